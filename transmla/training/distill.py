"""Recovery losses on final hidden states, chunked over tokens: next-token cross-entropy and
distillation from the original model (KL of the teacher's to the student's next-token distribution).

Neither loss ever holds [batch, tokens, vocab] logits: positions are taken `chunk` at a time, each
chunk's logits are made from the hidden states by the output head inside a checkpointed function
(recomputed in backward), so peak memory is one chunk's logits (chunk x vocab floats) whatever the
batch and block length. For SmolLM2 (vocab 49,152) a batch of 8 x 512 tokens in float32 would hold
805 MB of logits, plus as much again for their gradient and the softmax; with chunk = 1024, 201 MB.

    lm  = mean_t -log p_s(y_t | x_<t)
    kd  = tau^2 mean_t KL(softmax(z_t / tau) || softmax(s_t / tau))     z: teacher, s: student logits

tau^2 keeps the gradient's scale independent of the temperature (Hinton et al., 2015).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

OBJECTIVES = ("lm", "kd", "kd+lm")


def _chunk_sums(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, t_h: torch.Tensor | None,
                t_w: torch.Tensor | None, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (lm, kd) over one chunk. h [n, D], w [V, D], labels [n], t_h [n, Dt] (no grad), t_w [V, Dt]."""
    s = (h @ w.T).float()  # [n, V]
    lm = F.cross_entropy(s, labels, reduction="sum")
    if t_h is None:
        return lm, s.new_zeros(())
    with torch.no_grad():
        t_logp = F.log_softmax((t_h @ t_w.T).float() / tau, -1)
    kd = F.kl_div(F.log_softmax(s / tau, -1), t_logp, log_target=True, reduction="sum") * tau**2
    return lm, kd


def recovery_loss(hidden: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor, objective: str = "lm",
                  teacher_hidden: torch.Tensor | None = None, teacher_head: torch.Tensor | None = None,
                  tau: float = 1.0, kd_weight: float = 1.0, chunk: int = 1024) -> tuple[torch.Tensor, dict]:
    """The training loss of `objective` and its parts (floats, per predicted token; lm is reported
    for every objective: it costs nothing once the chunk's logits exist).

    hidden [B, T, D]: the student's final hidden states (after the final norm); head [V, D]: its
    output weight. input_ids [B, T]: position t predicts token t+1 (no padding: packed blocks).
    teacher_hidden [B, T, Dt], teacher_head [V, Dt]: the same for the teacher (kd objectives; no grad).
    kd+lm = kd_weight * kd + lm.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {OBJECTIVES}")
    use_kd = objective != "lm"
    if use_kd and (teacher_hidden is None or teacher_head is None):
        raise ValueError(f"objective {objective!r} needs the teacher's hidden states and head")
    D = hidden.shape[-1]
    h = hidden[:, :-1].reshape(-1, D)
    y = input_ids[:, 1:].reshape(-1)
    t_h = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).detach() if use_kd else None
    t_w = teacher_head.detach() if use_kd else None
    lm = kd = hidden.new_zeros((), dtype=torch.float32)
    for a in range(0, len(y), chunk):
        b = a + chunk
        args = (h[a:b], head, y[a:b], None if t_h is None else t_h[a:b], t_w, tau)
        if torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
            c_lm, c_kd = checkpoint(_chunk_sums, *args, use_reentrant=False)
        else:
            c_lm, c_kd = _chunk_sums(*args)
        lm, kd = lm + c_lm, kd + c_kd
    n = max(len(y), 1)
    lm, kd = lm / n, kd / n
    loss = {"lm": lm, "kd": kd, "kd+lm": kd_weight * kd + lm}[objective]
    return loss, {"lm": lm.item(), "kd": kd.item() if use_kd else None}

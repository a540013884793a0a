"""Recovery losses on final hidden states, chunked over tokens: next-token cross-entropy and
distillation from the original model (KL of the teacher's to the student's next-token distribution).

Neither loss ever holds [batch, tokens, vocab] logits: positions are taken `chunk` at a time, each
chunk's logits are made from the hidden states by the output head inside a checkpointed function
(recomputed in backward), so peak memory is one chunk's logits (chunk x vocab floats) whatever the
batch and block length. For SmolLM2 (vocab 49,152) a batch of 8 x 512 tokens in float32 would hold
805 MB of logits, plus as much again for their gradient and the softmax; with chunk = 1024, 201 MB.

    lm  = mean_t -log p_s(y_t | x_<t)
    kd  = tau^2 mean_t KL(softmax(z_t / tau) || softmax(s_t / tau))     z: teacher, s: student logits

tau^2 keeps the gradient's scale independent of the temperature (Hinton et al., 2015). A model with
final logit soft-capping (Gemma 2: logits c tanh(z / c)) has it applied to each chunk's logits, as
its own forward does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

OBJECTIVES = ("lm", "kd", "kd+lm")


def _softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else torch.tanh(z / cap) * cap


def _chunk_sums(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, t_h: torch.Tensor | None,
                t_w: torch.Tensor | None, tau: float, cap: float | None = None,
                t_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed (lm, kd) over one chunk. h [n, D], w [V, D], labels [n], t_h [n, Dt] (no grad), t_w [V, Dt];
    cap / t_cap: the student's / teacher's final logit soft-capping (None: none)."""
    s = _softcap((h @ w.T).float(), cap)  # [n, V]
    lm = F.cross_entropy(s, labels, reduction="sum")
    if t_h is None:
        return lm, s.new_zeros(())
    with torch.no_grad():
        t_logp = F.log_softmax(_softcap((t_h @ t_w.T).float(), t_cap) / tau, -1)
    kd = F.kl_div(F.log_softmax(s / tau, -1), t_logp, log_target=True, reduction="sum") * tau**2
    return lm, kd


def recovery_loss(hidden: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor, objective: str = "lm",
                  teacher_hidden: torch.Tensor | None = None, teacher_head: torch.Tensor | None = None,
                  tau: float = 1.0, kd_weight: float = 1.0, chunk: int = 1024, softcap: float | None = None,
                  teacher_softcap: float | None = None) -> tuple[torch.Tensor, dict]:
    """The training loss of `objective` and its parts (floats, per predicted token; lm is reported
    for every objective: it costs nothing once the chunk's logits exist).

    hidden [B, T, D]: the student's final hidden states (after the final norm); head [V, D]: its
    output weight. input_ids [B, T]: position t predicts token t+1 (no padding: packed blocks).
    teacher_hidden [B, T, Dt], teacher_head [V, Dt]: the same for the teacher (kd objectives; no grad).
    kd+lm = kd_weight * kd + lm. softcap / teacher_softcap: final logit soft-capping (config.final_logit_softcapping).
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
        args = (h[a:b], head, y[a:b], None if t_h is None else t_h[a:b], t_w, tau, softcap, teacher_softcap)
        if torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
            c_lm, c_kd = checkpoint(_chunk_sums, *args, use_reentrant=False)
        else:
            c_lm, c_kd = _chunk_sums(*args)
        lm, kd = lm + c_lm, kd + c_kd
    n = max(len(y), 1)
    lm, kd = lm / n, kd / n
    loss = {"lm": lm, "kd": kd, "kd+lm": kd_weight * kd + lm}[objective]
    return loss, {"lm": lm.item(), "kd": kd.item() if use_kd else None}


def relative_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||out - target||^2 / ||target||^2 in float32 (target: float32, no grad)."""
    return (out.float() - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-12)


class AttentionMatch:
    """Per-layer attention matching: the signal the conversion broke, at every layer.

    While active (`with match:` around the student's forward), each student decoder layer's attention
    output on its own input x_l is compared with the original (teacher) layer's attention on the same
    x_l (detached; the teacher runs without gradients):

        attn = mean_l ||A_l^mla(x_l) - A_l^gqa(x_l)||^2 / ||A_l^gqa(x_l)||^2

    a relative error, so every layer counts alike whatever its output's scale. The teacher's attention
    costs about a third of its forward; nothing else of the teacher runs for it. The hooks record only
    inside the `with` block, so activation checkpointing's recompute in backward adds no terms.
    """

    def __init__(self, student, teacher):
        s_layers, t_layers = student.model.layers, teacher.model.layers
        if len(s_layers) != len(t_layers):
            raise ValueError(f"student has {len(s_layers)} layers, teacher {len(t_layers)}")
        self.teacher = teacher
        self.terms: list[tuple[torch.Tensor, torch.Tensor]] = []  # (student output, teacher output) per layer
        self._active = False
        self._pe = None
        self._hooks = [s.self_attn.register_forward_hook(self._hook(t.self_attn), with_kwargs=True)
                       for s, t in zip(s_layers, t_layers)]

    def _hook(self, t_attn):
        def hook(module, args, kwargs, output):
            if not self._active:
                return
            x = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach()
            out = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                t_dtype = next(t_attn.parameters()).dtype
                xt = x.to(t_dtype)
                if self._pe is None:
                    pos = kwargs.get("position_ids")
                    if pos is None:
                        pos = torch.arange(x.shape[1], device=x.device)[None]
                    self._pe = self.teacher.model.rotary_emb(xt, pos)
                target = t_attn(hidden_states=xt, position_embeddings=self._pe,
                                attention_mask=kwargs.get("attention_mask"))[0].float()
            # the error itself is computed in loss(), outside the layer: inside an activation-checkpointed
            # layer it would save tensors that the recompute (hooks inactive) does not
            self.terms.append((out, target))
        return hook

    def __enter__(self):
        self.terms, self._pe, self._active = [], None, True
        return self

    def __exit__(self, *exc):
        self._active = False

    def loss(self) -> torch.Tensor:
        """The mean relative error over the layers recorded by the last `with` block."""
        if not self.terms:
            raise RuntimeError("no attention layer ran inside the `with` block")
        errs = [relative_error(out, t) for out, t in self.terms]
        self.terms = []  # the outputs' graphs are released with the loss
        return torch.stack(errs).mean()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

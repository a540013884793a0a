"""Recovery losses on final hidden states, chunked over tokens: next-token cross-entropy and
distillation from the original model (KL of the teacher's to the student's next-token distribution).

Neither loss ever holds [batch, tokens, vocab] logits: positions are taken `chunk` at a time, so
peak memory is a few chunks' logits (chunk x vocab floats) whatever the batch and block length. For
SmolLM2 (vocab 49,152) a batch of 8 x 512 tokens in float32 would hold 805 MB of logits, plus as much
again for their gradient and the softmax; with chunk = 1024, 201 MB each. When gradients are wanted,
each chunk's gradient with respect to its logits is known in closed form once its softmax is (below),
so it is taken straight to the hidden states and the head weight in the forward pass (`_FusedHeadLoss`,
as fused linear cross-entropy kernels do): nothing is recomputed in backward, neither the student's
logits nor the teacher's. Small chunks are faster on CPU: glibc serves an allocation above 32 MB with
a fresh mmap, page-faulted and zeroed on first touch, and a chunk makes a dozen logits-sized
temporaries. One kd+lm step of SmolLM2-135M at the 87.5% cut (8 x 512 tokens, 2 threads, measured
here): checkpointed chunks of 1,024 positions 55-68 s, 9.8 GiB peak RSS; fused, 1,024: 47-56 s;
fused, 128 (25 MB of logits): 43-47 s, 9.1 GiB. So on CPU `chunk` is a ceiling and the loss takes
at most `CPU_CHUNK_BYTES` of logits per chunk (160 positions for SmolLM2's vocabulary, 48 for Qwen2's).

    d lm / d s_t = softmax(s_t) - onehot(y_t)
    d kd / d s_t = tau (softmax(s_t / tau) - softmax(z_t / tau))
    soft-capped logits s = c tanh(u / c): d s / d u = 1 - (s / c)^2

    lm  = mean_t -log p_s(y_t | x_<t)
    kd  = tau^2 mean_t KL(softmax(z_t / tau) || softmax(s_t / tau))     z: teacher, s: student logits

tau^2 keeps the gradient's scale independent of the temperature (Hinton et al., 2015). A model with
final logit soft-capping (Gemma 2: logits c tanh(z / c)) has it applied to each chunk's logits, as
its own forward does.
"""

from __future__ import annotations

import torch

OBJECTIVES = ("lm", "kd", "kd+lm")
CPU_CHUNK_BYTES = 32 << 20  # glibc's largest mmap threshold: logits chunks below it reuse freed heap


def chunk_positions(chunk: int, vocab: int, device) -> int:
    """Positions per loss chunk: `chunk`, lowered on CPU so that a chunk's float32 logits fit in
    CPU_CHUNK_BYTES (a multiple of 16 positions, at least 16)."""
    if torch.device(device).type != "cpu":
        return chunk
    return min(chunk, max(16, CPU_CHUNK_BYTES // (4 * vocab) // 16 * 16))


def _softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else torch.tanh(z / cap) * cap


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
    chunk: the most positions whose logits are held at once (fewer on CPU: `chunk_positions`).
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
    n = max(len(y), 1)
    chunk = chunk_positions(chunk, head.shape[0], head.device)
    lm_coef, kd_coef = {"lm": (1.0, 0.0), "kd": (0.0, 1.0), "kd+lm": (1.0, kd_weight)}[objective]
    if torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
        loss, lm, kd = _FusedHeadLoss.apply(h, head, y, t_h, t_w, tau, lm_coef / n, kd_coef / n, chunk, softcap,
                                            teacher_softcap)
    else:  # evaluation: the same sums, no gradients
        lm, kd, _, _ = head_loss_sums(h, head, y, t_h, t_w, tau, 0.0, 0.0, chunk, softcap, teacher_softcap)
        loss = (lm_coef * lm + kd_coef * kd).float() / n
    return loss, {"lm": lm.item() / n, "kd": kd.item() / n if use_kd else None}


def head_loss_sums(h, w, y, t_h, t_w, tau: float, lm_coef: float, kd_coef: float, chunk: int, cap: float | None,
                   t_cap: float | None, want_h: bool = False, want_w: bool = False):
    """Summed cross-entropy and summed tau^2 KL (float64) over the chunks of h [N, D] through the head
    w [V, D] (labels y [N]; teacher t_h [N, Dt], t_w [V, Dt], or None), and, where wanted, the gradients
    of lm_coef * lm + kd_coef * kd with respect to h and w, accumulated chunk by chunk in closed form
    (module docstring). Returns (lm_sum, kd_sum, g_h or None, g_w or None)."""
    dt = torch.promote_types(h.dtype, torch.float32)  # the softmax in float32 at least
    grads = want_h or want_w
    g_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_h else None
    g_w = torch.zeros(w.shape, dtype=dt, device=w.device) if want_w else None
    lm_sum = torch.zeros((), dtype=torch.float64, device=h.device)
    kd_sum = torch.zeros((), dtype=torch.float64, device=h.device)
    for a in range(0, len(y), chunk):
        hc, yc = h[a : a + chunk], y[a : a + chunk]
        s = _softcap((hc @ w.T).to(dt), cap)  # [n, V]
        logp = torch.log_softmax(s, -1)
        lm_sum += -logp.gather(1, yc[:, None]).sum(dtype=torch.float64)
        if grads:
            g = logp.exp_()  # softmax(s), in place of logp
            if lm_coef:
                g.mul_(lm_coef)
                g[torch.arange(len(yc), device=g.device), yc] -= lm_coef
            else:
                g.zero_()
        del logp
        if t_h is not None:
            t_logp = torch.log_softmax(_softcap((t_h[a : a + chunk] @ t_w.T).to(dt), t_cap) / tau, -1)
            q_log = torch.log_softmax(s / tau, -1)
            p_t = t_logp.exp()
            kd_sum += tau**2 * (p_t * t_logp.sub_(q_log)).sum(dtype=torch.float64)
            if grads:  # + kd_coef tau (q - p_t), with q = softmax(s / tau)
                g.add_(q_log.exp_().sub_(p_t), alpha=kd_coef * tau)
            del t_logp, q_log, p_t
        if grads:
            if cap is not None:
                g.mul_(1 - (s / cap).square_())
            g = g.to(h.dtype)
            if want_h:
                torch.matmul(g, w.to(h.dtype), out=g_h[a : a + chunk])
            if want_w:
                g_w.addmm_(g.T.to(dt), hc.to(dt))
            del g
        del s
    return lm_sum, kd_sum, g_h, g_w


class _FusedHeadLoss(torch.autograd.Function):
    """lm_coef * (summed cross-entropy) + kd_coef * (summed tau^2 KL) over the chunks of h [N, D] through
    the head w [V, D], with its gradients with respect to h and w accumulated chunk by chunk in the
    forward pass (closed form, module docstring) and scaled by the incoming gradient in backward.
    Also returns the summed cross-entropy and KL (no gradient) for logging. Extra memory: one gradient
    of h and one of w, besides the chunk's temporaries."""

    @staticmethod
    def forward(ctx, h, w, y, t_h, t_w, tau, lm_coef, kd_coef, chunk, cap, t_cap):
        lm_sum, kd_sum, g_h, g_w = head_loss_sums(h, w, y, t_h, t_w, tau, lm_coef, kd_coef, chunk, cap, t_cap,
                                                  want_h=ctx.needs_input_grad[0], want_w=ctx.needs_input_grad[1])
        ctx.save_for_backward(g_h, g_w)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(lm_sum, kd_sum)
        loss = (lm_coef * lm_sum + kd_coef * kd_sum).to(torch.promote_types(h.dtype, torch.float32))
        return loss, lm_sum, kd_sum

    @staticmethod
    def backward(ctx, grad, _lm, _kd):
        g_h, g_w = ctx.saved_tensors  # None where that input needs no gradient
        return (None if g_h is None else g_h * grad.to(g_h.dtype), None if g_w is None else (g_w * grad).to(ctx.w_dtype),
                *[None] * 9)


def relative_error(out: torch.Tensor, target: torch.Tensor, per_block: bool = False) -> torch.Tensor:
    """||out - target||^2 / ||target||^2 in float32 (target: float32, no grad); per_block: one per
    leading-dim block, [batch]."""
    dims = tuple(range(1, target.dim())) if per_block else tuple(range(target.dim()))
    return (out.float() - target).pow(2).sum(dims) / target.pow(2).sum(dims).clamp_min(1e-12)


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
        """The mean relative error over the layers recorded by the last `with` block (the batch's sums)."""
        if not self.terms:
            raise RuntimeError("no attention layer ran inside the `with` block")
        errs = [relative_error(out, t) for out, t in self.terms]
        self.terms = []  # the outputs' graphs are released with the loss
        return torch.stack(errs).mean()

    def block_errors(self) -> torch.Tensor:
        """[batch]: each block's mean relative error over the recorded layers, without gradient.

        Validation scores blocks one by one (a run in several processes must, to drop the sampler's
        repeated blocks), so one process scores them the same way from one batched forward.
        """
        if not self.terms:
            raise RuntimeError("no attention layer ran inside the `with` block")
        with torch.no_grad():
            errs = [relative_error(out, t, per_block=True) for out, t in self.terms]
        self.terms = []
        return torch.stack(errs).mean(0)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

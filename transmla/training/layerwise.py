"""Layer-wise distillation: fit each converted attention layer to the original's, one layer at a time.

The conversion breaks the attention and nothing else, layer by layer; the end-to-end fine-tune sees
that damage only through the output head, one optimizer step per batch for the whole model. This
phase, run before it, trains each converted layer l's attention alone on the inputs the converted
(and already fitted) prefix produces, to reproduce the original layer's attention on those inputs:

    min_theta_l  sum_b ||A_l^mla(x_l; theta_l) - A_l^gqa(x_l)||^2 / ||A_l^gqa(x_l)||^2

x_l = RMSNorm_l(h_l), h_l the converted model's own residual stream at layer l; A^gqa runs without
gradients. Then h_{l+1} = converted layer l (fitted) on h_l, and the next layer. Like sequential
calibration (transmla.pipeline), it is one pass over the layers with the hidden states [N, T, D] held
(SmolLM2-135M, 240 blocks of 512 tokens: 283 MB in float32) plus the targets, and it costs one
layer's forward and backward per step: many steps per layer for what one end-to-end step costs. The
objective is the per-layer attention matching term of the end-to-end fine-tune
(distill.AttentionMatch), here optimised layer by layer to convergence instead of as a side loss.
"""

from __future__ import annotations

import math
import time

import torch

from transmla.training.distill import relative_error


def _call_layer(layer, h: torch.Tensor, pe) -> torch.Tensor:
    out = layer(h, position_embeddings=pe, attention_mask=None, use_cache=False)
    return out[0] if isinstance(out, tuple) else out


def _attention(layer, h: torch.Tensor, pe) -> torch.Tensor:
    """A decoder layer's attention output [b, T, D] on its residual input h [b, T, D] (pre-norm layers)."""
    x = layer.input_layernorm(h)
    return layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]


def layerwise_distill(student, teacher, train_ids: torch.Tensor, val_ids: torch.Tensor, epochs: float, lr: float,
                      batch_size: int, seed: int = 0, chunk: int = 16, log=None, schedule: str = "constant") -> dict:
    """Fit each of `student`'s attention layers (in place, in order) to `teacher`'s on the student's own stream.

    student: a converted MLA model whose identity latent norms are unfolded (finetune.unfold_latent_norms),
    so the latent is the projection's output. teacher: the original model (same layer count, no gradients;
    its dtype is kept, its outputs compared in float32). train_ids [N, T], val_ids [M, T]: token blocks
    (packed, no padding: attention is causal over each block). Per layer: ceil(epochs * N / batch_size) Adam
    steps at `lr` over the layer's attention weights in a seeded order; the relative error on `val_ids`
    (the held-out blocks, propagated alongside) before and after is recorded, and a layer whose held-out
    error did not fall is put back as it was. schedule: `constant` lr, or `cosine`: each layer's steps warm up
    linearly over their first tenth and decay to zero along a half cosine (Adam's first steps move every
    weight by about lr whatever its gradient, and a constant lr ends on a noisy iterate). Returns the record.
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"layer-wise schedule {schedule!r}: use constant or cosine")
    s_layers, t_layers = student.model.layers, teacher.model.layers
    if len(s_layers) != len(t_layers):
        raise ValueError(f"student has {len(s_layers)} layers, teacher {len(t_layers)}")
    dev = next(student.parameters()).device
    dtype = next(student.parameters()).dtype
    t_dtype = next(teacher.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    steps = max(1, math.ceil(epochs * len(train_ids) / batch_size))
    T = train_ids.shape[1]
    pos = torch.arange(T, device=dev)[None]
    t0 = time.perf_counter()
    with torch.no_grad():
        h = student.model.embed_tokens(train_ids.to(dev)).to(dtype)  # [N, T, D]: the converted stream
        hv = student.model.embed_tokens(val_ids.to(dev)).to(dtype)  # [M, T, D]
        pe = student.model.rotary_emb(h[:1], pos)
        t_pe = teacher.model.rotary_emb(h[:1].to(t_dtype), pos)

    def targets(t_layer, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32, device=dev)
        for i in range(0, len(x), chunk):
            out[i : i + chunk] = _attention(t_layer, x[i : i + chunk].to(t_dtype), t_pe).float()
        return out

    def val_err(s_layer, xv, tv) -> float:
        with torch.no_grad():
            num = sum((_attention(s_layer, xv[i : i + chunk], pe).float() - tv[i : i + chunk]).pow(2).sum().item()
                      for i in range(0, len(xv), chunk))
        return num / max(tv.pow(2).sum().item(), 1e-12)

    layers = []
    for idx, (s_layer, t_layer) in enumerate(zip(s_layers, t_layers)):
        with torch.no_grad():
            tgt, tgt_v = targets(t_layer, h), targets(t_layer, hv)
        before = val_err(s_layer, hv, tgt_v)
        params = [p for p in s_layer.self_attn.parameters() if p.is_floating_point()]
        start = [p.detach().clone() for p in params]
        was = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.Adam(params, lr=lr)
        order = torch.randperm(len(h), generator=gen)
        k = 0
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(schedule, step, steps)
            if k + batch_size > len(h):  # a new pass in a new order (the tail of the last one is dropped)
                order, k = torch.randperm(len(h), generator=gen), 0
            b = order[k : k + batch_size].to(dev)
            k += batch_size
            loss = relative_error(_attention(s_layer, h[b], pe), tgt[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for p, w in zip(params, was):
            p.requires_grad_(w)
            p.grad = None
        after = val_err(s_layer, hv, tgt_v)
        kept = after < before
        if not kept:  # Adam overshot (5 of SmolLM2's last 7 layers at lr 1e-3): the conversion's weights stay
            with torch.no_grad():
                for p, w in zip(params, start):
                    p.copy_(w)
        del tgt, tgt_v, opt, start
        with torch.no_grad():  # the fitted layer produces the next layer's input
            for x in (h, hv):
                for i in range(0, len(x), chunk):
                    x[i : i + chunk] = _call_layer(s_layer, x[i : i + chunk], pe)
        layers.append({"layer": idx, "val_err_before": round(before, 6), "val_err_after": round(min(after, before), 6),
                       "fitted": kept})
        if log is not None:
            log(f"layer-wise distillation: layer {idx}: held-out attention error {before:.4f} -> {after:.4f} "
                f"({'kept' if kept else 'not better: reverted'}; {time.perf_counter() - t0:.0f} s)")
    return {"epochs": epochs, "lr": lr, "schedule": schedule, "batch_size": batch_size, "steps_per_layer": steps,
            "tokens": int(train_ids.numel()), "seconds": round(time.perf_counter() - t0, 1), "layers": layers}


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The multiple of lr at step `step` (0-based) of `steps`: 1 (constant), or a linear warmup over the first
    tenth of the steps followed by a half cosine that reaches zero one step after the last (cosine: the last
    step still moves, by under 1% of lr from about 20 steps per layer on)."""
    if schedule == "constant":
        return 1.0
    warm = max(1, math.ceil(0.1 * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm + 1) / max(1, steps - warm + 1)))


def summary(record: dict | None) -> dict:
    """A layer-wise record in brief: passes, lr and its schedule, seconds, layers fitted, and the held-out attention error,
    mean over layers, before and after ({} when the phase did not run)."""
    if not record:
        return {}
    layers = record["layers"]
    n = max(len(layers), 1)
    return {"epochs": record["epochs"], "lr": record["lr"], "schedule": record.get("schedule", "constant"),
            "seconds": record.get("seconds"),
            "attn_err_before": round(sum(x["val_err_before"] for x in layers) / n, 4),
            "attn_err_after": round(sum(x["val_err_after"] for x in layers) / n, 4),
            "layers_fitted": sum(bool(x.get("fitted", True)) for x in layers), "layers": len(layers)}

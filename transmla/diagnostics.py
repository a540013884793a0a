"""Measurements on converted models (used by tests and reports)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def latent_norm_identity_error(model, input_ids: torch.Tensor) -> float:
    """Largest per-token relative error of kv_a_layernorm / q_a_layernorm against the identity they
    were built to be: out should equal in * w / sqrt(eps) (= the unscaled latent)."""
    worst = 0.0
    hooks = []

    def hook(mod, inp, out):
        nonlocal worst
        x = inp[0].double()
        ideal = x * mod.weight.double() / math.sqrt(mod.variance_epsilon)
        err = (out.double() - ideal).norm(dim=-1) / ideal.norm(dim=-1).clamp_min(1e-30)
        worst = max(worst, err.max().item())

    for layer in model.model.layers:
        for name in ("kv_a_layernorm", "q_a_layernorm"):
            mod = getattr(layer.self_attn, name, None)
            if mod is not None:
                hooks.append(mod.register_forward_hook(hook))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return worst

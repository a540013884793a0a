"""Measurements on converted models (used by tests and reports)."""

from __future__ import annotations

import math

import torch


def latent_norms(model):
    """(attention module, attribute name, norm) for every latent RMSNorm: kv_a_layernorm, and q_a_layernorm
    where it spans the q-LoRA latent (a Qwen3 / Gemma 3 export's q_a_layernorm is the original's query norm,
    one head wide, with its own eps: not a latent norm)."""
    ranks = {"kv_a_layernorm": model.config.kv_lora_rank, "q_a_layernorm": getattr(model.config, "q_lora_rank", None)}
    for layer in model.model.layers:
        for name, rank in ranks.items():
            norm = getattr(layer.self_attn, name, None)
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape[0] == rank:
                yield layer.self_attn, name, norm


def use_recorded_latent_norm_eps(model) -> float | None:
    """Set the eps of every kv_a_layernorm / q_a_layernorm of a transformers DeepseekV3 model to the one its
    latent-norm identities were built for (`config.transmla.latent_norm_eps`); transformers otherwise uses
    a fixed 1e-6. Returns the eps. A no-op for exports built for 1e-6 (the default); None, touching nothing,
    for a model that records no eps (not this package's export: an original, a genuine DeepSeek)."""
    meta = getattr(model.config, "transmla", None)
    if not isinstance(meta, dict) or meta.get("latent_norm_eps") is None:
        return None
    eps = float(meta["latent_norm_eps"])
    for _, _, norm in latent_norms(model):
        norm.variance_epsilon = eps
    return eps


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

    for _, _, mod in latent_norms(model):
        hooks.append(mod.register_forward_hook(hook))
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return worst


def key_dim_rms(wk: torch.Tensor, bk: torch.Tensor | None, xx: torch.Tensor, mu: torch.Tensor,
                T: torch.Tensor | None = None) -> torch.Tensor:
    """RMS of each merged-key coordinate over the calibration tokens, optionally after the RoRoPE
    rotation T (paper Fig. 4a). wk: [g*d, D]; returns [g*d]."""
    from transmla.method.linalg import affine_diag

    W = wk if T is None else T @ wk
    b = bk if (T is None or bk is None) else T @ bk
    return affine_diag(W, b, xx, mu).clamp_min(0).sqrt()


def kv_dim_rms(wk_nope: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension RMS of the NoPE keys (divided by the BKV alpha) and of the values (paper Fig. 5)."""
    from transmla.method.linalg import affine_diag

    return affine_diag(wk_nope, None, xx, xx.new_zeros(xx.shape[0])).clamp_min(0).sqrt() / alpha, \
        affine_diag(wv, None, xx, xx.new_zeros(xx.shape[0])).clamp_min(0).sqrt()


def key_norm_series(wk: torch.Tensor, bk: torch.Tensor | None, xx: torch.Tensor, mu: torch.Tensor,
                    rotations: dict) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Paper Fig. 4a: per-dimension key RMS of the original merged key and after each rotation
    ({label: KeyRotation}); returns (series, captured RoPE energy per rotation)."""
    series = {"original": key_dim_rms(wk, bk, xx, mu).tolist()}
    for label, rot in rotations.items():
        series[label] = key_dim_rms(wk, bk, xx, mu, rot.T).tolist()
    return series, {label: rot.energy for label, rot in rotations.items()}


def balance_norms(wk: torch.Tensor, wv: torch.Tensor, xx: torch.Tensor, rot, alpha: float) -> dict[str, list[float]]:
    """Paper Fig. 5: per-dimension RMS of the NoPE keys before and after dividing by the BKV alpha, and of the values."""
    wk_nope = rot.T[rot.rope_dim:] @ wk
    k_before, v = kv_dim_rms(wk_nope, wv, xx)
    k_after, _ = kv_dim_rms(wk_nope, wv, xx, alpha)
    return {"k_before": k_before.tolist(), "k_after": k_after.tolist(), "v": v.tolist()}

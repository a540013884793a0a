"""RoPE layouts and frequency bookkeeping.

HF Llama/Qwen2/Mistral use the *rotate_half* layout: in a head of dim d, dimension l (l < d/2) is the
real part and l + d/2 the imaginary part of the pair rotated at frequency theta_l = base^(-2l/d).
DeepSeek checkpoints with `rope_interleave: true` store pairs adjacently: (2p, 2p+1) = (re, im).

A *rope plan* says which original frequency index each pair p of the exported RoPE head carries.
Standard RoPE with head dim R and the same base carries base^(-2p/R) = theta_{p*c} for c = d/R: every
c-th original frequency (the "standard" plan, servable by any DeepSeek runtime). Other plans (e.g.
`lossless`, which repeats every frequency g times) need per-frequency factors (LongRoPE parameters,
transformers only).
"""

from __future__ import annotations

import torch

from transmla.errors import TransMLAError


def inv_freq(base: float, dim: int) -> torch.Tensor:
    """Original inverse frequencies theta_l = base^(-2l/dim), l < dim/2, float64. Shape [dim/2]."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def rope_attention_scaling(config, layer_type: str | None = None) -> float:
    """The factor transformers' RoPE multiplies cos and sin by for this layer type: YaRN's and LongRoPE's
    attention factor m (1 for the other types). Through a rotation that covers the whole head, the original
    scales every score dimension by m^2; an MLA head rotates only its RoPE part, so m^2 goes on its softmax
    scale and out of the gathered cos/sin (transmla.models' Gemma layers, pipeline.stream's simulation)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    rp = params[layer_type] if nested else params
    rtype = rp.get("rope_type", "default")
    if rtype == "default":
        return 1.0
    fn = ROPE_INIT_FUNCTIONS[rtype]
    _, factor = fn(config, None, layer_type=layer_type) if nested else fn(config, None)
    return float(factor)


def standard_plan(d: int, rope_dim: int) -> list[int]:
    """Frequency index of each pair of a standard RoPE head of dim `rope_dim`: [0, c, 2c, ...]."""
    if rope_dim <= 0 or rope_dim % 2 or d % rope_dim:
        raise TransMLAError(
            f"qk_rope_head_dim={rope_dim} must be even and divide the head dim d={d}.",
            f"choose one of {[d // c for c in range(1, d // 2 + 1) if d % c == 0 and (d // c) % 2 == 0]}.",
        )
    c = d // rope_dim
    return [p * c for p in range(rope_dim // 2)]


def lossless_plan(d: int, g: int) -> list[int]:
    """Every original frequency repeated g times: RoPE kept on all g*d merged key dims."""
    return [l for l in range(d // 2) for _ in range(g)]


def is_standard(plan: list[int], d: int) -> bool:
    R = 2 * len(plan)
    return d % R == 0 and plan == [p * (d // R) for p in range(R // 2)]


def longrope_parameters(plan: list[int], base: float, d: int, max_pos: int,
                        target: torch.Tensor | None = None) -> dict:
    """LongRoPE parameters making a RoPE head of dim 2*len(plan) carry exactly the planned frequencies
    (`target`, default the unscaled base^(-2 plan/d); pass a scaled model's own inverse frequencies).

    transformers computes inv_freq_p = 1 / (factor_p * base^(2p/R)); solve for factor_p.
    """
    R = 2 * len(plan)
    target = inv_freq(base, d)[plan] if target is None else target.to(torch.float64)
    natural = inv_freq(base, R)
    factors = (natural / target).tolist()
    return {
        "rope_type": "longrope",
        "rope_theta": base,
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": max_pos,
    }


def interleave_index(rope_dim: int) -> torch.Tensor:
    """Row index turning a rotate_half-layout RoPE block into the interleaved layout.

    new[2p] = old[p] (real), new[2p+1] = old[p + R/2] (imaginary).
    """
    half = rope_dim // 2
    idx = torch.empty(rope_dim, dtype=torch.long)
    idx[0::2] = torch.arange(half)
    idx[1::2] = torch.arange(half) + half
    return idx

"""A faster causal attention for evaluating exported DeepSeek-V3 models on unpadded windows.

DeepSeek's value head (d) is narrower than its query/key head (d + R); torch's SDPA then falls
back to its slow "math" kernel on CPU (2x slower end to end on SmolLM2). Zero-padding the values to
the key width keeps the fused kernel and gives identical outputs after slicing. Only valid without
padding masks (perplexity windows, single-sequence generation), so it is opt-in (sliding-window layers
pass their window and get it):
`use_causal_padded_sdpa(model)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "causal_padded_sdpa"


def causal_padded_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [b, h, t, d+R], key [b, h or g, t, d+R], value [b, h or g, t, d] -> ([b, t, h, d], None)."""
    dv = value.shape[-1]
    if kwargs.get("softcap") is not None:  # Gemma 2: SDPA has no soft-capping; its own eager kernel has
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        return eager_attention_forward(module, query, key, value, _window_mask(query, key, kwargs.get("sliding_window")),
                                       dropout=0.0, scaling=scaling, softcap=kwargs["softcap"])[0], None
    if dv < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - dv))
    gqa = query.shape[1] != key.shape[1]  # GQA models (the originals) share K/V heads
    tq, tk = query.shape[-2], key.shape[-2]
    window = kwargs.get("sliding_window")  # a sliding layer (Gemma 3): key j visible from query i while i - j < window
    if window is not None and tk > window:
        ones = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
        mask, causal = ones.tril(tk - tq) & ~ones.tril(tk - tq - window), False
    elif tq == tk:
        mask, causal = None, True
    elif tq == 1:
        mask, causal = None, False  # one decode step: the last position sees every cached key
    else:
        # queries after a cache (chunked prefill): SDPA's is_causal aligns the mask top-left, the
        # cache needs it bottom-right
        mask, causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq), False
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                         enable_gqa=gqa)
    return out[..., :dv].transpose(1, 2).contiguous(), None


def _window_mask(query, key, window: int | None) -> torch.Tensor:
    """Additive causal mask [tq, tk] (bottom-right aligned), limited to the last `window` keys if given."""
    tq, tk = query.shape[-2], key.shape[-2]
    ones = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
    visible = ones.tril(tk - tq) & (~ones.tril(tk - tq - window) if window is not None else ones)
    return torch.zeros(tq, tk, dtype=query.dtype, device=query.device).masked_fill(~visible, float("-inf"))


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_padded_sdpa)
    return NAME


def use_causal_padded_sdpa(model):
    model.config._attn_implementation = register()
    return model

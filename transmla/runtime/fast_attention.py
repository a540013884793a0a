"""A faster causal attention for evaluating exported DeepSeek-V3 models on unpadded windows.

DeepSeek's value head (d) is narrower than its query/key head (d + R); torch's SDPA then falls
back to its slow "math" kernel on CPU (2x slower end to end on SmolLM2). Zero-padding the values to
the key width keeps the fused kernel and gives identical outputs after slicing. Registered with SDPA's
mask function, so transformers builds a mask wherever one is needed (padding, a static cache's unwritten
slots, sliding windows) and skips it where causal order alone says it all (unpadded windows: the fused
causal kernel). Opt-in: `use_causal_padded_sdpa(model)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "causal_padded_sdpa"


def causal_padded_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [b, h, t, d+R], key [b, h or g, t, d+R], value [b, h or g, t, d] -> ([b, t, h, d], None).
    attention_mask: SDPA's boolean mask [b, 1, t, T] (True: visible), or None where causal order is all."""
    dv = value.shape[-1]
    tq, tk = query.shape[-2], key.shape[-2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :tk]
    if kwargs.get("softcap") is not None:  # Gemma 2: SDPA has no soft-capping; its own eager kernel has
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        # finfo.min, not -inf, as transformers' eager masks: a padding query that sees no key then gets a finite
        # (uniform) softmax, not NaN, which the next layer would carry into its row's real tokens (0 x NaN)
        additive = _causal_mask(query, key, kwargs.get("sliding_window")) if attention_mask is None else \
            torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager_attention_forward(module, query, key, value, additive, dropout=0.0, scaling=scaling,
                                       softcap=kwargs["softcap"])[0], None
    if dv < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - dv))
    gqa = query.shape[1] != key.shape[1]  # GQA models (the originals) share K/V heads
    window = kwargs.get("sliding_window")  # a sliding layer (Gemma 3): key j visible from query i while i - j < window
    if attention_mask is not None:  # transformers' own: padding, a static cache's empty slots, the window
        mask, causal = attention_mask, False
    elif window is not None and tk > window:
        ones = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
        mask, causal = ones.tril(tk - tq) & ~ones.tril(tk - tq - window), False
    else:
        # transformers leaves the mask out (sdpa_mask's skip) only where causal order says it all, as for its own
        # SDPA: one query (it sees every cached key), as many queries as keys, or a prefill into an empty static
        # cache, whose unwritten slots SDPA's top-left aligned is_causal keeps out
        mask, causal = None, tq > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, scale=scaling,
                                         enable_gqa=gqa)
    return out[..., :dv].transpose(1, 2).contiguous(), None


def _causal_mask(query, key, window: int | None) -> torch.Tensor:
    """The additive mask [tq, tk] where transformers passed none, i.e. where causal order says it all (as SDPA's
    is_causal above): one query sees every key; several are aligned top-left (as many queries as keys, or a
    prefill into an empty static cache, whose unwritten slots stay out), limited to the last `window` keys."""
    tq, tk = query.shape[-2], key.shape[-2]
    ones = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
    if tq == 1:
        visible = ones
    else:
        visible = ones.tril() & (~ones.tril(-window) if window is not None else ones)
    return torch.zeros(tq, tk, dtype=query.dtype, device=query.device).masked_fill(~visible,
                                                                                   torch.finfo(query.dtype).min)


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, causal_padded_sdpa)
    # without a mask function of its own, transformers passed attention_mask=None for this name whatever the
    # padding or cache (a static cache's decode step then attended to its unwritten slots)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_causal_padded_sdpa(model):
    model.config._attn_implementation = register()
    return model

"""Merge the KV heads into one latent head (paper section 4.1): exact.

A GQA layer has g KV heads of dim d; query head i (of h) attends with KV head j = kv_group(i).
Stacking the g key heads gives ONE key of width g*d, k = W_K x + b_K (W_K is already stored that
way, [g*d, D]); query head i reads its group's block through the selector E_j [g*d, d]:

    q_i . k_j = (E_j q_i) . k          v_j = E_j^T v

so every later step (RoRoPE's rotation T of the merged key, the BKV latent) works on one head and
each query head keeps exactly its original scores. `merged_query` is E_j: the zero-padded embedding
of a query head into the merged key's coordinates.
"""

from __future__ import annotations

import torch


def kv_group(i: int, h: int, g: int) -> int:
    """The KV head that query head i attends with (GQA: h // g consecutive query heads per group)."""
    return i // (h // g)


def kv_block(i: int, h: int, g: int, d: int) -> slice:
    """Rows of the merged key (width g*d) that query head i reads: its group's block."""
    j = kv_group(i, h, g)
    return slice(j * d, (j + 1) * d)


def merged_query(q: torch.Tensor, i: int, h: int, g: int, d: int) -> torch.Tensor:
    """E_j q_i: query head i [..., d] embedded in the merged key's coordinates [..., g*d], so that
    merged_query(q_i) . k = q_i . k_j for the merged key k."""
    out = q.new_zeros(*q.shape[:-1], g * d)
    out[..., kv_block(i, h, g, d)] = q
    return out

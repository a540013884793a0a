"""The MHA2MLA baseline (Ji et al., github.com/JT-Ushio/MHA2MLA), at the same KV budget.

Partial RoPE by 2-norm selection (their `2_norm.py`): the score of frequency l of KV head i is
sum over the query heads of its group of ||q pair l|| * ||k pair l||; the top frequencies keep RoPE.
NoPE keys and values are then compressed by a joint SVD of the WEIGHTS (no activations, no
balancing) - see `bkv.joint_basis(..., pca="weights")` with alpha = 1.

DeepSeek-V3 checkpoints have ONE shared RoPE key whose pair p rotates at frequency plan[p]
(every c-th original frequency, c = d/R). We therefore keep MHA2MLA's criterion but pick, for every
RoPE pair p, the best-scoring (KV head, frequency) among the c frequencies [plan[p], plan[p] + c) of
its window; that pair is rotated at plan[p]. Norms are root-mean-square over the calibration tokens
(computable from the second moments) where MHA2MLA uses plain means.
"""

from __future__ import annotations

import torch

from transmla.method.linalg import affine_diag
from transmla.method.rope import is_standard
from transmla.method.rorope import KeyRotation


def pair_rms(diag: torch.Tensor, n_heads: int, d: int) -> torch.Tensor:
    """RMS norm of each (head, frequency) pair from the diagonal of a second moment. [n_heads, d/2]"""
    v = diag.view(n_heads, 2, d // 2)  # rotate_half: (real half, imaginary half)
    return (v[:, 0] + v[:, 1]).clamp_min(0).sqrt()


def two_norm_scores(wq, bq, wk, bk, xx, mu, h: int, g: int, d: int) -> torch.Tensor:
    """Score of every (KV head, frequency): sum_{q heads of the group} rms(q pair) * rms(k pair). [g, d/2]"""
    q = pair_rms(affine_diag(wq, bq, xx, mu), h, d)  # [h, d/2]
    k = pair_rms(affine_diag(wk, bk, xx, mu), g, d)  # [g, d/2]
    return (q.view(g, h // g, d // 2) * k[:, None]).sum(1)


def mha2mla_selection(scores: torch.Tensor, g: int, d: int, plan: list[int]) -> KeyRotation:
    """A permutation T of the merged key: the selected pairs become the RoPE rows, the rest NoPE."""
    half, L, R = d // 2, g * d, 2 * len(plan)
    c = d // R if is_standard(plan, d) else 1  # width of each RoPE pair's frequency window
    T = torch.zeros(L, L, dtype=torch.float64)
    used: set[int] = set()
    kept = 0.0
    for p, l0 in enumerate(plan):
        window = [(i, l) for i in range(g) for l in range(l0, min(l0 + c, half)) if i * d + l not in used]
        i, l = max(window, key=lambda il: scores[il[0], il[1]].item())
        T[p, i * d + l] = 1.0
        T[R // 2 + p, i * d + l + half] = 1.0
        used.add(i * d + l)
        kept += scores[i, l].item()
    row = R
    for i in range(g):
        for l in range(half):
            if i * d + l in used:
                continue
            T[row, i * d + l] = 1.0
            T[row + 1, i * d + l + half] = 1.0
            row += 2
    assert row == L
    return KeyRotation(T=T, plan=list(plan), energy=kept / scores.sum().item())

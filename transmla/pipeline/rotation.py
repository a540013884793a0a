"""Step: which merged-key coordinates keep RoPE (paper 4.2): RoRoPE + FreqFold, or MHA2MLA's 2-norm pick."""

from __future__ import annotations

import torch

from transmla.adapters import AttentionWeights, GQASpec
from transmla.method.calibration import LayerMoments
from transmla.method.linalg import affine_second_moment
from transmla.method.merge import kv_block
from transmla.method.mha2mla import mha2mla_selection, two_norm_scores
from transmla.method.rorope import KeyRotation, rorope


def merged_query_moment(w: AttentionWeights, m: LayerMoments, spec: GQASpec) -> torch.Tensor:
    """sum_i E[(E_j q_i)(E_j q_i)^T]: every query head's second moment in its group's block of the merged key. [g d, g d]"""
    h, g, d = spec.h, spec.g, spec.d
    Q = torch.zeros(g * d, g * d, dtype=torch.float64)
    for i in range(h):
        blk = kv_block(i, h, g, d)
        bq = None if w.bq is None else w.bq[i * d : (i + 1) * d]
        Q[blk, blk] += affine_second_moment(w.wq[i * d : (i + 1) * d], bq, m.xx, m.mean)
    return Q


def rotation_step(w: AttentionWeights, m: LayerMoments, spec: GQASpec, plan: list[int], method: str,
                  freqfold: int, rorope_metric: str = "key") -> KeyRotation:
    """The orthogonal basis change T of the merged key and its RoPE rows (options: ConvertOptions.rotation_options)."""
    if method == "mha2mla":
        scores = two_norm_scores(w.wq, w.bq, w.wk, w.bk, m.xx, m.mean, spec.h, spec.g, spec.d)
        return mha2mla_selection(scores, spec.g, spec.d, list(plan))
    cov_k = affine_second_moment(w.wk, w.bk, m.xx, m.mean)  # E[k k^T] of the merged key (4.1)
    cov_q = merged_query_moment(w, m, spec) if rorope_metric == "query" else None
    return rorope(cov_k, spec.g, spec.d, list(plan), freqfold, cov_q)

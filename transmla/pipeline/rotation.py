"""Step: which merged-key coordinates keep RoPE (paper 4.2): RoRoPE + FreqFold, or MHA2MLA's 2-norm pick."""

from __future__ import annotations

from transmla.adapters import AttentionWeights, GQASpec
from transmla.method.calibration import LayerMoments
from transmla.method.linalg import affine_second_moment
from transmla.method.mha2mla import mha2mla_selection, two_norm_scores
from transmla.method.rorope import KeyRotation, rorope


def rotation_step(w: AttentionWeights, m: LayerMoments, spec: GQASpec, plan: list[int], method: str,
                  freqfold: int) -> KeyRotation:
    """The orthogonal basis change T of the merged key and its RoPE rows (options: ConvertOptions.rotation_options)."""
    if method == "mha2mla":
        scores = two_norm_scores(w.wq, w.bq, w.wk, w.bk, m.xx, m.mean, spec.h, spec.g, spec.d)
        return mha2mla_selection(scores, spec.g, spec.d, list(plan))
    cov_k = affine_second_moment(w.wk, w.bk, m.xx, m.mean)  # E[k k^T] of the merged key (4.1)
    return rorope(cov_k, spec.g, spec.d, list(plan), freqfold)

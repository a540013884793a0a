"""Step: the latent basis (paper 4.3): BKV alpha + joint PCA of [k_nope/alpha ; v] (MHA2MLA: weight SVD)."""

from __future__ import annotations

from transmla.adapters import AttentionWeights, GQASpec
from transmla.method.bkv import JointBasis, attention_metrics, bkv_alpha, joint_basis
from transmla.method.calibration import LayerMoments
from transmla.method.rorope import KeyRotation


def basis_step(w: AttentionWeights, m: LayerMoments, spec: GQASpec, rot: KeyRotation, rank: int, method: str,
               balance_kv: bool, pca: str, attention_aware: bool) -> JointBasis:
    """alpha and P [(g*d - R) + g*d, rank] (options: ConvertOptions.basis_options)."""
    wk_nope = rot.T[rot.rope_dim :] @ w.wk
    if method == "mha2mla":
        return joint_basis(wk_nope, w.wv, None, rank, 1.0, "weights")
    mk = mv = None
    if attention_aware and wk_nope.shape[0] > 0:
        mk, mv = attention_metrics(w, rot.query_T, rot.rope_dim, m.xx, m.mean, spec.h, spec.g, spec.d)
    alpha = 1.0
    if balance_kv and wk_nope.shape[0] > 0:
        alpha = bkv_alpha(wk_nope if mk is None else mk @ wk_nope, w.wv if mv is None else mv @ w.wv, m.xx)
    return joint_basis(wk_nope, w.wv, m.xx, rank, alpha, pca, mk, mv)

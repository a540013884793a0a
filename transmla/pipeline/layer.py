"""Step: one DeepSeek-V3 attention layer from (rotation, basis) (paper 4.1-4.3 assembled, method.mla)."""

from __future__ import annotations

from transmla.adapters import AttentionWeights, GQASpec
from transmla.method.bkv import JointBasis
from transmla.method.calibration import LayerMoments
from transmla.method.mla import MLALayer, build_mla_layer
from transmla.method.rorope import KeyRotation


def layer_step(w: AttentionWeights, m: LayerMoments, spec: GQASpec, rot: KeyRotation, basis: JointBasis,
               q_lora_rank: int | None, norm_eps: float) -> tuple[MLALayer, dict]:
    """The MLA layer and its diagnostics (alpha, captured energies, norm scales)."""
    return build_mla_layer(w, rot, basis, spec.h, spec.g, spec.d, m.xx, m.mean, q_lora_rank, norm_eps)

"""Step: one DeepSeek-V3 attention layer from (rotation, basis) (paper 4.1-4.3 assembled, method.mla)."""

from __future__ import annotations

from dataclasses import replace

from transmla.adapters import AttentionWeights, GQASpec
from transmla.method.bkv import JointBasis
from transmla.method.calibration import LayerMoments
from transmla.method.mla import MLALayer, build_mla_layer, check_finite, head_value_bias
from transmla.method.refit import RefitMoments, refit_output
from transmla.method.rorope import KeyRotation


def layer_step(w: AttentionWeights, m: LayerMoments, spec: GQASpec, rot: KeyRotation, basis: JointBasis,
               q_lora_rank: int | None, norm_eps: float) -> tuple[MLALayer, dict]:
    """The MLA layer and its diagnostics (alpha, captured energies, norm scales)."""
    return build_mla_layer(w, rot, basis, spec.h, spec.g, spec.d, m.xx, m.mean, q_lora_rank, norm_eps)


def value_bias(w: AttentionWeights, spec: GQASpec):
    """The value bias per query head [h d] (None without one): the refit's targets exclude it (it moves to o_proj)."""
    return head_value_bias(w.bv, spec.h, spec.g, spec.d)


def refit_step(layer: MLALayer, blocks: list[RefitMoments], spec: GQASpec, damp: float) -> tuple[MLALayer, dict]:
    """The layer with o_proj and kv_b_proj's value rows W_UV refit jointly by least squares (method.refit),
    and the fit's diagnostics."""
    h, d = spec.h, spec.d
    kv_b = layer.kv_b_proj.view(h, 2 * d, -1).clone()
    o_proj, w_uv, diag = refit_output(blocks, layer.o_proj, kv_b[:, d:], damp)
    kv_b[:, d:] = w_uv
    out = replace(layer, kv_b_proj=kv_b.reshape(2 * h * d, -1), o_proj=o_proj)
    check_finite(out, "refit")
    return out, diag

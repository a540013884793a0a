"""Step 3, per layer: balanced-KV joint PCA (alpha and the basis of [k_nope/alpha ; v]) at one rank.

Cached per layer on (model, statistics, rotation, rank, ConvertOptions.basis_options()).
"""

from __future__ import annotations

from transmla.adapters import attention_weights
from transmla.method.bkv import JointBasis
from transmla.pipeline.basis import basis_step

from .artifacts import cached_task, load_tensors, save_tensors
from .calibrate import stats_of
from .model import load, spec_of
from .rorope import rotation_of


@cached_task("layer_basis")
def layer_basis(model: dict, stats: dict, rotation: dict, layer: int, rank: int, method: str, balance_kv: bool,
                pca: str, attention_aware: bool) -> dict:
    w = attention_weights(load(model["path"])[0], layer)
    basis = basis_step(w, stats_of(stats).moments(layer), spec_of(model), rotation_of(rotation), rank, method,
                       balance_kv, pca, attention_aware)
    return save_tensors("basis", basis.to_tensors())


def basis_of(ref: dict) -> JointBasis:
    return JointBasis.from_tensors(load_tensors(ref))

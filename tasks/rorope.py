"""Step 2, per layer: which merged-key coordinates keep RoPE (RoRoPE + FreqFold, or MHA2MLA's 2-norm pick).

Cached per layer on (model, statistics, RoPE plan, ConvertOptions.rotation_options()): another KV
rank at the same RoPE dim reuses it.
"""

from __future__ import annotations

from transmla.adapters import attention_weights
from transmla.method.rorope import KeyRotation
from transmla.pipeline.rotation import rotation_step

from .artifacts import cached_task, load_tensors, save_tensors
from .calibrate import stats_of
from .model import load, spec_of


@cached_task("layer_rotation")
def layer_rotation(model: dict, stats: dict, layer: int, plan: list[int], method: str, freqfold: int,
                   rorope_metric: str) -> dict:
    w = attention_weights(load(model["path"])[0], layer)
    rot = rotation_step(w, stats_of(stats).moments(layer), spec_of(model), plan, method, freqfold,
                        rorope_metric)
    return save_tensors("rotation", rot.to_tensors())


def rotation_of(ref: dict) -> KeyRotation:
    return KeyRotation.from_tensors(load_tensors(ref))

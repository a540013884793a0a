"""Stage 2, per layer: which merged-key coordinates keep RoPE (RoRoPE + FreqFold, or MHA2MLA's 2-norm pick).

Cached per layer on (model, statistics, method, RoPE plan, FreqFold): a different KV rank reuses it.
"""

from __future__ import annotations

import torch

from transmla.adapters import attention_weights, read_spec
from transmla.convert import Budget, ConvertOptions, layer_rotation as _layer_rotation
from transmla.method.rorope import KeyRotation

from .artifacts import cached_task, load_tensors, save_tensors
from .calibrate import stats_of
from .model import load

CODE = ("transmla/method/rorope.py", "transmla/method/mha2mla.py", "transmla/method/rope.py", "transmla/method/linalg.py", "transmla/adapters.py")


@cached_task("layer_rotation", code=CODE)
def layer_rotation(model: dict, stats: dict, layer: int, method: str, plan: list[int], freqfold: int) -> dict:
    m, _ = load(model["path"])
    spec = read_spec(m.config)
    o = ConvertOptions(method=method, freqfold=freqfold)
    budget = Budget(tuple(plan), 1, 2 * spec.g * spec.d)  # rank is irrelevant to the rotation
    rot = _layer_rotation(attention_weights(m, layer), stats_of(stats), layer, spec, budget, o)
    return save_tensors("rotation", {"T": rot.T}, {"plan": list(rot.plan), "energy": float(rot.energy)})


def rotation_of(ref: dict) -> KeyRotation:
    t, meta = load_tensors(ref)
    return KeyRotation(t["T"].to(torch.float64), list(meta["plan"]), float(meta["energy"]))

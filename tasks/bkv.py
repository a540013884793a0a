"""Stage 3, per layer: balanced-KV joint PCA (alpha and the basis of [k_nope/alpha ; v]) at one rank."""

from __future__ import annotations

from transmla.adapters import attention_weights, read_spec
from transmla.method.bkv import JointBasis
from transmla.convert import Budget, ConvertOptions, layer_basis as _layer_basis

from .artifacts import cached_task, load_tensors, save_tensors
from .calibrate import stats_of
from .model import load
from .rorope import rotation_of

CODE = ("transmla/method/bkv.py", "transmla/method/linalg.py", "transmla/adapters.py")


@cached_task("layer_basis", code=CODE)
def layer_basis(model: dict, stats: dict, rotation: dict, layer: int, method: str, kv_lora_rank: int,
                balance_kv: bool = True, pca: str = "activations", attention_aware: bool = False) -> dict:
    m, _ = load(model["path"])
    spec = read_spec(m.config)
    rot = rotation_of(rotation)
    o = ConvertOptions(method=method, balance_kv=balance_kv, pca=pca, attention_aware=attention_aware)
    budget = Budget(tuple(rot.plan), kv_lora_rank, 2 * spec.g * spec.d)
    b = _layer_basis(attention_weights(m, layer), stats_of(stats), layer, spec, rot, budget, o)
    tensors = {"P": b.P}
    if b.metric_k is not None:
        tensors.update(metric_k=b.metric_k, metric_v=b.metric_v)
    return save_tensors("basis", tensors, {"alpha": float(b.alpha), "energy": float(b.energy)})


def basis_of(ref: dict) -> JointBasis:
    t, meta = load_tensors(ref)
    return JointBasis(float(meta["alpha"]), t["P"], float(meta["energy"]), t.get("metric_k"), t.get("metric_v"))

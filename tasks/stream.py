"""Steps 1-3 in one task for layer-streamed conversions (calibration: sequential | two_pass, or refit):
layer l's statistics depend on the converted layers before it, so the layers are computed in order
over one stream of the calibration set's hidden states (transmla.pipeline.stream).

Cached on (model, calibration data and sizes, statistics when the mode uses them, RoPE plan, rank,
options); the result is every layer's MLA weights (float64) and diagnostics.
"""

from __future__ import annotations

from transmla.config import ConvertOptions
from transmla.convert import convert_layers
from transmla.method.calibration import mixed_calibration_ids
from transmla.method.mla import MLALayer
from transmla.pipeline.budget import Budget
from transmla.pipeline.stream import LayerStream

from .artifacts import cached_task, load_tensors, save_json, save_tensors
from .calibrate import stats_of
from .model import calibration_texts, load, spec_of


@cached_task("streamed_layers")
def streamed_layers(model: dict, data: dict, stats: dict | None, plan: list[int], rank: int, options: dict) -> dict:
    """Refs to the MLA layers (safetensors, `layers.<i>.<param>`) and their diagnostics (JSON)."""
    o = ConvertOptions(**options)
    m, tok = load(model["path"])
    spec = spec_of(model)
    ids = mixed_calibration_ids(tok, calibration_texts(data), o.cal_nsamples, o.cal_seqlen, o.seed)
    stream = LayerStream(m, ids, o.cal_batch_size, progress=False)
    budget = Budget.of(spec, plan, rank)
    layers, diags = convert_layers(m, stats_of(stats) if stats else None, spec, budget, o, False, stream)
    tensors = {f"layers.{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.to_tensors().items()}
    return {"layers": save_tensors("layers", tensors),
            "diags": save_json("diags", {"layers": diags, "calibration_tokens": ids.numel()})}


def layers_of(ref: dict, n_layers: int) -> list[MLALayer]:
    t = load_tensors(ref["layers"])
    return [MLALayer.from_tensors({k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"layers.{i}.")})
            for i in range(n_layers)]

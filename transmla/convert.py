"""GQA -> MLA conversion: the pipeline's steps (transmla.pipeline) run in memory, source to checkpoint.

    stats  = collect_stats(model, calibration ids)          one forward pass (method.calibration)
    budget = resolve_budget(spec, options)
    per layer l (moments = stats.moments(l)):
      rot    = rotation_step  -> basis = basis_step  -> layer = layer_step
    config, state dict = assemble(...)  -> io.export.write_checkpoint

The Prefect tasks (tasks/) run the very same step functions one at a time, cached.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from transmla.adapters import GQASpec, attention_weights, read_spec
from transmla.config import ConvertOptions
from transmla.method.calibration import CalibrationStats, LayerMoments, calibration_ids, collect_stats
from transmla.method.mla import MLALayer
from transmla.pipeline.assemble import assemble, conversion_metadata
from transmla.pipeline.basis import basis_step
from transmla.pipeline.budget import Budget, resolve_budget
from transmla.pipeline.layer import layer_step
from transmla.pipeline.rotation import rotation_step

__all__ = ["Budget", "ConvertOptions", "assemble", "convert", "convert_layers", "resolve_budget"]


def convert_layers(model, moments: CalibrationStats | Callable[[int], LayerMoments], spec: GQASpec, budget: Budget,
                   o: ConvertOptions, progress: bool = True) -> tuple[list[MLALayer], list[dict]]:
    """Every layer's MLA weights and diagnostics.

    `moments(l)` gives layer l's input moments; it is called in layer order, after layers < l were
    converted, so a layer-by-layer calibration can feed it the converted prefix's activations.
    """
    moments_of = moments.moments if isinstance(moments, CalibrationStats) else moments
    n = o.normalized()
    layers, diags = [], []
    for i in tqdm(range(spec.n_layers), desc="convert", file=sys.stderr, disable=not progress):
        w, m = attention_weights(model, i), moments_of(i)
        rot = rotation_step(w, m, spec, list(budget.plan), **n.rotation_options())
        basis = basis_step(w, m, spec, rot, budget.kv_lora_rank, **n.basis_options())
        layer, diag = layer_step(w, m, spec, rot, basis, o.q_lora_rank, o.norm_eps)
        layers.append(layer)
        diags.append(diag)
    return layers, diags


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def convert(source: str, out: str | Path, o: ConvertOptions, cache=None, data_dir=None, progress=True) -> dict:
    """Load `source`, calibrate, convert, export to `out`. Returns the conversion record plus timings
    (the timings stay out of the checkpoint, so identical conversions give identical checkpoints)."""
    from transmla.io.data import load_texts
    from transmla.io.export import write_checkpoint
    from transmla.io.paths import new_output_dir
    from transmla.io.sources import load_model, source_info

    t0 = time.perf_counter()
    out = new_output_dir(out)  # fail before any work
    info = source_info(source, cache)
    model, tok = load_model(source, dtype="float32", device=o.device, cache=cache)  # the math runs in fp32/fp64
    spec = read_spec(model.config)
    budget = resolve_budget(spec, o)
    ids = calibration_ids(tok, load_texts(o.cal_dataset, data_dir), o.cal_nsamples, o.cal_seqlen, o.seed)
    t_cal = time.perf_counter()
    stats = collect_stats(model, ids, o.cal_batch_size, progress)
    cal_seconds = time.perf_counter() - t_cal
    layers, diags = convert_layers(model, stats, spec, budget, o, progress)
    metadata = conversion_metadata(info, spec, budget, o, diags, stats.n)
    config, sd = assemble(model, spec, budget, layers, o)
    write_checkpoint(out, config, sd, tok, metadata)
    return {**metadata, "calibration_seconds": round(cal_seconds, 2), "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_gib": round(peak_rss_gib(), 3)}

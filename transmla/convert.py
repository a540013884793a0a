"""GQA -> MLA conversion: the pipeline's steps (transmla.pipeline) run in memory, source to checkpoint.

    stats  = collect_stats(model, calibration ids)          one forward pass (method.calibration)
    budget = resolve_budget(spec, options)
    per layer l (moments = stats.moments(l)):
      rot    = rotation_step  -> basis = basis_step  -> layer = layer_step
    config, state dict = assemble(...)  -> io.export.write_checkpoint

The Prefect tasks (tasks/) run the very same step functions one at a time, cached.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transmla.adapters import GQASpec, attention_weights, read_spec
from transmla.config import REFIT_DAMP, REFIT_MAX_DIM, ConvertOptions
from transmla.method.calibration import CalibrationStats, collect_stats, mixed_calibration_ids
from transmla.method.mla import MLALayer
from transmla.method.qknorm import rebase_query
from transmla.pipeline.assemble import assemble, conversion_metadata
from transmla.pipeline.basis import basis_step
from transmla.pipeline.budget import Budget, resolve_budget
from transmla.pipeline.layer import layer_step, refit_step, value_bias
from transmla.pipeline.rotation import rotation_step
from transmla.pipeline.stream import LayerStream, MLAShapes
from transmla.runtime.memory import peak_rss_bytes, trim_heap

__all__ = ["Budget", "ConvertOptions", "assemble", "convert", "convert_layers", "resolve_budget"]


def mla_shapes(spec: GQASpec, budget: Budget, o: ConvertOptions) -> MLAShapes:
    return MLAShapes(spec.h, spec.d, budget.rope_dim, budget.kv_lora_rank, o.norm_eps, budget.plan,
                     spec.rms_norm_eps if spec.qk_norm else None)


def second_pass_layer(w, m, spec: GQASpec, rot, budget: Budget, o: ConvertOptions) -> tuple[MLALayer, MLAShapes]:
    """The authors' second pass: layer l with RoPE dropped as planned but no rank cut (the layer whose
    output the two-pass mode's BKV statistics of layer l+1 come from)."""
    full = Budget(budget.plan, 2 * spec.g * spec.d - budget.rope_dim, budget.original_kv)
    basis = basis_step(w, m, spec, rot, full.kv_lora_rank, **o.normalized().basis_options())
    return layer_step(w, m, spec, rot, basis, o.q_lora_rank, o.norm_eps)[0], mla_shapes(spec, full, o)


def convert_layers(model, stats: CalibrationStats | None, spec: GQASpec, budget: Budget, o: ConvertOptions,
                   progress: bool = True, stream: LayerStream | None = None,
                   store_dtype: torch.dtype = torch.float64) -> tuple[list[MLALayer], list[dict]]:
    """Every layer's MLA weights and diagnostics.

    o.calibration = parallel: every step uses `stats` (the original model's moments); two_pass: the
    rotation uses `stats`, the basis the moments of `stream` pushed through RoPE-dropped full-rank
    layers (the authors' second pass); sequential: everything uses `stream` pushed through the
    converted layers. o.refit needs `stream` in every mode (o.streamed says when one is needed).
    Built layers are kept in `store_dtype` (convert() passes the export dtype: no float64 copy of
    every layer's attention until export).
    """
    n = o.normalized()
    if o.streamed and stream is None:
        raise ValueError(f"calibration={n.calibration}, refit={n.refit} needs a LayerStream")
    layers, diags = [], []
    for i in tqdm(range(spec.n_layers), desc="convert", file=sys.stderr, disable=not progress):
        w = attention_weights(model, i)
        m_rot = stream.moments(i) if n.calibration == "sequential" else stats.moments(i)
        m = stream.moments(i) if n.calibration == "two_pass" else m_rot
        rot = rotation_step(w, m_rot, spec, list(budget.plan), **n.rotation_options())
        basis = basis_step(w, m, spec, rot, budget.kv_lora_rank, **n.basis_options())
        layer, diag = layer_step(w, m, spec, rot, basis, o.q_lora_rank, o.norm_eps)
        if spec.qk_norm:  # Qwen3: the exported query / key-norm form, so the stream runs what the user will
            layer = rebase_query(layer, w, spec.h, spec.d)
        if n.refit:
            s = mla_shapes(spec, budget, o)
            blocks = stream.refit_moments(i, layer, s, value_bias(w, spec), REFIT_MAX_DIM)
            layer, fit = refit_step(layer, blocks, spec, REFIT_DAMP)
            diag.update(fit)
        if n.calibration == "sequential":
            stream.advance(i, layer, mla_shapes(spec, budget, o))
        elif n.calibration == "two_pass":
            stream.advance(i, *second_pass_layer(w, m, spec, rot, budget, o))
        elif stream is not None:
            stream.advance(i, None)
        layers.append(layer.cast(store_dtype))
        diags.append(diag)
    return layers, diags


def peak_rss_gib() -> float:
    return peak_rss_bytes() / 2**30


def calibration_windows(tok, o: ConvertOptions, data_dir=None) -> torch.Tensor:
    """The calibration windows of `o` (cal_dataset, cal_nsamples x cal_seqlen, seed). [N, T]"""
    from transmla.io.data import calibration_corpora

    return mixed_calibration_ids(tok, calibration_corpora(o.cal_dataset, data_dir), o.cal_nsamples, o.cal_seqlen, o.seed)


def convert(source: str, out: str | Path, o: ConvertOptions, cache=None, data_dir=None, progress=True) -> dict:
    """Load `source`, calibrate, convert, export to `out`. Returns the conversion record plus timings
    (the timings stay out of the checkpoint, so identical conversions give identical checkpoints)."""
    from transmla.io.data import calibration_parts
    from transmla.io.export import write_checkpoint
    from transmla.io.paths import new_output_dir
    from transmla.io.sources import check_source, load_model, source_info

    t0 = time.perf_counter()
    calibration_parts(o.cal_dataset)  # unknown data set or missing path: fail before any work
    check_source(source, cache)  # unsupported architecture: refused from its config, before any weight is read
    out = new_output_dir(out)
    info = source_info(source, cache)
    model, tok = load_model(source, dtype="float32", device=o.device, cache=cache)  # the math runs in fp32/fp64
    spec = read_spec(model.config)
    budget = resolve_budget(spec, o)
    ids = calibration_windows(tok, o, data_dir)
    trim_heap()  # tokenizing the corpus left ~0.2 GiB of free heap (SmolLM2) that calibration would fragment
    t_cal = time.perf_counter()
    n = o.normalized()
    stats = collect_stats(model, ids, o.cal_batch_size, progress) if n.calibration != "sequential" else None
    stream = LayerStream(model, ids, o.cal_batch_size, progress) if o.streamed else None
    cal_seconds = time.perf_counter() - t_cal
    layers, diags = convert_layers(model, stats, spec, budget, o, progress, stream, getattr(torch, o.dtype))
    compute_seconds = time.perf_counter() - t_cal  # calibration + per-layer math: what a forward pass compares with
    del stream, stats  # the export needs the weights only
    trim_heap()  # the stream's freed pages go back before the export touches every weight page
    metadata = conversion_metadata(info, spec, budget, o, diags, ids.numel())
    config, sd = assemble(model, spec, budget, layers, o)
    write_checkpoint(out, config, sd, tok, metadata)
    return {**metadata, "calibration_seconds": round(cal_seconds, 2), "compute_seconds": round(compute_seconds, 2),
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_gib": round(peak_rss_gib(), 3)}

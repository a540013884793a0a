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

from transmla.adapters import GQASpec, attention_weights, read_spec, warn_past_positions
from transmla.config import REFIT_DAMP, REFIT_MAX_DIM, ConvertOptions
from transmla.errors import TransMLAError
from transmla.method.calibration import CalibrationStats, collect_stats, mixed_calibration_ids
from transmla.method.mla import MLALayer, check_q_lora_rank
from transmla.method.qknorm import rebase_query
from transmla.pipeline.assemble import assemble, conversion_metadata
from transmla.pipeline.basis import basis_step
from transmla.pipeline.budget import Budget, resolve_budget
from transmla.pipeline.layer import layer_step, refit_step, value_bias
from transmla.pipeline.rotation import rotation_step
from transmla.pipeline.stream import LayerStream, MLAShapes
from transmla.runtime.memory import peak_rss_bytes, release_pages, trim_heap

__all__ = ["Budget", "ConvertOptions", "assemble", "check_request", "convert", "convert_layers", "resolve_budget"]


def check_request(spec: GQASpec, o: ConvertOptions) -> Budget:
    """The budget of `o` for the model `spec` describes, and every other shape request checked against it
    (q_lora_rank): all from the config, so a dry run and a real run refuse the same things before any weight."""
    budget = resolve_budget(spec, o)
    check_q_lora_rank(o.q_lora_rank, spec.h, spec.d, budget.rope_dim, spec.D, spec.q_bias)
    # the converted queries are a linear map of the original's h d, affine with a bias: their rank is at most
    # min(h d, D [+ 1]) whatever their width h (d + R), and any rank from there up keeps them exactly
    full = min(spec.h * spec.d, spec.D + int(spec.q_bias))
    if o.lossless and o.q_lora_rank is not None and o.q_lora_rank < full:  # a cut of the queries: not the original
        raise TransMLAError(f"--lossless with --q-lora-rank {o.q_lora_rank}: the queries have rank up to {full}, so "
                            "a lower rank cuts them and the export is no longer the original model.",
                            f"drop --q-lora-rank (or set it to {full}), or drop --lossless.")
    return budget


def config_spec(cfg: dict) -> GQASpec | None:
    """The spec of a source's config (io.sources.check_source's dict); None when it cannot give one: empty
    (a hub config not reachable), a model type alone, or a GGUF header's partial fields that transformers
    refuses (Llama-3.1 RoPE scaling without its factors)."""
    from transformers import AutoConfig

    if not set(cfg) - {"model_type"}:
        return None
    cfg = dict(cfg)
    from huggingface_hub.errors import StrictDataclassError

    try:
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (KeyError, TypeError, ValueError, StrictDataclassError):  # the loaded model's config decides, later
        return None
    return read_spec(config)


def mla_shapes(spec: GQASpec, budget: Budget, o: ConvertOptions) -> MLAShapes:
    return MLAShapes(spec.h, spec.d, budget.rope_dim, budget.kv_lora_rank, o.norm_eps, budget.plan,
                     spec.rms_norm_eps if spec.qk_norm else None)


def second_pass_layer(w, m, spec: GQASpec, rot, budget: Budget, o: ConvertOptions) -> tuple[MLALayer, MLAShapes]:
    """The authors' second pass: layer l with RoPE dropped as planned but no rank cut (the layer whose
    output the two-pass mode's BKV statistics of layer l+1 come from)."""
    full = Budget.of(spec, budget.plan, 2 * spec.g * spec.d - budget.rope_dim)
    basis = basis_step(w, m, spec, rot, full.kv_lora_rank, **o.normalized().basis_options())
    return layer_step(w, m, spec, rot, basis, o.q_lora_rank, o.norm_eps)[0], mla_shapes(spec, full, o)


def convert_layers(model, stats: CalibrationStats | None, spec: GQASpec, budget: Budget, o: ConvertOptions,
                   progress: bool = True, stream: LayerStream | None = None,
                   store_dtype: torch.dtype = torch.float64) -> tuple[list[MLALayer], list[dict]]:
    """Every layer's MLA weights and diagnostics (`iter_layers`, collected)."""
    layers, diags = [], []
    for i, layer, diag in iter_layers(model, stats, spec, budget, o, progress, stream, store_dtype):
        layers.append(layer)
        diags.append(diag)
        # layer i's source weights are done with until the export: give their mapped pages back
        release_pages(t for t in model.model.layers[i].state_dict().values())
    return layers, diags


def iter_layers(model, stats: CalibrationStats | None, spec: GQASpec, budget: Budget, o: ConvertOptions,
                progress: bool = True, stream: LayerStream | None = None, store_dtype: torch.dtype = torch.float64,
                load=None):
    """Yield (i, MLA layer i, its diagnostics) for every layer, in order.

    o.calibration = parallel: every step uses `stats` (the original model's moments), or, without
    `stats`, the moments of `stream` pushed through the original layers (the same statistics, one
    layer at a time); two_pass: the rotation uses `stats`, the basis the moments of `stream` pushed
    through RoPE-dropped full-rank layers (the authors' second pass); sequential: everything uses
    `stream` pushed through the converted layers. o.refit needs `stream` in every mode (o.streamed
    says when one is needed). Built layers are kept in `store_dtype` (convert() passes the export
    dtype: no float64 copy of every layer's attention until export). load(i), if given, is called
    before layer i's weights are read (layer-streamed conversion materialises them there); layer i's
    weights must stay until the consumer has taken the yielded layer.
    """
    n = o.normalized()
    if (o.streamed or stats is None) and stream is None:
        raise ValueError(f"calibration={n.calibration}, refit={n.refit} needs a LayerStream")
    for i in tqdm(range(spec.n_layers), desc="convert", file=sys.stderr, disable=not progress):
        if load is not None:
            load(i)
        w = attention_weights(model, i)
        m_rot = stream.moments(i) if n.calibration == "sequential" or stats is None else stats.moments(i)
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
        yield i, layer.cast(store_dtype), diag


def peak_rss_gib() -> float:
    return peak_rss_bytes() / 2**30


def calibration_windows(tok, o: ConvertOptions, data_dir=None) -> torch.Tensor:
    """The calibration windows of `o` (cal_dataset, cal_nsamples x cal_seqlen, seed). [N, T]"""
    from transmla.io.data import calibration_corpora

    return mixed_calibration_ids(tok, calibration_corpora(o.cal_dataset, data_dir), o.cal_nsamples, o.cal_seqlen, o.seed)


def precheck(source: str, out: str | Path | None, o: ConvertOptions, cache=None, data_dir=None,
             weights: bool = True) -> Path | None:
    """What a conversion refuses before any work, shared by the run and the dry run: calibration data
    (unknown set, missing file or path), an `out` the export could not write, a local model folder that
    cannot load (no safetensors weights, unreadable tokenizer; weights=False: the dry run, which plans a
    folder holding only config.json), an unsupported architecture and impossible ranks (from the config,
    before any weight is read, downloaded or dequantised). -> `out`, resolved (None without one)."""
    from transmla.devices import check_device
    from transmla.io.data import check_calibration_files
    from transmla.io.paths import check_output
    from transmla.io.lazy import safetensors_files
    from transmla.io.sources import check_model_dir, check_source, parse_source

    check_device(o.device, "device", "use device cpu")  # the CLI checks --device; a library call reached torch's own error
    check_calibration_files(o.cal_dataset, data_dir)
    if out is not None:
        out = check_output(out)
    src = parse_source(source)
    cfg = check_source(src, cache)  # the architecture first: a folder of an unsupported one is refused as such
    spec = config_spec(cfg)
    if spec is not None:
        check_request(spec, o)
    warn_past_positions(cfg, o.cal_seqlen, "cal_seqlen")
    quant = (cfg.get("quantization_config") or {}) if isinstance(cfg, dict) else {}
    if o.load == "layers" and quant:  # raw safetensors reads: FP8 blocks and their scales are not float weights
        raise TransMLAError(f"{source} is quantized ({quant.get('quant_method', 'quantization_config')}): the "
                            "layer-streamed load reads float safetensors tensors as stored.",
                            "convert with --load model (transformers dequantizes it on load), or from the model's "
                            "float release.")
    if src.kind == "dir" and weights:
        check_model_dir(Path(src.location))
    if o.load == "layers" and src.kind == "dir" and safetensors_files(src.location):  # the dry run too: headers only
        from transformers import AutoConfig

        import transmla.models  # noqa: F401  (this package's config classes, for converted sources)
        from transmla.io.lazy import LazyCheckpoint, skeleton

        config = AutoConfig.from_pretrained(src.location)
        check_streamable(skeleton(config), LazyCheckpoint(src.location), config, src)
    return out


def convert(source: str, out: str | Path, o: ConvertOptions, cache=None, data_dir=None, progress=True) -> dict:
    """Load `source`, calibrate, convert, export to `out`. Returns the conversion record plus timings
    (the timings stay out of the checkpoint, so identical conversions give identical checkpoints)."""
    from transmla.io.export import write_checkpoint
    from transmla.io.sources import load_model, source_info

    t0 = time.perf_counter()
    out = precheck(source, out, o, cache, data_dir)
    info = source_info(source, cache)
    if o.load == "layers":
        return convert_layer_streamed(source, out, o, info, t0, cache, data_dir, progress)
    model, tok = load_model(source, dtype="float32", device=o.device, cache=cache)  # the math runs in fp32/fp64
    spec = read_spec(model.config)
    budget = check_request(spec, o)  # again on the loaded config: authoritative where the source's was not read
    ids = calibration_windows(tok, o, data_dir)
    trim_heap()  # tokenizing the corpus left ~0.2 GiB of free heap (SmolLM2) that calibration would fragment
    data_peak = _data_peak()
    t_cal, c_cal = time.perf_counter(), time.process_time()
    n = o.normalized()
    stats = collect_stats(model, ids, o.cal_batch_size, progress) if n.calibration != "sequential" else None
    stream = LayerStream(model, ids, o.cal_batch_size, progress) if o.streamed else None
    cal_seconds = time.perf_counter() - t_cal
    layers, diags = convert_layers(model, stats, spec, budget, o, progress, stream, getattr(torch, o.dtype))
    compute_seconds = time.perf_counter() - t_cal  # calibration + per-layer math: what a forward pass compares with
    compute_cpu = time.process_time() - c_cal  # CPU time of all threads: time the host gives to other machines does not count
    del stream, stats  # the export needs the weights only
    trim_heap()  # the stream's freed pages go back before the export touches every weight page
    metadata = conversion_metadata(info, spec, budget, o, diags, ids.numel())
    config, sd = assemble(model, spec, budget, layers, o)
    write_checkpoint(out, config, sd, tok, metadata, generation=model.generation_config)
    return {**metadata, "calibration_seconds": round(cal_seconds, 2), "compute_seconds": round(compute_seconds, 2),
            "compute_cpu_seconds": round(compute_cpu, 2), "seconds": round(time.perf_counter() - t0, 2), **_peaks(data_peak)}


def _data_peak() -> float:
    """Peak RSS so far (GiB), then reset: tokenizing the calibration corpus (~0.5 GiB for WikiText-2
    train, whatever the model) is reported apart from the conversion's own peak."""
    from transmla.runtime.memory import reset_peak_rss

    peak = peak_rss_gib()
    reset_peak_rss()
    return peak


def _peaks(data_peak: float) -> dict:
    conv = peak_rss_gib()
    return {"peak_rss_gib": round(max(data_peak, conv), 3), "calibration_data_peak_rss_gib": round(data_peak, 3),
            "conversion_peak_rss_gib": round(conv, 3)}


def convert_layer_streamed(source: str, out: Path, o: ConvertOptions, info: dict, t0: float, cache=None,
                           data_dir=None, progress=True) -> dict:
    """`convert` with one decoder layer in memory at a time (o.load = "layers").

    The model is a skeleton on the meta device (io.lazy); the calibration set's hidden states enter
    the first layer from the embeddings, then each layer is read from the source's safetensors,
    converted by the same steps as in memory (`iter_layers`: statistics from the stream), pushed
    through, written as its own shard and released. Peak memory: embeddings (at the start and the
    end) or one layer, plus the hidden states and O(D^2) statistics, whatever the depth.
    """
    from transformers import AutoConfig, AutoTokenizer

    from transmla.adapters import shared_state_dict
    from transmla.io.export import read_generation, write_checkpoint_parts
    from transmla.io.lazy import LazyCheckpoint, load_module, release_module, skeleton
    from transmla.io.sources import HUB_FILES, HUB_SKIP, ModelSource, check_tokenizer_fits, materialize, parse_source
    from transmla.pipeline.assemble import attention_state_dict, export_config

    loc = Path(materialize(source, cache))
    if not loc.is_dir():  # a hub id: its files, once, in the hub's own cache, at the source's @revision
        from huggingface_hub import snapshot_download

        src = source if isinstance(source, ModelSource) else parse_source(source)
        # the files every other hub load takes: a chat template, no duplicate consolidated weights (Mistral's)
        loc = Path(snapshot_download(str(loc), revision=src.revision, allow_patterns=HUB_FILES,
                                     ignore_patterns=HUB_SKIP))
    config = AutoConfig.from_pretrained(loc)
    tok = AutoTokenizer.from_pretrained(loc)
    spec = read_spec(config)
    ckpt = LazyCheckpoint(loc)
    budget = check_request(spec, o)
    dtype = getattr(torch, o.dtype)
    model = skeleton(config)
    decoder = model.model.layers
    check_streamable(model, ckpt, config, source)
    check_tokenizer_fits(str(source), tok, model.model.embed_tokens.num_embeddings)
    ids = calibration_windows(tok, o, data_dir)
    trim_heap()
    data_peak = _data_peak()
    t_cal, c_cal = time.perf_counter(), time.process_time()

    def load(i: int) -> None:
        load_module(decoder[i], f"model.layers.{i}.", ckpt, device=o.device)

    # the stream starts at the first layer's input; a model with several layer types (Gemma 3) runs
    # up to the first layer of each type to capture its mask and RoPE, so those layers are read too
    types = list(getattr(config, "layer_types", None) or ["full_attention"])
    before = max(types.index(t) for t in dict.fromkeys(types))
    # only the calibration tokens' embedding rows, not the table (a 152K-token vocabulary is 0.5 GiB in
    # float32): the stream embeds token i of the calibration set as row inverse[i] of those rows
    used, inverse = torch.unique(ids, return_inverse=True)
    emb = model.model.embed_tokens
    emb.padding_idx = None  # F.embedding checks it against the row count; it only matters for gradients
    emb.weight = torch.nn.Parameter(ckpt.rows("model.embed_tokens.weight", used, torch.float32, o.device),
                                    requires_grad=False)
    for i in range(before):
        load(i)
    stream = LayerStream(model, inverse.reshape(ids.shape), o.cal_batch_size, progress)
    release_module(model.model.embed_tokens)
    for i in range(before):
        release_module(decoder[i])
    trim_heap()

    diags, first = [], []

    def parts():
        for i, layer, diag in iter_layers(model, None, spec, budget, o, progress, stream, dtype, load=load):
            prefix = f"model.layers.{i}."
            part = {k: v.to(dtype) for k, v in shared_state_dict(model).items() if k.startswith(prefix)}
            part.update(attention_state_dict(model, spec, i, layer, dtype))
            diags.append(diag)
            first[:] = first or [layer]
            release_module(decoder[i])
            trim_heap()
            yield part
        stream.h.clear()  # the hidden states are done with
        trim_heap()
        # the same names as in memory (shared_state_dict): read from the source, a tied lm_head written
        # under both names (one tensor in memory), a buffer the source does not store from the skeleton
        glob = {}
        for k, v in shared_state_dict(model).items():
            if k.startswith("model.layers."):
                continue
            if k in ckpt:  # written from the source file, never held (the embedding table, lm_head)
                glob[k] = ckpt.lazy(k, dtype)
            elif k == "lm_head.weight":
                glob[k] = glob.get("model.embed_tokens.weight", None)
                if glob[k] is None:
                    glob[k] = ckpt.lazy("model.embed_tokens.weight", dtype)
            else:
                glob[k] = v.to(dtype)
        yield glob

    def finish():
        metadata = conversion_metadata(info, spec, budget, o, diags, ids.numel())
        return export_config(spec, budget, first[0], o), tok, metadata

    write_checkpoint_parts(out, parts(), spec.n_layers + 1, finish, read_generation(loc))
    compute_seconds = time.perf_counter() - t_cal
    compute_cpu = time.process_time() - c_cal
    metadata = conversion_metadata(info, spec, budget, o, diags, ids.numel())
    return {**metadata, "calibration_seconds": None, "compute_seconds": round(compute_seconds, 2),
            "compute_cpu_seconds": round(compute_cpu, 2), "seconds": round(time.perf_counter() - t0, 2), **_peaks(data_peak)}


def check_streamable(model, ckpt, config, source) -> None:
    """Refuse, from the safetensors headers, a checkpoint the layer-streamed load cannot read: layer tensors that
    transformers renames or fuses on load (Mixtral's per-expert weights cannot be read tensor by tensor), then
    check_streamed_weights. model: the config's skeleton (io.lazy.skeleton)."""
    missing = [n for n, _ in model.model.layers[0].named_parameters() if f"model.layers.0.{n}" not in ckpt]
    if missing:
        raise TransMLAError(
            f"load=layers reads each layer's tensors under the model's own names; {ckpt.dir} stores "
            f"{', '.join(missing[:3])} under other names (transformers converts them when it loads the whole model).",
            "use --load model (load: model) for this checkpoint.")
    check_streamed_weights(model, ckpt, config, source)


def check_streamed_weights(model, ckpt, config, source) -> None:
    """The layer-streamed path's version of load_model's check (io.sources._check_loading_info): every tensor the
    config's skeleton has, in the safetensors headers with its shape, and no layer past the config's depth. The
    stream reads tensors by name, so a config with more layers than the weights, or fewer, was converted as far as
    it went or silently cut short."""
    from transmla.io.sources import _check_loading_info, parse_source

    n = config.num_hidden_layers
    missing, shapes = [], []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for key, p in model.named_parameters():
        if key == "lm_head.weight" and tied:
            continue
        if key not in ckpt:
            missing.append(key)
        elif tuple(ckpt.entries[key][3]) != tuple(p.shape):
            shapes.append((key, tuple(ckpt.entries[key][3]), tuple(p.shape)))
    extra = [k for k in ckpt.names("model.layers.") if int(k.split(".")[2]) >= n]
    src = source if not isinstance(source, str) else parse_source(source)
    _check_loading_info(src, {"missing_keys": missing, "unexpected_keys": extra, "mismatched_keys": shapes})


def plan_conversion(source: str, o: ConvertOptions, cache=None, rates: dict | None = None):
    """The conversion's plan (pipeline.plan) from the source's config alone: no weight is read.
    rates: matmul / float64-eigh FLOP/s (default: measured on o.device in about a second)."""
    from transmla.errors import TransMLAError
    from transmla.io.sources import check_source
    from transmla.pipeline.plan import conversion_plan, measure_rates

    cfg = check_source(source, cache)  # refused from the config, as convert() would
    if not cfg:
        raise TransMLAError(f"No config.json found for {source!r}.", "a dry run reads the source's config.json only: "
                                                                       "pass a directory or hub id that has one.")
    spec = config_spec(cfg)
    if spec is None:  # a model type alone (a config transformers refuses): a default config's shapes would mislead
        raise TransMLAError(f"{source!r} is not materialised yet: its config holds no usable shapes.",
                            f"run `transmla fetch-model {source} --out DIR` (or a real conversion) once, then dry-run.")
    budget = check_request(spec, o)
    return conversion_plan(spec, budget, o, rates or measure_rates(o.device))

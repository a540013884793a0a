"""Step 4: the MLA layers from the cached rotations and bases -> a stock DeepseekV3 checkpoint (or
the model in memory, for the figure sweeps).

Not cached by Prefect: assembly takes seconds, and the checkpoint is a DVC out (DVC deletes it
before re-running the stage, so a Prefect cache hit would leave it missing).
"""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.adapters import attention_weights
from transmla.config import ConvertOptions
from transmla.convert import peak_rss_gib
from transmla.io.export import instantiate, read_generation, write_checkpoint
from transmla.io.sources import content_hash
from transmla.pipeline.assemble import assemble, conversion_metadata
from transmla.pipeline.budget import Budget, resolve_budget
from transmla.pipeline.layer import layer_step

from .artifacts import load_json, model_ref
from .bkv import basis_of
from .calibrate import stats_of
from .model import load, spec_of
from .rorope import rotation_of
from .stream import layers_of


def build(model: dict, stats: dict | None, rotations: list[dict], bases: list[dict], o: ConvertOptions,
          streamed: dict | None = None):
    """(tokenizer, config, state dict, conversion record) of the converted model: from the per-layer
    rotations and bases (parallel calibration) or from a streamed conversion's layers (tasks.stream)."""
    m, tok = load(model["path"])
    spec = spec_of(model)
    if streamed is not None:
        layers = layers_of(streamed, spec.n_layers)
        record = load_json(streamed["diags"])
        diags, n_tokens = record["layers"], record["calibration_tokens"]
        budget = resolve_budget(spec, o)
    else:
        st = stats_of(stats)
        layers, diags = [], []
        for i, (rref, bref) in enumerate(zip(rotations, bases, strict=True)):
            rot, basis = rotation_of(rref), basis_of(bref)
            layer, diag = layer_step(attention_weights(m, i), st.moments(i), spec, rot, basis, o.q_lora_rank, o.norm_eps)
            layers.append(layer)
            diags.append(diag)
        budget, n_tokens = Budget.of(spec, rot.plan, basis.rank), st.n  # (a QK-norm model's key scales counted)
    metadata = conversion_metadata({"source": model.get("source"), "content_hash": model["sha256"]}, spec, budget, o,
                                   diags, n_tokens)
    config, sd = assemble(m, spec, budget, layers, o)
    return tok, config, sd, metadata


@task(name="export_checkpoint", cache_policy=NO_CACHE)
def export_checkpoint(model: dict, stats: dict | None, rotations: list[dict], bases: list[dict], options: dict, out: str,
                      streamed: dict | None = None, replace: bool = False) -> dict:
    """Write the converted model to `out` (atomically; replace: a pipeline output, replaced whole) -> its model
    ref, with the record and timings."""
    t0 = time.perf_counter()
    tok, config, sd, metadata = build(model, stats, rotations, bases, ConvertOptions(**options), streamed)
    out = write_checkpoint(out, config, sd, tok, metadata, replace=replace, generation=read_generation(model["path"]))
    return model_ref(out, content_hash(out), transmla=config.transmla, seconds=round(time.perf_counter() - t0, 2),
                     peak_rss_gib=round(peak_rss_gib(), 3))


def mla_model(model: dict, stats: dict | None, rotations: list[dict], bases: list[dict], options: dict,
              streamed: dict | None = None):
    """The converted model in memory (stock DeepseekV3ForCausalLM) and its tokenizer."""
    tok, config, sd, _ = build(model, stats, rotations, bases, ConvertOptions(**options), streamed)
    return instantiate(config, sd), tok

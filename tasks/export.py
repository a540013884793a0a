"""Stage 4: assemble the MLA layers from the cached rotations and bases; write a stock DeepseekV3
checkpoint (or build it in memory for the figure sweeps).

Not cached by Prefect: assembly takes seconds, and the checkpoint is a DVC out (DVC caches it and
deletes it before re-running the stage, so a Prefect cache hit would leave it missing).
"""

from __future__ import annotations

import time
from dataclasses import replace

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.adapters import attention_weights, read_spec
from transmla.convert import Budget, ConvertOptions, assemble, conversion_metadata, peak_rss_gib
from transmla.io.export import instantiate, write_checkpoint
from transmla.method.mla import build_mla_layer
from transmla.io.sources import content_hash

from .artifacts import dir_ref, load_tensors
from .bkv import basis_of
from .calibrate import stats_of
from .model import load
from .rorope import rotation_of


def build(model: dict, stats: dict, rotations: list[dict], bases: list[dict], o: ConvertOptions):
    """(source model, tokenizer, config, state dict, metadata) of the converted model."""
    m, tok = load(model["path"])
    spec = read_spec(m.config)
    st = stats_of(stats)
    layers, diags, first = [], [], None
    for i, (rref, bref) in enumerate(zip(rotations, bases, strict=True)):
        rot, basis = rotation_of(rref), basis_of(bref)
        first = first or (rot, basis)
        layer, diag = build_mla_layer(attention_weights(m, i), rot, basis, spec.h, spec.g, spec.d,
                                      st.second_moment(i), st.mean(i), o.q_lora_rank, o.norm_eps)
        layers.append(layer)
        diags.append(diag)
    budget = Budget(tuple(first[0].plan), first[1].rank, 2 * spec.g * spec.d)
    info = {"source": model.get("source"), "content_hash": model["sha256"]}
    metadata = conversion_metadata(info, spec, budget, o, diags)
    metadata["calibration_tokens"] = load_tensors(stats)[1].get("tokens")
    config, sd = assemble(m, spec, budget, layers, o, metadata)
    return m, tok, config, sd, metadata


@task(name="export_checkpoint", cache_policy=NO_CACHE)
def export_checkpoint(model: dict, stats: dict, rotations: list[dict], bases: list[dict], options: dict, out: str) -> dict:
    """Write the converted model to `out` (atomically); ref to the directory (content hash)."""
    t0 = time.perf_counter()
    o = replace(ConvertOptions(), **options)
    _, tok, config, sd, metadata = build(model, stats, rotations, bases, o)
    # Timings stay out of config.json: an identical conversion must give an identical content hash
    # (the evaluation cache is keyed on it).
    out = write_checkpoint(out, config, sd, tok, metadata)
    return dir_ref(out, sha256=content_hash(out), transmla=config.transmla,
                   seconds=round(time.perf_counter() - t0, 2), peak_rss_gib=round(peak_rss_gib(), 3))


def mla_model(model: dict, stats: dict, rotations: list[dict], bases: list[dict], options: dict):
    """The converted model in memory (stock DeepseekV3ForCausalLM) and its tokenizer."""
    o = replace(ConvertOptions(), **options)
    _, tok, config, sd, _ = build(model, stats, rotations, bases, o)
    return instantiate(config, sd), tok

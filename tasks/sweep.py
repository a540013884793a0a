"""Figure sweeps: perplexity of a conversion built in memory from cached steps (no checkpoint on disk)."""

from __future__ import annotations

from transmla.evaluation.perplexity import dataset_perplexity

from .artifacts import cached_task, save_json
from .export import mla_model
from .model import data_dir_of


@cached_task("sweep_perplexity")
def sweep_perplexity(model: dict, stats: dict, rotations: list[dict], bases: list[dict], options: dict,
                     data: dict, seqlen: int, max_tokens: int | None) -> dict:
    m, tok = mla_model(model, stats, rotations, bases, options)
    return save_json("ppl", dataset_perplexity(m, tok, data["name"], seqlen, max_tokens, data_dir_of(data),
                                                 revision=data.get("revision")))

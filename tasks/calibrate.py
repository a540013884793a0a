"""Step 1: calibration statistics (one forward pass): per-layer E[x x^T], E[x] of the attention input."""

from __future__ import annotations

from transmla.io.data import load_texts
from transmla.method.calibration import CalibrationStats, calibration_ids, collect_stats

from .artifacts import cached_task, load_tensors, save_tensors
from .model import data_dir_of, load


@cached_task("calibration_stats")
def calibration_stats(model: dict, data: dict, nsamples: int, seqlen: int, batch_size: int, seed: int) -> dict:
    """Ref to a safetensors file of per-layer sums (float64) over nsamples x seqlen tokens of `data`."""
    m, tok = load(model["path"])
    ids = calibration_ids(tok, load_texts(data["name"], data_dir_override=data_dir_of(data)), nsamples, seqlen, seed)
    return save_tensors("stats", collect_stats(m, ids, batch_size).to_tensors())


_stats_cache: dict[str, CalibrationStats] = {}


def stats_of(ref: dict) -> CalibrationStats:
    """Load a stats artifact once per process (the per-layer tasks share it)."""
    if ref["sha256"] not in _stats_cache:
        _stats_cache.clear()
        _stats_cache[ref["sha256"]] = CalibrationStats.from_tensors(load_tensors(ref))
    return _stats_cache[ref["sha256"]]

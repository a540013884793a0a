"""Step 1: calibration statistics (one forward pass): per-layer E[x x^T], E[x] of the attention input."""

from __future__ import annotations

from transmla.method.calibration import CalibrationStats, collect_stats, mixed_calibration_ids

from .artifacts import cached_task, load_tensors, save_tensors
from .model import calibration_texts, load


@cached_task("calibration_stats")
def calibration_stats(model: dict, data: dict, nsamples: int, seqlen: int, batch_size: int, seed: int) -> dict:
    """Ref to a safetensors file of per-layer sums (float64) over nsamples x seqlen tokens of `data`
    (a calibration_ref: one data set, or a mix with an equal share of the windows per part)."""
    m, tok = load(model["path"])
    ids = mixed_calibration_ids(tok, calibration_texts(data), nsamples, seqlen, seed)  # one part: calibration_ids
    return save_tensors("stats", collect_stats(m, ids, batch_size).to_tensors())


_stats_cache: dict[str, CalibrationStats] = {}


def stats_of(ref: dict) -> CalibrationStats:
    """Load a stats artifact once per process (the per-layer tasks share it)."""
    if ref["sha256"] not in _stats_cache:
        _stats_cache.clear()
        _stats_cache[ref["sha256"]] = CalibrationStats.from_tensors(load_tensors(ref))
    return _stats_cache[ref["sha256"]]

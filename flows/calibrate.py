"""Flow: calibration statistics of one model -> artifacts/<model>/calibration.safetensors (a DVC out).

    python -m flows.calibrate --model smollm2-135m
"""

from __future__ import annotations

from prefect import flow

from tasks.artifacts import file_ref, publish
from tasks.calibrate import calibration_stats
from tasks.model import calibration_ref, resolve_model
from transmla.errors import TransMLAError
from transmla.io.data import check_calibration_apart

from . import _cli, layout
from .params import Profile


def calibration_data(profile: Profile) -> dict:
    """The calibration set's ref; a path: part holding text of the perplexity set is refused here (the params
    check names only: a path is read on the machine that runs the stage)."""
    check_calibration_apart(profile.calibration.dataset, profile.evaluation.ppl_dataset, "calibration.dataset")
    return calibration_ref(profile.calibration.dataset)


def stats_file_ref(path: str, model_ref: dict) -> dict:
    """The ref of a statistics file a user named (--stats-file), its shapes checked against the model's from the
    safetensors header: a weights file, or another model's statistics with other shapes, failed deep in the
    conversion (IndexError, KeyError). Another model's statistics of the same shapes cannot be told apart."""
    from safetensors import safe_open

    from tasks.model import spec_of

    spec = spec_of(model_ref)
    fix = ("pass the statistics of this model (python -m flows.calibrate --model NAME writes them), or leave "
           "--stats-file out to compute them (cached).")
    try:
        with safe_open(path, "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001  (not safetensors at all: safetensors' own error says why)
        raise TransMLAError(f"--stats-file {path} is not a safetensors file ({' '.join(str(e).split())[:160]}).",
                            fix) from None
    layers = sum(1 for k in shapes if k.startswith("layers.") and k.endswith(".xx"))
    if "n" not in shapes or not layers:
        raise TransMLAError(f"--stats-file {path} is not a calibration statistics file (no per-layer moments).", fix)
    want = {f"layers.{i}.{k}": s for i in range(spec.n_layers) for k, s in (("xx", (spec.D, spec.D)), ("xsum", (spec.D,)))}
    if layers != spec.n_layers or any(shapes.get(k) != s for k, s in want.items()):
        width = shapes.get("layers.0.xsum", ("?",))[0]
        raise TransMLAError(f"--stats-file {path} holds statistics of {layers} layers of width {width}; the model has "
                            f"{spec.n_layers} layers of width {spec.D}.", fix)
    return file_ref(path)


def stats_for(profile: Profile, model_ref: dict) -> dict:
    c = profile.calibration
    return calibration_stats(model_ref, calibration_data(profile), c.nsamples, c.seqlen, c.batch_size, c.seed)


@flow(name="calibrate")
def calibrate(profile: Profile, model: str, out: str | None = None) -> dict:
    stats = stats_for(profile, resolve_model(profile.model(model).source))
    # a pipeline output (a DVC out) is replaced; a user's --out never
    return file_ref(publish(stats, out or layout.calibration_file(model), replace=out is None))


if __name__ == "__main__":
    _cli.entry(calibrate, __doc__, new_outputs={"out": "new_file"}, tracked=False,
               out="statistics file (default artifacts/<model>/calibration.safetensors)")

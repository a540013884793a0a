"""Flow: calibration statistics of one model -> artifacts/<model>/calibration.safetensors (a DVC out).

    python -m flows.calibrate --model smollm2-135m
"""

from __future__ import annotations

from prefect import flow

from tasks.artifacts import file_ref, publish
from tasks.calibrate import calibration_stats
from tasks.model import calibration_ref, resolve_model
from transmla.io.data import check_calibration_apart

from . import _cli, layout
from .params import Profile


def calibration_data(profile: Profile) -> dict:
    """The calibration set's ref; a path: part holding text of the perplexity set is refused here (the params
    check names only: a path is read on the machine that runs the stage)."""
    check_calibration_apart(profile.calibration.dataset, profile.evaluation.ppl_dataset, "calibration.dataset")
    return calibration_ref(profile.calibration.dataset)


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

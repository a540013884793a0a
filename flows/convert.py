"""Flow: convert one model to MLA at one KV budget with one method -> a stock DeepseekV3 checkpoint.

    calibration stats -> per layer: rotation (RoRoPE + FreqFold | 2-norm) -> BKV basis -> export
    (calibration: sequential | two_pass, or refit: the layers in order over one stream -> export)

    python -m flows.convert --model smollm2-135m --method transmla --budget 0.125 [--stats FILE] [--out DIR]

Usable alone (it computes the statistics if --stats is not given); the DVC `convert` stage passes
the `calibrate` stage's output. Every per-layer step is a cached task, so another rank at the same
RoPE dim recomputes only the BKV bases, and a re-run after a crash resumes where it stopped.
"""

from __future__ import annotations

from prefect import flow

from tasks import tracking
from tasks.bkv import layer_basis
from tasks.export import export_checkpoint
from tasks.model import resolve_model, spec_of
from tasks.rorope import layer_rotation
from tasks.stream import streamed_layers
from transmla.config import ConvertOptions
from transmla.pipeline.budget import resolve_budget

from . import _cli, layout
from .calibrate import calibration_data, stats_file_ref, stats_for
from .params import Profile


def layer_steps(model_ref: dict, stats: dict, o: ConvertOptions) -> tuple[list[dict], list[dict]]:
    """Per-layer rotation and basis refs (cached tasks), keyed on the options each step uses
    (parallel calibration without refit: every layer's steps are independent)."""
    spec = spec_of(model_ref)
    budget = resolve_budget(spec, o)
    rotations = [layer_rotation(model_ref, stats, i, list(budget.plan), **o.rotation_options())
                 for i in range(spec.n_layers)]
    bases = [layer_basis(model_ref, stats, rot, i, budget.kv_lora_rank, **o.basis_options())
             for i, rot in enumerate(rotations)]
    return rotations, bases


def converted(profile: Profile, model_ref: dict, o: ConvertOptions, out: str, stats_file: str | None = None,
              replace: bool = False) -> dict:
    """The cached steps of one conversion, exported to `out` (replace: a pipeline output the run owns) -> the
    checkpoint's ref."""
    b = resolve_budget(spec_of(model_ref), o)  # an impossible budget fails here, not after calibration
    stats = None
    if o.normalized().calibration != "sequential":  # the original model's statistics (sequential makes its own)
        stats = stats_file_ref(stats_file, model_ref) if stats_file else stats_for(profile, model_ref)
    if o.streamed:  # layer l depends on the converted layers before it: one task, in layer order
        streamed = streamed_layers(model_ref, calibration_data(profile), stats, list(b.plan), b.kv_lora_rank,
                                   o.stream_options())
        return export_checkpoint(model_ref, None, [], [], o.model_dump(), out, streamed, replace)
    rotations, bases = layer_steps(model_ref, stats, o)
    return export_checkpoint(model_ref, stats, rotations, bases, o.model_dump(), out, replace=replace)


@flow(name="convert")
def convert(profile: Profile, model: str, method: str, budget: float, out: str | None = None,
            stats_file: str | None = None) -> dict:
    o = profile.convert_options(method, budget)
    model_ref = resolve_model(profile.model(model).source)
    # a pipeline output (a DVC out) is replaced, as dvc repro does; a user's --out never
    ckpt = converted(profile, model_ref, o, str(out or layout.checkpoint_dir(model, method, budget)), stats_file,
                     replace=out is None)
    if out is not None:  # a one-off run: never the pipeline's MLflow run (its params and metrics are the pipeline's)
        return ckpt
    info = ckpt["transmla"]
    # the run is replaced when the model behind the name changes too (its params are write-once: a reused run
    # kept the first source beside the new metrics)
    tracking.track(profile.mlflow.experiment, model, method, budget,
                   config={**o.model_dump(), "source": model_ref.get("source"), "model_sha256": model_ref["sha256"]},
                   params={"model": model, "source": profile.model(model).source, **o.used(),
                           "qk_rope_head_dim": info["qk_rope_head_dim"], "kv_lora_rank": info["kv_lora_rank"]},
                   metrics={**{k: info[k] for k in ("kv_cache_ratio", "kv_cache_reduction", "mean_rope_energy",
                                                    "mean_kv_energy", "mean_alpha")},
                            "convert_seconds": ckpt["seconds"], "convert_peak_rss_gib": ckpt["peak_rss_gib"]},
                   artifacts={"conversion.json": info})
    return ckpt


if __name__ == "__main__":
    _cli.entry(convert, __doc__, variant=True, new_outputs={"out": "new_dir"}, tracked="out",
               stats_file="calibration statistics file (default: computed, cached)",
               out="checkpoint directory of a one-off run (default: the pipeline's, "
                   "artifacts/<model>/<method>-<budget>/model, with its MLflow run)")

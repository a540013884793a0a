"""Flow: convert one model to MLA at one KV budget with one method -> a stock DeepseekV3 checkpoint.

    calibration stats -> per layer: rotation (RoRoPE + FreqFold | 2-norm) -> BKV basis -> export

    python -m flows.convert --model smollm2-135m --method transmla --budget 0.125 [--stats FILE] [--out DIR]

Usable alone (it computes the statistics if --stats is not given); the DVC `convert` stage passes
the `calibrate` stage's output. Every per-layer step is a cached task, so another rank at the same
RoPE dim recomputes only the BKV bases, and a re-run after a crash resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow

from tasks import tracking
from tasks.artifacts import file_ref
from tasks.bkv import layer_basis
from tasks.export import export_checkpoint
from tasks.model import load, resolve_model
from tasks.rorope import layer_rotation
from transmla.adapters import read_spec
from transmla.convert import ConvertOptions, resolve_budget

from . import _cli, layout
from .calibrate import stats_for
from .params import Profile


def convert_options(profile: Profile, method: str, budget: float | None, **explicit) -> ConvertOptions:
    """The ConvertOptions a (method, budget) of the profile stands for (validated)."""
    t, c, e = profile.methods.transmla, profile.calibration, profile.export
    o = ConvertOptions(
        method=method, kv_cache_ratio=budget, freqfold=t.freqfold, balance_kv=t.balance_kv, pca=t.pca,
        attention_aware=t.attention_aware, cal_dataset=c.dataset, cal_nsamples=c.nsamples, cal_seqlen=c.seqlen,
        cal_batch_size=c.batch_size, seed=c.seed, dtype=e.dtype, device=profile.device,
        latent_norm_eps=e.latent_norm_eps,
    )
    for k, v in explicit.items():
        setattr(o, k, v)
    o.validate()
    return o


def layer_steps(model_ref: dict, stats: dict, o: ConvertOptions) -> tuple[list[dict], list[dict]]:
    """Per-layer rotation and basis refs (cached tasks). Options a method ignores are normalised so
    they do not split its cache (MHA2MLA has no FreqFold, BKV or PCA mode)."""
    m, _ = load(model_ref["path"])
    spec = read_spec(m.config)
    budget = resolve_budget(spec, o)
    tm = o.method == "transmla"
    fold = (1 if o.lossless else o.freqfold) if tm else 1
    rotations, bases = [], []
    for i in range(spec.n_layers):
        rot = layer_rotation(model_ref, stats, i, o.method, list(budget.plan), fold)
        bases.append(layer_basis(model_ref, stats, rot, i, o.method, budget.kv_lora_rank,
                                 o.balance_kv if tm else False, o.pca if tm else "weights",
                                 o.attention_aware if tm else False))
        rotations.append(rot)
    return rotations, bases


@flow(name="convert")
def convert(profile: Profile, model: str, method: str, budget: float, out: str | None = None,
            stats_file: str | None = None) -> dict:
    o = convert_options(profile, method, budget)
    model_ref = resolve_model(profile.model(model).source)
    stats = file_ref(stats_file) if stats_file else stats_for(profile, model_ref)
    rotations, bases = layer_steps(model_ref, stats, o)
    ckpt = export_checkpoint(model_ref, stats, rotations, bases, asdict(o),
                             str(out or layout.checkpoint_dir(model, method, budget)))
    info = ckpt["transmla"]
    client, run_id = tracking.stage_run(profile.mlflow.experiment, model, method, budget, asdict(o))
    tracking.log(client, run_id, params={"model": model, "source": profile.model(model).source, **asdict(o),
                                         "qk_rope_head_dim": info["qk_rope_head_dim"], "kv_lora_rank": info["kv_lora_rank"]},
                 metrics={"kv_cache_ratio": info["kv_cache_ratio"], "kv_cache_reduction": info["kv_cache_reduction"],
                          "mean_rope_energy": info["mean_rope_energy"], "mean_kv_energy": info["mean_kv_energy"],
                          "mean_alpha": info["mean_alpha"], "convert_seconds": ckpt["seconds"],
                          "convert_peak_rss_gib": ckpt["peak_rss_gib"]},
                 artifacts={"conversion.json": info})
    return ckpt


def main():
    ap = _cli.variant_parser(__doc__)
    ap.add_argument("--stats", help="calibration statistics file (default: computed, cached)")
    ap.add_argument("--out", help="checkpoint directory (default artifacts/<model>/<method>-<budget>/model)")
    args = ap.parse_args()
    convert(_cli.profile_of(args), args.model, args.method, args.budget, args.out, args.stats)


if __name__ == "__main__":
    _cli.run(main)

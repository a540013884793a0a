"""Flow: the paper's Figs. 4 and 5 for one model, from the cached statistics and per-layer steps.

    python -m flows.figures --model smollm2-135m [--stats FILE]

Writes reports/figures/<model>/{fig4a_key_norms,fig4b_rope_removal,fig5_bkv}.png and the numbers
behind them in reports/metrics/<model>/figures.json. Every perplexity point is a cached task, and
the rotations are the same cached tasks the convert flow uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks.artifacts import load_json
from tasks.bkv import basis_of
from tasks.calibrate import stats_of
from tasks.evaluate import perplexity
from tasks.figures import plot_fig4a, plot_fig4b, plot_fig5
from tasks.model import dataset_ref, load, resolve_model, spec_of
from tasks.rorope import layer_rotation, rotation_of
from tasks.sweep import sweep_perplexity
from transmla.adapters import attention_weights
from transmla.method.diagnostics import balance_norms, key_norm_series
from transmla.pipeline.budget import resolve_budget
from transmla.errors import TransMLAError
from transmla.io.paths import write_text_atomic
from transmla.method.rope import standard_plan

from . import _cli, layout
from .calibrate import stats_file_ref, stats_for
from .convert import layer_steps
from .params import Profile


def _ppl(profile: Profile, model_ref, stats, o) -> float:
    f = profile.figures
    rotations, bases = layer_steps(model_ref, stats, o)
    ref = sweep_perplexity(model_ref, stats, rotations, bases, o.model_dump(), dataset_ref(profile.evaluation.ppl_dataset),
                           profile.evaluation.ppl_seqlen, f.ppl_max_tokens)
    return load_json(ref)["ppl"]


def figure_options(profile: Profile, method: str, budget: float | None, **explicit):
    """The ConvertOptions of one figure point: methods.<method> as params give it, calibrated on the original
    model's statistics without a refit, as the paper's figures are (and as _ppl builds them: from the per-layer
    steps; a layer-streamed methods entry was keyed as one and ran as this)."""
    o = profile.convert_options(method, budget, **explicit)
    return o.replace(calibration="parallel", refit=False) if method == "transmla" else o  # MHA2MLA: normalized so


def _fig4b_options(profile: Profile, spec, R: int):
    """(curve label, ConvertOptions) of Fig. 4b's three conversions at RoPE dim R, full KV rank."""
    f, full = profile.figures, 2 * spec.g * spec.d
    return [(label, figure_options(profile, method, None, qk_rope_dim=R, kv_lora_rank=full - R, freqfold=fold))
            for label, method, fold in (("MHA2MLA (2-norm)", "mha2mla", 1), ("RoRoPE", "transmla", 1),
                                        (f"RoRoPE + FreqFold {f.freqfold}", "transmla", f.freqfold))]


def check_figures(profile: Profile, spec) -> None:
    """figures: against the model's shapes (config.json only), before any calibration: every conversion the
    figures make is resolved, so an impossible one fails now, not after the sweeps before it."""
    f = profile.figures
    if f.layer >= spec.n_layers:
        raise TransMLAError(f"figures.layer={f.layer} but the model has {spec.n_layers} layers.", "lower figures.layer.")
    for field, R in [*(("rope_dims", R) for R in f.rope_dims), ("fig4a_rope_dim", f.fig4a_rope_dim)]:
        if spec.d % R or R > spec.d:
            raise TransMLAError(f"figures.{field}: RoPE dim {R} does not divide the model's head dim {spec.d}.",
                                f"set figures.{field} to {'even divisors' if field == 'rope_dims' else 'an even divisor'} "
                                f"of {spec.d}.")
    for R in f.rope_dims:
        for _, o in _fig4b_options(profile, spec, R):
            resolve_budget(spec, o)
    try:
        resolve_budget(spec, figure_options(profile, "transmla", f.fig5_budget, balance_kv=True))
    except TransMLAError as e:  # the budget's own fix names --kv-cache-ratio; a freqfold error keeps its own
        fix = "raise figures.fig5_budget." if "kv_cache_ratio" in e.problem else e.fix
        raise TransMLAError(f"figures.fig5_budget={f.fig5_budget:g}: {e.problem}", fix) from None


@flow(name="figures")
def figures(profile: Profile, model: str, stats_file: str | None = None, out_dir: str | None = None) -> dict:
    f = profile.figures
    model_ref = resolve_model(profile.model(model).source)
    spec = spec_of(model_ref)
    check_figures(profile, spec)
    stats = stats_file_ref(stats_file, model_ref) if stats_file else stats_for(profile, model_ref)
    out = layout.figures_dir(model) if out_dir is None else Path(out_dir)
    L, w = f.layer, attention_weights(load(model_ref["path"])[0], f.layer)
    m = stats_of(stats).moments(L)

    # Fig. 4a: where the key energy sits before / after RoRoPE (+ FreqFold), one layer.
    plan = standard_plan(spec.d, f.fig4a_rope_dim)
    # The paper's Fig. 4a is RoRoPE's PCA of the keys themselves (key metric).
    rots = {label: rotation_of(layer_rotation(model_ref, stats, L, plan, "transmla", fold, "key"))
            for label, fold in (("RoRoPE", 1), (f"RoRoPE + FreqFold {f.freqfold}", f.freqfold))}
    series, energy = key_norm_series(w.wk, w.bk, m.xx, m.mean, rots)
    fig4a = {"layer": L, "rope_dim": f.fig4a_rope_dim, "series": series, "energy": energy}

    # Fig. 4b: drop RoPE from more and more dims at full KV rank.
    # the original in the precision the sweep's conversions are built in (export.dtype), so the curves
    # start from their own baseline
    original = load_json(perplexity(model_ref, dataset_ref(profile.evaluation.ppl_dataset),
                                    profile.evaluation.ppl_seqlen, f.ppl_max_tokens, profile.export.dtype,
                                    profile.device))["ppl"]
    curves = {"MHA2MLA (2-norm)": [], "RoRoPE": [], f"RoRoPE + FreqFold {f.freqfold}": []}
    for R in f.rope_dims:
        for label, o in _fig4b_options(profile, spec, R):
            curves[label].append([1 - R / spec.d, _ppl(profile, model_ref, stats, o)])
    fig4b = {"original": original, "curves": curves, "tokens": f.ppl_max_tokens}

    # Fig. 5: balancing, and weight- vs activation-based joint PCA at one budget.
    ppl5 = {}
    for pca in ("weights", "activations"):
        for bkv in (False, True):
            o = figure_options(profile, "transmla", f.fig5_budget, pca=pca, balance_kv=bkv)
            ppl5[f"{pca}{' + BKV' if bkv else ''}"] = _ppl(profile, model_ref, stats, o)
    o = figure_options(profile, "transmla", f.fig5_budget, balance_kv=True)
    budget = resolve_budget(spec, o)
    rotations, bases = layer_steps(model_ref, stats, o)  # cached: the "+ BKV" point above made them
    alpha = basis_of(bases[L]).alpha
    fig5 = {"layer": L, "alpha": alpha, **balance_norms(w.wk, w.wv, m.xx, rotation_of(rotations[L]), alpha),
            "ppl": ppl5, "budget": f.fig5_budget, "qk_rope_head_dim": budget.rope_dim,
            "kv_lora_rank": budget.kv_lora_rank, "tokens": f.ppl_max_tokens}

    files = {"fig4a": plot_fig4a(fig4a, out / "fig4a_key_norms.png"),
             "fig4b": plot_fig4b(fig4b, out / "fig4b_rope_removal.png"),
             "fig5": plot_fig5(fig5, out / "fig5_bkv.png")}
    summary = {"model": model, "files": files, "fig4a_energy": energy, "fig4b": fig4b,
               "fig5": {k: fig5[k] for k in ("alpha", "ppl", "budget", "qk_rope_head_dim", "kv_lora_rank", "tokens")}}
    # the pipeline's record (a DVC out) only for the pipeline's own run: a one-off into out_dir keeps it there
    record = layout.REPORTS / "metrics" / model / "figures.json" if out_dir is None else out / "figures.json"
    write_text_atomic(record, json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    _cli.entry(figures, __doc__, tracked=False, stats_file="calibration statistics file (default: computed, cached)")

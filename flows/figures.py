"""Flow: the paper's Figs. 4 and 5 for one model, from the cached statistics and per-layer steps.

    python -m flows.figures --model smollm2-135m [--stats FILE]

Writes reports/figures/<model>/{fig4a_key_norms,fig4b_rope_removal,fig5_bkv}.png and the numbers
behind them in reports/metrics/<model>/figures.json. Every perplexity point is a cached task, and
the rotations are the same cached tasks the convert flow uses.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from prefect import flow

from tasks.artifacts import file_ref, load_json
from tasks.bkv import basis_of
from tasks.calibrate import stats_of
from tasks.evaluate import perplexity, sweep_perplexity
from tasks.figures import plot_fig4a, plot_fig4b, plot_fig5
from tasks.model import dataset_ref, load, resolve_model
from tasks.rorope import layer_rotation, rotation_of
from transmla.adapters import attention_weights, read_spec
from transmla.convert import resolve_budget
from transmla.method.diagnostics import key_dim_rms, kv_dim_rms
from transmla.errors import TransMLAError
from transmla.io.paths import write_text_atomic
from transmla.method.rope import standard_plan

from . import _cli, layout
from .calibrate import stats_for
from .convert import convert_options, layer_steps
from .params import Profile


def _ppl(profile: Profile, model_ref, stats, o) -> float:
    f = profile.figures
    rotations, bases = layer_steps(model_ref, stats, o)
    ref = sweep_perplexity(model_ref, stats, rotations, bases, asdict(o), dataset_ref(profile.evaluation.ppl_dataset),
                           profile.evaluation.ppl_seqlen, f.ppl_max_tokens)
    return load_json(ref)["ppl"]


@flow(name="figures")
def figures(profile: Profile, model: str, stats_file: str | None = None, out_dir: str | None = None) -> dict:
    f = profile.figures
    model_ref = resolve_model(profile.model(model).source)
    stats = file_ref(stats_file) if stats_file else stats_for(profile, model_ref)
    m, _ = load(model_ref["path"])
    spec = read_spec(m.config)
    if f.layer >= spec.n_layers:
        raise TransMLAError(f"figures.layer={f.layer} but the model has {spec.n_layers} layers.", "lower figures.layer.")
    for R in (*f.rope_dims, f.fig4a_rope_dim):
        if R % 2 or spec.d % R or R > spec.d:
            raise TransMLAError(f"RoPE dim {R} does not divide head dim {spec.d} (or is odd).",
                                "use figures.rope_dims / fig4a_rope_dim that divide the head dim.")
    out = layout.figures_dir(model) if out_dir is None else Path(out_dir)
    st, L, w = stats_of(stats), f.layer, attention_weights(m, f.layer)
    xx, mu = st.second_moment(L), st.mean(L)
    full = 2 * spec.g * spec.d

    # Fig. 4a: where the key energy sits before / after RoRoPE (+ FreqFold), one layer.
    plan = standard_plan(spec.d, f.fig4a_rope_dim)
    series, energy = {"original": key_dim_rms(w.wk, w.bk, xx, mu).tolist()}, {}
    for label, fold in (("RoRoPE", 1), (f"RoRoPE + FreqFold {f.freqfold}", f.freqfold)):
        rot = rotation_of(layer_rotation(model_ref, stats, L, "transmla", plan, fold))
        series[label] = key_dim_rms(w.wk, w.bk, xx, mu, rot.T).tolist()
        energy[label] = rot.energy
    fig4a = {"layer": L, "rope_dim": f.fig4a_rope_dim, "series": series, "energy": energy}

    # Fig. 4b: drop RoPE from more and more dims at full KV rank.
    original = load_json(perplexity(model_ref, dataset_ref(profile.evaluation.ppl_dataset),
                                    profile.evaluation.ppl_seqlen, f.ppl_max_tokens))["ppl"]
    curves = {"MHA2MLA (2-norm)": [], "RoRoPE": [], f"RoRoPE + FreqFold {f.freqfold}": []}
    for R in f.rope_dims:
        for label, method, fold in (("MHA2MLA (2-norm)", "mha2mla", 1), ("RoRoPE", "transmla", 1),
                                    (f"RoRoPE + FreqFold {f.freqfold}", "transmla", f.freqfold)):
            o = convert_options(profile, method, None, qk_rope_dim=R, kv_lora_rank=full - R, freqfold=fold)
            curves[label].append([1 - R / spec.d, _ppl(profile, model_ref, stats, o)])
    fig4b = {"original": original, "curves": curves, "tokens": f.ppl_max_tokens}

    # Fig. 5: balancing, and weight- vs activation-based joint PCA at one budget.
    ppl5 = {}
    for pca in ("weights", "activations"):
        for bkv in (False, True):
            o = convert_options(profile, "transmla", f.fig5_budget, pca=pca, balance_kv=bkv)
            ppl5[f"{pca}{' + BKV' if bkv else ''}"] = _ppl(profile, model_ref, stats, o)
    o = convert_options(profile, "transmla", f.fig5_budget, balance_kv=True)
    budget = resolve_budget(spec, o)
    rotations, bases = layer_steps(model_ref, stats, o)  # cached: the "+ BKV" point above made them
    rot, alpha = rotation_of(rotations[L]), basis_of(bases[L]).alpha
    wk_nope = rot.T[rot.rope_dim:] @ w.wk
    k_before, v = kv_dim_rms(wk_nope, w.wv, xx)
    k_after, _ = kv_dim_rms(wk_nope, w.wv, xx, alpha)
    fig5 = {"layer": L, "alpha": alpha, "k_before": k_before.tolist(), "k_after": k_after.tolist(), "v": v.tolist(),
            "ppl": ppl5, "budget": f.fig5_budget, "qk_rope_head_dim": budget.rope_dim,
            "kv_lora_rank": budget.kv_lora_rank, "tokens": f.ppl_max_tokens}

    files = {"fig4a": plot_fig4a(fig4a, out / "fig4a_key_norms.png"),
             "fig4b": plot_fig4b(fig4b, out / "fig4b_rope_removal.png"),
             "fig5": plot_fig5(fig5, out / "fig5_bkv.png")}
    summary = {"model": model, "files": files, "fig4a_energy": energy, "fig4b": fig4b,
               "fig5": {k: fig5[k] for k in ("alpha", "ppl", "budget", "qk_rope_head_dim", "kv_lora_rank", "tokens")}}
    write_text_atomic(layout.REPORTS / "metrics" / model / "figures.json", json.dumps(summary, indent=2))
    return summary


def main():
    ap = _cli.parser(__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--stats", help="calibration statistics file (default: computed, cached)")
    args = ap.parse_args()
    figures(_cli.profile_of(args), args.model, args.stats)


if __name__ == "__main__":
    _cli.run(main)

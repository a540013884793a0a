"""Stage 6: the paper's figures as PNGs (matplotlib, headless) from data computed by the flow.

Fig. 4a  per-dimension key RMS of one layer before / after RoRoPE / after RoRoPE + FreqFold
Fig. 4b  log perplexity vs RoPE-removal ratio: MHA2MLA 2-norm vs RoRoPE vs RoRoPE + FreqFold
Fig. 5   NoPE-key and value RMS before / after balancing; perplexity of weight- vs activation-based
         PCA with and without BKV at one budget
"""

from __future__ import annotations

import math
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    from transmla.io.paths import atomic_file

    with atomic_file(path) as tmp:
        # Fixed metadata so an unchanged figure is byte-identical (DVC/git see no change).
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    _plt().close(fig)
    return str(path)


@task(name="plot_fig4a", cache_policy=NO_CACHE)
def plot_fig4a(data: dict, path: Path) -> str:
    """data: {"layer", "rope_dim", "series": {label: [rms per merged-key dim]}, "energy": {label: frac}}."""
    plt = _plt()
    series = data["series"]
    fig, axes = plt.subplots(len(series), 1, figsize=(10, 2.2 * len(series)), sharex=True)
    R = data["rope_dim"]
    for ax, (label, ys) in zip(axes, series.items()):
        ax.bar(range(len(ys)), ys, width=1.0, color=["tab:red" if (label != "original" and i < R) else "tab:blue"
                                                      for i in range(len(ys))])
        e = data["energy"].get(label)
        ax.set_title(label + ("" if e is None else f"  (first {R} dims keep RoPE: {100 * e:.1f}% of key energy)"),
                     fontsize=9)
        ax.set_ylabel("RMS")
    axes[-1].set_xlabel("merged key dimension (original: head-major; rotated: RoPE dims first, red)")
    fig.suptitle(f"Key norms per dimension, layer {data['layer']} (paper Fig. 4a)", fontsize=10)
    return _save(fig, path)


@task(name="plot_fig4b", cache_policy=NO_CACHE)
def plot_fig4b(data: dict, path: Path) -> str:
    """data: {"original": ppl, "curves": {label: [[removal_ratio, ppl], ...]}, "tokens"}."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in data["curves"].items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [math.log(p[1]) for p in pts], marker="o", label=label)
    ax.axhline(math.log(data["original"]), color="gray", ls="--", label="original")
    ax.set_xlabel("RoPE removal ratio (1 - R/d)")
    ax.set_ylabel("log perplexity (WikiText-2)")
    ax.set_title(f"Dropping RoPE at full KV rank, {data['tokens']} tokens (paper Fig. 4b)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


@task(name="plot_fig5", cache_policy=NO_CACHE)
def plot_fig5(data: dict, path: Path) -> str:
    """data: {"layer", "alpha", "k_before", "k_after", "v", "ppl": {label: ppl}, "budget", "tokens"}."""
    plt = _plt()
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [2, 2, 1.4]})
    for ax, k, title in ((a1, data["k_before"], "before balancing"),
                         (a2, data["k_after"], f"after balancing (k / alpha, alpha = {data['alpha']:.2f})")):
        n = len(k)
        ax.bar(range(n), k, width=1.0, color="tab:orange", label="NoPE key")
        ax.bar(range(n, n + len(data["v"])), data["v"], width=1.0, color="tab:green", label="value")
        ax.set_title(f"layer {data['layer']}: {title}", fontsize=9)
        ax.set_xlabel("dimension of [k_nope ; v]")
        ax.set_ylabel("RMS")
        ax.legend(fontsize=8)
    labels = list(data["ppl"])
    a3.bar(range(len(labels)), [data["ppl"][lbl] for lbl in labels],
           color=["tab:gray", "tab:gray", "tab:blue", "tab:blue"][: len(labels)])
    a3.set_yscale("log")
    a3.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    a3.set_ylabel("perplexity (log scale)")
    a3.set_title(f"PCA at KV ratio {data['budget']} ({data['tokens']} tokens)", fontsize=9)
    fig.suptitle("Balanced KV (paper Fig. 5)", fontsize=10)
    return _save(fig, path)

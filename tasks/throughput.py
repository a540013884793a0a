"""Stage 8: decode throughput of the original vs the converted model on this machine (paper
appendix F), and the paper's Fig. 6 (speedup vs context length).

Backends: the original with its own cache (`hf`), the converted DeepseekV3 as stock transformers runs
it (`hf`), and the converted model decoding with the Absorb operation over a latent-only cache
(`absorb`). Two measurements (transmla.runtime.throughput):

    steady decode   time per output token at each context length (`decode_step`: one prefill of
                    `context` tokens replicated to the batch, then timed single-token steps)
    paper run       the whole protocol at short contexts (`measure`: batch requests, input = output
                    = context / 2, greedy, no EOS stop), output tokens/s over prefill + decode

Cached like every task (inputs' content hashes + params + library code), so `dvc repro` re-measures
only when a model, a param or the measurement code changed.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.io.sources import load_model
from transmla.runtime import hugepages
from transmla.runtime.absorb import enable_absorb
from transmla.runtime.packed import OP_KERNELS
from transmla.runtime.throughput import (GIB, bound_fields, decode_step, floor_fields, kv_bytes_per_token,
                                         kv_capacity_tokens, measure, memory_bandwidth, peak_flops, readings_summary)

from .artifacts import cached_task, save_json
from .figures import _plt, _save

# (label, which model, backend) in table order. "original" is the stock default (DynamicCache, what
# `generate` uses); "original static" its best stock form (preallocated StaticCache, SDPA, GQA heads
# never repeated): the baseline the speedups are against.
RUNS = (("original", "original", "hf"), ("original static", "original", "static"),
        ("converted hf", "converted", "hf"), ("converted absorb", "converted", "absorb"))
FULL_RUNS = tuple(r for r in RUNS if r[2] != "static")  # the whole paper run uses generate's own caches
BASELINES = ("original", "original static")
# the runs in their best form: with `packed_weights`, every linear layer on weights prepacked for the
# batch (transmla.runtime.packed; CPU float32), the original's best baseline as much as the absorbed MLA
PACKED_RUNS = ("original static", "converted absorb")
# with `compiled_decode`, the absorbed run's steps as one compiled graph (transmla.runtime.compiled_decode)
COMPILED_RUNS = ("converted absorb",)
ATTENTION_NAMES = {"cpu": "this project's C++ latent kernel (`transmla.runtime.cpu_kernels`)",
                   "sdpa": "PyTorch's SDPA", "bmm": "two batched matmuls", "triton": "the Triton split-K kernel",
                   "splitk_torch": "the split-K kernel's PyTorch form (Triton cannot run here)"}
GEMM_NAMES = {"mkl": "MKL's packed sgemm", "onednn": "oneDNN's blocked layout",
              "stream": "the stream kernel on the stock layout (`transmla.runtime.cpu_kernels`)",
              "tiled": "the tiled kernel on a copy packed k-major in 48-column tiles (`transmla.runtime.cpu_kernels`)"}


def median_row(rows: list[dict]) -> dict:
    """One steady-decode cell from repeated measurements: the median repeat (by time per token), with
    the range of the repeats' medians (min, max) beside it. For an even count it is the slower of the
    middle two, a whole measured row (its other columns derive from its time), not their mean."""
    rows = sorted(rows, key=lambda r: r["time_per_output_token_ms"])
    mid = dict(rows[len(rows) // 2])
    mid["repeats"] = len(rows)
    mid["time_per_output_token_range_ms"] = [rows[0]["time_per_output_token_ms"], rows[-1]["time_per_output_token_ms"]]
    compile_s = [r["compile_s"] for r in rows if r.get("compile_s") is not None]
    if compile_s:  # the repeat that compiled (the others reuse its graph)
        mid["compile_s"] = max(compile_s)
    return mid


@cached_task("throughput")
def throughput(original: dict, converted: dict, contexts: list[int], batch: int, steps: int,
               full_contexts: list[int], threads: int | None, cache_memory_gib: float, device: str = "cpu",
               repeats: int = 3, packed_weights: bool = False, compiled_decode: bool = False,
               native_decode: bool = False, host: str | None = None) -> dict:
    """-> ref to {"decode": [rows], "full": [rows], "kv": {...}, "bandwidth": {...}, "compute": {...}} for every run.
    host: the machine that measures (runtime.throughput.processor_name), in the key only: timings from another
    machine sharing the store (a copied cache, a DVC remote) are measured again, not reported as this one's."""
    from tqdm.auto import tqdm

    models = {"original": load_model(original["path"], device=device)[0],
              "converted": load_model(converted["path"], device=device)[0]}
    # on CPU every run's weights and preallocated decode cache in 2 MB pages (runtime.hugepages), the
    # baselines' as much as the converted model's: a decode step streams them all, and in the 4 KB pages of
    # the safetensors mapping that is a TLB miss per 4 KB and a prefetcher stopped at every page boundary
    on_cpu = str(device).startswith("cpu")
    pages = {name: hugepages.to_hugepages(m) for name, m in models.items()} if on_cpu else {}
    # the copy bandwidth and the matmul peak read before the runs, before every steady-decode cell and after
    # them: the bounds and floors divide by the median readings (`readings_summary`), one reading swings
    # with the host's load
    dtype = next(models["converted"].parameters()).dtype
    readings, peaks = [], []

    def read():
        readings.append(memory_bandwidth(device, hugepages=on_cpu))
        peaks.append(peak_flops(device, dtype, threads=threads))

    read()
    # the paper runs first: their peak RSS then holds the models, not what compiling leaves resident
    plan = [("full", c, run) for c in full_contexts for run in FULL_RUNS] + [("decode", c, run) for c in contexts for run in RUNS]
    out = {"decode": [], "full": []}
    # one GEMM kernel for every packed run, chosen by measurement on the first one's weights: the speedups
    # compare the same kernel (chosen per model, noise could pick two for a tiny model's near-equal timings)
    gemm = "auto"
    bar = tqdm(plan, desc="throughput", unit="run")
    for kind, context, (label, which, backend) in bar:
        bar.set_postfix(kind=kind, context=context, run=label)
        if kind == "decode" and compiled_decode and label in COMPILED_RUNS:
            # the converted model's module tree once more over the same weights (parameters shared, not
            # copied), absorbed once for all its runs: the compiled graph holds the absorbed matrices it
            # was traced with, so absorbing the stock instance anew for each run (it alternates with
            # "converted hf") would compile again at every context and repeat
            if "converted absorbed" not in models:
                shared = {id(p): p for p in models["converted"].parameters()}
                models["converted absorbed"] = enable_absorb(copy.deepcopy(models["converted"], memo=shared))
            which = "converted absorbed"
        m = models[which]
        if kind == "decode":
            read()
            row = median_row([decode_step(m, backend, context, batch, steps=steps, threads=threads, seed=i,
                                          packed_weights=packed_weights and label in PACKED_RUNS,
                                          compiled=compiled_decode and label in COMPILED_RUNS, native=native_decode, gemm=gemm,
                                          hugepages=on_cpu)
                              for i in range(repeats)])
            gemm = row.get("gemm") or gemm
            row["bandwidth_before_bytes_per_s"] = readings[-1]["bytes_per_s"]
            row["flops_before_per_s"] = peaks[-1]["flops_per_s"]
        else:
            row = measure(m, backend, context, batch, threads=threads, cache_memory_bytes=int(cache_memory_gib * GIB))
        out[kind].append({"run": label, **row})
    read()
    out["bandwidth"] = bw = readings_summary(readings, "bytes_per_s")
    out["compute"] = peak = readings_summary(peaks, "flops_per_s")
    for row in out["decode"]:
        row.update(floor_fields(row, peak["flops_per_s"], peak["range_flops_per_s"]))
        row.update(bound_fields(row, row["time_per_output_token_ms"] / 1e3, bw["bytes_per_s"], bw["range_bytes_per_s"]))
    mem = int(cache_memory_gib * GIB)
    kv = {label: kv_bytes_per_token(models[which].config, backend) for label, which, backend in FULL_RUNS}
    out["kv"] = {label: {"bytes_per_token": b, "capacity_tokens": kv_capacity_tokens(b, mem),
                         "capacity_ratio": kv["original"] / b} for label, b in kv.items()}
    out["cache_memory_gib"] = cache_memory_gib
    out["hugepages"] = pages
    return save_json("throughput", out)


@cached_task("vllm_throughput")
def vllm_throughput(original: dict, converted: dict, contexts: list[int], requests: int, threads: int | None,
                    host: str | None = None, engine: dict | None = None) -> dict:
    """vLLM's offline throughput (paper protocol: `requests` random prompts, input = output = context / 2)
    of the original and of the converted model, padded to the MLA sizes vLLM's kernels serve
    (transmla.runtime.serving) -> ref to {"rows": [...]}. Needs the vLLM environment (transmla.runtime.vllm_env).
    host: as for `throughput` (the key only); engine: the vLLM environment (runtime.vllm_env.environment), likewise."""
    from transmla.runtime.serving import pad_checkpoint
    from transmla.runtime.vllm_env import run_vllm

    from .artifacts import task_dir

    padded = task_dir() / "converted-vllm"
    if not (padded / "config.json").is_file():
        pad_checkpoint(converted["path"], padded)
    rows = []
    for context in contexts:
        for label, path in (("vllm original", original["path"]), ("vllm converted (padded)", str(padded))):
            res = run_vllm({"task": "throughput", "model": path, "input_len": context // 2,
                            "output_len": context - context // 2, "num_prompts": requests, "dtype": "float32"},
                           threads=threads, timeout=None)
            rows.append({"run": label, "context": context, **res})
    return save_json("vllm_throughput", {"rows": rows})


def best_original_ms(by: dict, c: int) -> float | None:
    """The faster of the original's stock default and best stock decode at context c (ms per token)."""
    times = [by[(b, c)] for b in BASELINES if (b, c) in by]
    return min(times) if times else None


def speedups(result: dict) -> dict[str, list[tuple[int, float]]]:
    """Decode speedup over the best original baseline per context: {run: [(context, best original ms / run ms)]}."""
    by = {(r["run"], r["context"]): r["time_per_output_token_ms"] for r in result["decode"]}
    contexts = sorted({c for _, c in by})
    return {run: [(c, best_original_ms(by, c) / by[(run, c)]) for c in contexts if (run, c) in by and best_original_ms(by, c)]
            for run, _, _ in RUNS if run not in BASELINES}


def table(result: dict, title: str) -> str:
    """Markdown: steady decode per context, the paper run at short contexts, KV bytes and capacity."""
    dec = {(r["run"], r["context"]): r for r in result["decode"]}
    contexts = sorted({c for _, c in dec})
    runs = [label for label, _, _ in RUNS if any(k[0] == label for k in dec)]
    others = [r for r in runs if r not in BASELINES]
    first = result["decode"][0] if result["decode"] else {}
    bw = result.get("bandwidth")
    lines = [f"# Throughput: {title}", "", "<!-- Generated by `dvc repro` (flows/throughput.py); do not edit by hand. -->", "",
             f"Steady decode, batch {first.get('batch')}: output tokens/s, time per output token in ms (the median "
             f"of {first.get('repeats', 1)} measurements of {first.get('steps')} steps each, with their range) and, in "
             "brackets, that time as a multiple of the step's memory-bandwidth bound (every weight read once + the "
             "batch's KV cache, over the measured bandwidth). original = stock default (DynamicCache); original "
             "static = its best stock form (preallocated StaticCache); speedup = the faster of the two / this run.", ""]
    packed = sorted({r["run"] for r in result["decode"] if r.get("packed_weights")}, key=[x[0] for x in RUNS].index)
    gemm = {r["gemm"] for r in result["decode"] if r.get("gemm")}
    gemm_name = " / ".join(GEMM_NAMES.get(g, g) for g in sorted(gemm)) or "MKL's packed sgemm"
    stream = gemm == {"stream"}  # nothing packed: the kernel reads the stock weights
    if packed and stream:
        lines += [f"{' and '.join(packed)}: every linear layer through {gemm_name}, which reads each weight once per "
                  "step for all rows of the batch (`transmla.runtime.packed`; no packed copy); the stock runs on "
                  "PyTorch's F.linear.", ""]
    elif packed:
        lines += [f"{' and '.join(packed)}: every linear layer on weights prepacked once for the batch ({gemm_name}, "
                  "`transmla.runtime.packed`; the packed copy takes about the weights' memory once more"
                  + ("; the tiled copies in 2 MB pages where the kernel offers them" if "tiled" in gemm else "")
                  + "); the stock runs on PyTorch's own weight layout.", ""]
    compiled = [r for r in result["decode"] if r.get("compiled")]
    native = [r for r in compiled if r.get("decode_loop") == "native"]
    compiled = [r for r in compiled if r.get("decode_loop") != "native"]
    if native:
        lines += [f"{' and '.join(sorted({r['run'] for r in native}))}: each step one native call "
                  "(`transmla.runtime.native_decode`: every decoder layer, the final norm and the head in one OpenMP "
                  f"region, its phases separated by barriers; every linear through {gemm_name}, the linears of one input "
                  "(each MLP's gate and up; the folded query and kv_a_proj) one product over their copies side by side) "
                  "over a static latent cache (`transmla.runtime.compiled_decode`).", ""]
    if compiled:
        first_compile = max(r.get("compile_s") or 0 for r in compiled)
        ours = bool(gemm) and gemm <= set(OP_KERNELS)  # this project's kernels: operator calls in the graph
        how = (f"weights frozen, every linear one call of {gemm_name}" if ours
               else f"weights frozen and prepacked by it for {gemm_name}")
        if gemm == {"tiled"}:  # runtime.packed.sibling_linears: the linears of one input packed side by side
            how += ("; the linears of one input (each MLP's gate and up; the folded query and kv_a_proj) one call "
                    "over their copies side by side")
        lines += [f"{' and '.join(sorted({r['run'] for r in compiled}))}: each step one torch.compile graph (inductor, "
                  f"{how}) over a static latent cache "
                  f"(`transmla.runtime.compiled_decode`); compiling took {first_compile:.0f} s once, not in the times.", ""]
    attention = sorted({r["decode_attention"] for r in result["decode"] if r.get("decode_attention")})
    if attention:
        blocked = any(r.get("latent_layout") == "blocked" for r in result["decode"])
        lines += ["converted absorb, single-token attention over the latent: "
                  + " / ".join(ATTENTION_NAMES.get(a, a) for a in attention)
                  + (" (compiled runs: over the blocked latent cache, 16 tokens per block with the keys in the vector "
                     "lanes)" if blocked else "") + ".", ""]
    pass_ms = next((r["gemm_pass_ms"] for r in result["decode"] if r.get("gemm_pass_ms")), None)
    if pass_ms:
        lines += ["GEMM kernel chosen by measurement on this CPU (`packed.fastest_kernel`: one pass of the batch "
                  "through every linear weight): " + ", ".join(f"{GEMM_NAMES.get(k, k)} {v:.0f} ms" for k, v in pass_ms.items())
                  + ".", ""]
    pages = result.get("hugepages") or {}
    if pages:
        moved = {k: v for k, v in pages.items() if v.get("moved")}
        cached = sorted({r["run"] for r in result["decode"] if r.get("cache_hugepages")}, key=[x[0] for x in RUNS].index)
        if moved:
            lines += ["Memory pages: every run's weights in 2 MB pages (`transmla.runtime.hugepages`, transparent huge "
                      "pages; " + ", ".join(f"{k} {v['hugepage_bytes'] / 2**20:.0f} of {v['bytes'] / 2**20:.0f} MiB backed "
                                            "by them" for k, v in moved.items())
                      + ")" + (f"; the preallocated decode caches of {' and '.join(cached)} too" if cached else "")
                      + "; the bandwidth copies from 2 MB pages as well.", ""]
        else:
            lines += ["Memory pages: 4 KB (" + "; ".join(sorted({v.get("reason") or "" for v in pages.values()})) + ").", ""]
    if bw:
        host = f"{bw['processor']}; " if bw.get("processor") else ""
        lo, hi = bw["range_bytes_per_s"]
        lines += [f"Measured memory bandwidth ({host}{bw['device']}; a {bw['copy_bytes'] / GIB:.0f} GiB copy, median of "
                  f"{bw['repeats']} copies per reading; {bw['readings']} readings, before the runs, before each "
                  f"steady-decode cell and after them): median {bw['bytes_per_s'] / 1e9:.1f} GB/s, range "
                  f"{lo / 1e9:.1f}-{hi / 1e9:.1f} GB/s. The bounds below divide by the median; the roofline table also "
                  "gives each time against the lowest and the highest reading.", ""]
    lines += ["| context | " + " | ".join(runs) + " | " + " | ".join(f"speedup {r}" for r in others) + " |",
              "|---:|" + "---:|" * (len(runs) + len(others))]

    def cell(r):
        rng = r.get("time_per_output_token_range_ms")
        spread = f" [{rng[0]:.0f}-{rng[1]:.0f}]" if rng and r.get("repeats", 1) > 1 else ""
        bound = f" ({r['x_of_bound']:.1f}x bound)" if r.get("x_of_bound") else ""
        return f"{r['decode_tokens_per_s']:.1f}, {r['time_per_output_token_ms']:.0f} ms{spread}{bound}"

    by = {k: v["time_per_output_token_ms"] for k, v in dec.items()}
    for c in contexts:
        cells = [cell(dec[(r, c)]) if (r, c) in dec else "-" for r in runs]
        base = best_original_ms(by, c)
        sp = [f"{base / dec[(r, c)]['time_per_output_token_ms']:.2f}x" if base and (r, c) in dec else "-" for r in others]
        lines.append(f"| {c:,} | " + " | ".join(cells) + " | " + " | ".join(sp) + " |")
    roof = [r for r in result["decode"] if r.get("compute_floor_ms") and r.get("bound_ms")]
    if roof:
        peak = result["compute"]
        lo, hi = peak["range_flops_per_s"]
        lines += ["", "Roofline of each step: the bandwidth bound (weights read once + the batch's KV cache, over "
                  "the measured bandwidth) and the compute floor (the step's multiply-adds, 2 operations each: "
                  f"linears + attention, over the measured matmul peak, an {peak['n']}^3 matmul in {peak['dtype']} on "
                  f"{peak['threads']} threads, the best of {peak['repeats']} per reading, read with the bandwidth: median "
                  f"{peak['flops_per_s'] / 1e9:.0f} GFLOP/s of {peak['readings']} readings, range "
                  f"{lo / 1e9:.0f}-{hi / 1e9:.0f}). Where the two are close, a step near either needs its memory reads and its arithmetic to "
                  "overlap almost perfectly.", "",
                  "| context | run | bandwidth bound ms (weights + KV) | compute floor ms (linears + attention) | "
                  "measured ms | x of bandwidth bound (at the lowest-highest reading) | x of the larger |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in sorted(roof, key=lambda r: (r["context"], runs.index(r["run"]) if r["run"] in runs else 0)):
            bw_ms = r["bound_ms"]
            w_ms = bw_ms * r["weight_bytes"] / r["step_bytes"]
            xr = r["x_of_bound_range"]
            x = f"{r['x_of_bound']:.1f}x ({xr[0]:.1f}-{xr[1]:.1f})"
            lines.append(f"| {r['context']:,} | {r['run']} | {bw_ms:.1f} ({w_ms:.1f} + {bw_ms - w_ms:.1f}) | "
                         f"{r['compute_floor_ms']:.1f} ({r['linear_floor_ms']:.1f} + {r['attention_floor_ms']:.1f}) | "
                         f"{r['time_per_output_token_ms']:.0f} | {x} | {r['x_of_roofline']:.1f}x |")
    if result["full"]:
        lines += ["", "Paper protocol (input = output = context / 2, greedy, no EOS stop): output tokens/s over "
                  "prefill + decode, time per output token, prefill seconds, peak RSS of the process.", "",
                  "| context | run | batch | output tokens/s | ms / output token | prefill s | peak RSS GiB |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in result["full"]:
            lines.append(f"| {r['context']:,} | {r['run']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                         f"{r['time_per_output_token_ms']:.0f} | {r['prefill_s']:.1f} | {r['peak_rss_gib']:.2f}"
                         + (f" (GPU {r['peak_gpu_gib']:.2f})" if "peak_gpu_gib" in r else "") + " |")
    if result.get("vllm_throughput"):
        lines += ["", "vLLM offline throughput (paper protocol, random prompts): output tokens/s.", "",
                  "| context | run | requests | output tokens/s | total tokens/s |", "|---:|---|---:|---:|---:|"]
        for r in result["vllm_throughput"]:
            lines.append(f"| {r['context']:,} | {r['run']} | {r['num_prompts']} | {r['output_tokens_per_s']:.1f} | "
                         f"{r['total_tokens_per_s']:.1f} |")
    gib = result["cache_memory_gib"]
    lines += ["", f"KV cache per token (all layers, float32) and the tokens that fit in {gib:g} GiB of cache memory:", "",
              "| run | bytes / token | tokens in cache memory | capacity vs original |", "|---|---:|---:|---:|"]
    for r in [label for label, _, _ in FULL_RUNS]:
        k = result["kv"][r]
        lines.append(f"| {r} | {k['bytes_per_token']:,} | {k['capacity_tokens']:,} | {k['capacity_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


@task(name="plot_fig6", cache_policy=NO_CACHE)
def plot_fig6(result: dict, title: str, path: Path) -> str:
    """Decode speedup over the original vs context length (paper Fig. 6)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run, points in speedups(result).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=run)
        for x, y in points:
            ax.annotate(f"{y:.1f}x", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode speedup over the original")
    ax.set_title(f"{title} (paper Fig. 6, this CPU)", fontsize=10)
    ax.legend(fontsize=8)
    ax.set_ylim(0, max(2.0, math.ceil(max(y for pts in speedups(result).values() for _, y in pts) + 0.5)))
    return _save(fig, path)


def write_report(result: dict, title: str, dest: Path) -> None:
    """reports/throughput/<model>/<variant>/: results.json, throughput.md (with the vLLM check), Fig. 6."""
    import json

    from transmla.io.paths import atomic_dir

    text = table(result, title)
    v = result["vllm"]
    text += f"\nvLLM serving check: **{v['status']}**" + (f" ({v['reason']})" if v.get("reason") else "") + "\n"
    for line in v.get("details", []):
        text += f"- {line}\n"
    with atomic_dir(dest) as tmp:
        (tmp / "results.json").write_text(json.dumps(result, indent=2, default=str))
        (tmp / "throughput.md").write_text(text)
        plot_fig6(result, title, tmp / "fig6_speedup.png")


def tracked(result: dict) -> dict:
    """MLflow metrics, curves (step = context length) and tags of a throughput result."""
    v = result["vllm"]
    history = {f"throughput.speedup.{run.replace(' ', '_')}": points for run, points in speedups(result).items()}
    for r in result["decode"]:
        history.setdefault(f"throughput.decode_tokens_per_s.{r['run'].replace(' ', '_')}", []).append(
            (r["context"], r["decode_tokens_per_s"]))
    return {"metrics": {"throughput.kv_capacity_ratio": result["kv"]["converted absorb"]["capacity_ratio"],
                        "throughput.vllm_serving_ok": float(v["status"] == "passed")},
            "history": history, "tags": {"throughput.vllm": v["status"]}}

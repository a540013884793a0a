"""Benchmark: the training-free conversion modes side by side (reports/ablation/<model>.{json,md}).

    .venv/bin/python scripts/ablation.py --model smollm2-135m [--budgets 0.3125,0.125] [--rows ROW,ROW]

Per KV budget and row (conversion mode), one `transmla convert` in its own process (so its wall time
and peak RSS are its own), then on the exported stock DeepseekV3 checkpoint:
  - WikiText-2 test perplexity, first --ppl-tokens tokens in 2048-token windows (the paper's protocol);
  - c4-demo perplexity, same protocol (held out: calibration uses WikiText-2 train);
  - greedy 24-token continuations of the case-study prompts, scored by the original model
    (transmla.evaluation.prompts).
Next to them: one plain forward (with logits) of the original model over the calibration tokens, and
the model's float32 size. Rows already in the JSON with the same protocol are kept (resumable).

    .venv/bin/python scripts/ablation.py --model smollm2-135m --retime

re-runs every row's conversion (and the plain forward) only for its wall time and peak RSS, keeping
the quality columns (conversions are deterministic): run it on a quiet machine, since a time taken
beside other work is not a measurement.

    .venv/bin/python scripts/ablation.py --model smollm2-135m --rescore

adds the 4-gram loop measure (prompts.loop_fields) to rows saved before it existed, from their stored
continuation text re-tokenized (marked in the table), and the original model's own count.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _common import check_report_out, report_stem, run  # noqa: E402

from transmla.config import ConvertOptions  # noqa: E402
from transmla.convert import calibration_windows  # noqa: E402
from transmla.evaluation import prompts  # noqa: E402
from transmla.evaluation.perplexity import perplexity, tokenize_corpus  # noqa: E402
from transmla.io.data import load_texts  # noqa: E402
from transmla.io.paths import write_text_atomic  # noqa: E402
from transmla.io.sources import load_model  # noqa: E402
from transmla.runtime.fast_attention import use_causal_padded_sdpa  # noqa: E402

CODE_CAL = ["--cal-dataset", f"wikitext2-train+path:{Path(os.__file__).parent}"]
SHORT_CAL = ["--cal-nsamples", "512", "--cal-seqlen", "64"]
# name -> (label, `transmla convert` flags)
ROWS = {
    "mha2mla": ("MHA2MLA", ["--method", "mha2mla"]),
    "transmla": ("TransMLA, one pass (paper)", ["--paper"]),
    "two_pass": ("TransMLA, two passes (authors' code)", ["--paper", "--calibration", "two_pass"]),
    "sequential": ("+ sequential calibration", ["--paper", "--calibration", "sequential"]),
    # key metric, as the report's rows were made (the default became query-metric on 2026-11-27)
    "sequential_aa": ("+ sequential + attention-aware", ["--calibration", "sequential", "--no-refit",
                                                         "--rorope-metric", "key"]),
    "refit": ("+ LS refit (one pass)", ["--paper", "--refit"]),
    "sequential_refit": ("+ sequential + LS refit", ["--paper", "--calibration", "sequential", "--refit"]),
    "all": ("all combined, key-metric RoRoPE (the default until 2026-11-27)", ["--rorope-metric", "key"]),
    "all_qm": ("all combined, query-metric RoRoPE (default)", ["--rorope-metric", "query"]),
    # Opt-in (--rows): a code model calibrated half on code. The running interpreter's standard library
    # is Python source every machine has, so the row reproduces without a code data set.
    "all_code": ("all combined, key-metric RoRoPE, calibration half Python source", ["--rorope-metric", "key", *CODE_CAL]),
    "all_code_qm": ("all combined, query-metric RoRoPE, calibration half Python source", ["--rorope-metric", "query", *CODE_CAL]),
    # Opt-in: short calibration windows (the same 32,768 tokens) weight the early positions a short prompt
    # lives in 4x more than 256-token windows do.
    "all_short": ("all combined, key-metric RoRoPE, calibration in 512 x 64-token windows", ["--rorope-metric", "key", *SHORT_CAL]),
    "all_code_qm_short": ("all combined, query-metric RoRoPE, calibration half Python source in 512 x 64-token windows",
                          ["--rorope-metric", "query", *CODE_CAL, *SHORT_CAL]),
}
OPT_IN = ("all_code", "all_code_qm", "all_short", "all_code_qm_short")
DEFAULT_ROWS = [r for r in ROWS if r not in OPT_IN]
DATASETS = ("wikitext2-test", "c4-demo")


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def plain_forward_times(model, tok, o: ConvertOptions, repeats: int = 3) -> dict:
    """Wall and CPU seconds (plain_forward_seconds, plain_forward_cpu_seconds) of one forward with logits over the calibration windows (what a conversion is
    compared with), each the median of `repeats` runs: single wall times on this machine ranged 30-38 s
    for SmolLM2; CPU time leaves out the time a shared host gives to other machines (not the contention
    on the same cores)."""
    ids = calibration_windows(tok, o)
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            for s in range(0, ids.shape[0], o.cal_batch_size):
                model(ids[s : s + o.cal_batch_size], use_cache=False)
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return {"plain_forward_seconds": round(_median(walls), 2), "plain_forward_cpu_seconds": round(_median(cpus), 2)}


def convert_row(source: str, budget: float, flags: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "transmla.cli", "convert", "--model", source, "--out", str(out),
           "--kv-cache-ratio", str(budget), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"convert failed ({' '.join(cmd)}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def save(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(res, indent=1))
    write_text_atomic(out.with_suffix(".md"), markdown(res))


def retime(args, res: dict, out: Path, model, tok, o: ConvertOptions, rows: list[str]) -> None:
    """Conversion wall time and peak RSS of the rows `rows` at the budgets --budgets again, each convert
    between two plain forwards: F C F C F ... (--repeats converts). This machine's speed drifts by 20-40%
    within minutes, so a convert is compared with the forwards timed right before and after it (their
    mean), and the row keeps the median of those ratios (wall and CPU) with their range."""
    if not res["rows"]:
        raise SystemExit(f"--retime: {out} has no rows with this protocol; run the ablation first")
    for r in res["rows"]:  # rows not retimed keep the forward they were timed against
        r.setdefault("plain_forward_seconds", res["plain_forward_seconds"])
        if "plain_forward_cpu_seconds" in res:
            r.setdefault("plain_forward_cpu_seconds", res["plain_forward_cpu_seconds"])
    budgets = {float(b) for b in args.budgets.split(",")}
    for r in res["rows"]:
        if r["row"] not in rows or r["budget"] not in budgets:
            continue
        fwds, infos = [plain_forward_times(model, tok, o, repeats=1)], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                infos.append(convert_row(args.model, r["budget"], ROWS[r["row"]][1], Path(tmp) / "model"))
            fwds.append(plain_forward_times(model, tok, o, repeats=1))
        wall = [i["compute_seconds"] * 2 / (a["plain_forward_seconds"] + b["plain_forward_seconds"])
                for i, a, b in zip(infos, fwds, fwds[1:])]
        cpu = [i["compute_cpu_seconds"] * 2 / (a["plain_forward_cpu_seconds"] + b["plain_forward_cpu_seconds"])
               for i, a, b in zip(infos, fwds, fwds[1:])]
        r.update({k: _median([i[k] for i in infos]) for k in ("seconds", "calibration_seconds", "compute_seconds",
                                                          "compute_cpu_seconds", "peak_rss_gib")},
                 plain_forward_seconds=_median([f["plain_forward_seconds"] for f in fwds]),
                 plain_forward_cpu_seconds=_median([f["plain_forward_cpu_seconds"] for f in fwds]),
                 compute_x_forward=[round(_median(wall), 3), round(min(wall), 3), round(max(wall), 3)],
                 compute_cpu_x_forward=[round(_median(cpu), 3), round(min(cpu), 3), round(max(cpu), 3)])
        res.update({k: r[k] for k in ("plain_forward_seconds", "plain_forward_cpu_seconds")})
        save(res, out)
        print(json.dumps({k: r[k] for k in ("row", "budget", "seconds", "compute_seconds", "compute_cpu_seconds",
                                            "peak_rss_gib", "compute_x_forward", "compute_cpu_x_forward")}), flush=True)


def original_prompts(model, tok) -> dict:
    """The original model's own short-prompt summary (its continuations scored by itself)."""
    return prompts.summary(prompts.score_continuations(model, tok, prompts.greedy_continuations(model, tok)))


def rescore(res: dict, out: Path, model, tok) -> None:
    """prompt_loops for rows without it, from each stored continuation's text re-tokenized (a decoded
    continuation re-encodes to the same ids but for rare merges: marked `loops_from_text`)."""
    if not res["rows"]:
        raise SystemExit(f"--rescore: {out} has no rows with this protocol; run the ablation first")
    for r in res["rows"]:
        if "prompt_loops" in r:
            continue
        for p in r["prompts"]:
            p.update(prompts.loop_fields(tok(p["continuation"], add_special_tokens=False).input_ids))
        r["prompt_loops"] = sum(p["loops"] for p in r["prompts"])
        r["loops_from_text"] = True
    if "prompt_loops" not in res["original"]:
        res["original"].update(original_prompts(model, tok))
    save(res, out)


def markdown(res: dict) -> str:
    def _compute(r):
        c = r.get("compute_seconds")
        fwd = r.get("plain_forward_seconds", res["plain_forward_seconds"])  # the row's own run, else the report's
        if c is None:
            return "n/a"
        if "compute_x_forward" in r:  # interleaved: median ratio against the bracketing forwards, with its range
            (w, w0, w1), (u, u0, u1) = r["compute_x_forward"], r["compute_cpu_x_forward"]
            return f"{c:.0f} ({w:.2f}x, {w0:.2f}-{w1:.2f}); CPU {u:.2f}x ({u0:.2f}-{u1:.2f})"
        cpu, cpu_fwd = r.get("compute_cpu_seconds"), r.get("plain_forward_cpu_seconds")
        return f"{c:.0f} ({c / fwd:.1f}x)" + ("" if cpu is None or not cpu_fwd else f"; CPU {cpu / cpu_fwd:.2f}x")

    def _loops(r):
        return "n/a" if "prompt_loops" not in r else f"{r['prompt_loops']}{'*' if r.get('loops_from_text') else ''}"

    pr = res["protocol"]
    in_dtype = f", forwards in {pr['eval_dtype']}" if "eval_dtype" in pr else ""
    lines = [f"# Conversion ablation: {res['model']}", "",
             f"Perplexity: first {pr['ppl_tokens']:,} tokens of each test set in {pr['seqlen']}-token windows, "
             f"ppl = exp(mean NLL){in_dtype}. Original model: WikiText-2 {res['original']['wikitext2-test']:.2f}, c4-demo "
             f"{res['original']['c4-demo']:.2f}. Calibration: {pr['calibration']}. Prompts: greedy "
             f"{prompts.NEW_TOKENS}-token continuations of {len(prompts.PROMPTS)} prompts; NLL = the original "
             "model's mean NLL of the continuation (nats/token); rep. = 1 - distinct/total tokens; degen. = "
             "continuations with rep. > 0.5 or a token repeated 8 times; loops = continuations with seq-rep-4 (1 - distinct / "
             "total 4-grams) > 0.5 or a token repeated 8 times (unlike rep., not fired by a list of numbers; * = "
             "recomputed from the stored text). Original model: "
             f"{res['original'].get('prompt_degenerate', 'n/a')} degenerate, {res['original'].get('prompt_loops', 'n/a')} loops.",
             "Convert = wall time of `transmla convert`: all of it (load, tokenize, calibrate, convert, export) / "
             "its compute (calibration passes and per-layer math), the latter also as a multiple of one plain "
             "forward with logits over the same calibration tokens timed in the row's own run (this machine's speed "
             f"drifts between sessions; latest forward {res['plain_forward_seconds']:.1f} s); CPU = the same ratio in "
             "CPU seconds of the process (all threads; time the host gives to other machines is not counted, "
             "contention on the same cores still is; rows retimed since 2026-11-27); rows with a range were retimed "
             "interleaved (`--retime`: each convert between two forwards, ratio to their mean; median and range of "
             "`--repeats` converts), the others against one forward timed before them; "
             f"peak RSS of the convert process; float32 model size {res['float32_gib']:.2f} GiB. Machine: "
             f"{pr['machine']}; one convert process at a time (`--retime` re-measures the times alone: run it on an "
             "idle machine).", ""]
    lines += ["| KV cut | RoPE + rank | row | WikiText-2 | c4-demo | prompt NLL | rep. | degen. | loops | convert s: all / compute (x fwd) | peak RSS GiB |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(
            f"| {100 * (1 - r['kv_cache_ratio']):.2f}% | {r['qk_rope_head_dim']} + {r['kv_lora_rank']} | {r['label']} | "
            f"{r['wikitext2-test']:.2f} | {r['c4-demo']:.2f} | {r['prompt_nll']:.2f} | {r['prompt_repetition']:.2f} | "
            f"{r['prompt_degenerate']} | {_loops(r)} | {'n/a' if r['seconds'] is None else format(r['seconds'], '.0f')} / {_compute(r)} | "
            f"{r['peak_rss_gib']:.2f} |")
    lines += ["", "Continuations of the combined modes at each budget:", ""]
    for r in res["rows"]:
        if r["row"].startswith("all"):
            lines.append(f"- {100 * (1 - r['kv_cache_ratio']):.2f}%, {r['label']}: " + "; ".join(
                f"`{p['prompt']}` -> `{p['continuation'].strip()[:80]}`" for p in r["prompts"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="any transmla source")
    ap.add_argument("--budgets", default="0.3125,0.125", help="KV-cache fractions kept")
    ap.add_argument("--rows", default="default", help=f"comma list of {list(ROWS)} (default: {DEFAULT_ROWS})")
    ap.add_argument("--ppl-tokens", type=int, default=65536)
    ap.add_argument("--seqlen", type=int, default=2048, help="perplexity window")
    ap.add_argument("--out", default=None, help="default reports/ablation/<model>.json")
    ap.add_argument("--eval-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the perplexity forwards (bfloat16: ~4x faster on CPUs with AMX; prompts stay float32)")
    ap.add_argument("--retime", action="store_true", help="re-measure conversion times and peak RSS of the rows only")
    ap.add_argument("--repeats", type=int, default=3, help="--retime: converts per row, each between two forwards")
    ap.add_argument("--rescore", action="store_true", help="add the 4-gram loop measure to rows saved without it")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = DEFAULT_ROWS if args.rows == "default" else args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}: choose from {list(ROWS)}")
    try:  # checked before the model loads: a bad budget would otherwise stop the run after minutes of work
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets {args.budgets!r}: write KV-cache fractions joined by commas, e.g. 0.3125,0.125")
    if not all(0 < b <= 1 for b in budgets):
        ap.error(f"--budgets {args.budgets!r}: each fraction of the KV cache kept must be in (0, 1]")
    if args.repeats < 1 or args.ppl_tokens < args.seqlen or args.seqlen < 2:
        ap.error("--repeats must be >= 1, --seqlen >= 2 and --ppl-tokens >= --seqlen (one window)")
    # an --out it cannot write (a directory) is refused now, not after the conversions
    out = check_report_out(ap, Path(args.out or REPO / "reports" / "ablation" / f"{report_stem(args.model)}.json"))
    o = ConvertOptions()
    protocol = {"ppl_tokens": args.ppl_tokens, "seqlen": args.seqlen, "machine": f"CPU, {torch.get_num_threads()} threads",
                "calibration": f"{o.cal_nsamples} x {o.cal_seqlen} tokens of {o.cal_dataset}"}
    if args.eval_dtype != "float32":  # absent for float32, so earlier reports keep their protocol
        protocol["eval_dtype"] = args.eval_dtype
    eval_dtype = getattr(torch, args.eval_dtype)
    res = json.loads(out.read_text()) if out.is_file() else {}
    # the rows' numbers do not depend on the machine (their times are ratios to a forward timed beside them): a
    # report resumed, retimed or rescored on another machine keeps its rows; the one that ran first is the
    # protocol's, later rows name their own (a machine of other thread count wiped the report's rows)
    same = {k: v for k, v in res.get("protocol", {}).items() if k != "machine"} == \
        {k: v for k, v in protocol.items() if k != "machine"}
    if res.get("rows") and not same:
        ap.error(f"--out {out} holds rows measured under another protocol ({res.get('protocol')}, not {protocol}): "
                 "choose another --out, or remove it to start again")
    if res.get("rows") and res.get("model") != args.model:  # two models' rows in one table, under one original
        ap.error(f"--out {out} holds rows of {res.get('model')}, not {args.model}: choose another --out")
    if not same or res.get("model") != args.model:  # nothing of it to keep (an original measured, no rows yet: kept)
        res = {"model": args.model, "protocol": protocol, "rows": []}
    machine = protocol["machine"]

    model, tok = load_model(args.model, dtype="float32")
    if args.retime:
        return retime(args, res, out, model, tok, o, rows)
    if args.rescore:
        return rescore(res, out, model, tok)
    ref = use_causal_padded_sdpa(model)
    tests = {d: tokenize_corpus(tok, load_texts(d)) for d in DATASETS}

    def ppl(m, d):
        return perplexity(m, tests[d], args.seqlen, max_tokens=args.ppl_tokens, progress=False)["ppl"]

    def for_ppl(m):  # the float32 model stays for the prompts (generated and scored in float32)
        return m if eval_dtype == torch.float32 else copy.deepcopy(m).to(eval_dtype)

    if "original" not in res:
        res.update(plain_forward_times(model, tok, o))
        res["float32_gib"] = round(sum(p.numel() for p in model.parameters()) * 4 / 2**30, 3)
        ref_eval = for_ppl(ref)
        res["original"] = {d: round(ppl(ref_eval, d), 3) for d in DATASETS}
        del ref_eval
    if "prompt_nll" not in res["original"]:
        res["original"].update(original_prompts(model, tok))
    done = {(r["row"], r["budget"]) for r in res["rows"]}
    from transformers import AutoModelForCausalLM

    todo = [(b, row) for b in budgets for row in rows if (row, b) not in done]
    fwd = plain_forward_times(model, tok, o, repeats=1) if todo else None  # this run's machine speed

    for budget in budgets:
        for row in rows:
            if (row, budget) in done:
                continue
            label, flags = ROWS[row]
            with tempfile.TemporaryDirectory() as tmp:
                info = convert_row(args.model, budget, flags, Path(tmp) / "model")
                mla = AutoModelForCausalLM.from_pretrained(Path(tmp) / "model", dtype=torch.float32, use_safetensors=True)
            p = prompts.score_continuations(model, tok, prompts.greedy_continuations(mla, tok))
            fast = use_causal_padded_sdpa(mla.to(eval_dtype))
            r = {"row": row, "label": label, "budget": budget, **{k: info[k] for k in (
                "qk_rope_head_dim", "kv_lora_rank", "kv_cache_ratio", "seconds", "calibration_seconds", "compute_seconds",
                "compute_cpu_seconds", "peak_rss_gib")}, **fwd,
                **{d: round(ppl(fast, d), 3) for d in DATASETS}, **prompts.summary(p), "prompts": p,
                **({"machine": machine} if machine != res["protocol"]["machine"] else {})}
            res["rows"].append(r)
            res["rows"].sort(key=lambda x: (-x["kv_cache_ratio"], list(ROWS).index(x["row"])))
            save(res, out)
            print(json.dumps({k: v for k, v in r.items() if k != "prompts"}), flush=True)
            del mla, fast


if __name__ == "__main__":
    run(main)

"""Benchmark: recovery fine-tunes side by side, by objective (reports/recovery/<model>-<budget>.{json,md}).

    .venv/bin/python scripts/recovery.py --model smollm2-135m --budget 0.125 [--runs lm,kd,lm_time,kd_no_wt2]
    .venv/bin/python scripts/recovery.py --index     # reports/recovery/index.md: every report in one table

One conversion (the CLI's default mode at --budget, or --checkpoint DIR), then per run one
`transmla finetune` in its own process (its tokens/s and peak RSS are its own) from that same
checkpoint, and on each result:
  - the validation cross-entropy and KL to the original on the run's held-out blocks (split by document);
  - WikiText-2 test perplexity, first --ppl-tokens tokens in 2048-token windows;
  - c4-demo perplexity, same protocol (a corpus the `*_no_wt2` runs train on; WikiText-2 test is then
    the corpus they did not see: WikiText-2 train is left out of their corpora).
Runs:
  lm         next-token cross-entropy, --max-tokens tokens
  kd         KL from the original model, --max-tokens tokens
  kd+lm      both
  kd_attn    kd + per-layer attention matching (--attn-weight 1); kd+lm_attn likewise
  lm_time    cross-entropy for as long as the kd run took (the teacher's forward costs time);
             lm_time_kd+lm likewise for the kd+lm run
  kd_no_wt2  kd without WikiText-2 train in the corpora; kd+lm_no_wt2 and lm_no_wt2 likewise (the
             objectives compared on a test set neither trained on: recovery without in-domain adaptation)
Rows already in the JSON with the same protocol are kept (resumable); a time taken beside other work
is not a measurement, so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _common import check_report_out, report_stem, run  # noqa: E402

from transmla.cli import build_parser, finetune_config  # noqa: E402
from transmla.config import FINETUNE_CORPORA, FinetuneConfig  # noqa: E402
from transmla.errors import TransMLAError  # noqa: E402
from transmla.evaluation.perplexity import perplexity, tokenize_corpus  # noqa: E402
from transmla.io.data import load_texts  # noqa: E402
from transmla.io.paths import write_text_atomic  # noqa: E402
from transmla.io.sources import load_model, source_info  # noqa: E402
from transmla.runtime.fast_attention import use_causal_padded_sdpa  # noqa: E402
from transmla.training import layerwise  # noqa: E402

DATASETS = ("wikitext2-test", "c4-demo")
ATTN = ["--attn-weight", "1"]
RUNS = {  # name -> (objective, corpora filter, label, more finetune flags)
    "lm": ("lm", None, "lm (next-token cross-entropy)", []),
    "kd": ("kd", None, "kd (distillation from the original)", []),
    "kd+lm": ("kd+lm", None, "kd + lm", []),
    "kd_attn": ("kd", None, "kd + per-layer attention matching", ATTN),
    "kd+lm_attn": ("kd+lm", None, "kd + lm + per-layer attention matching", ATTN),
    "lm_time": ("lm", None, "lm, as long as kd took", []),
    "lm_time_kd+lm": ("lm", None, "lm, as long as kd + lm took", []),
    "kd_no_wt2": ("kd", "wikitext2-train", "kd, WikiText-2 train left out", []),
    "kd+lm_no_wt2": ("kd+lm", "wikitext2-train", "kd + lm, WikiText-2 train left out", []),
    "lm_no_wt2": ("lm", "wikitext2-train", "lm, WikiText-2 train left out", []),
}
# equal-wall-time runs: name -> the teacher run whose seconds they get (at the lm run's tokens/s)
TIMED = {"lm_time": "kd", "lm_time_kd+lm": "kd+lm"}


def run_cli(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "transmla.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def markdown(res: dict) -> str:
    pr, o = res["protocol"], res["original"]
    lines = [f"# Recovery fine-tune by objective: {res['model']} at a {100 * (1 - res['budget']):.1f}% KV cut", "",
             f"Start: {res['conversion']}. Training: {pr['training']}. Perplexity: first {pr['ppl_tokens']:,} tokens "
             f"of each test set in 2048-token windows, ppl = exp(mean NLL). Original model: WikiText-2 "
             f"{o['wikitext2-test']:.2f}, c4-demo {o['c4-demo']:.2f}; converted, before training: WikiText-2 "
             f"{res['converted']['wikitext2-test']:.2f}, c4-demo {res['converted']['c4-demo']:.2f}. Val. = the run's "
             "held-out blocks (whole documents): next-token cross-entropy and KL from the original (nats/token). "
             f"Gap = WikiText-2 ppl minus the original's. Machine: {pr['machine']}; one run at a time.", "",
             "| run | corpora | tokens | tokens/s | s | peak RSS GiB | val. CE | val. KL | WikiText-2 | gap | c4-demo |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['label']} | {', '.join(r['corpora'])} | {r['tokens_trained']:,} | {r['tokens_per_second']} | "
            f"{r['seconds']:.0f} | {r['peak_rss_gib']:.2f} | {r['val_loss_before']:.3f} -> {r['val_loss_after']:.3f} | "
            f"{r['val_kd_before']:.3f} -> {r['val_kd_after']:.3f} | {r['wikitext2-test']:.2f} | "
            f"{r['wikitext2-test'] - o['wikitext2-test']:.2f} | {r['c4-demo']:.2f} |")
    return "\n".join(lines) + "\n"


def index(folder: Path) -> str:
    """One table over every report in `folder` (`--index`): per cut, by tokens trained, then best WikiText-2 first."""
    reports = [(json.loads(f.read_text()), f.stem) for f in sorted(folder.glob("*.json"))]
    ppl_tokens = " or ".join(f"{n:,}" for n in sorted({res["protocol"]["ppl_tokens"] for res, _ in reports}))
    lines = ["# Recovery runs: index", "",
             "Generated by `scripts/recovery.py --index` from the `*.json` reports in this folder (never hand-edited): "
             "one row per run. Flags = the `transmla finetune` flags beyond its defaults; start = WikiText-2 "
             f"perplexity of the conversion the run started from; perplexity on the first {ppl_tokens} "
             "tokens of each test set in 2048-token windows (each report states its own protocol); "
             "gap = WikiText-2 minus the original's; val. = the run's held-out blocks, cross-entropy and KL "
             "from the original after training. Times are as recorded: `README.md` says which runs shared "
             "the CPU (their tokens/s are not measurements).", ""]
    models = {r["model"] for r, _ in reports}
    for model, budget in sorted({(r["model"], r["budget"]) for r, _ in reports}):  # one original per section
        rows = [(res, stem, row) for res, stem in reports if (res["model"], res["budget"]) == (model, budget)
                for row in res["rows"]]
        rows.sort(key=lambda t: (t[2]["tokens_trained"], t[2]["wikitext2-test"]))
        orig = rows[0][0]["original"]
        lines += [f"## {model + ', ' if len(models) > 1 else ''}{100 * (1 - budget):.2f}% KV cut (original: WikiText-2 "
                  f"{orig['wikitext2-test']:.2f}, c4-demo {orig['c4-demo']:.2f})", "",
                  "| report | run | flags | start | tokens trained | WikiText-2 | gap | c4-demo | val. CE | val. KL "
                  "| tokens/s | s | peak RSS GiB |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for res, stem, r in rows:
            flags = res["protocol"]["training"].partition("defaults")[2].strip() or "-"
            lines.append(
                f"| {stem} | {r['run']} | {flags} | {res['converted']['wikitext2-test']:.2f} | "
                f"{r['tokens_trained']:,} | {r['wikitext2-test']:.2f} | "
                f"{r['wikitext2-test'] - res['original']['wikitext2-test']:.2f} | {r['c4-demo']:.2f} | "
                f"{r['val_loss_after']:.3f} | {r['val_kd_after']:.3f} | {r['tokens_per_second']} | "
                f"{r['seconds']:.0f} | {r['peak_rss_gib']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def check_checkpoint_source(ap, checkpoint: str, meta: dict, model: str) -> None:
    """--checkpoint converted from another model than --model: the runs would distil from (and the report measure
    the gap to) a model the checkpoint never was. Compared by content hash, as the conversion recorded it
    (source_info: no weights loaded)."""
    recorded = meta.get("source_content_hash")
    if recorded is None:  # an older record, or a source without one (a hub id): nothing to compare
        return
    now = source_info(model).get("content_hash")
    if now is not None and now != recorded:
        ap.error(f"--checkpoint {checkpoint} was converted from {meta.get('source') or 'another model'} (content "
                 f"hash {recorded[:12]}), not from --model {model} ({now[:12]}); pass the --model it was converted "
                 "from")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="the original model (any transmla source): converted, then the teacher")
    ap.add_argument("--budget", type=float, default=None,
                    help="KV-cache fraction kept (default 0.125; with --checkpoint: the checkpoint's)")
    ap.add_argument("--checkpoint", default=None, help="start from this converted dir instead of converting")
    ap.add_argument("--runs", default="lm,kd,lm_time,kd_no_wt2", help=f"comma list of {list(RUNS)}")
    ap.add_argument("--max-tokens", type=int, default=FinetuneConfig().max_tokens)
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--out", default=None, help="default reports/recovery/<model>-<budget>.json")
    ap.add_argument("--keep", default=None, help="keep each run's fine-tuned model in DIR/<run> (default: deleted)")
    ap.add_argument("--index", action="store_true",
                    help="only write reports/recovery/index.md, one table over the reports there, and exit")
    ap.add_argument("finetune_args", nargs="*", help="more `transmla finetune` flags, after --")
    args = ap.parse_args()
    if args.index:
        folder = REPO / "reports" / "recovery"
        write_text_atomic(folder / "index.md", index(folder))
        return
    runs = args.runs.split(",")
    if bad := [r for r in runs if r not in RUNS]:
        ap.error(f"unknown runs {bad}: choose from {list(RUNS)}")
    # bad input is refused before the original model's perplexity (minutes): each run's finetune options too,
    # else a flag one objective refuses (--kd-weight with lm) would fail after the runs before it (hours)
    cfgs = {}  # run -> its FinetuneConfig (epochs, and whether a layer-wise phase runs before the end-to-end one)
    owned = {"objective": "--objective", "max_tokens": "--max-tokens", "teacher": "--teacher", "corpora": "--corpora",
             "model": "--model", "out": "--out", "work_dir": "--work-dir"}
    for name in runs:
        objective, _, _, extra = RUNS[name]
        set_here = {"objective": objective, "max_tokens": args.max_tokens, "teacher": "-", "corpora": "-",
                    "model": "-", "out": "-", "work_dir": None}
        flags = build_parser().parse_args(["finetune", "--model", "-", "--out", "-", "--teacher", "-", "--corpora", "-",
                                           "--objective", objective, "--max-tokens", str(args.max_tokens),
                                           *extra, *args.finetune_args])
        # each run sets these itself; argparse keeps the last value (and takes abbreviations), so one after --
        # won over the run's (a row labelled lm trained with --objective kd, its tokens other than the header's)
        if changed := [owned[k] for k, v in set_here.items() if getattr(flags, k) != v]:
            ap.error(f"{', '.join(changed)} after --: each run sets {', '.join(owned.values())} itself; use --runs, "
                     "--max-tokens, --model or --out of this script instead")
        try:
            cfgs[name] = finetune_config(flags)
        except TransMLAError as e:
            ap.error(f"run {name} (--objective {objective} {' '.join(args.finetune_args)}): {e}")
    if args.checkpoint:
        if not (Path(args.checkpoint) / "config.json").is_file():
            ap.error(f"--checkpoint {args.checkpoint}: no config.json there; pass a `transmla convert --out` directory")
        meta = json.loads((Path(args.checkpoint) / "config.json").read_text()).get("transmla") or {}
        # the ratio asked for (a QK-norm model's record counts its cached key scales too: 0.1289 for 0.125)
        ratio = (meta.get("options") or {}).get("kv_cache_ratio") or meta.get("kv_cache_ratio")
        if ratio is None:
            ap.error(f"--checkpoint {args.checkpoint}: not a TransMLA conversion (no transmla.kv_cache_ratio in its config)")
        if args.budget is not None and abs(args.budget - ratio) > 1e-3:  # the report was titled with --budget
            ap.error(f"--budget {args.budget}: the checkpoint keeps {ratio:.4f} of the KV cache; drop --budget")
        args.budget = args.budget if args.budget is not None else round(ratio, 6)
    args.budget = 0.125 if args.budget is None else args.budget
    if not 0 < args.budget <= 1:
        ap.error(f"--budget {args.budget}: the fraction of the KV cache kept must be in (0, 1]")
    if args.ppl_tokens < 2048 or args.max_tokens < 1:
        ap.error("--ppl-tokens must hold one 2048-token window and --max-tokens be positive")
    # an --out it cannot write (a directory) is refused now, not after the runs
    out = check_report_out(ap, Path(args.out or REPO / "reports" / "recovery" / f"{report_stem(args.model)}-{args.budget}.json"))
    protocol = {"ppl_tokens": args.ppl_tokens, "machine": f"CPU, {torch.get_num_threads()} threads",
                "training": f"{args.max_tokens:,} tokens, `transmla finetune` defaults {' '.join(args.finetune_args)}".strip()}
    res = json.loads(out.read_text()) if out.is_file() else {}
    start = {"model": args.model, "budget": args.budget, "checkpoint": args.checkpoint}
    if res.get("protocol") == protocol and res.get("rows") and \
            {k: res.get(k) for k in start} != start:  # resuming would mix runs from two starting points
        ap.error(f"--out {out} holds runs from another start ({ {k: res.get(k) for k in start} }, not {start}); "
                 "choose another --out")
    if res.get("protocol") != protocol:
        res = {**start, "protocol": protocol, "rows": []}
    # an equal-time run takes its tokens from rows measured before it (in this invocation or the resumed --out):
    # refused now, not after the original's perplexity and a conversion
    for i, name in enumerate(runs):
        before = set(runs[:i]) | {r["run"] for r in res["rows"]}
        if name in TIMED and not {"lm", TIMED[name]} <= before:
            ap.error(f"run {name} needs the lm and {TIMED[name]} runs first (--runs lm,{TIMED[name]},{name})")
    if args.checkpoint:
        check_checkpoint_source(ap, args.checkpoint, meta, args.model)
    model, tok = load_model(args.model, dtype="float32")
    tests = {d: tokenize_corpus(tok, load_texts(d)) for d in DATASETS}

    def ppl(m) -> dict:
        m = use_causal_padded_sdpa(m)
        return {d: round(perplexity(m, tests[d], 2048, max_tokens=args.ppl_tokens, progress=False)["ppl"], 3)
                for d in DATASETS}

    if "original" not in res:
        res["original"] = ppl(model)
    del model
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "converted"
        if not args.checkpoint:
            info = run_cli(["convert", "--model", args.model, "--out", str(ckpt), "--kv-cache-ratio", str(args.budget)])
            res["conversion"] = (f"`transmla convert --kv-cache-ratio {args.budget}` (default mode), RoPE "
                                 f"{info['qk_rope_head_dim']} + rank {info['kv_lora_rank']}")
        else:
            res["conversion"] = f"{args.checkpoint}"
        if "converted" not in res:
            res["converted"] = ppl(load_model(str(ckpt), dtype="float32")[0])
        done = {r["run"] for r in res["rows"]}
        for name in runs:
            if name in done:
                continue
            objective, drop, label, extra = RUNS[name]
            corpora = [c for c in FINETUNE_CORPORA if c != drop]
            tokens = args.max_tokens
            if name in TIMED:
                # (both rows are there: the order was checked before the model loaded, and a failed run exits)
                kd = next(r for r in res["rows"] if r["run"] == TIMED[name])
                lm = next(r for r in res["rows"] if r["run"] == "lm")
                # kd's seconds at lm's speed are tokens trained in all; --max-tokens counts distinct ones, which
                # --epochs repeats. kd's seconds hold its layer-wise phase: where this run has one too, its own
                # phase fills that share, so only kd's end-to-end seconds are matched (else it ran a phase longer)
                seconds = kd["seconds"]
                if cfgs[name].layerwise_epochs > 0:
                    seconds -= (kd.get("layerwise") or {}).get("seconds", 0)
                tokens = int(seconds * lm["tokens_per_second"] / cfgs[name].epochs)
            # a run killed in an earlier invocation left its work folder under --keep: a rerun resumed it and
            # recorded the resumed part's seconds as the run's (its tokens/s, and the equal-time runs after it,
            # wrong). Only that folder: a finished model there (the output is written whole) is refused by finetune
            stale = Path(args.keep or tmp) / f".{name}.trainer"
            if stale.exists():
                print(f"[recovery] removing {stale}, left by a killed run: the run starts again so that its time "
                      "is measured whole", file=sys.stderr)
                shutil.rmtree(stale)
            r = run_cli(["finetune", "--model", str(ckpt), "--out", str(Path(args.keep or tmp) / name),
                         "--teacher", args.model,
                         "--objective", objective, "--corpora", ",".join(corpora), "--max-tokens", str(tokens),
                         *extra, *args.finetune_args])
            row = {"run": name, "label": label, "corpora": corpora, **{k: r[k] for k in (
                "objective", "tokens_trained", "tokens_per_second", "peak_rss_gib", "val_loss_before", "val_loss_after",
                "val_kd_before", "val_kd_after", "train_loss")}, "seconds": r["seconds_this_run"],
                **{k: r.get(k) for k in ("val_attn_before", "val_attn_after")},
                **({"layerwise": layerwise.summary(r["layerwise"])} if r.get("layerwise") else {}),
                **ppl(load_model(r["out"], dtype="float32")[0])}
            if "layerwise" in row:
                sched = row["layerwise"].get("schedule", "constant")
                row["label"] += (f", after layer-wise distillation ({row['layerwise']['epochs']:g} "
                                 f"{'pass' if row['layerwise']['epochs'] == 1 else 'passes'} per layer"
                                 + (f", {sched} lr" if sched != "constant" else "") + ", "
                                 f"{row['layerwise']['seconds']:.0f} s; held-out attention error, mean over layers, "
                                 f"{row['layerwise']['attn_err_before']:.3f} -> {row['layerwise']['attn_err_after']:.3f}; "
                                 "val. before = after it)")
                row["seconds"] = round(row["seconds"] + row["layerwise"]["seconds"], 1)
            res["rows"].append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out, json.dumps(res, indent=1))
            write_text_atomic(out.with_suffix(".md"), markdown(res))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    run(main)

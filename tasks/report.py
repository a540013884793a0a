"""Stage 7: the Table-1 analogue as markdown, generated from the per-row metrics files."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.errors import TransMLAError
from transmla.evaluation.benchmarks import paired_columns
from transmla.evaluation.prompts import NEW_TOKENS
from transmla.io.paths import write_text_atomic

COLUMNS = (("MMLU", "mmlu"), ("ARC", "arc_mean"), ("PIQA", "piqa"), ("HS", "hellaswag"), ("OBQA", "openbookqa"),
           ("WG", "winogrande"))
METHOD_NAMES = {"original": "Original", "mha2mla": "MHA2MLA", "transmla": "TransMLA",
                "transmla-refit": "TransMLA + seq. refit (ours)"}


def table_row(model: str, method: str, budget: float | None, ppl: dict, bench: dict, conversion: dict | None,
              limit: int | None) -> dict:
    """One Table-1 row (reports/metrics/<model>/<variant>.json) from an evaluation's results."""
    ft = (conversion or {}).get("finetune") or {}
    tokens = ft.get("tokens_trained", 0)
    return {
        "model": model, "method": method, "budget": budget, "finetuned": tokens > 0,
        # runs from before the kd objectives were plain next-token training
        "objective": (ft.get("objective") or "lm") if tokens else None,
        "kv_cache_ratio": 1.0 if conversion is None else conversion["kv_cache_ratio"],
        "qk_rope_head_dim": None if conversion is None else conversion["qk_rope_head_dim"],
        "kv_lora_rank": None if conversion is None else conversion["kv_lora_rank"],
        "tokens_trained": tokens,
        "ppl": ppl["ppl"], "ppl_tokens": ppl["tokens"],
        "average": bench["average"], "arc_mean": bench.get("arc_mean"),
        "average_se": bench.get("average_se"), "arc_se": bench.get("arc_se"),
        "benchmarks": {t: v["value"] for t, v in bench["tasks"].items()},
        "benchmark_se": {t: v.get("se") for t, v in bench["tasks"].items()},
        "benchmark_n": {t: v["n"] for t, v in bench["tasks"].items()},
        "protocol": bench.get("protocol"),
        # per-document scores: the report's paired differences to the original (same sample)
        "scores": bench.get("scores"), "sizes": bench.get("sizes"),
        "eval_limit": limit, "seconds": {"ppl": ppl["seconds"], "benchmarks": bench["seconds"]},
    }


def tracked_metrics(row: dict) -> dict:
    """The MLflow metrics of a Table-1 row."""
    return {"wikitext2_ppl": row["ppl"], "average": row["average"], "average_se": row.get("average_se"), "arc": row["arc_mean"],
            "kv_cache_ratio": row["kv_cache_ratio"], "kv_cache_reduction": 1 - row["kv_cache_ratio"],
            "tokens_trained": row["tokens_trained"], **{f"bench.{t}": v for t, v in row["benchmarks"].items()}}


def _pct(x, se=None, sign: bool = False) -> str:
    if x is None:
        return "-"
    v = f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"
    return v if se is None else f"{v} ±{100 * se:.1f}"


def paired_to_original(rows: list[dict]) -> list[dict | None]:
    """Each row's paired differences to its model's original row (same documents), None for the original
    itself or where per-document scores are missing."""
    orig = {r["model"]: r for r in rows if r["method"] == "original"}
    out = []
    for r in rows:
        o = orig.get(r["model"])
        ok = r["method"] != "original" and o is not None and r.get("scores") and o.get("scores")
        try:
            out.append(paired_columns(r, o) if ok else None)
        except ValueError as e:  # scored on other documents than the original (another seed or sample)
            name = f"{r['model']} {r['method']}" + ("" if r["budget"] is None else f" {r['budget']}")
            raise TransMLAError(f"{name}{' ft' if r.get('finetuned') else ''} was scored on other documents than its "
                                f"original row ({str(e)[:120]}...): no paired difference exists.",
                                "evaluate every row with the same evaluation params (seed, limits), e.g. dvc repro.") from None
    return out


def _row(r: dict, diff: dict | None) -> str:
    kv = "100%" if r["method"] == "original" else f"-{100 * (1 - r['kv_cache_ratio']):.2f}%"
    shape = "-" if r["qk_rope_head_dim"] is None else f"{r['qk_rope_head_dim']} + {r['kv_lora_rank']}"
    se = r.get("benchmark_se") or {}
    d = (diff or {}).get("average")
    cells = [r["model"], METHOD_NAMES.get(r["method"], r["method"]), kv, shape, _pct(r["average"], r.get("average_se")),
             "-" if d is None else _pct(d["value"], d["se"], sign=True)]
    for _, key in COLUMNS:
        cells.append(_pct(r["arc_mean"], r.get("arc_se")) if key == "arc_mean" else _pct(r["benchmarks"].get(key), se.get(key)))
    tokens = f"{r['tokens_trained']:,} ({r.get('objective') or 'lm'})" if r["tokens_trained"] else "0"
    cells += [tokens, f"{r['ppl']:.2f}"]
    return "| " + " | ".join(cells) + " |"


def _variant(r: dict) -> str:
    if r["method"] == "original":
        return "Original"
    name = f"{METHOD_NAMES.get(r['method'], r['method'])}, -{100 * (1 - r['kv_cache_ratio']):.2f}% KV"
    return name + (f", fine-tuned {r['tokens_trained']:,} tokens ({r.get('objective') or 'lm'})" if r["tokens_trained"]
                   else ", no training")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ⏎ ").strip()


@task(name="case_study", cache_policy=NO_CACHE)
def case_study(rows: list[dict], out: Path) -> str:
    """The paper's case study (Table 6): greedy continuations of its four prompts by every evaluated row."""
    lines = ["# Case study (the paper's Table 6, regenerated)", "",
             "<!-- Generated by `dvc repro` (flows/report.py); do not edit by hand. -->", "",
             f"Greedy continuations ({NEW_TOKENS} new tokens, the model's evaluation dtype) of the paper's four case-study prompts by each "
             "evaluated model; *loop* marks a degenerate continuation (more than half its tokens repeated, or "
             "one token 8 times in a row)."]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("case_study")]
        if not mine:
            continue
        prompts = [c["prompt"] for c in mine[0]["case_study"]]
        lines += ["", f"## {model}", "", "| Model | " + " | ".join(f"`{p}`" for p in prompts) + " |",
                  "|---|" + "---|" * len(prompts)]
        for r in mine:
            cells = [_cell(c["continuation"]) + (" *loop*" if c["degenerate"] else "") for c in r["case_study"]]
            lines.append(f"| {_variant(r)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    write_text_atomic(out, text)
    return text


@task(name="table1", cache_policy=NO_CACHE)
def table1(rows: list[dict], figures: dict[str, list[str]], notes: list[str], out: Path,
           ppl_label: str = "WikiText-2 test") -> str:
    """Write the markdown table (rows in the given order) with its figures and notes; ppl_label names the
    perplexity set (evaluation.ppl_dataset)."""
    head = ["Model", "Method", "KV Mem.", "RoPE + rank", "Avg.", "vs original", *[c for c, _ in COLUMNS], "Tokens",
            f"{ppl_label.removesuffix(' test')} ppl"]
    lines = [
        "# Table 1 (regenerated)",
        "",
        "<!-- Generated by `dvc repro` (flows/report.py); do not edit by hand. -->",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|",
        *[_row(r, d) for r, d in zip(rows, paired_to_original(rows))],
        "",
        *[f"- {n}" for n in notes],
    ]
    for model, files in figures.items():
        lines += ["", f"## Figures: {model}", ""]
        lines += [f"![{Path(f).stem}]({Path(f).relative_to(out.parent) if Path(f).is_absolute() else Path(f).relative_to('reports')})"
                  for f in files]
    text = "\n".join(lines) + "\n"
    write_text_atomic(out, text)
    return text

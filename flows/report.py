"""Flow: collect the per-row metrics into reports/table1.md (the analogue of the paper's Table 1).

    python -m flows.report
"""

from __future__ import annotations

import json

from prefect import flow

from tasks import tracking
from tasks.report import case_study, table1
from transmla.config import PAPER_TRANSMLA
from transmla.errors import TransMLAError
from transmla.evaluation.benchmarks import PROTOCOL_NOTE
from transmla.evaluation.stats import AVERAGE_WEIGHTS, worst_case_average_se

from . import _cli, layout
from .params import Profile


def rows_of(profile: Profile) -> list[dict]:
    rows, missing = [], []
    p = profile.pipeline
    for model in p.models:
        keys = [("original", None, False)] + [(m, b, False) for b in p.budgets for m in p.methods]
        keys += [(m, b, True) for b in p.budgets for m in p.methods if profile.finetuned(m, b)]
        for method, budget, finetuned in keys:
            f = layout.metrics_file(model, method, budget, finetuned)
            if f.is_file():
                rows.append(json.loads(f.read_text()))
            else:
                missing.append(str(f))
    if missing:
        raise TransMLAError(f"Metrics missing: {', '.join(missing)}.", "run the evaluate stages first (dvc repro).")
    check_protocol(rows, profile.evaluation)
    return rows


def expected_docs(r: dict, ev, task: str) -> int | None:
    """How many documents of `task` the params score for row r (the Original row: its reference_limits'
    superset), capped by the task's size where the row records it; None: every document, size unknown."""
    limit = (ev.reference_limits.get(task) if r["method"] == "original" and not r.get("finetuned") else None) \
        or ev.limits.get(task, ev.limit)
    sizes = (r.get("sizes") or {}).get(task)
    total = sum(sizes.values()) if sizes else None
    if limit is None:
        return total
    return limit if total is None else min(limit, total)


def check_protocol(rows: list[dict], ev) -> None:
    """The table's notes describe the rows from the params: refuse rows scored under other evaluation params
    (a stale metrics file, or `-S evaluation....` given to the report alone): the protocol, the document limit,
    each benchmark's document count (per-benchmark limits, the reference superset) and the perplexity tokens,
    which must also be one count for every row (the note states one)."""
    want = {"protocol": ev.protocol, "eval_limit": ev.limit}
    stale = []
    ppl_counts = {r.get("ppl_tokens") for r in rows if r.get("ppl_tokens") is not None}
    for r in rows:
        off = [f"{k} {r.get(k)!r}" for k, v in want.items() if r.get(k) != v]
        for task, n in (r.get("benchmark_n") or {}).items():
            docs = expected_docs(r, ev, task)
            if docs is not None and n != docs:
                off.append(f"{task} on {n} docs (the params: {docs})")
        tokens = r.get("ppl_tokens")
        if tokens is not None and ((ev.ppl_max_tokens is not None and tokens > ev.ppl_max_tokens)
                                   or (len(ppl_counts) > 1 and tokens != max(ppl_counts))):
            off.append(f"perplexity over {tokens} tokens (the params: {ev.ppl_max_tokens or 'all'})")
        if off:
            name = f"{r['model']} {r['method']}" + ("" if r["budget"] is None else f" {r['budget']}")
            stale.append(f"{name}{' ft' if r.get('finetuned') else ''}: {', '.join(off)}")
    if stale:
        raise TransMLAError(
            f"Rows scored under other evaluation params than the report's ({', '.join(f'{k} {v!r}' for k, v in want.items())}): "
            + "; ".join(stale) + ".",
            "run the evaluate stages with the same params (dvc repro), or give the report the params they used.")


def ppl_label(dataset: str) -> str:
    """How the table names the perplexity set (evaluation.ppl_dataset): the paper's name for its own."""
    return {"wikitext2-test": "WikiText-2 test"}.get(dataset, dataset)


def transmla_steps(o) -> str:
    """The conversion steps a TransMLA row's options run, in the paper's terms."""
    return ("RoRoPE" + (f" + FreqFold {o.freqfold}" if o.freqfold > 1 else "")
            + (f" + BKV ({o.pca} PCA)" if o.balance_kv else f" + joint KV PCA ({o.pca}, no BKV)"))


def transmla_note(o, paper_steps: str | None = None) -> str:
    """What a TransMLA row's options do (read from the options: a methods entry changed in params is described
    as it ran, not as the default runs). paper_steps: the paper row's steps, named "the same steps" when equal."""
    steps = transmla_steps(o)
    text = "the same steps" if steps == paper_steps else steps
    text += {"parallel": ", statistics of the original model",
             "two_pass": ", statistics of the original model recomputed with RoPE dropped (the authors' code)",
             "sequential": " calibrated layer by layer on the converted model"}[o.calibration]
    if o.attention_aware:
        text += ", in attention's metric"
    if o.refit:
        text += ", with each layer's W_UV and o_proj refit jointly by least squares to the original layer's output"
    if o.rorope_metric == "query":
        text += ", RoRoPE components ranked by the score energy the queries read"
    paper = all(getattr(o, k) == v for k, v in PAPER_TRANSMLA.items())
    return text + (" (the paper)" if paper else " (this project)")


def methods_note(methods) -> str:
    """The Calibration note's description of the three rows, from methods.* as the conversions ran them."""
    return (f"TransMLA = {transmla_note(methods.transmla)}; TransMLA + seq. refit = "
            f"{transmla_note(methods.transmla_refit, transmla_steps(methods.transmla))}; "
            "MHA2MLA = 2-norm RoPE selection + joint SVD of the weights")


def sample_note(ev, rows: list[dict] = ()) -> str:
    """What the table's benchmark sample is, and the average's standard error it guarantees. Each count is
    capped by the benchmark's size where the rows record it (OpenBookQA has 500 documents, whatever a limit of
    1000 says), and a reference limit of a benchmark the tasks do not run is not the table's."""
    sizes = next((r["sizes"] for r in rows if r.get("sizes")), {})

    def count(t: str, n: int) -> int:
        return min(n, sum(sizes[t].values())) if sizes.get(t) else n

    docs = {t: count(t, ev.limits.get(t, ev.limit)) for t in ev.tasks}
    text = "the same seeded sample for every row: " + ", ".join(f"{t} {n}" for t, n in docs.items()) + " docs"
    if set(AVERAGE_WEIGHTS) <= set(docs):
        text += (f" (MMLU stratified by subject; the average's standard error is at most "
                 f"{100 * worst_case_average_se(docs):.2f} points at any accuracy)")
    reference = {t: count(t, n) for t, n in ev.reference_limits.items() if t in ev.tasks}
    if reference:
        text += ("; the Original rows score " + ", ".join(f"{t} on {n}" for t, n in reference.items())
                 + " docs that include those (a larger sample for the reference's own level; every 'vs original' "
                 "difference is paired on the shared documents)")
    return text


@flow(name="report")
def report(profile: Profile) -> str:
    rows = rows_of(profile)
    ev = profile.evaluation
    limit = "all docs" if ev.limit is None else sample_note(ev, rows)
    ppl_tokens = sorted({r["ppl_tokens"] for r in rows})
    notes = [
        f"Benchmarks (lm-eval): {PROTOCOL_NOTE[ev.protocol]}; {limit}. Accuracy in % ± its standard error; "
        "ARC = mean of ARC-Easy and ARC-Challenge; Avg. = mean of the six columns; 'vs original' = the paired "
        "difference of Avg. to the same model's original row on the same documents ± its standard error.",
        f"{ppl_label(ev.ppl_dataset)} perplexity over {', '.join(f'{t:,}' for t in ppl_tokens)} tokens in "
        f"{ev.ppl_seqlen}-token windows.",
        "KV Mem. = change of the per-token KV cache (original: 2 x kv_heads x head_dim values per layer; "
        "MLA: kv_lora_rank + qk_rope_head_dim, the 'RoPE + rank' column).",
        f"Calibration: {profile.calibration.nsamples} x {profile.calibration.seqlen} tokens of "
        f"{profile.calibration.dataset}; {methods_note(profile.methods)}.",
        "Tokens = fine-tuning tokens after conversion and the objective in brackets (lm: next-token cross-entropy; "
        "kd: distillation from the original model; kd+lm: both; 0: conversion only; the paper's rows use 300M-6B tokens of lm).",
    ]
    ft = profile.finetune
    if ft.budgets:
        kd = "" if ft.objective == "lm" else (
            f" (KL to the original model at temperature {ft.kd_temperature:g}, teacher in {ft.teacher_dtype}"
            + (f", + {ft.kd_weight:g} x lm" if ft.objective == "kd+lm" else "") + ")")
        notes.append(
            f"Fine-tune ({ft.mode}, transformers Trainer): {', '.join(ft.corpora)} packed into {ft.seqlen}-token "
            f"blocks, batch {ft.batch_size} x {ft.grad_accum}, lr {ft.lr:g} {ft.schedule} (warmup {ft.warmup_ratio:g}"
            + (f"; the MLA projections at {ft.attention_lr_scale:g} x lr" if ft.attention_lr_scale != 1 else "") + "), "
            f"{ft.dtype}, objective {ft.objective}{kd}"
            + (f" + {ft.attn_weight:g} x per-layer attention matching to the original" if ft.attn_weight > 0 else "")
            + (f", after layer-wise distillation ({ft.layerwise_epochs:g} pass(es) per layer over the same tokens, "
               f"each converted attention fitted to the original's, lr {ft.layerwise_lr:g}"
               + (f" {ft.layerwise_schedule}" if ft.layerwise_schedule != "constant" else "") + ")"
               if ft.layerwise_epochs > 0 else "")
            + "; validation split by document; loss curves in reports/plots/."
            + (" WikiText-2 train is one of the corpora, so part of the perplexity gain is in-domain adaptation, "
               "not only recovery." if "wikitext2-train" in ft.corpora else ""))
    figs = {}
    for model in profile.pipeline.models:
        f = layout.REPORTS / "metrics" / model / "figures.json"
        if f.is_file():
            figs[model] = list(json.loads(f.read_text())["files"].values())
    text = table1(rows, figs, notes + ["Case study (the paper's Table 6): [case_study.md](case_study.md); decode "
                                       "throughput (Table 5): reports/throughput/."], layout.table_file(),
                  ppl_label(ev.ppl_dataset))
    case_study(rows, layout.case_study_file())
    for model in profile.pipeline.models:
        tracking.log_files(profile.mlflow.experiment, model,
                           [layout.table_file(), layout.case_study_file(), *figs.get(model, [])])
    return text


if __name__ == "__main__":
    _cli.entry(report, __doc__, model=False)

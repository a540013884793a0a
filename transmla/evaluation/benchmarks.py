"""Six-benchmark evaluation (paper Table 1) with lm-evaluation-harness, offline.

lm-eval's own task definitions (prompts, choices, metrics) are reused; only the data source is
overridden. At run time we write task YAMLs that `include:` the installed lm-eval task file and set
`dataset_path: json` with absolute `data_files` pointing at the local JSONL mirror (relative paths
would resolve against the working directory, not the YAML). MMLU becomes one task per subject
(filtered from the single JSONL by a generated `process_docs`), with the dev split as few-shot pool,
grouped with weight_by_size like lm-eval's own `mmlu` group. The model is lm-eval's HFLM, loaded
once, with each context's choices scored in one packed sequence (transmla.evaluation.scoring: the
same log-likelihoods, the context encoded once).

Protocols (PROTOCOLS):
    paper    what the paper (and MHA2MLA, whose task file it shares) scores: zero-shot, length-
             normalised log-likelihood accuracy (acc_norm) on every benchmark, MMLU in cloze form
             (lm-eval's mmlu_*_continuation: the question, then each answer text as a continuation;
             no letters shown). WinoGrande's choices share one continuation, so its acc_norm = acc.
    lm_eval  lm-eval's defaults: letter-choice MMLU scored by acc, WinoGrande by acc, the rest acc_norm.

Sampling and uncertainty (transmla.evaluation.stats): `limit` docs per benchmark, each benchmark
drawn with its own seeded generator, MMLU stratified over its 57 subjects in proportion to their
sizes; every column carries its standard error and n, computed from the per-document scores, which
the result keeps so methods scored on the same sample compare by paired differences.

The paper's "ARC" column is the mean of ARC-Easy and ARC-Challenge (`arc_mean` here).
"""

from __future__ import annotations

import json
import os
import sys
import time
import typing
from pathlib import Path

from transmla.config import BENCHMARKS as TASKS
from transmla.config import EvaluationOptions
from transmla.errors import TransMLAError
from transmla.evaluation import stats
from transmla.io.data import load_rows, local_path
from transmla.io.paths import write_text_atomic

PREFIX = "offline_"

# task -> (lm-eval YAML relative to lm_eval/tasks, {split: registry data set}, splits absent offline)
SINGLE = {
    "arc_easy": ("arc/arc_easy.yaml", {"test": "arc_easy"}, ("training_split", "validation_split")),
    "arc_challenge": ("arc/arc_challenge.yaml", {"test": "arc_challenge"}, ("training_split", "validation_split")),
    "hellaswag": ("hellaswag/hellaswag.yaml", {"validation": "hellaswag"}, ("training_split",)),
    "piqa": ("piqa/piqa.yaml", {"validation": "piqa"}, ("training_split",)),
    "openbookqa": ("openbookqa/openbookqa.yaml", {"test": "openbookqa"}, ("training_split", "validation_split")),
    "winogrande": ("winogrande/default.yaml", {"validation": "winogrande"}, ("training_split",)),
}
# The data sets each benchmark reads (they join an evaluation's cache key).
BENCHMARK_DATA = {t: list(splits.values()) for t, (_, splits, _) in SINGLE.items()} | {"mmlu": ["mmlu_test", "mmlu_dev"]}
# protocol -> (MMLU form, the metric each Table-1 column reports)
PROTOCOLS = {
    # WinoGrande: both options score the same continuation (the text after the blank), so normalising by its
    # length is a no-op and acc is the length-normalised accuracy; lm-eval's acc_norm there divides by the
    # option's length, which is part of the context, not of what is scored.
    "paper": ("cloze", {t: "acc" if t == "winogrande" else "acc_norm" for t in TASKS}),
    "lm_eval": ("letter", {"mmlu": "acc", "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "piqa": "acc_norm",
                           "hellaswag": "acc_norm", "openbookqa": "acc_norm", "winogrande": "acc"}),
}
PROTOCOL_NOTE = {
    "paper": "zero-shot, acc_norm (length-normalised log-likelihood accuracy), MMLU in cloze form (each answer "
             "text scored as the continuation of the question); WinoGrande acc (its options share one continuation, "
             "so length normalisation is a no-op)",
    "lm_eval": "zero-shot, lm-eval's letter-choice MMLU (acc), WinoGrande acc, ARC/PIQA/HellaSwag/OpenBookQA acc_norm",
}
# Both metrics are computed for every task (lm-eval's winogrande and letter-MMLU files list acc only).
METRIC_LIST = ("metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
               "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def mmlu_subjects() -> list[str]:
    d = _lm_eval_tasks_dir() / "mmlu" / "default"
    return sorted(p.stem[len("mmlu_"):] for p in d.glob("mmlu_*.yaml"))


def _q(path: Path) -> str:
    return json.dumps(str(path))  # a valid YAML double-quoted scalar


def write_task_yamls(out_dir: str | Path, tasks=TASKS, data_dir=None, mmlu: str = "cloze", num_fewshot: int = 0) -> Path:
    """Write the offline task YAMLs into out_dir (MMLU in `mmlu` form: cloze | letter; `num_fewshot` set in
    each task's config, so lm-eval has nothing to override); clear errors for missing data files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = _lm_eval_tasks_dir()
    for t in tasks:
        if t == "mmlu":
            _write_mmlu(out, base, data_dir, mmlu, num_fewshot)
            continue
        if t not in SINGLE:
            raise TransMLAError(f"Unknown benchmark {t!r}.", f"choose from {', '.join(TASKS)}.")
        rel, splits, absent = SINGLE[t]
        files = "\n".join(f"    {split}: {_q(local_path(ds, data_dir))}" for split, ds in splits.items())
        nulls = "".join(f"{k}: null\n" for k in absent)
        (out / f"{PREFIX}{t}.yaml").write_text(
            f"include: {_q(base / rel)}\ntask: {PREFIX}{t}\ntag: transmla_offline\n"
            f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n{files}\n{nulls}"
            f"num_fewshot: {num_fewshot}\n{METRIC_LIST}"
        )
    return out


def _write_mmlu(out: Path, base: Path, data_dir, form: str = "cloze", num_fewshot: int = 0) -> None:
    if form not in ("cloze", "letter"):
        raise TransMLAError(f"Unknown MMLU form {form!r}.", "use cloze (the paper's) or letter (lm-eval's mmlu).")
    test, dev = local_path("mmlu_test", data_dir), local_path("mmlu_dev", data_dir)
    subjects = mmlu_subjects()
    (out / "offline_mmlu_subjects.py").write_text(
        '"""Generated: one process_docs filter per MMLU subject (the offline JSONL holds all 57)."""\n\n\n'
        "def _subject(name):\n    def process_docs(dataset):\n"
        "        return dataset.filter(lambda d: d[\"subject\"] == name)\n\n    return process_docs\n\n\n"
        + "".join(f"{s} = _subject({s!r})\n" for s in subjects)
    )
    src = base / "mmlu" / ("continuation" if form == "cloze" else "default")  # same file names in both
    for s in subjects:
        (out / f"{PREFIX}mmlu_{s}.yaml").write_text(
            f"include: {_q(src / f'mmlu_{s}.yaml')}\n"
            f"task: {PREFIX}mmlu_{s}\ntag: {PREFIX}mmlu_tasks\n"
            f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
            f"    test: {_q(test)}\n    dev: {_q(dev)}\n"
            f"process_docs: !function offline_mmlu_subjects.{s}\n"
            f"num_fewshot: {num_fewshot}\n{METRIC_LIST}"
        )
    metric = "acc_norm" if form == "cloze" else "acc"
    (out / f"{PREFIX}mmlu.yaml").write_text(
        f"group: {PREFIX}mmlu\ntask:\n  - {PREFIX}mmlu_tasks\naggregate_metric_list:\n"
        f"  - metric: {metric}\n    weight_by_size: true\nmetadata:\n  version: 2\n"
    )


def task_strata(tasks, data_dir) -> dict[str, dict[str, int]]:
    """benchmark -> {lm-eval task: number of docs in the local files} (MMLU: one task per subject).

    Always the local files, whatever TRANSMLA_DATA_SOURCE says: lm-eval scores those (write_task_yamls),
    and the counts must describe the documents it scores."""
    strata = {}
    for t in tasks:
        if t == "mmlu":
            counts: dict[str, int] = {}
            for r in load_rows("mmlu_test", data_dir, source="local"):
                counts[r["subject"]] = counts.get(r["subject"], 0) + 1
            strata[t] = {f"{PREFIX}mmlu_{s}": counts.get(s, 0) for s in mmlu_subjects()}
        else:
            strata[t] = {PREFIX + t: len(load_rows(next(iter(SINGLE[t][1].values())), data_dir, source="local"))}
    return strata


def _offline_env() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


BACKENDS = typing.get_args(EvaluationOptions.model_fields["backend"].annotation)  # ("hf", "vllm")


def evaluate(
    model_path: str,
    tasks=TASKS,
    limit: int | None = None,
    num_fewshot: int = 0,
    batch_size: int | str = 8,
    seed: int = 1234,
    dtype: str = "float32",
    device: str = "cpu",
    out_dir: str | Path | None = None,
    data_dir=None,
    protocol: str = "paper",
    limits: dict[str, int] | None = None,
    backend: str = "hf",
    tensor_parallel: int = 1,
    data_parallel: int = 1,
    parallelize: bool = False,
    threads: int | None = None,
    superset: dict[str, int] | None = None,
) -> dict:
    """Run lm-eval on a local HF model directory; return (and optionally write) a compact result.

    limit: docs per benchmark (MMLU: in all, stratified over subjects), None: every doc; limits: benchmark ->
    its own number of docs (with a limit); superset: benchmark -> a larger number of docs that contains that
    sample (stats.sample_plan: the reference row's absolute level on more documents, paired_columns still
    compares on the shared ones).
    backend: hf = lm-eval's HFLM in this process, each context's choices packed in one sequence
    (transmla.evaluation.scoring; parallelize: lm-eval's split of the model over the visible GPUs);
    vllm = lm-eval's own VLLM backend in the vLLM environment (transmla.runtime.vllm_env), with
    tensor_parallel GPUs per replica and data_parallel replicas (lm-eval dispatches those through Ray);
    an MLA export is padded for vLLM first (transmla.runtime.serving.pad_checkpoint, exact); threads:
    the vLLM process's CPU threads. Both backends score the same documents with the same task files.
    Result: {"tasks": {task: {"metric", "value", "se", "n", "acc", "acc_norm"}}, "arc_mean", "average"
    (with "arc_se", "average_se"; average only when all seven benchmarks ran), "scores" (task ->
    lm-eval task -> {doc index: score of the column metric}), "sizes", "protocol", "sampling", ...}.
    With out_dir: results.json and samples/<task>.jsonl (lm-eval's per-sample log).
    """
    _offline_env()
    tasks = tuple(tasks)
    check_evaluation(tasks, limit, num_fewshot, protocol, backend, tensor_parallel, data_parallel, parallelize, out_dir)
    import tempfile

    mmlu_form, _ = PROTOCOLS[protocol]
    t0 = time.perf_counter()
    raw: dict = {"results": {}, "samples": {}}
    per_task = {}
    with tempfile.TemporaryDirectory(prefix="transmla-tasks-") as tdir:
        write_task_yamls(tdir, tasks, data_dir, mmlu=mmlu_form, num_fewshot=num_fewshot)
        strata = task_strata(tasks, data_dir)
        chosen = stats.sample_plan(strata, limit, seed, limits, superset)
        jobs = []
        for t in tasks:  # one benchmark at a time: a progress bar and a docs/s figure each
            # the lm-eval tasks with sampled docs (a stratified MMLU sample skips small subjects at small limits;
            # a subject left out of `samples` would be scored in full)
            names = [k for k in strata[t] if chosen is None or chosen[k]]
            jobs.append((t, names, None if chosen is None else {k: chosen[k] for k in names}))
        if backend == "vllm":
            runs, version = _run_vllm(model_path, jobs, Path(tdir), seed, dtype, batch_size, tensor_parallel,
                                      data_parallel, threads)
        else:
            import lm_eval

            runs = _run_hf(model_path, jobs, tdir, seed, dtype, device, batch_size, parallelize)
            version = getattr(lm_eval, "__version__", None)
        for t, out, sec in runs:
            raw["results"].update(out["results"])
            raw["samples"].update(out.get("samples", {}))
            n = sum(len(rows) for rows in out.get("samples", {}).values())  # the job's tasks only
            per_task[t] = {"docs": n, "seconds": round(sec, 1), "docs_per_second": round(n / sec, 2) if sec else None}
            print(f"[transmla] {t}: {n} docs in {sec:.0f} s ({n / max(sec, 1e-9):.1f} docs/s)", file=sys.stderr)
    result = summarize(raw, tasks, strata, protocol)
    result["speed"] = per_task
    result.update({
        "model": model_path, "limit": limit, "limits": limits or {}, "superset": superset or {}, "num_fewshot": num_fewshot, "seed": seed,
        "sampling": ("all docs" if limit is None else
                     f"{limit} docs per benchmark{''.join(f', {t} {k}' for t, k in sorted((limits or {}).items()))} "
                     "(MMLU: stratified by subject, proportional), each benchmark drawn "
                     f"without replacement by its own random.Random('{seed}/<task>')"
                     + "".join(f"; {t}: a superset of {k} docs" for t, k in sorted((superset or {}).items()))),
        "lm_eval_version": version,
        "seconds": round(time.perf_counter() - t0, 1),
    })
    if backend != "hf":  # an HF result keeps the format of the results already stored
        result["backend"] = {"name": backend, "tensor_parallel": tensor_parallel, "data_parallel": data_parallel}
    docs = sum(e["n"] for e in result["tasks"].values())
    result["docs_per_second"] = round(docs / result["seconds"], 2) if result["seconds"] else None
    if out_dir is not None:
        write_results(out_dir, result, raw)
    return result


MMLU_DEV_PER_SUBJECT = 5  # MMLU's dev split: five questions per subject, by the benchmark's construction


def check_evaluation(tasks, limit: int | None = None, num_fewshot: int = 0, protocol: str = "paper",
                     backend: str = "hf", tensor_parallel: int = 1, data_parallel: int = 1, parallelize: bool = False,
                     out_dir: str | Path | None = None) -> None:
    """Refuse a request `evaluate` cannot run as asked, from its arguments alone: callers check it before
    they load or materialise the model (an unusable out_dir would otherwise fail after the whole run)."""
    from transmla.io.paths import check_output

    if not tasks:
        raise TransMLAError("No benchmark to evaluate (an empty task list).", f"name some of {', '.join(TASKS)}.")
    if num_fewshot < 0:
        raise TransMLAError(f"num_fewshot={num_fewshot} is negative.", "pass 0 (the paper's zero-shot) or more.")
    for t in tasks:
        if t not in TASKS:
            raise TransMLAError(f"Unknown benchmark {t!r}.", f"choose from {', '.join(TASKS)}.")
    EvaluationOptions(tasks=tuple(tasks))  # the params' rules for the list itself (a benchmark named twice)
    if protocol not in PROTOCOLS:
        raise TransMLAError(f"Unknown evaluation protocol {protocol!r}.", f"choose from {', '.join(PROTOCOLS)}.")
    if limit is not None and limit < 1:
        raise TransMLAError(f"--limit {limit} must be a positive number of docs.",
                            "pass --limit N >= 1, or omit it for full runs.")
    _check_backend(backend, tensor_parallel, data_parallel, parallelize)
    if num_fewshot and set(tasks) - {"mmlu"}:
        # the offline files hold only the evaluation split of these: demonstrations would be drawn from the
        # very documents being scored
        raise TransMLAError(f"num_fewshot={num_fewshot}: the local data has a few-shot split only for MMLU (dev); "
                            f"{', '.join(sorted(set(tasks) - {'mmlu'}))} would draw demonstrations from their test split.",
                            "evaluate zero-shot (the paper's protocol), or pass --tasks mmlu for few-shot MMLU.")
    if num_fewshot > MMLU_DEV_PER_SUBJECT:
        # lm-eval draws a subject's demonstrations from its dev split and asserts there are enough, after the model loaded
        raise TransMLAError(f"num_fewshot={num_fewshot}: MMLU's dev split holds five questions per "
                            "subject, the most demonstrations a prompt can take.",
                            f"pass --num-fewshot {MMLU_DEV_PER_SUBJECT} or fewer (5 is MMLU's standard few-shot).")
    if out_dir is not None:
        check_output(out_dir, "dir")


def _check_backend(backend: str, tensor_parallel: int, data_parallel: int, parallelize: bool) -> None:
    """Fail fast, before any model is loaded, on a backend that cannot run as asked (the rules are
    EvaluationOptions', the params' own validation)."""
    if backend not in BACKENDS:
        raise TransMLAError(f"Unknown evaluation backend {backend!r}.", f"choose from {', '.join(BACKENDS)}.")
    EvaluationOptions(backend=backend, tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                      parallelize=parallelize)
    if parallelize:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:  # HF's device map then offloads to ./offload on disk: the same scores, slower, a stray folder
            raise TransMLAError(f"parallelize splits one model over the visible GPUs; this machine has {gpus}.",
                                "drop --parallelize (parallelize: false) here; use it on a machine with several GPUs.")
    if backend == "vllm":
        from transmla.runtime.vllm_env import venv_dir, vllm_python

        if vllm_python() is None:
            raise TransMLAError(f"The vLLM backend needs the vLLM environment ({venv_dir()} is not ready).",
                                "run `python -m transmla.runtime.vllm_env` to create it, or use backend: hf.")


def _run_hf(model_path, jobs, tdir, seed, dtype, device, batch_size, parallelize):
    """(benchmark, lm-eval output, seconds) per job, scored by lm-eval's HF model loaded once."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from transmla.evaluation.scoring import SharedContextLM

    # lm-eval's HF model, loaded once, scoring each context's choices in one packed sequence
    lm = SharedContextLM(pretrained=model_path, dtype=dtype, device=device, batch_size=batch_size,
                         **({"parallelize": True} if parallelize else {}))
    tm = TaskManager(include_path=tdir, include_defaults=True)
    for t, names, plan in jobs:
        t1 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=None,  # set in each task's config: nothing to override (and warn about) per task
            samples=plan,
            log_samples=True,
            task_manager=tm,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )
        yield t, out, time.perf_counter() - t1


def vllm_model_dir(model_path: str, work: Path) -> str:
    """The directory vLLM evaluates: an original model as it is; a TransMLA export padded to the latent and
    RoPE sizes vLLM's MLA kernels take (exact: transmla.runtime.serving), refused where vLLM would not run
    it faithfully (e.g. Qwen2 exports' attention biases)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    if "transmla" not in cfg:
        return model_path
    from transmla.runtime.serving import pad_checkpoint

    res = pad_checkpoint(model_path, work / "vllm-model")
    if res["vllm_problems"]:
        raise TransMLAError(f"vLLM would not evaluate {model_path} faithfully: {'; '.join(res['vllm_problems'])}.",
                            "evaluate it with backend: hf.")
    return res["out"]


def _run_vllm(model_path, jobs, work: Path, seed, dtype, batch_size, tensor_parallel, data_parallel, threads):
    """([(benchmark, lm-eval output, seconds)], lm-eval version): lm-eval's VLLM backend, loaded once in
    the vLLM environment (transmla.runtime.vllm_runner, task lm_eval)."""
    from transmla.runtime.vllm_env import run_vllm

    req = {"task": "lm_eval", "model": vllm_model_dir(model_path, work), "include_path": str(work), "seed": seed,
           "dtype": dtype, "batch_size": "auto" if str(batch_size).startswith("auto") else int(batch_size),
           "tensor_parallel_size": tensor_parallel, "data_parallel_size": data_parallel,
           "jobs": [{"name": t, "tasks": names, "samples": plan} for t, names, plan in jobs]}
    res = run_vllm(req, kv_cache_gib=2, threads=threads, timeout=None)
    return [(j["name"], j, j["seconds"]) for j in res["jobs"]], res["environment"].get("lm_eval")


def doc_scores(raw: dict, strata: dict[str, dict[str, int]], metric: dict[str, str]) -> dict[str, dict[str, dict[int, float]]]:
    """Per-document scores of each benchmark's column metric from lm-eval's sample logs:
    task -> lm-eval task -> {doc index: 0.0 | 1.0}."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for t, subs in strata.items():
        out[t] = {}
        for name in subs:
            rows = raw.get("samples", {}).get(name, [])
            if rows and metric[t] not in rows[0]:
                raise TransMLAError(f"lm-eval logged no {metric[t]} for {name}.", "check the task's metric_list.")
            out[t][name] = {int(r["doc_id"]): float(r[metric[t]]) for r in rows}
    return out


def summarize(raw: dict, tasks, strata: dict[str, dict[str, int]], protocol: str = "paper") -> dict:
    """Columns (estimate, standard error, n) from the per-document scores; lm-eval's own aggregates of
    acc/acc_norm are kept beside them for reference."""
    _, metric = PROTOCOLS[protocol]
    scores = doc_scores(raw, strata, metric)
    out: dict = {"tasks": {}, "protocol": protocol, "protocol_note": PROTOCOL_NOTE[protocol]}
    est = {}
    for t in tasks:
        sizes = strata[t]
        est[t] = stats.estimate({k: v for k, v in scores[t].items() if v}, sizes)
        r = raw["results"].get(PREFIX + t, {})
        entry = {m: r[f"{m},none"] for m in ("acc", "acc_norm") if f"{m},none" in r}
        entry.update(metric=metric[t], value=est[t].value, se=est[t].se, n=est[t].n)
        out["tasks"][t] = entry
    if "arc_easy" in est and "arc_challenge" in est:
        arc = (est["arc_easy"] + est["arc_challenge"]).scale(0.5)  # the paper's "ARC" column
        out["arc_mean"], out["arc_se"] = arc.value, arc.se
    if set(TASKS) <= set(est):
        avg = stats.average(est)
        out["average"], out["average_se"] = avg.value, avg.se
    else:  # a subset of the benchmarks has no Table-1 average (never a mean over fewer columns)
        out["average"] = out["average_se"] = None
    out["columns"] = {t: metric[t] for t in tasks}
    out["scores"] = {t: {k: {str(i): x for i, x in sorted(v.items())} for k, v in scores[t].items()} for t in tasks}
    out["sizes"] = {t: strata[t] for t in tasks}
    return out


def scores_of(result: dict, task: str) -> dict[str, dict[int, float]]:
    """A result's per-document scores of one benchmark, keyed back to int doc indices."""
    return {k: {int(i): x for i, x in v.items()} for k, v in result["scores"][task].items()}


def on_docs_of(reference: dict[str, dict[int, float]], model: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """The reference's scores on the documents the model scored (a reference scored on a superset of the
    model's sample: stats.sample_plan); a document the reference lacks stays missing, for paired() to refuse."""
    return {h: {i: reference[h][i] for i in docs if i in reference.get(h, {})} for h, docs in model.items()}


def paired_columns(result: dict, reference: dict) -> dict:
    """Per benchmark, the ARC mean and the average: result - reference on the result's documents, with the
    paired standard error (the reference must have scored every one of them: the same sample, or a
    superset of it)."""
    d = {t: stats.paired(scores_of(result, t), on_docs_of(scores_of(reference, t), scores_of(result, t)),
                         result["sizes"][t])
         for t in result["scores"] if t in reference["scores"]}
    out = {t: e.as_dict() for t, e in d.items()}
    if "arc_easy" in d and "arc_challenge" in d:
        out["arc_mean"] = (d["arc_easy"] + d["arc_challenge"]).scale(0.5).as_dict()
    if set(TASKS) <= set(d):
        out["average"] = stats.average(d).as_dict()
    return out


def write_results(out_dir: str | Path, result: dict, raw: dict) -> None:
    """results.json and samples/<task>.jsonl of one run. The samples folder is replaced whole: an --out that
    held an earlier run (other tasks, another limit) never mixes its sample files with this run's."""
    from transmla.io.paths import atomic_dir

    out = Path(out_dir)
    groups: dict[str, list] = {}
    for name, rows in raw.get("samples", {}).items():
        task = "mmlu" if name.startswith(f"{PREFIX}mmlu_") else name[len(PREFIX):]
        for row in rows:
            row = dict(row, task=name[len(PREFIX):])
            groups.setdefault(task, []).append(row)
    with atomic_dir(out / "samples") as tmp:
        for task, rows in groups.items():
            with open(tmp / f"{task}.jsonl", "w") as f:
                for row in rows:
                    f.write(json.dumps(row, default=str) + "\n")
    write_text_atomic(out / "results.json", json.dumps(result, indent=2, default=str))
    print(f"[transmla] wrote {out / 'results.json'}", file=sys.stderr)

"""Six-benchmark evaluation (paper Table 1) with lm-evaluation-harness, offline.

lm-eval's own task definitions (prompts, choices, metrics) are reused; only the data source is
overridden. At run time we write task YAMLs that `include:` the installed lm-eval task file and set
`dataset_path: json` with absolute `data_files` pointing at the local JSONL mirror (relative paths
would resolve against the working directory, not the YAML). MMLU becomes one task per subject
(filtered from the single JSONL by a generated `process_docs`), with the dev split as few-shot pool,
grouped with weight_by_size like lm-eval's own `mmlu` group.

The paper's "ARC" column is the mean of ARC-Easy and ARC-Challenge (`arc_mean` here).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from transmla.io.data import load_rows, local_path
from transmla.errors import TransMLAError
from transmla.io.paths import write_text_atomic

from transmla.config import BENCHMARKS as TASKS
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
# The metric each Table-1 column reports (acc_norm where lm-eval/MHA2MLA report it).
COLUMN_METRIC = {
    "mmlu": "acc", "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "piqa": "acc_norm",
    "hellaswag": "acc_norm", "openbookqa": "acc_norm", "winogrande": "acc",
}


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def mmlu_subjects() -> list[str]:
    d = _lm_eval_tasks_dir() / "mmlu" / "default"
    return sorted(p.stem[len("mmlu_"):] for p in d.glob("mmlu_*.yaml"))


def _q(path: Path) -> str:
    return json.dumps(str(path))  # a valid YAML double-quoted scalar


def write_task_yamls(out_dir: str | Path, tasks=TASKS, data_dir=None) -> Path:
    """Write the offline task YAMLs into out_dir; clear errors for missing data files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = _lm_eval_tasks_dir()
    for t in tasks:
        if t == "mmlu":
            _write_mmlu(out, base, data_dir)
            continue
        if t not in SINGLE:
            raise TransMLAError(f"Unknown benchmark {t!r}.", f"choose from {', '.join(TASKS)}.")
        rel, splits, absent = SINGLE[t]
        files = "\n".join(f"    {split}: {_q(local_path(ds, data_dir))}" for split, ds in splits.items())
        nulls = "".join(f"{k}: null\n" for k in absent)
        (out / f"{PREFIX}{t}.yaml").write_text(
            f"include: {_q(base / rel)}\ntask: {PREFIX}{t}\ntag: transmla_offline\n"
            f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n{files}\n{nulls}"
        )
    return out


def _write_mmlu(out: Path, base: Path, data_dir) -> None:
    test, dev = local_path("mmlu_test", data_dir), local_path("mmlu_dev", data_dir)
    subjects = mmlu_subjects()
    (out / "offline_mmlu_subjects.py").write_text(
        '"""Generated: one process_docs filter per MMLU subject (the offline JSONL holds all 57)."""\n\n\n'
        "def _subject(name):\n    def process_docs(dataset):\n"
        "        return dataset.filter(lambda d: d[\"subject\"] == name)\n\n    return process_docs\n\n\n"
        + "".join(f"{s} = _subject({s!r})\n" for s in subjects)
    )
    for s in subjects:
        (out / f"{PREFIX}mmlu_{s}.yaml").write_text(
            f"include: {_q(base / 'mmlu' / 'default' / f'mmlu_{s}.yaml')}\n"
            f"task: {PREFIX}mmlu_{s}\ntag: {PREFIX}mmlu_tasks\n"
            f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
            f"    test: {_q(test)}\n    dev: {_q(dev)}\n"
            f"process_docs: !function offline_mmlu_subjects.{s}\n"
        )
    (out / f"{PREFIX}mmlu.yaml").write_text(
        f"group: {PREFIX}mmlu\ntask:\n  - {PREFIX}mmlu_tasks\naggregate_metric_list:\n"
        "  - metric: acc\n    weight_by_size: true\nmetadata:\n  version: 2\n"
    )


def _task_sizes(tasks, data_dir) -> dict[str, int]:
    """Number of docs of each lm-eval task (MMLU: per subject) in the local files."""
    sizes = {}
    for t in tasks:
        if t == "mmlu":
            counts: dict[str, int] = {}
            for r in load_rows("mmlu_test", data_dir):
                counts[r["subject"]] = counts.get(r["subject"], 0) + 1
            sizes.update({f"{PREFIX}mmlu_{s}": counts.get(s, 0) for s in mmlu_subjects()})
        else:
            sizes[PREFIX + t] = len(load_rows(next(iter(SINGLE[t][1].values())), data_dir))
    return sizes


def sample_indices(sizes: dict[str, int], limit: int | None, seed: int) -> dict[str, list[int]] | None:
    """Seeded random subset of `limit` docs per task (all docs when limit is None)."""
    if limit is None:
        return None
    rng = random.Random(seed)
    return {t: sorted(rng.sample(range(n), min(limit, n))) for t, n in sorted(sizes.items())}


def _offline_env() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
) -> dict:
    """Run lm-eval on a local HF model directory; return (and optionally write) a compact result.

    Result: {"tasks": {task: {"metric", "value", "stderr", "n", "acc", "acc_stderr", ...}},
    "arc_mean", "average", "limit", "sampling", ...}. With out_dir: results.json and
    samples/<task>.jsonl (lm-eval's per-sample log).
    """
    _offline_env()
    tasks = tuple(tasks)
    for t in tasks:
        if t not in TASKS:
            raise TransMLAError(f"Unknown benchmark {t!r}.", f"choose from {', '.join(TASKS)}.")
    if limit is not None and limit < 1:
        raise TransMLAError(f"limit={limit} must be positive.", "pass --limit N >= 1, or omit it for full runs.")
    import tempfile

    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="transmla-tasks-") as tdir:
        write_task_yamls(tdir, tasks, data_dir)
        sizes = _task_sizes(tasks, data_dir)
        chosen = sample_indices(sizes, limit, seed)
        tm = TaskManager(include_path=tdir, include_defaults=True)
        names = [f"{PREFIX}{t}" for t in tasks]
        raw = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": model_path, "dtype": dtype, "device": device},
            tasks=names,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            samples=chosen,
            log_samples=True,
            task_manager=tm,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        )
    result = summarize(raw, tasks, sizes, chosen)
    result.update({
        "model": model_path, "limit": limit, "num_fewshot": num_fewshot, "seed": seed,
        "sampling": ("all docs" if limit is None else
                     f"{limit} docs per task (per MMLU subject) drawn uniformly without replacement, random.Random({seed})"),
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
        "seconds": round(time.perf_counter() - t0, 1),
    })
    if out_dir is not None:
        write_results(out_dir, result, raw)
    return result


def summarize(raw: dict, tasks, sizes: dict[str, int], chosen) -> dict:
    res = raw["results"]
    out: dict = {"tasks": {}}
    for t in tasks:
        name = PREFIX + t
        r = res[name]
        entry = {}
        for m in ("acc", "acc_norm"):
            if f"{m},none" in r:
                entry[m] = r[f"{m},none"]
                se = r.get(f"{m}_stderr,none")
                entry[f"{m}_stderr"] = se if isinstance(se, (int, float)) else None
        if t == "mmlu":
            subs = [k for k in sizes if k.startswith(f"{PREFIX}mmlu_")]
            entry["n"] = sum(len(chosen[k]) if chosen else sizes[k] for k in subs)
        else:
            entry["n"] = int(raw.get("n-samples", {}).get(name, {}).get("effective", 0)) or (
                len(chosen[name]) if chosen else sizes[name])
        entry["metric"] = COLUMN_METRIC[t]
        entry["value"] = entry[COLUMN_METRIC[t]]
        entry["stderr"] = entry.get(f"{COLUMN_METRIC[t]}_stderr")
        out["tasks"][t] = entry
    v = {t: out["tasks"][t]["value"] for t in tasks}
    if "arc_easy" in v and "arc_challenge" in v:
        out["arc_mean"] = (v["arc_easy"] + v["arc_challenge"]) / 2  # the paper's "ARC" column
    cols = [v[t] for t in ("mmlu", "piqa", "hellaswag", "openbookqa", "winogrande") if t in v]
    if "arc_mean" in out:
        cols.append(out["arc_mean"])
    out["average"] = sum(cols) / len(cols) if cols else None
    out["columns"] = {t: COLUMN_METRIC[t] for t in tasks}
    return out


def write_results(out_dir: str | Path, result: dict, raw: dict) -> None:
    out = Path(out_dir)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    groups: dict[str, list] = {}
    for name, rows in raw.get("samples", {}).items():
        task = "mmlu" if name.startswith(f"{PREFIX}mmlu_") else name[len(PREFIX):]
        for row in rows:
            row = dict(row, task=name[len(PREFIX):])
            groups.setdefault(task, []).append(row)
    for task, rows in groups.items():
        with open(out / "samples" / f"{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    write_text_atomic(out / "results.json", json.dumps(result, indent=2, default=str))
    print(f"[transmla] wrote {out / 'results.json'}", file=sys.stderr)

"""Flow: evaluate one model (original or converted) -> the Table-1 metrics of one row.

    perplexity (WikiText-2 test) + benchmarks (six Table-1 benchmarks via lm-eval) -> metrics JSON

    python -m flows.evaluate --model smollm2-135m --method original
    python -m flows.evaluate --model smollm2-135m --method transmla --budget 0.125 [--checkpoint DIR --out FILE]
    python -m flows.evaluate --model smollm2-135m --method transmla --budget 0.125 --finetuned   (re-eval)
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks import tracking
from tasks.artifacts import load_json, publish
from tasks.evaluate import benchmarks, case_study, perplexity
from tasks.model import checkpoint_ref, dataset_ref, resolve_model
from transmla.errors import TransMLAError
from tasks.report import table_row, tracked_metrics
from transmla.evaluation.benchmarks import BENCHMARK_DATA
from transmla.io.paths import write_text_atomic
from transmla.runtime import vllm_env

from . import _cli, layout
from .params import Profile


def evaluate_ref(profile: Profile, model_ref: dict, dtype: str = "float32", reference: bool = False) -> dict:
    """{"ppl": {...}, "benchmarks": {...}, "bench_ref"} of a model ref (both cached on its content hash).
    reference: the model the table compares every row with (the original): its benchmarks also score the
    superset evaluation.reference_limits."""
    ev = profile.evaluation
    ppl_data, data = evaluation_data(profile)
    ppl = perplexity(model_ref, ppl_data, ev.ppl_seqlen, ev.ppl_max_tokens, dtype, profile.device)
    bench = benchmarks(model_ref, data, list(ev.tasks), ev.limit, ev.batch_size, ev.seed, dtype, profile.device,
                       ev.protocol, dict(ev.limits), backend_of(ev),
                       dict(ev.reference_limits) if reference else None,
                       vllm_env.environment() if ev.backend == "vllm" else None)  # another vLLM: other scores
    cases = case_study(model_ref, dtype=dtype, device=profile.device)
    return {"ppl": load_json(ppl), "benchmarks": json.loads((Path(bench["path"]) / "results.json").read_text()),
            "bench_ref": bench, "case_study": load_json(cases)["rows"]}


def evaluation_data(profile: Profile) -> tuple[dict, list[dict]]:
    """The data refs an evaluation reads: the perplexity set's and the benchmarks' (lm-eval reads the benchmarks
    from the local files whatever the data source: they are keyed on those)."""
    ev = profile.evaluation
    return dataset_ref(ev.ppl_dataset), [dataset_ref(n, source="local") for t in ev.tasks for n in BENCHMARK_DATA[t]]


def backend_of(ev) -> dict:
    """The evaluation backend's arguments (transmla.evaluation.benchmarks.evaluate)."""
    return {k: getattr(ev, k) for k in ("backend", "tensor_parallel", "data_parallel", "parallelize")}


def model_under_test(profile: Profile, model: str, method: str, budget: float | None, checkpoint: str | None,
                     finetuned: bool) -> tuple[dict, dict | None]:
    """(model ref, conversion record) of the original, a converted or a fine-tuned checkpoint."""
    if method == "original":
        if finetuned:
            raise TransMLAError("The original model is not fine-tuned here.", "drop --finetuned or pick a converted method.")
        if checkpoint is not None:  # it scored the profile's model and wrote the row as if it were the checkpoint's
            raise TransMLAError(f"--method original scores the profile's model: --checkpoint {checkpoint} would be "
                                "ignored.", "drop --checkpoint, or name the --method and --budget it was converted with "
                                "(another original model: add it under models: in the params).")
        return resolve_model(profile.model(model).source), None
    if budget is None:
        raise TransMLAError("A converted model needs its --budget.", "pass --budget (e.g. 0.125).")
    where = layout.finetuned_dir if finetuned else layout.checkpoint_dir
    ref = checkpoint_ref(checkpoint or where(model, method, budget), "finetune" if finetuned else "convert")
    return ref, json.loads((Path(ref["path"]) / "config.json").read_text()).get("transmla")


@flow(name="evaluate")
def evaluate(profile: Profile, model: str, method: str, budget: float | None = None, checkpoint: str | None = None,
             out: str | None = None, finetuned: bool = False) -> dict:
    if checkpoint is not None and out is None:
        raise TransMLAError(f"--checkpoint {checkpoint} is not the pipeline's model: its metrics would replace the "
                            "pipeline's row.", "pass --out FILE for its metrics JSON.")
    model_ref, conversion = model_under_test(profile, model, method, budget, checkpoint, finetuned)
    ev = evaluate_ref(profile, model_ref, profile.model(model).dtype, reference=method == "original")
    row = table_row(model, method, budget, ev["ppl"], ev["benchmarks"], conversion, profile.evaluation.limit)
    row["case_study"] = ev["case_study"]
    if out is not None:  # a one-off run (another sample, another checkpoint): never the pipeline's row, logs or run
        write_text_atomic(out, json.dumps(row, indent=2))
        return row
    write_text_atomic(layout.metrics_file(model, method, budget, finetuned), json.dumps(row, indent=2))
    publish(ev["bench_ref"], layout.eval_dir(model, method, budget, finetuned))  # per-sample logs
    tracking.track(profile.mlflow.experiment, model, method, budget, finetuned=finetuned,
                   tags={"eval." + k: v for k, v in profile.evaluation.model_dump().items()}, tag_prefix="eval.",
                   metrics=tracked_metrics(row), artifacts={"table_row.json": row})
    return row


if __name__ == "__main__":
    _cli.entry(evaluate, __doc__, variant="or-original", new_outputs={"out": "new_file"}, tracked="out",
               checkpoint="model dir (default artifacts/<model>/<method>-<budget>[-ft]/model; another needs --out)",
               finetuned="flag: evaluate the fine-tuned model",
               out="metrics JSON of a one-off run (default: the pipeline's row, reports/metrics/..., with its "
                   "per-sample logs and MLflow run)")

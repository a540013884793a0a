"""Flow: evaluate one model (original or converted) -> the Table-1 metrics of one row.

    perplexity (WikiText-2 test) + benchmarks (six Table-1 benchmarks via lm-eval) -> metrics JSON

    python -m flows.evaluate --model smollm2-135m --method original
    python -m flows.evaluate --model smollm2-135m --method transmla --budget 0.125 [--checkpoint DIR]
    python -m flows.evaluate --model smollm2-135m --method transmla --budget 0.125 --finetuned   (re-eval)
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks import tracking
from tasks.artifacts import dir_ref, load_json, publish
from tasks.evaluate import benchmarks, perplexity
from tasks.model import dataset_ref, resolve_model
from transmla.errors import TransMLAError
from transmla.evaluation.benchmarks import SINGLE
from transmla.io.paths import write_text_atomic
from transmla.io.sources import content_hash

from . import _cli, layout
from .params import Profile

# The data sets each benchmark reads (they join its cache key): evaluation.SINGLE's, plus MMLU's test + dev files.
BENCHMARK_DATA = {t: list(splits.values()) for t, (_, splits, _) in SINGLE.items()} | {"mmlu": ["mmlu_test", "mmlu_dev"]}


def evaluate_ref(profile: Profile, model_ref: dict, dtype: str = "float32") -> dict:
    """{"ppl": {...}, "benchmarks": {...}} of a model ref (both cached on its content hash)."""
    ev = profile.evaluation
    ppl = perplexity(model_ref, dataset_ref(ev.ppl_dataset), ev.ppl_seqlen, ev.ppl_max_tokens, dtype, profile.device)
    data = [dataset_ref(n) for t in ev.tasks for n in BENCHMARK_DATA[t]]
    bench = benchmarks(model_ref, data, list(ev.tasks), ev.limit, ev.batch_size, ev.seed, dtype, profile.device)
    return {"ppl": load_json(ppl), "benchmarks": json.loads((_path(bench) / "results.json").read_text()), "bench_ref": bench}


def _path(ref) -> Path:
    return Path(ref["path"])


def table_row(model: str, method: str, budget: float | None, ev: dict, conversion: dict | None, profile: Profile) -> dict:
    b = ev["benchmarks"]
    tasks = {t: v["value"] for t, v in b["tasks"].items()}
    tokens = ((conversion or {}).get("finetune") or {}).get("tokens_trained", 0)
    return {
        "model": model, "method": method, "budget": budget, "finetuned": tokens > 0,
        "kv_cache_ratio": 1.0 if conversion is None else conversion["kv_cache_ratio"],
        "qk_rope_head_dim": None if conversion is None else conversion["qk_rope_head_dim"],
        "kv_lora_rank": None if conversion is None else conversion["kv_lora_rank"],
        "tokens_trained": tokens,
        "ppl": ev["ppl"]["ppl"], "ppl_tokens": ev["ppl"]["tokens"],
        "average": b["average"], "arc_mean": b.get("arc_mean"), "benchmarks": tasks,
        "benchmark_n": {t: v["n"] for t, v in b["tasks"].items()},
        "eval_limit": profile.evaluation.limit, "seconds": {"ppl": ev["ppl"]["seconds"], "benchmarks": b["seconds"]},
    }


@flow(name="evaluate")
def evaluate(profile: Profile, model: str, method: str, budget: float | None = None, checkpoint: str | None = None,
             out: str | None = None, samples_out: str | None = None, finetuned: bool = False) -> dict:
    if method == "original":
        if finetuned:
            raise TransMLAError("The original model is not fine-tuned here.", "drop --finetuned or pick a converted method.")
        model_ref, conversion = resolve_model(profile.model(model).source), None
    else:
        if budget is None:
            raise TransMLAError("A converted model needs its --budget.", "pass --budget (e.g. 0.125).")
        default = layout.finetuned_dir if finetuned else layout.checkpoint_dir
        ckpt = Path(checkpoint or default(model, method, budget))
        if not (ckpt / "config.json").is_file():
            stage = "finetune" if finetuned else "convert"
            raise TransMLAError(f"No {'fine-tuned' if finetuned else 'converted'} checkpoint at {ckpt}.",
                                f"run the {stage} flow (or dvc repro) first.")
        model_ref = dir_ref(ckpt, sha256=content_hash(ckpt))
        conversion = json.loads((_path(model_ref) / "config.json").read_text()).get("transmla")
    ev = evaluate_ref(profile, model_ref, profile.model(model).dtype)
    row = table_row(model, method, budget, ev, conversion, profile)
    write_text_atomic(out or layout.metrics_file(model, method, budget, finetuned), json.dumps(row, indent=2))
    publish(ev["bench_ref"], samples_out or layout.eval_dir(model, method, budget, finetuned))  # per-sample logs
    client, run_id = tracking.stage_run(profile.mlflow.experiment, model, method, budget, finetuned=finetuned)
    metrics = {"wikitext2_ppl": row["ppl"], "average": row["average"], "arc": row["arc_mean"],
               "kv_cache_ratio": row["kv_cache_ratio"], "kv_cache_reduction": 1 - row["kv_cache_ratio"],
               "tokens_trained": row["tokens_trained"], **{f"bench.{t}": v for t, v in row["benchmarks"].items()}}
    tracking.log(client, run_id, tags={"eval." + k: v for k, v in profile.evaluation.model_dump().items()},
                 metrics=metrics, artifacts={"table_row.json": row})
    return row


def main():
    ap = _cli.parser(__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", required=True, choices=["original", "transmla", "mha2mla"])
    ap.add_argument("--budget", type=float)
    ap.add_argument("--checkpoint", help="converted model dir (default artifacts/<model>/<method>-<budget>/model)")
    ap.add_argument("--finetuned", action="store_true",
                    help="evaluate the fine-tuned model (default checkpoint artifacts/<model>/<method>-<budget>-ft/model)")
    ap.add_argument("--out", help="metrics JSON (default reports/metrics/<model>/<variant>.json)")
    args = ap.parse_args()
    evaluate(_cli.profile_of(args), args.model, args.method, args.budget, args.checkpoint, args.out,
             finetuned=args.finetuned)


if __name__ == "__main__":
    _cli.run(main)

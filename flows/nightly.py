"""Flow: nightly conversions of a watch list of model sources (params `nightly:`).

For each watched source: resolve it to its content hash; convert + evaluate it at each nightly
budget x method unless that (content hash, conversion config, evaluation config) is already in
the ledger, i.e. an unchanged release is skipped and a new one (new weights) is converted.

    python -m flows.nightly                # one pass now
    python -m flows.nightly --serve        # long-running: a Prefect deployment on the params' cron
    prefect deploy --all                   # or register the deployment in prefect.yaml with a work pool

Outputs: artifacts/nightly/<source slug>-<hash[:12]>/<method>-<budget>/{model,metrics.json};
ledger entries in <store>/nightly/; one MLflow run per (model, method, budget).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from prefect import flow, get_run_logger

from tasks import tracking
from tasks.artifacts import STORE, canonical
from tasks.model import resolve_model
from tasks.report import table_row
from transmla.io.paths import write_text_atomic
from transmla.io.sources import parse_source

from . import _cli, layout
from .convert import converted
from .evaluate import evaluate_ref
from .params import DEFAULT_PARAMS, load_profile

LEDGER = STORE / "nightly"


def job_key(model_sha: str, options: dict, evaluation: dict) -> str:
    payload = json.dumps({"model": model_sha, "convert": canonical(options), "eval": canonical(evaluation)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@flow(name="nightly")
def nightly(params: str = str(DEFAULT_PARAMS), overrides: dict | None = None, out_root: str | None = None) -> list[dict]:
    """One pass over the watch list; returns one record per (source, method, budget)."""
    profile = load_profile(params, overrides)
    log = get_run_logger()
    root = Path(out_root) if out_root else layout.ARTIFACTS / "nightly"
    records = []
    for source in profile.nightly.watch:
        model_ref = resolve_model(source)
        name = f"{parse_source(source).slug}-{model_ref['sha256'][:12]}"
        for budget in profile.nightly.budgets:
            for method in profile.nightly.methods:
                o = profile.convert_options(method, budget)
                key = job_key(model_ref["sha256"], o.model_dump(), profile.evaluation.model_dump())
                entry = LEDGER / f"{key}.json"
                rec = {"source": source, "content_hash": model_ref["sha256"], "method": method, "budget": budget, "key": key}
                if entry.is_file():
                    log.info(f"{source} {method} {budget}: unchanged (content {model_ref['sha256'][:12]}), skipped")
                    records.append({**rec, "status": "skipped", **json.loads(entry.read_text())})
                    continue
                out = root / name / layout.variant(method, budget)
                if (out / "model").exists():  # an interrupted earlier night: its steps are cached
                    shutil.rmtree(out / "model")
                ckpt = converted(profile, model_ref, o, str(out / "model"))
                ev = evaluate_ref(profile, ckpt)
                row = table_row(name, method, budget, ev["ppl"], ev["benchmarks"], ckpt["transmla"], profile.evaluation.limit)
                write_text_atomic(out / "metrics.json", json.dumps(row, indent=2))
                tracking.track(profile.mlflow.experiment, name, method, budget, config=o.model_dump(), params={"source": source, "content_hash": model_ref["sha256"]},
                             metrics={"wikitext2_ppl": row["ppl"], "average": row["average"],
                                      "kv_cache_ratio": row["kv_cache_ratio"]},
                             tags={"transmla.nightly": "true"}, artifacts={"table_row.json": row})
                done = {"checkpoint": str(out / "model"), "ppl": row["ppl"], "average": row["average"]}
                write_text_atomic(entry, json.dumps(done, indent=2))
                log.info(f"{source} {method} {budget}: converted -> {out}, ppl {row['ppl']:.2f}")
                records.append({**rec, "status": "converted", **done})
    return records


def deployment(params: str = str(DEFAULT_PARAMS)):
    """The nightly deployment (cron from the params), for `serve` and for tests."""
    from prefect.schedules import Cron

    profile = load_profile(params)
    return nightly.to_deployment(name="nightly", schedules=[Cron(profile.nightly.cron, timezone=profile.nightly.timezone)],
                                 parameters={"params": params}, tags=["transmla", "nightly"])


def main():
    ap = _cli.parser(__doc__)
    ap.add_argument("--serve", action="store_true", help="serve the deployment on its cron schedule (runs until stopped)")
    args = ap.parse_args()
    _cli.profile_of(args)  # validate before serving or running
    if args.serve:
        from prefect import serve

        serve(deployment(args.params))
    else:
        for r in nightly(args.params, _cli.overrides_of(args) or None):
            print(json.dumps(r))


if __name__ == "__main__":
    _cli.run(main)

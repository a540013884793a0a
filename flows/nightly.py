"""Flow: nightly conversions of new model releases (params `nightly:`).

    watch entry --(metadata: hub commit / newest PyPI version / content hash)--> release id
      unchanged release id (in the ledger) -> skipped, nothing downloaded
      new release id -> fetch exactly that revision / version -> convert + evaluate at each
                         nightly budget x method, next to the original -> ledger, MLflow, report

    python -m flows.nightly                # one night now: prints the report's path; exit 1 if any failed or unresolved
    python -m flows.nightly --serve        # long-running: a Prefect deployment on the params' cron
    prefect deploy --all                   # or register the deployment in prefect.yaml with a work pool

A watch entry is a source string (hf:ORG/NAME[@REV], pypi:PKG>=VER:PATH, a catalog name, a local path)
or a hub query {hub: {author, search, sort, limit}} whose every repository is a watched model.
Outputs: artifacts/nightly/<slug>/<release>/<method>-<budget>/{model,metrics.json} (<release>: the short
release id, so a new release never overwrites the checkpoint the ledger names for an earlier one); ledger entries in
<store>/nightly/ keyed by (release id, conversion config, evaluation config, the code that runs them: a new
converter converts every watched release again, once); one MLflow run per
(model, method, budget); the night's report (nightly.report, default reports/nightly.md).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

from prefect import flow, get_run_logger

from tasks import tracking
from tasks.artifacts import STORE, canonical
from tasks.model import resolve_model
from tasks.releases import watch_releases
from tasks.report import table_row
from transmla.convert import precheck
from transmla.io.paths import check_output, write_text_atomic
from transmla.io.releases import one_line
from transmla.io.sources import parse_source

from . import _cli, layout
from .calibrate import calibration_data
from .convert import converted
from .evaluate import evaluate_ref, evaluation_data
from .params import DEFAULT_PARAMS, Profile, load_profile

LEDGER = STORE / "nightly"
STATUSES = ("converted", "skipped", "refused", "failed", "unresolved")


def job_key(release: str, options: dict, evaluation: dict, code: str, data: str) -> str:
    payload = json.dumps({"release": release, "convert": canonical(options), "eval": canonical(evaluation),
                          "code": code, "data": data}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def variant_data(profile: Profile) -> str:
    """A hash of the data a variant reads (the calibration set, the perplexity set, the benchmarks: their
    contents, or in hub mode their commits). In the ledger key: after a data change a release is converted and
    scored again, not skipped onto numbers from the old data."""
    ppl_data, bench_data = evaluation_data(profile)
    refs = [calibration_data(profile), ppl_data, *bench_data]
    return hashlib.sha256("\n".join(r["sha256"] for r in refs).encode()).hexdigest()


def variant_code() -> str:
    """A hash of the code a variant runs (the convert and evaluate flows' closures and library versions, as
    their tasks' cache keys see them). In the ledger key: a release converted by older code is converted
    again by the new, once, so the night's numbers never describe a converter that no longer runs."""
    from tasks.codehash import code_key

    payload = json.dumps({"convert": code_key("flows.convert"), "evaluate": code_key("flows.evaluate")}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def ledger_entry(path: Path, log=None) -> dict | None:
    """A variant's ledger entry, or None: none yet, or one that cannot be read (cut short by a full disk, edited
    by hand). That variant is converted again and its entry rewritten; a JSON error here stopped the night, the
    remaining releases and the report with it."""
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        entry = e
    if isinstance(entry, dict) and isinstance(entry.get("checkpoint"), str) and entry["checkpoint"]:
        return entry  # (no checkpoint named: Path("") is the working directory, which "exists": skipped on nothing)
    if log is not None:
        log.warning(f"ledger entry {path} is unreadable ({entry if isinstance(entry, Exception) else 'no checkpoint named'}): "
                    "its variant is converted again")
    return None


def release_dir(release_id: str) -> str:
    """A short, filesystem-safe folder name for a release id: a commit or content hash cut to 12 hex digits,
    a PyPI pin (pkg==1.2) as it reads, with a hash of the whole id where it had to be shortened."""
    rid = release_id.removeprefix("sha256:")
    if re.fullmatch(r"[0-9a-f]{40,64}", rid):
        return rid[:12]
    safe = re.sub(r"[^A-Za-z0-9._=+-]+", "_", rid).strip("._")
    return safe if len(safe) <= 60 and safe == rid else f"{safe[:40]}-{hashlib.sha256(rid.encode()).hexdigest()[:12]}"


def _variant(profile, rel: dict, model_ref: dict, original: dict, method: str, budget: float, root: Path,
             key: str) -> dict:
    """Convert + evaluate one (release, method, budget) and record it (ledger, metrics, MLflow). key: the ledger
    key, in the folder's name: a night under other options or code writes a folder of its own, so the checkpoint an
    earlier ledger entry names is never replaced (going back to those options skipped onto the other's weights)."""
    name = parse_source(rel["source"]).slug
    o = profile.convert_options(method, budget)
    out = root / name / release_dir(rel["release_id"]) / f"{layout.variant(method, budget)}-{key[:12]}"
    if (out / "model").exists():  # an interrupted earlier night: its steps are cached
        shutil.rmtree(out / "model")
    ckpt = converted(profile, model_ref, o, str(out / "model"))
    ev = evaluate_ref(profile, ckpt)
    row = table_row(name, method, budget, ev["ppl"], ev["benchmarks"], ckpt["transmla"], profile.evaluation.limit)
    write_text_atomic(out / "metrics.json", json.dumps(row, indent=2))
    # one MLflow run per release (as one folder): a local folder's or GGUF's slug is its path, the same for
    # every release written there, and a shared run would keep the first release's write-once params
    tracking.track(profile.mlflow.experiment, f"{name}/{release_dir(rel['release_id'])}", method, budget,
                   config=o.model_dump(),
                   params={"source": rel["source"], "release_id": rel["release_id"], "watch": rel["watch"]},
                   metrics={"wikitext2_ppl": row["ppl"], "average": row["average"], "kv_cache_ratio": row["kv_cache_ratio"],
                            "original_wikitext2_ppl": original["ppl"], "original_average": original["average"]},
                   tags={"transmla.nightly": "true"}, artifacts={"table_row.json": row})
    return {"checkpoint": str(out / "model"), "ppl": row["ppl"], "average": row["average"],
            "original_ppl": original["ppl"], "original_average": original["average"]}


@flow(name="nightly")
def nightly(params: str = str(DEFAULT_PARAMS), overrides: dict | None = None, out_root: str | None = None) -> list[dict]:
    """One night over the watch list; returns one record per (release, method, budget) and writes the report.
    status: converted | skipped (release id already done) | refused (before any weight download) | failed
    | unresolved (the watch entry could not be looked up: index or hub unreachable, a bad name)."""
    profile = load_profile(params, overrides)
    night = profile.nightly
    # the report is written last: a path it cannot take is refused now, not after the night's conversions
    check_output(night.report, "file", "nightly.report")
    log = get_run_logger()
    # absolute: the ledger names each checkpoint, and a later night may run from another directory
    root = (Path(out_root) if out_root else layout.ARTIFACTS / "nightly").resolve()
    seen = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    code = variant_code()
    try:  # the data every variant reads: a file missing or refused, or the hub down, fails each variant, and the
        data, data_error = variant_data(profile), None  # report is still written (as for a release that fails)
    except Exception as e:  # noqa: BLE001
        data, data_error = None, f"the night's data: {one_line(e)}"
        log.error(data_error)
    records = []
    for entry in night.watch:
        spec = entry if isinstance(entry, str) else entry.model_dump()
        for rel in watch_releases(spec, night.max_params):
            base = {**rel, "seen": seen}
            if rel.get("unresolved"):
                log.error(f"{rel['source']}: unresolved ({rel['unresolved']})")
                records.append({**base, "status": "unresolved", "reason": rel["unresolved"]})
                continue
            if rel["refused"]:
                log.info(f"{rel['source']}: refused ({rel['refused']})")
                records.append({**base, "status": "refused", "reason": rel["refused"]})
                continue
            # The release's setup (fetch, then the reference evaluation) runs once, before its first variant that
            # is not in the ledger (the evaluation: its first the model can take); if it fails, every remaining
            # variant of the release fails with its reason.
            model_ref, original, setup_error = None, None, None
            for budget in night.budgets:
                for method in night.methods:
                    if data_error is not None:
                        records.append({**base, "method": method, "budget": budget, "status": "failed",
                                        "reason": data_error})
                        continue
                    # a local path's identity: ./dm and /abs/dm, dir:dm, are one release (two conversions of it before)
                    key = job_key(f"{rel.get('identity') or rel['source']}#{rel['release_id']}",
                                  profile.convert_options(method, budget).model_dump(),
                                  profile.evaluation.model_dump(), code, data)
                    entry_file = LEDGER / f"{key}.json"
                    rec = {**base, "method": method, "budget": budget, "key": key}
                    done_before = ledger_entry(entry_file, log)
                    # a ledger entry whose checkpoint was removed (a pruned artifacts/nightly) is converted again
                    if done_before is not None and Path(done_before["checkpoint"]).is_dir():
                        log.info(f"{rel['source']} {method} {budget}: release {rel['release_id'][:12]} already done, skipped")
                        records.append({**rec, "status": "skipped", **done_before})
                        continue
                    if model_ref is None and setup_error is None:
                        try:
                            model_ref = resolve_model(rel["source"])  # fetches exactly this revision / version
                        except Exception as e:  # noqa: BLE001  (one model's failure never stops the others)
                            setup_error = f"setup of the release failed: {one_line(e)}"
                            log.error(f"{rel['source']}: {setup_error}")
                    if setup_error is None:
                        try:  # a budget this model cannot take fails now, not after the reference evaluation
                            precheck(model_ref["path"], None, profile.convert_options(method, budget))
                        except Exception as e:  # noqa: BLE001  (one variant's failure never stops the others)
                            log.error(f"{rel['source']} {method} {budget}: failed: {one_line(e)}")
                            records.append({**rec, "status": "failed", "reason": one_line(e)})
                            continue
                    if original is None and setup_error is None:
                        try:
                            # the converted variants' own sample, so the two averages are over the same documents
                            # (reference=True scored the original on reference_limits' superset: 1000 MMLU
                            # documents against the converted model's 146)
                            ev = evaluate_ref(profile, model_ref)
                            original = {"ppl": ev["ppl"]["ppl"], "average": ev["benchmarks"]["average"]}
                        except Exception as e:  # noqa: BLE001
                            setup_error = f"setup of the release failed: {one_line(e)}"
                            log.error(f"{rel['source']}: {setup_error}")
                    if setup_error is not None:  # a variant never runs without its reference numbers
                        records.append({**rec, "status": "failed", "reason": setup_error})
                        continue
                    try:  # one variant's failure never stops the others
                        done = _variant(profile, rel, model_ref, original, method, budget, root, key)
                    except Exception as e:  # noqa: BLE001
                        log.error(f"{rel['source']} {method} {budget}: failed: {one_line(e)}")
                        records.append({**rec, "status": "failed", "reason": one_line(e)})
                        continue
                    try:  # a ledger that cannot be written fails this variant, not the night (nor its report)
                        write_text_atomic(entry_file, json.dumps({**done, "release_id": rel["release_id"],
                                                                  "converted": seen, "code": code}, indent=2))
                    except OSError as e:
                        reason = (f"converted to {done['checkpoint']}, but its ledger entry could not be written "
                                  f"({one_line(e)}): the next night converts it again")
                        log.error(f"{rel['source']} {method} {budget}: {reason}")
                        records.append({**rec, **done, "status": "failed", "reason": reason})
                        continue
                    log.info(f"{rel['source']} {method} {budget}: converted -> {done['checkpoint']}, ppl {done['ppl']:.2f}")
                    records.append({**rec, "status": "converted", **done})
    report = Path(night.report)  # relative: to the working directory, as artifacts/ and reports/ are
    write_text_atomic(report, render_report(records, seen, profile.evaluation))
    log.info(f"report: {report}")
    return records


def _num(x, fmt="{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def protocol_text(ev) -> str:
    """What the report's numbers are, from the profile's evaluation section (EvaluationOptions)."""
    from flows.report import ppl_label

    tokens = f"first {ev.ppl_max_tokens:,} tokens" if ev.ppl_max_tokens else "every token"
    sample = "every document" if ev.limit is None else ", ".join(
        f"{t} {ev.limits.get(t, ev.limit)}" for t in ev.tasks) + " documents"
    return (f"Perplexity: {ppl_label(ev.ppl_dataset)} ({tokens}, {ev.ppl_seqlen}-token windows); average of the "
            f"benchmarks, % ({sample}; the original on the same documents as the converted model).")


def render_report(records: list[dict], seen: str, evaluation) -> str:
    """The night's report: one row per release seen (and per method x budget where it was converted).
    evaluation: the profile's EvaluationOptions, which the header describes."""
    counts = {s: sum(r["status"] == s for r in records) for s in STATUSES}
    lines = [f"# Nightly conversions, {seen}", "",
             ", ".join(f"{n} {s}" for s, n in counts.items()) + ". " + protocol_text(evaluation), "",
             "| source | release | published | status | method | budget | ppl original | ppl converted "
             "| avg original | avg converted | reason |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in records:
        rid = r["release_id"]
        rid = rid[:12] if len(rid) == 40 and all(c in "0123456789abcdef" for c in rid) else rid
        lines.append(" | ".join(["", r["source"].split("@")[0] if r["source"].startswith("hf:") else r["source"], rid,
                                 (r.get("date") or "")[:10], r["status"], r.get("method", ""), _num(r.get("budget"), "{:g}"),
                                 _num(r.get("original_ppl")), _num(r.get("ppl")), _pct(r.get("original_average")),
                                 _pct(r.get("average")), (r.get("reason") or "").replace("|", "/"), ""]).strip())
    return "\n".join(lines) + "\n"


def deployment(params: str = str(DEFAULT_PARAMS), overrides: dict | None = None, profile: Profile | None = None):
    """The nightly deployment (cron from the params), for `serve` and for tests. `overrides` (-S) shape
    the schedule and every scheduled run; `profile`: load_profile(params, overrides), when already validated."""
    from prefect.schedules import Cron

    profile = profile or load_profile(params, overrides)
    # concurrency_limit=1: a night still running when the next one is due would convert the same new
    # releases twice (the ledger is written only once a variant is done); the next run waits instead
    return nightly.to_deployment(name="nightly", schedules=[Cron(profile.nightly.cron, timezone=profile.nightly.timezone)],
                                 parameters={"params": params, **({"overrides": overrides} if overrides else {})},
                                 tags=["transmla", "nightly"], concurrency_limit=1)


def main():
    ap = _cli.parser(__doc__)
    ap.add_argument("--serve", action="store_true", help="serve the deployment on its cron schedule (runs until stopped)")
    args = ap.parse_args()
    overrides = _cli.overrides_of(args) or None
    profile = load_profile(args.params, overrides)  # validate before serving or running
    _cli.check_profile_device(profile)
    _cli.check_tracking(profile.mlflow.experiment)
    if args.serve:
        from prefect import serve

        serve(deployment(args.params, overrides, profile))
        return
    records = nightly(args.params, overrides)
    print(f"report: {Path(profile.nightly.report).resolve()}")
    failed = sum(r["status"] == "failed" for r in records)
    unresolved = sum(r["status"] == "unresolved" for r in records)
    if failed or unresolved:
        what = ([f"{failed} nightly conversion(s) failed"] if failed else []) + \
               ([f"{unresolved} watch entr{'y' if unresolved == 1 else 'ies'} could not be looked up"] if unresolved else [])
        print(f"transmla: {' and '.join(what)} (see the report)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _cli.run(main)

"""MLflow tracking: one run per (model, method, budget), nested under one pipeline run per model.

Store: MLFLOW_TRACKING_URI (default sqlite:///<store>/mlflow.db, set in tasks._env; a tracking server
`http://HOST:PORT` works too: runs and artifacts then live where the server keeps them). Runs are found
by tags, so stages running in separate processes (DVC) log into the same run: the convert stage
logs the conversion's params, the evaluate stage the Table-1 metrics. A conversion whose config
changed replaces its run (the old one is deleted, i.e. moved to MLflow's trash).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transmla.errors import TransMLAError

from ._env import STORE

ROLE, MODEL, METHOD, BUDGET, FINETUNED, CONFIG = ("transmla.role", "transmla.model", "transmla.method",
                                                  "transmla.budget", "transmla.finetuned", "transmla.config")


_LOCAL_FIX = f"unset MLFLOW_TRACKING_URI to track into the pipeline's own store ({STORE / 'mlflow.db'})"


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// store URI (None for other stores)."""
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]) if uri.startswith("sqlite:///") else None


def check_store(uri: str | None = None, timeout: float = 5.0) -> None:
    """The tracking store answers, checked before a stage starts its work: MLflow would find out only
    when the stage logs, after its outputs are written, and retries an absent server for minutes first.

    http(s): any HTTP answer from `<uri>/health` counts (a proxy may refuse it; MLflow then says why);
    no answer within `timeout` is refused. sqlite: the file, where there is one, is an SQLite database
    and its folder is not a file. Other stores (databases, Databricks) are left to MLflow."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    uri = uri or os.environ["MLFLOW_TRACKING_URI"]
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout).close()
        except urllib.error.HTTPError:
            pass
        except (OSError, ValueError, http.client.HTTPException) as e:  # HTTPException: a bad port, not HTTP there
            reason = getattr(e, "reason", None) or e
            if isinstance(reason, ssl.SSLError):
                return  # it answered; whether its certificate is trusted is MLflow's call (MLFLOW_TRACKING_INSECURE_TLS, ...)
            reason = " ".join(str(reason).split())[:200]  # a non-HTTP service's greeting spans lines
            raise TransMLAError(f"MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer ({reason}).",
                                f"start it (e.g. mlflow server --host 127.0.0.1 --port PORT) or {_LOCAL_FIX}.") from None
    elif (path := _sqlite_path(uri)) is not None:
        if path.exists():
            ok = path.is_file()
            if ok and path.stat().st_size:
                with path.open("rb") as f:
                    ok = f.read(16) == b"SQLite format 3\x00"
            if not ok:
                raise TransMLAError(f"MLflow tracking store {path} (MLFLOW_TRACKING_URI) is not an SQLite database.",
                                    f"point MLFLOW_TRACKING_URI at a new or existing mlflow.db, or {_LOCAL_FIX}.")
        else:
            folder = next((p for p in path.parents if p.exists()), None)
            if folder is not None and not folder.is_dir():
                raise TransMLAError(f"MLflow tracking store {path} (MLFLOW_TRACKING_URI): {folder} is a file, "
                                    "not a folder.", f"point MLFLOW_TRACKING_URI at a path in a folder, or {_LOCAL_FIX}.")


def check_experiment(experiment: str) -> None:
    """The experiment, where it exists, is active (checked before a stage's work, as check_store): MLflow refuses
    every run in a deleted one, which a stage found out only when it logged, after its outputs were written."""
    uri = os.environ["MLFLOW_TRACKING_URI"]
    if (path := _sqlite_path(uri)) is not None and not path.is_file():
        return  # no store yet: no experiment (and no database to create here)
    with _StoreErrors():  # a store that answers check_store but refuses MLflow (an auth proxy): one error, now
        _client(experiment, create=False)


def _client(experiment: str, create: bool = True):
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise TransMLAError(f"MLflow experiment {experiment!r} (id {exp.experiment_id}) is deleted: MLflow logs no run "
                            "in it.", f"restore it (mlflow experiments restore --experiment-id {exp.experiment_id}, "
                            "with MLFLOW_TRACKING_URI set as here), or name another in the params' mlflow.experiment.")
    if exp is None and not create:
        return None, None
    if exp is None:
        # a tracking server (http[s]://) keeps the artifacts where it was told to (`mlflow server
        # --artifacts-destination`, proxied to clients); a local store keeps them beside the pipeline's store
        remote = os.environ["MLFLOW_TRACKING_URI"].startswith(("http://", "https://"))
        location = None if remote else (STORE / "mlartifacts" / experiment).as_uri()
        exp_id = client.create_experiment(experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    return client, exp_id


def _find(client, exp_id: str, tags: dict) -> list:
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return client.search_runs([exp_id], filter_string=flt, max_results=100)


def pipeline_run(client, exp_id: str, model: str) -> str:
    runs = _find(client, exp_id, {ROLE: "pipeline", MODEL: model})
    if runs:
        return runs[0].info.run_id
    run = client.create_run(exp_id, run_name=f"pipeline {model}", tags={ROLE: "pipeline", MODEL: model})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def stage_run(experiment: str, model: str, method: str, budget: float | None, config: dict | None = None,
              finetuned: bool = False, role: str = "variant"):
    """(client, run_id) of the (model, method, budget[, fine-tuned]) run; created (nested) if missing.

    `config` (convert and finetune stages): if the run was made for another config, it is replaced.
    `role` other than "variant" (e.g. "throughput"): a run of its own nested under the variant's run, for what
    is measured again and must not share the variant's run (a metric's curve is logged once per run).
    """
    client, exp_id = _client(experiment)
    if role == "variant":
        parent = pipeline_run(client, exp_id, model)
    else:
        client, parent = stage_run(experiment, model, method, budget, None, finetuned)
    b = "none" if budget is None else repr(float(budget))
    tags = {ROLE: role, MODEL: model, METHOD: method, BUDGET: b, FINETUNED: str(finetuned).lower()}
    cfg = None if config is None else json.dumps(config, sort_keys=True, default=str)
    for run in _find(client, exp_id, tags):
        if cfg is None or run.data.tags.get(CONFIG) == cfg[:5000]:
            return client, run.info.run_id
        client.delete_run(run.info.run_id)
    name = f"{model} {method}" + ("" if budget is None else f" kv-{(1 - float(budget)) * 100:g}%") + (" ft" if finetuned else "")
    name += "" if role == "variant" else f" {role}"
    extra = {"mlflow.parentRunId": parent, "kv_reduction": "0" if budget is None else f"{1 - float(budget):g}"}
    if cfg is not None:
        extra[CONFIG] = cfg[:5000]
    run = client.create_run(exp_id, run_name=name, tags={**tags, **extra})
    client.set_terminated(run.info.run_id)
    return client, run.info.run_id


def log(client, run_id: str, params: dict | None = None, metrics: dict | None = None,
        artifacts: dict[str, object] | None = None, files: list[str | Path] = (), tags: dict | None = None,
        history: dict[str, list[tuple[int, float]]] | None = None, tag_prefix: str | None = None) -> None:
    """Params (flattened; MLflow params are write-once), numeric metrics, metric histories (name ->
    [(step, value)], e.g. loss curves; logged once per run), tags
    (overwritable), small JSON artifacts and files into one run. tag_prefix: `tags` are the whole set under
    it: the run's other tags under it (a key the new config no longer has: eval.limits.mmlu after limits: {})
    are deleted, so the run never shows a config that did not run."""
    from mlflow.entities import Metric, Param, RunTag

    if tag_prefix is not None:
        keep = {k for k in _flatten(tags or {}) if k.startswith(tag_prefix)}
        for k in client.get_run(run_id).data.tags:
            if k.startswith(tag_prefix) and k not in keep:
                client.delete_tag(run_id, k)
    flat = _flatten(params or {})
    existing = client.get_run(run_id).data.params
    new_params = [Param(k, str(v)[:6000]) for k, v in flat.items() if k not in existing]
    now = int(time.time() * 1000)
    ms = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and v is not None]
    logged = client.get_run(run_id).data.metrics
    for name, points in (history or {}).items():
        if name in logged:  # a re-run logs the same curve again: keep one copy
            continue
        ms += [Metric(name, float(v), now, int(step)) for step, v in points]
    for i in range(0, max(len(ms), 1), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=ms[i : i + 1000], params=new_params if i == 0 else [],
                         tags=[RunTag(k, str(v)[:5000]) for k, v in _flatten(tags or {}).items()] if i == 0 else [])
    for name, obj in (artifacts or {}).items():
        client.log_dict(run_id, json.loads(json.dumps(obj, default=str)), name)
    for f in files:
        client.log_artifact(run_id, str(f))


class _StoreErrors:
    """MLflow's failures to reach or write its store (a server that went away after check_store, a full disk)
    as one TransMLAError: the stage logs last, after its outputs are written and its steps cached."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None:
            return False
        from mlflow.exceptions import MlflowException
        from sqlalchemy.exc import SQLAlchemyError

        if not isinstance(exc, (MlflowException, SQLAlchemyError, OSError)):
            return False  # a bug: its traceback
        uri = os.environ["MLFLOW_TRACKING_URI"]
        line = " ".join(str(exc).split())[:300]
        raise TransMLAError(f"MLflow tracking into {uri} failed: {line}",
                            f"make the store reachable (or {_LOCAL_FIX}) and rerun the stage: its finished steps "
                            "are cached.") from exc


def _check_files(files) -> None:
    """The files to log are there (checked before _StoreErrors, which would report a missing one as the store's)."""
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"no file {f} to log")


def track(experiment: str, model: str, method: str, budget: float | None, *, config: dict | None = None,
          finetuned: bool = False, role: str = "variant", **logged) -> None:
    """Log into the (model, method, budget[, fine-tuned]) run (or its `role` child run): the one call every
    flow makes."""
    _check_files(logged.get("files", ()))
    with _StoreErrors():
        client, run_id = stage_run(experiment, model, method, budget, config, finetuned, role)
        log(client, run_id, **logged)


def log_files(experiment: str, model: str, files: list) -> None:
    """Files (the table, figures) into the model's pipeline run."""
    _check_files(files)
    with _StoreErrors():
        client, exp_id = _client(experiment)
        log(client, pipeline_run(client, exp_id, model), files=files)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out

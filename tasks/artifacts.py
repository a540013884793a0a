"""The artifact layer: where task outputs live, how they are hashed, and the tasks' cache keys.

Store (TRANSMLA_STORE, default <repo>/.transmla, never in git):

    artifacts/<task>/<key[:20]>/...   task outputs: safetensors tensors, JSON, result directories
    prefect/                          Prefect's home: its DB and the persisted task results
    mlflow.db                         MLflow tracking store (unless MLFLOW_TRACKING_URI is set)

A *ref* is a plain dict {"path": ..., "sha256": ...} naming one artifact by content. Tasks return
refs, so Prefect persists its results as JSON (never pickle) and the tensors stay in safetensors.

Cache key of a task run = sha256 over (task name, the sha256 of every library file the task
executes, the task's parameters with each ref replaced by its content hash). So an unchanged stage
is skipped across processes, a changed parameter or input recomputes exactly the tasks that
depend on it, and editing e.g. `transmla/method/bkv.py` recomputes the BKV bases but not the rotations.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path

from prefect import task
from safetensors.torch import load_file, save_file

from transmla.errors import TransMLAError
from transmla.io.paths import atomic_dir, atomic_file, check_output
from transmla.io.sources import sha256_file, tokenizer_hash

from . import codehash
from ._env import STORE

KEY_SCHEMA = "transmla-cache-v2"  # bump to invalidate every cached result at once
_current_dir: contextvars.ContextVar[Path] = contextvars.ContextVar("transmla_task_dir")


# ---------------------------------------------------------------- hashing

def sha256_tree(path: str | os.PathLike) -> str:
    """Content hash of a directory: relative names + file hashes (sorted)."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def file_ref(path: str | os.PathLike, **extra) -> dict:
    p = Path(path).resolve()
    if not p.is_file():
        raise TransMLAError(f"Input file {p} does not exist.", "run the stage that produces it first (dvc repro).")
    return {"path": str(p), "sha256": sha256_file(p), **extra}


def dir_ref(path: str | os.PathLike, sha256: str | None = None, **extra) -> dict:
    p = Path(path).resolve()
    if not p.is_dir():
        raise TransMLAError(f"Input directory {p} does not exist.", "run the stage that produces it first (dvc repro).")
    return {"path": str(p), "sha256": sha256 or sha256_tree(p), **extra}


def model_ref(path: str | os.PathLike, sha256: str, **extra) -> dict:
    """A model directory as a ref: its content hash (config + weights) plus its tokenizer's hash."""
    return dir_ref(path, sha256=sha256, tokenizer_sha256=tokenizer_hash(path), **extra)


def is_ref(x) -> bool:
    return isinstance(x, dict) and "sha256" in x and "path" in x


def canonical(x):
    """JSON-able, order-independent form of task parameters; refs collapse to their content hashes."""
    if is_ref(x):
        return "sha256:" + x["sha256"] + (":tok:" + x["tokenizer_sha256"] if x.get("tokenizer_sha256") else "")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return canonical(dataclasses.asdict(x))
    if hasattr(x, "model_dump"):
        return canonical(x.model_dump())
    if isinstance(x, dict):
        return {str(k): canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [canonical(v) for v in x]
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, Path):
        return str(x)
    return x


def task_key(name: str, module: str, params: dict) -> str:
    """The cache key of task `name` defined in `module`, called with `params`."""
    payload = {
        "schema": KEY_SCHEMA,
        "task": name,
        "code": codehash.code_key(module),
        "params": canonical(params),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- cached tasks

def cached_task(name: str, **task_kwargs):
    """A Prefect task cached on `task_key` (code = the closure of the decorated function's module),
    results persisted as JSON in the store.

    Inside the task body `task_dir()` is the task run's own artifact directory
    (artifacts/<name>/<key>/), so outputs are content-addressed by the same key.
    """

    def decorate(fn):
        sig = inspect.signature(fn)

        def key_of(params: dict) -> str:
            bound = sig.bind(**params)
            bound.apply_defaults()
            return task_key(name, fn.__module__, dict(bound.arguments))

        @functools.wraps(fn)
        def body(*args, **kwargs):
            key = key_of(dict(sig.bind(*args, **kwargs).arguments))
            token = _current_dir.set(STORE / "artifacts" / name / key[:20])
            try:
                return fn(*args, **kwargs)
            finally:
                _current_dir.reset(token)

        t = task(
            name=name,
            cache_key_fn=lambda _ctx, params: key_of(params),
            persist_result=True,
            result_serializer="json",
            **task_kwargs,
        )(body)
        t.key_of = key_of  # tests and flows can ask which key a call would use
        return t

    return decorate


def task_dir() -> Path:
    return _current_dir.get()


# ---------------------------------------------------------------- read / write

def save_tensors(name: str, tensors: dict) -> dict:
    """Write `tensors` to <task_dir>/<name>.safetensors atomically; return its ref."""
    final = task_dir() / f"{name}.safetensors"
    with atomic_file(final) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    return file_ref(final)


def load_tensors(ref: dict) -> dict:
    return load_file(str(_existing(ref)))


def save_json(name: str, obj) -> dict:
    final = task_dir() / f"{name}.json"
    with atomic_file(final) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
    return file_ref(final)


def load_json(ref: dict):
    return json.loads(_existing(ref).read_text())


def _existing(ref: dict) -> Path:
    p = Path(ref["path"])
    if not p.exists():
        raise TransMLAError(
            f"Cached artifact {p} is gone (the store was cleaned but Prefect's result cache was not).",
            f"run again with PREFECT_TASKS_REFRESH_CACHE=true, or delete {STORE} to start clean.",
        )
    return p


def publish(ref: dict, dest: str | os.PathLike, replace: bool = True) -> Path:
    """Copy an artifact (file or directory) to a pipeline output path (a DVC out), atomically.
    replace=False (a path the user named, e.g. --out): refused if `dest` already holds something."""
    src, dest = _existing(ref), Path(dest)
    if not replace:  # (checked up front as well; here again: the run may have taken hours)
        check_output(dest, "new_dir" if src.is_dir() else "new_file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        with atomic_dir(dest) as tmp:
            shutil.copytree(src, tmp, dirs_exist_ok=True)
    else:
        with atomic_file(dest) as tmp:
            shutil.copyfile(src, tmp)
    return dest

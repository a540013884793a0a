"""Inputs of the DAG: a model source and a data set, resolved to content-hashed refs.

A model ref's sha256 is the model's content hash (config + safetensors weights) and its
tokenizer_sha256 the tokenizer files' hash, so a re-released model with new weights or a new
tokenizer gets new keys everywhere downstream and an unchanged one is recognised.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.adapters import GQASpec, read_spec
from transmla.errors import TransMLAError
from transmla.io.data import (DATA_SOURCE_ENV, PATH_PREFIX, calibration_parts, hub_revision, load_texts, local_path,
                              path_texts, spec)
from transmla.io.sources import check_source, content_hash, parse_source, source_info

from .artifacts import STORE, model_ref, sha256_file


@task(name="resolve_model", cache_policy=NO_CACHE)
def resolve_model(source: str) -> dict:
    """{"path", "sha256", "tokenizer_sha256", "source"} of a model source (GGUF sources materialise once)."""
    src = parse_source(source)
    check_source(src)  # an architecture the converter cannot handle: refused before any weight is fetched
    if src.kind == "hf":  # hub id: one local copy per commit, so the content can be hashed
        from transmla.io.paths import write_text_atomic
        from transmla.io.sources import fetch_model, hub_commit

        # A branch or tag (main by default) moves: the copy is kept per commit, so a new commit is fetched
        # and gets new keys downstream. Without the hub, the commit this source resolved to last time.
        last = STORE / "models" / f"{src.slug}.commit"
        try:
            sha = hub_commit(src)
        except TransMLAError as e:
            if not last.is_file():
                raise
            sha = last.read_text().strip()
            print(f"[transmla] warning: {e.problem} Using {src.location}@{sha[:12]}, the commit fetched last.",
                  file=sys.stderr)
        pinned = parse_source(f"hf:{src.location}@{sha}")
        local = STORE / "models" / pinned.slug
        if not (local / "config.json").is_file():
            fetch_model(pinned.text, local)
        write_text_atomic(last, sha + "\n")
        return model_ref(local, content_hash(local), source=pinned.text)
    info = source_info(src)
    return model_ref(info["path"], info.get("content_hash") or content_hash(info["path"]), source=source)


def checkpoint_ref(path: str | Path, stage: str = "convert") -> dict:
    """A pipeline checkpoint directory as a model ref; one clear error naming the stage that makes it."""
    p = Path(path)
    if not (p / "config.json").is_file():
        what = "fine-tuned" if stage == "finetune" else "converted"
        raise TransMLAError(f"No {what} checkpoint at {p}.", f"run the {stage} flow (or dvc repro) first.")
    return model_ref(p, content_hash(p))


def spec_of(ref: dict) -> GQASpec:
    """The model's shapes from its config.json alone (no weights loaded)."""
    from transformers import AutoConfig

    return read_spec(AutoConfig.from_pretrained(ref["path"]))


def dataset_ref(name: str, data_dir=None, source: str | None = None) -> dict:
    """A registry data set as a ref: its local file's hash (hub mode: its name and the commit it is read
    at, resolved once here; the tasks load exactly that `revision`, so a new hub commit is a new key).
    source: "local" | "hub" (None: TRANSMLA_DATA_SOURCE, default local)."""
    import os

    if (source or os.environ.get(DATA_SOURCE_ENV, "local")) == "hub":
        s, rev = spec(name), hub_revision(name)
        return {"path": f"hub:{s.hub_path}", "sha256": f"hub:{s.hub_path}:{s.hub_name}:{s.hub_split}@{rev}",
                "name": name, "revision": rev}
    p = local_path(name, data_dir)
    return {"path": str(p), "sha256": _file_hash(str(p), p.stat().st_mtime_ns), "name": name}


def calibration_ref(name: str, data_dir=None) -> dict:
    """A calibration data spec (registry names and `path:` parts joined by '+', transmla.io.data) as one
    ref: a single registry set is its dataset_ref; a mix is keyed on its parts' keys, a path: part on the
    texts calibration reads from it."""
    parts = calibration_parts(name)  # unknown names and missing paths: one clear error here
    if len(parts) == 1 and not name.startswith(PATH_PREFIX):
        return dataset_ref(name, data_dir)
    refs = [{"path": p, "sha256": hashlib.sha256("\0".join(path_texts(p)).encode()).hexdigest(), "name": p}
            if p.startswith(PATH_PREFIX) else dataset_ref(p, data_dir) for p in parts]
    key = hashlib.sha256("\n".join(r["sha256"] for r in refs).encode()).hexdigest()
    return {"path": f"mix:{name}", "sha256": key, "name": name, "parts": refs}


def calibration_texts(data: dict) -> list[list[str]]:
    """The corpora of a calibration ref, one per part, read as the ref was keyed (hub: at its revision)."""
    return [path_texts(r["name"]) if r["name"].startswith(PATH_PREFIX)
            else load_texts(r["name"], data_dir_override=data_dir_of(r), revision=r.get("revision"))
            for r in data.get("parts", [data])]


def data_dir_of(data: dict):
    """The data dir a dataset ref was made with (None on the hub path)."""
    if data["path"].startswith("hub:"):
        return None
    p, rel = Path(data["path"]), Path(spec(data["name"]).local_file)
    return p.parents[len(rel.parts) - 1]


@functools.lru_cache(maxsize=None)
def _file_hash(path: str, _mtime: int) -> str:
    return sha256_file(path)


@functools.lru_cache(maxsize=2)
def load(path: str, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer), loaded once per process: the per-layer tasks share one copy."""
    from transmla.io.sources import load_model

    return load_model(path, dtype=dtype, device=device)

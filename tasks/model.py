"""Inputs of the DAG: a model source and a data set, resolved to content-hashed refs.

A model ref's sha256 is the model's content hash (config + safetensors weights) and its
tokenizer_sha256 the tokenizer files' hash, so a re-released model with new weights or a new
tokenizer gets new keys everywhere downstream and an unchanged one is recognised.
"""

from __future__ import annotations

import functools
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from transmla.adapters import GQASpec, read_spec
from transmla.errors import TransMLAError
from transmla.io.data import local_path, spec
from transmla.io.sources import check_source, content_hash, parse_source, source_info

from .artifacts import STORE, model_ref, sha256_file


@task(name="resolve_model", cache_policy=NO_CACHE)
def resolve_model(source: str) -> dict:
    """{"path", "sha256", "tokenizer_sha256", "source"} of a model source (GGUF sources materialise once)."""
    src = parse_source(source)
    check_source(src)  # an architecture the converter cannot handle: refused before any weight is fetched
    if src.kind == "hf":  # hub id: keep one local copy so the content can be hashed
        from transmla.io.sources import fetch_model

        local = STORE / "models" / src.slug
        if not (local / "config.json").is_file():
            fetch_model(source, local)
        return model_ref(local, content_hash(local), source=source)
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


def dataset_ref(name: str, data_dir=None) -> dict:
    """A registry data set as a ref: its local file's hash (hub mode: its name and revision)."""
    import os

    if os.environ.get("TRANSMLA_DATA_SOURCE") == "hub":
        s = spec(name)
        return {"path": f"hub:{s.hub_path}", "sha256": f"hub:{s.hub_path}:{s.hub_name}:{s.hub_split}", "name": name}
    p = local_path(name, data_dir)
    return {"path": str(p), "sha256": _file_hash(str(p), p.stat().st_mtime_ns), "name": name}


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

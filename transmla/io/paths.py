"""Where things live on disk: the shared data folder and the model cache.

Resolution order for each location: explicit argument > environment variable > default.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

# The repository root, for the editable install this project uses (transmla/ sits in the repo).
REPO_ROOT = Path(__file__).resolve().parents[2]

DATA_DIR_ENV = "TRANSMLA_DATA_DIR"
CACHE_DIR_ENV = "TRANSMLA_CACHE_DIR"


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The folder with the offline JSONL data sets (default: `../shared/data` beside the repo)."""
    if override:
        return Path(override).expanduser().resolve()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser().resolve()
    return (REPO_ROOT.parent / "shared" / "data").resolve()


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Cache for materialised models (GGUF -> safetensors). Default `~/.cache/transmla`."""
    if override:
        root = Path(override)
    elif os.environ.get(CACHE_DIR_ENV):
        root = Path(os.environ[CACHE_DIR_ENV])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "transmla"
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def new_output_dir(path: str | os.PathLike) -> Path:
    """Resolve an output directory that must not exist yet (or be empty); one clear error otherwise."""
    from transmla.errors import TransMLAError

    out = Path(path).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TransMLAError(f"Output directory {out} exists and is not empty.", "choose a new --out or remove it.")
    return out


@contextmanager
def atomic_dir(final: str | os.PathLike):
    """Yield a temporary sibling directory; on success it replaces `final`, on error it is removed,
    so a failed run never leaves a half-written artifact."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a file via a temporary sibling + rename."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    tmp.replace(p)

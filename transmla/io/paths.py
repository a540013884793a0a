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
    so a failed or interrupted run never leaves a half-written artifact. Safe for concurrent
    writers: an existing `final` is first renamed aside (atomic), then ours is renamed in."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        for _ in range(100):
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
                try:
                    final.rename(old / "x")
                except FileNotFoundError:  # another writer moved it first
                    pass
                shutil.rmtree(old, ignore_errors=True)
            try:
                tmp.rename(final)
                break
            except OSError:  # another writer renamed theirs in between: replace it again
                continue
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# Files are created 0600 by mkstemp; give them the mode a plain open() would.
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path in the same directory; on success it replaces `path` (os.replace), on
    error it is removed. Each writer gets its own unique temporary name, so concurrent writers of the
    same artifact never collide: the last one to finish wins and readers only ever see a whole file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield Path(tmp)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)

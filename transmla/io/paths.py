"""Where things live on disk: the shared data folder and the model cache.

Resolution order for each location: explicit argument > environment variable > default.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager, suppress
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
    from transmla.errors import TransMLAError

    if override:
        root, setting = Path(override), "--cache-dir"
    elif os.environ.get(CACHE_DIR_ENV):
        root, setting = Path(os.environ[CACHE_DIR_ENV]), f"${CACHE_DIR_ENV}"
    else:  # the default: name what sets it, or what to set instead
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "transmla"
        setting = "$XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else f"--cache-dir (or ${CACHE_DIR_ENV})"
    root = root.expanduser().resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there or on the way, no permission: a traceback from deep in a load otherwise
        raise TransMLAError(f"the model cache {root} cannot be made a folder ({e.strerror}).",
                            f"point {setting} at a writable folder.") from None
    return root


def _not_blank(path, flag: str) -> None:
    """An empty path resolves to the working directory: more often an unset shell variable than a choice."""
    from transmla.errors import TransMLAError

    if isinstance(path, str) and not path.strip():
        raise TransMLAError(f"{flag} is empty (an unset shell variable?); it would mean the working directory.",
                            f"give {flag} a path (. for the working directory).")


def new_output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Resolve an output directory that must not exist yet (or be empty); one clear error otherwise."""
    from transmla.errors import TransMLAError

    _not_blank(path, flag)
    out = Path(path).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise TransMLAError(f"{flag} {out} is a file, not a directory.", f"give {flag} a new directory path.")
    if out.exists() and any(out.iterdir()):
        raise TransMLAError(f"Output directory {out} exists and is not empty.", f"choose a new {flag} or remove it.")
    return out


def check_output(path: str | Path, kind: str = "new_dir", flag: str = "--out") -> Path:
    """Resolve an output path and refuse, up front, one the run could not write at its end (hours of work
    lost otherwise): kind new_dir = a directory that must not exist or be empty (new_output_dir), dir = a
    directory that may exist, file = a file (not an existing directory), new_file = a file not there yet (a
    path the user named, which an atomic replace would overwrite). The nearest existing ancestor must be a
    writable directory: a file on the way fails only at mkdir time."""
    from transmla.errors import TransMLAError

    if kind not in ("new_dir", "dir", "file", "new_file"):
        raise ValueError(f"check_output kind {kind!r}")
    _not_blank(path, flag)
    out = new_output_dir(path, flag) if kind == "new_dir" else Path(path).expanduser().resolve()
    if kind == "new_file" and (out.exists() or out.is_symlink()):
        raise TransMLAError(f"Output file {out} ({flag}) already exists.", f"choose a new {flag} or remove it.")
    if kind == "dir" and out.exists() and not out.is_dir():
        raise TransMLAError(f"{flag} {out} is a file, not a directory.", f"give {flag} a directory path.")
    if kind in ("file", "new_file") and out.is_dir():
        raise TransMLAError(f"{flag} {out} is a directory.", f"give {flag} a file path, e.g. {out / 'result.json'}.")
    up = out if kind == "dir" and out.is_dir() else out.parent  # where the first write lands
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise TransMLAError(f"{flag} {out} cannot be created: {up} is a file.",
                            f"choose a {flag} whose parent folders are directories.")
    if not _can_create_in(up):
        raise TransMLAError(f"{flag} {out} cannot be created: {up} is not writable.",
                            f"choose a {flag} in a folder you can write to.")
    return out


def _can_create_in(folder: Path) -> bool:
    """A file can be created in `folder`: tried (a probe file, removed at once), not read off its mode bits,
    which say yes to root everywhere, /proc and read-only mounts included."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    probe = _fresh_name(folder, ".transmla-probe-")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return False
    try:
        os.unlink(probe)
    except OSError:
        pass
    return True


def _fresh_name(parent: Path, prefix: str, suffix: str = "") -> Path:
    """An unused random name in `parent` (64 random bits: concurrent writers never pick the same one)."""
    while True:
        p = parent / f"{prefix}{secrets.token_hex(8)}{suffix}"
        if not p.exists():
            return p


@contextmanager
def atomic_dir(final: str | os.PathLike):
    """Yield a temporary sibling directory; on success it replaces `final`, on error it is removed,
    so a failed or interrupted run never leaves a half-written artifact. Safe for concurrent
    writers: an existing `final` is first renamed aside (atomic), then ours is renamed in."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_name(final.parent, f".{final.name}.tmp-")
    try:
        # created inside the try: a signal landing right after mkdir (KeyboardInterrupt is raised
        # between bytecodes) still reaches the cleanup below (tempfile.mkdtemp would leave it behind);
        # with a plain mkdir's mode (0777 & ~umask): the folder is renamed into place as it is, and a
        # checkpoint others on the machine could not read would be useless to them
        os.mkdir(tmp, 0o777)
        yield tmp
        for f in tmp.rglob("*"):
            _readable(f)
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
            except OSError as e:  # another writer renamed theirs in between: replace it again
                err = e
                continue
        else:  # never returns as if written when the output is not there (the finally removes ours)
            raise OSError(f"could not move {tmp} to {final} (last error: {err})") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    try:  # Linux: read, not set (os.umask sets it, for every thread of the process)
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        old = os.umask(0o022)
        os.umask(old)
        return old


def _readable(path: Path) -> None:
    """Give a written file the read bits a plain open() would (0666 & ~umask): safetensors' save_file writes 0600,
    and a checkpoint no one else on the machine can read is useless to them."""
    if path.is_file() and not path.is_symlink():
        mode = path.stat().st_mode
        want = mode | (0o444 & ~_umask())
        if want != mode:
            os.chmod(path, want)


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path in the same directory; on success it replaces `path` (os.replace), on
    error or interrupt it is removed. Each writer gets its own unique temporary name, so concurrent
    writers of the same artifact never collide: the last one to finish wins and readers only ever see
    a whole file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_name(p.parent, f".{p.name}.", ".tmp")
    try:
        # created inside the try (see atomic_dir), with the mode a plain open() gives (0666 & ~umask)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        yield tmp
        _readable(tmp)
        os.replace(tmp, p)
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)

"""Where things live on disk: the shared data folder and the model cache.

Resolution order for each location: explicit argument > environment variable > default.
"""

from __future__ import annotations

import os
from pathlib import Path

# The repository root, for the editable install this project uses (transmla/ sits in the repo).
REPO_ROOT = Path(__file__).resolve().parents[1]

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

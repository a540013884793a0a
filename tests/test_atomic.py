"""One atomic-write helper: concurrent writers of the same artifact both finish, one whole file remains."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from transmla.io.paths import atomic_dir, atomic_file


def _write_file(path: str, byte: bytes, n: int) -> None:
    for _ in range(20):
        with atomic_file(path) as tmp:
            with open(tmp, "wb") as f:
                for _ in range(n):
                    f.write(byte * 4096)


def _write_dir(path: str, tag: str) -> None:
    for _ in range(20):
        with atomic_dir(path) as tmp:
            for i in range(5):
                (tmp / f"part{i}").write_text(tag * 1000)


def test_concurrent_file_writers(tmp_path):
    target = str(tmp_path / "artifact.safetensors")
    ps = [mp.get_context("fork").Process(target=_write_file, args=(target, b, 256)) for b in (b"a", b"b")]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert [p.exitcode for p in ps] == [0, 0]  # both finished
    data = open(target, "rb").read()
    assert len(data) == 256 * 4096 and len(set(data)) == 1  # one writer's complete file
    assert os.listdir(tmp_path) == ["artifact.safetensors"]  # no temporaries left


def test_concurrent_dir_writers(tmp_path):
    target = str(tmp_path / "model")
    ps = [mp.get_context("fork").Process(target=_write_dir, args=(target, t)) for t in "xy"]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert [p.exitcode for p in ps] == [0, 0]
    texts = {(tmp_path / "model" / f"part{i}").read_text() for i in range(5)}
    assert len(texts) == 1 and len(next(iter(texts))) == 1000  # all parts from one writer
    assert os.listdir(tmp_path) == ["model"]


def test_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "x.json"
    with pytest.raises(RuntimeError, match="interrupted"), atomic_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert not target.exists() and os.listdir(tmp_path) == []


def test_interrupt_right_after_the_temporary_is_created_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C raises KeyboardInterrupt at the first bytecode after the signal: landing just after the
    temporary file or directory exists (before any write) must still remove it. CI caught that window
    once in the interrupt test, when the temporary was created before the cleanup's try."""
    from transmla.io import paths

    real_open, real_mkdir = os.open, os.mkdir

    def open_then_interrupt(*a, **k):
        fd = real_open(*a, **k)
        os.close(fd)
        raise KeyboardInterrupt

    def mkdir_then_interrupt(*a, **k):
        real_mkdir(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(paths.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(tmp_path / "a.safetensors"):
            pass
    monkeypatch.setattr(paths.os, "open", real_open)
    monkeypatch.setattr(paths.os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "model"):
            pass
    monkeypatch.setattr(paths.os, "mkdir", real_mkdir)
    assert list(tmp_path.iterdir()) == []


def test_a_written_folder_has_a_plain_mkdir_mode(tmp_path):
    """A checkpoint or evaluation folder is renamed into place as it was created: it must carry the mode a
    plain mkdir gives (0777 & ~umask), not a private 0700 that no one else on the machine can read."""
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            (tmp / "config.json").write_text("{}")
        with atomic_dir(tmp_path / "model2"):
            pass
    finally:
        os.umask(old)
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "model2").stat().st_mode & 0o777 == 0o755


def test_a_folder_that_cannot_be_moved_into_place_is_an_error(tmp_path, monkeypatch):
    """atomic_dir retried a failing rename 100 times, then removed its temporary folder and returned as if the
    output had been written."""
    from pathlib import Path

    real = Path.rename

    def refuse(self, target):
        if Path(target).name == "out":
            raise PermissionError(13, "Permission denied")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refuse)
    with pytest.raises(OSError, match="could not move"):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "weights").write_text("w")
    assert os.listdir(tmp_path) == []


def test_weights_written_by_safetensors_get_a_plain_file_mode(tmp_path):
    """safetensors' save_file writes its file 0600: a checkpoint (atomic_dir) or a cached tensor file (atomic_file)
    no one else on the machine could read. Both now carry the read bits a plain open() gives."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        with atomic_file(tmp_path / "stats.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    for f in (tmp_path / "model" / "model.safetensors", tmp_path / "stats.safetensors"):
        assert f.stat().st_mode & 0o777 == 0o644, oct(f.stat().st_mode)

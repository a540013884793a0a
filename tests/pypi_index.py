"""A local PEP 503 package index for tests: wheels (and sdists) written by hand, served to pip as
`--index-url file://...` through the environment, with the machine's pip configuration shut out."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def add_wheel(root: Path, name: str, version: str, files: dict[str, bytes], record_override: dict | None = None) -> Path:
    """A py3-none-any wheel of `files` (paths as installed in site-packages) in the index at `root`.
    record_override: {path: bytes} whose hash RECORD lists instead (a tampered wheel)."""
    dist = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    meta = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
            f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    entries = {**files, **meta}
    record = [_record_line(p, (record_override or {}).get(p, d)) for p, d in entries.items()]
    record.append(f"{dist}.dist-info/RECORD,,")
    pkg = root / "simple" / _norm(name)
    pkg.mkdir(parents=True, exist_ok=True)
    whl = pkg / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for p, d in entries.items():
            zf.writestr(p, d)
        zf.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    _write_index(root)
    return whl


def add_sdist(root: Path, name: str, version: str, marker: Path) -> Path:
    """An sdist whose setup.py, if it ever ran, would write `marker`."""
    base = f"{name}-{version}"
    setup = f"open({str(marker)!r}, 'w').write('built')\nfrom setuptools import setup\nsetup(name={name!r}, version={version!r})\n"
    pkg = root / "simple" / _norm(name)
    pkg.mkdir(parents=True, exist_ok=True)
    out = pkg / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        for fname, text in (("setup.py", setup), ("PKG-INFO", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"{base}/{fname}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    _write_index(root)
    return out


def _write_index(root: Path) -> None:
    simple = root / "simple"
    projects = sorted(p.name for p in simple.iterdir() if p.is_dir())
    (simple / "index.html").write_text("".join(f'<a href="{p}/">{p}</a>\n' for p in projects))
    for p in projects:
        links = "".join(f'<a href="{f.name}#sha256={hashlib.sha256(f.read_bytes()).hexdigest()}">{f.name}</a>\n'
                        for f in sorted((simple / p).iterdir()) if f.name != "index.html")
        (simple / p / "index.html").write_text(links)


def use_index(monkeypatch, root: Path) -> None:
    """Point pip (in subprocesses) at this index alone."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", (root / "simple").as_uri())

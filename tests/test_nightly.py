"""The nightly flow against fake releases: a hub API (monkeypatched HfApi over repositories on disk,
one directory per commit) and a local PEP 503 index (tests/pypi_index.py). A release is judged from
metadata alone; only a new release id downloads weights; one model's failure spares the others."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import tasks  # noqa: F401  (Prefect defaults; conftest pointed the store at a temp dir)


class FakeHub:
    """HfApi's surface the project uses, over repos = {repo_id: [commit dir, ...]} (newest last)."""

    def __init__(self):
        self.repos: dict[str, list[Path]] = {}
        self.snapshots: list[tuple[str, str]] = []  # weight downloads: (repo, sha)
        self.configs: list[str] = []  # config.json reads

    def publish(self, repo: str, model_dir: Path) -> str:
        self.repos.setdefault(repo, []).append(model_dir)
        return self.sha(repo)

    def sha(self, repo: str, i: int = -1) -> str:
        return hashlib.sha1(f"{repo}:{len(self.repos[repo][:i % len(self.repos[repo]) + 1])}".encode()).hexdigest()

    def _commit(self, repo: str, revision: str | None) -> Path:
        if repo not in self.repos:
            raise FileNotFoundError(f"404: {repo}")
        for i, d in enumerate(self.repos[repo]):
            if revision in (None, "main") and i == len(self.repos[repo]) - 1 or revision == self.sha(repo, i):
                return d
        raise FileNotFoundError(f"404: {repo}@{revision}")

    def model_info(self, repo, revision=None, **_):
        d = self._commit(repo, revision)
        i = self.repos[repo].index(d)
        return SimpleNamespace(id=repo, sha=self.sha(repo, i), safetensors=None,
                               last_modified=dt.datetime(2026, 11, 20 + i, tzinfo=dt.timezone.utc))

    def list_models(self, author=None, search=None, sort=None, limit=None, pipeline_tag=None, **_):
        assert pipeline_tag == "text-generation"
        found = [r for r in self.repos if (not author or r.startswith(author + "/")) and (not search or search in r)]
        return [SimpleNamespace(id=r) for r in found][:limit]

    def hf_hub_download(self, repo, filename, revision=None, **_):
        assert filename == "config.json", "only config.json is read before a release is chosen"
        self.configs.append(repo)
        return str(self._commit(repo, revision) / filename)

    def snapshot_download(self, repo, revision=None, local_dir=None, allow_patterns=None, ignore_patterns=None, **_):
        from huggingface_hub.utils import filter_repo_objects

        self.snapshots.append((repo, revision))
        src = self._commit(repo, revision)
        files = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]
        for f in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (Path(local_dir) / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / f, Path(local_dir) / f)
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)  # as the hub client leaves
        return local_dir


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    fake = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: fake)
    return fake


@pytest.fixture
def make_model(tmp_path, tiny_tokenizer, request):
    from conftest import _tiny_model

    base = zlib.crc32(request.node.name.encode()) % 10_000

    def make(name: str, seed: int = 0, **config) -> Path:
        d = tmp_path / "repos" / name
        _tiny_model("llama", len(tiny_tokenizer), seed=base + seed).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        if config:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **config}))
        return d

    return make


def _profile(tmp_path: Path, watch: list, **nightly) -> str:
    raw = {
        "models": {"tiny": {"source": str(tmp_path)}},
        "pipeline": {"models": [], "budgets": [0.25], "methods": ["transmla"]},
        "calibration": {"nsamples": 8, "seqlen": 64, "batch_size": 4},
        "evaluation": {"ppl_seqlen": 128, "ppl_max_tokens": 256, "tasks": ["arc_easy"], "limit": 2},
        "finetune": {"budgets": [], "methods": []},
        "throughput": {"budgets": [], "methods": []},
        "nightly": {"watch": watch, "budgets": [0.25], "methods": ["transmla"], "report": str(tmp_path / "nightly.md"),
                    **nightly},
    }
    p = tmp_path / "profile.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def _by_source(records):
    return {r["source"].split("@")[0]: r for r in records}


def test_hub_releases_discovery_and_failures(tmp_path, hub, make_model, monkeypatch):
    from flows.nightly import nightly

    monkeypatch.chdir(tmp_path)
    hub.publish("acme/tiny-a", make_model("a1", seed=1))
    hub.publish("org/tiny-b", make_model("b1", seed=2))  # supported: converted
    hub.publish("org/tiny-c", make_model("c1", seed=3, model_type="gpt2"))  # unsupported: refused from config
    broken = make_model("d1", seed=4)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    hub.publish("org/tiny-d", broken)  # converts nowhere: failed, the others go on
    hub.publish("org/tiny-e", make_model("e1", seed=5, num_hidden_layers=200))  # over nightly.max_params
    prof = _profile(tmp_path, ["hf:acme/tiny-a", {"hub": {"author": "org", "search": "tiny", "limit": 10}}],
                    max_params=2e6)

    first = _by_source(nightly(prof))
    assert {s: r["status"] for s, r in first.items()} == {
        "hf:acme/tiny-a": "converted", "hf:org/tiny-b": "converted", "hf:org/tiny-c": "refused",
        "hf:org/tiny-d": "failed", "hf:org/tiny-e": "refused"}
    assert "Unsupported architecture 'gpt2'" in first["hf:org/tiny-c"]["reason"]
    assert "over the nightly cap" in first["hf:org/tiny-e"]["reason"]
    assert first["hf:org/tiny-d"]["reason"]
    assert sorted(r for r, _ in hub.snapshots) == ["acme/tiny-a", "org/tiny-b", "org/tiny-d"], \
        "refused releases' weights are never fetched"
    a = first["hf:acme/tiny-a"]
    assert a["source"] == f"hf:acme/tiny-a@{hub.sha('acme/tiny-a')}" and a["release_id"] == hub.sha("acme/tiny-a")
    cfg = json.loads(Path(a["checkpoint"], "config.json").read_text())
    assert cfg["transmla"]["source"] == a["source"], "the checkpoint names the exact revision"
    assert a["ppl"] > 0 and a["original_ppl"] > 0
    report = (tmp_path / "nightly.md").read_text()
    assert "| hf:org/tiny-c |" in report and "refused" in report and "| failed |" in report
    assert f"| {hub.sha('acme/tiny-a')[:12]} | 2026-11-20 | converted | transmla | 0.25 |" in report

    # An unchanged night: every release id is in the ledger -> skipped, no weight download.
    hub.snapshots.clear()
    second = _by_source(nightly(prof))
    assert second["hf:acme/tiny-a"]["status"] == second["hf:org/tiny-b"]["status"] == "skipped"
    assert second["hf:org/tiny-d"]["status"] == "failed"  # a failure is retried (from its local copy)
    assert hub.snapshots == [], "an unchanged night downloads no weights"

    # A new commit of a watched repo and a new repo of the watched author: both converted.
    hub.snapshots.clear()
    hub.repos.pop("org/tiny-d")
    sha2 = hub.publish("acme/tiny-a", make_model("a2", seed=6))
    hub.publish("org/tiny-new", make_model("n1", seed=7))
    third = _by_source(nightly(prof))
    assert third["hf:acme/tiny-a"]["status"] == "converted" and third["hf:acme/tiny-a"]["release_id"] == sha2
    assert third["hf:org/tiny-new"]["status"] == "converted" and third["hf:org/tiny-b"]["status"] == "skipped"
    assert sorted(hub.snapshots) == [("acme/tiny-a", sha2), ("org/tiny-new", hub.sha("org/tiny-new"))]


def _header_gguf(path: Path, name: str) -> bytes:
    """A GGUF whose header describes a small Llama (what the converter checks before any weight is read)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_embedding_length(64)
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_pypi_release_follows_the_index(tmp_path, make_model, monkeypatch):
    """A ranged PyPI source picks up a newly published version from the (local) index and pins it."""
    from pypi_index import add_wheel, use_index

    from flows.nightly import nightly
    from transmla.io import sources

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRANSMLA_CACHE_DIR", str(tmp_path / "cache"))  # this test's model cache
    index = tmp_path / "index"
    use_index(monkeypatch, index)
    ggufs = {v: _header_gguf(tmp_path / f"{v}.gguf", v) for v in ("v1", "v2")}
    models = {ggufs["v1"]: make_model("p1", seed=1), ggufs["v2"]: make_model("p2", seed=2)}

    def save(gguf, out):  # stands in for transformers' GGUF dequantisation: each GGUF names a tiny model
        shutil.copytree(models[gguf.read_bytes()], out, dirs_exist_ok=True)

    monkeypatch.setattr(sources, "_save_gguf_as_hf", save)
    add_wheel(index, "tiny-model-gguf", "0.1.0", {"tiny_model_gguf/model.gguf": ggufs["v1"]})
    prof = _profile(tmp_path, ["pypi:tiny-model-gguf>=0.1:tiny_model_gguf/model.gguf"])
    (first,) = nightly(prof)
    assert first["status"] == "converted" and first["release_id"] == "tiny-model-gguf==0.1.0"
    assert first["source"] == "pypi:tiny-model-gguf==0.1.0:tiny_model_gguf/model.gguf"
    assert [r["status"] for r in nightly(prof)] == ["skipped"]
    add_wheel(index, "tiny-model-gguf", "0.2.0", {"tiny_model_gguf/model.gguf": ggufs["v2"]})
    (third,) = nightly(prof)
    assert third["status"] == "converted" and third["release_id"] == "tiny-model-gguf==0.2.0"
    ledger = json.loads((Path(tasks.artifacts.STORE) / "nightly" / f"{third['key']}.json").read_text())
    assert ledger["release_id"] == "tiny-model-gguf==0.2.0"
    assert json.loads(Path(third["checkpoint"], "config.json").read_text())["transmla"]["source"] == third["source"]


def test_cli_prints_the_report_and_fails_when_a_model_failed(tmp_path, make_model):
    import subprocess
    import sys

    good = make_model("good", seed=1)
    bad = make_model("bad", seed=2)
    (bad / "model.safetensors").write_bytes(b"broken")
    prof = _profile(tmp_path, [str(good), str(bad)])
    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "flows.nightly", "--params", prof], cwd=tmp_path, capture_output=True,
                       text=True, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"report: {tmp_path / 'nightly.md'}" in r.stdout and "1 nightly conversion(s) failed" in r.stderr
    rows = (tmp_path / "nightly.md").read_text()
    assert rows.count("| converted |") == 1 and rows.count("| failed |") == 1


def test_watch_entries_are_validated():
    from flows.params import load_profile
    from transmla.errors import TransMLAError

    repo = Path(__file__).resolve().parent.parent
    with pytest.raises(TransMLAError, match="needs author or search"):
        load_profile(repo / "params" / "default.yaml", {"nightly.watch": [{"hub": {"sort": "likes"}}]})
    with pytest.raises(TransMLAError, match="nightly.watch"):
        load_profile(repo / "params" / "default.yaml", {"nightly.watch": [{"hub": {"author": "x", "sort": "newest"}}]})


@pytest.fixture
def fast_variants(monkeypatch):
    """The conversion, its evaluation and MLflow replaced by stubs that record their calls (the flow's
    bookkeeping is what these tests check); resolve_model stays real unless a test replaces it."""
    import flows.nightly as N

    calls = {"converted": [], "reference": [], "track": []}

    def converted(profile, model_ref, o, out):
        calls["converted"].append((model_ref["sha256"], out))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text(json.dumps({"from": model_ref["sha256"]}))
        return {"path": out, "transmla": {}}

    def evaluate_ref(profile, ref, reference=False):
        # the original on the converted models' own sample (reference=True scored it on the larger superset)
        assert not reference
        if "transmla" not in ref:  # the release's own model, not a conversion
            calls["reference"].append(ref["path"])
        return {"ppl": {"ppl": 10.0}, "benchmarks": {"average": 0.5}}

    monkeypatch.setattr(N, "converted", converted)
    monkeypatch.setattr(N, "evaluate_ref", evaluate_ref)
    monkeypatch.setattr(N, "table_row", lambda *a, **k: {"ppl": 12.0, "average": 0.4, "kv_cache_ratio": 0.25})
    monkeypatch.setattr(N.tracking, "track", lambda *a, **k: calls["track"].append((a, k)))
    return calls


def test_rewritten_local_gguf_is_a_new_release_with_its_own_checkpoint(tmp_path, make_model, monkeypatch,
                                                                      fast_variants):
    """A new release written over a local GGUF's path is converted from its own weights (not the cache
    entry of the old file) into its own folder: the checkpoint the ledger names for the old one stays."""
    from flows.nightly import nightly
    from transmla.io import sources
    from transmla.io.sources import content_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRANSMLA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    models = {}

    def save(gguf, out):  # stands in for transformers' GGUF dequantisation: each GGUF names a tiny model
        shutil.copytree(models[gguf.read_bytes()], out, dirs_exist_ok=True)

    monkeypatch.setattr(sources, "_save_gguf_as_hf", save)
    models[_header_gguf(path, "v1")] = make_model("g1", seed=1)
    prof = _profile(tmp_path, [f"gguf:{path}"])
    (first,) = nightly(prof)
    models[_header_gguf(path, "v2")] = make_model("g2", seed=2)
    (second,) = nightly(prof)
    assert first["status"] == second["status"] == "converted" and first["release_id"] != second["release_id"]
    assert [h for h, _ in fast_variants["converted"]] == [content_hash(models[k]) for k in models], \
        "each release is converted from its own weights"
    assert first["checkpoint"] != second["checkpoint"]
    assert second["release_id"].removeprefix("sha256:")[:12] in second["checkpoint"]
    # each release logs into an MLflow run of its own (params are write-once: a shared run would keep the
    # first release's release_id beside the second's metrics)
    (a1, k1), (a2, k2) = fast_variants["track"]
    assert a1[1] != a2[1] and second["release_id"].removeprefix("sha256:")[:12] in a2[1]
    assert [k["params"]["release_id"] for k in (k1, k2)] == [first["release_id"], second["release_id"]]
    assert json.loads(Path(first["checkpoint"], "config.json").read_text())["from"] == content_hash(models[
        next(iter(models))]), "the first release's checkpoint is still the one its ledger entry names"


def test_hub_query_failing_mid_listing_is_one_unresolved_row(tmp_path, hub, make_model, monkeypatch, fast_variants):
    """list_models pages lazily: an error on a later page arises while iterating. It is one unresolved
    record for the query; the other watch entries still run and the report is written."""
    from flows.nightly import nightly

    monkeypatch.chdir(tmp_path)
    hub.publish("org/tiny-a", make_model("a1", seed=1))

    def pages(**kw):
        yield SimpleNamespace(id="org/tiny-a")
        raise ConnectionError("hub: page 2 timed out")

    monkeypatch.setattr(hub, "list_models", pages)
    local = make_model("local", seed=2)
    records = nightly(_profile(tmp_path, [{"hub": {"author": "org"}}, str(local)]))
    assert [r["status"] for r in records] == ["unresolved", "converted"] and records[1]["source"] == str(local)
    query = records[0]["source"]
    assert query.startswith("hub:author=org") and "page 2 timed out" in records[0]["reason"]
    report = (tmp_path / "nightly.md").read_text()
    assert f"| {query} | ? |  | unresolved |" in report and "1 unresolved" in report


def test_failed_release_setup_fails_its_remaining_variants_once(tmp_path, make_model, monkeypatch, fast_variants):
    """When the release's setup (fetch or reference evaluation) fails, every remaining variant of it fails
    with that reason, nothing is converted or retried for it, and the next release goes on."""
    import flows.nightly as N

    monkeypatch.chdir(tmp_path)
    bad, good = make_model("bad", seed=1), make_model("good", seed=2)
    resolved = []

    def resolve_model(source):
        resolved.append(source)
        return {"path": source, "sha256": source}

    def evaluate_ref(profile, ref, reference=False):
        if ref["path"] == str(bad):  # the release's own model (its conversions' paths are folders of their own)
            raise RuntimeError("reference evaluation OOM")
        return {"ppl": {"ppl": 10.0}, "benchmarks": {"average": 0.5}}

    monkeypatch.setattr(N, "resolve_model", resolve_model)
    monkeypatch.setattr(N, "evaluate_ref", evaluate_ref)
    records = N.nightly(_profile(tmp_path, [str(bad), str(good)], budgets=[0.25, 0.5]))
    assert [(r["source"], r["budget"], r["status"]) for r in records] == [
        (str(bad), 0.25, "failed"), (str(bad), 0.5, "failed"), (str(good), 0.25, "converted"),
        (str(good), 0.5, "converted")]
    assert all("reference evaluation OOM" in r["reason"] for r in records[:2])
    assert resolved == [str(bad), str(good)], "a release's setup runs once"
    assert [h for h, _ in fast_variants["converted"]] == [str(good), str(good)], "nothing converted without its reference"

    def resolve_fails(source):
        resolved.append(source)
        raise OSError("disk full")

    resolved.clear()
    monkeypatch.setattr(N, "resolve_model", resolve_fails)
    records = N.nightly(_profile(tmp_path, [str(bad)], budgets=[0.25, 0.5]))
    assert [r["status"] for r in records] == ["failed", "failed"] and resolved == [str(bad)]
    assert all("disk full" in r["reason"] for r in records)


def test_a_budget_the_model_cannot_take_fails_before_the_reference_evaluation(tmp_path, make_model, monkeypatch,
                                                                               fast_variants):
    """A nightly budget too small for a watched model (no value left for RoPE) fails that variant with the
    converter's reason from the config alone; the reference evaluation (the six benchmarks of the original) runs
    only for a release with a variant it can take, and the others still convert."""
    import flows.nightly as N

    monkeypatch.chdir(tmp_path)
    a = make_model("a", seed=1)
    records = N.nightly(_profile(tmp_path, [str(a)], budgets=[0.01]))
    assert [r["status"] for r in records] == ["failed"]
    assert "too few for any RoPE dim" in records[0]["reason"]
    assert fast_variants["reference"] == [] and fast_variants["converted"] == []
    records = N.nightly(_profile(tmp_path, [str(a)], budgets=[0.01, 0.25]))
    assert [(r["budget"], r["status"]) for r in records] == [(0.01, "failed"), (0.25, "converted")]
    assert fast_variants["reference"] == [str(a)] and len(fast_variants["converted"]) == 1


def test_ledger_names_absolute_checkpoints_and_its_write_failure_fails_one_variant(tmp_path, make_model, monkeypatch,
                                                                                  fast_variants):
    """The ledger's checkpoint paths hold from any working directory; a ledger that cannot be written fails
    that variant (the next night converts it again) while the night goes on and writes its report."""
    import flows.nightly as N

    monkeypatch.chdir(tmp_path)
    a, b = make_model("a", seed=1), make_model("b", seed=2)
    (rec,) = N.nightly(_profile(tmp_path, [str(a)]))
    assert rec["status"] == "converted" and Path(rec["checkpoint"]).is_absolute()
    assert json.loads((N.LEDGER / f"{rec['key']}.json").read_text())["checkpoint"] == rec["checkpoint"]
    assert Path(rec["checkpoint"], "config.json").is_file()

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the ledger's folder should be")
    monkeypatch.setattr(N, "LEDGER", blocker / "nightly")
    records = N.nightly(_profile(tmp_path, [str(a), str(b)], budgets=[0.25, 0.5]))
    assert [r["status"] for r in records] == ["failed"] * 4, "each variant converted, none recorded"
    assert all("ledger entry could not be written" in r["reason"] and r["checkpoint"] in r["reason"] for r in records)
    assert len(fast_variants["converted"]) == 1 + 4, "the night went on past the first failed write"
    assert "4 failed" in (tmp_path / "nightly.md").read_text()


def test_a_release_done_by_older_code_is_converted_again_once(tmp_path, make_model, monkeypatch, fast_variants):
    """The ledger records what converted a release: after a change to the code a variant runs (a module of the
    conversion or evaluation, a library version) the next night converts it again, once; a change to code no
    variant runs (the report's rendering) does not. Keyed without the code, a watched release kept its first
    night's numbers whatever the converter became."""
    import flows.nightly as N
    import tasks.codehash as C

    monkeypatch.chdir(tmp_path)
    a = make_model("a", seed=1)
    prof = _profile(tmp_path, [str(a)])
    assert [r["status"] for r in N.nightly(prof)] == ["converted"]
    assert [r["status"] for r in N.nightly(prof)] == ["skipped"]
    real = C.file_digest

    def edited(*names):
        return lambda rel: "0" * 64 if rel in names else real(rel)

    monkeypatch.setattr(C, "file_digest", edited("flows/nightly.py", "flows/report.py"))
    assert "flows/nightly.py" not in C.closure("flows.convert")[0] + C.closure("flows.evaluate")[0]
    assert [r["status"] for r in N.nightly(prof)] == ["skipped"], "code no variant runs"
    for module in ("transmla/method/bkv.py", "transmla/evaluation/perplexity.py"):
        monkeypatch.setattr(C, "file_digest", edited(module))
        (rec,) = N.nightly(prof)
        assert rec["status"] == "converted", module
        assert json.loads((N.LEDGER / f"{rec['key']}.json").read_text())["code"] == N.variant_code()
        assert [r["status"] for r in N.nightly(prof)] == ["skipped"]
    assert len(fast_variants["converted"]) == 3


def test_a_release_scored_on_older_data_is_converted_again_once(tmp_path, make_model, monkeypatch, fast_variants):
    """The ledger key holds the data a variant reads: after a change to the calibration set, the perplexity set or
    a benchmark file the next night converts and scores the release again, once. Keyed without it, the night
    reported "skipped" with the numbers of the old data."""
    import flows.nightly as N
    from transmla.io.paths import data_dir

    monkeypatch.chdir(tmp_path)
    data, offline = tmp_path / "data", data_dir()
    # a data dir of links to the offline data; a file edited below is unlinked first and written as its own copy
    for f in offline.rglob("*.jsonl"):
        (data / f.relative_to(offline)).parent.mkdir(parents=True, exist_ok=True)
        (data / f.relative_to(offline)).symlink_to(f)
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(data))
    a = make_model("a", seed=1)
    prof = _profile(tmp_path, [str(a)])
    assert [r["status"] for r in N.nightly(prof)] == ["converted"]
    assert [r["status"] for r in N.nightly(prof)] == ["skipped"]
    for rel in ("wikitext2/train_partial.jsonl", "wikitext2/test.jsonl", "benchmarks/arc_easy_test.jsonl"):
        lines = (data / rel).read_text().splitlines(keepends=True)
        (data / rel).unlink()
        (data / rel).write_text("".join(lines[:-1]))  # one row fewer
        assert [r["status"] for r in N.nightly(prof)] == ["converted"], rel
        assert [r["status"] for r in N.nightly(prof)] == ["skipped"], rel
    (data / "benchmarks/piqa_validation.jsonl").unlink()  # a link to the offline data: never written through
    (data / "benchmarks/piqa_validation.jsonl").write_text("")  # a benchmark the profile does not run
    assert [r["status"] for r in N.nightly(prof)] == ["skipped"]
    assert len(fast_variants["converted"]) == 4
    # data the night cannot read fails each variant, with the reason, and the report is still written
    (data / "wikitext2/train_partial.jsonl").unlink()
    (rec,) = N.nightly(prof)
    assert rec["status"] == "failed" and "the night's data" in rec["reason"] and "train_partial.jsonl" in rec["reason"]
    assert "1 failed" in (tmp_path / "nightly.md").read_text() and len(fast_variants["converted"]) == 4


def test_unreachable_index_is_unresolved_and_fails_the_night(tmp_path, monkeypatch, capsys):
    """An index that cannot be reached is not the converter's refusal: the release is unresolved, and the
    night exits 1 (a refusal alone does not)."""
    import sys

    import flows.nightly as N
    from tasks.releases import watch_releases

    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    entry = "pypi:tiny-model-gguf>=0.1:tiny_model_gguf/model.gguf"
    (rel,) = watch_releases.fn(entry, 1e9)
    assert rel["unresolved"] and rel["refused"] is None and "tiny-model-gguf" in rel["unresolved"]

    prof = _profile(tmp_path, [entry])
    monkeypatch.setattr(sys, "argv", ["nightly", "--params", prof])
    monkeypatch.setattr(N, "nightly", lambda *a, **k: [{**rel, "status": "unresolved", "reason": rel["unresolved"]},
                                                       {**rel, "status": "refused", "reason": "gpt2"}])
    with pytest.raises(SystemExit) as e:
        N.main()
    assert e.value.code == 1 and "1 watch entry could not be looked up" in capsys.readouterr().err
    monkeypatch.setattr(N, "nightly", lambda *a, **k: [{**rel, "status": "refused", "reason": "gpt2"}])
    N.main()  # a refusal alone: exit 0

    from transmla.config import EvaluationOptions

    report = N.render_report([{**rel, "status": "unresolved", "reason": rel["unresolved"], "seen": "x"}], "x",
                             EvaluationOptions())
    assert "1 unresolved" in report and "| unresolved |" in report


def test_deployment_runs_one_night_at_a_time():
    """Overlapping nights would convert one release twice: the deployment (served and in prefect.yaml)
    allows one run at a time."""
    from flows.nightly import deployment

    repo = Path(__file__).resolve().parent.parent
    assert deployment(str(repo / "params" / "default.yaml")).concurrency_limit == 1
    spec = yaml.safe_load((repo / "prefect.yaml").read_text())
    (nd,) = [d for d in spec["deployments"] if d["name"] == "nightly"]
    assert nd["concurrency_limit"] == 1


def test_discovered_repo_lookup_failures_are_told_apart(hub, make_model, monkeypatch):
    """A discovered repo the hub says cannot be had (gated, gone) is refused, like a model the converter
    cannot take; a lookup the network broke is unresolved (a failure of the night, retried the next)."""
    import httpx
    from huggingface_hub.errors import GatedRepoError

    from transmla.io.releases import discover

    for name in ("ok", "gated", "flaky"):
        hub.publish(f"org/{name}", make_model(name))
    info = hub.model_info

    def model_info(repo, revision=None, **kw):
        if repo == "org/gated":
            raise GatedRepoError("403: gated", response=httpx.Response(403, request=httpx.Request("GET", "http://hub")))
        if repo == "org/flaky":
            raise ConnectionError("connection reset")
        return info(repo, revision, **kw)

    monkeypatch.setattr(hub, "model_info", model_info)
    got = {r.source.split("@")[0]: r for r in discover({"author": "org"}, max_params=1e9)}
    assert got["hf:org/ok"].refused is None and got["hf:org/ok"].unresolved is None
    assert "gated" in got["hf:org/gated"].refused and got["hf:org/gated"].unresolved is None
    assert "connection reset" in got["hf:org/flaky"].unresolved and got["hf:org/flaky"].refused is None


def test_a_config_transformers_refuses_is_a_refusal_not_an_unresolved_lookup(hub, make_model):
    """A repository whose config.json transformers cannot build (RoPE scaling without its factor, heads
    that do not divide the width) is the repository's defect: refused with the reason, not unresolved (an
    unresolved row fails the night, and it would fail every night again)."""
    from transmla.io.releases import discover

    hub.publish("org/ok", make_model("ok"))
    hub.publish("org/badrope", make_model("badrope", rope_scaling={"rope_type": "linear"}))
    hub.publish("org/badheads", make_model("badheads", hidden_size=63))
    got = {r.source.split("@")[0]: r for r in discover({"author": "org"}, max_params=1e9)}
    assert got["hf:org/ok"].refused is None and got["hf:org/ok"].unresolved is None
    for name in ("badrope", "badheads"):
        r = got[f"hf:org/{name}"]
        assert r.unresolved is None and "config.json does not load in transformers" in r.refused, r


def test_a_corrupt_config_is_a_refusal_whether_watched_directly_or_found(hub, make_model):
    """config.json that is not JSON: refused when a hub query found the repository, but unresolved (the night
    failed, every night) when the same repository or a local folder was watched by name."""
    from transmla.io.releases import discover, resolve

    bad = make_model("bad")
    (bad / "config.json").write_text('{"model_type": "llama",')
    hub.publish("org/bad", bad)
    found = discover({"author": "org"}, max_params=1e9)
    for r in (*found, resolve("hf:org/bad", max_params=1e9), resolve(str(bad), max_params=1e9)):
        assert r.unresolved is None and "config.json is not valid JSON" in r.refused, r
    from transmla.errors import TransMLAError

    with pytest.raises(TransMLAError, match="not found"):  # a bad name stays a failure to look (unresolved)
        resolve(str(bad.parent / "nosuch"))


def test_an_unpinned_hub_source_follows_its_branch(hub, make_model, capsys):
    """A pipeline model `hf:ORG/NAME` is fetched at the commit its branch points at now: a new commit is a
    new local copy with new keys (the first copy was kept for good); without the hub, the commit fetched last."""
    from tasks.model import resolve_model

    first = hub.publish("acme/tiny", make_model("t1", seed=1))
    a = resolve_model.fn("hf:acme/tiny")
    assert resolve_model.fn("hf:acme/tiny")["path"] == a["path"] and hub.snapshots == [("acme/tiny", first)]
    second = hub.publish("acme/tiny", make_model("t2", seed=2))
    b = resolve_model.fn("hf:acme/tiny")
    assert hub.snapshots[-1] == ("acme/tiny", second) and b["path"] != a["path"] and b["sha256"] != a["sha256"]
    assert b["source"] == f"hf:acme/tiny@{second}"

    def unreachable(*a, **k):
        raise ConnectionError("no route to the hub")

    hub.model_info = unreachable
    c = resolve_model.fn("hf:acme/tiny")
    assert (c["path"], c["sha256"]) == (b["path"], b["sha256"]) and len(hub.snapshots) == 2
    assert f"acme/tiny@{second[:12]}, the commit fetched last" in capsys.readouterr().err


def test_a_hub_fetch_takes_what_the_model_needs(hub, make_model, tmp_path):
    """The chat template (transformers 5 writes chat_template.jinja) was left behind, Mistral's own-format
    consolidated.safetensors (a second copy of every weight) was downloaded and hashed with the model, and the hub
    client's .cache folder ended up in the output. Pickles stay out."""
    from transmla.io.sources import fetch_model

    d = make_model("chat")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    shutil.copy(d / "model.safetensors", d / "consolidated.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    hub.publish("org/chat", d)
    out = tmp_path / "fetched"
    fetch_model("hf:org/chat", out, cache=tmp_path / "cache")
    names = {p.name for p in out.iterdir()}
    assert "chat_template.jinja" in names and "model.safetensors" in names
    assert not names & {"consolidated.safetensors", "pytorch_model.bin", ".cache"}, names


def test_an_unreadable_ledger_entry_converts_its_variant_again(tmp_path, make_model, monkeypatch, fast_variants):
    """A ledger entry cut short (a full disk) or edited by hand raised a JSON error outside any guard: the night
    stopped there, the remaining releases and the report with it. It is converted again and rewritten."""
    import flows.nightly as N

    monkeypatch.chdir(tmp_path)
    a, b = make_model("a", seed=1), make_model("b", seed=2)
    (rec,) = N.nightly(_profile(tmp_path, [str(a)]))
    for broken in ("", "[1, 2]", "{}", '{"checkpoint": null}'):
        (N.LEDGER / f"{rec['key']}.json").write_text(broken)
        records = N.nightly(_profile(tmp_path, [str(a), str(b)]))
        assert [r["status"] for r in records] == ["converted", "skipped" if broken else "converted"], broken
        assert json.loads((N.LEDGER / f"{rec['key']}.json").read_text())["release_id"] == rec["release_id"]
        assert ("1 converted, 1 skipped" if broken else "2 converted") in (tmp_path / "nightly.md").read_text()
    assert len(fast_variants["converted"]) == 1 + 2 + 1 + 1 + 1


def test_spellings_of_one_model_are_one_release(tmp_path, make_model, monkeypatch, fast_variants):
    """A local folder watched as dm, ./dm, its absolute path or dir:dm, a PyPI package as Foo_Bar or foo-bar: one
    model, one release id and ledger key, so it is converted once (twice, or four times, before)."""
    import flows.nightly as N
    from transmla.io.releases import resolve

    monkeypatch.chdir(tmp_path)
    a = make_model("a", seed=1)
    rel = a.relative_to(tmp_path)
    spellings = [str(rel), f"./{rel}", str(a), f"dir:{rel}"]
    records = N.nightly(_profile(tmp_path, spellings))
    assert [r["status"] for r in records] == ["converted", "skipped", "skipped", "skipped"]
    assert len({r["key"] for r in records}) == 1 and len(fast_variants["converted"]) == 1
    assert [r["source"] for r in records] == spellings  # the report still shows each entry as written

    from pypi_index import add_wheel, use_index

    index = tmp_path / "index"
    use_index(monkeypatch, index)
    add_wheel(index, "tiny-model-gguf", "0.1.0", {"tiny_model_gguf/model.gguf": b"GGUF"})
    ids = {resolve(f"pypi:{name}==0.1.0:tiny_model_gguf/model.gguf").release_id
           for name in ("tiny-model-gguf", "Tiny_Model.GGUF", "tiny_model_gguf")}
    assert ids == {"tiny-model-gguf==0.1.0"}


def test_a_hub_query_that_finds_nothing_is_one_unresolved_row(tmp_path, hub, make_model, monkeypatch, fast_variants):
    """A query that matches no repository (a misspelt author) left no row at all: the night said '0 converted,
    0 unresolved' and exited 0, as if the entry were not there."""
    from flows.nightly import nightly

    monkeypatch.chdir(tmp_path)
    hub.publish("org/tiny-a", make_model("a1", seed=1))
    records = nightly(_profile(tmp_path, [{"hub": {"author": "orgg"}}, {"hub": {"author": "org"}}]))
    assert [r["status"] for r in records] == ["unresolved", "converted"]
    assert records[0]["source"].startswith("hub:author=orgg,") and "found no text-generation repository" in records[0]["reason"]
    assert "1 unresolved" in (tmp_path / "nightly.md").read_text()


def test_a_watched_repo_without_config_is_refused_as_when_found(hub, make_model):
    """A repository with no config.json is its own defect: refused (with its commit) when a query finds it, but it
    was unresolved (release '?', the night failed, every night) when the same repository was watched by name."""
    from transmla.io.releases import discover, resolve

    bare = make_model("bare")
    (bare / "config.json").unlink()
    sha = hub.publish("org/bare", bare)
    orig = hub.hf_hub_download

    def download(repo, filename, revision=None, **kw):
        from huggingface_hub.errors import RemoteEntryNotFoundError

        if not (hub._commit(repo, revision) / filename).is_file():
            import httpx

            raise RemoteEntryNotFoundError(f"404: {filename}", response=httpx.Response(
                404, request=httpx.Request("GET", "http://hub")))
        return orig(repo, filename, revision, **kw)

    hub.hf_hub_download = download
    for r in (*discover({"author": "org"}, max_params=1e9), resolve("hf:org/bare", max_params=1e9)):
        assert r.unresolved is None and "404" in r.refused and r.release_id == sha, r

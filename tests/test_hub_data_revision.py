"""Hub-mode data sets are keyed on, and loaded at, one hub commit (no network: a fake HfApi and a fake
`datasets` module stand in for the hub)."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import httpx
import pytest

import transmla.io.data as data
from tasks.artifacts import canonical, sha256_file
from tasks.model import data_dir_of, dataset_ref
from transmla.errors import TransMLAError

SHA1, SHA2 = "1" * 40, "2" * 40


class FakeHub:
    """HfApi with dataset_info over a dict repo -> newest commit; records every request."""

    def __init__(self):
        self.heads: dict[str, str] = {}
        self.calls: list[tuple[str, str | None]] = []
        self.error: Exception | None = None

    def dataset_info(self, repo_id, revision=None, **_):
        self.calls.append((repo_id, revision))
        if self.error is not None:
            raise self.error
        return types.SimpleNamespace(id=repo_id, sha=self.heads[repo_id] if revision is None else f"sha-of-{revision}")


class FakeDatasets(types.ModuleType):
    """A `datasets` module whose load_dataset records its arguments and returns rows of the commit asked for."""

    def __init__(self):
        super().__init__("datasets")
        self.calls: list[dict] = []
        self.error: Exception | None = None

    def load_dataset(self, path, name=None, split=None, **kwargs):
        self.calls.append({"path": path, "name": name, "split": split, **kwargs})
        if self.error is not None:
            raise self.error
        rows = [{"text": f"row {i} at {kwargs.get('revision')}"} for i in range(5)]
        if kwargs.get("streaming"):
            return _Stream(rows)
        return rows


class _Stream:
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)

    def take(self, n):
        return self.rows[:n]


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    fake = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: fake)
    monkeypatch.setenv(data.DATA_SOURCE_ENV, "hub")
    return fake


@pytest.fixture
def fake_datasets(monkeypatch):
    fake = FakeDatasets()
    monkeypatch.setitem(sys.modules, "datasets", fake)
    return fake


def test_hub_key_follows_the_hub_commit(hub):
    hub.heads["wikitext"] = SHA1
    first, again = dataset_ref("wikitext2-test"), dataset_ref("wikitext2-test")
    assert first == again and canonical(first) == canonical(again), "an unchanged hub data set keeps its key"
    assert first["revision"] == SHA1 and SHA1 in first["sha256"] and first["name"] == "wikitext2-test"
    assert first["path"] == "hub:wikitext" and data_dir_of(first) is None

    hub.heads["wikitext"] = SHA2  # a new commit on the hub
    moved = dataset_ref("wikitext2-test")
    assert moved["revision"] == SHA2 and canonical(moved) != canonical(first), "a new hub commit is a new cache key"
    assert ("wikitext", None) in hub.calls  # the newest commit asked for

    # other data sets of the same repo are told apart as before (name / split in the key)
    assert canonical(dataset_ref("wikitext2-train")) != canonical(moved)


def test_hub_key_resolves_a_pinned_revision(hub, monkeypatch):
    monkeypatch.setitem(data.REGISTRY, "arc_easy", replace(data.REGISTRY["arc_easy"], hub_revision="v1.0"))
    ref = dataset_ref("arc_easy")
    assert hub.calls == [("allenai/ai2_arc", "v1.0")]
    assert ref["revision"] == "sha-of-v1.0" and ref["sha256"].endswith("@sha-of-v1.0")


def test_loaders_read_the_refs_revision(hub, fake_datasets):
    hub.heads["allenai/ai2_arc"] = SHA1
    hub.heads["allenai/c4"] = SHA1
    ref = dataset_ref("arc_easy")
    rows = data.load_rows(ref["name"], data_dir_of(ref), revision=ref["revision"])
    assert fake_datasets.calls[-1] == {"path": "allenai/ai2_arc", "name": "ARC-Easy", "split": "test",
                                       "revision": SHA1}
    assert rows[0]["text"].endswith(SHA1)

    hub.heads["allenai/c4"] = SHA2  # moved after the ref was made: the loader still reads the ref's commit
    ref = {**dataset_ref("c4-demo"), "revision": SHA1}
    docs = data.load_documents(ref["name"], data_dir_of(ref), max_documents=2, revision=ref["revision"])
    assert fake_datasets.calls[-1]["revision"] == SHA1 and fake_datasets.calls[-1]["streaming"] is True
    assert len(docs) == 2 and docs[0].endswith(SHA1)
    n = len(fake_datasets.calls)
    with pytest.raises(TransMLAError, match="downloaded whole"):  # C4 whole: refused (io.data.check_document_limit)
        data.load_documents("c4-demo", revision=SHA1)
    assert len(fake_datasets.calls) == n
    docs = data.load_documents("wikitext2-test", revision=SHA1)  # a whole line-row set: through load_rows / load_texts
    assert fake_datasets.calls[-1] == {"path": "wikitext", "name": "wikitext-2-raw-v1", "split": "test", "revision": SHA1}
    assert docs[0].endswith(SHA1)
    assert data.load_texts("wikitext2-test", revision=SHA2)[0].endswith(SHA2)
    assert fake_datasets.calls[-1]["revision"] == SHA2
    data.calibration_corpora("wikitext2-train+wikitext2-test", revisions={"wikitext2-test": SHA2})
    assert [c["revision"] for c in fake_datasets.calls[-2:]] == [None, SHA2]


def _http_error(cls, status):
    return cls(f"{status} Client Error", response=httpx.Response(status, request=httpx.Request("GET", "http://hub")))


def test_hub_failures_are_one_clear_error(hub, fake_datasets, monkeypatch):
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled, RepositoryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub.error = _http_error(RepositoryNotFoundError, 404)
    with pytest.raises(TransMLAError) as e:
        dataset_ref("hellaswag")
    assert "Rowan/hellaswag" in e.value.problem and "no such repo" in e.value.problem
    assert "HF_TOKEN" in e.value.fix and "unset TRANSMLA_DATA_SOURCE" in e.value.fix

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.error = OfflineModeIsEnabled("offline")
    with pytest.raises(TransMLAError) as e:
        dataset_ref("fineweb-edu-dedup")
    assert "HF_HUB_OFFLINE is set" in e.value.problem and "HuggingFaceTB/smollm-corpus" in e.value.problem
    assert "no offline copy" in e.value.fix  # a hub-only set: unsetting the source would not help

    fake_datasets.error = ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub")
    for load in (lambda: data.load_rows("arc_easy", revision=SHA1),
                 lambda: data.load_documents("c4-demo", max_documents=3, revision=SHA1)):
        with pytest.raises(TransMLAError) as e:
            load()
        assert "Could not load the data set" in e.value.problem and SHA1[:12] in e.value.problem
        assert "ConnectionError" in e.value.problem and "HF_ENDPOINT" in e.value.fix


def test_local_refs_and_loaders_unchanged(monkeypatch, fake_datasets):
    import huggingface_hub

    monkeypatch.delenv(data.DATA_SOURCE_ENV, raising=False)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("local mode asked the hub"))
    p = data.local_path("wikitext2-test")
    ref = dataset_ref("wikitext2-test")
    assert ref == {"path": str(p), "sha256": sha256_file(p), "name": "wikitext2-test"}  # no revision field
    assert data_dir_of(ref) == p.parents[1]
    rows = data.load_rows("arc_easy")
    assert data.load_rows("arc_easy", revision=SHA1) == rows  # a revision means nothing for a local file
    assert data.load_documents("c4-demo", max_documents=2, revision=SHA1) == data.load_documents("c4-demo", max_documents=2)
    assert fake_datasets.calls == []

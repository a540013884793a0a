import pytest

from transmla.io.data import REGISTRY, load_rows, load_texts, local_path
from transmla.errors import TransMLAError


def test_every_registered_file_exists():
    offline = [name for name, s in REGISTRY.items() if s.local_file is not None]
    assert {"wikitext2-test", "wikitext2-train", "c4-demo", "wiki-demo", "mmlu_test"} <= set(offline)
    for name in offline:
        assert local_path(name).is_file(), name


def test_hub_only_sets_name_the_fix():
    hub_only = [name for name, s in REGISTRY.items() if s.local_file is None]
    assert "fineweb-edu-dedup" in hub_only  # the paper's fine-tune corpus
    for name in hub_only:
        with pytest.raises(TransMLAError, match="TRANSMLA_DATA_SOURCE=hub"):
            local_path(name)


def test_documents_join_line_rows_and_cap():
    from transmla.io.data import load_documents

    (wiki,) = load_documents("wikitext2-train")  # WikiText rows are lines of one running text
    assert wiki.startswith(load_texts("wikitext2-train")[0]) and "\n\n" in wiki
    docs = load_documents("c4-demo", max_documents=7)
    assert len(docs) == 7 and all(d.strip() for d in docs)


def test_wikitext_rows_keep_blanks():
    texts = load_texts("wikitext2-test")
    assert len(texts) == 4358 and texts[0] == "" and any(t.startswith(" = ") for t in texts)


def test_benchmark_rows_have_hub_schema():
    row = load_rows("piqa")[0]
    assert set(row) >= {"goal", "sol1", "sol2", "label"}


def test_missing_file_names_file_and_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(tmp_path))
    with pytest.raises(TransMLAError) as e:
        load_texts("wikitext2-test")
    assert str(tmp_path / "wikitext2" / "test.jsonl") in str(e.value) and "TRANSMLA_DATA_DIR" in str(e.value)


def test_unknown_dataset():
    with pytest.raises(TransMLAError, match="Unknown data set"):
        load_rows("imagenet")

import pytest

from transmla.data import REGISTRY, load_rows, load_texts, local_path
from transmla.errors import TransMLAError


def test_every_registered_file_exists():
    for name in REGISTRY:
        assert local_path(name).is_file(), name


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

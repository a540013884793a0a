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


def test_emptied_file_names_file_and_fix(tmp_path, monkeypatch):
    """A data file with no rows (truncated, blank lines only) is refused where it is read, naming it: it would
    otherwise score no document of a benchmark, or no token, and fail far from the cause."""
    from transmla.io.data import spec

    emptied = tmp_path / spec("piqa").local_file
    emptied.parent.mkdir(parents=True)
    emptied.write_text("\n  \n")
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(tmp_path))
    assert local_path("piqa") == emptied
    with pytest.raises(TransMLAError, match="holds no rows") as e:
        load_rows("piqa")
    assert str(local_path("piqa")) in str(e.value) and "Fix:" in str(e.value)


def test_unknown_dataset():
    with pytest.raises(TransMLAError, match="Unknown data set"):
        load_rows("imagenet")


# Calibration corpora beyond the registry (`cal_dataset`: names and path:FILE_OR_DIR joined by '+').
from transmla.config import ConvertOptions  # noqa: E402
from transmla.io.data import calibration_corpora, calibration_parts  # noqa: E402


def test_calibration_parts_check_names_and_paths_before_any_work(tmp_path):
    assert calibration_parts(f"wikitext2-train+path:{tmp_path}") == ["wikitext2-train", f"path:{tmp_path}"]
    with pytest.raises(TransMLAError, match="Unknown data set 'nope'"):
        calibration_parts("wikitext2-train+nope")
    with pytest.raises(TransMLAError, match="Calibration path not found"):
        calibration_parts(f"path:{tmp_path / 'missing'}")


def test_a_plus_inside_a_calibration_path_belongs_to_the_path(tmp_path):
    """'+' separates the parts, but a folder named c++src is one path: it was cut at each '+', and the error
    named '.../c', a path the user never gave. A '+' before a registry name or path: still separates."""
    src = tmp_path / "c++src"
    src.mkdir()
    (src / "a.py").write_text("print(1)\n")
    assert calibration_parts(f"path:{src}") == [f"path:{src}"]
    assert calibration_parts(f"path:{src}+wikitext2-train+path:{src}") == [f"path:{src}", "wikitext2-train", f"path:{src}"]
    assert calibration_corpora(f"path:{src}") == [["print(1)\n"]]


@pytest.mark.parametrize("spec_text", ["arc_easy", "wikitext2-train+arc_easy"])
def test_a_benchmark_is_refused_as_calibration_text(spec_text):
    """A benchmark's rows have no text to calibrate on: refused naming the text corpora (it failed in the
    loader with 'use load_rows() instead', a function no user calls)."""
    with pytest.raises(TransMLAError, match="arc_easy is a benchmark") as e:
        calibration_parts(spec_text)
    assert "wikitext2-train" in e.value.fix and "load_rows" not in str(e.value)


def test_convert_refuses_bad_calibration_data_before_any_work(tmp_path):
    from transmla.convert import convert

    out = tmp_path / "out"
    with pytest.raises(TransMLAError, match="Calibration path not found"):
        convert("no-such-model", out, ConvertOptions(cal_dataset=f"path:{tmp_path / 'missing'}"))
    assert not out.exists()


def test_directory_corpus_reads_text_files_in_order(tmp_path):
    (tmp_path / "b.py").write_text("def b(): pass\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_text("# x\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")  # not a text suffix
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "c.py").write_text("hidden\n")
    (tmp_path / "rows.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    [texts] = calibration_corpora(f"path:{tmp_path}")
    assert texts == ["# x\n", "def b(): pass\n"]  # sorted by path; .jsonl rows only as a file of their own
    assert calibration_corpora(f"path:{tmp_path / 'rows.jsonl'}") == [["one", "two"]]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(TransMLAError, match="'text' field"):
        calibration_corpora(f"path:{tmp_path / 'bad.jsonl'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TransMLAError, match="No text files"):
        calibration_corpora(f"path:{empty}")


@pytest.mark.parametrize("content, words", [
    (b'{"text": "a"}\n{"text": "b"\n', ":2 is not JSON"),
    (b'{"text": "a"}\n{"body": "b"}\n', ":2 has no string 'text' field"),
    (b'{"text": null}\n', ":1 has no string 'text' field"),
    (b'[1, 2]\n', ":1 is not a JSON object"),
    (b'{"text": "caf\xe9"}\n', "is not UTF-8"),
])
def test_a_malformed_data_file_is_one_error_naming_the_line(tmp_path, monkeypatch, content, words):
    """A truncated line, a row without its text, a non-object row or Latin-1 bytes raised the parser's own error
    (JSONDecodeError, KeyError, TypeError, UnicodeDecodeError: a traceback from the CLI, after the model loaded)."""
    from transmla.io.data import spec

    bad = tmp_path / spec("wikitext2-test").local_file
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(tmp_path))
    with pytest.raises(TransMLAError, match=words) as e:
        load_texts("wikitext2-test")
    assert str(bad) in str(e.value) and "Fix:" in str(e.value)
    rows = tmp_path / "rows.JSONL"
    rows.write_bytes(content)
    with pytest.raises(TransMLAError, match=words):
        calibration_corpora(f"path:{rows}")


def test_a_byte_order_mark_and_an_upper_case_suffix_are_read(tmp_path, monkeypatch):
    from transmla.io.data import spec

    f = tmp_path / spec("wikitext2-test").local_file
    f.parent.mkdir(parents=True)
    f.write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": ""}\n')
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(tmp_path))
    assert load_texts("wikitext2-test") == ["one", ""]
    (tmp_path / "rows.JSONL").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert calibration_corpora(f"path:{tmp_path / 'rows.JSONL'}") == [["one", "two"]]


def test_a_hub_document_corpus_is_never_read_whole(monkeypatch):
    """On the hub, c4-demo is allenai/c4 (en, train): hundreds of GB. Read as calibration or perplexity text
    (no document limit) or fine-tuning documents without max_documents it is refused before the datasets library
    is called; WikiText (line rows, a few MB) and a streamed read with a limit go on."""
    from transmla.io import data

    monkeypatch.setenv("TRANSMLA_DATA_SOURCE", "hub")
    asked = []
    monkeypatch.setattr(data, "_hub_dataset", lambda s, revision, streaming=False: asked.append((s.name, streaming)) or [])
    for read in (lambda: data.load_texts("c4-demo"), lambda: data.calibration_corpora("wikitext2-train+wiki-demo"),
                 lambda: data.load_documents("fineweb-edu-dedup")):
        with pytest.raises(TransMLAError, match="would be downloaded whole") as e:
            read()
        assert "TRANSMLA_DATA_SOURCE=local" in e.value.fix
    assert "max_documents N" in e.value.fix
    assert asked == [("wikitext2-train", False)], "only WikiText was read, before wiki-demo was refused"
    data.check_document_limit("c4-demo", 5)
    data.check_document_limit("wikitext2-test", None)

"""Six-benchmark evaluation through lm-eval on local files (tiny model, --limit 2)."""

import json
import subprocess
import sys

import pytest

from transmla.errors import TransMLAError
from transmla.evaluation.benchmarks import TASKS, evaluate, mmlu_subjects, sample_indices, write_task_yamls


@pytest.fixture(scope="module")
def tiny_eval(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    return evaluate(str(tiny_model_dir), limit=2, batch_size=4, out_dir=out), out


def test_result_structure_and_counts(tiny_eval):
    res, out = tiny_eval
    assert set(res["tasks"]) == set(TASKS)
    n_subjects = len(mmlu_subjects())
    assert n_subjects == 57
    for t, e in res["tasks"].items():
        assert e["metric"] in e and 0.0 <= e["value"] <= 1.0 and e["stderr"] is not None
        assert e["n"] == (2 * n_subjects if t == "mmlu" else 2)
        assert e["acc"] is not None
    assert res["arc_mean"] == pytest.approx((res["tasks"]["arc_easy"]["value"] + res["tasks"]["arc_challenge"]["value"]) / 2)
    assert res["limit"] == 2 and "random.Random(1234)" in res["sampling"]
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["tasks"].keys() == res["tasks"].keys()
    # lm-eval's per-sample log: one line per evaluated doc, with the model's responses
    for t in TASKS:
        rows = [json.loads(line) for line in open(out / "samples" / f"{t}.jsonl")]
        assert len(rows) == res["tasks"][t]["n"]
        assert all("resps" in r and "doc" in r for r in rows)


def test_sampling_is_seeded_and_bounded():
    sizes = {"a": 10, "b": 3}
    s1, s2 = sample_indices(sizes, 5, 0), sample_indices(sizes, 5, 0)
    assert s1 == s2 and len(s1["a"]) == 5 and s1["b"] == [0, 1, 2]
    assert sample_indices(sizes, 5, 1) != s1
    assert sample_indices(sizes, None, 0) is None


def test_yamls_use_absolute_local_paths(tmp_path):
    write_task_yamls(tmp_path, ["arc_easy", "mmlu"])
    text = (tmp_path / "offline_arc_easy.yaml").read_text()
    assert "dataset_path: json" in text and "arc_easy_test.jsonl" in text and '"/' in text
    assert "include:" in text and "lm_eval/tasks/arc/arc_easy.yaml" in text
    assert len(list(tmp_path.glob("offline_mmlu_*.yaml"))) == 57


def test_missing_data_file_names_file_and_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSMLA_DATA_DIR", str(tmp_path))
    with pytest.raises(TransMLAError) as e:
        write_task_yamls(tmp_path / "t", ["piqa"])
    assert "benchmarks/piqa_validation.jsonl" in str(e.value) and "TRANSMLA_DATA_DIR" in str(e.value)


def test_cli_missing_data_exits_nonzero(tiny_model_dir, tmp_path):
    import os

    r = subprocess.run([sys.executable, "-m", "transmla.cli", "eval", "--model", str(tiny_model_dir), "--limit", "1"],
                       capture_output=True, text=True, env=dict(os.environ, TRANSMLA_DATA_DIR=str(tmp_path)))
    assert r.returncode == 2 and "TRANSMLA_DATA_DIR" in r.stderr


def test_unknown_task():
    with pytest.raises(TransMLAError, match="Unknown benchmark"):
        evaluate("/nonexistent", tasks=["squad"])

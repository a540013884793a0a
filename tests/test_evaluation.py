"""Six-benchmark evaluation through lm-eval on local files (tiny model, --limit 2)."""

import json
import subprocess
import sys

import pytest

from transmla.errors import TransMLAError
from transmla.evaluation import stats
from transmla.evaluation.benchmarks import (PREFIX, TASKS, evaluate, mmlu_subjects, paired_columns, task_strata,
                                           write_results, write_task_yamls)


@pytest.fixture(scope="module")
def tiny_eval(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    return evaluate(str(tiny_model_dir), limit=3, batch_size=4, out_dir=out), out


def _samples(out, task):
    return [json.loads(line) for line in open(out / "samples" / f"{task}.jsonl")]


def test_result_structure_and_counts(tiny_eval):
    res, out = tiny_eval
    assert set(res["tasks"]) == set(TASKS)
    assert len(mmlu_subjects()) == 57
    assert res["protocol"] == "paper"
    for t, e in res["tasks"].items():
        assert e["metric"] == ("acc" if t == "winogrande" else "acc_norm") and 0.0 <= e["value"] <= 1.0 and e["se"] >= 0
        assert e["n"] == 3  # MMLU too: 3 docs in all, stratified over subjects
        assert sum(len(v) for v in res["scores"][t].values()) == 3
        assert res["speed"][t]["docs"] == 3
    # the scored documents are the planned ones (lm-eval's doc_id is the index in the local file)
    plan = stats.sample_plan(task_strata(TASKS, None), 3, 1234)
    for t in TASKS:
        assert {k: sorted(map(int, v)) for k, v in res["scores"][t].items() if v} == {
            k: plan[k] for k in res["sizes"][t] if plan[k]}
    assert res["arc_mean"] == pytest.approx((res["tasks"]["arc_easy"]["value"] + res["tasks"]["arc_challenge"]["value"]) / 2)
    cols = [res["tasks"][t]["value"] for t in ("mmlu", "piqa", "hellaswag", "openbookqa", "winogrande")]
    assert res["average"] == pytest.approx((sum(cols) + res["arc_mean"]) / 6) and res["average_se"] > 0
    assert res["limit"] == 3 and "random.Random('1234/<task>')" in res["sampling"]
    assert res["docs_per_second"] > 0
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["tasks"].keys() == res["tasks"].keys()
    # lm-eval's per-sample log: one line per evaluated doc, with the model's responses
    for t in TASKS:
        rows = _samples(out, t)
        assert len(rows) == res["tasks"][t]["n"]
        assert all("resps" in r and "doc" in r for r in rows)


def test_cloze_mmlu_scores_the_answer_texts_and_the_table_reads_acc_norm(tiny_eval):
    """Paper protocol: each MMLU choice is the answer's text as a continuation of the question (no letters
    shown), and the per-document score the table reads is that sample's acc_norm."""
    res, out = tiny_eval
    rows = _samples(out, "mmlu")
    for r in rows:
        ctx = [a[0] for a in r["arguments"]]
        conts = [a[1] for a in r["arguments"]]
        assert conts == [" " + c for c in r["doc"]["choices"]]
        assert all("Question: " in c and c.endswith("Answer:") and "\nA. " not in c for c in ctx)
        assert res["scores"]["mmlu"]["offline_" + r["task"]][str(r["doc_id"])] == r["acc_norm"]


def test_letter_protocol_and_paired_differences(tiny_model_dir, tiny_eval, tmp_path):
    """lm-eval's protocol: letters as choices, acc; the same sample again scores identically, so its
    paired difference to the first run is exactly zero."""
    res, _ = tiny_eval
    letter = evaluate(str(tiny_model_dir), tasks=["mmlu"], limit=3, batch_size=4, protocol="lm_eval", out_dir=tmp_path)
    rows = _samples(tmp_path, "mmlu")
    assert [[a[1] for a in r["arguments"]] for r in rows] == [[" A", " B", " C", " D"]] * 3
    assert letter["tasks"]["mmlu"]["metric"] == "acc" and letter["average"] is None  # one benchmark: no average
    docs = lambda r: {s: set(v) for s, v in r["scores"]["mmlu"].items() if v}  # noqa: E731  (subject -> doc ids)
    assert docs(letter) == docs(res) and sum(map(len, docs(res).values())) == 3, "the same documents as the paper run"
    again = evaluate(str(tiny_model_dir), tasks=["mmlu"], limit=3, batch_size=4, out_dir=tmp_path / "again")
    d = paired_columns(again, res)  # a second, independent run of the paper protocol
    assert set(d) == {"mmlu"} and d["mmlu"]["value"] == 0 and d["mmlu"]["se"] == 0
    assert "average" in paired_columns(res, res), "a run of every benchmark pairs into the average"


def test_sampling_is_seeded_per_benchmark():
    strata = task_strata(["piqa", "mmlu"], None)
    assert sum(strata["mmlu"].values()) > 10_000
    p1 = stats.sample_plan(strata, 5, 0)
    assert p1 == stats.sample_plan(strata, 5, 0)
    assert p1["offline_piqa"] == stats.sample_plan({"piqa": strata["piqa"]}, 5, 0)["offline_piqa"]
    assert sum(len(v) for k, v in p1.items() if k.startswith("offline_mmlu_")) == 5
    p2 = stats.sample_plan(strata, 5, 0, {"mmlu": 60})
    assert sum(len(v) for k, v in p2.items() if k.startswith("offline_mmlu_")) == 60 and p2["offline_piqa"] == p1["offline_piqa"]


def test_strata_count_the_local_files_in_hub_mode(monkeypatch):
    """lm-eval scores the local benchmark files whatever TRANSMLA_DATA_SOURCE says, so their counts come from
    there too: in hub mode (evaluate() has set HF_HUB_OFFLINE by then) they were asked of the hub and failed."""
    local = task_strata(["piqa", "mmlu"], None)
    monkeypatch.setenv("TRANSMLA_DATA_SOURCE", "hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert task_strata(["piqa", "mmlu"], None) == local


def test_few_shot_from_the_scored_split_is_refused():
    with pytest.raises(TransMLAError, match="few-shot split"):
        evaluate("/nonexistent", tasks=["piqa"], num_fewshot=5)


def test_yamls_use_absolute_local_paths(tmp_path):
    write_task_yamls(tmp_path, ["arc_easy", "mmlu"])
    text = (tmp_path / "offline_arc_easy.yaml").read_text()
    assert "dataset_path: json" in text and "arc_easy_test.jsonl" in text and '"/' in text
    assert "include:" in text and "lm_eval/tasks/arc/arc_easy.yaml" in text
    assert len(list(tmp_path.glob("offline_mmlu_*.yaml"))) == 57
    assert "mmlu/continuation/mmlu_anatomy.yaml" in (tmp_path / "offline_mmlu_anatomy.yaml").read_text()  # cloze
    assert "num_fewshot: 0" in text and "metric: acc_norm" in text


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


@pytest.mark.parametrize("flags, named", [
    (["--limits", "mmlu"], "--limits 'mmlu'"),
    (["--limits", "mmlu=x"], "--limits 'mmlu=x'"),
    (["--limit", "146", "--superset", "mmlu=100"], "--superset 'mmlu=100'"),
    (["--superset", "mmlu=1000"], "--superset 'mmlu=1000'"),  # a superset needs a limit
])
def test_cli_bad_sample_flags_exit_2_naming_the_flag(flags, named, capsys):
    from transmla.cli import main

    assert main(["eval", "--model", "/nonexistent", *flags]) == 2  # refused before any model is read
    err = capsys.readouterr().err
    assert named in err and "BENCHMARK=N" in err


def test_cli_limits_with_and_without_limit(capsys):
    """--limits sizes the benchmarks it names beside --limit: with --limit it passes the flag checks (the run
    then fails on the missing model, not on the flags); without --limit it would be ignored, and is refused."""
    from transmla.cli import main

    assert main(["eval", "--model", "/nonexistent", "--limit", "170", "--limits", "mmlu=400"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent" in err and "--limits" not in err
    assert main(["eval", "--model", "/nonexistent", "--limits", "mmlu=400"]) == 2
    err = capsys.readouterr().err
    assert "--limits needs --limit" in err and "pass --limit N" in err


def test_an_out_folder_holds_one_run(tmp_path):
    """eval --out into the folder of an earlier run: the earlier run's sample files of other tasks do not
    remain beside the new results.json (the folder would mix two runs)."""
    row = {"doc_id": 0, "target": 1}
    write_results(tmp_path, {"tasks": ["arc_easy", "piqa"]},
                  {"samples": {f"{PREFIX}arc_easy": [row], f"{PREFIX}piqa": [row, row]}})
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["arc_easy.jsonl", "piqa.jsonl"]
    write_results(tmp_path, {"tasks": ["piqa"]}, {"samples": {f"{PREFIX}piqa": [row]}})
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["piqa.jsonl"]
    assert len(_samples(tmp_path, "piqa")) == 1
    assert json.loads((tmp_path / "results.json").read_text()) == {"tasks": ["piqa"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "samples"]  # no temporaries left

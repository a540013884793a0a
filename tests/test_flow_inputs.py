"""Bad input to the flow modules (`python -m flows.X`): refused before any flow run starts, as one line
(`transmla: error: ... Fix: ...`, exit 2), and nothing a user keeps at an explicit --out is replaced.

The command-line tests point PREFECT_API_URL at a closed port: a flow run cannot start there, so a
mistake only caught inside one fails the test with Prefect's "Failed to reach API" instead."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import tasks  # noqa: F401  (Prefect defaults; conftest pointed the store at a temp dir)
from transmla.errors import TransMLAError

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "params" / "default.yaml"


def _profile(tmp_path: Path) -> Path:
    # no model is ever loaded: every command below must stop before that
    raw = {"models": {"tiny": {"source": str(tmp_path / "no-such-model")}},
           "pipeline": {"models": ["tiny"], "budgets": [0.25], "methods": ["transmla"]}}
    p = tmp_path / "profile.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def _flow_cli(tmp_path: Path, module: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "PREFECT_CLIENT_MAX_RETRIES": "0"}
    return subprocess.run([sys.executable, "-m", f"flows.{module}", "--params", str(_profile(tmp_path)), *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _one_error_line(r: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("transmla: error:") and "Fix:" in lines[0], r.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ 1. an explicit --out is never replaced

def test_finetune_refuses_an_out_dir_in_use(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = _flow_cli(tmp_path, "finetune", "--model", "tiny", "--method", "transmla", "--budget", "0.25", "--out", str(out))
    _one_error_line(r, str(out), "not empty", "--out")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"


def test_calibrate_refuses_an_existing_out_file(tmp_path):
    out = tmp_path / "stats.safetensors"
    out.write_bytes(b"mine")
    r = _flow_cli(tmp_path, "calibrate", "--model", "tiny", "--out", str(out))
    _one_error_line(r, str(out), "already exists", "--out")
    assert out.read_bytes() == b"mine"


def test_publish_replaces_pipeline_outputs_but_never_a_named_out(tmp_path):
    from tasks.artifacts import dir_ref, file_ref, publish

    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_text("new")
    (tmp_path / "src.json").write_text("new")

    used_dir = tmp_path / "dir-out"
    used_dir.mkdir()
    (used_dir / "old.txt").write_text("old")
    with pytest.raises(TransMLAError, match="choose a new --out"):
        publish(dir_ref(src), used_dir, replace=False)
    assert [p.name for p in used_dir.iterdir()] == ["old.txt"]
    publish(dir_ref(src), used_dir)  # a pipeline output (a DVC out): replaced, as before
    assert [p.name for p in used_dir.iterdir()] == ["model.bin"]

    used_file = tmp_path / "file-out"
    used_file.write_text("old")
    with pytest.raises(TransMLAError, match="choose a new --out"):
        publish(file_ref(tmp_path / "src.json"), used_file, replace=False)
    assert used_file.read_text() == "old"
    publish(file_ref(tmp_path / "src.json"), used_file)
    assert used_file.read_text() == "new"

    # a named output that is new, or an empty directory, is written
    (tmp_path / "empty").mkdir()
    assert (publish(dir_ref(src), tmp_path / "empty", replace=False) / "model.bin").is_file()
    assert publish(file_ref(tmp_path / "src.json"), tmp_path / "new.json", replace=False).read_text() == "new"


def test_finetune_flow_refuses_an_out_in_use_before_training(tmp_path):
    """Called from Python (no CLI), the flow refuses too, at its start; no task runs."""
    import flows.finetune as ft
    from flows.params import load_profile

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(TransMLAError, match="not empty"):
        ft.finetune.fn(load_profile(_profile(tmp_path)), "tiny", "transmla", 0.25, out=str(out))
    assert (out / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------ 2. nightly --serve keeps the -S overrides

def test_nightly_serve_keeps_the_overrides(monkeypatch):
    import prefect

    import flows.nightly as nightly

    served = []
    monkeypatch.setattr(prefect, "serve", lambda *deployments, **_: served.extend(deployments))
    monkeypatch.setattr(sys, "argv", ["flows.nightly", "--params", str(DEFAULT), "--serve",
                                      "-S", "nightly.cron=5 4 * * 1", "-S", "nightly.timezone=Europe/Berlin",
                                      "-S", "nightly.budgets=[0.25]"])
    nightly.main()
    (dep,) = served
    (sched,) = dep.schedules
    assert (sched.schedule.cron, sched.schedule.timezone) == ("5 4 * * 1", "Europe/Berlin")
    # every scheduled night runs with them too
    assert dep.parameters == {"params": str(DEFAULT), "overrides": {"nightly.cron": "5 4 * * 1",
                                                                    "nightly.timezone": "Europe/Berlin",
                                                                    "nightly.budgets": [0.25]}}


def test_nightly_serve_refuses_a_bad_override_before_serving(monkeypatch):
    import prefect

    import flows.nightly as nightly

    monkeypatch.setattr(prefect, "serve", lambda *a, **k: pytest.fail("served"))
    monkeypatch.setattr(sys, "argv", ["flows.nightly", "--params", str(DEFAULT), "--serve", "-S", "nightly.cron=bogus"])
    with pytest.raises(TransMLAError, match="nightly.cron"):
        nightly.main()


# ------------------------------------------------------------------ 3. --model/--method/--budget before the run

@pytest.mark.parametrize("module, argv, words", [
    ("convert", ["--model", "nosuch", "--method", "transmla", "--budget", "0.25"], ["'nosuch'", "['tiny']"]),
    ("convert", ["--model", "tiny", "--method", "transmla", "--budget", "7"], ["--budget", "(0, 1]"]),
    ("finetune", ["--model", "tiny", "--method", "transmla", "--budget", "0"], ["--budget", "(0, 1]"]),
    ("evaluate", ["--model", "tiny", "--method", "transmla"], ["--budget"]),
    ("figures", ["--model", "nosuch"], ["'nosuch'"]),
], ids=["convert-model", "convert-budget", "finetune-budget", "evaluate-no-budget", "figures-model"])
def test_variant_is_checked_before_the_flow_run(tmp_path, module, argv, words):
    out = tmp_path / "out"
    r = _flow_cli(tmp_path, module, *argv, *(["--out", str(out)] if module != "figures" else []))
    _one_error_line(r, *words)
    assert not out.exists() and not (tmp_path / "artifacts").exists() and not (tmp_path / "reports").exists()


def test_check_variant_accepts_good_input():
    from flows._cli import check_variant
    from flows.params import load_profile

    prof = load_profile(DEFAULT)
    check_variant(prof, "smollm2-135m", "transmla", 0.125)
    check_variant(prof, "smollm2-135m", "original", None)
    check_variant(prof, "smollm2-135m")
    with pytest.raises(TransMLAError, match="--budget"):
        check_variant(prof, "smollm2-135m", "mha2mla", float("nan"))


# ------------------------------------------------------------------ 4. -S overrides that cannot apply

@pytest.mark.parametrize("override, where", [
    ({"evaluation.limit.x": 5}, "evaluation.limit"),
    ({"pipeline.budgets.0": 5}, "pipeline.budgets"),
    ({"pipeline..budgets": [0.5]}, "pipeline..budgets"),
])
def test_override_into_a_value_is_one_error(override, where):
    from flows.params import load_profile

    with pytest.raises(TransMLAError) as e:
        load_profile(DEFAULT, override)
    text = str(e.value)
    assert f"-S {next(iter(override))}" in text and where in text and "Fix:" in text and "\n" not in text


def test_override_that_is_not_yaml_is_one_error():
    from flows._cli import overrides_of

    with pytest.raises(TransMLAError) as e:
        overrides_of(SimpleNamespace(set=["evaluation.limit=["]))
    text = str(e.value)
    assert "evaluation.limit" in text and "not YAML" in text and "Fix:" in text and "\n" not in text


def test_cli_override_that_is_not_yaml(tmp_path):
    r = _flow_cli(tmp_path, "calibrate", "--model", "tiny", "-S", "evaluation.limit=[")
    _one_error_line(r, "evaluation.limit", "not YAML")


@pytest.mark.parametrize("override, words", [
    # every row twice in Table 1; DVC merged the duplicate stages without a word
    ({"pipeline.models": ["smollm2-135m", "smollm2-135m"]}, "pipeline.models: Value error, models names"),
    ({"pipeline.methods": ["transmla", "transmla"]}, "methods names ['transmla'] more than once"),
    ({"finetune.corpora": ["c4-demo", "c4-demo"]}, "corpora names ['c4-demo'] more than once"),
    ({"throughput.contexts": [512, 512]}, "contexts names [512] more than once"),
    ({"nightly.methods": ["transmla-refit", "transmla-refit"]},
     "nightly.methods: Value error, methods names ['transmla-refit'] more than once"),
    # a string alone was read as one watch entry per character: a dozen unresolved rows each night
    ({"nightly.watch": "smollm2-135m"}, "watch is a list of entries"),
    ({"nightly.watch": {"hub": {"author": "Qwen"}}}, "watch is a list of entries"),
    # the field's Python spelling loaded, and dvc repro stopped at the first stage tracking methods.transmla-refit
    ({"methods.transmla_refit": {"freqfold": 2}}, "the row is spelled transmla-refit"),
    # refused by the perplexity run after the model loaded (under dvc repro: after calibration and conversions)
    ({"evaluation.ppl_max_tokens": 1000}, "ppl_max_tokens 1000 is fewer than one ppl_seqlen window (2048)"),
    ({"figures.ppl_max_tokens": 1024}, "figures.ppl_max_tokens 1024 is fewer than one evaluation.ppl_seqlen"),
    # pydantic read "0.50" as 0.5 where DVC named the stage and its paths "0.50"
    ({"pipeline.budgets": ["0.50"]}, "budget '0.50' is quoted text"),
    ({"nightly.budgets": ["1"]}, "budget '1' is quoted text"),
])
def test_profile_lists_and_spellings_that_would_run_wrong_are_refused(override, words):
    from flows.params import load_profile

    with pytest.raises(TransMLAError, match=re.escape(words)):
        load_profile(DEFAULT, override)


def test_profile_lists_as_written_still_load():
    from flows.params import load_profile

    p = load_profile(DEFAULT, {"nightly.watch": ["smollm2-135m", {"hub": {"author": "Qwen"}}],
                               "methods.transmla-refit": {"freqfold": 2}})
    assert p.nightly.watch[0] == "smollm2-135m" and p.nightly.watch[1].hub.author == "Qwen"
    assert p.methods.transmla_refit.freqfold == 2


def test_bad_override_value_names_the_option():
    from flows.params import load_profile

    with pytest.raises(TransMLAError, match=r"Fix: change -S pipeline\.budgets="):
        load_profile(DEFAULT, {"pipeline.budgets": [2]})


def test_a_profile_device_the_fine_tune_cannot_use_fails_at_load():
    """The fine-tune's own refusal of cuda:N (N > 0) came when its stage started, after every conversion and
    evaluation; a profile that fine-tunes on it now fails where it is read, naming the fix. Without a fine-tune
    stage the device is the other stages' to use."""
    from flows.params import load_profile

    with pytest.raises(TransMLAError, match=r"device cuda:1.*CUDA_VISIBLE_DEVICES=1 and device cuda") as e:
        load_profile(DEFAULT, {"device": "cuda:1"})
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)
    p = load_profile(DEFAULT, {"device": "cuda:1", "finetune.budgets": []})
    assert p.device == "cuda:1" and p.finetune.budgets == ()
    # the section's own device (a FinetuneConfig field) was validated and then replaced by the profile's
    with pytest.raises(TransMLAError, match=r"finetune\.device: .*set the top-level device"):
        load_profile(DEFAULT, {"finetune.device": "cuda"})


# ------------------------------------------------------------------ 5. nightly budgets and schedule at load

@pytest.mark.parametrize("override, field", [
    ({"nightly.budgets": [7, -1]}, "nightly.budgets"),
    ({"nightly.budgets": [0.25, 0.25]}, "nightly.budgets"),
    ({"nightly.cron": "bogus"}, "nightly.cron"),
    ({"nightly.cron": "61 3 * * *"}, "nightly.cron"),
    ({"nightly.timezone": "Mars/Olympus"}, "nightly.timezone"),
])
def test_nightly_params_are_validated_at_load(override, field):
    from flows.params import load_profile

    with pytest.raises(TransMLAError) as e:
        load_profile(DEFAULT, override)
    assert field in str(e.value) and "Fix:" in str(e.value)


@pytest.mark.parametrize("override, words", [
    # DVC names stages and paths after the YAML's "1", the flows after the float's "1.0"
    ({"pipeline.budgets": [1, 0.125]}, ["pipeline.budgets", "integer", "1.0"]),
    ({"finetune.budgets": [1]}, ["finetune.budgets", "integer"]),
    ({"throughput.budgets": [1]}, ["throughput.budgets", "integer"]),
    # each of these used to load, then fail inside a stage, after the stages before it had run
    ({"evaluation.tasks": []}, ["evaluation.tasks", "no benchmark"]),
    ({"nightly.methods": []}, ["nightly.methods", "at least 1"]),
    ({"nightly.budgets": []}, ["nightly.budgets", "at least 1"]),
    ({"mlflow.experiment": ""}, ["mlflow.experiment", "at least 1"]),
    ({"device": "cdua"}, ["device", "not a torch device"]),
    ({"calibration.dataset": "wikitext3-train"}, ["calibration.dataset", "Unknown data set 'wikitext3-train'"]),
    ({"calibration.dataset": "c4-demo+wikitext3+path:/no/such/dir"}, ["calibration.dataset", "'wikitext3'"]),
    ({"finetune.corpora": ["c4-demo", "c4"]}, ["finetune.corpora", "Unknown data set 'c4'"]),
    ({"evaluation.ppl_dataset": "wikitext-2"}, ["evaluation.ppl_dataset", "Unknown data set"]),
    # read as text by their stages, where a benchmark's rows failed with "use load_rows() instead"
    ({"finetune.corpora": ["c4-demo", "arc_easy"]}, ["finetune.corpora", "arc_easy is a benchmark"]),
    ({"evaluation.ppl_dataset": "hellaswag"}, ["evaluation.ppl_dataset", "hellaswag is a benchmark"]),
    # trained or calibrated on the text its perplexity is measured on
    ({"finetune.corpora": ["c4-demo", "wikitext2-test"]}, ["finetune.corpora", "wikitext2-test is an evaluation split"]),
    # packed into 0 blocks at the fine-tune stage, after the conversions, with a fix about seqlen
    ({"finetune.corpora": []}, ["finetune.corpora", "at least 1 item"]),
    # measured, then the report's Fig. 6 failed on no points (a traceback, no report)
    ({"throughput.contexts": []}, ["throughput.contexts", "at least 1 item"]),
    ({"calibration.dataset": "wikitext2-train+wikitext2-test"}, ["calibration.dataset", "includes wikitext2-test, the set perplexity is measured on"]),
    # numpy refused them inside the stage, after the model had loaded
    ({"calibration.seed": -1}, ["calibration.seed", "greater than or equal to 0"]),
    ({"finetune.seed": 2**32}, ["finetune.seed", "less than 4294967296"]),
    ({"evaluation.seed": -5}, ["evaluation.seed", "greater than or equal to 0"]),
    # YAML reads yes/no/on/off as booleans, and pydantic took them as 1 and 0 (`nsamples: yes` calibrated on 1 window)
    ({"calibration.nsamples": True}, ["calibration.nsamples", "True is a boolean, not a number"]),
    ({"finetune.lr": False}, ["finetune.lr", "False is a boolean"]),
    ({"throughput.contexts": [512, True]}, ["throughput.contexts", "holds a boolean"]),
    ({"evaluation.limit": True}, ["evaluation.limit", "is a boolean"]),
    ({"evaluation.limits": {"mmlu": True}}, ["evaluation.limits", "holds a boolean"]),
    ({"evaluation.tasks": ["piqa", "mmlu", "piqa"]}, ["evaluation.tasks", "['piqa'] more than once"]),
    # Fig. 4b divided the head dim by 0 after calibration and every conversion
    ({"figures.rope_dims": [8, 0]}, ["figures.rope_dims", "RoPE dim 0", "even number >= 2"]),
    ({"figures.rope_dims": [3]}, ["figures.rope_dims", "RoPE dim 3"]),
    ({"figures.rope_dims": []}, ["figures.rope_dims", "at least 1 item"]),
    ({"figures.fig4a_rope_dim": -2}, ["figures.fig4a_rope_dim", "RoPE dim -2"]),
], ids=lambda x: next(iter(x)) if isinstance(x, dict) else None)
def test_params_that_would_fail_inside_a_stage_are_refused_at_load(override, words):
    from flows.params import load_profile

    with pytest.raises(TransMLAError) as e:
        load_profile(DEFAULT, override)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "Fix:" in str(e.value) and "\n" not in str(e.value)


def test_a_calibration_path_holding_the_perplexity_text_is_refused_by_the_stages(tmp_path):
    """A calibration part holding WikiText-2 test text (a copy of some of its rows: the conversion was calibrated on
    the text Table 1 scores it on, exit 0) is refused at load where the path is there, and by the stages that read
    the calibration set (a path: part is read on the machine that runs the stage); one that does not is taken."""
    from flows.calibrate import calibration_data
    from flows.params import load_profile
    from transmla.io.data import local_path

    rows = local_path("wikitext2-test").read_text().splitlines(keepends=True)
    copy, other = tmp_path / "notes.jsonl", tmp_path / "other.jsonl"
    prof = load_profile(DEFAULT, {"calibration.dataset": f"wikitext2-train+path:{copy}"})  # not there yet
    copy.write_text("".join(rows[2000:2300]))
    other.write_text("".join(local_path("wikitext2-train").read_text().splitlines(keepends=True)[:300]))
    for refuse in (lambda: calibration_data(prof),
                   lambda: load_profile(DEFAULT, {"calibration.dataset": f"wikitext2-train+path:{copy}"})):
        with pytest.raises(TransMLAError, match="calibration.dataset part 'path:.*' holds text of wikitext2-test"):
            refuse()
    one = tmp_path / "one.txt"  # one paragraph of it in other text (a sample of its paragraphs missed most of these)
    texts = [json.loads(r)["text"] for r in rows]
    one.write_text("Some notes.\n" + [t for t in texts if len(t) > 300][777] + "\nMore notes.\n")
    with pytest.raises(TransMLAError, match=r"holds text of wikitext2-test, .*\(1 of its"):
        load_profile(DEFAULT, {"calibration.dataset": f"path:{one}"})
    ref = calibration_data(load_profile(DEFAULT, {"calibration.dataset": f"wikitext2-train+path:{other}"}))
    assert [p["name"] for p in ref["parts"]] == ["wikitext2-train", f"path:{other}"]


def test_yaml_booleans_stay_where_a_boolean_is_wanted():
    """The refusal of booleans for numbers leaves the boolean params, and the library's options, as they were."""
    from flows.params import load_profile
    from transmla.config import ConvertOptions

    prof = load_profile(DEFAULT, {"finetune.gradient_checkpointing": True, "throughput.packed_weights": False,
                            "methods.transmla.refit": True})
    assert prof.finetune.gradient_checkpointing is True and prof.methods.transmla.refit is True
    assert ConvertOptions(refit=False, lossless=False).refit is False
    with pytest.raises(TransMLAError, match="cal_nsamples: True is a boolean"):
        ConvertOptions(cal_nsamples=True)


def test_a_device_this_machine_lacks_is_refused_before_the_flow_run(tmp_path):
    """Calibration and conversion run on the CPU whatever the device: a GPU the machine lacks would fail
    only at the first evaluation, after them."""
    r = _flow_cli(tmp_path, "calibrate", "--model", "tiny", "-S", "device=cuda:99")
    _one_error_line(r, "params device cuda:99", "no such CUDA device", "-S device=cpu")
    assert not (tmp_path / "artifacts").exists()


def test_nightly_good_schedule_loads():
    from flows.params import load_profile

    night = load_profile(DEFAULT, {"nightly.cron": "30 2 * * 1-5", "nightly.timezone": "Asia/Tokyo",
                                   "nightly.budgets": [0.125, 0.25]}).nightly
    assert (night.cron, night.timezone, night.budgets) == ("30 2 * * 1-5", "Asia/Tokyo", (0.125, 0.25))


def test_finetune_task_refuses_several_processes_before_any_work(monkeypatch, tmp_path):
    """The fine-tune's steps count WORLD_SIZE processes, which its cache key does not see: the pipeline's task
    (one process) refuses a WORLD_SIZE other than 1 before it reads the model, instead of caching a run made
    for another process count under the one-process key."""
    from tasks.finetune import finetune_checkpoint

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TransMLAError, match="WORLD_SIZE=2.*torchrun"):
        finetune_checkpoint.fn({"path": str(tmp_path / "no-such-model")}, [], {})


def test_report_refuses_rows_scored_under_other_evaluation_params(tmp_path, monkeypatch):
    """The report's notes describe the benchmarks from the params: rows whose protocol or document limit differ
    (a stale metrics file, or -S evaluation.protocol=... given to the report alone) are refused, naming them."""
    from flows import layout
    from flows.params import load_profile
    from flows.report import rows_of

    profile = load_profile(_profile(tmp_path), {"evaluation.protocol": "paper", "evaluation.limit": 5})
    monkeypatch.setattr(layout, "metrics_file", lambda m, meth, b, ft: tmp_path / f"{meth}-{b}-{ft}.json")
    row = {"model": "tiny", "budget": None, "finetuned": False, "protocol": "paper", "eval_limit": 5}
    for meth, b in (("original", None), ("transmla", 0.25)):
        (tmp_path / f"{meth}-{b}-False.json").write_text(json.dumps({**row, "method": meth, "budget": b}))
    assert [r["method"] for r in rows_of(profile)] == ["original", "transmla"]
    (tmp_path / "transmla-0.25-False.json").write_text(json.dumps({**row, "method": "transmla", "budget": 0.25,
                                                                    "protocol": "lm_eval"}))
    with pytest.raises(TransMLAError, match=r"tiny transmla 0.25: protocol 'lm_eval'.*dvc repro"):
        rows_of(profile)
    with pytest.raises(TransMLAError, match="eval_limit 5"):
        rows_of(load_profile(_profile(tmp_path), {"evaluation.protocol": "lm_eval", "evaluation.limit": 7}))
    # each row names only the params it differs in, every such row once
    with pytest.raises(TransMLAError, match=r"\(protocol 'paper', eval_limit 7\): tiny original: eval_limit 5; "
                                            r"tiny transmla 0\.25: protocol 'lm_eval', eval_limit 5\."):
        rows_of(load_profile(_profile(tmp_path), {"evaluation.protocol": "paper", "evaluation.limit": 7}))
    with pytest.raises(TransMLAError, match=r"\): tiny original: protocol 'paper'\."):
        rows_of(load_profile(_profile(tmp_path), {"evaluation.protocol": "lm_eval", "evaluation.limit": 5}))


def test_the_table_names_the_perplexity_set_the_params_score(tmp_path):
    """The column and the note said WikiText-2 whatever evaluation.ppl_dataset named (wiki-demo is accepted)."""
    from flows.report import ppl_label
    from tasks.report import table1

    assert ppl_label("wikitext2-test") == "WikiText-2 test" and ppl_label("wiki-demo") == "wiki-demo"
    assert "| Tokens | wiki-demo ppl |" in table1.fn([], {}, [], tmp_path / "t.md", ppl_label("wiki-demo"))
    assert "| Tokens | WikiText-2 ppl |" in table1.fn([], {}, [], tmp_path / "t.md", ppl_label("wikitext2-test"))


def test_the_table_describes_the_methods_as_the_params_ran_them():
    """The Calibration note was fixed text ("BKV", "statistics of the original model", "refit jointly"): with
    methods.* changed in params (the report stage tracks them) it described conversions that never ran."""
    from flows.params import load_profile
    from flows.report import methods_note

    default = methods_note(load_profile(DEFAULT).methods)
    assert default.startswith("TransMLA = RoRoPE + FreqFold 4 + BKV (activations PCA), statistics of the original "
                              "model (the paper); TransMLA + seq. refit = the same steps calibrated layer by layer")
    assert "refit jointly by least squares" in default and default.count("(this project)") == 1
    changed = methods_note(load_profile(DEFAULT, {
        "methods.transmla.calibration": "sequential", "methods.transmla.balance_kv": False,
        "methods.transmla-refit.refit": False, "methods.transmla-refit.calibration": "parallel",
        "methods.transmla-refit.freqfold": 1}).methods)
    paper, refit = changed.split("; ")[:2]
    assert paper == ("TransMLA = RoRoPE + FreqFold 4 + joint KV PCA (activations, no BKV) calibrated layer by layer on "
                     "the converted model (this project)")
    assert refit == ("TransMLA + seq. refit = RoRoPE + BKV (activations PCA), statistics of the original model, in "
                     "attention's metric, RoRoPE components ranked by the score energy the queries read (this project)")


def test_the_figures_are_keyed_on_the_conversions_they_run():
    """The figures build every point from the per-layer steps on the original model's statistics (the paper's
    figures): with methods.transmla made layer-streamed, the points were keyed on a sequential refit that never
    ran. Their options now say what runs; the default profile's are unchanged (its cached points stay valid)."""
    from flows.figures import figure_options
    from flows.params import load_profile

    default = load_profile(DEFAULT)
    for method in ("transmla", "mha2mla"):
        assert figure_options(default, method, 0.25) == default.convert_options(method, 0.25)
    streamed = load_profile(DEFAULT, {"methods.transmla.calibration": "sequential", "methods.transmla.refit": True,
                                      "methods.transmla.freqfold": 2})
    o = figure_options(streamed, "transmla", 0.25, balance_kv=False)
    assert (o.calibration, o.refit, o.streamed, o.freqfold, o.balance_kv) == ("parallel", False, False, 2, False)


def test_the_sample_note_counts_the_documents_there_are_of_the_benchmarks_run():
    """A limit of 1000 was printed as 1000 OpenBookQA documents (it has 500) with the standard error of that
    sample; a reference limit of a benchmark not in tasks was printed as a sample the Original rows scored."""
    from flows.report import sample_note
    from transmla.config import EvaluationOptions

    rows = [{"sizes": {"openbookqa": {"offline_openbookqa": 500}, "piqa": {"offline_piqa": 1838}}}]
    note = sample_note(EvaluationOptions(limit=1000, limits={}, reference_limits={}), rows)
    assert "openbookqa 500, winogrande 1000" in note and "piqa 1000" in note
    assert "at most 0.67 points" in note  # the worst case of the sample scored (0.62 for 1000 of each)
    note = sample_note(EvaluationOptions(tasks=("mmlu", "piqa"), limit=5, limits={},
                                         reference_limits={"winogrande": 1000, "mmlu": 20}), rows)
    assert "Original rows score mmlu on 20 docs" in note and "winogrande" not in note


def test_report_refuses_rows_with_other_document_counts_or_perplexity_tokens(tmp_path, monkeypatch):
    """Beyond protocol and limit: each benchmark's document count (per-benchmark limits, the Original row's
    reference superset, capped by the task's size) and the perplexity tokens must be what the params say, and
    one token count for every row (a row measured with limits.mmlu=400 or over 16,384 tokens was accepted and
    the notes mixed them); rows scored on other documents fail as one error, not a ValueError."""
    from flows import layout
    from flows.params import load_profile
    from flows.report import rows_of
    from tasks.report import paired_to_original

    over = {"evaluation.protocol": "paper", "evaluation.limit": 5, "evaluation.limits": {"mmlu": 8},
            "evaluation.reference_limits": {"mmlu": 20}, "evaluation.ppl_max_tokens": 4096}
    profile = load_profile(_profile(tmp_path), over)
    monkeypatch.setattr(layout, "metrics_file", lambda m, meth, b, ft: tmp_path / f"{meth}-{b}-{ft}.json")
    sizes = {"mmlu": {"offline_mmlu_a": 30, "offline_mmlu_b": 30}, "arc_easy": {"offline_arc_easy": 3}}
    row = {"model": "tiny", "finetuned": False, "protocol": "paper", "eval_limit": 5, "ppl_tokens": 4096,
           "sizes": sizes}

    def write(meth, b, **kw):
        n = {"mmlu": 20 if meth == "original" else 8, "arc_easy": 3}  # arc_easy: 3 docs in all, under the limit
        (tmp_path / f"{meth}-{b}-False.json").write_text(json.dumps({**row, "method": meth, "budget": b,
                                                                     "benchmark_n": n, **kw}))

    write("original", None)
    write("transmla", 0.25)
    assert len(rows_of(profile)) == 2
    write("transmla", 0.25, benchmark_n={"mmlu": 400, "arc_easy": 3})
    with pytest.raises(TransMLAError, match=r"tiny transmla 0.25: mmlu on 400 docs \(the params: 8\)"):
        rows_of(profile)
    write("transmla", 0.25, ppl_tokens=2048)
    with pytest.raises(TransMLAError, match=r"tiny transmla 0.25: perplexity over 2048 tokens"):
        rows_of(profile)
    write("transmla", 0.25)
    with pytest.raises(TransMLAError, match=r"tiny original: mmlu on 20 docs \(the params: 8\)"):
        rows_of(load_profile(_profile(tmp_path), {**over, "evaluation.reference_limits": {}}))
    rows = [{"model": "tiny", "method": m, "budget": b, "finetuned": False,
             "scores": {"arc_easy": {"offline_arc_easy": {d: 1.0}}},
             "sizes": {"arc_easy": {"offline_arc_easy": 3}}} for m, b, d in (("original", None, "0"), ("transmla", 0.25, "1"))]
    with pytest.raises(TransMLAError, match="tiny transmla 0.25 was scored on other documents"):
        paired_to_original(rows)


@pytest.mark.parametrize("flags", [[], ["--model", "tiny"]], ids=["no-model", "model"])
def test_entry_runs_a_flow_with_and_without_model(tmp_path, flags):
    """The flows without --model (report, paper) pass the up-front checks and reach their flow, called with
    the validated profile alone (before, their command died in check_variant with a TypeError)."""
    code = ("import sys; from flows import _cli; sys.argv = ['x', '--params', sys.argv[1], *sys.argv[2:]]; "
            "_cli.entry(lambda profile, *pos: print('ran', type(profile).__name__, *pos), 'doc', "
            f"model={bool(flags)})")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code, str(_profile(tmp_path)), *flags], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ran", "Profile", *flags[1:]]


def test_the_default_profile_is_the_file_the_stages_read(monkeypatch):
    """No environment variable picks another profile: the flows' --params default, the model pre-fetch of
    `make repro` and flows.dag all read params/default.yaml, as dvc.yaml's stages do."""
    from flows.params import load_profile

    monkeypatch.setenv("TRANSMLA_PARAMS", str(REPO / "params" / "paper.yaml"))
    assert load_profile(None) == load_profile(DEFAULT)


def test_a_distributed_rank_loads_onto_its_own_gpu(monkeypatch):
    """Under torchrun / accelerate launch every rank read `--device cuda` as GPU 0 and loaded its student and
    teacher there; a bare cuda is the rank's own GPU now, and a GPU index (every rank on that one GPU) is
    refused. One process may name its GPU (the Trainer's own limit on it: FinetuneConfig, below)."""
    from transmla.config import FinetuneConfig
    from transmla.devices import rank_device
    from transmla.errors import TransMLAError

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device("cuda") == "cuda" and rank_device("cpu") == "cpu" and rank_device("cuda:1") == "cuda:1"
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_device("cuda") == "cuda:3" and rank_device("cpu") == "cpu"
    with pytest.raises(TransMLAError, match="every rank would load onto that one GPU"):
        rank_device("cuda:0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_device("cuda:0") == "cuda:0"
    # transformers' Trainer trains on the first visible GPU whatever index is given: refused, naming the fix
    assert FinetuneConfig(device="cuda:0").device == "cuda:0" and FinetuneConfig(device="cuda").device == "cuda"
    with pytest.raises(TransMLAError, match="CUDA_VISIBLE_DEVICES=2 and device cuda"):
        FinetuneConfig(device="cuda:2")


def test_an_input_error_inside_a_flow_run_is_its_line_without_tracebacks(tmp_path):
    """An input error raised once the flow runs (here: another --checkpoint without --out) was printed under
    Prefect's logged tracebacks of the flow run: a page of its engine above the one line. The run's log line
    stays; the traceback goes. (A real flow run: a temporary Prefect server, some seconds.)"""
    ckpt = tmp_path / "other"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.evaluate", "--params", str(_profile(tmp_path)), "--model", "tiny",
                        "--method", "transmla", "--budget", "0.25", "--checkpoint", str(ckpt)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Encountered exception during execution" in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert any(ln.startswith("transmla: error: --checkpoint") and "pass --out FILE" in ln for ln in lines), r.stderr


def test_the_original_with_a_budget_is_refused_before_the_run(tmp_path):
    """--method original --budget 0.25 ran a whole evaluation of the original, the budget silently ignored."""
    r = _flow_cli(tmp_path, "evaluate", "--model", "tiny", "--method", "original", "--budget", "0.25")
    _one_error_line(r, "--method original", "--budget 0.25", "drop --budget")


# ------------------------------------------------------------------ 6. each model's plan before the first calibration

def _plan_profile(tmp_path: Path, model_dir: Path, **sections) -> Path:
    raw = {"models": {"first": {"source": str(model_dir)}, "second": {"source": str(model_dir)}},
           "pipeline": {"models": ["first", "second"], "budgets": [0.25], "methods": ["transmla"]},
           "figures": {"rope_dims": [8, 4], "fig4a_rope_dim": 8, "fig5_budget": 0.25}}
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    p = tmp_path / "plan.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("sections, words", [
    # a budget too small for the model (head dim 16, 2 KV heads: 64 values per token, 0.01 keeps 1)
    ({"pipeline": {"budgets": [0.25, 0.01]}}, ["first, transmla at budget 0.01", "too few for any RoPE dim"]),
    # the second model cannot be read: refused before the first model's calibration
    ({"models": {"second": {"source": "/no/such/model"}}}, ["/no/such/model"]),
    # Fig. 4 params the model's head dim (16) cannot take; they failed after every conversion
    ({"figures": {"rope_dims": [8, 32]}}, ["first: figures.rope_dims", "RoPE dim 32", "head dim 16"]),
    ({"figures": {"fig4a_rope_dim": 6}}, ["first: figures.fig4a_rope_dim", "RoPE dim 6"]),
    ({"figures": {"fig5_budget": 0.001}}, ["first: figures.fig5_budget=0.001", "raise figures.fig5_budget"]),
], ids=["budget", "second-model", "rope-dims", "fig4a", "fig5-budget"])
def test_paper_flow_checks_every_model_before_any_work(tmp_path, tiny_model_dir, sections, words):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api",
           "PREFECT_CLIENT_MAX_RETRIES": "0"}
    r = subprocess.run([sys.executable, "-m", "flows.paper", "--params", str(_plan_profile(tmp_path, tiny_model_dir,
                                                                                       **sections))],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    _one_error_line(r, *words)
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "reports").exists()


def test_paper_flow_plan_skips_the_figures_it_will_not_make(tmp_path, tiny_model_dir, monkeypatch):
    import flows.paper
    from flows.paper import check_plan
    from flows.params import load_profile

    # the plan reads config.json alone: no model is fetched or hashed for it
    monkeypatch.setattr(flows.paper, "resolve_model", pytest.fail)
    profile = load_profile(_plan_profile(tmp_path, tiny_model_dir, figures={"rope_dims": [32]}))
    with pytest.raises(TransMLAError, match="figures.rope_dims"):
        check_plan(profile)
    check_plan(profile, no_figures=True)
    check_plan(load_profile(_plan_profile(tmp_path, tiny_model_dir)))  # the good plan passes


def test_convert_and_figures_resolve_their_budget_before_calibrating(tmp_path, tiny_model_dir, monkeypatch):
    """An impossible conversion fails on config.json, before the calibration statistics (minutes to hours)."""
    import flows.convert as fc
    import flows.figures as ff
    from flows.params import load_profile
    from tasks.artifacts import model_ref

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before the budget was checked")

    monkeypatch.setattr(fc, "stats_for", no_calibration)
    monkeypatch.setattr(ff, "stats_for", no_calibration)
    ref = model_ref(tiny_model_dir, "hash", source=str(tiny_model_dir))
    profile = load_profile(_plan_profile(tmp_path, tiny_model_dir, figures={"fig5_budget": 0.001}))
    with pytest.raises(TransMLAError, match="too few for any RoPE dim"):
        fc.converted(profile, ref, profile.convert_options("transmla", 0.01), str(tmp_path / "out"))
    monkeypatch.setattr(ff, "resolve_model", lambda source: ref)
    with pytest.raises(TransMLAError, match="figures.fig5_budget"):
        ff.figures.fn(profile, "first")
    assert not (tmp_path / "out").exists()


def test_figures_budget_errors_keep_their_own_fix(monkeypatch):
    """Fig. 5's conversion uses methods.transmla's FreqFold: its error keeps that fix, and only a budget too small
    is told to raise figures.fig5_budget."""
    from flows.figures import check_figures
    from flows.params import load_profile
    from transmla.adapters import GQASpec

    spec = GQASpec(model_type="llama", D=48, h=4, g=2, d=12, n_layers=2, rope_theta=1e4, rms_norm_eps=1e-6,
                   vocab_size=64, intermediate_size=96, hidden_act="silu", max_position_embeddings=512,
                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    prof = load_profile(DEFAULT, {"figures.rope_dims": [6, 4, 2], "figures.fig4a_rope_dim": 6, "figures.freqfold": 2,
                                  "methods.transmla.freqfold": 4})
    with pytest.raises(TransMLAError, match="figures.fig5_budget=0.3125: freqfold=4") as e:
        check_figures(prof, spec)
    assert "raise figures.fig5_budget" not in str(e.value)
    with pytest.raises(TransMLAError, match="raise figures.fig5_budget"):
        check_figures(load_profile(DEFAULT, {"figures.rope_dims": [6, 4, 2], "figures.fig4a_rope_dim": 6,
                                             "figures.freqfold": 2, "methods.transmla.freqfold": 2,
                                             "figures.fig5_budget": 0.01}), spec)


@pytest.mark.parametrize("module, argv", [
    ("evaluate", ["--model", "tiny", "--method", "original"]),
    ("convert", ["--model", "tiny", "--method", "transmla", "--budget", "0.25"]),
    ("calibrate", ["--model", "tiny"]),
], ids=["evaluate", "convert", "calibrate"])
def test_flows_refuse_an_empty_out(tmp_path, module, argv):
    """--out "" passed the output check and reached the flow: evaluate ran, then failed writing ".";
    convert and calibrate fell back to the pipeline's own output path."""
    r = _flow_cli(tmp_path, module, *argv, "--out", "")
    _one_error_line(r, "--out is empty", "give --out a path")
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "reports").exists()

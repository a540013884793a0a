"""The benchmark scripts' bookkeeping (scripts/recovery.py, scripts/ablation.py): what they refuse before any
model loads, and what a resumed report keeps. Their measurements are the scripts' own runs, not tests."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / f"{name}.py"), *argv], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("argv, named", [(["--objective", "kd"], "--objective"), (["--max-tokens=1024"], "--max-tokens"),
                                         (["--corpora", "c4-demo"], "--corpora"), (["--teacher", "x"], "--teacher"),
                                         (["--objec", "kd"], "--objective")])  # argparse takes abbreviations
def test_recovery_refuses_flags_each_run_sets_itself(tmp_path, argv, named):
    """A flag after -- came last on each run's command line and won: a row labelled lm trained with --objective kd
    (and another --max-tokens than its header said), exit 0."""
    out = tmp_path / "r.json"
    # a model that is not there: were the flag taken, the run would stop at loading it (exit 1), not run for hours
    r = _run("recovery", "--model", str(tmp_path / "none"), "--runs", "lm", "--out", str(out), "--", *argv)
    assert r.returncode == 2 and f"{named} after --" in r.stderr and "each run sets" in r.stderr, r.stderr[-2000:]
    assert not out.exists()
    r = _run("recovery", "--model", str(tmp_path / "none"), "--runs", "lm", "--out", str(out), "--", "--lr", "3e-4")
    assert r.returncode == 1 and "each run sets" not in r.stderr  # a flag of its own passes (then: no such model)


def test_recovery_takes_the_budget_from_its_checkpoint(tmp_path):
    """--checkpoint DIR was labelled with --budget (default 0.125) whatever the checkpoint kept."""
    ckpt = tmp_path / "mla"
    ckpt.mkdir()
    # a QK-norm model's record counts its cached key scales (0.5078 for 0.5): the ratio asked for is the label
    (ckpt / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "transmla": {
        "kv_cache_ratio": 0.5078, "options": {"kv_cache_ratio": 0.5}}}))
    r = _run("recovery", "--model", str(tmp_path / "none"), "--checkpoint", str(ckpt), "--budget", "0.125", "--out",
             str(tmp_path / "r.json"))
    assert r.returncode == 2 and "keeps 0.5000 of the KV cache" in r.stderr, r.stderr[-2000:]
    r = _run("recovery", "--model", str(tmp_path / "none"), "--checkpoint", str(ckpt), "--budget", "0.5", "--out",
             str(tmp_path / "r.json"))
    assert r.returncode == 1 and "KV cache" not in r.stderr  # taken (then: no such model)


def test_recovery_index_gives_each_model_its_own_original(tmp_path):
    """Reports of two models at one budget were one section under the first model's original perplexity."""
    rec = _script("recovery")
    row = {"run": "lm", "tokens_trained": 10, "wikitext2-test": 50.0, "c4-demo": 60.0, "val_loss_after": 4.0,
           "val_kd_after": 1.0, "tokens_per_second": 1.0, "seconds": 10.0, "peak_rss_gib": 1.0}
    for model, orig in (("big", 20.0), ("small", 500.0)):
        (tmp_path / f"{model}.json").write_text(json.dumps({
            "model": model, "budget": 0.125, "protocol": {"ppl_tokens": 2048, "training": "10 tokens, defaults"},
            "original": {"wikitext2-test": orig, "c4-demo": orig}, "converted": {"wikitext2-test": 99.0},
            "rows": [row]}))
    text = rec.index(tmp_path)
    assert "## big, 87.50% KV cut (original: WikiText-2 20.00" in text
    assert "## small, 87.50% KV cut (original: WikiText-2 500.00" in text
    assert "| small | lm |" in text and "| 480.00 |" not in text.split("## small")[0]


def _ablation_report(path: Path, model: str, machine: str) -> None:
    """The committed SmolLM2 report, as if measured for `model` on `machine` with 256 perplexity tokens."""
    res = json.loads((REPO / "reports" / "ablation" / "smollm2-135m.json").read_text())
    res["model"] = model
    res["protocol"].update(ppl_tokens=256, seqlen=128, machine=machine)
    path.write_text(json.dumps(res))


def test_ablation_keeps_its_rows_on_another_machine_and_refuses_another_model(tmp_path, tiny_model_dir):
    """The thread count was part of the resume key: on another machine --rescore failed (KeyError 'original') and a
    plain resume dropped every stored row; a second model's rows were appended under the first one's original."""
    out = tmp_path / "a.json"
    _ablation_report(out, str(tiny_model_dir), "CPU, 999 threads")
    before = json.loads(out.read_text())
    r = _run("ablation", "--model", str(tiny_model_dir), "--rescore", "--out", str(out), "--ppl-tokens", "256",
             "--seqlen", "128")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["rows"] == before["rows"]
    r = _run("ablation", "--model", "another-model", "--rows", "transmla", "--budgets", "0.5", "--out", str(out),
             "--ppl-tokens", "256", "--seqlen", "128")
    assert r.returncode == 2 and "holds rows of" in r.stderr, r.stderr[-2000:]
    r = _run("ablation", "--model", str(tiny_model_dir), "--out", str(out), "--ppl-tokens", "512", "--seqlen", "128")
    assert r.returncode == 2 and "another protocol" in r.stderr, r.stderr[-2000:]
    assert json.loads(out.read_text())["rows"] == before["rows"]


def test_eval_sizing_caps_each_benchmark_at_its_documents(tmp_path, capsys):
    """Without the benchmarks' sizes it printed 620 OpenBookQA documents (the file has 500) and a standard error
    that sample could not reach; capped, the others take up what OpenBookQA cannot, and the bound holds."""
    from transmla.evaluation.benchmarks import task_strata
    from transmla.evaluation.stats import AVERAGE_WEIGHTS, worst_case_average_se

    sizing = _script("eval_sizing")
    sizes = {b: sum(n.values()) for b, n in task_strata(list(AVERAGE_WEIGHTS), None).items()}
    speed = {b: {"docs": 100, "seconds": 100 * c} for b, c in {
        "mmlu": 0.5, "arc_easy": 0.3, "arc_challenge": 0.3, "piqa": 0.3, "hellaswag": 1.2, "openbookqa": 0.05,
        "winogrande": 0.2}.items()}
    (tmp_path / "results.json").write_text(json.dumps({"speed": speed}))
    out = sizing.main([str(tmp_path / "results.json"), "--target-se", "0.01"])
    docs = out["sized"]["docs"]
    assert docs["openbookqa"] == sizes["openbookqa"] and all(docs[b] <= sizes[b] for b in docs), docs
    assert worst_case_average_se(docs) <= 0.01
    with pytest.raises(SystemExit):  # more than there is: no sample reaches it
        sizing.main([str(tmp_path / "results.json"), "--target-se", "0.001"])
    assert "out of reach" in capsys.readouterr().err

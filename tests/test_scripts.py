"""The benchmark scripts' bookkeeping (scripts/recovery.py, scripts/ablation.py, the others): what they refuse
before any model loads, and what a resumed report keeps. Their measurements are the scripts' own runs, not tests."""

from __future__ import annotations

import importlib.util
import json
import re
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
    # a model that is not there: were the flag taken, the run would stop at loading it, not run for hours
    r = _run("recovery", "--model", str(tmp_path / "none"), "--runs", "lm", "--out", str(out), "--", *argv)
    assert r.returncode == 2 and f"{named} after --" in r.stderr and "each run sets" in r.stderr, r.stderr[-2000:]
    assert not out.exists()
    r = _run("recovery", "--model", str(tmp_path / "none"), "--runs", "lm", "--out", str(out), "--", "--lr", "3e-4")
    assert "each run sets" not in r.stderr and "Model directory not found" in r.stderr  # a flag of its own passes


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
    assert "KV cache" not in r.stderr and "Model directory not found" in r.stderr  # taken (then: no such model)


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


class _Loaded(Exception):
    """Raised by a stubbed load_model: the script got past every check it makes before its work."""


def _no_load(*_a, **_k):
    raise _Loaded


def _main(mod, monkeypatch, *argv):
    """A script's main() in this process, on this command line."""
    monkeypatch.setattr(sys, "argv", [f"{mod.__name__}.py", *argv])
    return mod.main()


@pytest.fixture(scope="module")
def tiny_llamas(tiny_tokenizer, tmp_path_factory) -> list[Path]:
    """Two tiny Llama directories of one shape and tokenizer, with other weights (seeds 0 and 1)."""
    from conftest import _tiny_model

    dirs = []
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"llama-seed{seed}")
        _tiny_model("llama", len(tiny_tokenizer), seed=seed).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        dirs.append(d)
    return dirs


def _checkpoint(tmp_path: Path) -> Path:
    """A --checkpoint folder as far as recovery.py reads it before the runs: a conversion record at 0.125."""
    ckpt = tmp_path / "mla"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "transmla": {"kv_cache_ratio": 0.125}}))
    return ckpt


def _fake_recovery(monkeypatch, rec) -> None:
    """recovery.py's work stubbed: models load as nothing, every perplexity is 10, and each `transmla finetune`
    trains at 100 tokens/s (lm) or 50 (kd objectives: the teacher's forward besides), after a 30 s layer-wise
    phase where its flags ask for one."""
    def run_cli(args):
        tokens = int(args[args.index("--max-tokens") + 1])
        objective = args[args.index("--objective") + 1]
        speed = 100.0 if objective == "lm" else 50.0
        phase = {"epochs": 1.0, "lr": 1e-3, "seconds": 30.0, "layers": [{"val_err_before": 0.5, "val_err_after": 0.1}]}
        return {"objective": objective, "tokens_trained": tokens, "tokens_per_second": speed, "peak_rss_gib": 1.0,
                "val_loss_before": 5.0, "val_loss_after": 4.0, "val_kd_before": 1.0, "val_kd_after": 0.5,
                "train_loss": 4.0, "seconds_this_run": tokens / speed, "out": args[args.index("--out") + 1],
                **({"layerwise": phase} if "--layerwise-epochs" in args else {})}

    monkeypatch.setattr(rec, "run_cli", run_cli)
    monkeypatch.setattr(rec, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(rec, "load_texts", lambda *a, **k: [])
    monkeypatch.setattr(rec, "tokenize_corpus", lambda *a, **k: None)
    monkeypatch.setattr(rec, "use_causal_padded_sdpa", lambda m: m)
    monkeypatch.setattr(rec, "perplexity", lambda *a, **k: {"ppl": 10.0})


@pytest.mark.parametrize("phase", [False, True])
def test_recovery_equal_time_run_matches_kd_end_to_end_where_it_has_a_layerwise_phase(tmp_path, monkeypatch, phase):
    """kd's seconds hold its layer-wise phase: an lm_time run with a phase of its own got tokens for all of kd's
    seconds and ran its phase besides, about one phase longer than kd."""
    rec = _script("recovery")
    _fake_recovery(monkeypatch, rec)
    _main(rec, monkeypatch, "--model", "orig", "--checkpoint", str(_checkpoint(tmp_path)), "--runs", "lm,kd,lm_time",
          "--max-tokens", "1000", "--out", str(tmp_path / "r.json"), "--",
          *(["--layerwise-epochs", "1"] if phase else []))
    rows = {r["run"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["kd"]["seconds"] == 20 + 30 * phase
    # lm's 100 tokens/s for kd's 20 s end to end; where lm_time has a phase, its own 30 s fill kd's
    assert rows["lm_time"]["tokens_trained"] == 2000
    assert rows["lm_time"]["seconds"] == rows["kd"]["seconds"]


def test_recovery_refuses_a_run_order_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """`--runs lm_time,lm,kd` was refused after the original's perplexity and a conversion (minutes)."""
    rec = _script("recovery")
    _fake_recovery(monkeypatch, rec)
    common = ("--model", "orig", "--checkpoint", str(_checkpoint(tmp_path)), "--max-tokens", "1000",
              "--out", str(tmp_path / "r.json"))
    monkeypatch.setattr(rec, "load_model", _no_load)
    with pytest.raises(SystemExit) as e:
        _main(rec, monkeypatch, *common, "--runs", "lm_time,lm,kd")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "run lm_time needs the lm and kd runs first" in err, err
    monkeypatch.setattr(rec, "load_model", lambda *a, **k: (None, None))
    _main(rec, monkeypatch, *common, "--runs", "lm,kd")
    monkeypatch.setattr(rec, "load_model", _no_load)
    with pytest.raises(_Loaded):  # lm and kd are rows of the --out it resumes
        _main(rec, monkeypatch, *common, "--runs", "lm_time")
    with pytest.raises(SystemExit) as e:  # kd+lm is not
        _main(rec, monkeypatch, *common, "--runs", "lm_time_kd+lm")
    assert e.value.code == 2 and "needs the lm and kd+lm runs first" in capsys.readouterr().err


def test_recovery_refuses_a_checkpoint_converted_from_another_model(tmp_path, monkeypatch, capsys, tiny_llamas):
    """--checkpoint was never compared with --model: the runs distilled from a model the checkpoint never was."""
    from transmla.config import ConvertOptions
    from transmla.convert import convert

    a, b = tiny_llamas
    ckpt = tmp_path / "mla"
    convert(str(a), ckpt, ConvertOptions(kv_cache_ratio=0.5, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4),
            progress=False)
    assert json.loads((ckpt / "config.json").read_text())["transmla"]["source_content_hash"]
    rec = _script("recovery")
    monkeypatch.setattr(rec, "load_model", _no_load)
    argv = ("--checkpoint", str(ckpt), "--runs", "lm", "--out", str(tmp_path / "r.json"))
    with pytest.raises(SystemExit) as e:
        _main(rec, monkeypatch, "--model", str(b), *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "pass the --model it was converted from" in err, err
    for model in (str(a), f"dir:{a}"):  # the one it was converted from, however it is written
        with pytest.raises(_Loaded):
            _main(rec, monkeypatch, "--model", model, *argv)


def test_report_stem_keeps_catalog_names_and_makes_one_path_component_of_other_sources():
    stem = _script("_common").report_stem
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"):
        assert stem(name) == name
    for f in [*(REPO / "reports" / "ablation").glob("*.json"), *(REPO / "reports" / "recovery").glob("*.json")]:
        assert f.stem.startswith(stem(json.loads(f.read_text())["model"])), f  # the committed reports keep their names
    for source in ("/abs/models/tiny", "dir:/abs/models/tiny", "hf:Org/Name@main", "./tiny", ".", "..",
                   "gguf:/m/x.gguf"):
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", stem(source)), (source, stem(source))


@pytest.mark.parametrize("script, folder, suffix", [("ablation", "ablation", ".json"),
                                                    ("position_gap", "ablation", "-positions.json"),
                                                    ("recovery", "recovery", "-0.125.json")])
@pytest.mark.parametrize("model", ["/abs/models/tiny", "dir:/abs/models/tiny", "hf:Org/Name"])
def test_default_report_of_any_source_lies_in_the_reports_folder(monkeypatch, script, folder, suffix, model):
    """An absolute path dropped the reports folder (the report landed beside the model); `dir:` / `hf:` made
    nested folders named after the prefix."""
    mod = _script(script)
    seen = []

    def check_report_out(ap, out):
        seen.append(Path(out))
        raise _Loaded

    monkeypatch.setattr(mod, "check_report_out", check_report_out)
    monkeypatch.setattr(mod, "load_model", _no_load)
    with pytest.raises(_Loaded):
        _main(mod, monkeypatch, "--model", model)
    assert seen and seen[0].parent == REPO / "reports" / folder and seen[0].name.endswith(suffix), seen


@pytest.mark.parametrize("script", ["ablation", "position_gap", "recovery"])
def test_an_out_that_is_a_directory_is_refused_before_the_model_loads(tmp_path, script):
    """An --out directory failed with IsADirectoryError after the conversions and scoring."""
    (tmp_path / "r.json").mkdir()
    r = _run(script, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "r.json"))
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr[-2000:]
    (tmp_path / "s.md").mkdir()  # the table beside it
    r = _run(script, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "s.json"))
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr[-2000:]


def test_qwen3_qknorm_refuses_zero_steps_and_an_out_it_cannot_write(tmp_path):
    """--steps 0 divided by zero in the lr schedule; OUT.json a directory failed after training and conversions."""
    r = _run("qwen3_qknorm", "--steps", "0", "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and "--steps" in r.stderr, r.stderr[-2000:]
    (tmp_path / "q.json").mkdir()
    r = _run("qwen3_qknorm", "--steps", "1", "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "q.md").exists()


def test_layer_streamed_bench_keeps_its_folders_in_its_temp_dir_and_reports_a_tiny_model(tmp_path, monkeypatch,
                                                                                         tiny_llamas):
    """Folders named after the source: an absolute path put them outside the temp dir (a second run: 'exists and
    is not empty'); a float32 size that rounds to 0.000 GiB divided by zero after results.json, before README.md."""
    bench = _script("layer_streamed_bench")

    def run_convert(model, out, load, extra):
        assert out.parent.name.startswith("layer-streamed-"), out  # the run's own temp dir
        out.mkdir()
        return {"peak_rss_gib": 0.5, "conversion_peak_rss_gib": 0.4, "calibration_data_peak_rss_gib": 0.3,
                "wall_s": 2.0, "seconds": 1.5}

    monkeypatch.setattr(bench, "run_convert", run_convert)
    monkeypatch.setattr(bench, "max_logprob_diff", lambda a, b: 0.0)
    out = tmp_path / "report"
    assert _main(bench, monkeypatch, "--models", str(tiny_llamas[0]), str(tiny_llamas[1]), "--out", str(out)) == 0
    assert [r["float32_gib"] for r in json.loads((out / "results.json").read_text())] == [0.0, 0.0]
    assert f"| {tiny_llamas[1]} |" in (out / "README.md").read_text()


@pytest.mark.parametrize("script, argv", [
    ("ablation", ["--model", "{none}", "--out", "{tmp}/a.json"]),
    ("recovery", ["--model", "{none}", "--out", "{tmp}/r.json"]),
    ("position_gap", ["--model", "{none}", "--out", "{tmp}/p.json"]),
    ("ppl_by_position", ["{none}"]),
    ("decode_ab", ["--model", "{none}"]),
    ("bench_teacher_dtype", ["--model", "{none}"]),
    ("layer_streamed_bench", ["--models", "{none}", "--out", "{tmp}/ls"]),
    ("bench_loss", ["--student", "{tmp}/student", "--teacher", "{none}"])])
def test_a_bad_model_is_one_line_not_a_traceback(tmp_path, script, argv):
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "config.json").write_text("{}")
    r = _run(script, *[a.format(none=tmp_path / "none", tmp=tmp_path) for a in argv])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{script}.py: error: Model directory not found: {tmp_path / 'none'}" in r.stderr, r.stderr[-2000:]


def test_decode_ab_refuses_a_model_without_mla_in_one_line(tiny_llamas):
    r = _run("decode_ab", "--model", str(tiny_llamas[0]), "--context", "8", "--batch", "1", "--rounds", "1",
             "--steps", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "decode_ab.py: error: " in r.stderr, r.stderr[-2000:]

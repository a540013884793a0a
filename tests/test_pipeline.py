"""The pipeline layer on a tiny model: params validation, cache keys (same inputs -> cached, a
changed parameter -> exactly the dependent tasks recomputed), cross-process caching, the nightly
flow's skip logic and deployment, the end-to-end paper flow with its report and MLflow runs."""

from __future__ import annotations

import json
import zlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import tasks  # noqa: F401  (sets the Prefect defaults; conftest pointed the store at a temp dir)
from transmla.errors import TransMLAError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_dir(tmp_path, tiny_tokenizer, request):
    """A tiny random Llama with its own weights (seeded per test: its own cache keys)."""
    from conftest import _tiny_model

    seed = zlib.crc32(request.node.name.encode()) % 10_000
    d = tmp_path / "tiny-model"
    _tiny_model("llama", len(tiny_tokenizer), seed=seed).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def write_profile(tmp_path: Path, model_dir: Path, name: str = "tiny", **sections) -> Path:
    raw = {
        "models": {name: {"source": str(model_dir)}},
        "pipeline": {"models": [name], "budgets": [0.25], "methods": ["mha2mla", "transmla"]},
        "calibration": {"nsamples": 8, "seqlen": 64, "batch_size": 4},
        "evaluation": {"ppl_seqlen": 128, "ppl_max_tokens": 512, "tasks": ["arc_easy", "arc_challenge"], "limit": 2},
        "figures": {"ppl_max_tokens": 256, "rope_dims": [8, 4], "fig4a_rope_dim": 8, "fig5_budget": 0.25},
        "nightly": {"watch": [str(model_dir)], "budgets": [0.25], "methods": ["transmla"]},
        "finetune": {"budgets": [0.25], "methods": ["transmla"], "corpora": ["c4-demo", "wiki-demo"],
                     "max_documents": 20, "max_tokens": 6 * 4 * 64, "seqlen": 64, "batch_size": 4, "lr": 3e-3,
                     "warmup_ratio": 0.0, "val_tokens": 256, "eval_every": 3, "log_every": 1},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v}
    p = tmp_path / "profile.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


class Counter:
    """Counts the library calls behind each cached task: a call = the task really computed."""

    def __init__(self, monkeypatch):
        import tasks.bkv
        import tasks.calibrate
        import tasks.evaluate
        import tasks.rorope

        self.n = {}
        import tasks.finetune

        for mod, name, label in ((tasks.calibrate, "collect_stats", "stats"), (tasks.rorope, "rotation_step", "rotation"),
                                 (tasks.bkv, "basis_step", "basis"), (tasks.evaluate, "dataset_perplexity", "ppl"),
                                 (tasks.evaluate, "evaluate", "benchmarks"),
                                 (tasks.finetune, "finetune_on_corpora", "finetune")):
            monkeypatch.setattr(mod, name, self._wrap(getattr(mod, name), label))

    def _wrap(self, fn, label):
        def counted(*a, **k):
            self.n[label] = self.n.get(label, 0) + 1
            return fn(*a, **k)
        return counted

    def take(self) -> dict:
        out, self.n = self.n, {}
        return out


# ------------------------------------------------------------------ params

def test_profiles_validate():
    from flows.params import load_profile

    default = load_profile(REPO / "params" / "default.yaml")
    assert default.device == "cpu" and default.pipeline.models == ("smollm2-135m",)
    assert default.models["smollm2-135m"].source == "smollm2-135m"
    paper = load_profile(REPO / "params" / "paper.yaml")
    assert paper.evaluation.limit is None and paper.evaluation.ppl_max_tokens is None  # full data


@pytest.mark.parametrize("override, field", [
    ({"pipeline.budgets": [1.5]}, "pipeline.budgets"),
    ({"methods.transmla.freqfold": 3}, "methods.transmla.freqfold"),
    ({"evaluation.tasks": ["mmlu", "gsm8k"]}, "evaluation.tasks"),
    ({"pipeline.models": ["nope"]}, "pipeline"),
    ({"calibration.nsampels": 3}, "calibration.nsampels"),
    ({"finetune.budgets": [0.5]}, "finetune.budgets"),
    ({"finetune.mode": "lora"}, "finetune.mode"),
    ({"finetune.lr": 0}, "finetune.lr"),
])
def test_bad_params_name_the_field(override, field):
    from flows.params import load_profile

    with pytest.raises(TransMLAError) as e:
        load_profile(REPO / "params" / "default.yaml", override)
    assert field in str(e.value) and "Fix:" in str(e.value)


def test_a_cross_field_error_is_one_short_line():
    """A check across sections (or across options) names what disagrees, not a dump of the whole profile."""
    from flows.params import load_profile
    from transmla.config import ConvertOptions, options_error

    with pytest.raises(TransMLAError) as e:
        load_profile(overrides={"pipeline.models": ["foo"]})
    assert "['foo']" in str(e.value) and "-S" in e.value.fix and len(str(e.value)) < 300
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as v:
        ConvertOptions.model_validate({"lossless": True, "kv_cache_ratio": 0.5})
    err = options_error(v.value, "ConvertOptions")
    assert "lossless" in str(err) and "got" not in str(err) and len(str(err)) < 300


def test_missing_params_file(tmp_path):
    from flows.params import load_profile

    with pytest.raises(TransMLAError, match="not found"):
        load_profile(tmp_path / "nope.yaml")
    (tmp_path / "latin.yaml").write_bytes(b"device: cpu # caf\xe9\n")
    with pytest.raises(TransMLAError, match="not UTF-8"):
        load_profile(tmp_path / "latin.yaml")


def test_cli_bad_param_exits_2_and_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flows.convert", "--params", str(REPO / "params" / "default.yaml"),
                        "--model", "smollm2-135m", "--method", "transmla", "--budget", "0.125",
                        "-S", "methods.transmla.freqfold=3", "--out", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("transmla: error:") and "freqfold" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module, option", [("flows.convert", "--stats-file"), ("flows.evaluate", "--checkpoint")])
def test_cli_missing_input_is_one_line_before_the_run(tmp_path, module, option):
    """A named input that is not there: one line naming the option, exit 2, no flow run (no Prefect traceback)."""
    r = subprocess.run([sys.executable, "-m", module, "--model", "smollm2-135m", "--method", "transmla",
                        "--budget", "0.125", option, str(tmp_path / "nonexistent"), "--out", str(tmp_path / "out")],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"transmla: error: {option}")
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_a_stats_file_of_other_shapes_is_refused_before_the_conversion(tmp_path, tiny_dir, monkeypatch):
    """--stats-file was only checked to be a file: a weights file failed in the conversion with KeyError 'n',
    another model's statistics with fewer layers with an IndexError (tracebacks, exit 1). Now one error naming
    the shapes; the model's own statistics (flows.calibrate's file) convert as before."""
    from safetensors.torch import load_file, save_file

    from flows.calibrate import calibrate
    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    prof = load_profile(write_profile(tmp_path, tiny_dir))
    own = calibrate(prof, "tiny", out=str(tmp_path / "stats.safetensors"))["path"]
    t = load_file(own)
    save_file({k: v for k, v in t.items() if not k.startswith("layers.1.")}, tmp_path / "one-layer.safetensors")
    cases = [(tiny_dir / "model.safetensors", "not a calibration statistics file"),
             (tmp_path / "one-layer.safetensors", "statistics of 1 layers of width 64; the model has 2 layers of width 64"),
             (tiny_dir / "config.json", "not a safetensors file")]
    for path, words in cases:
        with pytest.raises(TransMLAError, match=words):
            convert(prof, "tiny", "transmla", 0.25, out=str(tmp_path / "out"), stats_file=str(path))
        assert not (tmp_path / "out").exists()
    assert convert(prof, "tiny", "transmla", 0.25, out=str(tmp_path / "out"), stats_file=own)["transmla"]


def test_impossible_budget_is_one_clear_error(tmp_path, tiny_dir, monkeypatch):
    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    prof = load_profile(write_profile(tmp_path, tiny_dir))
    with pytest.raises(TransMLAError, match="too few for any RoPE dim"):
        convert(prof, "tiny", "transmla", 0.01, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ cache keys

def test_task_key_is_content_addressed(tmp_path):
    from tasks.artifacts import file_ref, task_key

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"same"), b.write_bytes(b"same")
    k = task_key("t", "tasks.bkv", {"x": file_ref(a), "r": 4})
    assert k == task_key("t", "tasks.bkv", {"r": 4, "x": file_ref(b)})  # same content, other path
    assert k != task_key("t", "tasks.bkv", {"x": file_ref(a), "r": 5})
    assert k != task_key("t", "tasks.rorope", {"x": file_ref(a), "r": 4})  # other code
    b.write_bytes(b"other")
    assert k != task_key("t", "tasks.bkv", {"x": file_ref(b), "r": 4})


def test_convert_cache_keys(tmp_path, tiny_dir, monkeypatch):
    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    count = Counter(monkeypatch)
    prof = load_profile(write_profile(tmp_path, tiny_dir))

    def run(p, method="transmla", budget=0.25):
        out = tmp_path / "ckpt"
        shutil.rmtree(out, ignore_errors=True)
        return convert(p, "tiny", method, budget, out=str(out))

    first = run(prof)
    assert count.take() == {"stats": 1, "rotation": 2, "basis": 2}  # 2 layers
    # 0.25 of 64 values: B = 16, R = min(d/2, B/2) = 8, r = 8.
    assert (first["transmla"]["qk_rope_head_dim"], first["transmla"]["kv_lora_rank"]) == (8, 8)
    again = run(prof)
    assert count.take() == {}  # everything cached
    assert again["sha256"] == first["sha256"]  # and the export is byte-identical
    # Another rank at the same RoPE dim (0.3125 of 64 values: R=8, r=12): only the BKV bases.
    assert run(prof, budget=0.3125)["transmla"]["kv_lora_rank"] == 12
    assert count.take() == {"basis": 2}
    # FreqFold changes the rotations, hence the bases; the statistics stay.
    ff2 = load_profile(write_profile(tmp_path, tiny_dir), {"methods.transmla.freqfold": 2})
    run(ff2)
    assert count.take() == {"rotation": 2, "basis": 2}
    # MHA2MLA has no FreqFold: its steps do not depend on it.
    run(prof, method="mha2mla")
    assert count.take() == {"rotation": 2, "basis": 2}
    run(ff2, method="mha2mla")
    assert count.take() == {}
    # Calibration params change everything downstream.
    run(load_profile(write_profile(tmp_path, tiny_dir), {"calibration.seed": 7}))
    assert count.take() == {"stats": 1, "rotation": 2, "basis": 2}
    # The pipeline's own output (no --out) is replaced on a rerun, as dvc repro replaces it; a user's --out is not.
    default = [convert(prof, "tiny", "transmla", 0.25) for _ in range(2)]
    assert default[0]["path"] == default[1]["path"] and default[1]["sha256"] == first["sha256"]
    with pytest.raises(TransMLAError, match="not empty"):
        convert(prof, "tiny", "transmla", 0.25, out=default[0]["path"])


def test_one_off_runs_leave_the_pipelines_records_alone(tmp_path, tiny_dir, monkeypatch):
    """--out makes a one-off run: convert logged it into the pipeline's MLflow run (its metrics over the pipeline
    checkpoint's), finetune deleted and replaced the pipeline's run; --checkpoint alone (throughput, finetune)
    wrote another checkpoint's results over the pipeline's own report or model. A deleted experiment is refused
    before any work, with the fix that restores it (MLflow refused the run after the stage's work)."""
    import mlflow

    from flows import _cli
    from flows.convert import convert
    from flows.finetune import finetune
    from flows.params import load_profile
    from flows.throughput import throughput_flow

    monkeypatch.chdir(tmp_path)
    prof = load_profile(write_profile(tmp_path, tiny_dir, name="oneoffrun"))
    mine = str(tmp_path / "mine")
    convert(prof, "oneoffrun", "transmla", 0.25, out=mine)
    finetune(prof, "oneoffrun", "transmla", 0.25, checkpoint=mine, out=str(tmp_path / "mine-ft"))
    assert (tmp_path / "mine-ft/config.json").is_file() and not (tmp_path / "reports").exists()
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])  # no run here set it: another test's may linger
    runs = mlflow.search_runs(experiment_names=["transmla"], output_format="list",
                              filter_string="tags.`transmla.model` = 'oneoffrun'")
    assert runs == []
    for flow in (throughput_flow, finetune):
        with pytest.raises(TransMLAError, match="without --out: a one-off .*pass --out DIR"):
            flow(prof, "oneoffrun", "transmla", 0.25, checkpoint=mine)
    # not a conversion: refused before the original's runs (their end named a backend option the flow lacks)
    with pytest.raises(TransMLAError, match="is not an MLA checkpoint .*'llama'.*Fix: point --checkpoint at"):
        throughput_flow(prof, "oneoffrun", "transmla", 0.25, checkpoint=str(tiny_dir), out=str(tmp_path / "tp"))
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "reports").exists()
    client = mlflow.tracking.MlflowClient()
    client.delete_experiment(client.create_experiment("deleted-one"))
    with pytest.raises(TransMLAError, match="'deleted-one' .* is deleted.*Fix: restore it"):
        _cli.check_tracking("deleted-one")
    _cli.check_tracking("not-made-yet")  # an experiment that does not exist yet is made by the first run


def test_a_model_name_pointed_at_another_source_gets_a_new_tracking_run(tmp_path, tiny_dir, monkeypatch):
    """MLflow: the (model, method, budget) run of a conversion is replaced when the name's source changes (its
    params are write-once: the reused run kept the old source beside the new metrics)."""
    import mlflow

    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other-release"
    shutil.copytree(tiny_dir, other)
    for source in (tiny_dir, other):  # the pipeline's own conversion (a one-off --out logs nothing)
        prof = load_profile(write_profile(tmp_path, source, name="srcswap"))
        convert(prof, "srcswap", "transmla", 0.25)
    runs = mlflow.search_runs(experiment_names=["transmla"], output_format="list",
                              filter_string="tags.`transmla.model` = 'srcswap' and tags.`transmla.role` = 'variant'")
    assert len(runs) == 1 and runs[0].data.params["source"] == str(other)


def test_streamed_row_is_one_cached_task(tmp_path, tiny_dir, monkeypatch):
    """The recommended row (sequential calibration + refit): one cached task for all layers (no parallel
    statistics), a byte-identical export on the rerun, the mode in config.json, and the paper's row unchanged."""
    import tasks.stream
    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    count = Counter(monkeypatch)
    monkeypatch.setattr(tasks.stream, "convert_layers", count._wrap(tasks.stream.convert_layers, "streamed"))
    prof = load_profile(write_profile(tmp_path, tiny_dir, pipeline={"methods": ["transmla", "transmla-refit"]}))

    def run(method):
        out = tmp_path / method
        shutil.rmtree(out, ignore_errors=True)
        return convert(prof, "tiny", method, 0.25, out=str(out))

    first = run("transmla-refit")
    assert count.take() == {"streamed": 1}
    assert run("transmla-refit")["sha256"] == first["sha256"]
    assert count.take() == {}
    # the step builds float64 layers on the CPU from the plan and rank: the export's dtype is not one of its inputs
    # (keyed on every option, a bfloat16 export recomputed the whole stream); the calibration seed is
    for overrides, recomputed in (({"export.dtype": "bfloat16"}, {}), ({"calibration.seed": 7}, {"streamed": 1})):
        other = load_profile(write_profile(tmp_path, tiny_dir, pipeline={"methods": ["transmla", "transmla-refit"]}),
                             overrides)
        convert(other, "tiny", "transmla-refit", 0.25, out=str(tmp_path / f"other-{len(recomputed)}"))
        assert count.take() == recomputed, overrides
    rec = first["transmla"]
    assert (rec["options"]["calibration"], rec["options"]["refit"], rec["options"]["attention_aware"]) == (
        "sequential", True, True)
    report = json.loads((Path(first["path"]) / "transmla_report.json").read_text())
    assert all(d["refit_residual"] <= d["refit_residual_before"] for d in report["layers"])
    paper = run("transmla")["transmla"]["options"]
    assert (paper["calibration"], paper["refit"], paper["attention_aware"]) == ("parallel", False, False)
    assert count.take() == {"stats": 1, "rotation": 2, "basis": 2}


def test_a_mixed_calibration_set_runs_in_the_pipeline(tmp_path, tiny_dir, monkeypatch):
    """calibration.dataset may mix registry sets and path: parts, as the CLI's --cal-dataset does: the
    pipeline's statistics are the library's for that mix (an equal share of the windows per part), keyed
    on every part (an unchanged mix is cached; editing the path part's text recomputes)."""
    from safetensors.torch import load_file

    from flows.calibrate import calibrate
    from flows.params import load_profile
    from transmla.io.data import calibration_corpora
    from transmla.io.sources import load_model
    from transmla.method.calibration import collect_stats, mixed_calibration_ids

    monkeypatch.chdir(tmp_path)
    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("def inc(x):\n    return x + 1\n\n" * 300)
    mix = f"wikitext2-train+path:{code}"
    prof = load_profile(write_profile(tmp_path, tiny_dir, calibration={"dataset": mix}))
    count = Counter(monkeypatch)

    def run(out):
        return load_file(calibrate(prof, "tiny", out=str(tmp_path / out))["path"])

    first = run("s1.safetensors")
    assert count.take() == {"stats": 1}
    m, tok = load_model(str(tiny_dir))
    c = prof.calibration
    want = collect_stats(m, mixed_calibration_ids(tok, calibration_corpora(mix), c.nsamples, c.seqlen, c.seed),
                         c.batch_size).to_tensors()
    assert first.keys() == want.keys() and all(torch.equal(first[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(first.values(), run("s2.safetensors").values()))
    assert count.take() == {}
    (code / "a.py").write_text("class Box:\n    items = []\n\n" * 300)
    third = run("s3.safetensors")
    assert count.take() == {"stats": 1}
    assert not all(torch.equal(first[k], third[k]) for k in first)


def test_evaluation_cache_keys(tmp_path, tiny_dir, monkeypatch):
    from flows.evaluate import evaluate
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    count = Counter(monkeypatch)
    prof = load_profile(write_profile(tmp_path, tiny_dir))
    row = evaluate(prof, "tiny", "original")
    assert count.take() == {"ppl": 1, "benchmarks": 1}
    assert row["benchmark_n"] == {"arc_easy": 2, "arc_challenge": 2} and row["ppl"] > 1
    assert json.loads((tmp_path / "reports/metrics/tiny/original.json").read_text())["ppl"] == row["ppl"]
    evaluate(prof, "tiny", "original")
    assert count.take() == {}
    evaluate(load_profile(write_profile(tmp_path, tiny_dir), {"evaluation.limit": 3}), "tiny", "original")
    assert count.take() == {"benchmarks": 1}
    evaluate(load_profile(write_profile(tmp_path, tiny_dir), {"evaluation.ppl_max_tokens": 384}), "tiny", "original")
    assert count.take() == {"ppl": 1}


def test_a_one_off_evaluation_leaves_the_pipelines_row_alone(tmp_path, tiny_dir, monkeypatch):
    """An evaluation with --out (another sample here; another checkpoint, which needs --out) wrote its file and
    then replaced the pipeline's per-sample logs (a DVC out) and its MLflow metrics with the one-off's."""
    import mlflow

    from flows.evaluate import evaluate
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    prof = load_profile(write_profile(tmp_path, tiny_dir, "oneoff"))
    row = evaluate(prof, "oneoff", "original")
    logs = tmp_path / "artifacts/oneoff/original/eval"
    listing = sorted(p.relative_to(logs) for p in logs.rglob("*"))
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'oneoff' and tags.`transmla.method` = 'original'")
    assert len(runs) == 1 and runs["metrics.wikitext2_ppl"].iloc[0] == pytest.approx(row["ppl"])
    one_off = evaluate(load_profile(write_profile(tmp_path, tiny_dir, "oneoff"), {"evaluation.ppl_max_tokens": 384}), "oneoff",
                       "original", out=str(tmp_path / "one-off.json"))
    assert one_off["ppl"] != row["ppl"]
    assert json.loads((tmp_path / "one-off.json").read_text())["ppl"] == one_off["ppl"]
    assert json.loads((tmp_path / "reports/metrics/oneoff/original.json").read_text())["ppl"] == row["ppl"]
    assert sorted(p.relative_to(logs) for p in logs.rglob("*")) == listing
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'oneoff' and tags.`transmla.method` = 'original'")
    assert len(runs) == 1 and runs["metrics.wikitext2_ppl"].iloc[0] == pytest.approx(row["ppl"])
    with pytest.raises(TransMLAError, match="pass --out FILE"):
        evaluate(prof, "oneoff", "transmla", 0.25, checkpoint=str(tmp_path))
    with pytest.raises(TransMLAError, match="--checkpoint .* would be ignored"):  # scored the profile's model instead
        evaluate(prof, "oneoff", "original", checkpoint=str(tmp_path), out=str(tmp_path / "other.json"))
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize("method", ["transmla", "transmla-refit"])
def test_a_qk_norm_models_pipeline_conversion_records_the_cache_it_keeps(tmp_path, tiny_tokenizer, monkeypatch, method):
    """The parallel-calibration export (the paper's method, MHA2MLA) built its budget without a QK-norm model's
    cached key scales: the pipeline recorded a smaller KV cache and ratio than convert() and the model keep."""
    from test_architectures import CAL, _tiny_qwen3

    from flows.convert import convert
    from flows.params import load_profile
    from transmla.config import ConvertOptions
    from transmla.convert import convert as convert_direct

    monkeypatch.chdir(tmp_path)
    src = _tiny_qwen3(tmp_path, tiny_tokenizer)
    prof = load_profile(write_profile(tmp_path, src, pipeline={"methods": ["transmla", "transmla-refit"]}))
    rec = convert(prof, "tiny", method, 0.25, out=str(tmp_path / "ckpt"))["transmla"]
    direct = convert_direct(str(src), tmp_path / "direct", ConvertOptions(kv_cache_ratio=0.25, **CAL), progress=False)
    key = "kv_cache_values_per_token_per_layer"
    assert rec[key] == direct[key] and rec["kv_cache_ratio"] == direct["kv_cache_ratio"]
    assert rec[key]["mla"] == rec["kv_lora_rank"] + rec["qk_rope_head_dim"] + 2  # one key scale per KV head


def test_cache_hits_across_processes(tmp_path, tiny_dir):
    """Two separate processes (as two DVC stages): the second finds the first's results."""
    prof = write_profile(tmp_path, tiny_dir)
    cmd = [sys.executable, "-m", "flows.calibrate", "--params", str(prof), "--model", "tiny"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd + ["--out", str(tmp_path / "s1.safetensors")], cwd=tmp_path, env=env, check=True, capture_output=True)
    store = Path(os.environ["TRANSMLA_STORE"]) / "artifacts" / "calibration_stats"
    mtimes = {p: p.stat().st_mtime_ns for p in store.rglob("*.safetensors")}
    subprocess.run(cmd + ["--out", str(tmp_path / "s2.safetensors")], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*.safetensors")} == mtimes  # not recomputed
    assert (tmp_path / "s1.safetensors").read_bytes() == (tmp_path / "s2.safetensors").read_bytes()


def test_finetune_stage_cache_and_reeval(tmp_path, tiny_dir, monkeypatch):
    """finetune -> evaluate --finetuned: cached on (checkpoint, corpora, config); the row carries the
    tokens; the loss curves reach the DVC plots file and MLflow."""
    import mlflow
    from transformers import AutoModelForCausalLM

    from flows.convert import convert
    from flows.evaluate import evaluate
    from flows.finetune import finetune
    from flows.params import load_profile
    from transmla.io.sources import load_model

    monkeypatch.chdir(tmp_path)
    count = Counter(monkeypatch)
    prof = load_profile(write_profile(tmp_path, tiny_dir, name="ftp"))
    convert(prof, "ftp", "transmla", 0.25)
    with pytest.raises(TransMLAError, match="No fine-tuned checkpoint"):
        evaluate(prof, "ftp", "transmla", 0.25, finetuned=True)
    count.take()
    ref = finetune(prof, "ftp", "transmla", 0.25)
    assert count.take() == {"finetune": 1}
    summary = ref["finetune"]
    assert summary["tokens_trained"] == 6 * 4 * 64 and summary["val_loss_after"] < summary["val_loss_before"]
    ckpt = tmp_path / "artifacts/ftp/transmla-0.25-ft/model"
    assert type(AutoModelForCausalLM.from_pretrained(ckpt)).__name__ == "DeepseekV3ForCausalLM"
    curve = (tmp_path / "reports/plots/ftp/transmla-0.25-ft-loss.csv").read_text().splitlines()
    assert curve[0] == "step,train_loss,train_lm,val_loss,learning_rate" and len(curve) >= 7  # lm: no KD curves
    train = json.loads((tmp_path / "reports/metrics/ftp/transmla-0.25-ft.train.json").read_text())
    assert train["val_loss_after"] == summary["val_loss_after"]
    # Same inputs: cached (the DVC out is re-published from the store); a new lr trains again.
    shutil.rmtree(ckpt)
    assert finetune(prof, "ftp", "transmla", 0.25)["sha256"] == ref["sha256"] and ckpt.is_dir()
    assert count.take() == {}
    row = evaluate(prof, "ftp", "transmla", 0.25, finetuned=True)
    assert row["tokens_trained"] == 6 * 4 * 64 and row["finetuned"]
    assert json.loads((tmp_path / "reports/metrics/ftp/transmla-0.25-ft.json").read_text())["ppl"] == row["ppl"]
    assert count.take() == {"ppl": 1, "benchmarks": 1}
    shutil.rmtree(ckpt)
    finetune(load_profile(write_profile(tmp_path, tiny_dir, name="ftp"), {"finetune.lr": 1e-3}), "ftp", "transmla", 0.25)
    assert count.take() == {"finetune": 1}
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.finetuned` = 'true'",
                              output_format="list")
    run = next(r for r in runs if r.data.tags["transmla.model"] == "ftp")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # one point per logged step, nothing else
    # A new conversion under the same settings trains anew; its run holds its own curve, not the first one's.
    conv = tmp_path / "artifacts/ftp/transmla-0.25/model"
    model, tok = load_model(str(conv))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    shutil.rmtree(conv)
    model.save_pretrained(conv)
    tok.save_pretrained(conv)
    shutil.rmtree(ckpt)
    finetune(load_profile(write_profile(tmp_path, tiny_dir, name="ftp"), {"finetune.lr": 1e-3}), "ftp", "transmla", 0.25)
    assert count.take() == {"finetune": 1}
    curve = {int(r.split(",")[0]): r.split(",")[1]
             for r in (tmp_path / "reports/plots/ftp/transmla-0.25-ft-loss.csv").read_text().splitlines()[1:]}
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.finetuned` = 'true'",
                              output_format="list")
    run = next(r for r in runs if r.data.tags["transmla.model"] == "ftp")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "train_loss")
    assert {m.step: m.value for m in history} == {k: pytest.approx(float(v)) for k, v in curve.items() if v}


def test_finetune_stage_distils_from_the_original(tmp_path, tiny_dir, monkeypatch):
    """objective: kd -> the teacher is the profile's original model (its ref in the cache key), the
    validation KL and the KD curve reach the plots file, MLflow and Table 1's row ("(kd)")."""
    import mlflow

    from flows.convert import convert
    from flows.evaluate import evaluate
    from flows.finetune import finetune
    from flows.params import load_profile

    import torch

    from transmla.io.sources import load_model

    monkeypatch.chdir(tmp_path)
    # A random model predicts nearly uniformly (KL ~1e-3, below Adam's noise): peak it (head x 30).
    sharp, tok = load_model(str(tiny_dir))
    sharp.config.tie_word_embeddings = False
    sharp.lm_head.weight = torch.nn.Parameter(sharp.lm_head.weight.detach().clone() * 30)
    sharp.save_pretrained(tmp_path / "sharp")
    tok.save_pretrained(tmp_path / "sharp")
    count = Counter(monkeypatch)
    prof = load_profile(write_profile(tmp_path, tmp_path / "sharp", name="kdp"),
                        {"finetune.objective": "kd", "finetune.lr": 3e-4, "finetune.kd_temperature": 2.0})
    convert(prof, "kdp", "transmla", 0.25)
    count.take()
    ref = finetune(prof, "kdp", "transmla", 0.25)
    assert count.take() == {"finetune": 1}
    summary = ref["finetune"]
    assert summary["objective"] == "kd" and summary["val_kd_after"] < summary["val_kd_before"]
    curve = (tmp_path / "reports/plots/kdp/transmla-0.25-ft-loss.csv").read_text().splitlines()
    assert curve[0] == "step,train_loss,train_lm,train_kd,val_loss,val_kd,learning_rate"
    row = evaluate(prof, "kdp", "transmla", 0.25, finetuned=True)
    assert row["objective"] == "kd" and row["tokens_trained"] == 6 * 4 * 64
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.finetuned` = 'true'",
                              output_format="list")
    run = next(r for r in runs if r.data.tags["transmla.model"] == "kdp" and "train_kd" in r.data.metrics)
    assert len(mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "train_kd")) == 6


def test_throughput_stage(tmp_path, tiny_dir, monkeypatch):
    """Original vs converted in one run: table, Fig. 6, KV capacity, MLflow curves; cached on re-run;
    the vLLM check records why it was skipped when its environment is absent."""
    import mlflow

    import tasks.throughput
    from flows.convert import convert
    from flows.params import load_profile
    from flows.throughput import throughput_flow
    from torch._dynamo.utils import counters

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRANSMLA_VLLM_VENV", str(tmp_path / "no-vllm"))
    calls = []
    real = tasks.throughput.decode_step
    monkeypatch.setattr(tasks.throughput, "decode_step", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    from transmla.runtime import absorb, packed

    packable = bool(packed.kernels())
    prof = load_profile(write_profile(tmp_path, tiny_dir, name="tput"),
                        {"throughput": {"budgets": [0.25], "contexts": [16, 32], "batch": 2, "steps": 2,
                                        "full_contexts": [8], "repeats": 2}})
    convert(prof, "tput", "transmla", 0.25)
    torch._dynamo.reset()
    counters.clear()
    result = throughput_flow(prof, "tput", "transmla", 0.25)
    # the compiled run steps natively where its model and kernel allow (runtime.native_decode), else as the graph:
    # then one compiled graph for every context and repeat of the absorbed run (absorbing the shared model
    # anew per run made new matrices, and so a recompile, for each of them)
    (loop,) = {r["decode_loop"] for r in result["decode"] if r["compiled"]}
    assert counters["stats"]["unique_graphs"] == (1 if loop == "compiled" else 0)
    # every cell measured `repeats` times; the original also in its best stock form (StaticCache)
    assert sorted(calls) == sorted((b, c) for c in (16, 32) for b in ("hf", "static", "hf", "absorb") * 2)
    assert {(r["run"], r["context"]) for r in result["decode"]} == {
        (run, c) for run in ("original", "original static", "converted hf", "converted absorb") for c in (16, 32)}
    for r in result["decode"]:
        lo, hi = r["time_per_output_token_range_ms"]
        assert r["repeats"] == 2 and lo <= r["time_per_output_token_ms"] <= hi
        assert r["x_of_bound"] == pytest.approx(r["time_per_output_token_ms"] / r["bound_ms"])
        assert r["compute_floor_ms"] == pytest.approx(r["linear_floor_ms"] + r["attention_floor_ms"])
        assert r["x_of_roofline"] == pytest.approx(r["time_per_output_token_ms"]
                                                   / max(r["bound_ms"], r["compute_floor_ms"]))
        assert r["bandwidth_bytes_per_s"] == result["bandwidth"]["bytes_per_s"] > 0
        # the same time against the bound at the lowest and the highest bandwidth read in the run
        assert r["x_of_bound_range"][0] <= r["x_of_bound"] <= r["x_of_bound_range"][1]
        assert r["bandwidth_before_bytes_per_s"] in result["bandwidth"]["readings_bytes_per_s"]
        # the best forms: original static on packed weights, converted absorb compiled (inductor packs its
        # weights itself); the stock defaults neither
        assert r["packed_weights"] is (packable and r["run"] == "original static")
        assert r["compiled"] is (r["run"] == "converted absorb")
        # the prepacked GEMM kernel, chosen once by measurement, recorded for the packed and compiled runs
        assert (r["gemm"] in packed.KERNELS) is (r["packed_weights"] or r["compiled"])
        # the absorbed run records its single-token attention kernel ("auto" resolved)
        assert r["decode_attention"] == (absorb.decode_kernel(torch.device("cpu")) if r["run"] == "converted absorb" else None)
    # the bandwidth read before the runs, before each of the 8 steady-decode cells and after them; the median
    bw = result["bandwidth"]
    assert bw["readings"] == len(bw["readings_bytes_per_s"]) == 1 + 8 + 1
    assert bw["range_bytes_per_s"][0] <= bw["bytes_per_s"] <= bw["range_bytes_per_s"][1]
    mid = sorted(bw["readings_bytes_per_s"])[4:6]  # 10 readings: the mean of the middle two
    assert bw["bytes_per_s"] == pytest.approx(sum(mid) / 2, rel=1e-12)
    # the matmul peak read with it; the floors divide by its median
    peak = result["compute"]
    mid = sorted(peak["readings_flops_per_s"])[4:6]
    assert peak["readings"] == 10 and peak["flops_per_s"] == pytest.approx(sum(mid) / 2, rel=1e-12)
    for r in result["decode"]:
        assert r["flops_per_s"] == peak["flops_per_s"] and r["flops_before_per_s"] in peak["readings_flops_per_s"]
        hi, lo = r["compute_floor_range_ms"]  # the floor at the lowest peak is the highest
        assert lo <= r["compute_floor_ms"] <= hi
    assert [r["run"] for r in result["full"]] == ["original", "converted hf", "converted absorb"]
    # 2 layers: original 2 x 2 KV heads x 16 dims, converted 12 + 4 latent values, float32
    assert result["kv"]["original"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert result["kv"]["converted absorb"]["bytes_per_token"] == 2 * 16 * 4
    assert result["kv"]["converted absorb"]["capacity_ratio"] == pytest.approx(4.0)
    assert all(r["kv_bytes_per_token_measured"] == r["kv_bytes_per_token"] for r in result["decode"])
    assert result["vllm"]["status"] == "skipped" and "transmla.runtime.vllm_env" in result["vllm"]["reason"]
    out = tmp_path / "reports/throughput/tput/transmla-0.25"
    md = (out / "throughput.md").read_text()
    assert "| 32 |" in md and "speedup converted absorb" in md and "vLLM serving check: **skipped**" in md
    assert "x bound)" in md and "GB/s" in md and "original static" in md and "10 readings" in md
    assert "| compute floor ms (linears + attention) |" in md and "GFLOP/s" in md
    assert ("original static: every linear layer" in md) is packable
    if packable:  # the text says what the chosen kernel does: stream reads the stock weights, the others pack
        chosen = {r["gemm"] for r in result["decode"] if r["gemm"]}
        assert len(chosen) == 1 and ("through the stream kernel" in md) is ("stream" in chosen)
        assert ("on weights prepacked once" in md) is ("stream" not in chosen)
    assert all(r["decode_loop"] is None for r in result["decode"] if not r["compiled"])
    assert loop in ("native", "compiled") and (loop == "native") <= ({r["gemm"] for r in result["decode"] if r["gemm"]} == {"tiled"})
    assert ("converted absorb: each step one native call" in md) is (loop == "native")
    assert ("converted absorb: each step one torch.compile graph" in md and "compiling took" in md) is (loop == "compiled")
    assert ("GEMM kernel chosen by measurement" in md) is packable and result["bandwidth"]["processor"] in md
    assert "single-token attention over the latent: " in md
    # on CPU every run's weights, the preallocated caches and the bandwidth copy in 2 MB pages, where the kernel has them
    from transmla.runtime import hugepages

    thp = hugepages.supported()
    assert set(result["hugepages"]) == {"original", "converted"}
    for report in result["hugepages"].values():
        assert (report["moved"] > 0) is thp and (report["reason"] is None) is thp
    for r in result["decode"]:
        assert r["cache_hugepages"] is (thp and r["run"] in ("original static", "converted absorb"))
    assert result["bandwidth"]["hugepages"] is thp
    assert ("Memory pages: every run's weights in 2 MB pages" in md) is thp
    assert (out / "fig6_speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "results.json").read_text())["kv"] == result["kv"]
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'tput'",
                              output_format="list")
    run = next(r for r in runs if r.data.tags.get("throughput.vllm") == "skipped")
    hist = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "throughput.speedup.converted_absorb")
    assert sorted(m.step for m in hist) == [16, 32]
    calls.clear()
    throughput_flow(prof, "tput", "transmla", 0.25)
    assert calls == []  # cached: same models, params and code
    import flows.throughput

    # the same store on another machine (a copied cache, a DVC remote): measured again, not reported as its own
    monkeypatch.setattr(flows.throughput, "processor_name", lambda device: "another machine, 64 cores")
    throughput_flow(prof, "tput", "transmla", 0.25)
    assert calls, "timings cached on another machine were reported as this one's"
    # the new measurement's curves in MLflow, not the first one's kept (a curve is logged once per run): the
    # measurement is a run of its own under the conversion's run, replaced; the conversion's run keeps its params
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'tput'",
                              output_format="list")
    (measured,) = [r for r in runs if r.data.tags["transmla.role"] == "throughput"]
    (variant,) = [r for r in runs if r.data.tags["transmla.role"] == "variant"]
    assert measured.info.run_id != run.info.run_id and measured.data.tags["mlflow.parentRunId"] == variant.info.run_id
    assert variant.data.params["kv_lora_rank"] and "throughput.vllm" not in variant.data.tags
    hist = mlflow.tracking.MlflowClient().get_metric_history(measured.info.run_id, "throughput.speedup.converted_absorb")
    assert sorted(m.step for m in hist) == [16, 32]


def test_throughput_stage_vllm_sweep(tmp_path, tiny_dir, monkeypatch):
    """With a vLLM environment (stubbed here: CI has none), the stage also runs vLLM's throughput sweep
    on the original and on the converted model padded to vLLM's MLA sizes."""
    import flows.throughput
    import transmla.runtime.vllm_env
    from flows.convert import convert
    from flows.params import load_profile

    monkeypatch.chdir(tmp_path)
    served = []

    def fake_run_vllm(request, **kw):
        served.append((Path(request["model"]).name, request["input_len"], request["output_len"]))
        if Path(request["model"], "config.json").read_text().count('"deepseek_v3"'):
            cfg = json.loads(Path(request["model"], "config.json").read_text())
            assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
        return {"num_prompts": request["num_prompts"], "output_tokens_per_s": 1.0, "total_tokens_per_s": 2.0}

    monkeypatch.setattr(transmla.runtime.vllm_env, "run_vllm", fake_run_vllm)
    monkeypatch.setattr(flows.throughput, "serving_check", lambda *a: {"status": "passed", "details": []})
    prof = load_profile(write_profile(tmp_path, tiny_dir, name="tputv"),
                        {"throughput": {"budgets": [0.25], "contexts": [16], "batch": 2, "steps": 1, "full_contexts": [],
                                        "vllm_contexts": [16, 32], "vllm_requests": 3}})
    convert(prof, "tputv", "transmla", 0.25)
    result = flows.throughput.throughput_flow(prof, "tputv", "transmla", 0.25)
    assert [(r["run"], r["context"]) for r in result["vllm_throughput"]] == [
        ("vllm original", 16), ("vllm converted (padded)", 16), ("vllm original", 32), ("vllm converted (padded)", 32)]
    assert [s[1:] for s in served] == [(8, 8), (8, 8), (16, 16), (16, 16)]
    md = (tmp_path / "reports/throughput/tputv/transmla-0.25/throughput.md").read_text()
    assert "vLLM offline throughput" in md and "| 32 | vllm converted (padded) | 3 |" in md
    served.clear()
    flows.throughput.throughput_flow(prof, "tputv", "transmla", 0.25)
    assert served == [], "cached"
    # another vLLM environment (the cuda variant, another pin) measures again: its numbers are not the cpu env's
    monkeypatch.setattr(transmla.runtime.vllm_env, "environment", lambda *a: {"variant": "cuda", "packages": ["vllm==9"]})
    flows.throughput.throughput_flow(prof, "tputv", "transmla", 0.25)
    assert len(served) == 4


# ------------------------------------------------------------------ nightly

def test_nightly_skips_unchanged_releases(tmp_path, tiny_dir, tiny_tokenizer, monkeypatch):
    from conftest import _tiny_model

    from flows.nightly import nightly

    monkeypatch.chdir(tmp_path)
    prof = str(write_profile(tmp_path, tiny_dir))
    first = nightly(prof)
    assert [r["status"] for r in first] == ["converted"]
    assert Path(first[0]["checkpoint"], "config.json").is_file()
    assert [r["status"] for r in nightly(prof)] == ["skipped"]
    report = (tmp_path / "reports/nightly.md").read_text()  # the profile's protocol, not WikiText-2 and limit alone
    assert "Perplexity: WikiText-2 test (first 512 tokens, 128-token windows); average of the benchmarks, % " \
           "(arc_easy 2, arc_challenge 2 documents; the original on the same documents as the converted model)" in report
    # Other options (a night under another calibration seed), then back: each night's checkpoint is its own, so the
    # skipped night still points at weights its options made (one folder per release and variant replaced them)
    weights = Path(first[0]["checkpoint"], "model.safetensors").read_bytes()
    other = nightly(prof, {"calibration.seed": 7})
    assert [r["status"] for r in other] == ["converted"] and other[0]["checkpoint"] != first[0]["checkpoint"]
    back = nightly(prof)
    assert [r["status"] for r in back] == ["skipped"] and back[0]["checkpoint"] == first[0]["checkpoint"]
    assert Path(back[0]["checkpoint"], "model.safetensors").read_bytes() == weights
    # a checkpoint removed by hand (pruning artifacts/nightly): its ledger entry no longer skips onto nothing
    shutil.rmtree(Path(other[0]["checkpoint"]).parent)
    again = nightly(prof, {"calibration.seed": 7})
    assert [r["status"] for r in again] == ["converted"] and Path(again[0]["checkpoint"], "config.json").is_file()
    # A new release under the same source (new weights): converted again.
    _tiny_model("llama", len(tiny_tokenizer), seed=12345).save_pretrained(tiny_dir)
    third = nightly(prof)
    assert [r["status"] for r in third] == ["converted"] and third[0]["release_id"] != first[0]["release_id"]
    assert first[0]["release_id"].startswith("sha256:")  # a local directory's release id: its content hash


def test_nightly_refuses_a_report_path_it_cannot_write_before_any_work(tmp_path, tiny_dir, monkeypatch):
    from flows.nightly import nightly

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TransMLAError, match="nightly.report"):
        nightly(str(write_profile(tmp_path, tiny_dir)), {"nightly.report": str(tmp_path / "afile" / "n.md")})
    assert not (tmp_path / "artifacts").exists()  # nothing fetched nor converted


def test_nightly_deployment_schedule_matches_params():
    from flows.nightly import deployment
    from flows.params import load_profile

    cron = load_profile(REPO / "params" / "default.yaml").nightly.cron
    dep = deployment(str(REPO / "params" / "default.yaml"))
    assert [s.schedule.cron for s in dep.schedules] == [cron]
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (nd,) = [d for d in spec["deployments"] if d["name"] == "nightly"]
    assert nd["schedules"][0]["cron"] == cron
    module, fn = nd["entrypoint"].split(":")
    assert (REPO / module).is_file() and fn == "nightly"


# ------------------------------------------------------------------ end to end

def test_paper_flow_end_to_end(tmp_path, tiny_dir, monkeypatch):
    """Every stage on the tiny model: checkpoints, metrics, figures, Table 1 and MLflow runs."""
    import mlflow

    from flows.paper import paper
    from flows.params import load_profile

    import flows.paper
    from flows import layout

    monkeypatch.chdir(tmp_path)
    # its own MLflow runs; appendix F's runs stubbed (tested in test_throughput_stage), on the converted rows
    prof = load_profile(write_profile(tmp_path, tiny_dir, name="e2e", throughput={"budgets": [0.25]}))
    timed = []
    monkeypatch.setattr(flows.paper, "throughput_flow", lambda _p, *variant: timed.append(
        (variant, (layout.checkpoint_dir(*variant) / "config.json").is_file())))
    text = paper(prof)
    assert timed == [(("e2e", "transmla", 0.25), True)]
    assert (tmp_path / "reports/table1.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| e2e |")]
    assert [r.split("|")[2].strip() for r in rows] == ["Original", "MHA2MLA", "TransMLA", "TransMLA"]
    assert [r.split("|")[-3].strip() for r in rows] == ["0", "0", "0", f"{6 * 4 * 64:,} (lm)"]  # Tokens (objective)
    # the paper's Table 6: every evaluated row's continuations of the four case-study prompts
    cs = (tmp_path / "reports/case_study.md").read_text().splitlines()
    assert "`The capital of France is`" in cs[next(i for i, x in enumerate(cs) if x == "## e2e") + 2]
    assert [x.split("|")[1].strip().split(",")[0] for x in cs if x.startswith("| Original") or x.startswith("| MHA2MLA")
            or x.startswith("| TransMLA")] == ["Original", "MHA2MLA", "TransMLA", "TransMLA"]
    assert sum("fine-tuned" in x for x in cs) == 1
    for f in ("fig4a_key_norms", "fig4b_rope_removal", "fig5_bkv"):
        assert (tmp_path / f"reports/figures/e2e/{f}.png").read_bytes()[:4] == b"\x89PNG"
    fig = json.loads((tmp_path / "reports/metrics/e2e/figures.json").read_text())
    assert set(fig["fig4b"]["curves"]) == {"MHA2MLA (2-norm)", "RoRoPE", "RoRoPE + FreqFold 4"}
    assert set(fig["fig5"]["ppl"]) == {"weights", "weights + BKV", "activations", "activations + BKV"}
    # a one-off figures run into its own folder (cached points) writes its record there, not over the pipeline's
    from flows.figures import figures

    record = (tmp_path / "reports/metrics/e2e/figures.json").read_bytes()
    one_off = figures(load_profile(write_profile(tmp_path, tiny_dir, name="e2e", figures={"fig5_budget": 0.5})),
                      "e2e", out_dir=str(tmp_path / "one-off"))
    assert (tmp_path / "reports/metrics/e2e/figures.json").read_bytes() == record
    assert json.loads((tmp_path / "one-off/figures.json").read_text()) == one_off and one_off["fig5"]["budget"] == 0.5
    # MLflow: one run per (model, method, budget), nested under the model's pipeline run.
    runs = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'e2e'",
                              output_format="list")
    variants = [r for r in runs if r.data.tags["transmla.role"] == "variant"]
    keys = sorted((r.data.tags["transmla.method"], r.data.tags["transmla.budget"], r.data.tags["transmla.finetuned"])
                  for r in variants)
    assert keys == [("mha2mla", "0.25", "false"), ("original", "none", "false"), ("transmla", "0.25", "false"),
                    ("transmla", "0.25", "true")]
    (parent,) = [r for r in runs if r.data.tags["transmla.role"] == "pipeline"]
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in variants)
    tm = next(r for r in variants if r.data.tags["transmla.method"] == "transmla" and r.data.tags["transmla.finetuned"] == "false")
    ft = next(r for r in variants if r.data.tags["transmla.finetuned"] == "true")
    assert ft.data.metrics["tokens_trained"] == 6 * 4 * 64 and ft.data.metrics["wikitext2_ppl"] > 1
    assert ft.data.metrics["val_loss_after"] < ft.data.metrics["val_loss_before"]
    assert tm.data.metrics["kv_cache_reduction"] == pytest.approx(0.75) and tm.data.metrics["wikitext2_ppl"] > 1
    assert tm.data.params["freqfold"] == "4"
    # Running it again recomputes nothing and leaves one run per variant.
    paper(prof)
    runs2 = mlflow.search_runs(experiment_names=["transmla"], filter_string="tags.`transmla.model` = 'e2e'",
                               output_format="list")
    assert len(runs2) == len(runs)

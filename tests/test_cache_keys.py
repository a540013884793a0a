"""Cache keys cannot go stale: a task's code key is the import closure of its module, computed.

For every cached task: changing any module in its closure changes its key; changing a module
outside it does not. The closure is computed from the source (tasks.codehash), so these tests pin
the properties, not a list.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import tasks  # noqa: F401  (Prefect defaults; conftest points the store at a temp dir)
from tasks import codehash

REPO = Path(__file__).resolve().parent.parent
TASK_MODULES = ("tasks.calibrate", "tasks.rorope", "tasks.bkv", "tasks.evaluate", "tasks.sweep", "tasks.finetune",
                "tasks.throughput")


def _cached_tasks():
    import importlib

    out = []
    for mod in TASK_MODULES:
        m = importlib.import_module(mod)
        out += [(mod, name, obj) for name, obj in vars(m).items() if hasattr(obj, "key_of") and obj.__module__ == mod]
    return out


def _key(t):
    params = {p: 1 for p in inspect.signature(t.fn).parameters}
    return t.key_of(params)


def test_every_task_module_has_cached_tasks():
    found = {mod for mod, _, _ in _cached_tasks()}
    assert found == set(TASK_MODULES)


@pytest.mark.parametrize("mod, name, t", _cached_tasks(), ids=lambda x: x if isinstance(x, str) else "")
def test_key_covers_exactly_the_closure(mod, name, t, monkeypatch):
    files, _ = codehash.closure(mod)
    base = _key(t)
    every = sorted(str(p.relative_to(REPO)) for top in codehash.PROJECT for p in (REPO / top).rglob("*.py"))
    real = codehash.file_digest
    for f in every:
        monkeypatch.setattr(codehash, "file_digest", lambda rel, f=f: "edited" if rel == f else real(rel))
        changed = _key(t) != base
        assert changed == (f in files), f"{name}: editing {f} {'changes' if changed else 'keeps'} its key"
    monkeypatch.setattr(codehash, "file_digest", real)


def test_closures_are_what_the_tasks_run():
    """Spot checks of the computed closures (the modules each step really imports)."""
    rot, _ = codehash.closure("tasks.rorope")
    assert {"transmla/method/rorope.py", "transmla/method/mha2mla.py", "transmla/method/linalg.py",
            "transmla/pipeline/rotation.py", "transmla/config.py", "tasks/artifacts.py"} <= set(rot)
    assert "transmla/runtime/throughput.py" not in rot and "transmla/method/bkv.py" not in rot
    basis, _ = codehash.closure("tasks.bkv")
    assert "transmla/method/bkv.py" in basis and "transmla/pipeline/basis.py" in basis
    ev, ext = codehash.closure("tasks.evaluate")
    assert "transmla/runtime/fast_attention.py" in ev and "transmla/io/data.py" in ev and "lm_eval" in ext
    assert not any(f.startswith("transmla/pipeline/") for f in ev)  # conversion code never re-keys evaluation
    ft, _ = codehash.closure("tasks.finetune")
    assert "transmla/method/mla.py" in ft  # norm_identity_scale


def test_the_libraries_the_library_needs_are_in_the_key(monkeypatch):
    """tokenizers produces every token id but no project module imports it: it enters the key as a requirement
    of transformers, which the library imports, and a new version of it changes the key; Prefect's own
    requirements (orchestration: no numerics) do not."""
    import importlib.metadata as md

    key = codehash.code_key("tasks.calibrate")
    assert "tokenizers" not in codehash.closure("tasks.calibrate")[1]
    assert "tokenizers" in key["packages"] and "transformers" in key["packages"] and "prefect" in key["packages"]
    library = codehash.package_versions(codehash._closure("tasks.calibrate")[2])
    assert "prefect" not in library  # imported by tasks/ only
    prefect_only = set(codehash.requirements("prefect")) - {r for d in library for r in codehash.requirements(d)}
    assert prefect_only and not prefect_only & set(key["packages"])
    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "99.0" if d == "tokenizers" else real(d))
    assert codehash.code_key("tasks.calibrate")["packages"]["tokenizers"] == "99.0"


def test_an_extra_the_project_installs_for_a_library_is_in_the_key(monkeypatch):
    """transformers' Trainer and lm-eval's HF model run accelerate (an extra of both, required by this project), which
    neither the project's modules nor the libraries' plain requirements name: an upgrade of it reused the cached
    fine-tunes and benchmark scores. mlflow (the project's, no library's extra) stays out."""
    import importlib.metadata as md

    for task in ("tasks.finetune", "tasks.evaluate"):
        assert "accelerate" in codehash.code_key(task)["packages"], task
        assert "mlflow" not in codehash.code_key(task)["packages"]
    real = md.version
    monkeypatch.setattr(md, "version", lambda d: "99.0" if d == "accelerate" else real(d))
    assert codehash.code_key("tasks.finetune")["packages"]["accelerate"] == "99.0"


def test_native_sources_are_in_the_closure_and_the_key(monkeypatch):
    """The C++ a module compiles (its NATIVE_SOURCES) is code the step runs: in the closure of every task
    that can reach it, and a change to it changes the key."""
    files, _ = codehash.closure("tasks.throughput")
    assert {"transmla/runtime/cpu_kernels.py", "transmla/runtime/csrc/stream_linear.cpp",
            "transmla/runtime/csrc/latent_decode.cpp"} <= set(files)
    assert "transmla/runtime/csrc/stream_linear.cpp" not in codehash.closure("tasks.rorope")[0]
    key = codehash.code_key("tasks.throughput")
    real = codehash.file_digest
    monkeypatch.setattr(codehash, "file_digest", lambda f: "edited" if f.endswith(".cpp") else real(f))
    assert codehash.code_key("tasks.throughput") != key


def test_key_covers_package_versions(monkeypatch):
    from tasks.evaluate import benchmarks
    from tasks.rorope import layer_rotation

    b, r = _key(benchmarks), _key(layer_rotation)
    real = codehash.package_versions
    monkeypatch.setattr(codehash, "package_versions",
                        lambda names: {**real(names), **({"lm_eval": "9.9"} if "lm_eval" in names else {})})
    assert _key(benchmarks) != b  # a new lm-eval (its task YAMLs are the prompts) re-runs the benchmarks
    assert _key(layer_rotation) == r  # ... and nothing that does not import it
    assert "torch" in codehash.package_versions(["torch"])


def test_key_covers_the_tokenizer(tmp_path):
    from tasks.artifacts import model_ref, task_key

    (tmp_path / "tokenizer.json").write_text("{}")
    a = model_ref(tmp_path, "abc")
    (tmp_path / "tokenizer.json").write_text('{"x": 1}')
    b = model_ref(tmp_path, "abc")
    assert a["sha256"] == b["sha256"]  # same weights ...
    assert task_key("t", "tasks.rorope", {"m": a}) != task_key("t", "tasks.rorope", {"m": b})  # ... other tokenizer


def test_relative_and_function_level_imports_are_followed(tmp_path):
    files, _ = codehash.closure("tasks.evaluate")
    src = (REPO / "tasks" / "evaluate.py").read_text()
    lazy = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom) and n.col_offset > 0]
    assert lazy and "transmla/io/sources.py" in files  # imported inside perplexity()
    assert "tasks/model.py" in files  # `from .model import ...`


def test_project_code_never_imports_the_lazy_api():
    """transmla/__init__ resolves its names lazily, which a closure cannot follow: project code
    imports from the defining module (checked over every module)."""
    for top in codehash.PROJECT:
        for p in (REPO / top).rglob("*.py"):
            name = ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            codehash.imports_of(name)  # raises ImportProblem on `from transmla import X`


def test_dvc_stage_deps_are_the_flow_closures():
    """dvc.yaml's code deps of each stage are exactly the closure of the flow module it runs."""
    import yaml

    from flows import dag

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        body = stage.get("do", stage)
        code = sorted(d for d in body["deps"] if d.split("/")[0] in codehash.PROJECT)
        assert code == dag.code_deps(name), f"stage {name}: run `python -m flows.dag` to regenerate dvc.yaml deps"
        data = [d for d in body["deps"] if d.startswith(dag.DATA + "/")]
        assert data == dag.data_deps(name), f"stage {name}: run `python -m flows.dag` to regenerate dvc.yaml deps"


def test_dvc_stage_data_deps_follow_the_params(tmp_path):
    """A data set named in the params is a dep of exactly the stages that read it: the calibration set
    (with a path: part) of calibrate, and of convert only while a pipeline method streams it; the
    corpora of finetune; the perplexity set and each chosen benchmark's files of the evaluations."""
    from flows import dag
    from flows.params import load_profile

    own = load_profile(overrides={"calibration.dataset": "c4-demo+path:src/code", "finetune.corpora": ["wiki-demo"],
                                  "evaluation.tasks": ["mmlu", "piqa"], "evaluation.ppl_dataset": "wiki-demo"})
    assert dag.data_deps("calibrate", own) == ["${data}/corpus/c4_demo.jsonl", "src/code"]
    assert dag.data_deps("convert", own) == dag.data_deps("calibrate", own)  # transmla-refit streams
    unstreamed = own.model_copy(update={"pipeline": own.pipeline.model_copy(update={"methods": ("mha2mla", "transmla")})})
    assert dag.data_deps("convert", unstreamed) == []
    assert dag.data_deps("finetune", own) == ["${data}/corpus/wiki_demo.jsonl"]
    assert dag.data_deps("evaluate_original", own) == [
        "${data}/corpus/wiki_demo.jsonl", "${data}/benchmarks/mmlu_test.jsonl", "${data}/benchmarks/mmlu_dev.jsonl",
        "${data}/benchmarks/piqa_validation.jsonl"]
    assert dag.data_deps("figures", own) == ["${data}/corpus/wiki_demo.jsonl"]
    assert dag.data_deps("throughput", own) == dag.data_deps("report", own) == []
    hub_only = load_profile(overrides={"finetune.corpora": ["fineweb-edu-dedup", "c4-demo"]})
    assert dag.data_deps("finetune", hub_only) == ["${data}/corpus/c4_demo.jsonl"]  # no file to watch on the hub
    text = "stages:\n  finetune:\n    cmd: python -m flows.finetune\n    deps:\n      - artifacts/m\n      - ${data}/corpus\n"
    lines = dag.regenerate(text, own).splitlines()
    assert lines[4:6] == ["      - artifacts/m", "      - ${data}/corpus/wiki_demo.jsonl"]  # the old data dep replaced
    # a path: part's dep is replaced on each regeneration like the others (it was kept as a user's dep and
    # added again: one more copy each time, and still there once the params no longer named it)
    text = "stages:\n  calibrate:\n    cmd: python -m flows.calibrate\n    deps:\n      - artifacts/m\n"
    twice = dag.regenerate(dag.regenerate(text, own), own)
    assert [ln.split("#")[0].strip() for ln in twice.splitlines()].count("- src/code") == 1
    assert "src/code" not in dag.regenerate(twice, load_profile())
    assert "- artifacts/m" in dag.regenerate(twice, load_profile())


def test_cli_defaults_are_the_params_defaults():
    """One source of truth: the CLI flags, the library options and the params sections share defaults."""
    from flows.params import FinetuneParams
    from transmla.cli import build_parser
    from transmla.config import ConvertOptions, EvaluationOptions, FinetuneConfig

    sub = build_parser()._subparsers._group_actions[0].choices
    conv = {a.dest: a.default for a in sub["convert"]._actions}
    o = ConvertOptions()
    for flag, field in (("freqfold", "freqfold"), ("pca", "pca"), ("cal_nsamples", "cal_nsamples"),
                        ("cal_seqlen", "cal_seqlen"), ("cal_batch_size", "cal_batch_size"), ("seed", "seed"), ("dtype", "dtype"), ("method", "method")):
        assert conv[flag] == getattr(o, field), flag
    assert conv["no_balance_kv"] is (not o.balance_kv)
    # mode flags default to "unset" so that --paper can fill them; unset, they resolve to the library's
    from transmla.cli import convert_options

    eff = convert_options(build_parser().parse_args(["convert", "--out", "x"]))
    for field in ("attention_aware", "calibration", "refit"):
        assert getattr(eff, field) == getattr(o, field), field
    ft = {a.dest: a.default for a in sub["finetune"]._actions}
    params = FinetuneParams()
    for name in FinetuneConfig.model_fields:
        assert ft[name] == getattr(FinetuneConfig(), name) == getattr(params, name), name
    assert ft["corpora"].split(",") == list(params.corpora)
    ev = {a.dest: a.default for a in sub["eval"]._actions}
    e = EvaluationOptions()
    assert ev["tasks"].split(",") == list(e.tasks) and ev["limit"] == e.limit and int(ev["batch_size"]) == e.batch_size
    assert ev["seed"] == e.seed and {a.dest: a.default for a in sub["ppl"]._actions}["seqlen"] == e.ppl_seqlen


def test_regenerate_writes_the_code_deps_of_a_stage_that_ends_the_file():
    """A stage whose deps list is the last thing in dvc.yaml gets its code deps as any other does."""
    from flows import dag

    name = next(iter(dag._flows()))
    text = f"stages:\n  {name}:\n    cmd: python -m {dag._flows()[name]}\n    deps:\n      - data/x.jsonl\n"
    generated = [f"      - {f}" for f in dag.data_deps(name) + dag.code_deps(name)]
    lines = dag.regenerate(text).splitlines()
    assert lines[:5] == text.splitlines()
    assert lines[5:] == generated and len(lines) > 5
    bare = dag.regenerate(text.replace("      - data/x.jsonl\n", "")).splitlines()
    assert bare[4:] == generated


def test_requirements_follow_their_environment_markers(monkeypatch):
    """A requirement for another Python, platform or extra is not one here, even where a copy is importable
    (setuptools puts its vendored tomli, a Python < 3.11 requirement of huggingface_hub, on sys.path once
    imported: the pytest process and a Dask worker then keyed the same task differently)."""
    import importlib.metadata as md
    import sys

    monkeypatch.setattr(md, "requires", lambda dist: ["packaging>=20", 'torch; python_version < "3.0"',
                                                      'safetensors; extra == "x"', f'filelock; sys_platform == "{sys.platform}"'])
    assert codehash.requirements.__wrapped__("any") == ("filelock", "packaging")

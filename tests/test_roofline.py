"""The decode roofline's formulas (transmla.runtime.throughput) against what the caches and models hold, for
every family the repo runs: KV bytes per token and per step (key-norm scales, sliding windows), MoE weights
and FLOPs (top-k of the routed experts), medians of even counts, the reported absorb kernel, and the latent
cache's capacity through batch reindexing. Tiny random models only; no test asserts a wall-clock time."""

from types import SimpleNamespace

import pytest
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, StaticCache)

import transmla.models as tm
from transmla.runtime import absorb, latent_decode
from transmla.runtime import throughput as tp
from transmla.runtime.absorb import LatentCache, LatentLayer, absorbed

V = 64


def _gemma(**extra):
    """Gemma fields: 6 layers, the first 5 sliding with a window of 4 (the review's case)."""
    return dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=128, sliding_window=4,
                query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0,
                bos_token_id=1, eos_token_id=1) | extra


# the MLA shapes of the exports: latent rank r = 8, RoPE dims R = 4 (rope_plan: the original pairs carried)
MLA = dict(kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, rope_plan=[0, 1])


def _deepseek(cls=DeepseekV3ForCausalLM, cfg_cls=DeepseekV3Config, **extra):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
               qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2, n_routed_experts=1, n_shared_experts=1,
               num_experts_per_tok=1, n_group=1, topk_group=1, max_position_embeddings=128, pad_token_id=0) | extra
    return cls(cfg_cls(**cfg))


def _family(name):
    torch.manual_seed(0)
    if name == "llama":  # dense GQA original (SmolLM2's family)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=128, tie_word_embeddings=True))
    elif name == "gemma3":  # original with sliding layers
        m = Gemma3ForCausalLM(Gemma3TextConfig(**_gemma()))
    elif name == "deepseek_v3":  # the export of a Llama / Qwen2 / Mistral
        m = _deepseek()
    elif name == "qwen3_mla":  # L = 2, r = 8, R = 4, g = 2 key scales (the review's case)
        m = _deepseek(tm.Qwen3MLAForCausalLM, tm.Qwen3MLAConfig, q_lora_rank=32, qk_norm_groups=2)
    elif name == "gemma3_mla":  # key scales and sliding layers; the query path is q-LoRA of h * d (raw queries)
        m = tm.Gemma3MLAForCausalLM(tm.Gemma3MLAConfig(**_gemma(), **(MLA | {"q_lora_rank": 16}), qk_norm_groups=1))
    elif name == "gemma2_mla":  # sliding layers, no key scales
        m = tm.Gemma2MLAForCausalLM(tm.Gemma2MLAConfig(**_gemma(layer_types=["sliding_attention", "full_attention"] * 3), **MLA))
    return m.eval()


CASES = [("llama", "hf"), ("gemma3", "hf")] + [
    (f, b) for f in ("deepseek_v3", "qwen3_mla", "gemma3_mla", "gemma2_mla") for b in ("hf", "absorb")]


@pytest.mark.parametrize("family,backend", CASES)
def test_kv_formula_equals_the_cache_bytes(family, backend, monkeypatch):
    """The formula counts what each cache holds: the absorb LatentCache and the hf DynamicCache(config=...),
    prefilled and decoded through `decode_step` (a context past the windows) and prefilled alone at lengths
    below, at and past them. Qwen3 / Gemma 3 exports cache qk_norm_groups key scales beside k_pe; sliding
    layers of the hf cache keep window - 1 tokens. (llama, deepseek_v3: unchanged, regression guards.)"""
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "bmm")  # the cache does not depend on it; no C++ build
    model = _family(family)
    cfg = model.config
    row = tp.decode_step(model, backend, context=20, batch=2, steps=2, warmup_steps=0, threads=1)
    assert row["cache_length_end"] == 22
    assert row["kv_bytes_per_token"] == pytest.approx(row["kv_bytes_per_token_measured"], rel=1e-12)
    for T in (2, 3, 4, 9, 20):
        with absorbed(model, enabled=backend == "absorb") if tp.is_mla(cfg) else torch.no_grad(), torch.no_grad():
            cache = LatentCache(cfg) if backend == "absorb" else DynamicCache(config=cfg)
            model(torch.randint(1, V, (3, T)), past_key_values=cache, use_cache=True)
        # the roofline's KV term: the batch's cache at T tokens
        assert tp.step_bytes(model, backend, T, 3)["kv_bytes"] == tp.cache_nbytes(cache), T


def test_key_scales_and_windows_by_hand():
    """The review's numbers: tiny Qwen3-MLA (L 2, r 8, R 4, g 2) caches 112 bytes per token (not 96) in both
    caches; tiny Gemma 3 (5 of 6 layers sliding, window 4) 112 bytes per token at 20 tokens (not 384), all
    6 layers' 384 up to the window. The step's KV bytes and attention FLOPs follow the context."""
    q = _family("qwen3_mla").config
    assert tp.kv_bytes_per_token(q, "absorb") == tp.kv_bytes_per_token(q, "hf") == 2 * (8 + 4 + 2) * 4 == 112
    g = _family("gemma3")
    cfg = g.config
    per_layer = 2 * 1 * 8 * 4  # K and V of one KV head of 8 dims, float32
    assert tp.kv_bytes_per_token(cfg) == 6 * per_layer == 384  # no context: every layer caches the token
    assert tp.kv_bytes_per_token(cfg, context=20) == (5 * 3 + 20) * per_layer / 20 == 112
    assert tp.kv_bytes_per_token(cfg, context=3) == 384  # within the window: every layer, an int
    smol = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    kv = tp.kv_bytes_per_token(smol, context=4096)  # no windows: the same int at any context
    assert kv == tp.kv_bytes_per_token(smol) == 46080 and isinstance(kv, int)
    assert tp.cached_tokens_per_layer(cfg, "hf", 20) == [3] * 5 + [20]
    assert tp.step_bytes(g, "hf", 20, 3)["kv_bytes"] == 3 * 20 * 112
    assert tp.step_bytes(g, "hf", 2, 3)["kv_bytes"] == 3 * 2 * 384
    attention = tp.step_flops(g, "hf", 20, 3)["attention_flops"]
    assert attention == 2 * 3 * cfg.num_attention_heads * (2 * 8) * (5 * 3 + 20)
    # a StaticCache keeps window slots in its sliding layers (the "static" backend)
    assert tp.cached_tokens_per_layer(cfg, "static", 20) == [4] * 5 + [20]
    static = StaticCache(config=cfg, max_cache_len=20)
    with torch.no_grad():
        g(torch.randint(1, V, (1, 20)), past_key_values=static, use_cache=True)
    assert tp.cache_nbytes(static) == tp.kv_cache_bytes(cfg, "static", 20) == (5 * 4 + 20) * per_layer


def test_dense_formulas_unchanged():
    """A dense model (SmolLM2's shape, from its config only; a tiny Llama for the step) gets the same numbers
    as the formulas before the per-layer windows and experts: regression guard of the default stage."""
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert tp.kv_bytes_per_token(smol) == 2 * 30 * 3 * 64 * 4 == 46080
    m = _family("llama")
    cfg = m.config
    B, T = 8, 100
    assert m.get_input_embeddings().weight is m.get_output_embeddings().weight  # tied, as SmolLM2
    mats = sum(p.numel() for p in m.parameters() if p.dim() >= 2)  # the tied table is the head: read once
    weights = sum(p.numel() * 4 for p in m.parameters())
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert tp.step_bytes(m, "hf", T, B) == {"weight_bytes": weights, "kv_bytes": B * T * kv,
                                            "step_bytes": weights + B * T * kv}
    assert tp.step_bytes(m, "static", T, B) == tp.step_bytes(m, "hf", T, B)
    attn = 2 * B * T * cfg.num_attention_heads * 2 * cfg.head_dim * cfg.num_hidden_layers
    assert tp.step_flops(m, "hf", T, B) == {"linear_flops": 2 * B * mats, "attention_flops": attn,
                                            "step_flops": 2 * B * mats + attn}


def _moe(kind):
    torch.manual_seed(0)
    if kind == "mixtral_mla":  # Mixtral's sparse MoE in every layer: 3-D experts, 4 experts, top-2
        return _deepseek(tm.MixtralMLAForCausalLM, tm.MixtralMLAConfig, intermediate_size=24, n_routed_experts=4,
                         num_experts_per_tok=2).eval()
    # DeepSeek-V3's MoE in layer 1: 8 routed experts, top-2, one shared expert and the router always active
    return _deepseek(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2).eval()


@pytest.mark.parametrize("kind", ["mixtral_mla", "deepseek_v3_moe"])
def test_moe_counts_the_experts_a_step_uses(kind):
    """A decode token runs k of E routed experts: FLOPs count k / E of their matrices; a step of B tokens
    reads at most min(E, B k) experts' weights. Router, shared experts and the rest: always."""
    m = _moe(kind)
    E, k = (4, 2) if kind == "mixtral_mla" else (8, 2)
    routed = [(n, p) for n, p in m.named_parameters() if ".experts." in n]
    assert routed and all(p.dim() == 3 and p.shape[0] == E for _, p in routed)
    expert_numel = sum(p.numel() for _, p in routed)
    emb = m.get_input_embeddings().weight.numel()  # untied: the input table is not read whole
    dense_numel = sum(p.numel() for p in m.parameters()) - emb - expert_numel
    dense_mats = sum(p.numel() for n, p in m.named_parameters() if p.dim() >= 2 and ".experts." not in n) - emb
    assert any("shared_experts" in n or ".gate." in n for n, _ in m.named_parameters())
    for B in (1, 3, 8):
        touched = min(E, B * k)
        assert tp.step_flops(m, "hf", 10, B)["linear_flops"] == 2 * B * (dense_mats + expert_numel * k // E), B
        assert tp.step_bytes(m, "hf", 10, B)["weight_bytes"] == 4 * (dense_numel + expert_numel * touched // E), B
        assert tp.weight_bytes_per_step(m, B) == tp.step_bytes(m, "hf", 10, B)["weight_bytes"]
    assert tp.weight_bytes_per_step(m) == 4 * (dense_numel + expert_numel)  # no batch: every expert
    with absorbed(m):  # the absorbed step too
        f = tp.step_flops(m, "absorb", 10, 1)["linear_flops"]
        assert f < 2 * sum(t.numel() for t in tp.step_weights(m) if t.dim() >= 2)


def test_medians_of_even_counts(monkeypatch):
    """statistics.median everywhere: the mean of the middle two for an even count, over the bandwidth readings,
    over one reading's copies and over decode_step's timed steps (a fake clock: steps of 1 and 3 s)."""
    def reading(rate):
        return {"device": "cpu", "bytes_per_s": rate, "copy_bytes": 64, "repeats": 5, "processor": "x"}

    assert tp.readings_summary([reading(4.0), reading(2.0)])["bytes_per_s"] == 3.0
    assert tp.readings_summary([reading(r) for r in (5.0, 1.0, 2.0, 9.0)])["bytes_per_s"] == 3.5
    assert tp.readings_summary([reading(r) for r in (5.0, 1.0, 2.0)])["bytes_per_s"] == 2.0

    def clock(values):
        it = iter(values)
        return SimpleNamespace(perf_counter=lambda: next(it))

    monkeypatch.setattr(tp, "time", clock([0.0, 1.0, 10.0, 13.0]))  # two copies: 1 s, 3 s
    bw = tp.memory_bandwidth(nbytes=1 << 12, repeats=2)
    assert bw["bytes_per_s"] == 2 * 4096 / 2.0 and bw["best_bytes_per_s"] == 2 * 4096 / 1.0
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "bmm")
    monkeypatch.setattr(tp, "time", clock([0.0, 0.5, 10.0, 11.0, 20.0, 23.0]))  # prefill, then steps of 1 s, 3 s
    row = tp.decode_step(_family("deepseek_v3"), "absorb", context=6, batch=2, steps=2, warmup_steps=0, threads=1)
    assert row["time_per_output_token_ms"] == 2000.0 and row["decode_tokens_per_s"] == 1.0
    assert (row["time_per_output_token_min_ms"], row["time_per_output_token_max_ms"]) == (1000.0, 3000.0)


@pytest.mark.parametrize("call, words", [
    # a ZeroDivisionError, torch's negative dimension, StatisticsError: raw tracebacks from library calls
    (lambda m: tp.decode_step(m, "absorb", context=6, batch=0, steps=1), "batch=0 is below 1"),
    (lambda m: tp.decode_step(m, "absorb", context=-4, batch=1, steps=1), "context=-4 is below 1"),
    (lambda m: tp.decode_step(m, "absorb", context=6, batch=1, steps=0), "steps=0 is below 1"),
    (lambda m: tp.decode_step(m, "absorb", context=6, batch=1, steps=1, warmup_steps=-1), "warmup_steps=-1"),
    # no warm-up step: the compile was timed as a decode step (10 s per token, compile_s None)
    (lambda m: tp.decode_step(m, "absorb", context=6, batch=1, steps=1, warmup_steps=0, compiled=True),
     "warmup_steps=0 is below 1"),
    (lambda m: tp.measure(m, "absorb", context=8, batch=0), "batch=0 is below 1"),
    # blamed the context ("context=8 is too short")
    (lambda m: tp.measure(m, "absorb", context=8, batch=1, output_len=8), "output_len=8 leaves no prompt"),
    (lambda m: tp.memory_bandwidth(nbytes=2), "nbytes=2 is below 4"),  # 0 B/s, then a division by it
    (lambda m: tp.memory_bandwidth(nbytes=64, repeats=0), "repeats=0 is below 1"),
    (lambda m: tp.kv_cache_bytes(m.config, "absorb", -5), "context=-5 is below 0"),  # -800 bytes
    (lambda m: tp.kv_capacity_tokens(100, -5), "cache_memory_bytes=-5 is below 0"),
])
def test_impossible_sizes_are_one_error(call, words):
    from transmla.errors import TransMLAError

    with pytest.raises(TransMLAError, match=words):
        call(_family("deepseek_v3"))


def test_reported_kernel_is_the_one_that_runs(monkeypatch):
    """DECODE_KERNEL "triton" where the Triton kernel cannot run (a CPU tensor without Triton's interpreter,
    or no triton) runs latent_decode's PyTorch form, and is reported as that, in decode_kernel and the row."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "triton")
    ran = []
    torch_form = latent_decode.latent_decode_torch
    monkeypatch.setattr(latent_decode, "latent_decode_torch", lambda *a, **k: ran.append(1) or torch_form(*a, **k))
    monkeypatch.setattr(latent_decode, "latent_decode_op", lambda *a, **k: pytest.fail("the Triton kernel ran"))
    row = tp.decode_step(_family("deepseek_v3"), "absorb", context=6, batch=2, steps=2, warmup_steps=0, threads=1)
    assert ran and row["decode_attention"] != "triton"
    assert row["decode_attention"] == absorb.SPLITK_TORCH == "splitk_torch"
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert absorb.decode_kernel(cpu) == absorb.SPLITK_TORCH
    monkeypatch.setattr(latent_decode, "triton_available", lambda: True)
    assert absorb.decode_kernel(cuda) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert absorb.decode_kernel(cpu) == "triton"  # the interpreter runs the kernel on the CPU
    monkeypatch.setattr(latent_decode, "triton_available", lambda: False)
    assert absorb.decode_kernel(cuda) == absorb.SPLITK_TORCH


def test_latent_cache_keeps_its_capacity_through_reindexing():
    """batch_repeat_interleave / reorder / select keep the preallocated capacity: the next append writes in
    place (no reallocation copying the cache), and the rows are the reindexed ones."""
    layer = LatentLayer(max_cache_len=100)
    first = torch.arange(2 * 10 * 6, dtype=torch.float32).view(2, 10, 6)
    layer.append(first, 4)
    layer.batch_repeat_interleave(8)
    assert layer.buffer.shape == (16, 100, 6) and layer.length == 10
    assert torch.equal(layer.keys[:, 0], first.repeat_interleave(8, 0)[..., :4])
    ptr = layer.buffer.data_ptr()
    new = torch.ones(16, 1, 6)
    out = layer.append(new, 4)
    assert layer.buffer.data_ptr() == ptr and torch.equal(out[:, 10], new[:, 0])
    layer.reorder_cache(torch.arange(15, -1, -1))
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert layer.buffer.shape == (2, 100, 6) and layer.length == 11
    assert torch.equal(layer.keys[:, 0, :10], first[[1, 1]][..., :4])


@pytest.mark.parametrize("context", [20, 3])
def test_static_copy_decodes_like_the_dynamic_cache_past_the_window(context):
    """The original's static baseline (throughput.static_copy) on a model with sliding layers, prefilled
    within and past their window of 4: every decode step's logits equal the DynamicCache path's (before,
    a prefill past the window did not fit the sliding layers' static buffers; within it, a sliding layer's
    int length stayed 0). tests/test_absorb.py checks a model without windows."""
    from conftest import assert_static_decodes_like_dynamic

    ids = torch.randint(1, V, (1, context), generator=torch.Generator().manual_seed(0))
    assert_static_decodes_like_dynamic(_family("gemma3"), ids, batch=3, steps=6, tol=1e-5)


def _decode_gpu_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "decode_gpu.py"
    spec = importlib.util.spec_from_file_location("decode_gpu_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_gpu_script_reports_a_cpu_run_and_refuses_bad_input(tmp_path):
    """scripts/decode_gpu.py (issue 20's GPU measurement) on CPU: its report shows every measured cell (eager
    paths included) with the speedup and both roofline columns; an existing --out, an unknown or GPU-only
    --paths and --steps 0 are refused before any measurement, writing nothing."""
    dg = _decode_gpu_script()
    out = tmp_path / "run.jsonl"
    small = ["--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "0", "--contexts", "32", "--batch", "1"]
    assert dg.main([*small, "--out", str(out), "--paths", "static,absorb-bmm"]) == 0
    rows = [ln for ln in dg.report([str(out)]).splitlines() if ln.startswith("| 32 | 1 |")]
    assert len(rows) == 1, dg.report([str(out)])
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 2 + 2 + 3 and "-" not in cells and cells[4].endswith("x")  # 2 paths + speedup + 2 bounds
    for bad in (["--out", str(out)], ["--out", str(tmp_path / "b.jsonl"), "--paths", "absorb-bogus"],
                ["--out", str(tmp_path / "b.jsonl"), "--paths", "static+g"], ["--out", str(tmp_path / "b.jsonl"), "--steps", "0"]):
        with pytest.raises(SystemExit) as e:
            dg.main([*small, *bad])
        assert e.value.code == 2
    assert not (tmp_path / "b.jsonl").exists()

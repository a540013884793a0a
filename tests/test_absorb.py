"""Absorbed MLA decoding (transmla.runtime.absorb) equals the stock DeepseekV3 forward, caches only the latent,
and the throughput measurement (transmla.runtime.throughput) reports consistent sizes. Tiny models only; no
test asserts a wall-clock time."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

from transmla.runtime.absorb import LatentCache, absorbed, disable_absorb, enable_absorb, is_absorbed
from transmla.convert import ConvertOptions, convert
from transmla.errors import TransMLAError
from transmla.io.sources import load_model
from transmla.runtime.throughput import decode_step, kv_bytes_per_token, measure, sweep

CAL = dict(cal_nsamples=8, cal_seqlen=64, cal_batch_size=4)
TOL = 1e-4


ARCHS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def tiny_pair(tiny_tokenizer, tmp_path_factory):
    """arch -> (original model dir, converted DeepseekV3 model): tiny Llama / Qwen2 (q/k/v biases ->
    attention_bias and the q_a/q_b bias carrier) converted at 50% KV, built once per module on demand."""
    from conftest import _tiny_model

    made = {}

    def get(arch):
        if arch not in made:
            src = tmp_path_factory.mktemp(f"absorb-{arch}")
            _tiny_model(arch, len(tiny_tokenizer)).save_pretrained(src / "orig")
            tiny_tokenizer.save_pretrained(src / "orig")
            convert(str(src / "orig"), src / "mla", ConvertOptions(kv_cache_ratio=0.5, **CAL), progress=False)
            made[arch] = src / "orig", AutoModelForCausalLM.from_pretrained(src / "mla", dtype=torch.float32).eval()
        return made[arch]

    return get


def _random_dsv3(**overrides):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=1, n_shared_experts=1,
        num_experts_per_tok=1, n_group=1, topk_group=1, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=1,
    )
    cfg.update(overrides)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases away from their trivial init, so they matter
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
            else:
                p.normal_(0.0, 0.15)
    return model


RANDOM = {
    # low-rank queries (q_a_proj -> q_a_layernorm -> q_b_proj) with biases everywhere DeepSeek allows them
    "q_lora_bias": dict(q_lora_rank=24, attention_bias=True),
    # rotate_half RoPE layout, rank above the head dims (unfolded absorb is cheaper), YaRN mscale in the softmax scale
    "yarn_wide_rank": dict(
        rope_interleave=False, kv_lora_rank=40,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale_all_dim=1.0, mscale=1.0, beta_fast=32, beta_slow=1),
    ),
}


@pytest.fixture(params=[*ARCHS, *RANDOM])
def mla(request, tiny_pair):
    if request.param in ARCHS:
        return tiny_pair(request.param)[1]
    return _random_dsv3(**RANDOM[request.param])


def _ids(model, batch=2, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (batch, n), generator=g)


def _logprobs(model, ids, **kw):
    with torch.no_grad():
        return torch.log_softmax(model(ids, **kw).logits.float(), -1)


def _incremental(model, ids, prompt, cache):
    """Log-probs of a prefill of `prompt` tokens, then one token per step through `cache`."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(out, 1).float(), -1)


@pytest.mark.parametrize("fold", [None, True, False])
def test_prefill_matches_stock(mla, fold):
    """Every form of the absorbed matrices gives the stock logits, and the form asked for is the one built
    (fold=True: W_UK in the query and W_UV in o_proj; False: per-head products; None: one of each pair, by
    shape). Without the second check the three cases could all run one form."""
    ids = _ids(mla)
    ref = _logprobs(mla, ids)
    with absorbed(mla, fold=fold):
        got = _logprobs(mla, ids)
        forms = {(("absorb_q_weight" in m._buffers), ("absorb_w_uk" in m._buffers),
                  ("absorb_o_weight" in m._buffers), ("absorb_w_uv" in m._buffers))
                 for m in mla.modules() if hasattr(m, "kv_b_proj")}
    assert (got - ref).abs().max() < TOL
    assert forms and all(q != uk and o != uv for q, uk, o, uv in forms)  # exactly one form of each product
    if fold is not None:
        assert forms == {(fold, not fold, fold, not fold)}


@pytest.mark.parametrize("fold", [None, True, False])
def test_incremental_decode_matches_stock_and_caches_only_the_latent(mla, fold):
    cfg = mla.config
    r, R, L = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers
    ids = _ids(mla, batch=3, n=20)
    ref = _logprobs(mla, ids)
    cache = LatentCache(cfg)
    with absorbed(mla, fold=fold):
        got = _incremental(mla, ids, 6, cache)
        via_dynamic = _incremental(mla, ids, 6, DynamicCache(config=cfg))  # the default cache works too
    assert (got - ref).abs().max() < TOL
    assert (via_dynamic - ref).abs().max() < TOL
    B, T = ids.shape
    assert cache.get_seq_length() == T
    assert cache.values_per_token_per_layer() == [r + R] * L
    assert cache.values_per_token() == L * (r + R)
    for layer in cache.layers:  # the actual tensors: [c_kv ; k_pe] and nothing else
        assert layer.buffer.shape[0] == B and layer.buffer.shape[-1] == r + R
        assert layer.keys.shape == (B, 1, T, r) and layer.values.shape == (B, 1, T, R)
    assert cache.nbytes() == L * B * T * (r + R) * 4
    assert cache.bytes_per_token() == L * (r + R) * 4 == kv_bytes_per_token(cfg, "absorb")


def test_prefill_into_an_empty_static_cache(mla):
    """generate(cache_implementation="static") prefills a StaticCache longer than the prompt, and transformers
    then drops the mask: causal from the cache's start, the unwritten slots after the prompt. The absorbed
    path (latent_attention) must read it so, not bottom-right."""
    _check_static_cache_prefill(mla)


def test_prefill_into_an_empty_static_cache_with_key_scale():
    """The same through scaled_latent_attention (Qwen3 / Gemma 3's key norm)."""
    _check_static_cache_prefill(_tiny_qwen3_mla("sdpa"))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "key_scale"])
def test_chunks_into_a_dynamic_cache_without_a_mask(tiny_pair, scaled):
    """A mask function that drops the mask of a continuation (runtime.fast_attention's, flash attention's):
    chunks of several tokens into a DynamicCache that already holds some are causal from the cache's end."""
    from transmla.runtime.fast_attention import use_causal_padded_sdpa

    model = _tiny_qwen3_mla("sdpa") if scaled else tiny_pair("llama")[1]
    impl = model.config._attn_implementation
    ids = _ids(model, batch=2, n=14)
    ref = _logprobs(model, ids)
    use_causal_padded_sdpa(model)
    try:
        with absorbed(model), torch.no_grad():
            cache, out = DynamicCache(config=model.config), []
            for a, b in ((0, 6), (6, 10), (10, 14)):
                out.append(model(ids[:, a:b], past_key_values=cache, use_cache=True).logits)
        got = torch.log_softmax(torch.cat(out, 1).float(), -1)
    finally:
        model.set_attn_implementation(impl)
    assert (got - ref).abs().max() < TOL


def _check_static_cache_prefill(model):
    from transformers import StaticCache

    ids = _ids(model, batch=2, n=14)
    ref = _logprobs(model, ids)
    stock = _incremental(model, ids, 6, StaticCache(config=model.config, max_cache_len=24))
    assert (stock - ref).abs().max() < TOL  # the stock forward, same cache: the reference holds
    with absorbed(model):
        got = _incremental(model, ids, 6, StaticCache(config=model.config, max_cache_len=24))
    assert (got - ref).abs().max() < TOL


def test_latent_cache_holds_what_the_stock_module_computes(mla):
    """c_kv after kv_a_layernorm and k_pe after RoPE: the stock forward reading a LatentCache filled
    by the absorbed forward gives the stock log-probs (and the stock forward can fill it too)."""
    ids = _ids(mla, n=16)
    ref = _logprobs(mla, ids)
    cache = LatentCache(mla.config)
    with absorbed(mla), torch.no_grad():
        mla(ids[:, :10], past_key_values=cache, use_cache=True)
    assert not is_absorbed(mla)
    with torch.no_grad():
        tail = torch.log_softmax(mla(ids[:, 10:], past_key_values=cache, use_cache=True).logits, -1)
    assert (tail - ref[:, 10:]).abs().max() < TOL
    stock_filled = _incremental(mla, ids, 5, LatentCache(mla.config))
    assert (stock_filled - ref).abs().max() < TOL



def test_latent_cache_under_a_read_only_base_max_cache_len(mla, monkeypatch):
    """transformers 5.17's Cache has a read-only max_cache_len property: constructing a LatentCache
    must not assign to it (it raised AttributeError there), and it still reports its preallocation."""
    from transformers import cache_utils

    monkeypatch.setattr(cache_utils.Cache, "max_cache_len", property(lambda self: -1), raising=False)
    cache = LatentCache(mla.config, max_cache_len=24)
    assert cache.max_cache_len == 24
    assert LatentCache(mla.config).max_cache_len is None

def test_greedy_generate_identical(mla):
    ids = _ids(mla, batch=2, n=8)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        ref = mla.generate(ids, **kw)
        with absorbed(mla):
            latent = mla.generate(ids, past_key_values=LatentCache(mla.config, max_cache_len=32), **kw)
            default = mla.generate(ids, **kw)
    assert torch.equal(latent, ref) and torch.equal(default, ref)


@pytest.fixture(params=["sdpa", "bmm", "triton", "cpu"])
def decode_kernel(request, monkeypatch):
    """Every single-token decode attention kernel (absorb.DECODE_KERNEL); "triton" on a CPU runs the
    split-K kernel's PyTorch form (the Triton kernel itself: tests/test_latent_decode.py); "cpu" is
    this project's C++ kernel (skipped where it cannot be built)."""
    from transmla.runtime import absorb, cpu_kernels

    if request.param == "cpu" and not cpu_kernels.available():
        pytest.skip("no AVX2 CPU or no C++ toolchain for the CPU decode kernels")
    monkeypatch.setattr(absorb, "DECODE_KERNEL", request.param)
    return request.param


def test_decode_kernel_choice(monkeypatch):
    """"auto" resolves per device (the measured winner); an explicit kernel is kept; a typo is refused."""
    from transmla.runtime import absorb

    from transmla.runtime import latent_decode

    from transmla.runtime import cpu_kernels

    monkeypatch.setattr(absorb, "DECODE_KERNEL", "auto")
    for built in (True, False):  # this project's CPU kernel where it is built, SDPA otherwise
        monkeypatch.setattr(cpu_kernels, "_AVAILABLE", built)
        assert absorb.decode_kernel(torch.device("cpu"), 425, 8192) == ("cpu" if built else "sdpa")
        assert absorb.decode_kernel(torch.device("cpu"), 8, 4096, torch.bfloat16) == "sdpa"  # float32 only
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "cpu")
    with pytest.raises(TransMLAError, match="'auto'"):
        absorb.decode_kernel(torch.device("cpu"))  # not built (above)
    monkeypatch.setattr(cpu_kernels, "_AVAILABLE", True)
    assert absorb.decode_kernel(torch.device("cpu")) == "cpu"
    with pytest.raises(TransMLAError, match="'auto'"):
        absorb.decode_kernel(torch.device("cuda", 0))
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "auto")
    assert absorb.decode_kernel(torch.device("cuda", 0), 16, 1024) == "bmm"
    monkeypatch.setattr(latent_decode, "triton_available", lambda: True)
    assert absorb.decode_kernel(torch.device("cuda", 0), 16, 8192) == "triton"
    assert absorb.decode_kernel(torch.device("cuda", 0), 16, 1024) == "bmm"
    monkeypatch.setattr(latent_decode, "triton_available", lambda: False)
    assert absorb.decode_kernel(torch.device("cuda", 0), 16, 8192) == "bmm"
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "bmm")
    assert absorb.decode_kernel(torch.device("cpu")) == "bmm"
    monkeypatch.setattr(absorb, "DECODE_KERNEL", "flash")
    with pytest.raises(TransMLAError, match="decode kernel"):
        absorb.decode_kernel(torch.device("cpu"))


def test_decode_kernels_match_stock(mla, decode_kernel):
    ids = _ids(mla, batch=3, n=20)
    ref = _logprobs(mla, ids)
    with absorbed(mla):
        got = _incremental(mla, ids, 6, LatentCache(mla.config))
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("kernel", ["sdpa", "bmm", "triton"])  # not "cpu": the C++ kernel runs float32 only
def test_float16_decode_scores_past_its_range(kernel, monkeypatch):
    """float16 decode where one raw score q.k (about 1e5) is past float16's range (65504) and the scaled one
    is not: every kernel gives the float64 attention (the bmm path rounded the raw scores to float16 before
    scaling them: inf, then NaN)."""
    from transmla.runtime import absorb
    from transmla.runtime.absorb import latent_attention, scaled_latent_attention

    monkeypatch.setattr(absorb, "DECODE_KERNEL", kernel)
    g = torch.Generator().manual_seed(0)
    B, h, T, r, R = 2, 4, 24, 48, 16
    aligned = torch.randint(0, 2, (r + R,), generator=g) * 2.0 - 1  # a +-1 vector: q.k = 40 * 40 * 64 for token 3
    latent = torch.randn(B, T, r + R, generator=g) * 4
    latent[:, 3] = 40 * aligned
    query = torch.randn(B, h, 1, r + R, generator=g) * 4
    query[:, :, 0] = 40 * aligned
    scaling = 2e-4
    assert (query[0, 0, 0] @ latent[0, 3]).item() > 65504
    scores = (query.double()[:, :, 0] @ latent.double().transpose(1, 2)) * scaling
    ref = torch.softmax(scores, -1) @ latent.double()[..., :r]
    got = latent_attention(query.half(), latent.half(), None, scaling, r)
    assert got.isfinite().all()
    assert (got.double()[:, :, 0] - ref).abs().max() < 1e-2
    # the key-scaled / soft-capped form (Qwen3, Gemma 2) likewise: it multiplied the float16 product by the scale
    key_scale = 1 + torch.rand(B, h, T, 1, generator=g)
    ref = torch.softmax(scores * key_scale.double()[..., 0], -1) @ latent.double()[..., :r]
    got = scaled_latent_attention(query.half(), latent.half(), key_scale.half(), None, scaling, r)
    assert got.isfinite().all()
    assert (got.double()[:, :, 0] - ref).abs().max() < 1e-2
    # a key scale below 1 (a large key's norm): the scaled product passes 65504 before the key scale brings it back
    big, small = 0.9, torch.full((B, h, T, 1), 2e-3)
    assert (query[0, 0, 0] @ latent[0, 3]).item() * big > 65504
    ref = torch.softmax((query.double()[:, :, 0] @ latent.double().transpose(1, 2)) * big * small.double()[..., 0], -1)
    got = scaled_latent_attention(query.half(), latent.half(), small.half(), None, big, r)
    assert got.isfinite().all() and (got.double()[:, :, 0] - ref @ latent.double()[..., :r]).abs().max() < 1e-2
    cap = 50.0
    ref = torch.softmax(torch.tanh(scores / cap) * cap, -1) @ latent.double()[..., :r]
    got = scaled_latent_attention(query.half(), latent.half(), None, None, scaling, r, softcap=cap)
    assert (got.double()[:, :, 0] - ref).abs().max() < 1e-2


def _check_left_padded(model, ids, pads: dict[int, int], new_tokens: int) -> None:
    """Left-pad row i of `ids` by pads[i]; greedy generation absorbed (LatentCache) gives the stock tokens and
    finite log-probs within TOL of the stock ones."""
    mask = torch.ones_like(ids)
    for row, n in pads.items():
        ids[row, :n], mask[row, :n] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        with absorbed(model):
            got = model.generate(ids, past_key_values=LatentCache(model.config), **kw)
    assert all(g.isfinite().all() for g in got.logits)
    assert torch.equal(got.sequences, ref.sequences)
    diff = max((a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item() for a, b in zip(got.logits, ref.logits))
    assert diff < TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_left_padding(impl, decode_kernel):
    """Unequal prompts, left-padded: the absorbed path reads the same padding mask (bool or additive)."""
    model = _random_dsv3(**RANDOM["q_lora_bias"])
    model.set_attn_implementation(impl)
    _check_left_padded(model, _ids(model, batch=3, n=10), {0: 4, 1: 2}, 12)


def _tiny_qwen3_mla(impl):
    """A random Qwen3MLA (the key-norm scale path, `scaled_latent_attention`), norms away from identity."""
    from transmla.models import Qwen3MLAConfig, Qwen3MLAForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MLAConfig(vocab_size=101, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                         first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=256, qk_norm_groups=2, pad_token_id=0)
    model = Qwen3MLAForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 2.0)
    return model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_left_padding_with_key_scale(impl):
    """The scaled path (Qwen3 / Gemma 3 key norm) on left-padded prompts: a padded query row attends nothing;
    it must come out as zeros as in stock SDPA, not NaN that the next layer's latent spreads to every token."""
    model = _tiny_qwen3_mla(impl)
    _check_left_padded(model, torch.randint(1, 101, (3, 7), generator=torch.Generator().manual_seed(1)), {1: 3, 2: 5}, 6)


def test_absorb_refuses_a_2d_padding_mask():
    """A flash-attention style [B, T] mask would broadcast against the wrong axes: both latent paths refuse it."""
    from transmla.runtime.absorb import latent_attention, scaled_latent_attention

    q, latent, mask = torch.randn(2, 4, 2, 20), torch.randn(2, 2, 20), torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(TransMLAError, match="4D masks"):
        latent_attention(q, latent, mask, 0.1, 16)
    with pytest.raises(TransMLAError, match="4D masks"):
        scaled_latent_attention(q, latent, None, mask, 0.1, 16)


@pytest.mark.parametrize("fold", [True, False])
def test_absorbed_off_restores_the_form_it_found(fold):
    """`absorbed(enabled=False)` on a model absorbed with an explicit fold gives back that form, not the
    context's default."""
    model = _random_dsv3(**RANDOM["q_lora_bias"])
    enable_absorb(model, fold=fold)
    names = {n for n, _ in model.named_buffers() if n.split(".")[-1].startswith("absorb_")}
    with absorbed(model, enabled=False):
        assert not is_absorbed(model)
    assert is_absorbed(model)
    assert {n for n, _ in model.named_buffers() if n.split(".")[-1].startswith("absorb_")} == names


def test_enable_disable_round_trip(mla):
    keys = set(mla.state_dict())
    enable_absorb(mla)
    assert is_absorbed(mla) and set(mla.state_dict()) == keys  # absorbed matrices are non-persistent
    disable_absorb(mla)
    assert not is_absorbed(mla)
    assert not any(n.split(".")[-1].startswith("absorb_") for n, _ in mla.named_buffers())


def test_absorb_needs_mla(tiny_pair):
    model, _ = load_model(str(tiny_pair("llama")[0]))
    with pytest.raises(TransMLAError, match="no DeepseekV3Attention"):
        enable_absorb(model)
    with pytest.raises(TransMLAError, match="MLA"):
        measure(model, "absorb", context=8, batch=1, warmup=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_throughput_measure(tiny_pair, arch):
    orig_dir, converted = tiny_pair(arch)
    cfg = converted.config
    r, R, L = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers
    rows = sweep(converted, ("hf", "absorb"), (16,), (2,), progress=False, threads=1, seed=1)
    assert [row["backend"] for row in rows] == ["hf", "absorb"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["time_per_output_token_ms"] > 0
        assert row["prefill_s"] > 0 and row["peak_rss_gib"] > 0
        assert (row["input_len"], row["output_len"], row["batch"], row["threads"]) == (8, 8, 2, 1)
        # the config formula equals the bytes of the cache generate actually returned
        assert row["kv_bytes_per_token"] == row["kv_bytes_per_token_measured"]
    absorb = rows[1]
    assert absorb["kv_bytes_per_token"] == L * (r + R) * 4
    orig_model, _ = load_model(str(orig_dir))
    orig = measure(orig_model, "hf", context=16, batch=2, threads=1)
    spec = orig_model.config
    assert orig["kv_bytes_per_token"] == orig["kv_bytes_per_token_measured"] == 2 * L * spec.num_key_value_heads * spec.head_dim * 4
    assert absorb["original_kv_bytes_per_token"] == orig["kv_bytes_per_token"]  # from the export's transmla metadata
    ratio = absorb["kv_capacity_tokens"] / orig["kv_capacity_tokens"]
    assert absorb["kv_capacity_ratio_vs_original"] == pytest.approx(ratio) and ratio == pytest.approx(2.0, rel=1e-3)
    # the cheap long-context variant: one prefilled sequence replicated to the batch
    step = decode_step(converted, "absorb", context=12, batch=3, steps=3, threads=1)
    assert step["time_per_output_token_ms"] > 0 and step["cache_length_end"] == 12 + 2 + 3
    assert step["kv_bytes_per_token"] == step["kv_bytes_per_token_measured"] == L * (r + R) * 4


def test_static_baseline_decodes_like_the_dynamic_cache(tiny_pair):
    """The original's best stock decode (a preallocated StaticCache of the batch, throughput.static_copy)
    gives the same logits per step as the DynamicCache path."""
    from conftest import assert_static_decodes_like_dynamic

    orig, _ = load_model(str(tiny_pair("llama")[0]))
    assert_static_decodes_like_dynamic(orig, _ids(orig, batch=1, n=20), batch=3, steps=4, tol=TOL)
    step = decode_step(orig, "static", context=12, batch=3, steps=3, threads=1, bandwidth=1e9)
    assert step["cache_length_end"] == 12 + 2 + 3 and step["x_of_bound"] > 0


def test_timing_synchronises_around_every_clock_read(tiny_pair, monkeypatch):
    """On a GPU an unsynchronised clock times kernel launches: every clock read in decode_step follows a
    synchronize of the model's device; synchronize waits on CUDA devices only."""
    from transmla.runtime import throughput

    calls = []
    monkeypatch.setattr(throughput, "synchronize", lambda device: calls.append(str(device)))
    _, converted = tiny_pair("llama")
    throughput.decode_step(converted, "absorb", context=8, batch=2, steps=3, warmup_steps=1, threads=1)
    assert calls == ["cpu"] * (2 + 2 * (1 + 3))  # prefill start/end + every step start/end
    monkeypatch.undo()
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    throughput.synchronize("cpu")
    throughput.synchronize("cuda:0")
    assert synced == [torch.device("cuda:0")]


def test_roofline_bytes(tiny_pair):
    """A step reads each weight once (the untied input embedding table aside), kv_b_proj replaced by the
    absorbed matrices, plus the batch's KV cache; the measured bandwidth is a positive rate."""
    from transmla.runtime.throughput import memory_bandwidth, step_bytes, weight_bytes_per_step

    orig, _ = load_model(str(tiny_pair("qwen2")[0]))  # untied embeddings
    params = sum(p.numel() * 4 for p in orig.parameters())
    emb = orig.get_input_embeddings().weight.numel() * 4
    assert weight_bytes_per_step(orig) == params - emb
    kv = kv_bytes_per_token(orig.config, "hf")
    assert step_bytes(orig, "hf", 100, 3) == {"weight_bytes": params - emb, "kv_bytes": 300 * kv,
                                              "step_bytes": params - emb + 300 * kv}
    mla = tiny_pair("qwen2")[1]
    stock = weight_bytes_per_step(mla)
    assert stock == sum(p.numel() * 4 for p in mla.parameters()) - mla.get_input_embeddings().weight.numel() * 4
    cfg = mla.config
    h, r, R, dn, dv, D = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                          cfg.v_head_dim, cfg.hidden_size)
    Dq = D if cfg.q_lora_rank is None else cfg.q_lora_rank
    with absorbed(mla, fold=True):  # folded: [W_UK^T W_Q ; W_QR] and W_O W_UV replace q, kv_b and o_proj's weight
        per_layer = 4 * (h * (r + R) * Dq + D * h * r - h * (dn + R) * Dq - h * (dn + dv) * r - D * h * dv)
        assert weight_bytes_per_step(mla) == stock + cfg.num_hidden_layers * per_layer
    with absorbed(mla, fold=False):  # unfolded: W_UK, W_UV copies replace kv_b: the same bytes
        assert weight_bytes_per_step(mla) == stock
    bw = memory_bandwidth(nbytes=1 << 24, repeats=3)
    assert bw["bytes_per_s"] > 0 and bw["best_bytes_per_s"] >= bw["bytes_per_s"]


def test_readings_summary_bounds_and_floors():
    """Readings through a run -> their median (the middle one; the mean of the middle two of an even count) with the
    range and every reading in order, for the bandwidth and the matmul peak alike; the bounds divide the
    step's bytes by the bandwidth and the floors its operations by the peak, and the ranges give the same
    time against the lowest and the highest reading. No reading is an error that says what to do."""
    from transmla.runtime.throughput import bound_fields, floor_fields, readings_summary

    def reading(rate):
        return {"device": "cpu", "bytes_per_s": rate, "best_bytes_per_s": 2 * rate, "copy_bytes": 64, "repeats": 5,
                "processor": "x"}

    s = readings_summary([reading(r) for r in (30e9, 52e9, 35e9, 31e9, 36e9)])
    assert s["bytes_per_s"] == 35e9 and s["range_bytes_per_s"] == [30e9, 52e9] and s["readings"] == 5
    assert s["readings_bytes_per_s"] == [30e9, 52e9, 35e9, 31e9, 36e9]
    assert s["copy_bytes"] == 64 and s["processor"] == "x" and "best_bytes_per_s" not in s
    assert readings_summary([reading(4.0), reading(2.0)])["bytes_per_s"] == 3.0  # the middle two's mean
    assert readings_summary([reading(3.0)])["range_bytes_per_s"] == [3.0, 3.0]
    p = readings_summary([{"flops_per_s": f, "n": 1024, "threads": 2} for f in (190e9, 121e9, 188e9)], "flops_per_s")
    assert p["flops_per_s"] == 188e9 and p["range_flops_per_s"] == [121e9, 190e9] and p["n"] == 1024
    with pytest.raises(TransMLAError, match="peak_flops"):
        readings_summary([], "flops_per_s")
    row = {"step_bytes": 7e8, "step_flops": 6e9, "linear_flops": 4e9, "attention_flops": 2e9}
    row.update(floor_fields(row, 200e9, (100e9, 300e9)))  # 6e9 operations at 200 GFLOP/s = 30 ms
    assert row["compute_floor_ms"] == pytest.approx(30.0) and row["linear_floor_ms"] == pytest.approx(20.0)
    assert row["attention_floor_ms"] == pytest.approx(10.0) and row["compute_floor_range_ms"] == pytest.approx([60.0, 20.0])
    f = bound_fields(row, 0.04, 35e9, (30e9, 52e9))  # 40 ms; 7e8 bytes at 35 GB/s = 20 ms
    assert f["bound_ms"] == pytest.approx(20.0) and f["x_of_bound"] == pytest.approx(2.0)
    assert f["x_of_bound_range"] == pytest.approx([40 / (7e8 / 30e9 * 1e3), 40 / (7e8 / 52e9 * 1e3)])
    assert f["x_of_roofline"] == pytest.approx(40 / 30)  # the compute floor is the larger
    assert f["bandwidth_bytes_per_s"] == 35e9
    g = bound_fields({"step_bytes": 7e8}, 0.04, 7e9)  # no compute floor, no spread: 100 ms bound
    assert g["x_of_bound"] == pytest.approx(0.4) and "x_of_roofline" not in g and "x_of_bound_range" not in g


def test_roofline_flops(tiny_pair):
    """The compute floor counts 2 operations per multiply-add: every weight matrix once per row of the
    batch, and per layer, query head and cached token the attention's dot products (GQA: keys and values
    of head_dim; absorbed MLA: scores over the whole latent, values over its first kv_lora_rank dims)."""
    from transmla.runtime.throughput import peak_flops, step_flops

    orig, _ = load_model(str(tiny_pair("qwen2")[0]))  # untied embeddings: the input table is not a matmul
    cfg = orig.config
    B, T = 3, 100
    mats = sum(p.numel() for p in orig.parameters() if p.dim() >= 2) - orig.get_input_embeddings().weight.numel()
    d = cfg.hidden_size // cfg.num_attention_heads
    attn = 2 * B * T * cfg.num_attention_heads * 2 * d * cfg.num_hidden_layers
    assert step_flops(orig, "hf", T, B) == {"linear_flops": 2 * B * mats, "attention_flops": attn,
                                            "step_flops": 2 * B * mats + attn}
    mla = tiny_pair("qwen2")[1]
    cfg = mla.config
    with absorbed(mla, fold=False):
        f = step_flops(mla, "absorb", T, B)
    per_key = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    assert f["attention_flops"] == 2 * B * T * cfg.num_attention_heads * per_key * cfg.num_hidden_layers
    # unfolded absorption keeps the matrices' sizes (W_UK, W_UV replace kv_b_proj), so the linear work too
    assert f["linear_flops"] == step_flops(mla, "hf", T, B)["linear_flops"]
    with pytest.raises(TransMLAError):
        step_flops(mla, "paged", T, B)
    peak = peak_flops(n=128, repeats=3, threads=1)
    assert peak["flops_per_s"] > 0 and peak["threads"] == 1 and peak["dtype"] == "float32"


def _packed_kernels():
    from transmla.runtime import packed

    return packed.kernels()


needs_packing = pytest.mark.skipif(not _packed_kernels(), reason="PyTorch built without MKL and oneDNN: no packed GEMM")


@needs_packing
@pytest.mark.parametrize("kernel", ["mkl", "onednn", "stream", "tiled"])
@pytest.mark.parametrize("fold", [None, True, False])
def test_packed_weights_decode_like_the_stock_layout(mla, fold, kernel, monkeypatch):
    """Every linear layer (and Absorb's folded matrices) on weights packed for the batch: the absorbed
    decode gives the stock forward's log-probs; the packed kernel really runs at the packed row count
    (prefill rows fall back to F.linear); leaving the context restores the model exactly."""
    from torch import nn
    from torch.profiler import profile

    from transmla.runtime import packed

    if kernel not in packed.kernels():
        pytest.skip(f"PyTorch built without {kernel}")
    keys, B = set(mla.state_dict()), 3
    calls, fused_calls = [], []
    real, real_fused = packed.linear, packed.fused_linear
    monkeypatch.setattr(packed, "linear", lambda x, w, b, p: calls.append((p is not None, x.numel() // x.shape[-1])) or real(x, w, b, p))
    monkeypatch.setattr(packed, "fused_linear", lambda x, g: fused_calls.append(len(g.sizes)) or real_fused(x, g))
    ids = _ids(mla, batch=B, n=20)
    ref = _logprobs(mla, ids)
    with absorbed(mla, fold=fold), packed.packed(mla, batch=B, kernel=kernel) as used:
        assert used == kernel
        # "tiled": the linears of one input (an MLP's gate and up; the folded query and kv_a_proj without a q LoRA)
        # packed side by side as one group; the other kernels keep one call per linear
        groups = packed.sibling_linears(mla) if kernel == "tiled" else []
        assert all(packed.one_group(*(m.__dict__[a] for m, a, _, _ in g)) for g in groups)
        assert len(groups) >= mla.config.num_hidden_layers or kernel != "tiled"
        linears = [m for m in mla.modules() if isinstance(m, nn.Linear)]
        assert all(isinstance(getattr(m, packed.ATTR, None), packed.Packed) for m in linears)
        assert {getattr(m, packed.ATTR).kernel for m in linears} == {kernel}
        folded = [m for m in mla.modules() if any(n in m._buffers for n in packed.ABSORB_MATRICES)]
        assert all(packed.packed_buffer(m, n).batch == B for m in folded for n in packed.ABSORB_MATRICES if n in m._buffers)
        with profile() as prof:
            got = _incremental(mla, ids, 6, LatentCache(mla.config))
        assert set(mla.state_dict()) == keys  # the packed copies are invisible to saving
    assert (got - ref).abs().max() < TOL
    op = {"mkl": "mkl::_mkl_linear", "onednn": "mkldnn::_linear_pointwise", "stream": "transmla::stream_linear",
          "tiled": "transmla::tiled_linear"}[kernel]
    assert op in {e.key for e in prof.key_averages()}
    step_calls = [has for has, rows in calls if rows == B]  # the decode steps' products: all on packed weights
    assert all(step_calls) and len(step_calls) >= (20 - 6) * mla.config.num_hidden_layers
    assert len(fused_calls) == (20 - 6) * len(groups)  # each group one call per decode step; the prefill: one F.linear each
    assert not packed.is_packed(mla) and all("forward" not in m.__dict__ for m in linears)
    assert all("forward" not in m.__dict__ for m in mla.modules() if type(m).__name__ in packed.MLP_CLASSES)
    assert not any(packed.packed_buffer(m, n) for m in mla.modules() for n in packed.ABSORB_MATRICES)
    assert not any(n.endswith("_packed") for m in mla.modules() for n in m.__dict__)


@needs_packing
def test_packed_weights_in_decode_step_and_refused_where_they_cannot_run(tiny_pair):
    from transmla.runtime import packed

    _, converted = tiny_pair("llama")
    step = decode_step(converted, "absorb", context=12, batch=3, steps=3, threads=1, packed_weights=True)
    assert step["packed_weights"] is True and not packed.is_packed(converted)
    assert decode_step(converted, "absorb", context=12, batch=3, steps=3, threads=1)["packed_weights"] is False
    half = _random_dsv3().to(torch.bfloat16)
    assert not packed.available(half)  # decode_step then runs unpacked and records it
    assert decode_step(half, "absorb", context=8, batch=2, steps=2, threads=1, packed_weights=True)["packed_weights"] is False
    with pytest.raises(TransMLAError, match="float32 model on CPU") as err:
        packed.pack(half)
    assert "packed_weights: false" in str(err.value)
    assert not packed.is_packed(half)
    with pytest.raises(TransMLAError, match="'blas'") as err:
        packed.pack(converted, kernel="blas")
    assert "'auto'" in str(err.value) and not packed.is_packed(converted)


@needs_packing
def test_fastest_kernel_is_the_measured_one_and_measured_once(tiny_pair, monkeypatch):
    """pack(kernel="auto") packs with the kernel that ran the model's weights fastest; the measurement is
    made once per process for the same shapes, batch and threads (a choice that flipped on noise would
    recompile a compiled step), and decode_step records the kernel and each kernel's time."""
    from transmla.runtime import packed

    _, converted = tiny_pair("llama")
    measured, time_kernels = [], packed.time_kernels
    for fast in packed.kernels():
        monkeypatch.setattr(packed, "_FASTEST", {})
        measured.clear()
        fake = {k: (1.0 if k == fast else 2.0) for k in packed.kernels()}
        monkeypatch.setattr(packed, "time_kernels", lambda w, b, fake=fake: measured.append(len(w)) or dict(fake))
        assert packed.fastest_kernel(converted, 3) == (fast, fake)
        assert packed.fastest_kernel(converted, 3)[0] == fast and len(measured) == 1  # not measured again
        with packed.packed(converted, batch=3) as used:
            assert used == fast
            assert {m._packed_weight.kernel for m in converted.modules() if isinstance(m, torch.nn.Linear)} == {fast}
        assert len(measured) == 1
        measured.clear()
        row = decode_step(converted, "absorb", context=8, batch=3, steps=2, threads=1, packed_weights=True)
        assert row["gemm"] == fast and row["gemm_pass_ms"] == {k: 1e3 * v for k, v in fake.items()}
    real = time_kernels([converted.lm_head.weight], 2, repeats=1)
    assert set(real) == set(packed.kernels()) and all(t > 0 for t in real.values())


# --------------------------------------------------------------------------------------------------
# Compiled decode (transmla.runtime.compiled_decode)
# --------------------------------------------------------------------------------------------------


def _blocked_layouts():
    from transmla.runtime import cpu_kernels

    return [False, True] if cpu_kernels.available() else [False]


@pytest.mark.parametrize("mla", ["llama", "q_lora_bias", "yarn_wide_rank"], indirect=True)
@pytest.mark.parametrize("blocked", _blocked_layouts())
def test_compiled_decode_step_equals_the_stock_forward(mla, blocked):
    """One torch.compile graph per step over the static latent cache, in rows or blocked (read by
    transmla::latent_decode_blocked_cpu): the log-probs of the stock full forward at every decoded
    position, the same latents as the eager LatentCache, a position that moves and a capacity beyond it
    that stays masked out (and untouched)."""
    from transmla.runtime.cpu_kernels import unblock_latent
    from transmla.runtime.compiled_decode import StaticLatentCache, compiled_step

    ids = _ids(mla, batch=3, n=16)
    prompt, capacity = 5, 20
    ref = _logprobs(mla, ids)
    torch._dynamo.reset()
    with absorbed(mla):
        eager = LatentCache(mla.config)
        _incremental(mla, ids, prompt, eager)
        prefill = LatentCache(mla.config)
        with torch.no_grad():
            mla(ids[:, :prompt], past_key_values=prefill, use_cache=True)
        cache = StaticLatentCache.from_latent_cache(prefill, batch=3, capacity=capacity, blocked=blocked)
        step = compiled_step(mla)
        got = []
        for t in range(prompt, ids.shape[1]):
            got.append(torch.log_softmax(step(ids[:, t : t + 1], cache).float(), -1))
            cache.advance()
    assert (torch.stack(got, 1) - ref[:, prompt:]).abs().max() < TOL
    T = ids.shape[1]
    assert cache.blocked == blocked and cache.get_seq_length() == T
    assert cache.capacity == (32 if blocked else capacity)  # blocked: whole blocks of 16 tokens
    assert cache.nbytes() == eager.nbytes()
    for buf, layer in zip(cache.buffers, eager.layers, strict=True):
        rows = unblock_latent(buf) if blocked else buf
        assert (rows[:, :T] - layer.buffer[:, :T]).abs().max() < 1e-5
        assert not rows[:, T:].any()  # the slack is never written


def test_compiled_decode_skips_guards_only_for_inputs_it_has_run(tiny_pair, monkeypatch):
    """After a call, the same inputs (another position, another cache of any capacity) run the graph
    without dynamo's guard evaluation; a new batch or layout runs with the guards, so it compiles its own
    graph instead of reusing one built for other shapes: every call's log-probs are the stock forward's."""
    from transmla.runtime.compiled_decode import StaticLatentCache, call_signature, compiled_step

    _, mla = tiny_pair("llama")
    ids = _ids(mla, batch=3, n=10)
    prompt = 5
    ref = _logprobs(mla, ids)
    skipped = []
    stance = torch.compiler.set_stance

    def spy(*args, **kwargs):  # records each call's choice, then sets the stance as asked
        skipped.append(kwargs.get("skip_guard_eval_unsafe", False))
        return stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    torch._dynamo.reset()
    with absorbed(mla):
        prefill = LatentCache(mla.config)
        with torch.no_grad():
            mla(ids[:1, :prompt], past_key_values=prefill, use_cache=True)
        step = compiled_step(mla)

        def decode(batch, capacity, blocked=None):
            cache = StaticLatentCache.from_latent_cache(prefill, batch=batch, capacity=capacity, blocked=blocked)
            got = []
            for t in range(prompt, ids.shape[1]):
                # every row is sequence 0 (the prefill repeated), fed sequence 0's next tokens
                got.append(torch.log_softmax(step(ids[:1, t : t + 1].expand(batch, 1).contiguous(), cache).float(), -1))
                cache.advance()
            assert (torch.stack(got, 1) - ref[:1, prompt:]).abs().max() < TOL
            return cache

        a = decode(3, 12)
        assert skipped == [True] * (ids.shape[1] - prompt - 1)  # the first call compiled, with its guards
        b = decode(3, 40)  # another capacity: the same graph, its guards skipped from the first call
        assert skipped.count(True) == 2 * (ids.shape[1] - prompt) - 1
        c = decode(2, 12)  # a new batch: guarded once (a new graph), then skipped
        assert skipped.count(True) == 3 * (ids.shape[1] - prompt) - 2
        sig = call_signature(ids[:, :1].contiguous(), a)
        assert sig == call_signature(ids[:, 1:2].contiguous(), b)  # position and capacity are not in it
        assert sig != call_signature(ids[:2, :1].contiguous(), c)
        assert sig != call_signature(ids[:, :1], a)  # a strided view of the ids: another graph
        from transmla.runtime import absorb as absorb_module

        kernel = absorb_module.DECODE_KERNEL
        monkeypatch.setattr(absorb_module, "DECODE_KERNEL", "bmm" if kernel != "bmm" else "sdpa")
        assert sig != call_signature(ids[:, :1].contiguous(), a)  # a setting the trace read: another graph
        monkeypatch.setattr(absorb_module, "DECODE_KERNEL", kernel)
        # where `auto` resolves by batch x capacity (a GPU: bmm, then Triton from 32,768 tokens), the kernel it
        # resolves to is in the signature: a graph traced at one capacity does not serve the other kernel
        real = absorb_module.decode_kernel
        monkeypatch.setattr(absorb_module, "decode_kernel",
                            lambda device, batch=1, length=0, dtype=None: "triton" if batch * length >= 100 else "bmm")
        assert call_signature(ids[:, :1].contiguous(), a) != call_signature(ids[:, 1:2].contiguous(), b)
        monkeypatch.setattr(absorb_module, "decode_kernel", real)
        if True in _blocked_layouts():
            rows = decode(3, 12, blocked=not a.blocked)
            assert rows.blocked != a.blocked and call_signature(ids[:, :1].contiguous(), rows) != sig


def test_compiled_steps_past_the_recompile_limit_compile_instead_of_running_eagerly(tiny_pair):
    """Dynamo keeps decode_step's graphs per code object and, past its recompile_limit, runs the function
    eagerly with only a log line: a sweep over more batch sizes than the limit would time eager steps as
    compiled. Past it the step drops the graphs and compiles, so every call runs a graph (and, the guards
    of a dropped graph not skipped, the right one): the log-probs stay the stock forward's. The limit is
    lowered to 2 here to keep the compiles few."""
    from torch._dynamo.utils import counters

    from transmla.runtime.compiled_decode import StaticLatentCache, compiled_step

    _, mla = tiny_pair("llama")
    ids = _ids(mla, batch=1, n=6)
    ref = _logprobs(mla, ids)[:, 5]
    torch._dynamo.reset()
    with absorbed(mla), torch._dynamo.config.patch(recompile_limit=2):
        prefill = LatentCache(mla.config)
        with torch.no_grad():
            mla(ids[:, :5], past_key_values=prefill, use_cache=True)

        def run(step, batch):
            cache = StaticLatentCache.from_latent_cache(prefill, batch=batch, capacity=8)
            graphs = counters["stats"]["unique_graphs"]
            got = torch.log_softmax(step(ids[:, 5:6].expand(batch, 1).contiguous(), cache).float(), -1)
            assert (got - ref).abs().max() < TOL
            return counters["stats"]["unique_graphs"] - graphs  # graphs this call compiled

        first = compiled_step(mla)
        assert [run(first, 2), run(first, 2)] == [1, 0]  # compiled once, then reused
        assert [run(compiled_step(mla), b) for b in (3, 4)] == [1, 1]  # one step per cell: the third compiles too
        assert run(first, 2) == 1  # its graph was dropped with the others: compiled again, guarded
        assert [run(first, b) for b in (3, 4, 2)] == [1, 1, 1]


def test_static_latent_cache_copies_repeats_and_refuses(tiny_pair):
    """from_latent_cache repeats each prefilled sequence to the batch; bad sizes, a full cache and models
    the compiled step cannot run are refused with the fix named (before anything compiles)."""
    from transmla.runtime.compiled_decode import StaticLatentCache, compiled_step

    orig_dir, mla = tiny_pair("llama")
    ids = _ids(mla, batch=1, n=7)
    with absorbed(mla):
        prefill = LatentCache(mla.config)
        with torch.no_grad():
            mla(ids, past_key_values=prefill, use_cache=True)
        cache = StaticLatentCache.from_latent_cache(prefill, batch=4, capacity=8, blocked=False)
        for buf, layer in zip(cache.buffers, prefill.layers, strict=True):
            assert buf.shape == (4, 8, layer.buffer.shape[-1])
            assert torch.equal(buf[:, :7], layer.buffer[:, :7].expand(4, -1, -1)) and not buf[:, 7:].any()
        if True in _blocked_layouts():  # the same tokens, 16 to a block: [B, capacity / 16, E, 16]
            from transmla.runtime.cpu_kernels import unblock_latent

            blocked = StaticLatentCache.from_latent_cache(prefill, batch=4, capacity=8, blocked=True)
            for buf, layer in zip(blocked.buffers, prefill.layers, strict=True):
                assert buf.shape == (4, 2, layer.buffer.shape[-1], 16) and blocked.capacity == 32  # >= 2 blocks
                assert torch.equal(unblock_latent(buf)[:, :7], layer.buffer[:, :7].expand(4, -1, -1))
        assert cache.get_seq_length() == 7 and not cache.position.requires_grad
        with pytest.raises(TransMLAError, match="no room"):
            StaticLatentCache.from_latent_cache(prefill, batch=4, capacity=7)
        prefill.batch_repeat_interleave(2)
        for bad in (3, 0, -2):  # 0: a reshape error; -2 passed the multiple test, then torch.zeros failed
            with pytest.raises(TransMLAError, match="multiple"):
                StaticLatentCache.from_latent_cache(prefill, batch=bad, capacity=8)
        step = compiled_step(mla)
        cache.advance()
        with pytest.raises(TransMLAError, match="full") as err:  # position 8 of capacity 8: nothing left to write
            step(ids[:, :1].expand(4, 1), cache)
        assert "capacity" in str(err.value)
    with pytest.raises(TransMLAError, match="absorbed model"):
        compiled_step(mla)  # absorb disabled again
    original = load_model(str(orig_dir))[0]
    with pytest.raises(TransMLAError, match="compiled_decode: false"):
        compiled_step(original)


def _compiled_decode(mla, ids, prompt, gemm):
    """Prefill `prompt` tokens, then decode the rest of `ids` with the compiled step on `gemm` (mla
    absorbed): (log-probs [B, n - prompt, V], the ops the steps after the first (compiling) ran)."""
    from torch.profiler import profile

    from transmla.runtime.compiled_decode import StaticLatentCache, compiled_step

    prefill = LatentCache(mla.config)
    with torch.no_grad():
        mla(ids[:, :prompt], past_key_values=prefill, use_cache=True)
    cache = StaticLatentCache.from_latent_cache(prefill, batch=ids.shape[0], capacity=ids.shape[1] + 2)
    step = compiled_step(mla, gemm=gemm)
    got = [torch.log_softmax(step(ids[:, prompt : prompt + 1], cache).float(), -1)]
    cache.advance()
    with profile() as prof:
        for t in range(prompt + 1, ids.shape[1]):
            got.append(torch.log_softmax(step(ids[:, t : t + 1], cache).float(), -1))
            cache.advance()
    return torch.stack(got, 1), {e.key for e in prof.key_averages()}


@pytest.mark.skipif("onednn" not in _packed_kernels(), reason="PyTorch built without oneDNN")
def test_compiled_decode_on_onednn_gemms(tiny_pair):
    """gemm="onednn": the batch is a dynamic dimension, so inductor prepacks the frozen linears for
    oneDNN (mkldnn::_linear_pointwise) instead of MKL (its choice at a static batch); the log-probs are the
    stock forward's."""
    from transmla.runtime.compiled_decode import compiled_step

    _, mla = tiny_pair("llama")
    ids = _ids(mla, batch=3, n=10)
    prompt = 6
    ref = _logprobs(mla, ids)
    torch._dynamo.reset()
    with absorbed(mla):
        got, ops = _compiled_decode(mla, ids, prompt, "onednn")
        with pytest.raises(TransMLAError, match="'blas'"):
            compiled_step(mla, gemm="blas")
    assert (got - ref[:, prompt:]).abs().max() < TOL
    assert "mkldnn::_linear_pointwise" in ops and "mkl::_mkl_linear" not in ops


@pytest.mark.parametrize("kernel", ["stream", "tiled"])
def test_compiled_decode_on_this_projects_gemm_kernels(tiny_pair, kernel):
    """gemm="stream" / "tiled": every linear of the compiled step is one call of that operator (on the
    stock weights, or on their tiled copies), no MKL or oneDNN linear left in the graph; the log-probs are
    the stock forward's; compiling it for a model whose linears are not packed with the kernel is refused."""
    from transmla.runtime import packed
    from transmla.runtime.compiled_decode import compiled_step

    if kernel not in _packed_kernels():
        pytest.skip(f"no {kernel} kernel here (stream: AVX2 and a C++ toolchain; tiled: AVX-512 too)")
    _, mla = tiny_pair("llama")
    ids = _ids(mla, batch=3, n=10)
    prompt = 6
    ref = _logprobs(mla, ids)
    torch._dynamo.reset()
    with absorbed(mla):
        with pytest.raises(TransMLAError, match=f"kernel='{kernel}'"):
            compiled_step(mla, gemm=kernel)
        with packed.packed(mla, batch=3, kernel="stream" if kernel == "tiled" else "tiled"):
            with pytest.raises(TransMLAError, match=f"kernel='{kernel}'"):  # packed, but for the other kernel
                compiled_step(mla, gemm=kernel)
        with packed.packed(mla, batch=3, kernel=kernel) as used:
            assert used == kernel
            got, ops = _compiled_decode(mla, ids, prompt, kernel)
    assert (got - ref[:, prompt:]).abs().max() < TOL
    assert f"transmla::{kernel}_linear" in ops
    assert not ops & {"mkldnn::_linear_pointwise", "mkl::_mkl_linear", "aten::addmm", "aten::linear"}
    # the attention: "auto" on CPU is this project's latent kernel over the blocked static cache, one call in the graph
    assert "transmla::latent_decode_blocked_cpu" in ops and "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops


@pytest.mark.skipif("tiled" not in _packed_kernels(), reason="no AVX-512 CPU or no C++ toolchain for the tiled kernel")
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 17])
def test_tiled_kernel_equals_linear(rows):
    """transmla::tiled_linear on `tile_weight`'s copy = F.linear for any row count (8-row register blocks,
    a ragged last block), output widths below, at and past a tile of 48 (a ragged last tile, masked),
    with and without bias, leading batch dimensions; the layout is tiles of 48 columns, k-major, zero past
    N; it refuses a packed weight that does not match."""
    from transmla.runtime.cpu_kernels import TILE, tile_weight, tiled_linear

    g = torch.Generator().manual_seed(rows)
    for k, n in [(13, 5), (64, 48), (600, 49), (33, 150)]:
        x, w, b = torch.randn(2, rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        p = tile_weight(w)
        assert p.shape == (-(-n // TILE), k, TILE) and p.is_contiguous()
        assert torch.equal(p.transpose(1, 2).reshape(-1, k)[:n], w) and not p.transpose(1, 2).reshape(-1, k)[n:].any()
        for bias in (b, None):
            want = torch.nn.functional.linear(x, w, bias)
            got = tiled_linear(x, p, bias, n)
            assert got.shape == want.shape
            assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(tiled_linear(x[:, :0], p, b, n), x.new_empty(2, 0, n))
    with pytest.raises(RuntimeError, match="out_features does not match"):
        tiled_linear(x, p, None, n + TILE)
    with pytest.raises(RuntimeError, match="contiguous"):
        tiled_linear(x, p.transpose(0, 1), None, n)
    with pytest.raises(RuntimeError, match="float32"):
        tiled_linear(x.double(), p.double(), None, n)


@pytest.mark.skipif("tiled" not in _packed_kernels(), reason="no AVX-512 CPU or no C++ toolchain for the tiled kernel")
def test_tiled_copies_share_one_mapping_of_huge_pages_and_are_made_once():
    """pack_all("tiled"): the copies of all weights lie in one mapping (each on its own 64-byte-aligned
    storage, in the order given) where the kernel offers 2 MB pages, compute what the weights do, and are
    made once per weight while it is unchanged."""
    from transmla.runtime import hugepages, packed

    ws = [torch.randn(n, 40) for n in (7, 48, 100)]
    packs = packed.pack_all(ws, 8, "tiled")
    x = torch.randn(8, 40)
    for w, p in zip(ws, packs):
        assert p.kernel == "tiled" and p.weight is not None
        assert (packed.linear(x, w, None, p) - x @ w.T).abs().max() < 1e-4
    if hugepages.supported():
        ptrs = [p.data.data_ptr() for p in packs]
        assert all(q % 64 == 0 for q in ptrs) and ptrs == sorted(ptrs)
        assert ptrs[-1] - ptrs[0] < 2 * sum(p.data.numel() * 4 for p in packs)  # one region, not a mapping each
        assert ptrs[0] % hugepages.HUGE == 0
    # packing the same weights again hands out the same copies (a compiled step holds them as constants);
    # a weight changed in place or given new memory gets a new copy with its new values
    again = packed.pack_all(ws, 8, "tiled")
    assert all(a.data is p.data for a, p in zip(again, packs))
    with torch.no_grad():
        ws[0].mul_(2)
    ws[1].data = torch.randn(48, 40)
    fresh = packed.pack_all(ws, 8, "tiled")
    assert fresh[0].data is not packs[0].data and fresh[1].data is not packs[1].data and fresh[2].data is packs[2].data
    assert packed.Packed(ws[2], 8, "tiled").data is fresh[2].data  # one mechanism, however a weight is packed
    for w, p in zip(ws, fresh):
        assert (packed.linear(x, w, None, p) - x @ w.T).abs().max() < 1e-4


@pytest.mark.skipif("tiled" not in _packed_kernels(), reason="no AVX-512 CPU or no C++ toolchain for the tiled kernel")
def test_linears_of_one_input_run_as_one_tiled_call(monkeypatch):
    """tiled_groups: linears of one input packed side by side (ragged widths padded to whole tiles, the biases
    joined with zeros where one has none): `linears` gives each one's F.linear from one kernel call up to
    `batch` rows, and one call each past it or for a part of the group; each weight's tiled copy is its slice
    of the group's (no second copy); packing again reuses the group, a changed weight renews it; weights of
    different input widths are refused."""
    from transmla.runtime import packed

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 40, generator=g) for n in (7, 48, 100)]
    bs = [torch.randn(7, generator=g), None, torch.randn(100, generator=g)]
    (group,) = packed.tiled_groups([(ws, bs)])
    assert group.offsets == [0, 48, 96] and group.sizes == [7, 48, 100] and group.width == 5 * 48
    assert group.bias is not None and not group.bias[7:96].any() and not group.bias[196:].any()
    packs = packed.pack_all(ws, 8, "tiled")
    start, end = group.data.data_ptr(), group.data.data_ptr() + group.data.numel() * 4
    assert all(start <= p.data.data_ptr() < end for p in packs)  # slices of the group's copy
    assert not packed.one_group(*packs)  # packed one by one: no group until it is given
    for p in packs:
        p.group = group
    assert packed.one_group(*packs) and not packed.one_group(*packs[:2]) and not packed.one_group(packs[0], None)
    calls = []
    real = packed.fused_linear
    monkeypatch.setattr(packed, "fused_linear", lambda x, grp: calls.append(grp) or real(x, grp))
    for rows, fused in ((1, 1), (6, 1), (8, 1), (9, 0)):
        x = torch.randn(rows, 40, generator=g).view(1, rows, 40)
        calls.clear()
        outs = packed.linears(x, list(zip(ws, bs, packs)))
        assert len(calls) == fused
        for out, w, b in zip(outs, ws, bs):
            want = torch.nn.functional.linear(x, w, b)
            assert out.shape == want.shape and (out - want).abs().max() < 1e-4 * want.abs().max()
    calls.clear()
    (out,) = packed.linears(x[:, :3], list(zip(ws, bs, packs))[:1])  # part of a group: its own call
    assert not calls and (out - torch.nn.functional.linear(x[:, :3], ws[0], bs[0])).abs().max() < 1e-4
    assert packed.tiled_groups([(ws, bs)])[0] is group
    with torch.no_grad():
        ws[1].mul_(2)
    (again,) = packed.tiled_groups([(ws, bs)])
    assert again is not group and torch.equal(packed.tiled_copies([ws[1]])[0], again.data[1:2])
    with pytest.raises(TransMLAError, match="one input width"):
        packed.tiled_groups([([ws[0], torch.randn(3, 41)], [None, None])])


@pytest.mark.skipif("tiled" not in _packed_kernels(), reason="no AVX-512 CPU or no C++ toolchain for the tiled kernel")
def test_fused_query_and_latent_projection_with_biases_decode_like_the_stock_layout(monkeypatch):
    """A DeepseekV3 with attention biases and no query LoRA, absorbed (query folded) and packed "tiled": the
    folded query and kv_a_proj_with_mqa (its bias) run as one call per layer and step, gate and up as
    another, and the decode gives the stock forward's log-probs, eager and compiled."""
    from transmla.runtime import packed

    model = _random_dsv3(attention_bias=True)
    ids = _ids(model, batch=3, n=12)
    ref = _logprobs(model, ids)
    sizes = []
    real = packed.fused_linear
    monkeypatch.setattr(packed, "fused_linear", lambda x, g: sizes.append(tuple(g.sizes)) or real(x, g))
    with absorbed(model, fold=True), packed.packed(model, batch=3, kernel="tiled"):
        got = _incremental(model, ids, 6, LatentCache(model.config))
        c = model.config
        q_kv = (c.num_attention_heads * (c.kv_lora_rank + c.qk_rope_head_dim), c.kv_lora_rank + c.qk_rope_head_dim)
        assert sizes.count(q_kv) == sizes.count((c.intermediate_size,) * 2) == 6 * c.num_hidden_layers
        monkeypatch.undo()  # the compiled step traces the kernel call itself
        torch._dynamo.reset()
        compiled, ops = _compiled_decode(model, ids, 6, "tiled")
    assert "transmla::tiled_linear" in ops
    assert (got - ref).abs().max() < TOL and (compiled - ref[:, 6:]).abs().max() < TOL


@pytest.mark.skipif("stream" not in _packed_kernels(), reason="no AVX2 CPU or no C++ toolchain for the stream kernel")
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_stream_kernel_equals_linear(rows):
    """transmla::stream_linear = F.linear for any row count (the 8-row register blocks, a ragged last
    block, tiles of weight rows), a width that is not a multiple of 8, with and without bias, and
    leading batch dimensions; it refuses what it does not compute."""
    from transmla.runtime.cpu_kernels import stream_linear

    g = torch.Generator().manual_seed(rows)
    for k, n in [(13, 5), (64, 40), (600, 49)]:
        x, w, b = torch.randn(2, rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for bias in (b, None):
            want = torch.nn.functional.linear(x, w, bias)
            got = stream_linear(x, w, bias)
            assert got.shape == want.shape
            assert (got - want).abs().max() < 1e-4 * want.abs().max()
        assert torch.equal(stream_linear(x[:, :0], w, b), x.new_empty(2, 0, n))
    with pytest.raises(RuntimeError, match="float32"):
        stream_linear(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"weight \[N, K\]"):
        stream_linear(x, w.T.contiguous(), None)


def test_compiled_decode_in_decode_step(tiny_pair):
    """decode_step(compiled=True) runs the absorbed steps as the compiled graph: the row says so, with the
    compile time, the packed weights off (inductor packs its own), and the cache it measured."""
    _, converted = tiny_pair("llama")
    row = decode_step(converted, "absorb", context=12, batch=2, steps=3, threads=1, compiled=True, packed_weights=True)
    assert row["compiled"] is True and row["compile_s"] > 0 and row["packed_weights"] is False
    assert row["cache_length_end"] == 12 + 2 + 3
    assert row["kv_bytes_per_token_measured"] == row["kv_bytes_per_token"] == kv_bytes_per_token(converted.config, "absorb")
    assert row["latent_layout"] == ("blocked" if True in _blocked_layouts() else "rows")
    assert not is_absorbed(converted)
    static = decode_step(converted, "static", context=12, batch=2, steps=2, threads=1, compiled=True)
    assert static["compiled"] is False and static["compile_s"] is None  # only absorb has a compiled step
    assert static["latent_layout"] is None


def test_compiled_decode_over_a_latent_cache_in_huge_pages(tiny_pair):
    """The static latent cache moved into 2 MB pages (throughput.cache_to_hugepages) is the same input to
    the compiled step: the same graph, the same logits at every step as over the cache where it was."""
    from transmla.runtime import hugepages
    from transmla.runtime.compiled_decode import StaticLatentCache, compiled_step
    from transmla.runtime.throughput import cache_to_hugepages

    if not hugepages.supported():
        pytest.skip("no transparent huge pages on this kernel")
    _, mla = tiny_pair("llama")
    ids = _ids(mla, batch=2, n=10)
    with absorbed(mla), torch.no_grad():
        prefill = LatentCache(mla.config)
        mla(ids[:, :5], past_key_values=prefill, use_cache=True)
        here = StaticLatentCache.from_latent_cache(prefill, batch=2, capacity=20)
        moved = StaticLatentCache.from_latent_cache(prefill, batch=2, capacity=20)
        assert cache_to_hugepages(moved) is True
        assert all(b.data_ptr() % hugepages.HUGE == 0 for b in moved.buffers)
        step = compiled_step(mla)
        for t in range(5, 10):
            assert torch.equal(step(ids[:, t : t + 1], here), step(ids[:, t : t + 1], moved))
            here.advance()
            moved.advance()
    for a, b in zip(here.buffers, moved.buffers, strict=True):
        assert torch.equal(a, b)
    row = decode_step(mla, "absorb", context=12, batch=2, steps=2, threads=1, compiled=True, hugepages=True)
    assert row["cache_hugepages"] is True


def test_compiled_decode_one_graph_for_every_context(tiny_pair):
    """On a model absorbed once (as the throughput task keeps it), every decode_step call, at any context
    and seed, reuses one compiled graph: the capacity is dynamic and the absorbed matrices stay the same
    tensors. Re-absorbing makes new matrices, which the frozen graph cannot hold: it compiles again."""
    from torch._dynamo.utils import counters

    _, converted = tiny_pair("llama")
    torch._dynamo.reset()
    counters.clear()
    with absorbed(converted):
        rows = [decode_step(converted, "absorb", context=c, batch=2, steps=2, threads=1, compiled=True, seed=s)
                for c, s in ((12, 0), (12, 1), (20, 0))]
        assert counters["stats"]["unique_graphs"] == 1
    assert all(r["compiled"] for r in rows) and [r["cache_length_end"] for r in rows] == [16, 16, 24]
    decode_step(converted, "absorb", context=12, batch=2, steps=2, threads=1, compiled=True)  # absorbed anew
    assert counters["stats"]["unique_graphs"] == 2


def test_a_latent_cache_reset_follows_a_cast_model_and_a_filled_one_is_refused():
    """After reset() a LatentCache serves a model cast to another dtype as a new cache would (its buffer was
    kept, the latents cast into it, and SDPA failed on mixed dtypes); a cache still holding tokens of the old
    dtype is one clear error naming reset()."""
    model = _random_dsv3()
    ids = torch.randint(2, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = LatentCache(model.config)
    with torch.no_grad(), absorbed(model):
        model(ids, past_key_values=cache, use_cache=True)
        model.to(torch.bfloat16)
        with pytest.raises(TransMLAError, match="reset"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        cache.reset()
        got = model(ids, past_key_values=cache, use_cache=True).logits
        want = model(ids, past_key_values=LatentCache(model.config), use_cache=True).logits
    assert cache.layers[0].buffer.dtype == torch.bfloat16 and torch.equal(got, want)

"""The native decode step (transmla.runtime.native_decode, csrc/native_decode.cpp) equals the stock forward, writes
the latents the eager absorbed forward caches, and refuses what it does not run. Tiny models only; no test asserts a
wall-clock time."""

from pathlib import Path

import pytest
import torch
from test_absorb import TOL, _ids, _incremental, _logprobs, _random_dsv3
from torch import nn

from transmla.errors import TransMLAError
from transmla.runtime import cpu_kernels, packed
from transmla.runtime.absorb import LatentCache, absorbed

pytestmark = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.has_avx512()),
                                reason="no AVX-512 CPU or no C++ toolchain for the native step")


def _with_mlp_biases(model):
    """Every MLP linear given a random bias (DeepseekV3MLP has none; the fused gate/up bias and the down bias paths)."""
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(layer.mlp, name)
            new = nn.Linear(old.in_features, old.out_features, bias=True)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(torch.randn(old.out_features, generator=g) * 0.3)
            setattr(layer.mlp, name, new)
    return model


def _native_decode(model, ids, prompt, batch_pack=None):
    """Log-probs of the native step at every position after a prefill of `prompt` tokens, and its cache."""
    from transmla.runtime.compiled_decode import StaticLatentCache
    from transmla.runtime.native_decode import native_step

    B = ids.shape[0]
    prefill = LatentCache(model.config)
    with torch.no_grad():
        model(ids[:, :prompt], past_key_values=prefill, use_cache=True)
    cache = StaticLatentCache.from_latent_cache(prefill, batch=B, capacity=ids.shape[1] + 3, blocked=True)
    with packed.packed(model, batch=batch_pack or B, kernel="tiled"):
        step = native_step(model)
        got = []
        for t in range(prompt, ids.shape[1]):
            got.append(torch.log_softmax(step(ids[:, t : t + 1], cache).float(), -1))
            cache.advance()
    return torch.stack(got, 1), cache


@pytest.mark.parametrize("variant", [
    dict(),  # interleaved RoPE, no biases
    dict(rope_interleave=False, attention_bias=True),  # rotate_half RoPE; kv_a and o_proj biases
    dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                              mscale_all_dim=1.0, mscale=1.0, beta_fast=32, beta_slow=1)),  # YaRN: mscale in the scale
])
@pytest.mark.parametrize("batch", [3, 10])  # one ragged block of rows; a full block of 8 and a ragged one
def test_native_step_equals_the_stock_forward(variant, batch):
    """The native step's log-probs at every decoded position equal the stock full forward's, and it writes the
    latents the eager absorbed forward caches (and nothing past the current token), for both RoPE layouts, biases
    on every linear that can have one and more rows than one register block."""
    from transmla.runtime.cpu_kernels import unblock_latent

    model = _with_mlp_biases(_random_dsv3(**variant))
    ids = _ids(model, batch=batch, n=16)
    prompt = 5
    ref = _logprobs(model, ids)
    with absorbed(model, fold=True):
        eager = LatentCache(model.config)
        _incremental(model, ids, prompt, eager)
        got, cache = _native_decode(model, ids, prompt)
    assert (got - ref[:, prompt:]).abs().max() < TOL
    T = ids.shape[1]
    assert cache.get_seq_length() == T
    for buf, layer in zip(cache.buffers, eager.layers, strict=True):
        rows = unblock_latent(buf)
        assert (rows[:, :T] - layer.buffer[:, :T]).abs().max() < 1e-5
        assert not rows[:, T:].any()


def test_native_step_across_blocks_and_chunks_and_thread_counts():
    """Past a block of 16 keys and a chunk of 256 (the attention's work items), the log-probs still equal the stock
    forward's; one thread and two give the same bits (each thread takes whole tiles, rows and work items)."""
    model = _random_dsv3(max_position_embeddings=512)
    ids = _ids(model, batch=2, n=270)
    prompt = 250
    ref = _logprobs(model, ids)
    old = torch.get_num_threads()
    try:
        with absorbed(model, fold=True):
            torch.set_num_threads(2)
            two, _ = _native_decode(model, ids, prompt)
            torch.set_num_threads(1)
            one, _ = _native_decode(model, ids, prompt)
    finally:
        torch.set_num_threads(old)
    assert (two - ref[:, prompt:]).abs().max() < TOL
    assert torch.equal(one, two)


def test_native_step_refuses_what_it_does_not_run():
    """Each model or cache it cannot run gets one TransMLAError naming the fix (the compiled step), before any work."""
    from transmla.runtime.compiled_decode import StaticLatentCache
    from transmla.runtime.native_decode import native_step, unsupported

    model = _random_dsv3()
    ids = _ids(model, batch=2, n=6)
    with pytest.raises(TransMLAError, match="not absorbed") as err:
        native_step(model)
    assert "compiled step" in str(err.value)
    with absorbed(model, fold=True):
        assert "not packed" in unsupported(model)
        with packed.packed(model, batch=2, kernel="stream"):
            assert "not packed with the 'tiled' kernel" in unsupported(model)
        with packed.packed(model, batch=2, kernel="tiled"):
            assert unsupported(model) is None
            step = native_step(model)
            prefill = LatentCache(model.config)
            with torch.no_grad():
                model(ids[:, :4], past_key_values=prefill, use_cache=True)
            rows = StaticLatentCache.from_latent_cache(prefill, batch=2, capacity=8, blocked=False)
            with pytest.raises(TransMLAError, match="blocked float32"):
                step(ids[:, 4:5], rows)
            full = StaticLatentCache.from_latent_cache(prefill, batch=2, capacity=8, blocked=True)
            full.advance(full.capacity - full.get_seq_length())
            with pytest.raises(TransMLAError, match="full"):
                step(ids[:, 4:5], full)
    with absorbed(model, fold=False), packed.packed(model, batch=2, kernel="tiled"):
        assert "not folded" in unsupported(model)
    lora = _random_dsv3(q_lora_rank=24)
    with absorbed(lora, fold=True), packed.packed(lora, batch=2, kernel="tiled"):
        assert "query LoRA" in unsupported(lora)
    moe = _random_dsv3(first_k_dense_replace=1)
    with absorbed(moe, fold=True), packed.packed(moe, batch=2, kernel="tiled"):
        assert "mixture of experts" in unsupported(moe)
    gelu = _random_dsv3(hidden_act="gelu")
    with absorbed(gelu, fold=True), packed.packed(gelu, batch=2, kernel="tiled"):
        assert "not SiLU" in unsupported(gelu)


def test_native_step_operator_checks_its_operands():
    """The operator refuses operands whose shapes do not match (a wrong tile count, a cache of another width, a
    position past the capacity) instead of reading past them."""
    from transmla.runtime.compiled_decode import StaticLatentCache
    from transmla.runtime.native_decode import layer_tensors

    model = _random_dsv3()
    c = model.config
    E = c.kv_lora_rank + c.qk_rope_head_dim
    with absorbed(model, fold=True), packed.packed(model, batch=2, kernel="tiled"):
        weights, ints, floats = [], [], []
        for layer in model.model.layers:
            t, i, f = layer_tensors(layer)
            weights, ints, floats = weights + t, ints + i, floats + f
        cache = StaticLatentCache(
            [torch.zeros(2, 2, E, 16) for _ in model.model.layers], length=3)
        head = getattr(model.lm_head, packed.ATTR).data
        R = c.qk_rope_head_dim
        args = dict(heads=c.num_attention_heads, rank=c.kv_lora_rank, rope_dim=R, vocab=c.vocab_size,
                    rope_interleave=True, final_eps=1e-6)
        op = torch.ops.transmla.absorbed_decode_step
        x, cs = torch.randn(2, c.hidden_size), torch.ones(R)

        def run(weights=weights, caches=cache.buffers, position=3, head=head):
            return op(x, weights, caches, ints, floats, cs, cs, model.model.norm.weight.detach(), head, torch.empty(0),
                      position=position, **args)

        assert run().shape == (2, c.vocab_size)
        with pytest.raises(RuntimeError, match="fused query / kv_a"):
            run(weights=[w[:1] if k == 1 else w for k, w in enumerate(weights)])
        with pytest.raises(RuntimeError, match="cache 0"):
            run(caches=[torch.zeros(2, 2, E + 1, 16)] + cache.buffers[1:])
        with pytest.raises(RuntimeError, match="outside the cache"):
            run(position=32)
        with pytest.raises(RuntimeError, match="head"):
            run(head=head[:-1])


def test_native_decode_in_decode_step():
    """decode_step(compiled=True, native=True) steps natively where the model allows (the row says "native", no
    compile time, the blocked cache it measured) and falls back to the compiled graph where not (a query LoRA)."""
    from transmla.runtime.absorb import is_absorbed
    from transmla.runtime.throughput import decode_step, kv_bytes_per_token

    model = _random_dsv3()
    row = decode_step(model, "absorb", context=12, batch=2, steps=3, threads=1, compiled=True, native=True, gemm="tiled")
    assert row["decode_loop"] == "native" and row["compile_s"] is None and row["latent_layout"] == "blocked"
    assert row["cache_length_end"] == 12 + 2 + 3
    assert row["kv_bytes_per_token_measured"] == kv_bytes_per_token(model.config, "absorb")
    assert not is_absorbed(model) and not packed.is_packed(model)
    lora = _random_dsv3(q_lora_rank=24)
    row = decode_step(lora, "absorb", context=12, batch=2, steps=2, threads=1, compiled=True, native=True, gemm="tiled")
    assert row["decode_loop"] == "compiled" and row["compile_s"] > 0
    eager = decode_step(model, "absorb", context=12, batch=2, steps=2, threads=1, native=True)
    assert eager["decode_loop"] is None  # native applies to the compiled runs only


def test_every_kernel_source_is_package_data():
    """The kernels compile from transmla/runtime/csrc on first use: an installed (non-editable) package shipped the
    .cpp files only, and their #include'd headers were missing."""
    import fnmatch
    import tomllib

    repo = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["transmla.runtime"]
    files = [p.relative_to(repo / "transmla" / "runtime").as_posix() for p in (repo / "transmla/runtime/csrc").iterdir()]
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)

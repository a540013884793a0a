"""Layer-by-layer calibration and the least-squares refit (pipeline.stream, method.refit) on tiny
random Llama/Qwen2 models: lossless where they must be, and the streamed statistics are those of
the converted model itself."""

import pytest
import torch

from transmla.adapters import read_spec
from transmla.convert import ConvertOptions, assemble, convert_layers, mla_shapes, resolve_budget
from transmla.io.data import load_texts
from transmla.io.export import instantiate
from transmla.io.sources import load_model
from transmla.method.calibration import calibration_ids, collect_stats
from transmla.method.refit import RefitMoments, composite, factor_head, head_blocks, refit_output, solve_block
from transmla.pipeline.layer import refit_step
from transmla.pipeline.stream import LayerStream


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    ids = calibration_ids(tok, load_texts("wikitext2-train"), 8, 64, seed=0)
    return model, tok, read_spec(model.config), ids


def _convert(tiny, o):
    model, _, spec, ids = tiny
    budget = resolve_budget(spec, o)
    stats = collect_stats(model, ids, 4, progress=False) if o.normalized().calibration != "sequential" else None
    stream = LayerStream(model, ids, 4, progress=False) if o.streamed else None
    layers, diags = convert_layers(model, stats, spec, budget, o, progress=False, stream=stream)
    return budget, layers, diags


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


@pytest.mark.parametrize("mode", [dict(calibration="sequential"), dict(calibration="two_pass")])
def test_streamed_conversion_is_lossless_at_full_rank(tiny, mode):
    """All RoPE kept and full rank: every calibration mode reproduces the model (lossless has no refit:
    a damped least squares on finite data would only perturb an exact W_UV; test_refit_is_exact_at_full_rank)."""
    model, tok, spec, ids = tiny
    o = ConvertOptions(lossless=True, **mode)
    budget, layers, _ = _convert(tiny, o)
    mla = instantiate(*assemble(model, spec, budget, layers, o))
    text = tok("\n\n".join(load_texts("wikitext2-test")[1:30]), return_tensors="pt").input_ids[:, :200]
    assert (_logprobs(mla, text) - _logprobs(model, text)).abs().max() < 1e-3


def test_sequential_moments_are_those_of_the_converted_model(tiny):
    """Layer l's streamed moments = E[x x^T] of layer l's attention input when the exported (stock
    DeepseekV3) model runs the calibration set: the stream sees what the user's model computes."""
    model, _, spec, ids = tiny
    o = ConvertOptions(qk_rope_dim=4, kv_lora_rank=8, calibration="sequential", refit=True)
    budget, layers, _ = _convert(tiny, o)
    mla = instantiate(*assemble(model, spec, budget, layers, o))
    converted = collect_stats(mla, ids, 4, progress=False)

    stream = LayerStream(model, ids, 4, progress=False)
    s = mla_shapes(spec, budget, o)
    for i in range(spec.n_layers):
        m = stream.moments(i)
        ref = converted.moments(i)
        assert torch.allclose(m.xx, ref.xx, rtol=1e-4, atol=1e-5 * ref.xx.abs().max())
        assert torch.allclose(m.mean, ref.mean, rtol=1e-4, atol=1e-5 * ref.mean.abs().max())
        stream.advance(i, layers[i], s)
    # and the stream differs from the original model's statistics past layer 0 (the test can fail)
    original = collect_stats(model, ids, 4, progress=False)
    assert not torch.allclose(original.moments(1).xx, converted.moments(1).xx, rtol=1e-3)


def test_refit_is_exact_at_full_rank(tiny):
    """With the scores exact (all RoPE kept, full rank), the refit's least squares recovers each layer's own
    output on the calibration tokens (residual ~0), and the model refit layer by layer still gives the original
    log-probs on held-out text."""
    from transmla.adapters import attention_weights
    from transmla.config import REFIT_DAMP
    from transmla.pipeline.layer import value_bias

    model, tok, spec, ids = tiny
    o = ConvertOptions(lossless=True, calibration="sequential")
    budget, layers, _ = _convert(tiny, o)
    stream = LayerStream(model, ids, 4, progress=False)
    s = mla_shapes(spec, budget, o)
    refit = []
    for i, layer in enumerate(layers):
        blocks = stream.refit_moments(i, layer, s, value_bias(attention_weights(model, i), spec), max_dim=4096)
        assert len(blocks) == 1
        new, diag = refit_step(layer, blocks, spec, damp=REFIT_DAMP)
        assert diag["refit_residual"] < 1e-5 and diag["refit_residual_before"] < 1e-5  # float32 activations
        stream.advance(i, new, s)
        refit.append(new)
    mla = instantiate(*assemble(model, spec, budget, refit, o))
    text = tok("\n\n".join(load_texts("wikitext2-test")[1:30]), return_tensors="pt").input_ids[:, :200]
    assert (_logprobs(mla, text) - _logprobs(model, text)).abs().max() < 1e-3


def _synthetic_block(h=3, d=5, r=4, D=7, n=4000, noise=0.1, seed=0):
    torch.manual_seed(seed)
    M = torch.randn(D, h * r, dtype=torch.float64)
    Z = torch.randn(n, h * r, dtype=torch.float64) @ torch.randn(h * r, h * r, dtype=torch.float64)
    Y = Z @ M.T + noise * torch.randn(n, D, dtype=torch.float64)
    return M, Z, Y, RefitMoments(range(h), Z.T @ Z / n, Y.T @ Z / n, float(Y.pow(2).sum() / n))


def test_refit_solves_the_normal_equations():
    """solve_block is the least-squares solution over all heads jointly: on synthetic Z, Y = M Z + noise it
    equals lstsq and beats M itself."""
    M, Z, Y, m = _synthetic_block()
    fit = solve_block(m, damp=0.0)
    assert torch.allclose(fit, torch.linalg.lstsq(Z, Y).solution.T, atol=1e-10)
    assert m.residual(fit) <= m.residual(M)


def test_refit_factors_into_deepseek_shapes():
    """refit_output returns o_proj [D, h d] and W_UV [h, d, r] whose products are the joint fit: exactly when
    r <= d; when r > d, the rank-d truncation, which loses less on the latents than a plain SVD truncation."""
    h, d, r, D = 3, 5, 4, 7
    M, Z, Y, m = _synthetic_block(h, d, r, D)
    o, w, diag = refit_output([m], torch.zeros(D, h * d, dtype=torch.float64), torch.zeros(h, d, r, dtype=torch.float64), 0.0)
    assert o.shape == (D, h * d) and w.shape == (h, d, r)
    assert torch.allclose(composite(o, w, range(h)), solve_block(m, 0.0), atol=1e-9)
    assert diag["refit_residual_before"] == pytest.approx(1.0) and diag["refit_residual"] < 0.01

    d = 2  # r = 4 > d: truncation in the latents' metric
    fit = solve_block(m, 0.0)
    for a in range(h):
        mi, zi = fit[:, a * r : (a + 1) * r], m.zz[a * r : (a + 1) * r, a * r : (a + 1) * r]
        oi, wi = factor_head(mi, zi, d)
        U, S, Vh = torch.linalg.svd(mi, full_matrices=False)
        plain = (U[:, :d] * S[:d]) @ Vh[:d]
        err = lambda x: torch.trace((mi - x) @ zi @ (mi - x).T)  # noqa: E731
        assert oi.shape == (D, d) and wi.shape == (d, r)
        assert err(oi @ wi) <= err(plain) + 1e-9


def test_refit_in_blocks_of_heads(tiny):
    """head_blocks partitions the heads by max_dim. On a lossy conversion, a refit one head per block (each
    reproducing its own head's share of Y) lowers the output residual, and fitting all heads jointly lowers
    it further."""
    assert head_blocks(14, 48, 4096) == [range(0, 14)]
    assert head_blocks(32, 512, 4096) == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert head_blocks(4, 600, 512) == [range(i, i + 1) for i in range(4)]
    from transmla.adapters import attention_weights
    from transmla.pipeline.layer import value_bias

    model, _, spec, ids = tiny
    o = ConvertOptions(qk_rope_dim=4, kv_lora_rank=8, refit=False)
    budget, layers, _ = _convert(tiny, o)
    s = mla_shapes(spec, budget, o)
    vb = value_bias(attention_weights(model, 0), spec)
    per_head = LayerStream(model, ids, 4, progress=False).refit_moments(0, layers[0], s, vb, max_dim=s.r)
    joint = LayerStream(model, ids, 4, progress=False).refit_moments(0, layers[0], s, vb, max_dim=4096)
    assert [b.heads for b in per_head] == [range(i, i + 1) for i in range(spec.h)]
    by_head, _ = refit_step(layers[0], per_head, spec, damp=1e-6)
    _, d_joint = refit_step(layers[0], joint, spec, damp=1e-6)
    d, heads = spec.d, range(spec.h)
    full = joint[0].residual  # the whole layer's output residual
    residual_by_head = full(composite(by_head.o_proj, by_head.kv_b_proj.view(spec.h, 2 * d, -1)[:, d:], heads))
    assert d_joint["refit_residual"] < residual_by_head < d_joint["refit_residual_before"]


def test_advance_after_refit_reuses_the_latents_correctly(tiny):
    """advance() after refit_moments() reuses the attention-weighted latents with the refit W_UV and o_proj: the hidden
    states equal those of a fresh stream pushed through the refit layer."""
    from transmla.adapters import attention_weights
    from transmla.pipeline.layer import value_bias

    model, _, spec, ids = tiny
    o = ConvertOptions(qk_rope_dim=4, kv_lora_rank=8)
    budget, layers, _ = _convert(tiny, o.replace(refit=False))
    s = mla_shapes(spec, budget, o)
    reused, fresh = LayerStream(model, ids, 4, progress=False), LayerStream(model, ids, 4, progress=False)
    m = reused.refit_moments(0, layers[0], s, value_bias(attention_weights(model, 0), spec), max_dim=4096)
    refit, _ = refit_step(layers[0], m, spec, damp=1e-6)
    assert not torch.allclose(refit.kv_b_proj, layers[0].kv_b_proj)
    assert reused._z is not None  # small z: kept
    reused.advance(0, refit, s)
    fresh.advance(0, refit, s)
    for a, b in zip(reused.h, fresh.h):
        assert torch.allclose(a, b, atol=1e-5 * b.abs().max())


def test_refit_moments_from_the_original_query(tiny, monkeypatch):
    """The refit's pass derives the MLA query from the original attention's q_proj output (query_map) where
    the MLA q_proj is a per-head map of it (TransMLA's scaled, RoRoPE-rotated heads; Llama: plain q_proj).
    The moments equal those from the MLA q_proj itself; a q_proj that is no such map gets no shortcut."""
    from transmla.adapters import attention_weights
    from transmla.pipeline import stream as stream_mod
    from transmla.pipeline.layer import value_bias

    model, _, spec, ids = tiny
    o = ConvertOptions(qk_rope_dim=4, kv_lora_rank=8, refit=False)
    budget, layers, _ = _convert(tiny, o)
    s = mla_shapes(spec, budget, o)
    vb = value_bias(attention_weights(model, 0), spec)
    t = layers[0].to_tensors()
    qmap = LayerStream._query_map(model.model.layers[0].self_attn, t, s)
    if "q_proj.weight" not in t:  # Qwen2's q bias: the MLA query is a low-rank carrier, computed from x
        assert qmap is None
        return
    assert qmap is not None and qmap.shape == (spec.h, t["q_proj.weight"].shape[0] // spec.h, spec.d)
    # a query that mixes heads is no per-head map of the original one
    mixed = t["q_proj.weight"].roll(spec.d, 0) + 0.1 * t["q_proj.weight"]
    assert stream_mod.query_map(mixed, model.model.layers[0].self_attn.q_proj.weight, spec.h) is None
    fast = LayerStream(model, ids, 4, progress=False).refit_moments(0, layers[0], s, vb, max_dim=4096)
    monkeypatch.setattr(LayerStream, "_query_map", staticmethod(lambda *a: None))
    slow = LayerStream(model, ids, 4, progress=False).refit_moments(0, layers[0], s, vb, max_dim=4096)
    for a, b in zip(fast, slow):
        assert torch.allclose(a.zz, b.zz, rtol=1e-4, atol=1e-6 * b.zz.abs().max())
        assert torch.allclose(a.yz, b.yz, rtol=1e-4, atol=1e-6 * b.yz.abs().max())
        assert a.yy == pytest.approx(b.yy, rel=1e-6)


@pytest.mark.parametrize("max_scores", [1 << 25, 3 * 2 * 16 * 16])  # one chunk of heads; chunks of 3 heads
def test_shared_key_attention_matches_sdpa(max_scores):
    from transmla.pipeline.stream import shared_key_attention

    g = torch.Generator().manual_seed(0)
    B, h, T, e, r = 2, 7, 16, 12, 5
    q, key, value = torch.randn(B, h, T, e, generator=g), torch.randn(B, T, e, generator=g), torch.randn(B, T, r, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, key[:, None].expand(B, h, T, e), value[:, None].expand(B, h, T, r), is_causal=True, scale=0.3)
    got = shared_key_attention(q, key, value, 0.3, max_scores)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [4, 5, 64])  # several query blocks (one ragged), and one block for all 19 rows
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("scaled", [False, True])
def test_shared_key_attention_blocks_match_full_scores(block, window, scaled):
    """The query-block loop (keys up to each block's end, from its window start) equals full T x T scores
    masked causally (and by the window), with and without per-head key scales."""
    from transmla.pipeline.stream import shared_key_attention

    g = torch.Generator().manual_seed(1)
    B, h, T, e, r = 2, 3, 19, 8, 5
    q, key, value = torch.randn(B, h, T, e, generator=g), torch.randn(B, T, e, generator=g), torch.randn(B, T, r, generator=g)
    key_scale = torch.rand(B, h, T, generator=g) + 0.5 if scaled else None
    s = 0.3 * torch.einsum("bhte,bue->bhtu", q, key)
    if scaled:
        s = s * key_scale[:, :, None, :]
    t, u = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (u <= t) & ((t - u < window) if window is not None else True)
    want = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ value[:, None]
    got = shared_key_attention(q, key, value, 0.3, key_scale=key_scale, window=window, block=block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [1, 5, 9])
def test_gram_is_x_transpose_x(n):
    from transmla.method.linalg import gram

    x = torch.randn(50, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    torch.testing.assert_close(gram(x), x.T @ x)


def test_query_map_is_reproducible():
    """query_map returns the same bits on every call for the same input (SmolLM2's shapes at the 68.75% cut:
    9 heads, 576 x 64 -> 96). LAPACK's default gelsy gave a different rounding nearly every call on this CPU,
    and the sequential refit turned that into a different conversion on every run."""
    from transmla.pipeline.stream import query_map

    g = torch.Generator().manual_seed(0)
    h, D, d, e = 9, 576, 64, 96
    wq = torch.randn(h * d, D, generator=g)
    A = torch.randn(h, e, d, generator=g, dtype=torch.float64)
    mla_q = torch.einsum("hed,hdD->heD", A, wq.double().view(h, d, D)).reshape(h * e, D).float()
    maps = [query_map(mla_q, wq, h) for _ in range(12)]
    assert maps[0] is not None and maps[0].shape == (h, e, d)
    assert torch.allclose(maps[0], A, atol=1e-3 * A.abs().max())
    for m in maps[1:]:
        assert torch.equal(m, maps[0])

"""Degenerate but valid inputs of the method steps (a frequency group the queries never read, NoPE keys
that vanish, a query bias at full q rank, a corpus of exactly one window) and the requests refused
before any work (conflicting budgets, odd head dims). Small random GQA layers, float64."""

import pytest
import torch

from transmla.adapters import AttentionWeights, GQASpec
from transmla.config import ConvertOptions
from transmla.errors import TransMLAError
from transmla.method.bkv import bkv_alpha
from transmla.method.calibration import LayerMoments, calibration_ids
from transmla.method.mla import MLALayer, build_mla_layer, query_weights
from transmla.method.rope import inv_freq, lossless_plan, standard_plan
from transmla.method.rorope import rorope
from transmla.pipeline.basis import basis_step
from transmla.pipeline.budget import resolve_budget
from transmla.pipeline.layer import layer_step
from transmla.pipeline.rotation import rotation_step
from transmla.pipeline.stream import MLAShapes, mla_attention

F64 = torch.float64


def _spec(h, g, d, D):
    return GQASpec("llama", D, h, g, d, 1, 10000.0, 1e-6, 10, 10, "silu", 512, False, None, None, None)


def _weights(h, g, d, D, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    w = AttentionWeights(r(h * d, D) / D**0.5, r(g * d, D) / D**0.5, r(g * d, D) / D**0.5, r(D, h * d) / (h * d) ** 0.5)
    if bias:
        w.bq, w.bk, w.bv = r(h * d) * 0.5, r(g * d) * 0.5, r(g * d) * 0.5
    return w


def _inputs(T, D, seed=1):
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(seed), dtype=F64)
    X = x.reshape(-1, D)
    return x, LayerMoments(X.T @ X / X.shape[0], X.mean(0))


def _cos_sin(T, d):
    ang = torch.arange(T, dtype=F64)[:, None] * inv_freq(10000.0, d)[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos()[None], emb.sin()[None]


def _gqa(x, w, h, g, d, cos, sin):
    """The original attention (rotate_half RoPE, causal, scale d^-1/2)."""
    B, T, _ = x.shape

    def proj(W, b, n):
        return (x @ W.T + (0 if b is None else b)).view(B, T, n, d).transpose(1, 2)

    def rope(t):
        return t * cos[:, None] + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin[:, None]

    q, k, v = rope(proj(w.wq, w.bq, h)), rope(proj(w.wk, w.bk, g)), proj(w.wv, w.bv, g)
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = q @ k.transpose(-1, -2) * d**-0.5 + torch.full((T, T), float("-inf"), dtype=F64).triu(1)
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, h * d) @ w.wo.T


def _convert(w, m, spec, plan, rank, freqfold=1, metric="key", q_lora=None):
    rot = rotation_step(w, m, spec, plan, "transmla", freqfold, metric)
    basis = basis_step(w, m, spec, rot, rank, "transmla", True, "activations", False)
    return layer_step(w, m, spec, rot, basis, q_lora, 1e-6)[0], rot, basis


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("freqfold", [1, 2])
def test_query_metric_rorope_with_a_query_less_frequency_group(freqfold):
    """Queries that never read one FreqFold group (e.g. a QK-norm weight of zero there): that group falls back
    to the key PCA instead of Q^-1/2 of a zero matrix, so the weights stay bounded and float32 runs the layer
    (it used to get ~1e154 entries: inf in float32, NaN logits); at FreqFold 1, full rank and all RoPE kept,
    the layer is still exact."""
    h, g, d, D, T = 4, 2, 16, 64, 24
    w = _weights(h, g, d, D)
    for i in range(h):  # every head: the real and imaginary dims of the group's frequencies
        for l in range(freqfold):
            w.wq[i * d + l] = 0
            w.wq[i * d + l + d // 2] = 0
    x, m = _inputs(T, D)
    spec = _spec(h, g, d, D)
    plan = lossless_plan(d, g)
    R = 2 * len(plan)
    layer, rot, _ = _convert(w, m, spec, plan, 2 * g * d - R, freqfold, "query")
    assert rot.query_T.abs().max() < 1e3 and torch.allclose(rot.query_T @ rot.T.T, torch.eye(g * d, dtype=F64), atol=1e-8)
    assert 0 <= rot.energy <= 1
    t = layer.to_tensors()
    assert all(torch.isfinite(v.float()).all() for v in t.values())
    cos, sin = _cos_sin(T, d)
    shapes = MLAShapes(h, d, R, 2 * g * d - R, 1e-6, tuple(plan))
    out = mla_attention(x, t, shapes, cos, sin)
    out32 = mla_attention(x.float(), {k: v.float() for k, v in t.items()}, shapes, cos.float(), sin.float())
    assert _rel(out32.double(), out) < 1e-4  # the export's float32 runs the same layer
    if freqfold == 1:  # FreqFold > 1 rotates a group at one frequency: not exact by design
        assert _rel(out, _gqa(x, w, h, g, d, cos, sin)) < 1e-8


@pytest.mark.parametrize("metric", ["key", "query"])
@pytest.mark.parametrize("freqfold", [1, 2, 4])
@pytest.mark.parametrize("g", [1, 2])
def test_every_coordinate_kept_is_exact_at_any_freqfold(g, freqfold, metric):
    """RoPE on every coordinate of the merged key at full rank (one KV head with RoPE on all d dims: MQA, Gemma 3
    270M / 1B; or the lossless plan): every FreqFold group keeps all its coordinates, so the layer converts exactly.
    The group's PCA mixed its M frequencies into components that each rotate at one of them (relative error 0.2 at
    M = 2, 0.36 at M = 4 for one KV head) while the RoPE energy still read 1.0."""
    h, d, D, T = 4, 16, 32, 24
    w = _weights(h, g, d, D)
    x, m = _inputs(T, D)
    plan = lossless_plan(d, g)
    if g == 1:
        assert plan == standard_plan(d, d)
    R = 2 * len(plan)
    layer, rot, _ = _convert(w, m, _spec(h, g, d, D), plan, 2 * g * d - R, freqfold, metric)
    cos, sin = _cos_sin(T, d)
    out = mla_attention(x, layer.to_tensors(), MLAShapes(h, d, R, 2 * g * d - R, 1e-6, tuple(plan)), cos, sin)
    assert _rel(out, _gqa(x, w, h, g, d, cos, sin)) < 1e-8 and rot.energy == pytest.approx(1.0)


def test_query_less_group_takes_the_key_pca():
    """The fallback group's rows are exactly the key metric's; the other groups keep the query metric."""
    torch.manual_seed(0)
    g, d = 2, 16
    A, B = torch.randn(g * d, g * d, dtype=F64), torch.randn(g * d, g * d, dtype=F64)
    cov_k, cov_q = A @ A.T, B @ B.T
    half = d // 2
    zero = [i * d + l for i in range(g) for l in (0, half)]  # frequency 0 of both heads, real and imaginary
    cov_q[zero] = 0
    cov_q[:, zero] = 0
    plan = standard_plan(d, 4)
    by_query, by_key = rorope(cov_k, g, d, plan, 1, cov_q=cov_q), rorope(cov_k, g, d, plan, 1)
    rows = [r for r in range(g * d) if by_query.T[r, zero].abs().sum() > 0]
    assert torch.equal(by_query.T[rows], by_key.T[rows]) and torch.equal(by_query.Tq[rows], by_key.T[rows])
    assert not torch.allclose(by_query.T, by_key.T)  # the other frequencies: query metric


def test_non_finite_layer_is_refused():
    """A layer with inf/NaN weights is an error naming the tensor, never an exported checkpoint."""
    from transmla.method.mla import check_finite

    h, g, d, D = 2, 1, 8, 16
    w = _weights(h, g, d, D)
    _, m = _inputs(8, D)
    layer, _, _ = _convert(w, m, _spec(h, g, d, D), standard_plan(d, 4), 4)
    check_finite(layer)  # a sound layer passes
    bad = MLALayer.from_tensors({**layer.to_tensors(), "kv_b_proj.weight": layer.kv_b_proj * float("inf")})
    with pytest.raises(TransMLAError, match=r"non-finite weights \(kv_b_proj.weight\).*Fix:"):
        check_finite(bad)
    w.wo[0, 0] = float("nan")  # reaches o_proj untouched by any decomposition
    with pytest.raises(TransMLAError, match="non-finite"):
        _convert(w, m, _spec(h, g, d, D), standard_plan(d, 4), 4)


def test_bkv_keeps_values_exact_when_nope_keys_vanish():
    """Two KV heads with proportional keys and RoPE on d dims: RoRoPE moves all key energy into RoPE, the NoPE
    keys are rounding noise. alpha must stay 1 (not ~1e-16, which scales that noise up to the values'), so a
    rank of g*d still holds every value dim and the layer stays exact."""
    h, g, d, D, T = 4, 2, 16, 64, 24
    w = _weights(h, g, d, D)
    w.wk[d:] = -0.7 * w.wk[:d]
    x, m = _inputs(T, D)
    spec = _spec(h, g, d, D)
    plan = standard_plan(d, d)
    layer, _, basis = _convert(w, m, spec, plan, g * d)
    assert basis.alpha == 1.0
    cos, sin = _cos_sin(T, d)
    out = mla_attention(x, layer.to_tensors(), MLAShapes(h, d, d, g * d, 1e-6, tuple(plan)), cos, sin)
    assert _rel(out, _gqa(x, w, h, g, d, cos, sin)) < 1e-8
    # alpha is still the RMS ratio whenever both sides carry energy
    xx = torch.eye(4, dtype=F64)
    assert bkv_alpha(2 * torch.eye(4, dtype=F64), torch.eye(4, dtype=F64), xx) == 2.0
    assert bkv_alpha(torch.eye(4, dtype=F64), 1e-9 * torch.eye(4, dtype=F64), xx) == 1.0


def test_q_lora_rank_d_plus_one_is_exact_with_a_query_bias():
    """With a query bias the queries are affine in x, rank D + 1: q_lora_rank = D + 1 reproduces them exactly;
    without a bias D is the limit."""
    h, g, d, D = 4, 2, 16, 40
    _, m = _inputs(40, D)
    for bias in (True, False):
        w = _weights(h, g, d, D, bias=bias)
        rot = rotation_step(w, m, _spec(h, g, d, D), lossless_plan(d, g), "transmla", 1, "key")
        basis = basis_step(w, m, _spec(h, g, d, D), rot, g * d, "transmla", True, "activations", False)
        if not bias:
            with pytest.raises(TransMLAError, match=f"between 1 and {D}"):
                build_mla_layer(w, rot, basis, h, g, d, m.xx, m.mean, D + 1)
            continue
        layer, _ = build_mla_layer(w, rot, basis, h, g, d, m.xx, m.mean, D + 1)
        assert layer.q_a_proj.shape[0] == D + 1
        x = torch.randn(50, D, dtype=F64, generator=torch.Generator().manual_seed(3))
        y = x @ layer.q_a_proj.T + layer.q_a_bias
        q = (y / (y.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * layer.q_a_norm) @ layer.q_b_proj.T
        Wq, bq = query_weights(w, rot, h, g, d)
        ref = x @ Wq.T + bq
        assert _rel(q, ref) < 1e-9


@pytest.mark.parametrize("model_type, bias, top", [("qwen2", None, 65), ("llama", True, 65), ("llama", False, 64)])
def test_the_config_check_allows_q_lora_rank_d_plus_one_exactly_when_queries_have_a_bias(model_type, bias, top):
    """The converter's pre-check (from the config, before any weight) and the layer builder agree: Qwen2's
    queries always carry a bias, Llama's with attention_bias: true; then D + 1 is a possible q_lora_rank."""
    from transformers import AutoConfig

    from transmla.adapters import read_spec
    from transmla.convert import check_request

    extra = {} if bias is None else {"attention_bias": bias}
    cfg = AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, num_hidden_layers=2, vocab_size=100, **extra)
    spec = read_spec(cfg)
    assert spec.q_bias is (top == 65)
    check_request(spec, ConvertOptions(kv_cache_ratio=0.5, q_lora_rank=top))
    with pytest.raises(TransMLAError, match=f"between 1 and {top}"):
        check_request(spec, ConvertOptions(kv_cache_ratio=0.5, q_lora_rank=top + 1))


class _Words:  # a tokenizer stub: one id per word
    def __call__(self, text, return_tensors=None):
        return type("Enc", (), {"input_ids": torch.arange(len(text.split()))[None]})()


def test_calibration_corpus_of_exactly_one_window():
    """A corpus of exactly seqlen tokens is one window (it used to be refused); longer corpora draw the same
    windows as ever (the committed conversions depend on them)."""
    assert torch.equal(calibration_ids(_Words(), [" ".join("w" * 8)], 2, 8, 0), torch.arange(8).repeat(2, 1))
    with pytest.raises(TransMLAError, match="fewer than cal_seqlen=9"):
        calibration_ids(_Words(), [" ".join("w" * 8)], 2, 9, 0)
    starts = torch.randint(0, 100 - 8, (5,), generator=torch.Generator().manual_seed(7))
    want = torch.stack([torch.arange(s, s + 8) for s in starts.tolist()])
    assert torch.equal(calibration_ids(_Words(), [" ".join("w" * 100)], 5, 8, 7), want)


S = _spec(4, 2, 16, 64)  # 2 g d = 64 cached values per token


@pytest.mark.parametrize("opts, words", [
    (dict(kv_cache_ratio=0.25, qk_rope_dim=8, kv_lora_rank=10), r"16 cached values .* qk_rope_dim=8 \+ kv_lora_rank=10 = 18"),
    (dict(kv_cache_ratio=0.25, kv_lora_rank=40), r"qk_rope_dim=8 \(the ratio's pick\) \+ kv_lora_rank=40"),
])
def test_conflicting_budget_options_are_refused(opts, words):
    with pytest.raises(TransMLAError, match=words) as e:
        resolve_budget(S, ConvertOptions(**opts))
    assert "kv_lora_rank is 8" in str(e.value)


def test_consistent_budget_options_are_accepted():
    ratio = resolve_budget(S, ConvertOptions(kv_cache_ratio=0.25))
    for extra in (dict(kv_lora_rank=8), dict(qk_rope_dim=8, kv_lora_rank=8)):
        assert resolve_budget(S, ConvertOptions(kv_cache_ratio=0.25, **extra)) == ratio
    b = resolve_budget(S, ConvertOptions(kv_cache_ratio=0.25, qk_rope_dim=4))  # the ratio sets the rank
    assert (b.rope_dim, b.kv_lora_rank) == (4, 12)


@pytest.mark.parametrize("budget", [dict(kv_cache_ratio=0.1), dict(kv_lora_rank=5), dict(qk_rope_dim=4)])
def test_lossless_takes_no_budget(budget):
    with pytest.raises(TransMLAError, match="lossless keeps the whole KV cache.*drop --lossless"):
        ConvertOptions(lossless=True, **budget)


def test_freqfold_checked_as_the_method_uses_it():
    """MHA2MLA and lossless mode run at FreqFold 1 whatever was asked; d/2 = 6 is not a multiple of the default 4."""
    s12 = _spec(4, 2, 12, 64)
    assert resolve_budget(s12, ConvertOptions(method="mha2mla", kv_cache_ratio=0.25)).rope_dim == 6
    assert resolve_budget(s12, ConvertOptions(lossless=True)).kv_lora_rank == 24
    with pytest.raises(TransMLAError, match="freqfold=4 is not valid for head dim 12"):
        resolve_budget(s12, ConvertOptions(kv_cache_ratio=0.25))


@pytest.mark.parametrize("opts", [dict(kv_cache_ratio=0.25, freqfold=1), dict(lossless=True), dict(method="mha2mla")])
def test_odd_head_dim_is_refused(opts):
    with pytest.raises(TransMLAError, match="head_dim=15 is odd.*Fix: check head_dim"):
        resolve_budget(_spec(4, 2, 15, 64), ConvertOptions(**opts))


@pytest.mark.parametrize("r", [24, 40])  # r <= d and r > d, both above D
def test_refit_factors_a_head_wider_than_the_model(r):
    """A model narrower than its heads (D = 16 < d = 32) has at most D singular vectors per head's composite
    M_i [D, r]: factor_head assumed min(r, d) of them and the default mode (refit) crashed after the whole
    calibration. M_i has rank <= D <= d, so the factors are exact."""
    from transmla.method.refit import factor_head

    g = torch.Generator().manual_seed(0)
    D, d = 16, 32
    mi = torch.randn(D, r, generator=g, dtype=torch.float64)
    z = torch.randn(4 * r, r, generator=g, dtype=torch.float64)
    o, w = factor_head(mi, z.T @ z / len(z), d)
    assert o.shape == (D, d) and w.shape == (d, r)
    assert torch.allclose(o @ w, mi, atol=1e-10)

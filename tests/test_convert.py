"""The converter on tiny random Llama/Qwen2 models: exactness of every exact step, the export
format, and one clear error for each impossible request."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from transmla.adapters import attention_weights, read_spec
from transmla.method.bkv import joint_basis
from transmla.method.calibration import calibration_ids, collect_stats
from transmla.convert import ConvertOptions, assemble, convert, convert_layers, resolve_budget
from transmla.pipeline.rotation import rotation_step
from transmla.io.data import load_texts
from transmla.errors import TransMLAError
from transmla.io.export import instantiate
from transmla.config import LATENT_NORM_EPS, PAPER_TRANSMLA
from transmla.method.mla import build_mla_layer, norm_identity_scale
from transmla.method.rope import inv_freq, lossless_plan, standard_plan
from transmla.method.rorope import KeyRotation, _pair_indices, rorope
from transmla.io.sources import load_model

CAL = dict(cal_nsamples=8, cal_seqlen=64, cal_batch_size=4)


def paper(**kw) -> ConvertOptions:
    """The paper's TransMLA (parallel statistics, no extensions): what the per-step exactness tests are about."""
    return ConvertOptions(**{**PAPER_TRANSMLA, **CAL, **kw})


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    spec = read_spec(model.config)
    ids = calibration_ids(tok, load_texts("wikitext2-train"), 8, 64, seed=0)
    return model, tok, spec, collect_stats(model, ids, 4, progress=False)


def _text_ids(tok, n=200):
    text = "\n\n".join(load_texts("wikitext2-test")[1:30])
    return tok(text, return_tensors="pt").input_ids[:, :n]


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), -1)


def _in_memory(tiny, o, rot_fn=None, rank=None):
    model, tok, spec, stats = tiny
    budget = resolve_budget(spec, o)
    if rank is not None:
        budget = replace(budget, kv_lora_rank=rank)
    layers, _ = convert_layers(model, stats, spec, budget, o, progress=False)
    return instantiate(*assemble(model, spec, budget, layers, o))


def merge_only_rotation(g, d):
    """The head merge alone: merged key coordinates permuted into the RoPE layout, no PCA."""
    half, L = d // 2, g * d
    plan = lossless_plan(d, g)
    T = torch.zeros(L, L, dtype=torch.float64)
    for p, l in enumerate(plan):
        i = p % g
        T[p, i * d + l] = 1
        T[L // 2 + p, i * d + l + half] = 1
    return KeyRotation(T, plan, 1.0)


def test_head_merge_is_exact(tiny):
    """Step 4.1 alone (merged latent head + per-query-head up-projections), full rank, no rotation."""
    model, tok, spec, stats = tiny
    o = ConvertOptions(lossless=True, **CAL)
    budget = resolve_budget(spec, o)
    layers = []
    for i in range(spec.n_layers):
        w = attention_weights(model, i)
        rot = merge_only_rotation(spec.g, spec.d)
        basis = joint_basis(torch.zeros(0, spec.D, dtype=torch.float64), w.wv, stats.second_moment(i), spec.g * spec.d)
        layers.append(build_mla_layer(w, rot, basis, spec.h, spec.g, spec.d, stats.second_moment(i), stats.mean(i))[0])
    mla = instantiate(*assemble(model, spec, budget, layers, o))
    ids = _text_ids(tok)
    assert (_logprobs(mla, ids) - _logprobs(model, ids)).abs().max() < 1e-4


def _rope(x, plan_freqs, pos):
    """Apply RoPE in rotate_half layout to x [..., 2n] with frequencies plan_freqs [n] at positions pos."""
    n = x.shape[-1] // 2
    ang = pos[:, None] * plan_freqs[None]
    re, im = x[..., :n], x[..., n:]
    return torch.cat([re * ang.cos() - im * ang.sin(), re * ang.sin() + im * ang.cos()], -1)


@pytest.mark.parametrize("freqfold", [1, 2, 4])
def test_rorope_rotation_preserves_rope_scores(freqfold):
    """Eq. 6: with all coordinates kept and each rotated at its group's frequency, q.k under RoPE is
    unchanged by RoRoPE for FreqFold 1; T is orthogonal for every FreqFold."""
    torch.manual_seed(0)
    g, d = 3, 16
    A = torch.randn(g * d, g * d, dtype=torch.float64)
    rot = rorope(A @ A.T, g, d, lossless_plan(d, g) if freqfold == 1 else standard_plan(d, 4), freqfold)
    assert torch.allclose(rot.T @ rot.T.T, torch.eye(g * d, dtype=torch.float64), atol=1e-10)
    if freqfold != 1:
        return
    theta = inv_freq(10000.0, d)
    pos = torch.arange(7, dtype=torch.float64)
    k = torch.randn(7, g * d, dtype=torch.float64)
    q = torch.randn(7, g * d, dtype=torch.float64)
    # original: every head rotated at its own frequencies (rotate_half per head)
    per_head = lambda x: torch.cat([_rope(x[:, i * d:(i + 1) * d], theta, pos) for i in range(g)], -1)  # noqa: E731
    ref = per_head(q) @ per_head(k).T
    freqs = theta[rot.plan]
    new = _rope(q @ rot.T.T, freqs, pos) @ _rope(k @ rot.T.T, freqs, pos).T
    assert torch.allclose(ref, new, atol=1e-9)


def test_rorope_query_metric_preserves_rope_scores():
    """The query-metric RoRoPE (keys Q^1/2 k, queries Q^-1/2 q, per frequency) changes no RoPE score at
    FreqFold 1 with every coordinate kept, and ranks components by score energy: the kept RoPE pair holds
    the most E[(q'.k')^2] of its frequency, which the key-metric pick need not."""
    torch.manual_seed(0)
    g, d = 3, 16
    A, B = torch.randn(g * d, g * d, dtype=torch.float64), torch.randn(g * d, g * d, dtype=torch.float64)
    cov_k, cov_q = A @ A.T, B @ B.T
    rot = rorope(cov_k, g, d, lossless_plan(d, g), 1, cov_q=cov_q)
    assert torch.allclose(rot.query_T @ rot.T.T, torch.eye(g * d, dtype=torch.float64), atol=1e-8)  # Tq = T^-T
    theta = inv_freq(10000.0, d)
    pos = torch.arange(7, dtype=torch.float64)
    k, q = torch.randn(7, g * d, dtype=torch.float64), torch.randn(7, g * d, dtype=torch.float64)
    per_head = lambda x: torch.cat([_rope(x[:, i * d:(i + 1) * d], theta, pos) for i in range(g)], -1)  # noqa: E731
    freqs = theta[rot.plan]
    new = _rope(q @ rot.query_T.T, freqs, pos) @ _rope(k @ rot.T.T, freqs, pos).T
    assert torch.allclose(per_head(q) @ per_head(k).T, new, atol=1e-8)
    # ranking: of frequency 0's components, the kept RoPE pair carries the most score energy
    # E[(q'_c k'_c)^2] = (a Kf a)(b Qf b) (a, b: its key and query rows over the frequency's coordinates)
    plan = standard_plan(d, 2)
    top = rorope(cov_k, g, d, plan, 1, cov_q=cov_q)
    re, im = _pair_indices(g, d, range(0, 1))
    Kf, Qf = cov_k[re][:, re] + cov_k[im][:, im], cov_q[re][:, re] + cov_q[im][:, im]
    rows = [r for r in range(g * d) if top.T[r, re].abs().sum() > 0]
    score = [float((top.T[r, re] @ Kf @ top.T[r, re]) * (top.Tq[r, re] @ Qf @ top.Tq[r, re])) for r in rows]
    assert rows[0] == 0 and score[0] == max(score) and score[0] > min(score)
    assert top.Tq is not None and rorope(cov_k, g, d, plan, 1).Tq is None


def test_rorope_key_metric_keeps_each_groups_top_components():
    """Eq. 6 at a cut: each planned frequency's RoPE pair is the top eigenvector of that frequency's Sigma_re +
    Sigma_im (one rotation for real and imaginary parts), computed here apart from the code, on both halves of the
    pair; `energy` is the kept eigenvalues' share. (With every coordinate kept, any orthogonal U preserved the
    scores: a PCA of the real part alone, or ranked the wrong way, passed the score tests.)"""
    torch.manual_seed(0)
    g, d = 3, 16
    A = torch.randn(g * d, g * d, dtype=torch.float64)
    cov_k = A @ A.T + torch.diag(torch.rand(g * d, dtype=torch.float64) * 5)
    plan = standard_plan(d, 4)  # frequencies 0 and 4 keep RoPE, one pair each
    rot = rorope(cov_k, g, d, plan, 1)
    R = 2 * len(plan)
    kept = total = 0.0
    for slot, f in enumerate(plan):
        re, im = _pair_indices(g, d, range(f, f + 1))
        vals, vecs = torch.linalg.eigh(cov_k[re][:, re] + cov_k[im][:, im])
        top = vecs[:, -1]
        for row, cols in ((slot, re), (R // 2 + slot, im)):
            assert abs(float(rot.T[row, cols] @ top)) == pytest.approx(1.0, abs=1e-9), (f, row)
            assert rot.T[row].abs().sum() == pytest.approx(rot.T[row, cols].abs().sum())  # nothing outside the pair
    for f in range(d // 2):
        re, im = _pair_indices(g, d, range(f, f + 1))
        vals = torch.linalg.eigvalsh(cov_k[re][:, re] + cov_k[im][:, im])
        kept += float(vals[-1]) if f in plan else 0.0
        total += float(vals.sum())
    assert rot.energy == pytest.approx(kept / total, rel=1e-9) and rot.energy < 0.5


def test_bkv_basis_is_the_balanced_top_pca(tiny):
    """Section 4.3 on a real layer at a cut: alpha = sqrt(E||k_nope||^2 / E||v||^2) (computed here), the basis
    spans the top-r eigenvectors of [k_nope/alpha ; v] E[xx^T] [...]^T, and `energy` is their share; with
    balance_kv off, alpha is 1 and the kept subspace differs. (alpha applied nowhere passed every other test: at
    full rank on and off are the same model.)"""
    from transmla.pipeline.basis import basis_step

    model, _, spec, stats = tiny
    o = paper(qk_rope_dim=8, freqfold=2)
    budget = resolve_budget(spec, o)
    w, m = attention_weights(model, 1), stats.moments(1)
    rot = rotation_step(w, m, spec, budget.plan, **o.rotation_options())
    opts = {**o.basis_options(), "balance_kv": True}
    rank = 8
    basis = basis_step(w, m, spec, rot, rank, **opts)
    wk_nope = rot.T[rot.rope_dim:] @ w.wk
    xx = stats.second_moment(1)
    alpha = (torch.trace(wk_nope @ xx @ wk_nope.T) / torch.trace(w.wv @ xx @ w.wv.T)).sqrt().item()
    assert basis.alpha == pytest.approx(alpha, rel=1e-9) and abs(alpha - 1) > 0.05
    W = torch.cat([wk_nope / alpha, w.wv], 0)
    vals, vecs = torch.linalg.eigh(W @ xx @ W.T)
    top = vecs[:, -rank:]
    assert vals[-rank] > vals[-rank - 1] * (1 + 1e-6)  # an eigengap: the subspace is unique
    torch.testing.assert_close(basis.P @ basis.P.T, top @ top.T, atol=1e-8, rtol=0)
    assert basis.energy == pytest.approx(float(vals[-rank:].sum() / vals.clamp_min(0).sum()), rel=1e-9)
    off = basis_step(w, m, spec, rot, rank, **{**opts, "balance_kv": False})
    assert off.alpha == 1.0 and (off.P @ off.P.T - basis.P @ basis.P.T).abs().max() > 1e-3


def test_lossless_export_matches_original(tiny, tmp_path, tiny_model_dir):
    """Acceptance 1 on tiny Llama and Qwen2 (with q/k/v biases): stock AutoModelForCausalLM."""
    model, tok, spec, _ = tiny
    out = tmp_path / "mla"
    convert(str(tiny_model_dir), out, ConvertOptions(lossless=True, **CAL), progress=False)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(mla).__name__ == "DeepseekV3ForCausalLM"
    ids = _text_ids(tok)
    assert (_logprobs(mla, ids) - _logprobs(model, ids)).abs().max() < 1e-3
    prompt = ids[:, :8]
    a = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    b = mla.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert torch.equal(a, b)


def test_an_export_is_refused_in_float16(tiny, tmp_path, tiny_model_dir):
    """The latent-norm identity keeps an export's cached latent near 1e-8 rms, under float16's smallest subnormal
    (6e-8): loaded in float16 its latent underflows (log-probs off by ~0.7 on this tiny model, bfloat16 ~0.01). The
    loader refuses float16 for an export, with the dtypes that work; the original still loads in it."""
    from transmla.io.sources import load_model

    out = tmp_path / "mla"
    convert(str(tiny_model_dir), out, paper(kv_cache_ratio=0.5), progress=False)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    a = mla.model.layers[0].self_attn
    ids = _text_ids(tiny[1], 40)
    with torch.no_grad():
        lat = a.kv_a_proj_with_mqa(mla.model.layers[0].input_layernorm(mla.model.embed_tokens(ids)))[..., :a.kv_lora_rank]
    assert lat.pow(2).mean().sqrt() < torch.finfo(torch.float16).smallest_normal  # the reason, measured
    with pytest.raises(TransMLAError, match="underflow") as e:
        load_model(str(out), dtype="float16")
    assert "bfloat16 or float32" in e.value.fix
    assert load_model(str(tiny_model_dir), dtype="float16")[0].dtype == torch.float16


def test_bkv_scaling_exact_before_rank_cut(tiny):
    """alpha rescales keys against up-projections: at full rank BKV on/off give the same model."""
    ids = _text_ids(tiny[1])
    on = _in_memory(tiny, paper(qk_rope_dim=8, freqfold=2))
    off = _in_memory(tiny, paper(qk_rope_dim=8, freqfold=2, balance_kv=False))
    assert (_logprobs(on, ids) - _logprobs(off, ids)).abs().max() < 1e-4
    # and the rank cut after balancing really is a cut: rank 8 differs
    cut = _in_memory(tiny, paper(qk_rope_dim=8, kv_lora_rank=8, freqfold=2))
    assert (_logprobs(cut, ids) - _logprobs(on, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_a_layernorm_identity(dtype):
    """RMSNorm(c / s) * (s sqrt(eps)) = c for ordinary and 1e4x outlier tokens (float32 and bfloat16)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    torch.manual_seed(0)
    r = 32
    c = torch.randn(64, r, dtype=torch.float64)
    c[0] *= 100.0  # energy 1e4 x the average
    s = norm_identity_scale(c[1:].pow(2).mean().item(), LATENT_NORM_EPS)  # sized on the ordinary tokens
    norm = DeepseekV3RMSNorm(r)  # transformers' kv_a_layernorm: eps 1e-6
    norm.weight.data.fill_(s * math.sqrt(LATENT_NORM_EPS))
    norm = norm.to(dtype)
    y = norm((c / s).to(dtype)).double()
    rel = ((y - c).norm(dim=-1) / c.norm(dim=-1)).max().item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2)  # bf16: its own rounding, not the identity


def test_export_format(tiny, tmp_path, tiny_model_dir):
    model, tok, spec, _ = tiny
    out = tmp_path / "mla"
    info = convert(str(tiny_model_dir), out, ConvertOptions(kv_cache_ratio=0.5, **CAL), progress=False)
    # timings go to the caller (benchmarks compare wall and CPU time with a plain forward), never the checkpoint
    assert all(isinstance(info[k], float) for k in ("compute_cpu_seconds", "compute_seconds"))  # reported (no timing asserted)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["first_k_dense_replace"] == spec.n_layers and isinstance(cfg["n_routed_experts"], int)
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == spec.h
    assert cfg["rope_interleave"] is True and cfg["tie_word_embeddings"] is False
    assert cfg["q_lora_rank"] is None or isinstance(cfg["q_lora_rank"], int)
    assert cfg["qk_rope_head_dim"] + cfg["kv_lora_rank"] == spec.g * spec.d  # 50% of 2 g d
    t = cfg["transmla"]
    assert t["method"] == "transmla" and t["source_content_hash"] and t["kv_cache_ratio"] == 0.5
    assert "seconds" not in t and t["calibration_tokens"] == 8 * 64  # a deterministic record: no timings
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    assert (out / "tokenizer.json").is_file()


def test_low_rank_q(tiny):
    """q_lora_rank = full query rank is exact; smaller ranks run (and differ)."""
    model, tok, spec, _ = tiny
    ids = _text_ids(tok)
    base = paper(qk_rope_dim=8, freqfold=2)
    ref = _logprobs(_in_memory(tiny, base), ids)
    full = _logprobs(_in_memory(tiny, base.replace(q_lora_rank=spec.D)), ids)
    assert (full - ref).abs().max() < 1e-3
    low = _logprobs(_in_memory(tiny, base.replace(q_lora_rank=8)), ids)
    assert torch.isfinite(low).all() and (low - ref).abs().max() > 1e-3


def test_budget_shorthand_reproduces_paper_settings():
    from transmla.adapters import GQASpec

    smol = GQASpec("llama", 576, 9, 3, 64, 30, 1e5, 1e-5, 49152, 1536, "silu", 8192, True, 1, 2, None)
    b = resolve_budget(smol, ConvertOptions(kv_cache_ratio=0.3125))
    assert (b.rope_dim, b.kv_lora_rank) == (32, 88)
    b = resolve_budget(smol, ConvertOptions(kv_cache_ratio=0.125))
    assert (b.rope_dim, b.kv_lora_rank) == (16, 32)
    llama2 = GQASpec("llama", 4096, 32, 32, 128, 32, 1e4, 1e-5, 32000, 11008, "silu", 4096, False, 1, 2, None)
    b = resolve_budget(llama2, ConvertOptions(kv_cache_ratio=1 - 0.9297))
    assert (b.rope_dim, b.kv_lora_rank) == (64, 512)
    # two KV heads (Qwen2.5-0.5B): half the budget may carry RoPE
    qwen = GQASpec("qwen2", 896, 14, 2, 64, 24, 1e6, 1e-6, 151936, 4864, "silu", 32768, True, 1, 2, None)
    b = resolve_budget(qwen, ConvertOptions(kv_cache_ratio=0.3125))
    assert (b.rope_dim, b.kv_lora_rank) == (32, 48)
    b = resolve_budget(qwen, ConvertOptions(kv_cache_ratio=0.125))
    assert (b.rope_dim, b.kv_lora_rank) == (16, 16)



def test_budget_errors_blame_what_was_given():
    """qk_rope_dim over a ratio's whole budget was reported as an impossible kv_lora_rank (-19) the user never set;
    a rank alone on a head dim of 2 mod 4 defaulted the RoPE dim to an odd d/2 and refused that."""
    from transmla.adapters import GQASpec

    spec = GQASpec("llama", 256, 4, 2, 64, 2, 1e4, 1e-5, 100, 512, "silu", 512, True, 1, 2, None)
    with pytest.raises(TransMLAError, match=r"qk_rope_dim=32 leaves none for the latent.*Fix: lower --qk-rope-dim"):
        resolve_budget(spec, ConvertOptions(kv_cache_ratio=0.05, qk_rope_dim=32))
    odd_half = GQASpec("llama", 360, 4, 2, 90, 2, 1e4, 1e-5, 100, 512, "silu", 512, True, 1, 2, None)
    b = resolve_budget(odd_half, ConvertOptions(kv_lora_rank=50, freqfold=1))
    assert (b.rope_dim, b.kv_lora_rank) == (30, 50)


@pytest.mark.parametrize(
    "opts, words",
    [
        (dict(qk_rope_dim=16, kv_lora_rank=10_000), "kv_lora_rank=10000 is impossible"),
        (dict(qk_rope_dim=6), "must be even and divide"),
        (dict(dtype="float16"), "float16"),
        (dict(freqfold=3), "freqfold=3"),
        (dict(kv_cache_ratio=1.5), "not in"),
        (dict(kv_cache_ratio=0.5, kv_lora_rank=5), r"kv_cache_ratio=0.5 means 32 cached values .* = 13"),
        (dict(lossless=True, kv_cache_ratio=0.5), "lossless keeps the whole KV cache"),
    ],
)
def test_bad_requests_leave_nothing(tiny_model_dir, tmp_path, opts, words):
    out = tmp_path / "out"
    with pytest.raises(TransMLAError, match=words) as e:
        convert(str(tiny_model_dir), out, ConvertOptions(**CAL, **opts), progress=False)
    assert "Fix:" in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_unsupported_architecture_cli(tmp_path, tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer))).save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "transmla.cli", "convert", "--model", str(src), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Unsupported architecture 'gpt2'" in r.stderr
    assert not out.exists()


def test_latent_norm_identity_error_on_real_activations(tiny):
    """The kv_a/q_a layernorm identity, measured inside a converted model (Qwen2: with the q-bias carrier)."""
    from transmla.method.diagnostics import latent_norm_identity_error

    mla = _in_memory(tiny, paper(kv_cache_ratio=0.5, q_lora_rank=16))
    assert latent_norm_identity_error(mla, _text_ids(tiny[1])) < 1e-5


def test_attention_aware_basis_exact_at_full_rank(tiny):
    """The query/o_proj metrics are undone by the up-projections: exact at full rank."""
    ids = _text_ids(tiny[1])
    ref = _logprobs(_in_memory(tiny, paper(qk_rope_dim=8, freqfold=2)), ids)
    aa = _logprobs(_in_memory(tiny, paper(qk_rope_dim=8, freqfold=2, attention_aware=True)), ids)
    assert (aa - ref).abs().max() < 1e-4


def test_mha2mla_selects_whole_pairs_and_exports(tiny):
    """MHA2MLA's key change of basis is a permutation keeping whole (real, imag) pairs; the model runs."""
    model, tok, spec, stats = tiny
    o = ConvertOptions(method="mha2mla", qk_rope_dim=8, kv_lora_rank=16, **CAL)
    budget = resolve_budget(spec, o)
    rot = rotation_step(attention_weights(model, 0), stats.moments(0), spec, budget.plan, **o.rotation_options())
    assert torch.equal(rot.T.abs().sum(0), torch.ones(spec.g * spec.d, dtype=torch.float64))  # permutation
    half = spec.d // 2
    for p in range(4):  # the imaginary row of each RoPE pair is its real row's partner (+d/2)
        assert rot.T[4 + p].argmax() == rot.T[p].argmax() + half
    assert torch.isfinite(_logprobs(_in_memory(tiny, o), _text_ids(tok))).all()


@pytest.mark.parametrize("which", ["original", "mla"])
def test_padded_sdpa_matches_sdpa_with_a_cache(tiny, which):
    """The evaluation attention (runtime.fast_attention) on a KV cache: a chunk after a prefix and
    single decode steps give the full forward's logits (SDPA's is_causal alone is top-left aligned)."""
    from transformers import DynamicCache

    from transmla.runtime.fast_attention import use_causal_padded_sdpa

    model, tok, _, _ = tiny
    m = model if which == "original" else _in_memory(tiny, paper(kv_cache_ratio=0.5))
    ids = _text_ids(tok, 24)
    full = _logprobs(m, ids)
    impl = m.config._attn_implementation
    try:
        use_causal_padded_sdpa(m)
        assert torch.allclose(_logprobs(m, ids), full, atol=1e-4)
        cache, got = DynamicCache(config=m.config), []
        with torch.no_grad():
            for a, b in [(0, 12), (12, 17), *[(t, t + 1) for t in range(17, 24)]]:  # prefill, chunk, decode
                got.append(m(ids[:, a:b], past_key_values=cache, use_cache=True).logits.float())
        assert torch.allclose(torch.log_softmax(torch.cat(got, 1), -1), full, atol=1e-4)
    finally:
        m.config._attn_implementation = impl


@pytest.mark.parametrize("which", ["original", "mla"])
def test_padded_sdpa_honours_padding_and_a_static_cache(tiny, which):
    """The evaluation attention gets transformers' masks (its mask function is SDPA's): a left-padded batch and
    greedy decoding into a StaticCache give stock SDPA's logits and tokens. It was handed no mask at all: the
    padding was attended to, and a static cache's decode step attended to its unwritten slots."""
    from transformers import StaticCache

    from transmla.runtime.fast_attention import use_causal_padded_sdpa

    model, tok, _, _ = tiny
    m = model if which == "original" else _in_memory(tiny, paper(kv_cache_ratio=0.5))
    ids = _text_ids(tok, 24).repeat(2, 1)
    ids[0, :5] = tok.pad_token_id or 0
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    impl = m.config._attn_implementation

    @torch.no_grad()
    def run():  # padded-batch logits, greedy tokens through a StaticCache, one static decode step's logits
        static = m.generate(ids[1:, :12], cache_implementation="static", do_sample=False, max_new_tokens=6,
                            min_new_tokens=6, pad_token_id=0)
        cache = StaticCache(config=m.config, max_cache_len=32)
        m(ids[1:, :12], past_key_values=cache, use_cache=True)
        return m(ids, attention_mask=mask).logits, static, m(ids[1:, 12:13], past_key_values=cache, use_cache=True).logits

    try:
        m.set_attn_implementation("sdpa")
        want, want_static, want_step = run()
        use_causal_padded_sdpa(m)
        got, got_static, got_step = run()
    finally:
        m.config._attn_implementation = impl
    assert (got - want)[:, 5:].abs().max() < 1e-4 and (got - want)[1].abs().max() < 1e-4
    assert (got_step - want_step).abs().max() < 1e-4
    assert torch.equal(got_static, want_static)


def test_padded_sdpa_soft_capped_path_honours_padding_and_a_static_cache():
    """Gemma 2's soft-capped scores take the eager kernel inside the evaluation attention. Where transformers
    passes no mask (a prefill into an empty StaticCache) its causal mask was aligned bottom-right, so every
    query also saw the cache's unwritten slots; a left-padded batch's fully padded queries got -inf rows, whose
    NaN the next layer carried into the real tokens. Both now give the stock eager logits and tokens."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, StaticCache

    from transmla.runtime.fast_attention import use_causal_padded_sdpa

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    m = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(1, 100, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0

    @torch.no_grad()
    def run():
        prefill = m(ids[1:], past_key_values=StaticCache(config=m.config, max_cache_len=32), use_cache=True).logits
        tokens = m.generate(ids[1:], cache_implementation="static", do_sample=False, max_new_tokens=6,
                            min_new_tokens=6, pad_token_id=0)
        return prefill, tokens, m(ids, attention_mask=mask).logits

    want_prefill, want_tokens, want_padded = run()
    use_causal_padded_sdpa(m)
    got_prefill, got_tokens, got_padded = run()
    assert (got_prefill - want_prefill).abs().max() < 1e-4
    assert torch.equal(got_tokens, want_tokens)
    assert got_padded.isfinite().all()
    assert (got_padded - want_padded)[:, 4:].abs().max() < 1e-4 and (got_padded - want_padded)[1].abs().max() < 1e-4


@pytest.mark.parametrize("argv, want", [
    ([], {"calibration": "sequential", "refit": True, "attention_aware": True}),
    (["--paper"], {"calibration": "parallel", "refit": False, "attention_aware": False}),
    (["--paper", "--calibration", "two_pass"], {"calibration": "two_pass", "refit": False, "attention_aware": False}),
    (["--paper", "--refit"], {"calibration": "parallel", "refit": True, "attention_aware": False}),
    (["--no-refit"], {"calibration": "sequential", "refit": False, "attention_aware": True}),
    (["--load", "layers", "--cal-batch-size", "2"], {"load": "layers", "cal_batch_size": 2}),
])
def test_cli_mode_flags_override_paper(argv, want):
    """--paper sets the paper's modes; a mode flag given explicitly still applies (the ablation rows)."""
    from transmla.cli import build_parser, convert_options

    args = build_parser().parse_args(["convert", "--out", "x", *argv])
    o = convert_options(args)
    assert {k: getattr(o, k) for k in want} == want


def test_mixed_calibration_shares_windows_and_keeps_one_corpus_exact():
    from transmla.method.calibration import mixed_calibration_ids

    class Chars:  # a tokenizer stub: one id per character
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    a, b = ["a" * 500], ["b" * 500]
    assert torch.equal(mixed_calibration_ids(Chars(), [a], 5, 16, 0), calibration_ids(Chars(), a, 5, 16, 0))
    ids = mixed_calibration_ids(Chars(), [a, b], 5, 16, 0)
    assert ids.shape == (5, 16)
    assert (ids[:3] == ord("a")).all() and (ids[3:] == ord("b")).all()  # 3 + 2 windows
    with pytest.raises(TransMLAError, match="cal-nsamples"):
        mixed_calibration_ids(Chars(), [a, b], 1, 16, 0)


@pytest.mark.parametrize("load", ["model", "layers"])
@pytest.mark.parametrize("device, words", [("cuda:7", "no such CUDA device"), ("tpu", "not a torch device")])
def test_the_library_refuses_a_device_this_machine_lacks_before_any_work(tiny_model_dir, tmp_path, load, device, words):
    """Only the CLI checked --device: convert(..., device="cuda") on a CPU machine failed deep in torch (an
    AssertionError 'Torch not compiled with CUDA'; 'tpu' a RuntimeError), in both load modes."""
    with pytest.raises(TransMLAError, match=words):
        convert(str(tiny_model_dir), tmp_path / "out", ConvertOptions(kv_cache_ratio=0.5, device=device, load=load),
                progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("load", ["model", "layers"])
def test_the_export_keeps_the_generation_settings_the_sources_authors_wrote(tiny_model_dir, tmp_path, load):
    """The export dropped generation_config.json: an instruct model's extra stop token and its sampling defaults
    were lost, so even a lossless export generated differently. One transformers derived from config.json
    (_from_model_config) says nothing new and is not written."""
    import shutil

    from transformers import GenerationConfig

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir, src)
    authored = GenerationConfig(bos_token_id=0, eos_token_id=[0, 7], repetition_penalty=1.5, do_sample=True,
                                temperature=0.7)
    authored.save_pretrained(src)
    o = ConvertOptions(lossless=True, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4, load=load)
    convert(str(src), tmp_path / "mla", o, progress=False)
    got = GenerationConfig.from_pretrained(tmp_path / "mla")
    assert (got.eos_token_id, got.repetition_penalty, got.do_sample, got.temperature) == ([0, 7], 1.5, True, 0.7)
    assert not getattr(got, "_from_model_config", False)
    from transformers import AutoConfig

    derived = GenerationConfig.from_model_config(AutoConfig.from_pretrained(src))  # what save_pretrained writes
    assert derived._from_model_config
    derived.save_pretrained(src)
    convert(str(src), tmp_path / "mla2", o, progress=False)
    assert not (tmp_path / "mla2" / "generation_config.json").exists()
    # one that does not load: transformers' model load goes on without it, and so does the export (the layer-
    # streamed conversion failed on it, after the whole conversion in the pipeline's export)
    (src / "generation_config.json").write_text('{"bos_token_id": 0,')
    convert(str(src), tmp_path / "mla3", o, progress=False)
    assert not (tmp_path / "mla3" / "generation_config.json").exists()


def test_lossless_takes_any_q_lora_rank_that_keeps_the_queries_exactly(tiny_model_dir, tmp_path):
    """The converted queries are a linear map of the original's h d (affine with Qwen2's bias), so a rank of
    min(h d, D [+ 1]) keeps them exactly: it was refused against the width h (d + R) (Qwen2 at D: 'rank up to
    65'). One below is a cut, refused with --lossless."""
    model, tok = load_model(str(tiny_model_dir))
    spec = read_spec(model.config)
    full = min(spec.h * spec.d, spec.D + int(spec.q_bias))
    ids = _text_ids(tok)
    o = ConvertOptions(lossless=True, q_lora_rank=full, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4)
    convert(str(tiny_model_dir), tmp_path / "mla", o, progress=False)
    got = _logprobs(load_model(str(tmp_path / "mla"))[0], ids)
    assert (got - _logprobs(model, ids)).abs().max() < 1e-4
    # fewer calibration tokens than hidden dims (32 < 64): the query basis came from the rank-deficient query
    # moments, whose null-space eigenvectors are arbitrary (a wrong model, exit 0); it is the weights' own span
    convert(str(tiny_model_dir), tmp_path / "few", o.replace(cal_nsamples=1, cal_seqlen=32), progress=False)
    got = _logprobs(load_model(str(tmp_path / "few"))[0], ids)
    assert (got - _logprobs(model, ids)).abs().max() < 1e-4
    with pytest.raises(TransMLAError, match=f"--lossless with --q-lora-rank {full - 1}.*rank up to {full}"):
        convert(str(tiny_model_dir), tmp_path / "cut", o.replace(q_lora_rank=full - 1), progress=False)

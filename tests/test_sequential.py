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
from transmla.method.refit import RefitMoments, refit_values
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
    """With the scores exact (all RoPE kept, full rank), the refit's least squares recovers W_UV exactly:
    the values of the refit layer equal the PCA layer's, and the fit's residual is ~0."""
    model, _, spec, ids = tiny
    o = ConvertOptions(lossless=True, calibration="sequential")
    budget, layers, _ = _convert(tiny, o)
    stream = LayerStream(model, ids, 4, progress=False)
    s = mla_shapes(spec, budget, o)
    from transmla.adapters import attention_weights
    from transmla.pipeline.layer import value_bias

    m = stream.refit_moments(0, layers[0], s, value_bias(attention_weights(model, 0), spec))
    refit, diag = refit_step(layers[0], m, spec, damp=1e-12)
    d = spec.d
    a = layers[0].kv_b_proj.view(spec.h, 2 * d, -1)[:, d:]
    b = refit.kv_b_proj.view(spec.h, 2 * d, -1)[:, d:]
    assert torch.allclose(a, b, atol=1e-4 * a.abs().max())
    assert diag["refit_residual"] < 1e-6 and diag["refit_residual_before"] < 1e-6  # float32 activations


def test_refit_values_solves_the_normal_equations():
    """refit_values is the least-squares solution: on synthetic z, y = W z + noise it beats W itself."""
    torch.manual_seed(0)
    h, d, r, n = 3, 5, 4, 4000
    W = torch.randn(h, d, r, dtype=torch.float64)
    z = torch.randn(h, n, r, dtype=torch.float64)
    y = torch.einsum("hdr,hnr->hnd", W, z) + 0.1 * torch.randn(h, n, d, dtype=torch.float64)
    m = RefitMoments(torch.einsum("hnr,hns->hrs", z, z) / n, torch.einsum("hnd,hnr->hdr", y, z) / n,
                     y.pow(2).sum((1, 2)) / n)
    w_fit, diag = refit_values(m, damp=0.0)
    direct = torch.linalg.lstsq(z, y).solution.transpose(1, 2)
    assert torch.allclose(w_fit, direct, atol=1e-10)
    assert diag["refit_residual"] <= m.residual(W)


def test_advance_after_refit_reuses_the_latents_correctly(tiny):
    """advance() after refit_moments() reuses the attention-weighted latents with the refit W_UV: the hidden
    states equal those of a fresh stream pushed through the refit layer."""
    from transmla.adapters import attention_weights
    from transmla.pipeline.layer import value_bias

    model, _, spec, ids = tiny
    o = ConvertOptions(qk_rope_dim=4, kv_lora_rank=8)
    budget, layers, _ = _convert(tiny, o.replace(refit=False))
    s = mla_shapes(spec, budget, o)
    reused, fresh = LayerStream(model, ids, 4, progress=False), LayerStream(model, ids, 4, progress=False)
    m = reused.refit_moments(0, layers[0], s, value_bias(attention_weights(model, 0), spec))
    refit, _ = refit_step(layers[0], m, spec, damp=1e-6)
    assert not torch.allclose(refit.kv_b_proj, layers[0].kv_b_proj)
    assert reused._z is not None  # small z: kept
    reused.advance(0, refit, s)
    fresh.advance(0, refit, s)
    for a, b in zip(reused.h, fresh.h):
        assert torch.allclose(a, b, atol=1e-5 * b.abs().max())

"""Shared-context multiple-choice scoring (transmla.evaluation.scoring) gives lm-eval's log-likelihoods."""

import random

import pytest

from transmla.convert import ConvertOptions, convert


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("score") / "mla"
    convert(str(tiny_model_dir), out, ConvertOptions(kv_cache_ratio=0.5, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4),
            progress=False)
    return out


def _requests(lm, seed=0):
    rng = random.Random(seed)
    words = "the cat sat on a mat while dogs ran far away from every blue house near old rivers".split()
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    reqs = []
    for n_ctx in (5, 17, 40, 70):  # 70 words: context + choice beyond max_length (lm-eval's truncating path)
        ctx = "Question: " + text(n_ctx) + "\nAnswer:"
        for n in (1, 3, 8, 2):
            cont = " " + text(n)
            reqs.append(((ctx, cont), *lm._encode_pair(ctx, cont)))
    rng.shuffle(reqs)
    return reqs


@pytest.mark.parametrize("which", ["original", "converted"])
def test_shared_context_matches_lm_eval(tiny_model_dir, converted, which):
    from lm_eval.models.huggingface import HFLM

    from transmla.evaluation.scoring import SharedContextLM

    path = str(tiny_model_dir if which == "original" else converted)
    ref_lm = HFLM(pretrained=path, batch_size=4, max_length=64, device="cpu")
    reqs = _requests(ref_lm)
    assert any(len(c) + len(x) > 64 for _, c, x in reqs)  # the fallback is exercised
    ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    lm = SharedContextLM(pretrained=path, batch_size=3, max_length=64, device="cpu")
    cfg = lm.model.config
    if which == "converted":  # the export's narrower value head: the padded masked kernel is what ran
        from transmla.evaluation.scoring import MASKED_PADDED_SDPA

        assert cfg.v_head_dim < cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        assert cfg._attn_implementation == MASKED_PADDED_SDPA
    new = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    assert len(new) == len(ref)
    for (a, ga), (b, gb) in zip(ref, new):
        assert b == pytest.approx(a, abs=1e-4)
        assert ga == gb


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])  # MLA-style (every head its own key) and GQA
def test_masked_padded_sdpa_equals_stock_sdpa(heads):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from transmla.evaluation.scoring import masked_padded_sdpa

    g = torch.Generator().manual_seed(0)
    h, kv = heads
    q, k = torch.randn(2, h, 9, 12, generator=g), torch.randn(2, kv, 9, 12, generator=g)
    v = torch.randn(2, kv, 9, 8, generator=g)  # value head narrower than the key head
    mask = torch.rand(2, 1, 9, 9, generator=g) < 0.6
    mask |= torch.eye(9, dtype=torch.bool)  # a packed mask: every row sees itself
    mod = torch.nn.Module()
    mod.is_causal, mod.num_key_value_groups = False, h // kv
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.3)
    out, _ = masked_padded_sdpa(mod, q, k, v, mask, scaling=0.3)
    assert out.shape == ref.shape == (2, 9, h, 8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

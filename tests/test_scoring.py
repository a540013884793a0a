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


def test_auto_batch_size_is_detected_for_the_packed_path(tiny_model_dir, monkeypatch):
    """--batch-size auto was read as 8 on the packed path whatever lm-eval's detection would find."""
    from transmla.evaluation.scoring import SharedContextLM

    ref = SharedContextLM(pretrained=str(tiny_model_dir), batch_size=3, max_length=256, device="cpu")
    reqs = _requests(ref)  # every context and its choices fit in 256 tokens: all packed, none alone
    assert all(len(c) + len(x) <= 256 for _, c, x in reqs)
    lm = SharedContextLM(pretrained=str(tiny_model_dir), batch_size="auto", max_batch_size=2, max_length=256,
                         device="cpu")
    sizes = []  # the length it is asked to fit: the longest pack's, not the model's whole context
    monkeypatch.setattr(lm, "_detect_batch_size", lambda reqs=None, pos=0: sizes.append(len(reqs[0][1]) + len(reqs[0][2])) or 2)
    seen = []
    forward = lm.model.model.forward
    monkeypatch.setattr(lm.model.model, "forward", lambda *a, **k: seen.append(k["input_ids"].shape[0]) or forward(*a, **k))
    got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    longest = max(len(c) + sum(len(x) for x in {tuple(x) for _, c2, x in reqs if c2 == c}) for _, c, _ in reqs)
    assert sizes == [longest] and seen and max(seen) == 2, (sizes, longest, seen)
    for (a, ga), (b, gb) in zip(ref._loglikelihood_tokens(reqs, disable_tqdm=True), got):
        assert b == pytest.approx(a, abs=1e-5) and ga == gb


def test_choice_longer_than_the_context_window_is_one_clear_error(tiny_model_dir):
    """lm-eval truncates a long context from the left but asserts on a choice longer than the window: a model with
    a tiny window would end in a bare AssertionError; the error names the choice's length, the window and the fix."""
    from transmla.errors import TransMLAError
    from transmla.evaluation.scoring import SharedContextLM

    lm = SharedContextLM(pretrained=str(tiny_model_dir), batch_size=2, max_length=16, device="cpu")
    ok = (("ctx", " c"), *lm._encode_pair("Question: the cat sat\nAnswer:", " on a mat"))
    long = (("ctx", " c"), *lm._encode_pair("Question:", " the cat sat on a mat while dogs ran far away " * 2))
    assert len(long[2]) > 16 >= len(ok[2]) and len(ok[1]) + len(ok[2]) > 16  # ok: the truncating path, which scores
    assert len(lm._loglikelihood_tokens([ok], disable_tqdm=True)) == 1
    with pytest.raises(TransMLAError, match=r"choice is \d+ tokens, longer than the model's context window \(16 tokens\)"):
        lm._loglikelihood_tokens([ok, long], disable_tqdm=True)


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


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny Gemma 2: eager attention (its soft-capped scores), final logit soft-capping and a sliding window,
    each set so that it changes the log-likelihoods."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       sliding_window=32, final_logit_softcapping=0.5, attn_logit_softcapping=1.0,
                       query_pre_attn_scalar=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # scores and logits large enough for both caps to bite
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("gemma2")
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def test_shared_context_matches_lm_eval_on_eager_softcapped_sliding_gemma2(tiny_gemma2_dir):
    """Eager attention adds its mask to the scores (a bool mask would add 0/1), the head's output is
    soft-capped, and a pack longer than the sliding window would see past it: each must match lm-eval."""
    from lm_eval.models.huggingface import HFLM

    from transmla.evaluation.scoring import SharedContextLM, pack_limit

    ref_lm = HFLM(pretrained=str(tiny_gemma2_dir), batch_size=4, max_length=64, device="cpu")
    assert ref_lm.model.config._attn_implementation == "eager"
    reqs = _requests(ref_lm)
    ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    lm = SharedContextLM(pretrained=str(tiny_gemma2_dir), batch_size=3, max_length=64, device="cpu")
    assert pack_limit(lm.model, 64) == 32
    packed = [r for r in reqs if len(r[1]) + len(r[2]) <= 32]
    assert len(packed) >= 3 and any(len(c) > 1 and len(x) > 1 for _, c, x in packed), "the packed path runs"
    new = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(ref, new):
        assert b == pytest.approx(a, abs=1e-4)
        assert ga == gb


def test_shared_context_lm_loads_exports_as_load_model_does(tiny_model_dir, tiny_tokenizer, tmp_path):
    """lm-eval's model loads the checkpoint itself (not through load_model): a lossless export built for another
    latent-norm eps (a vLLM-padded one's) scores what the original scores only once its recorded eps is applied
    (transformers' fixed 1e-6 scales its latent by about 3x), and in a fresh process, where nothing has imported
    transmla.models, a Qwen3 export still loads as the package's class (the benchmarks task could run alone when
    the perplexity task beside it was a cache hit)."""
    import subprocess
    import sys

    from lm_eval.models.huggingface import HFLM

    from test_architectures import _tiny_qwen3
    from transmla.evaluation.scoring import SharedContextLM

    out = tmp_path / "lossless-eps"
    convert(str(tiny_model_dir), out, ConvertOptions(lossless=True, latent_norm_eps=1e-5, cal_nsamples=8, cal_seqlen=64,
                                                     cal_batch_size=4), progress=False)
    ref_lm = HFLM(pretrained=str(tiny_model_dir), batch_size=4, max_length=64, device="cpu")
    reqs = _requests(ref_lm)
    ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    lm = SharedContextLM(pretrained=str(out), batch_size=3, max_length=64, device="cpu")
    assert lm.model.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == 1e-5
    new = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(ref, new):
        assert b == pytest.approx(a, abs=1e-4) and ga == gb

    q3 = tmp_path / "qwen3-mla"
    convert(str(_tiny_qwen3(tmp_path, tiny_tokenizer)), q3, ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, cal_nsamples=8,
                                                                         cal_seqlen=64, cal_batch_size=4), progress=False)
    code = ("import sys\nfrom transmla.evaluation.scoring import SharedContextLM\n"
            "assert 'transmla.models' not in sys.modules\n"
            f"lm = SharedContextLM(pretrained={str(q3)!r}, batch_size=2, max_length=64, device='cpu')\n"
            "print(type(lm.model).__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "Qwen3MLAForCausalLM"


def _save_tiny(model_cls, cfg, tok, out):
    import torch

    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # logits large enough that a missed scaling or window shows
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _matches_lm_eval(path, max_length=64):
    from lm_eval.models.huggingface import HFLM

    from transmla.evaluation.scoring import SharedContextLM

    ref_lm = HFLM(pretrained=str(path), batch_size=4, max_length=max_length, device="cpu")
    reqs = _requests(ref_lm)
    ref = ref_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    lm = SharedContextLM(pretrained=str(path), batch_size=3, max_length=max_length, device="cpu")
    new = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(ref, new):
        assert b == pytest.approx(a, abs=1e-4)
        assert ga == gb
    return lm, reqs


def test_requests_too_long_to_pack_keep_an_sdpa_sliding_window(tiny_tokenizer, tmp_path):
    """A request longer than the window goes through lm-eval's own path on the same model. With the SDPA
    routing's attention name unknown to transformers' mask functions it got no mask at all: plain causal
    attention past Mistral's window (0.3 nats off here, 4 on a Gemma 3), exit 0."""
    from transformers import MistralConfig, MistralForCausalLM

    from transmla.evaluation.scoring import MASKED_PADDED_SDPA, pack_limit

    cfg = MistralConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        sliding_window=16, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    path = _save_tiny(MistralForCausalLM, cfg, tiny_tokenizer, tmp_path / "mistral")
    lm, reqs = _matches_lm_eval(path)
    assert lm.model.config._attn_implementation == MASKED_PADDED_SDPA and pack_limit(lm.model, 64) == 16
    assert sum(len(c) + len(x) > 16 for _, c, x in reqs) > len(reqs) // 2  # most go the unpacked way


@pytest.mark.parametrize("family", ["granite", "gpt2"])
def test_families_the_packed_path_would_misread_are_scored_by_lm_eval(family, tiny_tokenizer, tmp_path):
    """The packed path runs model.model and the head: Granite divides its logits by logits_scaling (0.37 nats
    off, exit 0) and GPT-2 has no `.model` (an AttributeError traceback). Families outside the convertible ones
    are scored the way lm-eval scores them."""
    from transformers import GPT2Config, GPT2LMHeadModel, GraniteConfig, GraniteForCausalLM

    if family == "granite":
        cfg = GraniteConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            logits_scaling=8.0, bos_token_id=0, eos_token_id=0)
        path = _save_tiny(GraniteForCausalLM, cfg, tiny_tokenizer, tmp_path / family)
    else:
        cfg = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                         bos_token_id=0, eos_token_id=0)
        path = _save_tiny(GPT2LMHeadModel, cfg, tiny_tokenizer, tmp_path / family)
    _matches_lm_eval(path)

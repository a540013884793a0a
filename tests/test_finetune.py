"""Recovery fine-tune on tiny converted models: the latent-norm (un)folding is exact, a few Trainer
steps lower the held-out loss, the saved checkpoint is stock DeepseekV3 again, an interrupted run
resumes from its last checkpoint and ends where an uninterrupted one does."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from transmla.convert import ConvertOptions, convert
from transmla.io.data import load_documents
from transmla.method.diagnostics import latent_norm_identity_error
from transmla.errors import TransMLAError
from transmla.training.finetune import (FinetuneConfig, UnfoldedNorm, fold_latent_norms, finetune, mean_loss, pack_corpus,
                               save_finetuned, unfold_latent_norms)
from transmla.io.sources import load_model


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """A tiny Llama/Qwen2 converted at a 50% KV cut (Qwen2: with the (hidden+1)-rank q_a/q_b pair)."""
    out = tmp_path_factory.mktemp("ft-src") / "mla"
    convert(str(tiny_model_dir), out, ConvertOptions(kv_cache_ratio=0.5, cal_nsamples=8, cal_seqlen=64,
                                                     cal_batch_size=4), progress=False)
    return out


@pytest.fixture(scope="module")
def blocks(converted):
    _, tok = load_model(str(converted))
    corpora = {n: load_documents(n)[:40] for n in ("c4-demo", "wiki-demo")}
    return pack_corpus(tok, corpora, seqlen=64, val_tokens=512, seed=0)


def _cfg(**kw) -> FinetuneConfig:
    base = dict(max_tokens=16 * 4 * 64, seqlen=64, batch_size=4, lr=3e-3, warmup_ratio=0.0, eval_every=4, log_every=1,
                val_tokens=512, seed=0)
    return FinetuneConfig(**{**base, **kw})


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids, use_cache=False).logits.double(), -1)


def test_pack_corpus_is_seeded_and_disjoint(converted):
    _, tok = load_model(str(converted))
    corpora = {n: load_documents(n)[:20] for n in ("c4-demo", "wiki-demo")}
    tr1, va1, info = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=1)
    tr2, va2, _ = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=1)
    tr3, _, _ = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=2)
    assert torch.equal(tr1, tr2) and torch.equal(va1, va2) and not torch.equal(tr1, tr3)
    assert va1.shape == (8, 32) and tr1.shape[1] == 32
    assert len(tr1) + len(va1) == sum(c["blocks"] for c in info["corpora"].values())
    # the held-out blocks are not training blocks
    train_rows = {tuple(r.tolist()) for r in tr1}
    assert not any(tuple(r.tolist()) in train_rows for r in va1)
    with pytest.raises(TransMLAError, match="val_tokens"):
        pack_corpus(tok, corpora, seqlen=32, val_tokens=10**7, seed=1)


def test_unfold_and_fold_keep_the_function(converted, blocks):
    model, _ = load_model(str(converted))
    x = blocks[1][:2]
    ref = _logprobs(model, x)
    n = unfold_latent_norms(model)
    assert n == model.config.num_hidden_layers * (2 if model.config.q_lora_rank else 1)
    assert all(isinstance(l.self_attn.kv_a_layernorm, UnfoldedNorm) for l in model.model.layers)
    assert (_logprobs(model, x) - ref).abs().max() < 1e-4
    fold_latent_norms(model, blocks[1])
    assert not any(isinstance(l.self_attn.kv_a_layernorm, UnfoldedNorm) for l in model.model.layers)
    assert (_logprobs(model, x) - ref).abs().max() < 1e-4
    assert latent_norm_identity_error(model, x) < 1e-5


@pytest.fixture(scope="module")
def trained(converted, blocks, tmp_path_factory):
    """One uninterrupted run (the reference for the resume test)."""
    model, tok = load_model(str(converted))
    work = tmp_path_factory.mktemp("ft-work")
    record = finetune(model, blocks[0], blocks[1], _cfg(), str(work))
    return model, tok, record


def test_finetune_lowers_validation_loss(trained, blocks):
    model, _, record = trained
    assert record["steps"] == 16 and record["tokens_trained"] == 16 * 4 * 64
    assert record["val_loss_after"] < record["val_loss_before"] - 0.05
    # the folded (stock) model reproduces the trained validation loss
    assert abs(mean_loss(model, blocks[1]) - record["val_loss_after"]) < 1e-3
    curve = [h["loss"] for h in record["log_history"] if "loss" in h]
    assert len(curve) >= 8 and curve[-1] < curve[0]


def test_saved_checkpoint_is_stock_deepseek(trained, blocks, tmp_path):
    model, tok, record = trained
    out = save_finetuned(model, tok, tmp_path / "ft", record)
    loaded = AutoModelForCausalLM.from_pretrained(out)  # stock class, no remote code
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    x = blocks[1][:2]
    assert (_logprobs(loaded, x) - _logprobs(model, x)).abs().max() < 1e-5
    assert latent_norm_identity_error(loaded, x) < 1e-5
    meta = json.loads((out / "config.json").read_text())["transmla"]
    assert meta["finetune"]["tokens_trained"] == record["tokens_trained"]
    assert meta["kv_lora_rank"] == loaded.config.kv_lora_rank  # the conversion record survives
    assert not list(out.glob("*.bin")) and list(out.glob("*.safetensors"))


class _Interrupt(TrainerCallback):
    """Kill the run (as a Ctrl-C would) right after step `at` was checkpointed."""

    def __init__(self, at: int):
        self.at = at

    def on_save(self, args, state, control, **kw):
        if state.global_step >= self.at:
            raise KeyboardInterrupt


def test_interrupted_run_resumes_from_last_checkpoint(converted, blocks, trained, tmp_path):
    cfg = _cfg()
    model, _ = load_model(str(converted))
    with pytest.raises(KeyboardInterrupt):
        finetune(model, blocks[0], blocks[1], cfg, str(tmp_path), callbacks=[_Interrupt(8)])
    assert (tmp_path / "checkpoint-8").is_dir()
    model, _ = load_model(str(converted))  # a new process would start from the converted model again
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path))
    assert record["resumed_from"].endswith("checkpoint-8")
    assert record["steps"] == 16 and record["steps_this_run"] == 8
    ref_model, _, ref = trained
    assert record["val_loss_before"] == pytest.approx(ref["val_loss_before"])  # restored history
    assert record["val_loss_after"] == pytest.approx(ref["val_loss_after"], abs=1e-4)
    x = blocks[1][:2]
    assert (_logprobs(model, x) - _logprobs(ref_model, x)).abs().max() < 1e-3


def test_attention_mode_trains_only_mla_projections(converted, blocks, tmp_path):
    model, _ = load_model(str(converted))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = finetune(model, blocks[0], blocks[1], _cfg(mode="attention", max_tokens=2 * 4 * 64, eval_every=2),
                      str(tmp_path))
    assert 0 < record["params"]["trainable"] < record["params"]["total"]
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert any("kv_b_proj" in k for k in changed) and any("o_proj" in k for k in changed)


def test_bad_config_and_unconverted_model(tiny_model_dir, blocks, tmp_path):
    with pytest.raises(TransMLAError, match="mode"):
        _cfg(mode="lora")
    with pytest.raises(TransMLAError, match="float16"):
        _cfg(dtype="float16")
    original, _ = load_model(str(tiny_model_dir))
    with pytest.raises(TransMLAError, match="convert the model first"):
        finetune(original, blocks[0], blocks[1], _cfg(), str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing written

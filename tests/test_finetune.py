"""Recovery fine-tune on tiny converted models: the latent-norm (un)folding is exact, a few Trainer
steps lower the held-out loss, the saved checkpoint is stock DeepseekV3 again, an interrupted run
resumes from its last checkpoint and ends where an uninterrupted one does; the same for distillation
from the original model (kd), whose loss is zero when the conversion is lossless."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from transmla.convert import ConvertOptions, convert
from transmla.io.data import load_documents
from transmla.method.diagnostics import latent_norm_identity_error
from transmla.errors import TransMLAError
from transmla.method.diagnostics import use_recorded_latent_norm_eps
from transmla.runtime.serving import load_checkpoint, pad_for_vllm
from transmla.io.export import instantiate
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


def _docs_of(rows: torch.Tensor, docs: list[list[int]], eos: int) -> set[int]:
    """Indices of the documents whose text the blocks hold (each EOS-free piece of >= 12 tokens located)."""
    keys = ["," + ",".join(map(str, d)) + "," for d in docs]
    found = set()
    for r in rows.tolist():
        piece: list[int] = []
        for t in r + [eos]:
            if t != eos:
                piece.append(t)
                continue
            if len(piece) >= 12:
                k = "," + ",".join(map(str, piece)) + ","
                found |= {i for i, d in enumerate(keys) if k in d}
            piece = []
    return found


def test_pack_corpus_is_seeded_and_split_by_document(converted):
    _, tok = load_model(str(converted))
    corpora = {n: load_documents(n)[:20] for n in ("c4-demo", "wiki-demo")}
    tr1, va1, info = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=1)
    tr2, va2, _ = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=1)
    tr3, va3, _ = pack_corpus(tok, corpora, seqlen=32, val_tokens=256, seed=2)
    assert torch.equal(tr1, tr2) and torch.equal(va1, va2) and not torch.equal(va1, va3)
    assert va1.shape == (8, 32) and tr1.shape[1] == 32
    assert len(tr1) + len(va1) == sum(c["blocks"] for c in info["corpora"].values())
    assert all(c["val_blocks"] > 0 for c in info["corpora"].values())  # every corpus is represented
    # Held out by document: no document has text in both splits (split by block, the validation blocks'
    # neighbours from the same article were training blocks).
    docs = [tok(d, add_special_tokens=False)["input_ids"] for ds in corpora.values() for d in ds if d.strip()]
    held, trained = _docs_of(va1, docs, tok.eos_token_id), _docs_of(tr1, docs, tok.eos_token_id)
    assert held and trained and not held & trained
    with pytest.raises(TransMLAError, match="lower finetune.val_tokens"):
        pack_corpus(tok, corpora, seqlen=32, val_tokens=10**7, seed=1)
    # one block shared by three corpora of about a third each: every share rounds to none, so the fix is more
    thirds = {f"c4-{i}": load_documents("c4-demo")[10 * i : 10 * i + 10] for i in range(3)}
    with pytest.raises(TransMLAError, match="raise finetune.val_tokens"):
        pack_corpus(tok, thirds, seqlen=32, val_tokens=32, seed=1)
    assert len(pack_corpus(tok, thirds, seqlen=32, val_tokens=96, seed=1)[1]) == 3


def test_pack_corpus_holds_out_a_contiguous_span_of_a_running_text(converted):
    _, tok = load_model(str(converted))
    text = load_documents("wikitext2-test")  # one document: the rows joined into a running text
    assert len(text) == 1
    tr, va, info = pack_corpus(tok, {"wikitext2-test": [text[0][:60_000]]}, seqlen=32, val_tokens=320, seed=3)
    ids = tok(text[0][:60_000], add_special_tokens=False)["input_ids"]
    flat = va.reshape(-1).tolist()
    start = next(i for i in range(len(ids)) if ids[i : i + len(flat)] == flat)  # one span of the text, in order
    assert start % 32 == 0 and len(va) == 10
    assert len(tr) == (start // 32) + (len(ids) - start - 320) // 32  # the rest, before and after, never across it


def test_unfold_and_fold_keep_the_function(converted, blocks):
    model, _ = load_model(str(converted))
    x = blocks[1][:2]
    ref = _logprobs(model, x)
    n = unfold_latent_norms(model)
    assert n == model.config.num_hidden_layers * (2 if model.config.q_lora_rank else 1)
    assert all(isinstance(l.self_attn.kv_a_layernorm, UnfoldedNorm) for l in model.model.layers)
    assert (_logprobs(model, x) - ref).abs().max() < 1e-4
    head_calls = []  # the fold reads the latent only: no [batch, tokens, vocab] logits (its memory peak)
    hook = model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    fold_latent_norms(model, blocks[1])
    hook.remove()
    assert not head_calls
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
    # Trainer's use_cache=False (for training) is not what the checkpoint says: a plain forward caches
    assert loaded.config.use_cache is True and loaded(x[:, :4]).past_key_values is not None
    assert not list(out.glob("*.bin")) and list(out.glob("*.safetensors"))


class _Interrupt(TrainerCallback):
    """Kill the run (as a Ctrl-C would) right after step `at` was checkpointed."""

    def __init__(self, at: int):
        self.at = at

    def on_save(self, args, state, control, **kw):
        if state.global_step >= self.at:
            raise KeyboardInterrupt


class _FailAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        raise RuntimeError("failed before the first step")


def test_a_run_that_fails_before_saving_leaves_no_work_dir(converted, blocks, tmp_path):
    """A run that fails before its first checkpoint left its work dir with a run.json in it (the CLI's hidden
    .<out>.trainer beside --out): nothing to resume from, only a leftover."""
    model, _ = load_model(str(converted))
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="before the first step"):
        finetune(model, blocks[0], blocks[1], _cfg(), str(work), callbacks=[_FailAtStart()])
    assert not work.exists()


def test_interrupted_run_resumes_from_last_checkpoint(converted, blocks, trained, tmp_path):
    cfg = _cfg()
    model, _ = load_model(str(converted))
    with pytest.raises(KeyboardInterrupt):
        finetune(model, blocks[0], blocks[1], cfg, str(tmp_path), callbacks=[_Interrupt(8)])
    assert (tmp_path / "checkpoint-8").is_dir()
    model, _ = load_model(str(converted))  # a new process would start from the converted model again
    with pytest.raises(TransMLAError, match="another run.*config differ: lr"):  # not this run's checkpoints
        finetune(model, blocks[0], blocks[1], _cfg(lr=1e-3), str(tmp_path))
    other, _ = load_model(str(converted))
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # same shapes, other weights
    with pytest.raises(TransMLAError, match="another run.*model differ"):
        finetune(other, blocks[0], blocks[1], cfg, str(tmp_path))
    # other blocks (other corpora, split or seed) or another process count: another run too
    with pytest.raises(TransMLAError, match="another run.*data differ"):
        finetune(model, blocks[0].flip(0), blocks[1], cfg, str(tmp_path))
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}), pytest.raises(TransMLAError, match="world_size differ"):
        finetune(model, blocks[0], blocks[1], cfg, str(tmp_path))
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path))
    assert record["resumed_from"].endswith("checkpoint-8")
    assert record["steps"] == 16 and record["steps_this_run"] == 8
    ref_model, _, ref = trained
    assert record["val_loss_before"] == pytest.approx(ref["val_loss_before"])  # restored history
    assert record["val_loss_after"] == pytest.approx(ref["val_loss_after"], abs=1e-4)
    x = blocks[1][:2]
    assert (_logprobs(model, x) - _logprobs(ref_model, x)).abs().max() < 1e-3


def test_a_work_dir_that_holds_other_files_keeps_them(converted, blocks, tmp_path):
    """The run deletes what it wrote into its work dir (checkpoints, run.json) and nothing else: a user's
    --work-dir may be a folder of their own (it was deleted whole, with whatever it held)."""
    from transmla.training.finetune import finetune_on_corpora

    model, tok = load_model(str(converted))
    work = tmp_path / "mine"
    work.mkdir()
    (work / "notes.txt").write_text("keep")
    # a checkpoint-* folder the run did not write: the Trainer's rotation (by mtime) would delete it, so the
    # run is refused before it starts, naming it
    (work / "checkpoint-old-style").mkdir()
    with pytest.raises(TransMLAError, match="checkpoint-old-style: the Trainer rotates"):
        finetune_on_corpora(model, tok, {}, _cfg(max_tokens=2 * 4 * 64, eval_every=1), work, tmp_path / "out",
                            packed=blocks)
    assert (work / "checkpoint-old-style").is_dir() and not (tmp_path / "out").exists()
    (work / "checkpoint-old-style").rmdir()
    mine = tmp_path / "mine-out"  # an `out` holding other files: refused before training (they were deleted)
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(TransMLAError, match="not empty"):
        finetune_on_corpora(model, tok, {}, _cfg(max_tokens=2 * 4 * 64, eval_every=1), work, mine, packed=blocks)
    assert (mine / "notes.txt").read_text() == "keep" and not any(work.glob("checkpoint-*"))
    finetune_on_corpora(model, tok, {}, _cfg(max_tokens=2 * 4 * 64, eval_every=1), work, tmp_path / "out",
                        packed=blocks)
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert (work / "notes.txt").read_text() == "keep" and (tmp_path / "out" / "model.safetensors").is_file()
    own = tmp_path / "own"  # a work dir the run made is removed once empty
    finetune_on_corpora(load_model(str(converted))[0], tok, {}, _cfg(max_tokens=2 * 4 * 64, eval_every=1), own,
                        tmp_path / "out2", packed=blocks)
    assert not own.exists()


def test_one_process_trains_on_one_gpu_whatever_it_sees(tmp_path, monkeypatch):
    """With several GPUs visible and no launcher, Trainer would wrap the model in nn.DataParallel (the batch
    split over replicas, the loss's norm hook seeing one replica's rows): the arguments keep it to one."""
    from transmla.training.finetune import training_arguments

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # seen by TrainingArguments' device setup
    args = training_arguments(_cfg(device="cuda"), str(tmp_path))
    assert args.n_gpu == 1


def test_mean_train_loss_weights_each_entry_by_the_steps_it_covers():
    """Losses equal to the step number, logged every 3 steps, the run resumed from the checkpoint at step 10:
    Trainer restarts its count there, so the entry at 12 is the mean of steps 11-12, and step 10 (never
    logged) is left out, not given another entry's loss."""
    from transmla.training.finetune import mean_train_loss

    def mean(a, b):  # the mean of losses a..b
        return (a + b) / 2

    before = [{"loss": mean(1, 3), "step": 3}, {"loss": mean(4, 6), "step": 6}, {"loss": mean(7, 9), "step": 9},
              {"eval_loss": 1.0, "step": 10}]
    after = [{"loss": mean(11, 12), "step": 12}, {"loss": mean(13, 15), "step": 15}, {"loss": mean(16, 18), "step": 18},
             {"loss": mean(19, 20), "step": 20}]
    covered = [s for s in range(1, 21) if s != 10]
    assert mean_train_loss(before + after, resumed_at=10) == pytest.approx(sum(covered) / len(covered))
    assert mean_train_loss(before, resumed_at=0) == pytest.approx(5.0)  # steps 1-9
    assert mean_train_loss([], resumed_at=0) is None


def test_the_last_step_is_logged_when_it_is_not_a_logging_step(converted, blocks, tmp_path):
    """Trainer logs only at multiples of logging_steps: 5 steps logged every 3 would leave steps 4-5 out of the
    loss curve and of the recorded mean."""
    model, _ = load_model(str(converted))
    record = finetune(model, blocks[0], blocks[1], _cfg(max_tokens=5 * 4 * 64, log_every=3, eval_every=5),
                      str(tmp_path))
    logged = [h for h in record["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == [1, 3, 5]  # logging_first_step, every 3, the last
    spans = {1: 1, 3: 2, 5: 2}
    want = sum(h["loss"] * spans[h["step"]] for h in logged) / 5
    assert record["train_loss"] == pytest.approx(want)


def test_fingerprint_moments_are_chunked_float64():
    """The resume check's moments equal the whole-tensor float64 sums for any chunking (a partial last chunk,
    bf16 weights), so it needs no float64 copy of a large matrix."""
    from transmla.training.finetune import _moments

    g = torch.Generator().manual_seed(0)
    for p in (torch.randn(1000, 37, generator=g), torch.randn(513, generator=g).bfloat16(), torch.zeros(0)):
        ref = (p.double().sum().item(), p.double().square().sum().item())
        for chunk in (1, 100, 1 << 20):
            s, q = _moments(p, chunk)
            assert s == pytest.approx(ref[0], rel=1e-12, abs=1e-9) and q == pytest.approx(ref[1], rel=1e-12)
    p = torch.randn(100, generator=g)
    q = p.clone()
    q[99] += 1e-3  # one weight in the last chunk moved
    assert _moments(p, 16) != _moments(q, 16)


def test_resume_passes_over_a_checkpoint_cut_off_mid_save(tmp_path):
    """Trainer writes trainer_state.json last: a newer folder without a readable one (killed mid-save) is
    skipped for the newest complete checkpoint, so a restart does not fail on it every time."""
    from transmla.training.finetune import last_checkpoint

    assert last_checkpoint(str(tmp_path / "none")) is None
    for step, state in ((4, "{}"), (8, None), (10, '{"global_st'), (12, "{}")):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        if state is not None:
            (d / "trainer_state.json").write_text(state)
        if step != 12:  # 12: a state, but its weights never written
            (d / "model.safetensors").write_bytes(b"x")
    assert last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-12" / "model.safetensors").write_bytes(b"x")
    assert last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")


def test_bad_budget_and_teacher_are_refused_before_training(converted, blocks, tmp_path):
    """Corpora shorter than max_tokens (Trainer would loop over them: more passes than `epochs`) and a teacher
    of another vocabulary are refused with the fix named, before anything is written."""
    from types import SimpleNamespace

    model, _ = load_model(str(converted))
    with pytest.raises(TransMLAError, match="lower finetune.max_tokens to at most 192"):
        finetune(model, blocks[0][:3], blocks[1], _cfg(), str(tmp_path / "w"))
    vocab = model.lm_head.weight.shape[0]
    with pytest.raises(TransMLAError, match=f"vocabulary \\({vocab + 1} tokens\\)"):
        finetune(model, blocks[0], blocks[1], _cfg(objective="kd"), str(tmp_path / "w"),
                 teacher=SimpleNamespace(lm_head=torch.nn.Linear(4, vocab + 1)))
    assert not (tmp_path / "w").exists()


def test_a_diverged_run_is_an_error_not_a_saved_model(converted, blocks, tmp_path):
    """A run whose weights went non-finite (a learning rate far too high: NaN in every tensor) returned as trained and
    was saved as the fine-tuned model, exit 0; now one error naming the learning rate, before anything is saved."""
    from transformers import TrainerCallback

    class Diverge(TrainerCallback):  # what a far too high lr does, deterministically
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                with torch.no_grad():
                    model.model.layers[0].mlp.up_proj.weight.fill_(float("nan"))

    model, _ = load_model(str(converted))
    with pytest.raises(TransMLAError, match=r"the fine-tune diverged: validation loss nan at step 4.*lower the "
                                            r"learning rate \(lr 0.003\)"):
        finetune(model, blocks[0], blocks[1], _cfg(max_tokens=4 * 4 * 64), str(tmp_path / "w"), callbacks=[Diverge()])


def test_a_teacher_of_another_depth_is_refused_before_the_model_changes(cut, blocks, sharp, tmp_path):
    """Per-layer attention fitting pairs the student's layers with the teacher's: a teacher of another depth is
    one clear error before anything is changed (it was a ValueError from inside the run, leaving the model
    with unfolded latent norms and the fused kernel), and its config is refused before either model loads."""
    from transmla.training.finetune import check_teacher_config

    model, _ = load_model(str(cut))
    teacher, _ = load_model(str(sharp))
    teacher.model.layers = teacher.model.layers[:1]
    attn = model.config._attn_implementation
    for kw in ({"attn_weight": 1.0}, {"layerwise_epochs": 1.0}):
        with pytest.raises(TransMLAError, match=r"teacher's layers \(1\) is not the student's \(2\)"):
            finetune(model, blocks[0], blocks[1], _cfg(objective="kd", **kw), str(tmp_path / "w"), teacher=teacher)
    assert model.config._attn_implementation == attn and not (tmp_path / "w").exists()
    assert all(type(layer.self_attn.kv_a_layernorm).__name__ == "DeepseekV3RMSNorm" for layer in model.model.layers)
    student = {"model_type": "deepseek_v3", "vocab_size": 10, "num_hidden_layers": 2, "hidden_size": 64}
    check_teacher_config(student, {**student, "num_hidden_layers": 3}, _cfg(objective="kd"))  # kd alone: fine
    with pytest.raises(TransMLAError, match="layerwise_epochs to 0"):
        check_teacher_config(student, {**student, "num_hidden_layers": 3}, _cfg(objective="kd", layerwise_epochs=1.0))
    with pytest.raises(TransMLAError, match="hidden size"):
        check_teacher_config(student, {**student, "hidden_size": 32}, _cfg(objective="kd", attn_weight=1.0))


def test_the_fold_runs_under_the_fused_kernel_and_the_kernels_are_put_back(converted, blocks, tmp_path, monkeypatch):
    """The latent norms are folded back while the fused causal kernel still runs the model (the stock
    kernel's [B, h, T, T] scores made the fold the run's memory peak at long blocks); afterwards the
    model has its own attention kernel again."""
    from transmla.training import finetune as ft

    model, _ = load_model(str(converted))
    attn = model.config._attn_implementation
    seen = []
    real = ft.fold_latent_norms
    monkeypatch.setattr(ft, "fold_latent_norms", lambda m, ids: seen.append(m.config._attn_implementation) or real(m, ids))
    finetune(model, blocks[0], blocks[1], _cfg(max_tokens=2 * 4 * 64, eval_every=1), str(tmp_path / "w"))
    assert seen and seen[0] != attn and "causal" in seen[0]
    assert model.config._attn_implementation == attn


def test_the_validation_kl_is_at_temperature_one_whatever_the_training_temperature(cut, blocks, sharp, tmp_path):
    """The validation KL compares runs and objectives: the plain KL to the original, not tau^2 times the KL at
    the training temperature (which made it 460x larger at tau 4 for the same model)."""
    model, _ = load_model(str(cut))
    teacher, _ = load_model(str(sharp))
    before = [finetune(load_model(str(cut))[0], blocks[0], blocks[1], _cfg(objective="kd", max_tokens=4 * 64, kd_temperature=t),
                       str(tmp_path / f"w{t}"), teacher=teacher)["val_kd_before"] for t in (1.0, 4.0)]
    assert before[0] == pytest.approx(before[1], rel=1e-6)


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


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_attention_lr_scale_sets_the_step_of_the_mla_projections(converted, blocks, tmp_path, scale):
    # Adam's first step moves each weight by lr * sign(gradient): the largest change per weight is the lr its
    # group got, so one step shows the MLA projections at lr * scale and the original's own weights at lr
    lr = 1e-3
    model, _ = load_model(str(converted))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    finetune(model, blocks[0], blocks[1], _cfg(lr=lr, attention_lr_scale=scale, max_tokens=4 * 64, eval_every=1),
             str(tmp_path))
    after = model.state_dict()
    step = {k: (after[k] - before[k]).abs().max().item() for k in before if k.endswith(("o_proj.weight", "mlp.up_proj.weight"))}
    attn = [v for k, v in step.items() if "o_proj" in k]
    mlp = [v for k, v in step.items() if "up_proj" in k]
    assert attn and mlp
    assert all(v == pytest.approx(lr * scale, rel=1e-3) for v in attn), attn
    assert all(v == pytest.approx(lr, rel=1e-3) for v in mlp), mlp


def test_bad_config_and_unconverted_model(tiny_model_dir, blocks, tmp_path):
    with pytest.raises(TransMLAError, match="mode"):
        _cfg(mode="lora")
    with pytest.raises(TransMLAError, match="float16"):
        _cfg(dtype="float16")
    # a setting the run never reads is refused, not dropped: kd alone trained on kd whatever kd_weight said
    for bad, needs in ((dict(objective="kd", kd_weight=3.0), "objective kd\\+lm"),
                       (dict(objective="lm", kd_temperature=2.0), "objective kd or kd\\+lm"),
                       (dict(layerwise_lr=1e-2), "layerwise_epochs > 0"),
                       (dict(layerwise_batch_size=2), "layerwise_epochs > 0"),
                       (dict(layerwise_schedule="cosine"), "layerwise_epochs > 0"),
                       (dict(objective="kd+lm", kd_weight=0.0), "use objective lm")):
        with pytest.raises(TransMLAError, match=needs):
            _cfg(**bad)
    assert _cfg(objective="kd+lm", kd_weight=3.0, kd_temperature=2.0).kd_weight == 3.0  # read there: kept
    assert _cfg(layerwise_epochs=1.0, layerwise_lr=1e-2, layerwise_schedule="cosine").layerwise_lr == 1e-2
    original, _ = load_model(str(tiny_model_dir))
    with pytest.raises(TransMLAError, match="convert the model first"):
        finetune(original, blocks[0], blocks[1], _cfg(), str(tmp_path))
    assert not any(tmp_path.iterdir())  # nothing written


# ---------------------------------------------------------------- distillation from the original model

def _teacher(tiny_model_dir):
    t, _ = load_model(str(tiny_model_dir))
    return t


def test_kd_is_zero_for_a_lossless_conversion_and_never_trains_the_teacher(tiny_model_dir, blocks, tmp_path):
    """Student == teacher (lossless export): the validation KL is ~0; a KD step leaves the teacher untouched."""
    lossless = tmp_path / "lossless"
    convert(str(tiny_model_dir), lossless, ConvertOptions(lossless=True, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4),
            progress=False)
    model, _ = load_model(str(lossless))
    teacher = _teacher(tiny_model_dir)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    record = finetune(model, blocks[0], blocks[1], _cfg(objective="kd", max_tokens=2 * 4 * 64, eval_every=2, lr=1e-5),
                      str(tmp_path / "work"), teacher=teacher)
    assert record["val_kd_before"] < 1e-6
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    assert all(p.grad is None for p in teacher.parameters())
    assert [h["kd_loss"] for h in record["log_history"] if "kd_loss" in h]  # the KD curve is logged


KD = dict(objective="kd", kd_temperature=2.0, lr=3e-4)


@pytest.fixture(scope="module")
def sharp(tiny_model_dir, tmp_path_factory):
    """The tiny model with its output head scaled up 30x: a random model's next-token distribution is
    nearly uniform (KL of any conversion ~1e-3, below Adam's step noise); a peaked one has a KL to recover."""
    model, tok = load_model(str(tiny_model_dir))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 30)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def cut(sharp, tmp_path_factory):
    """The sharp tiny model at an 87.5% KV cut, RoRoPE by key energy (the query-metric default leaves this
    random model a KL of 0.17, too little for 16 KD steps to move reliably)."""
    out = tmp_path_factory.mktemp("kd-src") / "mla"
    convert(str(sharp), out, ConvertOptions(kv_cache_ratio=0.125, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4,
                                            rorope_metric="key"), progress=False)
    return out


@pytest.fixture(scope="module")
def kd_trained(cut, blocks, sharp, tmp_path_factory):
    model, tok = load_model(str(cut))
    work = tmp_path_factory.mktemp("kd-work")
    record = finetune(model, blocks[0], blocks[1], _cfg(**KD), str(work), teacher=_teacher(sharp))
    return model, tok, record


def test_kd_lowers_the_validation_kl(kd_trained, blocks):
    model, _, record = kd_trained
    assert record["objective"] == "kd" and record["steps"] == 16
    assert record["val_kd_after"] < 0.9 * record["val_kd_before"]
    parts = [h for h in record["log_history"] if "loss" in h]
    assert all("lm_loss" in h and "kd_loss" in h for h in parts)
    # eval_loss is the next-token cross-entropy for every objective (what the folded model scores)
    assert abs(mean_loss(model, blocks[1]) - record["val_loss_after"]) < 1e-3


def test_kd_checkpoint_is_stock_deepseek(kd_trained, blocks, tmp_path):
    model, tok, record = kd_trained
    out = save_finetuned(model, tok, tmp_path / "ft", record)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    x = blocks[1][:2]
    assert (_logprobs(loaded, x) - _logprobs(model, x)).abs().max() < 1e-5
    assert latent_norm_identity_error(loaded, x) < 1e-5
    assert json.loads((out / "config.json").read_text())["transmla"]["finetune"]["objective"] == "kd"


def test_kd_run_resumes_from_last_checkpoint(cut, blocks, kd_trained, sharp, tmp_path):
    cfg = _cfg(**KD)
    model, _ = load_model(str(cut))
    with pytest.raises(KeyboardInterrupt):
        finetune(model, blocks[0], blocks[1], cfg, str(tmp_path), callbacks=[_Interrupt(8)], teacher=_teacher(sharp))
    model, _ = load_model(str(cut))
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path), teacher=_teacher(sharp))
    assert record["resumed_from"].endswith("checkpoint-8") and record["steps_this_run"] == 8
    ref_model, _, ref = kd_trained
    assert record["val_kd_after"] == pytest.approx(ref["val_kd_after"], abs=1e-4)
    assert record["train_loss"] == pytest.approx(ref["train_loss"], abs=1e-4)  # over all 16 steps, not 8
    x = blocks[1][:2]
    assert (_logprobs(model, x) - _logprobs(ref_model, x)).abs().max() < 1e-3


def test_kd_objective_needs_the_teacher(converted, blocks, tmp_path):
    model, _ = load_model(str(converted))
    with pytest.raises(TransMLAError, match="teacher"):
        finetune(model, blocks[0], blocks[1], _cfg(objective="kd"), str(tmp_path))
    with pytest.raises(TransMLAError, match="objective"):
        _cfg(objective="mse")


# ---------------------------------------------------------------- review fixes

def test_restart_after_the_last_step_keeps_the_training_loss(converted, blocks, tmp_path):
    """A run that finished (its last checkpoint written) and is started again runs nothing and reports the
    whole run's training loss, not 0.0."""
    cfg = _cfg()
    model, _ = load_model(str(converted))
    first = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path))
    x = blocks[1][:2]
    ref = _logprobs(model, x)
    model, _ = load_model(str(converted))
    again = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path))
    assert again["steps"] == first["steps"] == 16 and again["steps_this_run"] == 0
    assert again["train_loss"] == pytest.approx(first["train_loss"]) and first["train_loss"] > 0
    assert again["val_loss_after"] == pytest.approx(first["val_loss_after"], abs=1e-5)
    assert (_logprobs(model, x) - ref).abs().max() < 1e-4  # the final weights, not one step more


def test_unfold_uses_the_recorded_latent_norm_eps(converted, blocks, tmp_path):
    """A vLLM-padded export (latent norms built for eps = rms_norm_eps, recorded in config.transmla) unfolds
    to the same function: with transformers' fixed 1e-6 the latent would start sqrt(eps ratio) too large."""
    config, sd, _, _ = load_checkpoint(converted)
    cfg, psd = pad_for_vllm(config, sd, latent_norm_eps=1e-4)
    model = instantiate(cfg, psd)
    x = blocks[1][:2]
    use_recorded_latent_norm_eps(model)
    ref = _logprobs(model, x)
    fresh = instantiate(cfg, psd)  # as from_pretrained gives it: eps 1e-6 in every latent norm
    assert unfold_latent_norms(fresh) > 0
    assert (_logprobs(fresh, x) - ref).abs().max() < 1e-4


def test_real_latent_norms_are_kept(converted, blocks):
    """A genuine DeepSeek checkpoint's kv_a_layernorm is a trained RMSNorm, not the identity: it stays."""
    model, _ = load_model(str(converted))
    real = model.model.layers[0].self_attn.kv_a_layernorm
    with torch.no_grad():
        real.weight.copy_(torch.linspace(0.5, 1.5, real.weight.numel()))
    n = unfold_latent_norms(model)
    assert model.model.layers[0].self_attn.kv_a_layernorm is real
    assert isinstance(model.model.layers[1].self_attn.kv_a_layernorm, UnfoldedNorm)
    assert n == model.config.num_hidden_layers * (2 if model.config.q_lora_rank else 1) - 1


def test_gradient_checkpointing_trains_the_same_model(converted, blocks, tmp_path):
    """Recomputing each decoder layer in backward (less memory) changes nothing but the cost."""
    runs = []
    for gc in (False, True):
        model, _ = load_model(str(converted))
        rec = finetune(model, blocks[0], blocks[1], _cfg(max_tokens=3 * 4 * 64, eval_every=3, gradient_checkpointing=gc),
                       str(tmp_path / str(gc)))
        runs.append((rec, _logprobs(model, blocks[1][:2])))
    (a, la), (b, lb) = runs
    assert a["val_loss_after"] == pytest.approx(b["val_loss_after"], abs=1e-5)
    assert (la - lb).abs().max() < 1e-4


def test_cli_distils_and_refuses_kd_without_a_teacher(cut, sharp, tmp_path):
    """`transmla finetune --objective kd`: without --teacher one clear error, exit 2 (bad input), nothing written;
    with it a run whose JSON names the objective, the validation KL and the peak RSS."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "transmla.cli", "finetune", "--model", str(cut), "--corpora", "c4-demo,wiki-demo",
            "--seqlen", "64", "--batch-size", "4", "--max-tokens", str(2 * 4 * 64), "--val-tokens", "256",
            "--eval-every", "2", "--objective", "kd"]
    bad = subprocess.run(base + ["--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and "--teacher" in bad.stderr and not (tmp_path / "bad").exists()
    ok = subprocess.run(base + ["--out", str(tmp_path / "ok"), "--teacher", str(sharp)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    res = json.loads(ok.stdout)
    assert res["objective"] == "kd" and res["val_kd_after"] is not None and res["peak_rss_gib"] > 0
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "ok")).__name__ == "DeepseekV3ForCausalLM"


# ---------------------------------------------------------------- per-layer attention matching

def test_attention_match_is_zero_for_a_lossless_conversion(tiny_model_dir, blocks, tmp_path):
    """Each converted layer's attention output equals the original layer's on the same input (lossless):
    the hooks feed the teacher the student's input with the teacher's own RoPE, one term per layer."""
    from transmla.training.distill import AttentionMatch

    lossless = tmp_path / "lossless"
    convert(str(tiny_model_dir), lossless, ConvertOptions(lossless=True, cal_nsamples=8, cal_seqlen=64, cal_batch_size=4),
            progress=False)
    model, _ = load_model(str(lossless))
    teacher = _teacher(tiny_model_dir)
    match = AttentionMatch(model, teacher)
    with torch.no_grad(), match:
        model(blocks[1][:2], use_cache=False)
    assert len(match.terms) == model.config.num_hidden_layers
    assert match.loss().item() < 1e-8
    model(blocks[1][:1], use_cache=False)  # outside the block: nothing recorded
    assert match.terms == []
    match.remove()


class _Regather(torch.autograd.Function):
    """Identity whose backward first restores a released weight (a sharding engine's pre-backward hook)."""

    @staticmethod
    def forward(ctx, x, param, full):
        ctx.param, ctx.full = param, full
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.param.data = ctx.full[0]
        return g, None, None


def _shard_like_zero3(module):
    """Holds module's weight only from its forward to its end, and again from its backward on, as DeepSpeed
    ZeRO-3 does with every parameter (released: a 0-element tensor); returns the hook handles."""
    param, full = module.weight, [module.weight.data]

    def gather(_m, _a):
        param.data = full[0]

    def release(_m, _a, out):
        full[0] = param.data
        param.data = torch.empty(0, dtype=param.dtype)
        wrap = lambda t: _Regather.apply(t, param, full) if torch.is_tensor(t) and t.requires_grad else t  # noqa: E731
        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    return [module.register_forward_pre_hook(gather), module.register_forward_hook(release)]


@pytest.mark.parametrize("objective", ["lm", "kd+lm"])
def test_the_loss_reads_the_head_through_its_module_as_a_sharded_run_must(cut, blocks, sharp, tmp_path, objective):
    """The fused loss reads the output head outside the model's forward; under a sharding engine that holds
    the head only within its module's forward and backward (ZeRO-3) the fine-tune still runs, and trains
    exactly as without it."""
    cfg = _cfg(objective=objective, max_tokens=4 * 4 * 64)
    teacher = (lambda: _teacher(sharp)) if objective != "lm" else (lambda: None)
    model, _ = load_model(str(cut))
    plain = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "plain"), teacher=teacher())
    model, _ = load_model(str(cut))
    assert not model.config.tie_word_embeddings
    hooks = _shard_like_zero3(model.lm_head)
    sharded = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "sharded"), teacher=teacher())
    for h in hooks:
        h.remove()
    losses = lambda r: [h["loss"] for h in r["log_history"] if "loss" in h]  # noqa: E731
    assert len(losses(sharded)) == 4 and losses(sharded) == pytest.approx(losses(plain), abs=1e-5)
    assert sharded["val_loss_after"] == pytest.approx(plain["val_loss_after"], abs=1e-5)


def test_attention_block_errors_score_each_block_as_if_alone(cut, blocks, sharp):
    """Validation's attention error is a mean of per-block errors however many processes run: the batched
    per-block errors equal each block's error from its own forward, and their mean is not the batch's
    ratio of sums (which a run in one process used to report)."""
    from transmla.training.distill import AttentionMatch

    model, _ = load_model(str(cut))
    match = AttentionMatch(model, _teacher(sharp))
    ids = blocks[1][:3]
    with torch.no_grad(), match:
        model(ids, use_cache=False)
    batched = match.block_errors()
    assert batched.shape == (3,) and match.terms == []
    alone = []
    for i in range(3):
        with torch.no_grad(), match:
            model(ids[i:i + 1], use_cache=False)
        alone.append(match.loss().item())
    assert batched.tolist() == pytest.approx(alone, rel=1e-4)
    with torch.no_grad(), match:
        model(ids, use_cache=False)
    assert match.loss().item() != pytest.approx(batched.mean().item(), rel=1e-6)
    match.remove()


def test_attention_matching_lowers_the_attention_error(cut, blocks, sharp, tmp_path):
    """kd + attention matching (weighted to dominate): the validation attention error falls, the curve is logged, the saved
    checkpoint is stock DeepseekV3; activation checkpointing's recompute adds no terms (same run)."""
    cfg = _cfg(objective="kd", kd_temperature=2.0, attn_weight=100.0, lr=3e-4, max_tokens=8 * 4 * 64)
    model, tok = load_model(str(cut))
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "a"), teacher=_teacher(sharp))
    assert record["val_attn_after"] < 0.9 * record["val_attn_before"]
    assert [h["attn_loss"] for h in record["log_history"] if "attn_loss" in h]
    model_gc, _ = load_model(str(cut))
    record_gc = finetune(model_gc, blocks[0], blocks[1], cfg.model_copy(update={"gradient_checkpointing": True}),
                         str(tmp_path / "b"), teacher=_teacher(sharp))
    assert record_gc["val_attn_after"] == pytest.approx(record["val_attn_after"], rel=1e-3)
    out = save_finetuned(model, tok, tmp_path / "ft", record)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert latent_norm_identity_error(loaded, blocks[1][:2]) < 1e-5


def test_attention_matching_needs_the_teacher(converted, blocks, tmp_path):
    model, _ = load_model(str(converted))
    with pytest.raises(TransMLAError, match="attn_weight"):
        finetune(model, blocks[0], blocks[1], _cfg(attn_weight=0.5), str(tmp_path))


# ---------------------------------------------------------------- layer-wise distillation

@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_layerwise_distillation_fits_each_attention_layer_and_nothing_else(cut, blocks, sharp, schedule):
    """Every converted layer's held-out attention error falls; only attention weights change; the
    stream each layer is fitted on is the fitted prefix's own (its error before equals the one
    measured by running the fitted model's attention on its own input, per layer). Either schedule."""
    from transmla.training.distill import AttentionMatch
    from transmla.training.layerwise import layerwise_distill, summary

    model, _ = load_model(str(cut))
    teacher = _teacher(sharp)
    unfold_latent_norms(model)
    model.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = layerwise_distill(model, teacher, blocks[0][:16], blocks[1], epochs=8, lr=1e-3, batch_size=4,
                               schedule=schedule)
    assert len(record["layers"]) == model.config.num_hidden_layers and record["steps_per_layer"] == 32
    assert record["schedule"] == schedule
    layers = record["layers"]
    assert all(r["val_err_after"] <= r["val_err_before"] for r in layers)  # a layer that got worse is put back
    assert any(r["fitted"] and r["val_err_after"] < 0.9 * r["val_err_before"] for r in layers)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".self_attn." in k for k in changed)
    for r in layers:  # exactly the fitted layers changed
        assert any(k.startswith(f"model.layers.{r['layer']}.") for k in changed) == r["fitted"]
    brief = summary(record)
    assert brief["layers_fitted"] == sum(r["fitted"] for r in layers) and brief["layers"] == len(layers)
    assert brief["attn_err_after"] == pytest.approx(sum(r["val_err_after"] for r in layers) / len(layers), abs=1e-4)
    assert summary(None) == {}
    assert not any(p.requires_grad for p in model.parameters())
    # the recorded "after" errors are those of the fitted model run end to end on the held-out blocks
    match = AttentionMatch(model, teacher)
    with torch.no_grad(), match:
        model(blocks[1], use_cache=False)
    errs = [((o.float() - t).pow(2).sum() / t.pow(2).sum()).item() for o, t in match.terms]
    match.remove()
    assert errs == pytest.approx([r["val_err_after"] for r in record["layers"]], rel=1e-3)


def test_layerwise_schedule_warms_up_then_decays_to_zero(cut, blocks, sharp, monkeypatch):
    """cosine: the lr each Adam step uses rises linearly over the first tenth of a layer's steps to lr, then
    falls monotonically to ~0 at its last step, and restarts for every layer; constant: lr at every step;
    an unknown schedule is refused before anything runs."""
    import transmla.training.layerwise as lw

    seen = []
    real_step = torch.optim.Adam.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    model, _ = load_model(str(cut))
    teacher = _teacher(sharp)
    unfold_latent_norms(model)
    model.requires_grad_(False)
    n = model.config.num_hidden_layers
    lw.layerwise_distill(model, teacher, blocks[0][:16], blocks[1], epochs=5, lr=2e-3, batch_size=4, schedule="cosine")
    steps = 20
    assert len(seen) == n * steps
    per_layer = [seen[i * steps : (i + 1) * steps] for i in range(n)]
    assert all(x == pytest.approx(per_layer[0]) for x in per_layer)  # every layer runs the same schedule
    lrs = per_layer[0]
    assert lrs[:2] == pytest.approx([1e-3, 2e-3])  # warmup: ceil(0.1 * 20) = 2 steps
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:])) and lrs[-1] < 0.02 * 2e-3
    seen.clear()
    lw.layerwise_distill(model, teacher, blocks[0][:8], blocks[1], epochs=1, lr=2e-3, batch_size=4)
    assert seen == [2e-3] * (2 * n)
    with pytest.raises(ValueError, match="cosine"):
        lw.layerwise_distill(model, teacher, blocks[0][:8], blocks[1], epochs=1, lr=2e-3, batch_size=4, schedule="step")


def test_a_run_that_fails_after_its_layerwise_phase_before_saving_leaves_no_work_dir(cut, blocks, sharp, tmp_path):
    """The phase's record (layerwise.json) is read only by a resume from a checkpoint, which holds the phase's
    weights: a run stopped before its first checkpoint left it and run.json behind, and the rerun ran the phase
    again anyway."""
    cfg = _cfg(objective="kd", max_tokens=4 * 4 * 64, layerwise_epochs=1)
    model, _ = load_model(str(cut))
    work = tmp_path / "work"
    with pytest.raises(RuntimeError, match="before the first step"):
        finetune(model, blocks[0], blocks[1], cfg, str(work), callbacks=[_FailAtStart()], teacher=_teacher(sharp))
    assert not work.exists()


def test_layerwise_phase_in_finetune_is_recorded_resumed_and_exported_stock(cut, blocks, sharp, tmp_path, monkeypatch):
    """finetune(layerwise_epochs > 0): the phase runs before the first step (whether it lowers the KL is
    measured on SmolLM2, not on random tiny models: reports/recovery/); a resumed run reports the phase's
    record without running it again; the saved checkpoint is stock DeepseekV3 with identity latent norms."""
    import transmla.training.layerwise as lw

    cfg = _cfg(objective="kd", lr=1e-4, max_tokens=4 * 4 * 64, eval_every=2, layerwise_epochs=4, layerwise_lr=1e-3,
               layerwise_schedule="cosine")
    model, tok = load_model(str(cut))
    with pytest.raises(KeyboardInterrupt):
        finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "w"), callbacks=[_Interrupt(2)], teacher=_teacher(sharp))
    monkeypatch.setattr(lw, "layerwise_distill", lambda *a, **k: pytest.fail("ran again on resume"))
    model, tok = load_model(str(cut))
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "w"), teacher=_teacher(sharp))
    assert record["resumed_from"].endswith("checkpoint-2") and record["layerwise"]["steps_per_layer"] == 16
    assert record["layerwise"]["schedule"] == "cosine"  # the config's schedule reached the phase
    plain, _ = load_model(str(cut))
    ref = finetune(plain, blocks[0], blocks[1], cfg.model_copy(update={"layerwise_epochs": 0.0}), str(tmp_path / "p"),
                   teacher=_teacher(sharp))
    assert ref["layerwise"] is None
    # the phase ran before step 0: the run's first validation differs from the plain run's, whose is the conversion's
    assert record["val_kd_before"] != pytest.approx(ref["val_kd_before"], rel=1e-4)
    out = save_finetuned(model, tok, tmp_path / "ft", record)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "DeepseekV3ForCausalLM"
    assert latent_norm_identity_error(loaded, blocks[1][:2]) < 1e-5
    assert "seconds" not in loaded.config.transmla["finetune"]["layerwise"]  # timings stay out of the content hash


def test_layerwise_distillation_needs_the_teacher(converted, blocks, tmp_path):
    model, _ = load_model(str(converted))
    with pytest.raises(TransMLAError, match="layerwise_epochs"):
        finetune(model, blocks[0], blocks[1], _cfg(layerwise_epochs=1), str(tmp_path))
    assert not (tmp_path / "layerwise.json").exists()


def test_epochs_pass_over_the_budgets_blocks_each_once_per_epoch(converted, blocks, tmp_path):
    """max_tokens picks the distinct blocks (the seeded order's first); epochs = passes over them: every
    one of them is trained on exactly `epochs` times, no other block ever."""
    from collections import Counter

    cfg = _cfg(max_tokens=4 * 4 * 64, epochs=2, eval_every=8)
    assert cfg.max_steps == 8 and cfg.train_blocks(len(blocks[0])) == 16 < len(blocks[0])
    assert _cfg(max_tokens=4 * 4 * 64, epochs=0.5).max_steps == 2
    model, _ = load_model(str(converted))
    seen = Counter()

    def record_rows(module, args):
        if module.training:
            seen.update(tuple(r) for r in args[0].tolist())

    model.model.embed_tokens.register_forward_pre_hook(record_rows)
    record = finetune(model, blocks[0], blocks[1], cfg, str(tmp_path / "w"))
    assert record["steps"] == 8 and record["tokens_trained"] == 2 * record["distinct_tokens"] == 2 * 16 * 64
    assert seen == Counter({tuple(r): 2 for r in blocks[0][:16].tolist()})
    # a budget that is not whole steps: the last batch of a pass is partial (4 + 1 blocks), yet every block is
    # still trained on `epochs` times (steps counted from tokens ran 3 steps, 9 block-passes of 10), and
    # tokens_trained counts the tokens trained on (it was steps x tokens per step once: 768 here against 640)
    seen.clear()
    model, _ = load_model(str(converted))
    model.model.embed_tokens.register_forward_pre_hook(record_rows)
    record = finetune(model, blocks[0], blocks[1], _cfg(max_tokens=5 * 64, epochs=2, eval_every=8), str(tmp_path / "w5"))
    assert record["steps"] == 4 and seen == Counter({tuple(r): 2 for r in blocks[0][:5].tolist()})
    assert record["tokens_trained"] == sum(seen.values()) * 64 == 10 * 64
    # grad_accum: a pass of 5 blocks at batch 2 is 3 batches, 2 steps (the last accumulates one batch)
    assert _cfg(max_tokens=5 * 64, batch_size=2, grad_accum=2, epochs=3).max_steps == 6
    with pytest.raises(TransMLAError, match="epochs"):
        _cfg(epochs=0)


def test_a_warmup_as_long_as_the_run_still_trains(converted, blocks, tmp_path):
    """transformers' warmup starts at rate 0: one step at warmup_ratio 0.6 (warmup_steps 1) left the weights
    as they were and saved them as fine-tuned, exit 0. The warmup now ends before the last step."""
    model, _ = load_model(str(converted))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = finetune(model, blocks[0], blocks[1], _cfg(max_tokens=4 * 64, warmup_ratio=0.6, eval_every=1),
                      str(tmp_path / "w"))
    assert record["steps"] == 1
    lrs = [h["learning_rate"] for h in record["log_history"] if "learning_rate" in h]
    assert lrs and all(lr > 0 for lr in lrs)
    assert record["val_loss_after"] < record["val_loss_before"]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

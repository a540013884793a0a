"""Recovery fine-tune of a converted (stock DeepseekV3) model with transformers' `Trainer`.

After conversion a short causal-LM run recovers quality (paper appendix E: 300M-6B tokens). Here:

    texts --pack_corpus--> train / validation blocks [n, seqlen] (seeded, held-out split)
    model --unfold_latent_norms--> latent at natural scale, kv_a_layernorm = identity module
          --Trainer (checkpoints, resume)--> trained weights
          --fold_latent_norms--> stock checkpoint again (kv_a_layernorm identity re-derived)

Why unfold: the export makes kv_a_layernorm (and q_a_layernorm) an identity by scaling the latent
rows of kv_a_proj_with_mqa by 1/s (s ~ 1e7-1e8) and setting the norm weight to s*sqrt(eps)
(transmla.method.mla.norm_identity_scale). Adam updates are ~lr per weight whatever the weight's size, so
training those ~1e-8-sized rows directly would wreck them in one step. Training therefore runs on
the equivalent parametrisation (latent rows times s, the norm replaced by an identity), and the
saved model gets a fresh s derived from the trained latent's energy on held-out data, so the
identity holds to NORM_TOL again (measured by diagnostics.latent_norm_identity_error).

Modes: "full" trains every weight; "attention" trains only the MLA projections (q_proj or
q_a_proj/q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj).
"""

from __future__ import annotations

import math
import random
import time

import torch

from transmla.config import FinetuneConfig
from transmla.errors import TransMLAError
from transmla.runtime.fast_attention import use_causal_padded_sdpa
from transmla.method.mla import norm_identity_scale

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine"}
ATTENTION_PARAMS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


# ---------------------------------------------------------------- data

def pack_corpus(tokenizer, corpora: dict[str, list[str]], seqlen: int, val_tokens: int, seed: int,
                max_train_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokenize documents, join them with EOS, cut fixed-length blocks; seeded held-out split.

    corpora: name -> documents. Blocks never mix corpora (each is packed on its own), are shuffled
    with `seed`, and the first ceil(val_tokens / seqlen) blocks are the validation split.
    Returns (train [n, seqlen], val [m, seqlen], info) as int64 tensors.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TransMLAError("The tokenizer has no EOS token to separate documents.", "set tokenizer.eos_token.")
    blocks, info = [], {"corpora": {}}
    for name, docs in corpora.items():
        ids: list[int] = []
        for doc in docs:
            if doc.strip():
                ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [eos]
        n = len(ids) // seqlen
        info["corpora"][name] = {"documents": len(docs), "tokens": len(ids), "blocks": n}
        if n:
            blocks.append(torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen))
    if not blocks:
        raise TransMLAError(f"The fine-tune corpora hold fewer than {seqlen} tokens.", "add data or lower finetune.seqlen.")
    allb = torch.cat(blocks)
    order = list(range(len(allb)))
    random.Random(seed).shuffle(order)
    allb = allb[order]
    n_val = math.ceil(val_tokens / seqlen)
    if n_val >= len(allb):
        raise TransMLAError(f"val_tokens={val_tokens} leaves no training blocks ({len(allb)} blocks of {seqlen}).",
                            "lower finetune.val_tokens.")
    val, train = allb[:n_val], allb[n_val:]
    info.update(train_blocks=len(train), val_blocks=len(val), train_tokens_available=train.numel(),
                val_tokens=val.numel(), seqlen=seqlen)
    if max_train_tokens is not None:
        info["epochs"] = round(max_train_tokens / train.numel(), 3)
    return train, val, info


class Blocks(torch.utils.data.Dataset):
    """Fixed-length token blocks as causal-LM examples (labels = inputs; the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        x = self.blocks[i]
        return {"input_ids": x, "labels": x}  # full blocks: no padding mask


# ---------------------------------------------------------------- latent norm (un)folding

def _latent_norms(model):
    """(attention module, norm attribute name, projection attribute name, rows) for each identity norm."""
    for layer in model.model.layers:
        a = layer.self_attn
        if isinstance(getattr(a, "kv_a_layernorm", None), torch.nn.Module):
            yield a, "kv_a_layernorm", "kv_a_proj_with_mqa", a.kv_a_layernorm.weight.shape[0]
        if isinstance(getattr(a, "q_a_layernorm", None), torch.nn.Module):
            yield a, "q_a_layernorm", "q_a_proj", a.q_a_layernorm.weight.shape[0]


class UnfoldedNorm(torch.nn.Identity):
    """Stands in for an identity-built RMSNorm during training; remembers the eps to fold back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps


@torch.no_grad()
def unfold_latent_norms(model) -> int:
    """Scale each identity norm's latent rows up by s and replace the norm with an identity module.

    The exported norm weight is s*sqrt(eps) on every row (mla.build_mla_layer); the model's function
    is unchanged to NORM_TOL. Returns the number of norms unfolded.
    """
    n = 0
    for attn, norm_name, proj_name, r in list(_latent_norms(model)):
        norm, proj = getattr(attn, norm_name), getattr(attn, proj_name)
        eps = float(norm.variance_epsilon)
        s = norm.weight.double() / math.sqrt(eps)  # [r]
        proj.weight[:r] *= s[:, None].to(proj.weight.dtype)
        if proj.bias is not None:
            proj.bias[:r] *= s.to(proj.bias.dtype)
        setattr(attn, norm_name, UnfoldedNorm(eps))
        n += 1
    return n


@torch.no_grad()
def fold_latent_norms(model, calib_ids: torch.Tensor, batch_size: int = 4) -> dict:
    """Inverse of unfold_latent_norms with s re-derived from the trained latent's mean square on
    `calib_ids` [n, t] (held-out tokens), as the converter does from its calibration statistics."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    sites = list(_unfolded(model))
    energy = [0.0] * len(sites)  # sum over tokens of mean(c^2), per site
    hooks = []
    for k, (a, _, proj_name, r) in enumerate(sites):
        def hook(mod, inp, out, k=k, r=r):
            energy[k] += out[..., :r].double().pow(2).mean(-1).sum().item()

        hooks.append(getattr(a, proj_name).register_forward_hook(hook))
    was_training, tokens = model.training, 0
    model.eval()
    try:
        for i in range(0, len(calib_ids), batch_size):
            x = calib_ids[i : i + batch_size].to(next(model.parameters()).device)
            model(input_ids=x, use_cache=False)
            tokens += x.numel()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    scales = []
    for k, (a, norm_name, proj_name, r) in enumerate(sites):
        eps = getattr(a, norm_name).eps
        s = norm_identity_scale(energy[k] / max(tokens, 1), eps)
        proj = getattr(a, proj_name)
        proj.weight[:r] /= s
        if proj.bias is not None:
            proj.bias[:r] /= s
        norm = DeepseekV3RMSNorm(r, eps=eps).to(device=proj.weight.device, dtype=proj.weight.dtype)
        norm.weight.fill_(s * math.sqrt(eps))
        setattr(a, norm_name, norm)
        scales.append(s)
    return {"norms": len(scales), "min_scale": min(scales, default=None), "max_scale": max(scales, default=None)}


def _unfolded(model):
    for layer in model.model.layers:
        a = layer.self_attn
        if isinstance(getattr(a, "kv_a_layernorm", None), UnfoldedNorm):
            yield a, "kv_a_layernorm", "kv_a_proj_with_mqa", a.config.kv_lora_rank
        if isinstance(getattr(a, "q_a_layernorm", None), UnfoldedNorm):
            yield a, "q_a_layernorm", "q_a_proj", a.config.q_lora_rank


def select_trainable(model, mode: str) -> dict:
    """Freeze what `mode` does not train; returns {"trainable": n, "total": n} parameter counts."""
    total = trainable = 0
    for name, p in model.named_parameters():
        train = mode == "full" or (".self_attn." in name and name.split(".")[-2] in ATTENTION_PARAMS)
        p.requires_grad_(train)
        total += p.numel()
        trainable += p.numel() if train else 0
    return {"trainable": trainable, "total": total}


def check_stock_deepseek(model) -> None:
    if getattr(model.config, "model_type", None) != "deepseek_v3":
        raise TransMLAError(
            f"finetune expects a converted DeepseekV3 checkpoint, got model_type={model.config.model_type!r}.",
            "convert the model first (transmla convert / the convert stage) and fine-tune its output directory.",
        )


# ---------------------------------------------------------------- training

def training_arguments(cfg: FinetuneConfig, output_dir: str, eval_on_start: bool = True):
    """transformers.TrainingArguments for `cfg` (checkpoints every eval_every steps; weights in
    safetensors, optimizer/RNG state as torch tensors that Trainer reloads with weights_only=True)."""
    from transformers import TrainingArguments

    steps = cfg.max_steps
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=steps,
        learning_rate=cfg.lr,
        lr_scheduler_type=SCHEDULES[cfg.schedule],
        warmup_steps=int(round(cfg.warmup_ratio * steps)),
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        bf16=cfg.dtype == "bfloat16",
        use_cpu=cfg.device == "cpu",
        logging_steps=cfg.log_every,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=cfg.eval_every,
        eval_on_start=eval_on_start,  # the validation loss before training: the baseline the run must beat
        save_strategy="steps",
        save_steps=cfg.eval_every,
        save_total_limit=2,
        report_to=[],
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=False,
        use_cache=False,
    )


def last_checkpoint(output_dir: str) -> str | None:
    from pathlib import Path

    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None


def finetune(model, train: torch.Tensor, val: torch.Tensor, cfg: FinetuneConfig, work_dir: str,
             callbacks: list | None = None) -> dict:
    """Train `model` (stock DeepseekV3, in place) with Trainer; resume from `work_dir`'s last checkpoint.

    On return the model is folded back to the stock format. Returns the run record: losses before and
    after (validation), the Trainer's log history (loss curves), tokens, seconds, resume point.
    """
    from transformers import Trainer, default_data_collator

    check_stock_deepseek(model)
    torch.manual_seed(cfg.seed)
    unfold_latent_norms(model)
    counts = select_trainable(model, cfg.mode)
    attn = model.config._attn_implementation
    use_causal_padded_sdpa(model)  # packed blocks have no padding: the fused causal kernel is exact and faster
    model.train()
    resume = last_checkpoint(work_dir)
    # A resumed run has its step-0 loss in the restored history.
    args = training_arguments(cfg, work_dir, eval_on_start=resume is None)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(train), eval_dataset=Blocks(val),
                      data_collator=default_data_collator, callbacks=callbacks or [])
    t0 = time.perf_counter()
    try:
        out = trainer.train(resume_from_checkpoint=resume)
        seconds = time.perf_counter() - t0
        history = trainer.state.log_history
        evals = [h for h in history if "eval_loss" in h]
        final = trainer.evaluate() if not evals or evals[-1]["step"] != trainer.state.global_step else evals[-1]
    finally:
        model.config._attn_implementation = attn
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    fold = fold_latent_norms(model, val[: max(1, min(len(val), 16))])
    steps_run = trainer.state.global_step - (_step_of(resume) if resume else 0)
    return {
        "config": cfg.model_dump(),
        "params": counts,
        "val_loss_before": evals[0]["eval_loss"] if evals and evals[0]["step"] == 0 else None,
        "val_loss_after": final["eval_loss"],
        "train_loss": out.training_loss,
        "steps": trainer.state.global_step,
        "tokens_trained": trainer.state.global_step * cfg.tokens_per_step,
        "resumed_from": resume,
        "steps_this_run": steps_run,
        "seconds_this_run": round(seconds, 1),
        "tokens_per_second": round(steps_run * cfg.tokens_per_step / seconds, 1) if seconds > 0 else None,
        "log_history": history,
        "latent_norms": fold,
    }


def save_finetuned(model, tokenizer, out, record: dict):
    """Write the (folded, stock) fine-tuned model to `out` atomically: safetensors weights, the
    conversion record in config.json's `transmla` section extended by a `finetune` summary, and the
    full run record (loss curves) in transmla_finetune.json. Returns the directory."""
    import json

    from transmla.io.paths import atomic_dir, new_output_dir

    out = new_output_dir(out)
    # Timings stay out of config.json: the content hash (evaluation cache key) must not depend on them.
    summary = {k: v for k, v in record.items()
               if k not in ("log_history", "resumed_from", "seconds_this_run", "tokens_per_second", "steps_this_run")}
    meta = dict(getattr(model.config, "transmla", None) or {})
    meta["finetune"] = summary
    with atomic_dir(out) as tmp:
        model.config.transmla = meta
        model.save_pretrained(tmp)  # safetensors (transformers 5 writes nothing else)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "transmla_finetune.json").write_text(json.dumps(record, indent=2, default=str))
    return out


def finetune_on_corpora(model, tokenizer, corpora: dict[str, list[str]], cfg: FinetuneConfig, work_dir,
                        out) -> dict:
    """The whole recovery run: pack `corpora` (name -> documents), train (resuming from `work_dir`'s
    last checkpoint), write the stock checkpoint to `out`, delete the Trainer checkpoints. Returns
    the run record."""
    import shutil
    from pathlib import Path

    check_stock_deepseek(model)
    train, val, data = pack_corpus(tokenizer, corpora, cfg.seqlen, cfg.val_tokens, cfg.seed, cfg.max_tokens)
    record = finetune(model, train, val, cfg, str(work_dir))
    record["data"] = data
    if Path(out).exists():  # a run that died between writing the model and cleaning up
        shutil.rmtree(out)
    save_finetuned(model, tokenizer, out, record)
    shutil.rmtree(work_dir, ignore_errors=True)
    return record


def _step_of(checkpoint: str) -> int:
    return int(str(checkpoint).rstrip("/").rsplit("-", 1)[-1])


@torch.no_grad()
def mean_loss(model, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token loss of `model` over token blocks [n, t] (what Trainer's eval_loss reports)."""
    model.eval()
    dev = next(model.parameters()).device
    tot, n = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        x = blocks[i : i + batch_size].to(dev)
        tot += model(input_ids=x, labels=x, use_cache=False).loss.item() * len(x)
        n += len(x)
    return tot / n

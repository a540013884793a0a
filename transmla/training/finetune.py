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

Objectives (training.distill): "lm" next-token cross-entropy; "kd" KL divergence from the original
model's next-token distribution (the teacher: the GQA model the conversion started from, run without
gradients on the same packed blocks); "kd+lm" both. The losses are computed from the final hidden
states in chunks of positions, so no [batch, tokens, vocab] logits are ever held. The validation
loss (eval_loss) is the next-token cross-entropy for every objective, so runs compare; with a
teacher the validation KL (eval_kd) is logged too.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import time
from pathlib import Path

import torch

from transmla.adapters import warn_past_positions
from transmla.config import FinetuneConfig
from transmla.errors import TransMLAError
from transmla.method.diagnostics import latent_norms
from transmla.method.mla import norm_identity_scale
from transmla.runtime.fast_attention import use_causal_padded_sdpa
from transmla.method.diagnostics import use_recorded_latent_norm_eps
from transmla.training.distill import AttentionMatch, recovery_loss

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine"}
ATTENTION_PARAMS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# A latent norm is the export's identity construction when its weight is one constant s*sqrt(eps) with
# s this large (exports: ~1e6-1e8); a trained norm (a genuine DeepSeek checkpoint) varies per row, and
# a freshly initialised one (weight 1, eps 1e-6) has s = 1e3. Those are real norms: trained as they are.
IDENTITY_MIN_SCALE = 1e4


# ---------------------------------------------------------------- data

def _param_name(field: str) -> str:
    return f"finetune.{field}"


def pack_corpus(tokenizer, corpora: dict[str, list[str]], seqlen: int, val_tokens: int,
                seed: int, setting=_param_name) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Tokenize documents, join them with EOS, cut fixed-length blocks; a seeded held-out split by document.

    corpora: name -> documents. Each corpus gives the validation split its share of `val_tokens`
    (proportional to its tokens) in whole documents, chosen in a seeded order, so no validation block
    shares an article with a training block. A corpus that is one running text (WikiText) holds out one
    contiguous span at a seeded place instead. Blocks never mix corpora or cross the split; training
    blocks are shuffled with `seed`. Returns (train [n, seqlen], val [m, seqlen], info) as int64 tensors.
    setting(field) names a setting in an error (the params' finetune.val_tokens; the CLI's --val-tokens).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise TransMLAError("The tokenizer has no EOS token to separate documents.", "set tokenizer.eos_token.")
    rng = random.Random(seed)
    docs = {name: [tokenizer(d, add_special_tokens=False)["input_ids"] + [eos] for d in texts if d.strip()]
            for name, texts in corpora.items()}
    total = sum(len(t) for ds in docs.values() for t in ds)
    n_val = math.ceil(val_tokens / seqlen)
    if 2 * seqlen > total:  # one block to train on and one to validate on, whatever val_tokens says
        raise TransMLAError(f"{setting('seqlen')} {seqlen}: the corpora hold {total} tokens, fewer than two blocks.",
                            f"lower {setting('seqlen')} or add data.")
    if n_val * seqlen >= total:
        raise TransMLAError(f"{setting('val_tokens')} {val_tokens} leaves no training tokens (the corpora hold "
                            f"{total}).", f"lower {setting('val_tokens')}.")
    train_blocks, val_blocks, info = [], [], {"corpora": {}}

    def blocks_of(ids: list[int]) -> torch.Tensor:
        n = len(ids) // seqlen
        return torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)

    for name, ds in docs.items():
        tokens = sum(len(t) for t in ds)
        want = round(n_val * tokens / total) * seqlen if total else 0  # this corpus's validation tokens
        if len(ds) == 1:  # one running text: a contiguous held-out span, the rest before and after it
            ids = ds[0]
            want = min(want, max(len(ids) - seqlen, 0) // seqlen * seqlen)
            start = rng.randrange(0, len(ids) - want + 1, seqlen) if want else 0
            held, parts = ids[start : start + want], [ids[:start], ids[start + want :]]
        else:
            order = list(range(len(ds)))
            rng.shuffle(order)
            held, k = [], 0
            while len(held) < want and k < len(order) - 1:  # at least one document stays for training
                held += ds[order[k]]
                k += 1
            rest = sorted(order[k:])
            parts = [[t for i in rest for t in ds[i]]]
        v = blocks_of(held)[: want // seqlen]
        tr = torch.cat([blocks_of(p) for p in parts])
        val_blocks.append(v)
        train_blocks.append(tr)
        info["corpora"][name] = {"documents": len(ds), "tokens": tokens, "blocks": len(tr) + len(v),
                                 "val_blocks": len(v)}
    val = torch.cat(val_blocks) if val_blocks else torch.zeros(0, seqlen, dtype=torch.long)
    train = torch.cat(train_blocks) if train_blocks else torch.zeros(0, seqlen, dtype=torch.long)
    if len(train) + len(val) == 0:
        raise TransMLAError(f"The fine-tune corpora hold fewer than {seqlen} tokens.",
                            f"add data or lower {setting('seqlen')}.")
    if not len(train) or not len(val):
        raise TransMLAError(f"{setting('val_tokens')} {val_tokens} leaves {len(train)} training and {len(val)} "
                            f"validation blocks of {seqlen} tokens ({total} tokens in all).",
                            f"lower {setting('val_tokens')}." if not len(train) else
                            f"raise {setting('val_tokens')}: each corpus holds out its share of it in whole {seqlen}-token "
                            f"blocks, and every share here rounded to none.")
    order = list(range(len(train)))
    rng.shuffle(order)
    train = train[order]
    info.update(train_blocks=len(train), val_blocks=len(val), train_tokens_available=train.numel(),
                val_tokens=val.numel(), seqlen=seqlen, split="by document")
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

def is_identity_norm(norm) -> bool:
    """Whether a latent RMSNorm is the export's identity construction (weight = s sqrt(eps) on every row,
    s >= IDENTITY_MIN_SCALE), not a real norm."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if w is None or eps is None or w.numel() == 0:
        return False
    w = w.detach().double()
    return bool((w - w[0]).abs().max() <= 1e-6 * w[0].abs()) and float(w[0]) / math.sqrt(eps) >= IDENTITY_MIN_SCALE


def _latent_norms(model):
    """(attention module, norm attribute name, projection attribute name, rows) for each identity norm
    (real norms, as in a genuine DeepSeek checkpoint, are left alone)."""
    proj = {"kv_a_layernorm": "kv_a_proj_with_mqa", "q_a_layernorm": "q_a_proj"}
    for a, norm_name, norm in latent_norms(model):  # an UnfoldedNorm has no weight: never listed
        if is_identity_norm(norm):
            yield a, norm_name, proj[norm_name], norm.weight.shape[0]


class UnfoldedNorm(torch.nn.Identity):
    """Stands in for an identity-built RMSNorm during training; remembers the eps to fold back."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps


@torch.no_grad()
def unfold_latent_norms(model) -> int:
    """Scale each identity norm's latent rows up by s and replace the norm with an identity module.

    The exported norm weight is s*sqrt(eps) on every row (mla.build_mla_layer), eps the one the export
    recorded (config.transmla.latent_norm_eps; a vLLM-padded export's is rms_norm_eps, not transformers'
    1e-6): the model's function is unchanged to NORM_TOL. Returns the number of norms unfolded.
    """
    use_recorded_latent_norm_eps(model)
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
            # the decoder alone: the hooks read the latent, and the head's [batch, tokens, vocab] logits were the
            # fold's peak (1.2 GB a batch for a 152k vocabulary at 512 tokens)
            model.get_decoder()(input_ids=x, use_cache=False)
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
        train = mode == "full" or is_attention_param(name)
        p.requires_grad_(train)
        total += p.numel()
        trainable += p.numel() if train else 0
    return {"trainable": trainable, "total": total}


def is_attention_param(name: str) -> bool:
    """An MLA projection of a decoder layer (what mode "attention" trains; attention_lr_scale applies to it)."""
    return ".self_attn." in name and name.split(".")[-2] in ATTENTION_PARAMS


def param_groups(model, lr: float, weight_decay: float, attention_lr_scale: float, decay: set[str]) -> list[dict]:
    """The trainable parameters in optimizer groups: MLA projections at lr * attention_lr_scale, the rest
    at lr; weight decay only on the names in `decay` (Trainer's rule: not on biases and norms)."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        key = (is_attention_param(name), name in decay)
        g = groups.setdefault(key, {"params": [], "lr": lr * (attention_lr_scale if key[0] else 1.0),
                                    "weight_decay": weight_decay if key[1] else 0.0})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def check_mla_type(model_type: str | None) -> None:
    """A converted MLA model's type (its config.json's model_type): checkable before any weight loads."""
    from transmla.models import MODEL_TYPES

    if model_type != "deepseek_v3" and model_type not in MODEL_TYPES:
        raise TransMLAError(
            f"finetune expects a converted MLA checkpoint, got model_type={model_type!r}.",
            "convert the model first (transmla convert / the convert stage) and fine-tune its output directory.",
        )


def check_training_blocks(n: int, cfg: FinetuneConfig, setting=_param_name) -> None:
    """The corpora's `n` training blocks hold cfg.max_tokens (Trainer would otherwise loop over the blocks
    there are: more passes than `epochs` says). setting(field) names a setting in the error."""
    needed = -(-cfg.max_tokens // cfg.seqlen)
    if n < needed:
        raise TransMLAError(
            f"The corpora hold {n} training blocks of {cfg.seqlen} tokens ({n * cfg.seqlen} tokens), "
            f"fewer than {setting('max_tokens')} {cfg.max_tokens} needs ({needed}).",
            f"lower {setting('max_tokens')} to at most {n * cfg.seqlen} ({setting('epochs')} repeats them), "
            "or add corpora.")


def check_teacher_config(student: dict, teacher: dict, cfg: FinetuneConfig | None = None) -> None:
    """The teacher's config against the student's, before either loads: distillation compares their
    next-token distributions, so their vocabularies must agree, and per-layer attention fitting (cfg's
    attn_weight or layerwise_epochs) pairs their layers, so then their depth and width must too (the loaded
    models are checked again)."""
    from transmla.adapters import SUPPORTED
    from transmla.models import MODEL_TYPES

    mt = teacher.get("model_type")
    if mt not in SUPPORTED and mt != "deepseek_v3" and mt not in MODEL_TYPES:  # its decoder is read layer by layer
        raise TransMLAError(f"The teacher's architecture {mt!r} is not one this package converts or exports.",
                            "pass the original model the student was converted from as the teacher.")
    s, t = (c.get("text_config", c) for c in (student, teacher))
    if s.get("vocab_size") is not None and t.get("vocab_size") is not None and s["vocab_size"] != t["vocab_size"]:
        raise TransMLAError(
            f"The teacher's vocabulary ({t['vocab_size']} tokens) is not the student's ({s['vocab_size']}): "
            "distillation compares their next-token distributions.",
            "pass the original model the student was converted from as --teacher.")
    if cfg is not None and (cfg.attn_weight > 0 or cfg.layerwise_epochs > 0):
        for key, what in (("num_hidden_layers", "layers"), ("hidden_size", "hidden size")):
            if s.get(key) is not None and t.get(key) is not None and s[key] != t[key]:
                _layer_mismatch(what, s[key], t[key])


def check_teacher_tokenizer(student_tok, teacher_tok) -> None:
    """Distillation compares the two models' probabilities token id by token id: the same vocabulary size is not
    enough, the ids must mean the same strings (a teacher with another tokenizer of that size ran, exit 0)."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s != t:
        differ = sorted(set(s.items()) ^ set(t.items()), key=lambda kv: kv[1])[:1]
        example = f" (e.g. id {differ[0][1]} is {differ[0][0]!r} in one and not the other)" if differ else ""
        raise TransMLAError(f"The teacher's tokenizer is not the student's{example}: the same token ids would mean "
                            "other strings.", "pass the original model the student was converted from as --teacher.")


def check_teacher_is_not_student(student: str, teacher: str) -> None:
    """A teacher that is the student itself (or a copy) has nothing to teach: its KL is 0 from the first step, and
    the run trained on nothing and exited 0. The same source, or two folders with the same config and weights (a
    converted student is a folder; a GGUF or catalog teacher cannot be one)."""
    from pathlib import Path

    from transmla.io.sources import content_hash, parse_source, source_config

    s, t = parse_source(student), parse_source(teacher)
    same = s.text == t.text
    if not same and s.kind == t.kind == "dir":
        a, b = Path(s.location).resolve(), Path(t.location).resolve()
        # only where the configs agree are the weights hashed (the normal teacher, the original, differs at once)
        same = a == b or (source_config(s) == source_config(t) and content_hash(a) == content_hash(b))
    if same:
        raise TransMLAError(f"The teacher {teacher} is the student itself (same config and weights): it has "
                            "nothing to teach (its KL to the student is 0).",
                            "pass the original model the student was converted from as --teacher.")


def _layer_mismatch(what: str, student, teacher):
    raise TransMLAError(
        f"The teacher's {what} ({teacher}) is not the student's ({student}): per-layer attention fitting "
        "(attn_weight, layerwise_epochs) matches each converted layer to the original's.",
        "pass the original model the student was converted from as the teacher, or set attn_weight and "
        "layerwise_epochs to 0 (--attn-weight 0 --layerwise-epochs 0).")


def check_mla_model(model, cfg: FinetuneConfig | None = None) -> None:
    """A converted MLA model: stock DeepseekV3 (a TransMLA export or a genuine DeepSeek checkpoint: only
    identity-built latent norms are unfolded for training, real ones are trained as norms) or an export
    into one of this package's classes (transmla.models: Mixtral, Qwen3, Gemma 2/3; their extra weights,
    Qwen3's query norm and raw-key norm projection, Gemma's own norms, are trained as they are)."""
    from transmla.models import Gemma2MLAConfig, Gemma3MLAConfig

    check_mla_type(getattr(model.config, "model_type", None))
    if cfg is not None:
        warn_past_positions(model.config, cfg.seqlen, "seqlen")
    if cfg is not None and isinstance(model.config, (Gemma2MLAConfig, Gemma3MLAConfig)):
        # the teacher's attention would need each layer's own RoPE and sliding-window mask
        for name in ("attn_weight", "layerwise_epochs"):
            if getattr(cfg, name) > 0:
                raise TransMLAError(f"per-layer attention fitting ({name} > 0) is not built for Gemma 2/3 exports.",
                                    f"set finetune.{name}: 0 (the kd / kd+lm objectives work) for this model.")


# ---------------------------------------------------------------- training

def training_arguments(cfg: FinetuneConfig, output_dir: str, eval_on_start: bool = True):
    """transformers.TrainingArguments for `cfg` (checkpoints every eval_every steps; weights in
    safetensors, optimizer/RNG state as torch tensors that Trainer reloads with weights_only=True)."""
    from transformers import TrainingArguments

    steps = cfg.max_steps
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=steps,
        learning_rate=cfg.lr,
        lr_scheduler_type=SCHEDULES[cfg.schedule],
        # transformers' warmup gives step 0 the rate 0 (and step i i/W): a warmup as long as the run trained
        # nothing (one step at warmup_ratio >= 0.5 left the weights as they were, exit 0), so the last step
        # always gets past it
        warmup_steps=min(int(round(cfg.warmup_ratio * steps)), steps - 1),
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
        # Trainer counts the tokens each step really trained on (a partial last batch of a pass included) and
        # keeps the count in its checkpoints: the record's tokens_trained
        include_num_input_tokens_seen="all",
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=False,
        use_cache=False,
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
    )
    # One process trains on one device. With several GPUs visible and no launcher Trainer would wrap the model
    # in nn.DataParallel: the batch split over replicas (max_steps counts one), and the loss's hook on
    # the final norm seeing one replica's rows against the whole batch's labels. Several GPUs: torchrun.
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args


def last_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-N` of `output_dir`, or None. Trainer writes into the folder in place
    and `trainer_state.json` last, so a run killed mid-save leaves a newer folder without a readable state:
    resuming from it would fail on every restart, so it is passed over for the one before."""
    import json

    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = sorted((_step_of(str(d)), d) for d in root.glob("checkpoint-*") if d.is_dir() and _run_checkpoint(d.name))
    for _, d in reversed(found):
        try:
            json.loads((d / "trainer_state.json").read_text())
        except (OSError, ValueError):
            continue
        if any(d.glob("*.safetensors")):
            return str(d)
    return None


def _model_fingerprint(model) -> list:
    """Per parameter: name, shape and two float64 moments; tells apart two models of one shape (a resume
    from another model's checkpoint) in about a second per billion weights."""
    return [[n, list(p.shape), *(f"{m:.9g}" for m in _moments(p))] for n, p in model.named_parameters()]


def _moments(p: torch.Tensor, chunk: int = 1 << 20) -> tuple[float, float]:
    """(sum, sum of squares) of `p` in float64, a chunk at a time: `p.double()` (or `sum(dtype=float64)`,
    which casts the same way) would hold a float64 copy of the largest matrix, 1.1 GB for a 0.5B model's
    embedding, beside a model about to train."""
    s = q = 0.0
    with torch.no_grad():
        for c in p.detach().reshape(-1).split(chunk):
            c = c.double()
            # 9 digits are kept: the sums' last bits may follow the thread count; another model differs far above
            s += c.sum().item()
            q += c.square().sum().item()
    return s, q


def _blocks_digest(train: torch.Tensor, val: torch.Tensor) -> str:
    """sha256 of the training and validation blocks (their shapes and token ids, in order)."""
    import hashlib

    h = hashlib.sha256()
    for t in (train, val):
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def _check_run(work_dir: str, cfg: FinetuneConfig, model, teacher, resume: str | None, train: torch.Tensor,
               val: torch.Tensor) -> None:
    """Record what `work_dir`'s checkpoints are a run of (the config, the student and the teacher) and refuse
    to resume another run's: a checkpoint carries weights, optimizer and schedule, not its settings."""
    import json

    run = {"config": cfg.model_dump(mode="json"), "model": _model_fingerprint(model),
           "teacher": None if teacher is None else _model_fingerprint(teacher),
           # the blocks (other corpora, split or seed: another run) and the processes (they set the steps)
           "data": _blocks_digest(train, val), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    path = Path(work_dir) / "run.json"
    if resume is not None and path.is_file():
        old = json.loads(path.read_text())
        # a key an older run.json lacks is not compared: that run's checkpoints stay resumable
        diff = [k for k in run if k in old and old[k] != run[k]]
        if diff:
            keys = [k for k in run["config"] if old.get("config", {}).get(k) != run["config"][k]]
            raise TransMLAError(
                f"{work_dir} holds checkpoints of another run (its {', '.join(diff)} differ"
                f"{': ' + ', '.join(keys) if keys else ''}); resuming would continue that run under these settings.",
                "pass another --work-dir (or --out), or delete that folder to start over.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".run.json.{os.getpid()}")  # every process of a distributed run writes it
    tmp.write_text(json.dumps(run))
    os.replace(tmp, path)


def _trainer_class():
    from transformers import Trainer

    class RecoveryTrainer(Trainer):
        """Trainer whose loss is training.distill.recovery_loss on the final hidden states (chunked; the
        teacher's forward runs without gradients), logging its parts (lm_loss, kd_loss) with each train
        loss and the validation cross-entropy (eval_loss) and KL (eval_kd) at each evaluation."""

        def __init__(self, *a, cfg: FinetuneConfig, teacher=None, **kw):
            super().__init__(*a, **kw)
            self.cfg, self.teacher = cfg, teacher
            # per-layer attention matching (attn_weight > 0): hooks on the student's attention modules
            self.match = AttentionMatch(self.model, teacher) if cfg.attn_weight > 0 else None
            self.loss_is_scaled_for_ga = False  # a per-batch mean: Trainer divides by grad_accum
            self._parts: dict[str, list[float]] = {}

        def create_optimizer(self, model=None):
            # Trainer's optimizer and kwargs, on groups that give the MLA projections their own learning
            # rate (the schedule multiplies every group's lr by the same factor, so the ratio holds)
            if self.optimizer is None and self.cfg.attention_lr_scale != 1.0:
                opt_model = self.model if model is None else model
                cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
                groups = param_groups(opt_model, self.args.learning_rate, self.args.weight_decay,
                                      self.cfg.attention_lr_scale, set(self.get_decay_parameter_names(opt_model)))
                self.optimizer = cls(groups, **kwargs)
            return super().create_optimizer(model)

        def _losses(self, model, input_ids, objective, attn_blocks: bool = False, tau: float | None = None):
            # The forward goes through `model` as Trainer hands it (DistributedDataParallel under
            # torchrun / accelerate launch: its forward prepares the gradient all-reduce); the final
            # hidden states are taken at the last norm and the loss is chunked over the vocabulary with
            # the same lm_head parameter, so only the last position's logits are computed there.
            inner = self.accelerator.unwrap_model(model)
            captured = []
            hook = inner.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out))
            try:
                with self.match or contextlib.nullcontext():
                    model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            finally:
                hook.remove()
            hidden, model = captured[-1], inner
            t_h = t_w = t_cap = None
            if objective != "lm":
                with torch.no_grad():
                    t = self.teacher
                    t_h = t.model(input_ids=input_ids.to(t.device), use_cache=False).last_hidden_state
                    t_h, t_w = t_h.to(hidden.device), t.lm_head.weight.to(hidden.device)
                    t_cap = getattr(t.config, "final_logit_softcapping", None)  # Gemma 2
            head = model.lm_head
            loss, parts = _call_as(head, lambda h: recovery_loss(
                h, head.weight, input_ids, objective, t_h, t_w, tau=self.cfg.kd_temperature if tau is None else tau,
                kd_weight=self.cfg.kd_weight, chunk=self.cfg.loss_chunk,
                softcap=getattr(model.config, "final_logit_softcapping", None), teacher_softcap=t_cap), hidden)
            if self.match is not None and attn_blocks:  # validation: one attention error per block
                parts["attn"] = self.match.block_errors().tolist()
            elif self.match is not None:
                attn = self.match.loss()
                loss = loss + self.cfg.attn_weight * attn
                parts["attn"] = attn.item()
            return loss, parts

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, parts = self._losses(model, inputs["input_ids"], self.cfg.objective)
            if model.training:
                for k, v in parts.items():
                    if v is not None:
                        self._parts.setdefault(k, []).append(v)
            return (loss, None) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            ids = inputs["input_ids"]
            objective = "lm" if self.teacher is None else "kd"
            # The validation KL at temperature 1 whatever the training's: the plain KL to the original's
            # next-token distribution, comparable across runs and objectives (kd_temperature shapes the loss)
            with torch.no_grad():
                if self.accelerator.num_processes == 1:
                    # the batch's cross-entropy and KL (blocks of one length: their mean is the blocks' mean),
                    # the attention error per block
                    parts = self._losses(model, ids, objective, attn_blocks=True, tau=1.0)[1]
                    rows = [{**parts, "attn": parts["attn"][i] if "attn" in parts else None} for i in range(len(ids))]
                else:
                    # Block by block: the distributed sampler fills the last batch with repeated blocks, and
                    # gather_for_metrics drops them only as rows, so a batch mean would count them in part.
                    rows = [self._losses(model, ids[i:i + 1], objective, attn_blocks=True, tau=1.0)[1]
                            for i in range(len(ids))]
                    rows = [{**r, "attn": r["attn"][0] if "attn" in r else None} for r in rows]
            # [n, 3]: cross-entropy, KL and attention error per block, every process's blocks counted once, so
            # a run in N processes scores the validation blocks as one does
            vals = torch.tensor([[r["lm"], r.get("kd") or 0.0, r.get("attn") or 0.0] for r in rows],
                                dtype=torch.float64, device=ids.device)
            vals = self.accelerator.gather_for_metrics(vals)
            self._eval_sums[0] += vals.sum(0).cpu()
            self._eval_sums[1] += len(vals)
            # Trainer's eval_loss, from a tensor on the batch's device (it gathers it across processes, which
            # NCCL does only for CUDA tensors); exact in one process, replaced by the sums' mean in several
            lm = rows[0]["lm"] if self.accelerator.num_processes == 1 else sum(r["lm"] for r in rows) / len(rows)
            return torch.tensor(lm, device=ids.device), None, None

        def evaluation_loop(self, *a, metric_key_prefix: str = "eval", **kw):
            self._eval_sums = [torch.zeros(3, dtype=torch.float64), 0]
            out = super().evaluation_loop(*a, metric_key_prefix=metric_key_prefix, **kw)
            sums, n = self._eval_sums
            if n:
                lm, kd, attn = (sums / n).tolist()
                if self.accelerator.num_processes > 1:
                    out.metrics[f"{metric_key_prefix}_loss"] = lm
                if self.teacher is not None:
                    out.metrics[f"{metric_key_prefix}_kd"] = kd
                    if self.match is not None:
                        out.metrics[f"{metric_key_prefix}_attn"] = attn
            return out

        def log(self, logs, start_time=None):
            if "loss" in logs and self._parts:  # the parts of the losses logged since the last train-loss entry
                # averaged over the processes too, as Trainer averages `loss` (every process logs here, and
                # every one has the same parts: one objective)
                keys = sorted(self._parts)
                means = torch.tensor([sum(self._parts[k]) / len(self._parts[k]) for k in keys], dtype=torch.float64,
                                     device=self.args.device)
                means = self.accelerator.reduce(means, "mean")
                for k, m in zip(keys, means.tolist(), strict=True):
                    logs[f"{k}_loss"] = round(m, 6)
                self._parts = {}
            super().log(logs, start_time)

    return RecoveryTrainer


def _call_as(module: torch.nn.Module, fn, *args):
    """fn(*args) run as `module`'s forward, with the hooks a sharding engine put on the module.

    The loss reads the head's weight outside the model's forward. DeepSpeed ZeRO-3 partitions every
    weight between its module's forward and backward, and gathers it only through that module's hooks:
    for the loss in forward and again before the gradient reaches the weight in backward. DDP and FSDP2
    (the root unit holds the head unsharded until backward) need no hook; the call costs them nothing.
    """
    module.forward = fn
    try:
        return module(*args)
    finally:
        del module.forward


def mean_train_loss(history: list[dict], resumed_at: int = 0) -> float | None:
    """The mean training loss over the steps whose loss was logged, from the logged train losses.

    Each entry is the mean since the step Trainer last logged. A run resumed from the checkpoint at step
    `resumed_at` restarts that count there, so its first entry covers (resumed_at, step], not the steps
    since the restored history's last entry (those between that entry and the checkpoint were never
    logged, and are left out rather than given another entry's loss)."""
    prev, covered, total = 0, 0, 0.0
    for h in history:
        if "loss" in h and "step" in h and h["step"] > prev:
            start = max(prev, resumed_at) if h["step"] > resumed_at else prev
            total += h["loss"] * (h["step"] - start)
            covered += h["step"] - start
            prev = h["step"]
    return total / covered if covered else None


def _log_last_step_callback():
    """A callback that makes Trainer log at the last step: it logs only at multiples of logging_steps, so
    without it a run whose max_steps is not one leaves its last steps out of the loss curve and the mean."""
    from transformers import TrainerCallback

    class LogLastStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                control.should_log = True
            return control

    return LogLastStep()


def finetune(model, train: torch.Tensor, val: torch.Tensor, cfg: FinetuneConfig, work_dir: str,
             callbacks: list | None = None, teacher=None) -> dict:
    """Train `model` (a converted MLA model, in place) with Trainer; resume from `work_dir`'s last checkpoint.

    teacher: the original model (any causal LM with `.model` and `.lm_head` sharing the tokenizer); needed
    by the kd objectives, used for the validation KL whenever given. On return the model is folded back to
    the stock format. Returns the run record: losses before and after (validation), the Trainer's log
    history (loss curves), tokens, seconds, resume point.
    """
    from transformers import default_data_collator

    check_mla_model(model, cfg)
    if teacher is not None and teacher.lm_head.weight.shape[0] != model.lm_head.weight.shape[0]:
        raise TransMLAError(
            f"The teacher's vocabulary ({teacher.lm_head.weight.shape[0]} tokens) is not the student's "
            f"({model.lm_head.weight.shape[0]}): distillation compares their next-token distributions.",
            "pass the original model the student was converted from as the teacher.")
    if cfg.needs_teacher and teacher is None:
        name, value = cfg.teacher_setting
        raise TransMLAError(f"finetune.{name}={value!r} distils from the original model, but no teacher was given.",
                            "pass the original model as the teacher, or use objective: lm with attn_weight: 0 "
                            "and layerwise_epochs: 0.")
    if teacher is not None and (cfg.attn_weight > 0 or cfg.layerwise_epochs > 0):
        s_n, t_n = len(model.model.layers), len(teacher.model.layers)
        if s_n != t_n:  # refused before the model is changed for training, not by the phase inside it
            _layer_mismatch("layers", s_n, t_n)
    check_training_blocks(len(train), cfg)
    resume = last_checkpoint(work_dir)
    _check_run(work_dir, cfg, model, teacher, resume, train, val)
    torch.manual_seed(cfg.seed)
    attn = model.config._attn_implementation
    teacher_attn = None if teacher is None else teacher.config._attn_implementation
    # Trainer sets config.use_cache from its arguments (False, for training): the saved model must keep the
    # converted one's (a plain forward of the fine-tuned checkpoint returned no cache)
    use_cache = model.config.use_cache
    trainer = None
    # From here the models run the fused causal kernel (packed blocks have no padding: it is exact, faster,
    # and never builds the stock kernel's [B, h, T, T] scores); the finally puts their kernels back whatever
    # happens. The model itself stays in its training form (unfolded latent norms) if a step fails.
    try:
        unfold_latent_norms(model)
        counts = select_trainable(model, cfg.mode)
        use_causal_padded_sdpa(model)
        if teacher is not None:
            teacher.to(getattr(torch, cfg.teacher_dtype)).eval().requires_grad_(False)
            use_causal_padded_sdpa(teacher)
        # the budget's blocks (the seeded order's first), for both phases and every epoch
        train = train[: cfg.train_blocks(len(train))]
        layerwise = _layerwise_phase(model, teacher, train, val, cfg, work_dir, resume)
        model.train()
        # A resumed run has its step-0 loss in the restored history.
        args = training_arguments(cfg, work_dir, eval_on_start=resume is None)
        trainer = _trainer_class()(model=model, args=args, train_dataset=Blocks(train), eval_dataset=Blocks(val),
                                   data_collator=default_data_collator,
                                   callbacks=[*(callbacks or []), _log_last_step_callback()], cfg=cfg, teacher=teacher)
        if teacher is not None and next(teacher.parameters()).device != args.device:
            teacher.to(args.device)  # Trainer moves the student to this process's device; the teacher goes with it
        t0 = time.perf_counter()
        seen_before = _tokens_seen(resume)
        if resume and _step_of(resume) >= cfg.max_steps:
            # Finished before (a restart after the last checkpoint): Trainer would run one step past
            # max_steps, so restore the final weights and history instead of training.
            from transformers.trainer_callback import TrainerState

            trainer._load_from_checkpoint(resume)
            trainer.state = TrainerState.load_from_json(str(Path(resume) / "trainer_state.json"))
        else:
            trainer.train(resume_from_checkpoint=resume)
        seconds = time.perf_counter() - t0
        history = trainer.state.log_history
        evals = [h for h in history if "eval_loss" in h]
        final = trainer.evaluate() if not evals or evals[-1]["step"] != trainer.state.global_step else evals[-1]
        if not math.isfinite(final["eval_loss"]) or not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            # a diverged run was saved as the fine-tuned model (NaN in every tensor), exit 0
            raise TransMLAError(f"the fine-tune diverged: validation loss {final['eval_loss']} at step "
                                f"{trainer.state.global_step}, non-finite weights; nothing was saved.",
                                f"lower the learning rate (lr {cfg.lr:g}) or max_grad_norm ({cfg.max_grad_norm:g}), "
                                f"and start again after removing {work_dir} (its checkpoints would resume the "
                                "diverged run).")
        if trainer.match is not None:
            trainer.match.remove()
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_disable()
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        # folded under the fused kernel too: the stock one's scores made the fold, after all the training, the
        # run's memory peak at long blocks (3 GiB against 0.6 for a tiny model at 4,096 tokens)
        fold = fold_latent_norms(model, val[: max(1, min(len(val), 16))])
    except BaseException:
        if last_checkpoint(work_dir) is None:  # nothing to resume from (layerwise.json is read only with a
            remove_run_files(work_dir)  # checkpoint, which holds the phase's weights): no files left of it
        raise
    finally:
        if trainer is not None and trainer.match is not None:
            trainer.match.remove()
        model.config._attn_implementation = attn
        model.config.use_cache = use_cache
        if teacher is not None:
            teacher.config._attn_implementation = teacher_attn
    steps_run = trainer.state.global_step - (_step_of(resume) if resume else 0)
    return {
        "config": cfg.model_dump(),
        "objective": cfg.objective,
        "params": counts,
        "val_loss_before": evals[0]["eval_loss"] if evals and evals[0]["step"] == 0 else None,
        "val_loss_after": final["eval_loss"],
        "val_kd_before": evals[0].get("eval_kd") if evals and evals[0]["step"] == 0 else None,
        "val_kd_after": final.get("eval_kd"),
        "val_attn_before": evals[0].get("eval_attn") if evals and evals[0]["step"] == 0 else None,
        "val_attn_after": final.get("eval_attn"),
        "train_loss": mean_train_loss(history, _step_of(resume) if resume else 0),
        "steps": trainer.state.global_step,
        "tokens_trained": trainer.state.num_input_tokens_seen,
        "distinct_tokens": train.numel(),
        "resumed_from": resume,
        "steps_this_run": steps_run,
        "seconds_this_run": round(seconds, 1),
        "tokens_per_second": (round((trainer.state.num_input_tokens_seen - seen_before) / seconds, 1)
                              if seconds > 0 and steps_run else None),
        "log_history": history,
        "latent_norms": fold,
        "layerwise": layerwise,
    }


def _layerwise_phase(model, teacher, train: torch.Tensor, val: torch.Tensor, cfg: FinetuneConfig, work_dir: str,
                     resume: str | None) -> dict | None:
    """Layer-wise distillation (training.layerwise) on the blocks the budget holds, before the first
    Trainer step; its record is kept in `work_dir`, so a resumed run (whose checkpoint holds the fitted
    weights) reports it without running it again."""
    import json

    if cfg.layerwise_epochs <= 0:
        return None
    path = Path(work_dir) / "layerwise.json"
    if resume is not None and path.is_file():
        return json.loads(path.read_text())
    from transmla.training.layerwise import layerwise_distill

    was = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    record = layerwise_distill(model, teacher, train, val, cfg.layerwise_epochs, cfg.layerwise_lr,
                               cfg.layerwise_batch_size, seed=cfg.seed, log=_log, schedule=cfg.layerwise_schedule)
    for p, w in was.items():
        p.requires_grad_(w)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return record


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


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
    if summary.get("layerwise"):
        summary["layerwise"] = {k: v for k, v in summary["layerwise"].items() if k != "seconds"}
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
                        out, teacher=None, packed: tuple | None = None) -> dict:
    """The whole recovery run: pack `corpora` (name -> documents), train (resuming from `work_dir`'s
    last checkpoint; `teacher` for the kd objectives), write the stock checkpoint to `out`, delete the
    Trainer checkpoints. Returns the run record. packed: pack_corpus's result for these corpora and
    `cfg`, when the caller packed them already (the CLI does, to refuse a bad split before the model loads)."""
    import shutil
    from pathlib import Path

    check_mla_model(model, cfg)
    check_work_dir(work_dir)
    if not (Path(out) / "transmla_finetune.json").is_file():  # not this function's own earlier output
        from transmla.io.paths import check_output

        check_output(out)  # a folder in use: refused now (it was deleted with its files after training)
    train, val, data = packed or pack_corpus(tokenizer, corpora, cfg.seqlen, cfg.val_tokens, cfg.seed)
    record = finetune(model, train, val, cfg, str(work_dir), teacher=teacher)
    record["data"] = data
    if not is_main_process():  # several processes (DDP): every one holds the same weights, one writes them
        return record
    if (Path(out) / "transmla_finetune.json").is_file():  # a run that died between writing the model and cleaning
        shutil.rmtree(out)  # up; anything else at `out` stays (new_output_dir refuses a folder in use: a user's files)
    save_finetuned(model, tokenizer, out, record)
    remove_run_files(work_dir)
    return record


def _run_checkpoint(name: str) -> bool:
    """A folder name the Trainer writes its checkpoints under: checkpoint-<step>."""
    return re.fullmatch(r"checkpoint-\d+", name) is not None


def check_work_dir(work_dir) -> None:
    """Refuse a work dir holding a `checkpoint-*` folder the run did not write: transformers' Trainer rotates
    every `checkpoint-*` folder of its output dir by modification time (save_total_limit), so it would delete
    it (only when the run takes over a second: a test that passed alone failed on a loaded CI host)."""
    from pathlib import Path

    root = Path(work_dir)
    foreign = sorted(p.name for p in root.glob("checkpoint-*") if p.is_dir() and not _run_checkpoint(p.name)) \
        if root.is_dir() else []
    if foreign:
        raise TransMLAError(f"--work-dir {root} holds {', '.join(foreign)}: the Trainer rotates every checkpoint-* "
                            "folder of its work dir and would delete it.",
                            "move it out of that folder, or give --work-dir another folder.")


def remove_run_files(work_dir) -> None:
    """Delete what a run wrote into `work_dir` (Trainer checkpoints, run.json, layerwise.json), then the folder
    if that left it empty. Only those: a user's --work-dir may be a folder that holds other things."""
    import shutil
    from pathlib import Path

    root = Path(work_dir)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.is_dir() and _run_checkpoint(p.name.removeprefix("tmp-")):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name in ("run.json", "layerwise.json") or re.fullmatch(r"\.run\.json\.\d+", p.name):
            p.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        root.rmdir()


def is_main_process() -> bool:
    """Rank 0 of a distributed run (torchrun / accelerate launch), or a single process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _tokens_seen(checkpoint: str | None) -> int:
    """The training tokens a checkpoint's run had seen (0 without one)."""
    import json

    if checkpoint is None:
        return 0
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("num_input_tokens_seen") or 0)


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

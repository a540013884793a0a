"""Stage 6: recovery fine-tune of a converted checkpoint (transformers Trainer), cached on the
checkpoint's content hash, the corpora's hashes and the training config.

The Trainer's checkpoints live in the task run's own directory (content-addressed by the same key),
so a killed run started again with the same inputs resumes from its last checkpoint. They are
deleted once the fine-tuned model is written: the model is the result, the checkpoints only a way
to get there.
"""

from __future__ import annotations

import csv
import io
import os

from transmla.errors import TransMLAError
from transmla.io.data import load_documents
from transmla.training.finetune import FinetuneConfig, finetune_on_corpora
from transmla.io.sources import content_hash, load_model

from .artifacts import cached_task, model_ref, task_dir
from .model import data_dir_of


@cached_task("finetune")
def finetune_checkpoint(model: dict, corpora: list[dict], config: dict, max_documents: int | None = None,
                        teacher: dict | None = None) -> dict:
    """Fine-tune a converted (stock DeepseekV3) model dir -> ref to the fine-tuned model dir.

    teacher: ref of the original model (the kd objectives distil from it; its content hash is in the key).
    The ref carries the run summary (tokens, losses before/after, tokens/s); the directory holds
    transmla_finetune.json with the full Trainer log history (loss curves).
    """
    if os.environ.get("WORLD_SIZE", "1") != "1":
        # the config's steps count WORLD_SIZE processes, which the key does not see; this task is one process
        raise TransMLAError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}: the pipeline's fine-tune runs in one process. "
                            "Fix: unset WORLD_SIZE, or fine-tune in several with `torchrun ... -m transmla.cli "
                            "finetune` (configs/accelerate/README.md)")
    d = task_dir()
    cfg = FinetuneConfig(**config)
    m, tok = load_model(model["path"], dtype="float32", device=cfg.device)  # fp32 master weights; bf16 = autocast
    t = load_model(teacher["path"], dtype=cfg.teacher_dtype, device=cfg.device)[0] if teacher else None
    docs = {c["name"]: load_documents(c["name"], data_dir_override=data_dir_of(c), max_documents=max_documents,
                                   revision=c.get("revision"))
            for c in corpora}
    record = finetune_on_corpora(m, tok, docs, cfg, d / "trainer", d / "model", teacher=t)
    summary = {k: v for k, v in record.items() if k not in ("log_history", "config", "data")}
    return model_ref(d / "model", content_hash(d / "model"), finetune=summary)


CURVES = {"train_loss": "loss", "train_lm": "lm_loss", "train_kd": "kd_loss", "train_attn": "attn_loss",
          "val_loss": "eval_loss", "val_kd": "eval_kd", "val_attn": "eval_attn", "learning_rate": "learning_rate"}


def loss_curves(log_history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Trainer log history -> {"train_loss": [(step, loss)], "train_lm", "train_kd", "train_attn" (the objective's
    parts), "val_loss" (cross-entropy), "val_kd" (KL to the teacher), "val_attn" (attention matching),
    "learning_rate"}; curves never logged are left out
    (an lm run has no KD curves)."""
    curves = {name: [(h["step"], h[k]) for h in log_history if k in h] for name, k in CURVES.items()}
    return {k: v for k, v in curves.items() if v or k in ("train_loss", "val_loss", "learning_rate")}


def curves_csv(curves: dict[str, list[tuple[int, float]]]) -> str:
    """One row per logged step: step, train_loss, val_loss, learning_rate (blank where not logged)."""
    steps = sorted({s for points in curves.values() for s, _ in points})
    by = {name: dict(points) for name, points in curves.items()}
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", *curves])
    for s in steps:
        w.writerow([s, *[by[name].get(s, "") for name in curves]])
    return buf.getvalue()

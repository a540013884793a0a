"""Flow: recovery fine-tune of one converted model -> a stock DeepseekV3 checkpoint, loss curves.

    converted checkpoint + corpora (+ the original model: the teacher of the kd objectives)
        -> finetune (Trainer; resumes a killed run) -> fine-tuned checkpoint
                                                    -> loss curves (DVC plots, MLflow)

    python -m flows.finetune --model smollm2-135m --method transmla --budget 0.125 [--checkpoint DIR] [--out DIR]

The re-evaluation is the evaluate flow with --finetuned (its own DVC stage).
"""

from __future__ import annotations

import json

from prefect import flow

from tasks import tracking
from tasks.artifacts import publish
from tasks.finetune import curves_csv, finetune_checkpoint, loss_curves
from tasks.model import checkpoint_ref, dataset_ref, resolve_model
from transmla.errors import TransMLAError
from transmla.io.data import check_document_limit
from transmla.io.paths import check_output, write_text_atomic
from transmla.training import layerwise

from . import _cli, layout
from .params import Profile


@flow(name="finetune")
def finetune(profile: Profile, model: str, method: str, budget: float, checkpoint: str | None = None,
             out: str | None = None) -> dict:
    if checkpoint is not None and out is None:
        raise TransMLAError(f"--checkpoint {checkpoint} without --out: a one-off fine-tune would replace the pipeline's "
                            "fine-tuned model and MLflow run.", "pass --out DIR for the fine-tuned model.")
    ft = profile.finetune
    if out is not None:  # a directory the user named: refused now if in use, not after hours of training
        check_output(out, "new_dir")
    src = checkpoint_ref(checkpoint or layout.checkpoint_dir(model, method, budget), "convert")
    for c in ft.corpora:  # on the hub a document corpus is streamed up to a limit: refused without one, now
        check_document_limit(c, ft.max_documents, setting="finetune.max_documents")
    teacher = resolve_model(profile.model(model).source) if ft.needs_teacher else None  # the original model
    ref = finetune_checkpoint(src, [dataset_ref(c) for c in ft.corpora], ft.config(profile.device), ft.max_documents,
                              teacher)
    # a pipeline output (a DVC out) is replaced; a user's --out never
    dest = publish(ref, out or layout.finetuned_dir(model, method, budget), replace=out is None)
    record = json.loads((dest / "transmla_finetune.json").read_text())
    curves = loss_curves(record["log_history"])
    summary = {"model": model, "method": method, "budget": budget, "corpora": list(ft.corpora),
               **{k: v for k, v in record.items() if k != "log_history"}}
    if out is not None:  # a one-off run: never the pipeline's records or MLflow run
        return ref
    write_text_atomic(layout.training_file(model, method, budget), json.dumps(summary, indent=2, default=str))
    write_text_atomic(layout.loss_curve_file(model, method, budget), curves_csv(curves))
    tracking.track(profile.mlflow.experiment, model, method, budget, finetuned=True,
                   # the trained weights' hash too: a new conversion under the same settings trains anew, and
                   # its curves must not be kept beside (MLflow keeps a curve once per run) the first training's
                   config={**ft.config(profile.device), "corpora": list(ft.corpora), "finetuned_sha256": ref["sha256"]},
                   params={"model": model, "finetune": ft.config(profile.device), "corpora": ",".join(ft.corpora)},
                   metrics={"train_loss_mean": record["train_loss"],  # "train_loss" is the per-step curve
                            **{k: record[k] for k in ("val_loss_before", "val_loss_after", "val_kd_before",
                                                      "val_kd_after", "tokens_trained", "tokens_per_second",
                                                      "seconds_this_run") if record.get(k) is not None},
                            **{f"layerwise_{k}": v for k, v in layerwise.summary(record.get("layerwise")).items()
                               if k in ("seconds", "attn_err_before", "attn_err_after")}},
                   history=curves, artifacts={"finetune.json": summary})
    return ref


if __name__ == "__main__":
    _cli.entry(finetune, __doc__, variant=True, new_outputs={"out": "new_dir"}, tracked="out",
               checkpoint="converted model dir (default artifacts/<model>/<method>-<budget>/model; another needs --out)",
               out="fine-tuned model dir of a one-off run (default: the pipeline's, "
                   "artifacts/<model>/<method>-<budget>-ft/model, with its records and MLflow run)")

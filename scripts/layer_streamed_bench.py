"""Layer-streamed conversion against the in-memory one (issue 21): peak RSS, wall time, equal exports.

Each conversion runs in its own process (`transmla convert`, so each peak RSS is that process's own),
in-memory (`--load model`) then layer-streamed (`--load layers`), same options; then both exports score
the same WikiText-2 test windows and the largest log-prob difference is reported. Writes
reports/layer_streamed/README.md and results.json.

    python scripts/layer_streamed_bench.py --models smollm2-135m qwen2.5-coder-0.5b --kv-cache-ratio 0.3125
    python scripts/layer_streamed_bench.py --models qwen2.5-coder-0.5b --cal-batch-size 2 \
        --out reports/layer_streamed/cal-batch-2     # fewer activations at once: the streamed peak below 0.5x
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _common import run  # noqa: E402


def run_convert(model: str, out: Path, load: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "transmla.cli", "convert", "--model", model, "--out", str(out), "--load", load, *extra]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout)
    res["wall_s"] = round(time.perf_counter() - t, 1)
    return res


@torch.no_grad()
def max_logprob_diff(a: Path, b: Path, windows: int = 4, seqlen: int = 256) -> float:
    from transmla.io.data import load_texts
    from transmla.io.sources import load_model

    ma, tok = load_model(f"dir:{a}")
    ids = tok("\n\n".join(load_texts("wikitext2-test")[:400]), return_tensors="pt").input_ids[0]
    ids = ids[: windows * seqlen].view(windows, seqlen)
    la = torch.log_softmax(ma(ids).logits.double(), -1)
    del ma
    mb, _ = load_model(f"dir:{b}")
    lb = torch.log_softmax(mb(ids).logits.double(), -1)
    return float((la - lb).abs().max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--kv-cache-ratio", default="0.3125")
    ap.add_argument("--cal-batch-size", type=int, default=None, help="calibration windows per forward (default: the CLI's)")
    ap.add_argument("--out", default=str(ROOT / "reports" / "layer_streamed"))
    a = ap.parse_args()
    from transmla.errors import TransMLAError
    from transmla.io.paths import check_output, write_text_atomic

    try:
        check_output(a.out, "dir")  # refused now, not after the conversions
    except TransMLAError as e:
        ap.error(str(e))
    from transformers import AutoConfig

    from transmla.io.lazy import float32_bytes
    from transmla.io.sources import materialize

    rows, f32s = [], []  # f32s: each float32 size unrounded (a tiny model's rounds to 0.000 GiB)
    extra = ["--kv-cache-ratio", a.kv_cache_ratio]
    if a.cal_batch_size is not None:
        extra += ["--cal-batch-size", str(a.cal_batch_size)]
    with tempfile.TemporaryDirectory(prefix="layer-streamed-") as tmp:
        for i, m in enumerate(a.models):
            f32 = float32_bytes(AutoConfig.from_pretrained(materialize(m))) / 2**30
            # named by index: a source is no file name (an absolute path put the folders outside tmp)
            mem = run_convert(m, Path(tmp) / f"{i}-model", "model", extra)
            lay = run_convert(m, Path(tmp) / f"{i}-layers", "layers", extra)
            diff = max_logprob_diff(Path(tmp) / f"{i}-model", Path(tmp) / f"{i}-layers")
            f32s.append(f32)
            rows.append({"model": m, "float32_gib": round(f32, 3), "kv_cache_ratio": float(a.kv_cache_ratio),
                         "model_peak_rss_gib": mem["peak_rss_gib"], "layers_peak_rss_gib": lay["peak_rss_gib"],
                         "model_conversion_peak_gib": mem["conversion_peak_rss_gib"],
                         "layers_conversion_peak_gib": lay["conversion_peak_rss_gib"],
                         "calibration_data_peak_gib": lay["calibration_data_peak_rss_gib"],
                         "model_wall_s": mem["wall_s"], "layers_wall_s": lay["wall_s"],
                         "model_seconds": mem["seconds"], "layers_seconds": lay["seconds"],
                         "cal_batch_size": a.cal_batch_size, "max_logprob_diff": diff})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(rows, indent=2))
    batch = "" if a.cal_batch_size is None else f" --cal-batch-size {a.cal_batch_size}"
    lines = ["# Layer-streamed conversion vs in memory", "",
             f"`python scripts/layer_streamed_bench.py --models {' '.join(a.models)} --kv-cache-ratio {a.kv_cache_ratio}{batch}`: "
             "the default conversion mode (sequential calibration, attention-aware, refit), float32 export, CPU; "
             "each conversion in its own process (peak RSS = that process's); log-probs of both exports on 4 x 256 "
             "WikiText-2 test tokens.", "",
             "Peak RSS of the whole process, and (in brackets) after the calibration windows are tokenised: "
             "tokenising WikiText-2 train peaks at the bracketed data figure whatever the model.", "",
             "| model | float32 size | data prep peak | peak RSS, in memory | peak RSS, layer-streamed | streamed conversion / float32 | wall, in memory | wall, streamed | ratio | max log-prob diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, f32 in zip(rows, f32s):
        lines.append(f"| {r['model']} | {r['float32_gib']:.2f} GiB | {r['calibration_data_peak_gib']:.2f} GiB | "
                     f"{r['model_peak_rss_gib']:.2f} ({r['model_conversion_peak_gib']:.2f}) GiB | "
                     f"{r['layers_peak_rss_gib']:.2f} ({r['layers_conversion_peak_gib']:.2f}) GiB | "
                     f"{r['layers_conversion_peak_gib'] / f32:.2f} | "
                     f"{r['model_wall_s']:.0f} s | {r['layers_wall_s']:.0f} s | {r['layers_wall_s'] / r['model_wall_s']:.2f} | "
                     f"{r['max_logprob_diff']:.1e} |")
    write_text_atomic(out / "README.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    run(main)

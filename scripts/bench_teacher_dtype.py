"""The teacher's forward on one fine-tune step's input (8 x 512 WikiText-2 train tokens), float32 vs bfloat16.

    .venv/bin/python scripts/bench_teacher_dtype.py [--model smollm2-135m] [--rounds 4]

Prints each round's seconds (the first is warm-up), the median of the rest, and the KL from the float32
next-token distribution to the bfloat16 one on the first 64 positions of each block: what a bfloat16
teacher (`--teacher-dtype bfloat16`) changes in the distillation target, next to what it saves.
Result and the whole-step A/B: reports/recovery/precision-ab.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run  # noqa: E402

from transmla.io.data import load_texts  # noqa: E402
from transmla.io.sources import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: the first round is warm-up and is not counted")
    model, tok = load_model(args.model, dtype="float32")
    ids = tok("\n\n".join(load_texts("wikitext2-train")[:400]), return_tensors="pt").input_ids[0]
    ids = ids[: 8 * 512].view(8, 512)
    ref = None
    for dtype in ("float32", "bfloat16"):
        m = model.to(getattr(torch, dtype)).eval()
        times = []
        with torch.no_grad():
            for _ in range(args.rounds):
                t = time.perf_counter()
                h = m.model(input_ids=ids).last_hidden_state  # [8, 512, D]
                times.append(time.perf_counter() - t)
            logp = m.lm_head(h[:, :64]).float().log_softmax(-1)  # [8, 64, vocab]
        ref = logp if ref is None else ref
        kl = (ref.exp() * (ref - logp)).sum(-1).mean().item()
        mb = sum(p.numel() * p.element_size() for p in m.parameters()) / 1e6
        print(f"{dtype}: rounds {[round(t, 2) for t in times]} s, median after warm-up "
              f"{statistics.median(times[1:]):.2f} s, KL from float32 {kl:.4f} nats, weights {mb:.0f} MB")


if __name__ == "__main__":
    run(main)

"""The absorbed decode step's loops side by side: the compiled graph against the native call, in one process.

    .venv/bin/python scripts/decode_ab.py --model artifacts/smollm2-135m/transmla-0.125/model \
        --context 4096 --batch 8 --rounds 20 --out /tmp/decode_ab.json

The model is loaded once, its weights moved to 2 MB pages, absorbed, one random sequence of `context` tokens
prefilled and packed "tiled" for `batch` rows, as the throughput stage does; each loop gets its own blocked static
latent cache of that prefill. Then `rounds` rounds of `steps` greedy steps per loop, the loops' order rotating each
round, so a drifting host slows them alike. Prints and writes each loop's per-round medians (ms per step), their
median, min and max, how often each loop beat the other, and the largest logit difference between the two on the
first step (equal to float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run  # noqa: E402

from transmla.errors import TransMLAError  # noqa: E402
from transmla.io.paths import check_output, write_text_atomic  # noqa: E402
from transmla.io.sources import load_model  # noqa: E402
from transmla.runtime import compiled_decode, hugepages, native_decode, packed  # noqa: E402
from transmla.runtime.absorb import LatentCache, enable_absorb  # noqa: E402

LOOPS = ("compiled", "native")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an absorbable DeepseekV3 export (transmla convert's output)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8, help="greedy steps per loop and round")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    if args.context < 1 or args.batch < 1 or args.rounds < 1 or args.steps < 1:
        sys.exit("decode_ab: --context, --batch, --rounds and --steps must be positive")
    if args.out:  # refused now, not after the rounds
        try:
            check_output(args.out, "file")
        except TransMLAError as e:
            sys.exit(f"decode_ab: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_model(args.model)[0]
    hugepages.to_hugepages(model)
    enable_absorb(model, fold=True)  # the native step needs folded queries and outputs (fold=None decides per layer)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill = LatentCache(model.config, max_cache_len=args.context)
        model(ids, past_key_values=prefill, use_cache=True, logits_to_keep=1)
    packed.pack(model, args.batch, kernel="tiled")
    why = native_decode.unsupported(model)
    if why is not None:
        sys.exit(f"decode_ab: the native step cannot run this model: {why}")
    capacity = args.context + args.steps * (args.rounds + 1) + 16
    caches = {k: compiled_decode.StaticLatentCache.from_latent_cache(prefill, args.batch, capacity, blocked=True)
              for k in LOOPS}
    steps = {"compiled": compiled_decode.compiled_step(model, gemm="tiled"), "native": native_decode.native_step(model)}
    first = torch.randint(0, model.config.vocab_size, (args.batch, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = {}
        for k in LOOPS:  # the first step: the compiled loop compiles here
            t = time.perf_counter()
            logits[k] = steps[k](first, caches[k])
            caches[k].advance()
            print(f"{k}: first step {time.perf_counter() - t:.2f} s", flush=True)
        diff = (logits["compiled"] - logits["native"]).abs().max().item()
        per_round = {k: [] for k in LOOPS}
        for r in range(args.rounds):
            for k in LOOPS[r % 2:] + LOOPS[: r % 2]:
                x, times = first, []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    out = steps[k](x, caches[k])
                    caches[k].advance()
                    x = out.argmax(-1, keepdim=True)
                    times.append(time.perf_counter() - t)
                per_round[k].append(1e3 * statistics.median(times))
    result = {"model": args.model, "context": args.context, "batch": args.batch, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "steps": args.steps, "first_step_max_abs_logit_diff": diff,
              "native_faster_rounds": sum(n < c for n, c in zip(per_round["native"], per_round["compiled"])),
              **{k: {"per_round_ms": v, "median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
                 for k, v in per_round.items()}}
    for k in LOOPS:
        print(f"{k}: median {result[k]['median_ms']:.2f} ms per step, min {result[k]['min_ms']:.2f}, "
              f"max {result[k]['max_ms']:.2f}")
    print(f"native faster in {result['native_faster_rounds']} of {args.rounds} rounds; "
          f"first-step logits differ by at most {diff:.2e}")
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run(main)

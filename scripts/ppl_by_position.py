"""Diagnostic: perplexity by position inside the 2048-token window, for several models side by side.

    .venv/bin/python scripts/ppl_by_position.py smollm2-135m CONVERTED_DIR [FINETUNED_DIR ...] [--windows 8]

Same protocol as `transmla ppl` (WikiText-2 test joined with "\\n\\n", non-overlapping windows of
--seqlen tokens from the start), but the NLL of each predicted token is kept by its position, and
exp(mean NLL) is printed per position range. Why: the 2048-token protocol averages over positions a
512-token fine-tune never trains on; this shows where in the window a conversion loses.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run  # noqa: E402

from transmla.evaluation.perplexity import tokenize_corpus  # noqa: E402
from transmla.io.data import load_texts  # noqa: E402
from transmla.io.sources import load_model  # noqa: E402


@torch.no_grad()
def nll_by_position(model, ids: torch.Tensor, windows: int, seqlen: int) -> torch.Tensor:
    """Mean NLL at each predicted position [seqlen - 1], over the first `windows` windows of `ids`."""
    total = torch.zeros(seqlen - 1, dtype=torch.float64)
    for w in range(windows):
        batch = ids[w * seqlen:(w + 1) * seqlen][None]
        logits = model(input_ids=batch, use_cache=False).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0, :-1], batch[0, 1:], reduction="none").double()
    return total / windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model sources (the first one's tokenizer is used for all)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--dataset", default="wikitext2-test")
    args = ap.parse_args()
    if args.windows < 1 or args.seqlen < 2:  # 0 windows printed nan everywhere, exit 0
        ap.error("--windows must be >= 1 and --seqlen >= 2")
    nll, ids = {}, None
    for src in args.models:
        model, tok = load_model(src)
        if ids is None:  # the first model's tokenizer serves all: the windows must be the same tokens
            ids = tokenize_corpus(tok, load_texts(args.dataset))
            if ids.numel() < args.windows * args.seqlen:
                raise SystemExit(f"{args.dataset} has {ids.numel()} tokens, fewer than --windows x --seqlen: "
                                 "lower --windows.")
        nll[src] = nll_by_position(model.eval(), ids, args.windows, args.seqlen)
        del model
    n = args.seqlen - 1  # predicted positions per window
    cuts = [c for c in (0, 128, 512, 1024) if c < n] + [n]
    ranges = list(zip(cuts, cuts[1:])) + [(0, n)]
    print(f"{args.dataset}, first {args.windows} x {args.seqlen} tokens; "
          "ppl = exp(mean NLL) per range of predicted positions")
    print("| positions | " + " | ".join(args.models) + " |")
    print("|---|" + "---:|" * len(args.models))
    for a, b in ranges:
        print(f"| {a}-{b} | " + " | ".join(f"{math.exp(nll[m][a:b].mean()):.2f}" for m in args.models) + " |")


if __name__ == "__main__":
    run(main)

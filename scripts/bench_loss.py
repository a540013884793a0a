"""One recovery training step with the fused loss against the checkpointed-chunk loss it replaced.

    .venv/bin/python scripts/bench_loss.py --student artifacts/smollm2-135m/transmla-0.125/model \
        --teacher smollm2-135m --objective kd+lm --rounds 4

Both run in one process on the same random 8 x 512-token batch, interleaved (old, new, old, new, ...;
the first round dropped as warm-up), so a drifting host slows both alike. A step is the student's
forward (final hidden states only), the teacher's (kd objectives), the loss and the backward, as the
fine-tune's Trainer does it, without activation checkpointing. Prints per-round seconds, the loss of
each (equal to float rounding) and the largest relative difference of the output head's gradient, then
the median, min and max of each. `reference_loss` below is the old implementation, kept here only as
the baseline: each chunk's logits recomputed in backward under torch.utils.checkpoint.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import run  # noqa: E402

from transmla.training.distill import recovery_loss  # noqa: E402


def _reference_chunk(h, w, y, t_h, t_w, tau):
    s = (h @ w.T).float()
    lm = F.cross_entropy(s, y, reduction="sum")
    if t_h is None:
        return lm, s.new_zeros(())
    with torch.no_grad():
        t_logp = F.log_softmax((t_h @ t_w.T).float() / tau, -1)
    return lm, F.kl_div(F.log_softmax(s / tau, -1), t_logp, log_target=True, reduction="sum") * tau**2


def reference_loss(hidden, head, input_ids, objective, t_hidden, t_head, tau=1.0, chunk=1024):
    """The checkpointed-chunk loss (before the fused one): kd+lm = kd + lm, per predicted token."""
    D = hidden.shape[-1]
    h, y = hidden[:, :-1].reshape(-1, D), input_ids[:, 1:].reshape(-1)
    t_h = t_hidden[:, :-1].reshape(-1, t_hidden.shape[-1]) if objective != "lm" else None
    lm = kd = hidden.new_zeros(())
    for a in range(0, len(y), chunk):
        c_lm, c_kd = checkpoint(_reference_chunk, h[a : a + chunk], head, y[a : a + chunk],
                                None if t_h is None else t_h[a : a + chunk], t_head, tau, use_reentrant=False)
        lm, kd = lm + c_lm, kd + c_kd
    lm, kd = lm / len(y), kd / len(y)
    return {"lm": lm, "kd": kd, "kd+lm": kd + lm}[objective]


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM

    from transmla.io.sources import load_model
    from transmla.training.finetune import unfold_latent_norms, use_causal_padded_sdpa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--student", required=True, help="a converted model directory (transmla convert --out)")
    ap.add_argument("--teacher", default="smollm2-135m", help="the original model (any transmla source)")
    ap.add_argument("--objective", default="kd+lm", choices=("lm", "kd", "kd+lm"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024, help="positions per chunk (the fused loss caps it on CPU)")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first is warm-up)")
    if not (Path(args.student) / "config.json").is_file():
        ap.error(f"--student {args.student}: no config.json there; pass a `transmla convert --out` directory")

    torch.manual_seed(0)
    teacher = load_model(args.teacher)
    teacher = teacher[0] if isinstance(teacher, tuple) else teacher
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32, use_safetensors=True)
    unfold_latent_norms(student)
    use_causal_padded_sdpa(student)
    use_causal_padded_sdpa(teacher)
    teacher.eval().requires_grad_(False)
    student.train()
    ids = torch.randint(0, student.config.vocab_size, (args.batch, args.seqlen))

    def step(which):
        t0 = time.perf_counter()
        captured = []
        hook = student.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out))
        student(input_ids=ids, use_cache=False, logits_to_keep=1)
        hook.remove()
        t_h = None
        if args.objective != "lm":
            with torch.no_grad():
                t_h = teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        w, t_w = student.lm_head.weight, teacher.lm_head.weight
        if which == "checkpointed":
            loss = reference_loss(captured[-1], w, ids, args.objective, t_h, t_w, chunk=args.chunk)
        else:
            loss, _ = recovery_loss(captured[-1], w, ids, args.objective, t_h, t_w, chunk=args.chunk)
        loss.backward()
        grad = student.lm_head.weight.grad.clone()
        student.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, loss.item(), grad

    times = {"checkpointed": [], "fused": []}
    for r in range(args.rounds):
        ref = None
        for which in times:
            sec, loss, grad = step(which)
            times[which].append(sec)
            diff = "" if ref is None else f", head-gradient max rel. diff {float((grad - ref).abs().max() / ref.abs().max()):.1e}"
            ref = grad if ref is None else ref
            print(f"round {r}: {which:12s} {sec:6.2f} s, loss {loss:.5f}{diff}", flush=True)
    for which, t in times.items():
        t = t[1:]
        print(f"{which:12s} median {statistics.median(t):.2f} s (min {min(t):.2f}, max {max(t):.2f}) over {len(t)} rounds")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (both, one process)")
    return 0


if __name__ == "__main__":
    run(main)

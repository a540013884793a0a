"""Benchmark: what Qwen3's QK-norm costs each export design (reports/architectures/qwen3-qknorm.{json,md}).

    .venv/bin/python scripts/qwen3_qknorm.py [--steps 400]

Random weights say nothing about quality, so a tiny Qwen3 (4 layers, hidden 128, 8 q / 2 kv heads of
dim 32, the tests' 512-token BPE) is first trained on WikiText-2 train; then, on WikiText-2 test
(first 32,768 tokens, 256-token windows, ppl = exp(mean NLL)):

  original                     the trained Qwen3
  exact (this package's class) lossless conversion into Qwen3MLAForCausalLM (QK-norm kept)
  stock: constant key norm     the per-token key norm 1/rms(W_k x) replaced by its calibration mean per
                               KV head (the query norm kept: what DeepSeek's q-LoRA norm could approach)
  stock: constant q and k norm both replaced by calibration means: what a stock DeepSeek-V3 export can
                               carry (the norm weights fold into W_q, W_k; the per-token factors cannot)
  exact at 50% / 25% KV        the class at real cuts (paper mode; default mode: sequential + refit), for scale

The stock rows are measured on the original architecture with the norm modules swapped (the MLA
export of such a model is exact in lossless mode, so this is the export's cost before compression).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from _common import check_report_out  # noqa: E402
from transmla.io.data import load_texts  # noqa: E402
from transmla.io.paths import write_text_atomic  # noqa: E402


def tokenizer():
    from conftest import _train_tokenizer  # the tests' offline BPE (512 tokens, WikiText-2 train)

    return _train_tokenizer()


def train_qwen3(tok, steps: int, seqlen: int = 256, batch: int = 16, seed: int = 0, **shape):
    """A tiny Qwen3 trained from scratch on WikiText-2 train: AdamW, lr 3e-3 cosine, packed blocks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=shape.get("hidden", 128), intermediate_size=4 * shape.get("hidden", 128),
                      num_hidden_layers=shape.get("layers", 4), num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
                      rope_theta=10000.0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    ids = tok("\n\n".join(t for t in load_texts("wikitext2-train") if t.strip()), return_tensors="pt").input_ids[0]
    n = (len(ids) // seqlen) * seqlen
    blocks = ids[:n].view(-1, seqlen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = blocks[torch.randint(0, len(blocks), (batch,), generator=g)]
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model.eval(), float(loss)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int = 256) -> float:
    nll, n = 0.0, 0
    for a in range(0, len(ids) - 1, window):
        x = ids[a : a + window + 1][None]
        if x.shape[1] < 2:
            break
        logits = model(x[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        n += x.shape[1] - 1
    return math.exp(nll / n)


class ConstantNorm(torch.nn.Module):
    """x -> weight * x * c[head]: a QK-norm with its per-token factor replaced by a constant per head."""

    def __init__(self, weight: torch.Tensor, c: torch.Tensor):
        super().__init__()
        self.weight, self.c = weight.detach().clone(), c

    def forward(self, x):  # x [B, T, heads, d]
        return self.weight * x * self.c.to(x)[:, None]


@torch.no_grad()
def mean_factors(model, ids: torch.Tensor, window: int = 256) -> dict:
    """Calibration mean of each head's per-token norm factor 1/rms(v) at every q_norm / k_norm."""
    sums, hooks, count = {}, [], [0]

    def hook(name, eps):
        def f(module, args):
            v = args[0].float()  # [B, T, heads, d]
            rho = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [B, T, heads]
            sums[name] = sums.get(name, 0) + rho.sum((0, 1))
        return f

    for i, layer in enumerate(model.model.layers):
        for kind in ("q_norm", "k_norm"):
            m = getattr(layer.self_attn, kind)
            hooks.append(m.register_forward_pre_hook(hook((i, kind), m.variance_epsilon)))
    for a in range(0, len(ids) - window, window):
        model(ids[a : a + window][None])
        count[0] += window
    for h in hooks:
        h.remove()
    return {k: v / count[0] for k, v in sums.items()}


def with_constant_norms(model, factors: dict, kinds: tuple[str, ...]):
    import copy

    m = copy.deepcopy(model)
    for i, layer in enumerate(m.model.layers):
        for kind in kinds:
            setattr(layer.self_attn, kind, ConstantNorm(getattr(layer.self_attn, kind).weight, factors[(i, kind)]))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--out", default=str(REPO / "reports" / "architectures" / "qwen3-qknorm"),
                    help="the reports' path without suffix: OUT.json and OUT.md are written")
    args = ap.parse_args()
    if args.steps < 1 or args.ppl_tokens < 1:  # 0 steps divided by zero in the lr schedule, 0 tokens in the ppl
        ap.error("--steps and --ppl-tokens must be >= 1")
    check_report_out(ap, Path(args.out).with_suffix(".json"))  # now, not after the training and five conversions
    from transformers import AutoModelForCausalLM

    import transmla.models  # noqa: F401
    from transmla.config import PAPER_TRANSMLA, ConvertOptions
    from transmla.convert import convert

    t0 = time.perf_counter()
    tok = tokenizer()
    model, train_loss = train_qwen3(tok, args.steps)
    train_s = time.perf_counter() - t0
    test = tok("\n\n".join(load_texts("wikitext2-test")), return_tensors="pt").input_ids[0][: args.ppl_tokens + 1]
    cal = tok("\n\n".join(load_texts("wikitext2-train")[-4000:]), return_tensors="pt").input_ids[0][:32768]
    factors = mean_factors(model, cal)
    rows = [("original (trained tiny Qwen3)", perplexity(model, test), "-")]
    cal_opts = dict(cal_nsamples=64, cal_seqlen=256, cal_batch_size=8)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "qwen3"
        model.save_pretrained(src)
        tok.save_pretrained(src)
        # the report was made on 2026-11-26, when the default mode's RoRoPE used the key metric: both modes pin
        # it, so a rerun reproduces the report's rows (the default became query-metric on 2026-11-27)
        paper = dict(PAPER_TRANSMLA)
        for label, opts, kv in (("exact: Qwen3MLAForCausalLM, lossless", dict(lossless=True), "100%"),
                                ("exact: Qwen3MLAForCausalLM, RoPE 16 + rank 48, paper mode", dict(qk_rope_dim=16, kv_lora_rank=48, **paper), "50%"),
                                ("exact: Qwen3MLAForCausalLM, RoPE 16 + rank 48, default mode", dict(qk_rope_dim=16, kv_lora_rank=48, rorope_metric="key"), "50%"),
                                ("exact: Qwen3MLAForCausalLM, RoPE 8 + rank 24, paper mode", dict(qk_rope_dim=8, kv_lora_rank=24, **paper), "25%"),
                                ("exact: Qwen3MLAForCausalLM, RoPE 8 + rank 24, default mode", dict(qk_rope_dim=8, kv_lora_rank=24, rorope_metric="key"), "25%")):
            out = Path(tmp) / f"mla{len(rows)}"
            convert(str(src), out, ConvertOptions(**opts, **cal_opts), progress=False)
            rows.append((label, perplexity(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, use_safetensors=True), test), kv))
    rows.append(("stock: constant key norm (query norm kept)", perplexity(with_constant_norms(model, factors, ("k_norm",)), test), "100%"))
    rows.append(("stock: constant query and key norms", perplexity(with_constant_norms(model, factors, ("q_norm", "k_norm")), test), "100%"))
    res = {"steps": args.steps, "train_loss": train_loss, "train_seconds": round(train_s, 1),
           "ppl_tokens": args.ppl_tokens, "rows": [{"label": a, "ppl": round(b, 3), "kv": c} for a, b, c in rows]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out.with_suffix(".json"), json.dumps(res, indent=2) + "\n")
    lines = ["# Qwen3's QK-norm: what each export design costs", "",
             f"A tiny Qwen3 (4 layers, hidden 128, 8 q / 2 kv heads of dim 32, 512-token BPE) trained {args.steps} steps "
             f"of 16 x 256 tokens on WikiText-2 train (final loss {train_loss:.2f}); WikiText-2 test, first "
             f"{args.ppl_tokens:,} tokens, 256-token windows, ppl = exp(mean NLL). Made by `scripts/qwen3_qknorm.py`.", "",
             "| export | KV cache kept | WikiText-2 ppl |", "|---|---:|---:|"]
    lines += [f"| {a} | {c} | {b:.2f} |" for a, b, c in rows]
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

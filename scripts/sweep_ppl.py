"""Perplexity sweep over conversion settings, sharing one calibration pass.

Usage: python scripts/sweep_ppl.py OUT.jsonl --max-tokens 65536 --config 'method=transmla,qk_rope_dim=32,kv_lora_rank=88,freqfold=4' ...
Each --config is a comma list of ConvertOptions fields; `kv_lora_rank=full` keeps full rank (RoPE
dropping only). Results are appended to OUT.jsonl as they finish (a long sweep can be resumed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from transmla.adapters import read_spec
from transmla.method.calibration import calibration_ids, collect_stats
from transmla.convert import ConvertOptions, assemble, convert_layers, resolve_budget
from transmla.io.data import load_texts
from transmla.io.export import instantiate
from transmla.runtime.fast_attention import use_causal_padded_sdpa
from transmla.evaluation.perplexity import perplexity, tokenize_corpus
from transmla.io.sources import load_model


def parse(cfg: str) -> dict:
    types = {f.name: f.type for f in fields(ConvertOptions)}
    out = {}
    for kv in filter(None, cfg.split(",")):
        k, v = kv.split("=")
        if v in ("none", "None"):
            out[k] = None
        elif v == "full":
            out[k] = "full"
        elif "bool" in str(types[k]):
            out[k] = v.lower() in ("1", "true", "yes")
        elif "int" in str(types[k]):
            out[k] = int(v)
        elif "float" in str(types[k]):
            out[k] = float(v)
        else:
            out[k] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--config", action="append", default=[])
    ap.add_argument("--original", action="store_true", help="also evaluate the unconverted model")
    args = ap.parse_args()
    done = set()
    if Path(args.out).exists():
        done = {json.loads(line)["config"] for line in open(args.out)}
    model, tok = load_model(args.model)
    spec = read_spec(model.config)
    ids = tokenize_corpus(tok, load_texts("wikitext2-test"))
    base = ConvertOptions()
    stats = None

    def record(cfg, res, extra):
        with open(args.out, "a") as f:
            f.write(json.dumps({"config": cfg, "ppl": res["ppl"], "tokens": res["tokens"], **extra}) + "\n")
        print(cfg, f"ppl={res['ppl']:.3f}", extra, file=sys.stderr, flush=True)

    if args.original and "original" not in done:
        record("original", perplexity(model, ids, args.seqlen, args.max_tokens), {})
    for cfg in args.config:
        if cfg in done:
            continue
        kw = parse(cfg)
        full = kw.get("kv_lora_rank") == "full"
        if full:
            kw["kv_lora_rank"] = None
        o = replace(base, **kw)
        o.validate()
        if stats is None:
            t = time.perf_counter()
            cal = calibration_ids(tok, load_texts(o.cal_dataset), o.cal_nsamples, o.cal_seqlen, o.seed)
            stats = collect_stats(model, cal, o.cal_batch_size)
            print(f"calibration {time.perf_counter() - t:.1f}s", file=sys.stderr)
        budget = resolve_budget(spec, o)
        if full:
            budget = replace(budget, kv_lora_rank=2 * spec.g * spec.d - budget.rope_dim)
        t = time.perf_counter()
        layers, diags = convert_layers(model, stats, spec, budget, o, progress=False)
        config, sd = assemble(model, spec, budget, layers, o, {})
        conv_s = time.perf_counter() - t
        mla = use_causal_padded_sdpa(instantiate(config, sd))
        res = perplexity(mla, ids, args.seqlen, args.max_tokens)
        record(cfg, res, {"qk_rope_head_dim": budget.rope_dim, "kv_lora_rank": budget.kv_lora_rank,
                          "kv_cache_ratio": round(budget.ratio, 4), "convert_seconds": round(conv_s, 1),
                          "mean_alpha": sum(d["alpha"] for d in diags) / len(diags),
                          "mean_rope_energy": sum(d["rope_energy"] for d in diags) / len(diags)})


if __name__ == "__main__":
    main()

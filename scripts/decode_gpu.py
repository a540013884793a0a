"""Decode speed at a real model's shape on a GPU: original GQA vs converted MLA (issue 20's GPU rows).

Random weights with the converter's own shapes (the cost of a decode step does not depend on the
values): the original LlamaForCausalLM and the DeepseekV3ForCausalLM that `transmla convert` would
write for it (`transmla.io.export.deepseek_config`, RoPE 64 + latent 512 by default). Per context
and batch, one sequence is prefilled, replicated into a preallocated cache of the batch, and single-
token steps are timed (synchronised):

    original  hf        stock default: DynamicCache, eager
              static    best stock: preallocated StaticCache, SDPA (GQA heads not repeated), eager
              static+g  the same step captured as a CUDA graph
    MLA       stock     stock DeepseekV3 forward over the latent cache (keys/values materialised from
                        the latent every step: the "materialise" path), eager and +g
              absorb    transmla.runtime.absorb, decode kernel "sdpa" or "bmm", eager and +g

A graph replays the captured step (same cache slot, same length): the work of one decode step at
that context. Roofline: the step's bytes (`throughput.step_bytes`: weights once + the batch's KV
cache) over the measured copy bandwidth; the compute floor (`throughput.step_flops` over the
measured matmul peak) beside it. At the last context the largest batch that fits is
measured for the original's best and absorb's best. Results are written to a new JSON lines file
(an existing --out is refused: the report reads one run per file) as they come, so a run cut short
keeps what it measured.

    python scripts/decode_gpu.py --out decode.jsonl                      # Llama-2-7B shape, cuda
    python scripts/decode_gpu.py --shape tiny --device cpu --out x.jsonl  # smoke test, no graphs
    python scripts/decode_gpu.py --report reports/throughput/gpu/*.jsonl > reports/throughput/gpu/README.md
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transmla.runtime import absorb, throughput  # noqa: E402
from transmla.runtime.throughput import synchronize  # noqa: E402

SHAPES = {
    # name: LlamaConfig fields (published configs)
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, rope_theta=10000.0, max_position_embeddings=4096),
}


def build(shape: str, which: str, rope_dim: int, rank: int, device, dtype):
    """Random-weight original (LlamaForCausalLM) or its converted DeepseekV3 shape, on `device`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from transmla.adapters import read_spec
    from transmla.io.export import deepseek_config
    from transmla.method.rope import standard_plan

    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    if which == "mla":
        spec = read_spec(cfg)
        cfg = deepseek_config(spec, standard_plan(spec.d, rope_dim), rank, None, False, str(dtype).removeprefix("torch."))
        cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def fill_cache(model, backend: str, context: int, batch: int, total: int):
    """Prefill one random sequence of `context` tokens; return (cache of `batch` copies, capacity `total`)."""
    from transformers import DynamicCache

    cfg, dev = model.config, model.device
    ids = throughput.random_prompts(cfg.vocab_size, 1, context).to(dev)
    mla = throughput.is_mla(cfg)
    one = absorb.LatentCache(cfg, max_cache_len=context) if mla else DynamicCache(config=cfg)
    absorb.disable_absorb(model) if mla else None  # prefill with the stock forward: same latent layout
    out = model(ids, past_key_values=one, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1:].argmax(-1).repeat(batch, 1)
    del out
    if backend == "static":
        cache = throughput.static_copy(one, cfg, batch, total)
    elif backend == "hf":
        one.batch_repeat_interleave(batch)
        cache = one
    else:  # a LatentCache preallocated for the batch, filled through its public append
        cache = absorb.LatentCache(cfg, max_cache_len=total)
        for i, layer in enumerate(one.layers):
            src = layer.buffer[:, :context]
            cache.update_latent(src.expand(batch, *src.shape[1:]), i, cfg.kv_lora_rank)
    del one
    return cache, nxt


def time_steps(model, backend: str, cache, nxt, context: int, *, graph: bool, steps: int, warmup: int, compiled=None):
    """Median/min/max seconds of one decode step (eager: real successive steps; graph: replays).
    compiled: a torch.compile'd model to run instead (graph mode only): its warm-up steps write the
    same cache slot, so it compiles for one cache length, then the compiled step is captured."""
    dev = model.device
    fwd = model if compiled is None else compiled
    B = nxt.shape[0]
    ids = nxt.clone()
    if backend == "static" or graph:  # a fixed slot: StaticCache needs its position as a tensor
        cp = torch.tensor([context], device=dev)
        kw = dict(cache_position=cp, position_ids=cp.view(1, 1).expand(B, 1))
    else:
        kw = {}

    def step():
        out = fwd(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
        if compiled is not None:  # back to `context` cached tokens: the next call sees the same shapes
            for layer in cache.layers:
                if isinstance(layer, absorb.LatentLayer):  # a StaticCache writes by cache_position
                    layer.length = context
                    layer._sync_views()
        return out.logits[:, -1:].argmax(-1)

    times = []
    if not graph:
        for i in range(warmup + steps):
            synchronize(dev)
            t = time.perf_counter()
            ids.copy_(step())
            synchronize(dev)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    else:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        for i in range(2 + steps):
            synchronize(dev)
            t = time.perf_counter()
            g.replay()
            synchronize(dev)
            if i >= 2:
                times.append(time.perf_counter() - t)
        del g, out
    return statistics.median(times), min(times), max(times)


def cell(model, backend, context, batch, *, graph, kernel, steps, warmup, bandwidth, flops=None, extra=None,
         compile_=False):
    """One measured cell as a flat dict (error recorded instead of raised). compile_: the step runs
    through torch.compile (absorb: the Triton kernel is the opaque custom op transmla::latent_decode)."""
    row = dict(backend=backend, graph=graph, kernel=kernel, context=context, batch=batch, model_type=model.config.model_type,
               **({"compiled": True} if compile_ else {}), **(extra or {}))
    cache = None
    try:
        total = context + warmup + steps + 8
        cache, nxt = fill_cache(model, "absorb" if backend in ("absorb", "stock") else backend, context, batch, total)
        if backend == "absorb":
            absorb.DECODE_KERNEL = kernel
            absorb.enable_absorb(model)
        elif throughput.is_mla(model.config):
            absorb.disable_absorb(model)
        compiled = None
        if compile_:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            compiled = torch.compile(model, dynamic=False)
        med, lo, hi = time_steps(model, backend, cache, nxt, context, graph=graph, steps=steps, warmup=warmup,
                                 compiled=compiled)
        if compile_:
            row["compile_and_time_s"] = round(time.perf_counter() - t0, 1)
        kind = "absorb" if backend == "absorb" else ("static" if backend == "static" else "hf")
        row.update(ms=1e3 * med, ms_min=1e3 * lo, ms_max=1e3 * hi, tokens_per_s=batch / med,
                   **throughput.roofline(model, kind, context, batch, med, bandwidth=bandwidth, flops=flops))
        if torch.cuda.is_available():
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # noqa: BLE001 - a benchmark records what failed and goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=3)
    finally:
        del cache
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return row


def graph_time(fn, dev, n: int = 50) -> float:
    """Seconds per call of `fn` with no launch overhead: one call captured as a CUDA graph, replayed n
    times between two synchronisations (eager timing of a ~100 us kernel measures Python, not the GPU)."""
    fn()
    synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    synchronize(dev)
    t = time.perf_counter()
    for _ in range(n):
        g.replay()
    synchronize(dev)
    dt = (time.perf_counter() - t) / n
    del g
    return dt


def kernel_bench(dev, dtype, emit, h=32, rank=512, rope=64, shapes=((16, 1024), (16, 8192), (425, 8192)),
                 configs=((32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 4, 3)), splits_sweep=True, bandwidth=None):
    """One layer's decode attention over the latent, graph-timed: bmm against the Triton split-K kernel
    per launch configuration (block_t, num_warps, num_stages) and product form (swap), the chunks per
    sequence chosen by `choose_splits`; then, for the TUNING configuration, every product form at a sweep
    of chunk counts (is the wave model's choice the fastest?). Returns the configuration best over all
    shapes (the sum of each shape's time over that shape's best)."""
    from transmla.runtime import latent_decode as ld

    rows_seen = []
    base = dict(ld.TUNING)
    for B, T in shapes:
        q = torch.randn(B, h, rank + rope, device=dev, dtype=dtype)
        lat = torch.randn(B, T + 64, rank + rope, device=dev, dtype=dtype)[:, :T]
        nbytes = lat.numel() * lat.element_size()
        absorb.DECODE_KERNEL = "bmm"
        want = absorb.latent_attention(q.view(B, h, 1, -1), lat, None, 0.05, rank).view(B, h, rank)
        t = graph_time(lambda: absorb.latent_attention(q.view(B, h, 1, -1), lat, None, 0.05, rank), dev)
        emit(dict(kind="kernel", kernel="bmm", batch=B, context=T, us=1e6 * t, gbps=nbytes / t / 1e9,
                  x_of_bound=t * bandwidth / nbytes if bandwidth else None))

        def run(row, **kw):
            try:
                got = ld.latent_decode_triton(q, lat, rank, 0.05, **kw)
                err = float((got.float() - want.float()).abs().max())
                t = graph_time(lambda: ld.latent_decode_triton(q, lat, rank, 0.05, **kw), dev)
                row.update(us=1e6 * t, gbps=nbytes / t / 1e9, max_abs_err=err,
                           x_of_bound=t * bandwidth / nbytes if bandwidth else None)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(row)
            return row

        for bt, nw, ns in configs:
            for swap in (False, True):
                ld.TUNING.update(block_t=bt, num_warps=nw, num_stages=ns, swap=swap)
                key = ld.variant_key(rank, rope, h, bt, nw, ns, swap, False)
                try:
                    ld.latent_decode_triton(q, lat, rank, 0.05)  # compiles; the occupancy is read after
                except Exception as e:  # noqa: BLE001 - e.g. a configuration out of shared memory
                    emit(dict(kind="kernel", kernel="triton", batch=B, context=T, block_t=bt, num_warps=nw, num_stages=ns,
                              swap=swap, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                res = ld._resident(q.device, key)
                rows_seen.append(run(dict(kind="kernel", kernel="triton", batch=B, context=T, block_t=bt, num_warps=nw,
                                          num_stages=ns, swap=swap, resident=res,
                                          splits=ld.choose_splits(B, T, bt, res))))
        ld.TUNING.update(base)
        if splits_sweep:
            bt = base["block_t"]
            tiles = -(-T // bt)
            for swap in (False, True):
                key = ld.variant_key(rank, rope, h, bt, base["num_warps"], base["num_stages"], swap, False)
                chosen = ld.choose_splits(B, T, bt, ld._resident(q.device, key))
                for S in sorted({1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64, chosen} & set(range(1, tiles + 1))):
                    if B * S > 64 * 1024:
                        continue
                    run(dict(kind="splits", batch=B, context=T, swap=swap, splits=S, chosen=S == chosen), num_splits=S, swap=swap)
        del q, lat, want
        torch.cuda.empty_cache()
    tri = [r for r in rows_seen if "us" in r]
    if not tri:
        return None
    best_t = {}
    for r in tri:
        best_t[(r["batch"], r["context"])] = min(best_t.get((r["batch"], r["context"]), 1e30), r["us"])
    score, count = {}, {}
    for r in tri:
        k = (r["block_t"], r["num_warps"], r["num_stages"])
        score[k] = score.get(k, 0.0) + r["us"] / best_t[(r["batch"], r["context"])]
        count[k] = count.get(k, 0) + 1
    full = [k for k in score if count[k] == max(count.values())]
    bt, nw, ns = min(full, key=score.get)
    return dict(block_t=bt, num_warps=nw, num_stages=ns)


@torch.inference_mode()
def profile_step(model, kernel: str, context: int, batch: int, emit, top: int = 25):
    """Where an absorbed decode step's GPU time goes: torch.profiler over 3 eager steps, kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    cache, nxt = fill_cache(model, "absorb", context, batch, context + 16)
    absorb.DECODE_KERNEL = kernel
    absorb.enable_absorb(model)
    ids = nxt.clone()
    for _ in range(2):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    synchronize(model.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        synchronize(model.device)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    print(table, flush=True)
    emit(dict(kind="profile", kernel=kernel, context=context, batch=batch, steps=3, table=table))
    del cache
    torch.cuda.empty_cache()


def max_batch(model, backend: str, context: int, margin_gib: float) -> int:
    """Largest batch whose cache (context + slack tokens) fits in free memory minus a margin."""
    free, _ = torch.cuda.mem_get_info()
    dtype = next(model.parameters()).dtype
    per_seq = (context + 64) * throughput.kv_bytes_per_token(model.config, "absorb" if backend == "absorb" else "hf", dtype)
    return max(1, int((free - margin_gib * 2**30) // per_seq))


def parse_tuning(text: str) -> dict:
    """"block_t=64,num_warps=8,swap=1" -> TUNING entries (swap: 0 / 1 / none = by batch)."""
    out = {}
    for kv in text.split(","):
        k, v = kv.split("=")
        out[k] = None if v.lower() == "none" else (bool(int(v)) if k == "swap" else int(v))
    return out


def plan_of(which: str, cuda: bool) -> list[tuple]:
    """(backend, graph, kernel, compiled) of every measured path of one model; graphs and compiled steps on CUDA only."""
    graphs = [False, True] if cuda else [False]
    if which == "original":
        return ([("hf", False, None, False), ("static", False, None, False)]
                + [("static", True, None, False), ("static", True, None, True)] * cuda)
    return ([(b, g, k, False) for b, k in (("stock", None), ("absorb", "sdpa"), ("absorb", "bmm"), ("absorb", "triton"))
             for g in graphs] + [("absorb", True, "triton", True)] * cuda)


def path_name(backend, graph, kernel, compiled) -> str:
    """A path as --paths spells it: hf, static+g+c, absorb-triton+g, ..."""
    return f"{backend}{'-' + kernel if kernel else ''}{'+g' if graph else ''}{'+c' if compiled else ''}"


PATH_NAMES = [path_name(*p) for which in ("original", "mla") for p in plan_of(which, True)]


def report(paths: list[str]) -> str:
    """Markdown tables from JSON-lines results: per shape, ms per step of every path, the speedup of
    absorb's best over the original's best, absorb's multiple of its bandwidth bound, largest batches."""
    lines = []
    for p in paths:
        rows = [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
        info = next(r for r in rows if r.get("kind") == "info")
        cells = [r for r in rows if r.get("kind") is None and "ms" in r]
        tuning = next((r for r in rows if r.get("kind") == "tuning"), None)
        lines += [f"## {info['shape']} on {info['device']}", "",
                  f"{info['dtype']}, torch {info['torch']}, transformers {info['transformers']}, measured copy bandwidth "
                  f"{info['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s. ms per decode step (median of the steps; +g = CUDA graph); "
                  "bound = (weights + the batch's KV cache) / bandwidth."
                  + (f" Triton kernel: block_t {tuning['block_t']}, {tuning['num_warps']} warps, {tuning['num_stages']} stages, "
                     f"product form {'by batch' if tuning.get('swap') is None else ('transposed' if tuning['swap'] else 'heads-major')}."
                     if tuning else "") + " +c = the step torch.compile'd (then captured).", ""]
        # every path a run can measure (CUDA graphs and compiled steps only on a GPU); a column none measured is left out
        label = lambda be, g, k, c: ("original " + {"hf": "stock (DynamicCache)", "static": "StaticCache"}[be] if be in ("hf", "static")  # noqa: E731
                                     else "MLA stock (materialise)" if be == "stock" else f"absorb {k}") \
            + (" +g" if g else "") + ("+c" if c else "")
        paths_ = [(which, *p) for which in ("original", "mla") for p in plan_of(which, True)]
        paths_ = [p for p in paths_ if any((r["backend"], r["graph"], r["kernel"], bool(r.get("compiled"))) == p[1:]
                                           for r in cells)]
        lines += ["| context | batch | " + " | ".join(label(*p[1:]) for p in paths_)
                  + " | best absorb vs best original | absorb x of bound | original x of bound |",
                  "|---:|---:|" + "---:|" * (len(paths_) + 3)]
        pick = lambda ctx, b, backend, g, k, c, largest=False: next(  # noqa: E731
            (r for r in cells if (r["context"], r["batch"], r["backend"], r["graph"], r["kernel"], bool(r.get("compiled")))
             == (ctx, b, backend, g, k, c) and bool(r.get("largest_batch")) == largest), None)
        bound = lambda r: "-" if r is None else f"{r['x_of_bound']:.2f} ({r['bound_ms']:.2f} ms)"  # noqa: E731
        for ctx, b in sorted({(r["context"], r["batch"]) for r in cells if not r.get("largest_batch")}):
            got = [pick(ctx, b, *p[1:]) for p in paths_]
            orig = min((r for p, r in zip(paths_, got) if r and p[0] == "original"), key=lambda r: r["ms"], default=None)
            ab = min((r for p, r in zip(paths_, got) if r and p[1] == "absorb"), key=lambda r: r["ms"], default=None)
            fmt = [f"{r['ms']:.2f}" if r else "-" for r in got]
            sp = f"{orig['ms'] / ab['ms']:.2f}x" if orig and ab else "-"
            lines.append(f"| {ctx} | {b} | " + " | ".join(fmt) + f" | {sp} | {bound(ab)} | {bound(orig)} |")
        big = [r for r in cells if r.get("largest_batch")]
        if big:
            lines += ["", "Largest batch that fits at the last context (memory left: the script's margin):", "",
                      "| path | context | batch | ms per step | tokens/s | x of bound | peak GiB |", "|---|---:|---:|---:|---:|---:|---:|"]
            for r in big:
                name = (f"{'original ' + r['backend'] if r['model_type'] != 'deepseek_v3' else 'absorb ' + str(r['kernel'])}"
                        f"{' +g' if r['graph'] else ''}{'+c' if r.get('compiled') else ''}")
                lines.append(f"| {name} | {r['context']} | {r['batch']} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {r['x_of_bound']:.2f} | {r.get('peak_gib', 0):.1f} |")
            o = [r for r in big if r["model_type"] != "deepseek_v3"]
            m = [r for r in big if r["model_type"] == "deepseek_v3"]
            if o and m:
                lines += ["", f"Largest-batch throughput, absorb over the original's best: **{m[-1]['tokens_per_s'] / o[-1]['tokens_per_s']:.2f}x**."]
        kern = [r for r in rows if r.get("kind") == "kernel" and "us" in r]
        if kern:
            lines += ["", "One layer's decode attention (h = 32, latent 512 + 64), graph-timed microseconds and x of the latent's "
                      "read time:", "",
                      "| batch | context | bmm | best Triton config (block_t, warps, stages, transposed, chunks) | Triton |",
                      "|---:|---:|---:|---|---:|"]
            for B, T in sorted({(r["batch"], r["context"]) for r in kern}):
                bmm = next((r for r in kern if (r["batch"], r["context"], r["kernel"]) == (B, T, "bmm")), None)
                tri = min((r for r in kern if (r["batch"], r["context"], r["kernel"]) == (B, T, "triton")),
                          key=lambda r: r["us"], default=None)
                cfg = (f"{tri['block_t']}, {tri['num_warps']}, {tri['num_stages']}, {tri.get('swap')}, {tri.get('splits')}"
                       if tri else "-")
                f = lambda r: f"{r['us']:.0f} ({r['x_of_bound']:.2f}x)" if r else "-"  # noqa: E731
                lines.append(f"| {B} | {T} | {f(bmm)} | {cfg} | {f(tri)} |")
        sweep = [r for r in rows if r.get("kind") == "splits" and "us" in r]
        if sweep:
            lines += ["", "Chunks per sequence (TUNING configuration): the wave model's choice against the fastest of the sweep:", "",
                      "| batch | context | transposed | chosen chunks | us | fastest chunks | us |", "|---:|---:|---|---:|---:|---:|---:|"]
            for B, T, sw in sorted({(r["batch"], r["context"], r["swap"]) for r in sweep}):
                rs = [r for r in sweep if (r["batch"], r["context"], r["swap"]) == (B, T, sw)]
                ch = next((r for r in rs if r["chosen"]), None)
                fa = min(rs, key=lambda r: r["us"])
                lines.append(f"| {B} | {T} | {sw} | {ch['splits'] if ch else '-'} | {ch['us']:.0f} | {fa['splits']} | {fa['us']:.0f} |"
                             if ch else f"| {B} | {T} | {sw} | - | - | {fa['splits']} | {fa['us']:.0f} |")
        errors = [r for r in rows if "error" in r]
        if errors:
            lines += ["", "Failed cells: " + "; ".join(f"{r.get('backend', r.get('kernel'))} B={r['batch']} T={r['context']}: {r['error'][:80]}" for r in errors)]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--report":
        print(report(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--max-batch", action="store_true", help="also the largest batch that fits at the last context")
    ap.add_argument("--margin-gib", type=float, default=6.0, help="memory left free for activations at the largest batch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel-bench", action="store_true", help="first time one layer's decode attention per kernel config")
    ap.add_argument("--paths", default="all",
                    help="comma list of hf,static,static+g[+c],stock,stock+g,absorb-<kernel>[+g], absorb-triton+g+c "
                         "(+c: torch.compile'd step; default all)")
    ap.add_argument("--profile", default="", help="BACKEND-KERNEL:CONTEXT:BATCH[,...]: kernel-time table of 3 eager steps (torch.profiler)")
    ap.add_argument("--tuning", default="", help="Triton kernel launch parameters, e.g. block_t=64,num_warps=8,swap=1")
    ap.add_argument("--compile-contexts", type=int, nargs="*", default=None,
                    help="contexts of the torch.compile'd (+c) paths (default: the last context)")
    a = ap.parse_args(argv)
    # bad input is refused here, before the bandwidth measurement or any model is built
    if a.steps < 1 or a.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0 (got {a.steps}, {a.warmup})")
    want = None if a.paths == "all" else set(a.paths.split(","))
    if want and want - set(PATH_NAMES):
        ap.error(f"unknown --paths {sorted(want - set(PATH_NAMES))}; choose from {', '.join(PATH_NAMES)}")
    dev = torch.device(a.device)
    if want and not any(path_name(*p) in want for w in ("original", "mla") for p in plan_of(w, dev.type == "cuda")):
        ap.error(f"none of --paths {a.paths} runs on {dev.type} (CUDA graphs and compiled steps need a GPU)")
    for spec in filter(None, a.profile.split(",")):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit() or "-" not in parts[0]:
            ap.error(f"bad --profile entry {spec!r}: write BACKEND-KERNEL:CONTEXT:BATCH, e.g. absorb-triton:8192:16")
    out = Path(a.out)
    if out.exists() and out.stat().st_size:
        ap.error(f"--out {out} exists: the report reads one run per file; choose a new file (or delete it)")
    dtype = getattr(torch, a.dtype)
    import transformers

    info = dict(kind="info", shape=a.shape, torch=torch.__version__, transformers=transformers.__version__,
                device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", dtype=a.dtype)
    bw = throughput.memory_bandwidth(dev, nbytes=(2 << 30) if dev.type == "cuda" else (1 << 28))
    info["bandwidth_bytes_per_s"] = bw["bytes_per_s"]
    info["flops_per_s"] = throughput.peak_flops(dev, dtype, n=4096 if dev.type == "cuda" else 1024)["flops_per_s"]

    def emit(row):
        row = {"shape": a.shape, **row}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    emit(info)
    if a.tuning:
        from transmla.runtime import latent_decode as ld

        ld.TUNING.update(parse_tuning(a.tuning))
    if a.kernel_bench and dev.type == "cuda":
        from transmla.runtime import latent_decode as ld

        best = kernel_bench(dev, dtype, emit, rank=a.rank, rope=a.rope_dim, bandwidth=bw["bytes_per_s"])
        if a.tuning:  # the kernel bench moved TUNING; the model cells use the requested one
            ld.TUNING.update(parse_tuning(a.tuning))
        elif best:
            ld.TUNING.update(best)
        emit(dict(kind="tuning", **ld.TUNING))
    if a.profile:
        from transmla.runtime import latent_decode as ld

        model = build(a.shape, "mla", a.rope_dim, a.rank, dev, dtype)
        for spec in a.profile.split(","):
            name, ctx, b = spec.split(":")
            profile_step(model, name.split("-")[1], int(ctx), int(b), emit)
        return 0
    common = dict(steps=a.steps, warmup=a.warmup, bandwidth=bw["bytes_per_s"], flops=info["flops_per_s"])
    best = {}
    with torch.inference_mode():
        for which in ("original", "mla"):
            model = build(a.shape, which, a.rope_dim, a.rank, dev, dtype)
            plan = [p for p in plan_of(which, dev.type == "cuda") if want is None or path_name(*p) in want]
            for ctx in a.contexts:
                for backend, graph, kernel, comp in plan:
                    if comp and ctx not in (a.compile_contexts or a.contexts[-1:]):
                        continue  # each context is a fresh compile (the cache length is a static shape)
                    row = cell(model, backend, ctx, a.batch, graph=graph, kernel=kernel, compile_=comp, **common)
                    emit(row)
                    if "ms" in row and ctx == a.contexts[-1]:
                        key = "original" if which == "original" and backend != "hf" else ("absorb" if backend == "absorb" else None)
                        if key and (key not in best or row["ms"] < best[key]["ms"]):
                            best[key] = row
            if a.max_batch and dev.type == "cuda":
                b = best.get("original" if which == "original" else "absorb")
                if b:
                    ctx = a.contexts[-1]
                    nb = max_batch(model, b["backend"], ctx, a.margin_gib)
                    for _ in range(4):  # shrink on OOM
                        row = cell(model, b["backend"], ctx, nb, graph=b["graph"], kernel=b["kernel"], **common,
                                   extra={"largest_batch": True}, compile_=bool(b.get("compiled")))
                        emit(row)
                        if "error" not in row or "OutOfMemory" not in row["error"]:
                            break
                        nb = int(nb * 0.85)
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode-throughput measurement (paper Appendix F): original GQA vs converted MLA, stock vs Absorb.

Setup as in the paper: a batch of B requests, input length = output length = context / 2 tokens,
greedy, no EOS stopping (min_new_tokens = max_new_tokens), random prompt tokens (seeded). Backends:

    hf       `model.generate` with the model's own default cache (DynamicCache): the original Llama/Qwen2
             and the converted DeepseekV3 as stock transformers runs them (stock default)
    static   the original's best stock way (`decode_step` only): a preallocated StaticCache, SDPA, GQA
             heads never repeated in memory (transformers' SDPA path passes enable_gqa)
    absorb   the same `generate` loop on a DeepseekV3 model with `transmla.runtime.absorb` enabled and a
             preallocated `LatentCache` (kv_lora_rank + qk_rope_head_dim values per token and layer)

Roofline: a decode step must read every weight once and the whole KV cache of the batch; over the
machine's measured copy bandwidth (`memory_bandwidth`) that is a lower bound on its time
(`step_bytes`), reported next to each measured step as "x of the bound". One copy's reading swings with
a shared host's load, so a run reads it several times and divides by the median (`readings_summary`,
`bound_fields`); the matmul peak too (`floor_fields`).

Compute floor: the step's floating-point operations (`step_flops`) over the machine's measured
matmul peak (`peak_flops`). On a CPU with few cores the two floors can be close (SmolLM2 at batch 8
on 2 Zen 4 cores at 4K: 14.5 and 17.9 ms in one run), and then a step near the bandwidth bound needs its loads and
its arithmetic to overlap almost perfectly, at near-peak arithmetic; the reports show both.

Timings synchronise the model's device before every clock read (`synchronize`): on a GPU an
unsynchronised clock measures kernel launches, not kernels.

Pure functions: no files, no orchestration; results are flat dicts. Wall-clock numbers depend on the
machine and its load; nothing here asserts a speed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from transmla.errors import TransMLAError
from transmla.runtime.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

BACKENDS = ("hf", "static", "absorb")
GIB = 2**30


# --------------------------------------------------------------------------------------------------
# KV-cache size (from the config)
# --------------------------------------------------------------------------------------------------


def is_mla(config) -> bool:
    mt = getattr(config, "model_type", None) or ""
    # this package's MLA classes (transmla.models) are named transmla_*_mla
    return (mt in ("deepseek_v3", "deepseek_v2") or mt.startswith("transmla_")) and hasattr(config, "kv_lora_rank")


@functools.lru_cache(maxsize=1)
def hf_mla_cache_layout() -> str:
    """What stock transformers' DeepseekV3 caches: "latent" ([c_kv ; k_pe], transformers >= 5.x) or
    "expanded" (per-head keys and values, older versions). Probed once on a 1-layer random model,
    so the formula follows the installed version instead of guessing it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

    cfg = DeepseekV3Config(
        vocab_size=8, hidden_size=16, intermediate_size=16, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=6, q_lora_rank=None, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=1, n_shared_experts=1,
        num_experts_per_tok=1, n_group=1, topk_group=1,
    )
    with torch.random.fork_rng():  # random init must not move the caller's RNG
        model = DeepseekV3ForCausalLM(cfg).eval()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long), past_key_values=cache, use_cache=True)
    width = cache.layers[0].keys.shape[-1]
    return "latent" if width == cfg.kv_lora_rank else "expanded"


# This package's MLA exports whose attention caches Qwen3's key-norm scale beside k_pe, qk_norm_groups values
# per token and layer (transmla.models.Qwen3MLAAttention; Gemma3MLAAttention inherits it; absorb does the same)
KEY_SCALE_TYPES = ("transmla_qwen3_mla", "transmla_gemma3_mla")
# ... and those whose attention is this package's own forward: it caches the latent whatever transformers does
OWN_LATENT_TYPES = (*KEY_SCALE_TYPES, "transmla_gemma2_mla")


def kv_values_per_layer(config, backend: str = "hf") -> int:
    """Values one layer caches per token of one sequence, as `backend` stores them.

    GQA (original):         2 * kv_heads * head_dim
    MLA, absorb:            kv_lora_rank + qk_rope_head_dim (+ qk_norm_groups for the Qwen3 / Gemma 3 exports)
    MLA, hf / static:       the same if the model caches the latent (this package's own attention classes, or
                            the installed transformers' DeepseekV3), else heads * (qk_nope + qk_rope + v)
    """
    _check_backend(backend)
    if not is_mla(config):
        if backend == "absorb":
            raise TransMLAError(f"The absorb backend needs an MLA model, not {config.model_type!r}.", "use backend 'hf'.")
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2 * config.num_key_value_heads * d
    if backend == "absorb" or config.model_type in OWN_LATENT_TYPES or hf_mla_cache_layout() == "latent":
        scales = config.qk_norm_groups if config.model_type in KEY_SCALE_TYPES else 0
        return config.kv_lora_rank + config.qk_rope_head_dim + scales
    h = config.num_attention_heads
    return h * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)


def cached_tokens_per_layer(config, backend: str, context: int) -> list[int]:
    """Tokens each layer's cache holds once a sequence has `context` tokens, as `backend` caches them: every
    token, except the sliding-window (and chunked) layers of transformers' caches ("hf": DynamicCache(config=...)
    keeps the last window - 1, the step's own token completing the window; "static": StaticCache, window slots),
    which are read from the config exactly as those caches read it. "absorb" (LatentCache) has no windows:
    every layer keeps every token, the sliding layers' masks hide the older ones."""
    _check_backend(backend)
    if backend == "absorb":
        return [context] * config.num_hidden_layers
    from transformers.cache_utils import get_layer_types_and_kwargs

    held = []
    for kind, kwargs in zip(*get_layer_types_and_kwargs(config.get_text_config(decoder=True)), strict=True):
        window = kwargs.get("sliding_window")
        if kind == "dummy":  # a layer that reuses another's cache, or has no attention
            held.append(0)
        elif window is None:
            held.append(context)
        else:
            held.append(min(context, window - 1 if backend == "hf" else window))
    return held


def check_counts(**counts: tuple[int, int]) -> None:
    """Refuse a size or count below its least value (name=(value, least)): a batch of 0 divided by zero, a
    negative one reached torch as a negative dimension, 0 steps left no median."""
    for name, (value, least) in counts.items():
        if value < least:
            raise TransMLAError(f"{name}={value} is below {least}.", f"pass {name} >= {least}.")


def kv_cache_bytes(config, backend: str, context: int, dtype: torch.dtype = torch.float32) -> int:
    """KV-cache bytes of one sequence of `context` tokens, all layers, as `backend` stores it
    (`kv_values_per_layer` values for each token `cached_tokens_per_layer` keeps)."""
    check_counts(context=(context, 0))
    b = torch.empty((), dtype=dtype).element_size()
    return kv_values_per_layer(config, backend) * sum(cached_tokens_per_layer(config, backend, context)) * b


def kv_bytes_per_token(config, backend: str = "hf", dtype: torch.dtype = torch.float32,
                       context: int | None = None) -> int | float:
    """KV-cache bytes per token of one sequence, all layers, as `backend` stores it (`kv_values_per_layer`).

    Without `context`: every layer caching the token (any context within every window; a model without
    sliding layers at any context), layers * values per layer * bytes. With `context`: the cache of a sequence
    of that many tokens over `context` (`kv_cache_bytes`; smaller where sliding layers keep only their window),
    an int where every layer keeps every token, so models without windows get the same int either way.
    """
    b = torch.empty((), dtype=dtype).element_size()
    every = config.num_hidden_layers * kv_values_per_layer(config, backend) * b
    if context is None or all(n == context for n in cached_tokens_per_layer(config, backend, context)):
        return every
    return kv_cache_bytes(config, backend, context, dtype) / context


def original_kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int | None:
    """The source model's KV bytes per token: the config itself for a GQA model; for a TransMLA export,
    from the `transmla` section of its config (2 g d values per layer). None if unknown."""
    if not is_mla(config):
        return kv_bytes_per_token(config, "hf", dtype)
    meta = getattr(config, "transmla", None) or {}
    per_layer = (meta.get("kv_cache_values_per_token_per_layer") or {}).get("original")
    if per_layer is None:
        return None
    return int(per_layer) * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()


def kv_capacity_tokens(bytes_per_token: float, cache_memory_bytes: int = GIB) -> int:
    """Tokens whose KV cache fits in `cache_memory_bytes` (1 GiB by default)."""
    check_counts(cache_memory_bytes=(cache_memory_bytes, 0))
    return int(cache_memory_bytes // bytes_per_token) if bytes_per_token > 0 else 0


def cache_nbytes(cache) -> int:
    """Bytes of the cached tokens in a transformers Cache (LatentCache: valid tokens only, no slack)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------------


def synchronize(device) -> None:
    """Wait until `device` has run every queued kernel (CUDA; a no-op on CPU, which runs eagerly)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def memory_bandwidth(device="cpu", nbytes: int = 1 << 30, repeats: int = 5, hugepages: bool = False) -> dict:
    """Measured memory bandwidth of `device`: a copy of `nbytes` reads and writes nbytes each, so
    bandwidth = 2 nbytes / time (median of `repeats` after one warm-up copy). `hugepages`: both buffers in
    2 MB pages (`runtime.hugepages`; CPU where the kernel offers them), as the decode runs' weights are, so
    the bound divides by what the copy reaches from the same pages (a 1 GiB copy read 35-37 GB/s from them
    against 35 from 4 KB pages, alternated in one process); the result's `hugepages` says whether they were."""
    from transmla.runtime import hugepages as hp

    check_counts(nbytes=(nbytes, 4), repeats=(repeats, 1))  # one float32 at least: 0 bytes read 0 B/s
    n = nbytes // 4
    huge = hugepages and torch.device(device).type == "cpu" and hp.supported()
    if huge:
        src, dst = hp.empty((n,)), hp.empty((n,))
        src.fill_(1.0)
    else:
        src = torch.ones(n, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)  # the mean of the middle two for an even count, as everywhere here
    del src, dst
    return {"device": str(torch.device(device)), "bytes_per_s": 2 * n * 4 / med, "copy_bytes": n * 4,
            "best_bytes_per_s": 2 * n * 4 / min(times), "repeats": repeats, "processor": processor_name(device),
            "hugepages": huge}


def readings_summary(readings: list[dict], key: str = "bytes_per_s") -> dict:
    """Several readings of one rate spread through a run (`memory_bandwidth`: key "bytes_per_s";
    `peak_flops`: "flops_per_s") -> the run's figure: the median of the readings (`key`; the mean of the middle
    two for an even count) with the range of all of them (`range_<key>`) and every reading in order
    (`readings_<key>`). Why several: on a shared host one reading can land 50% above or below the usual (a
    neighbour idle or busy for that second), and a bound divided by it swings as much."""
    if not readings:
        raise TransMLAError(f"No {key} readings to summarise.",
                            "take at least one (memory_bandwidth() or peak_flops()).")
    rates = [r[key] for r in readings]
    ordered = sorted(rates)
    return {**{k: v for k, v in readings[0].items() if k not in (key, f"best_{key}")},
            key: statistics.median(rates), f"range_{key}": [ordered[0], ordered[-1]],
            "readings": len(rates), f"readings_{key}": rates}


def floor_fields(row: dict, flops: float, spread: tuple[float, float] | None = None) -> dict:
    """The compute side of a roofline row (`roofline`: `step_flops`, `linear_flops`, `attention_flops`) at
    `flops` operations/s: the floor `compute_floor_ms`, split into `linear_floor_ms` and `attention_floor_ms`.
    `spread` (lowest, highest peak read in the run): `compute_floor_range_ms`, the floor at each end."""
    out = {"flops_per_s": flops, "compute_floor_ms": 1e3 * row["step_flops"] / flops,
           "linear_floor_ms": 1e3 * row["linear_flops"] / flops,
           "attention_floor_ms": 1e3 * row["attention_flops"] / flops}
    if spread:
        out["compute_floor_range_ms"] = [1e3 * row["step_flops"] / f for f in spread]
    return out


def bound_fields(row: dict, seconds: float, bandwidth: float, spread: tuple[float, float] | None = None) -> dict:
    """The bandwidth side of a roofline row (`roofline`: `step_bytes`, and `compute_floor_ms` if measured)
    at `bandwidth` bytes/s: the bound `bound_ms`, the measured `seconds` as `x_of_bound` and, beside the
    compute floor, `x_of_roofline`. `spread` (lowest, highest bandwidth read in the run): `x_of_bound_range`,
    the same time against the bound at each end."""
    out = {"bandwidth_bytes_per_s": bandwidth, "bound_ms": 1e3 * row["step_bytes"] / bandwidth,
           "x_of_bound": seconds * bandwidth / row["step_bytes"]}
    if spread:
        out["x_of_bound_range"] = [seconds * b / row["step_bytes"] for b in spread]
    if row.get("compute_floor_ms") is not None:
        out["x_of_roofline"] = 1e3 * seconds / max(out["bound_ms"], row["compute_floor_ms"])
    return out


def processor_name(device="cpu") -> str:
    """The device's model name, so numbers from different machines are not compared blind: the GPU's
    name, or the CPU's from /proc/cpuinfo (platform.processor() elsewhere) with its core count and
    whether it has AVX-512 (which decides much of the CPU kernels' speed)."""
    import platform

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    info = {}  # the first processor's fields
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name, flags = info.get("model name") or platform.processor() or platform.machine(), info.get("flags", "")
    avx512 = "avx512f" in flags.split()
    return f"{name}, {os.cpu_count()} cores{', AVX-512' if avx512 else (', no AVX-512' if flags else '')}"


def step_weights(model) -> list[torch.Tensor]:
    """The weights one decode step reads, each once: every parameter and absorbed buffer, except the input
    embedding table (a step reads B of its rows) unless it is also the output head (tied), and except
    what an absorbed attention layer replaced by its precomputed matrices (kv_b_proj always; the query
    projection or o_proj's weight when folded)."""
    seen, out = set(), []
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight if model.get_output_embeddings() is not None else None
    skip = set()
    if head is None or head.data_ptr() != emb.data_ptr():
        skip.add(emb.data_ptr())
    for m in model.modules():
        if "absorb_q_weight" in m._buffers or "absorb_w_uk" in m._buffers:
            skip.add(m.kv_b_proj.weight.data_ptr())
            if "absorb_q_weight" in m._buffers:
                skip.add((m.q_proj if m.q_lora_rank is None else m.q_b_proj).weight.data_ptr())
            if "absorb_o_weight" in m._buffers:
                skip.add(m.o_proj.weight.data_ptr())
    for t in list(model.parameters()) + [b for name, b in model.named_buffers() if name.rsplit(".", 1)[-1].startswith("absorb_")]:
        if t.data_ptr() in seen or t.data_ptr() in skip:
            continue
        seen.add(t.data_ptr())
        out.append(t)
    return out


def routed_experts(model) -> list[tuple[list[torch.Tensor], int, int]]:
    """The routed experts of each MoE block: (their weights, experts E, experts per token k). A block is a
    module with an `experts` child (Mixtral's and DeepSeek-V3's 3-D `experts.*` tensors, or a ModuleList of
    expert MLPs); its router (`gate`) and shared experts are siblings, not in the list: always active."""
    cfg = model.config.get_text_config(decoder=True)
    out = []
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, torch.nn.Module):
            continue
        weights = list(experts.parameters())
        E = getattr(experts, "num_experts", None) or (len(experts) if isinstance(experts, torch.nn.ModuleList) else None)
        E = E or next((t.shape[0] for t in weights if t.dim() == 3), None)
        k = getattr(block, "top_k", None) or getattr(getattr(block, "gate", None), "top_k", None) \
            or getattr(cfg, "num_experts_per_tok", None)
        if weights and E and k:
            out.append((weights, int(E), min(int(k), int(E))))
    return out


def _split_experts(model) -> tuple[list[torch.Tensor], list[tuple[int, int, int, int]]]:
    """`step_weights` as (the always-read tensors, per MoE block (elements of its matrices, bytes, E, k))."""
    weights = step_weights(model)
    ptr = {}
    for group, E, k in routed_experts(model):
        for t in group:
            ptr[t.data_ptr()] = (id(group), E, k)
    dense, blocks = [], {}
    for t in weights:
        if t.data_ptr() not in ptr:
            dense.append(t)
            continue
        key, E, k = ptr[t.data_ptr()]
        numel, nbytes, _, _ = blocks.get(key, (0, 0, E, k))
        blocks[key] = (numel + (t.numel() if t.dim() >= 2 else 0), nbytes + t.numel() * t.element_size(), E, k)
    return dense, list(blocks.values())


def weight_bytes_per_step(model, batch: int | None = None) -> int:
    """Bytes of weights one decode step of `batch` sequences reads (`step_weights`). Routed MoE experts: a step
    of B tokens, k experts each, touches at most min(E, B k) of a block's E experts, so that bound (equal-sized
    experts) stands for them; every expert without `batch`."""
    dense, blocks = _split_experts(model)
    total = sum(t.numel() * t.element_size() for t in dense)
    for _, nbytes, E, k in blocks:
        total += nbytes * (E if batch is None else min(E, batch * k)) // E
    return total


def step_bytes(model, backend: str, context: int, batch: int) -> dict:
    """The least a decode step at `context` cached tokens must read: weights (`weight_bytes_per_step`) + the
    batch's KV cache (`kv_cache_bytes`: sliding layers of the hf / static caches hold only their window)."""
    dtype = next(model.parameters()).dtype
    kv = batch * kv_cache_bytes(model.config, backend, context, dtype)
    w = weight_bytes_per_step(model, batch)
    return {"weight_bytes": w, "kv_bytes": kv, "step_bytes": w + kv}


def step_flops(model, backend: str, context: int, batch: int) -> dict:
    """Floating-point operations of one decode step at `context` cached tokens (multiply + add = 2):

    linear      2 B * (elements of every matrix in `step_weights`; vectors such as norms are elementwise), a
                routed MoE block's experts at k / E of their elements (a token runs its k experts of E)
    attention   per layer and query head, over the T tokens that layer's cache holds (`cached_tokens_per_layer`:
                a sliding layer's window in the hf / static caches): GQA (original) 2 B T (head_dim + head_dim);
                absorb 2 B T ((kv_lora_rank + qk_rope_head_dim) + kv_lora_rank), the scores over the whole
                latent and the values over its first kv_lora_rank dims; DeepseekV3 "hf" 2 B T (qk_nope +
                qk_rope + v) plus, where transformers caches the latent, its re-expansion by kv_b_proj
                (2 B T kv_lora_rank heads (qk_nope + v)) every step.
    Softmax and the elementwise work are left out: a floor, not an estimate."""
    _check_backend(backend)
    config = model.config
    dense, blocks = _split_experts(model)
    linear = 2 * batch * sum(t.numel() for t in dense if t.dim() >= 2)
    linear += sum(2 * batch * numel * k // E for numel, _, E, k in blocks)
    h = config.num_attention_heads
    if not is_mla(config):
        d = getattr(config, "head_dim", None) or config.hidden_size // h
        per_key = 2 * d
    elif backend == "absorb":
        per_key = (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank
    else:
        per_key = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
        if hf_mla_cache_layout() == "latent":
            per_key += config.kv_lora_rank * (config.qk_nope_head_dim + config.v_head_dim)
    attention = 2 * batch * h * per_key * sum(cached_tokens_per_layer(config, backend, context))
    return {"linear_flops": linear, "attention_flops": attention, "step_flops": linear + attention}


def roofline(model, backend: str, context: int, batch: int, seconds: float, *, bandwidth: float | None = None,
             flops: float | None = None) -> dict:
    """A measured step time (`seconds`) against what the step must do: its bytes (`step_bytes`) and, given
    the measured `bandwidth` (bytes/s), the bandwidth bound `bound_ms` and the time as `x_of_bound`; its
    operations (`step_flops`) and, given the measured `flops` (operations/s), the compute floor
    (`compute_floor_ms`, split into `linear_floor_ms` and `attention_floor_ms`); with both, the time as a
    multiple of the larger of the two, `x_of_roofline`. Call it in the model state that was timed (absorbed
    or not: the weights a step reads differ)."""
    row = step_bytes(model, backend, context, batch)
    work = step_flops(model, backend, context, batch)
    row.update(work)
    if flops:
        row.update(floor_fields(row, flops))
    if bandwidth:
        row.update(bound_fields(row, seconds, bandwidth))
    return row


def peak_flops(device="cpu", dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5,
               threads: int | None = None) -> dict:
    """Measured compute peak of `device` in `dtype`: an n x n x n matmul (2 n^3 operations; the BLAS's best
    case, so a floor for the skinny products of decode), the best of `repeats` after one warm-up (a peak:
    a busy moment of a shared host only lowers it), on `threads` CPU threads (default: `default_threads`,
    as the decode measurements)."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b
        # a GPU finishes one 1024^3 product in microseconds, less than a synchronisation: time several
        inner = 1 if torch.device(device).type == "cpu" else 20
        times = []
        for _ in range(repeats):
            synchronize(device)
            t = time.perf_counter()
            for _ in range(inner):
                a @ b
            synchronize(device)
            times.append((time.perf_counter() - t) / inner)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    times.sort()
    return {"device": str(torch.device(device)), "dtype": str(dtype).removeprefix("torch."), "n": n,
            "repeats": repeats, "flops_per_s": 2 * n**3 / times[0], "threads": used}


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


class _Clock:
    """A generate streamer that only timestamps: put() #0 is the prompt, #k the k-th new token."""

    def __init__(self, device="cpu"):
        self.times: list[float] = []
        self.device = device

    def put(self, value):
        synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise TransMLAError(f"Unknown throughput backend {backend!r}.", f"use one of {BACKENDS}.")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0, tokenizer=None) -> torch.Tensor:
    """[batch, length] uniform random token ids (special tokens of `tokenizer` excluded), seeded."""
    g = torch.Generator().manual_seed(seed)
    if tokenizer is None:
        return torch.randint(0, vocab_size, (batch, length), generator=g)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special])
    return allowed[torch.randint(0, len(allowed), (batch, length), generator=g)]


def _generate(model, backend: str, ids: torch.Tensor, new_tokens: int, streamer=None):
    from transmla.runtime.absorb import LatentCache

    kw = {}
    if backend == "absorb":
        kw["past_key_values"] = LatentCache(model.config, max_cache_len=ids.shape[1] + new_tokens)
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else (gc.eos_token_id if isinstance(gc.eos_token_id, int) else 0)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no EOS stopping: every request produces exactly new_tokens
        do_sample=False,
        num_beams=1,
        pad_token_id=pad,
        streamer=streamer,
        return_dict_in_generate=True,
        **kw,
    )


def measure(
    model,
    backend: str = "hf",
    context: int = 1024,
    batch: int = 8,
    *,
    tokenizer=None,
    vocab_size: int | None = None,
    prompt_ids: torch.Tensor | None = None,
    threads: int | None = None,
    warmup: bool = True,
    seed: int = 0,
    cache_memory_bytes: int = GIB,
    output_len: int | None = None,
) -> dict:
    """One throughput measurement: `batch` requests of context/2 prompt tokens + context/2 generated.

    Args:
        model: a causal LM (original GQA model or converted `DeepseekV3ForCausalLM`), eval mode.
        backend (`str`): "hf" (stock generate, default cache) or "absorb" (DeepseekV3 only).
        context (`int`): prompt + output length per request; input = context // 2, output = the rest.
        output_len (`int`, *optional*): override the output length (input = context - output_len), e.g.
            a short decode window at the end of a long context when a full run would take too long.
        batch (`int`): requests decoded together.
        tokenizer / vocab_size: where random prompt tokens come from (default config.vocab_size);
            `prompt_ids` `[batch, input_len]` fixes them instead.
        threads (`int`, *optional*): torch intra-op threads (default: all cores of this process);
            restored afterwards.
        warmup (`bool`): a short untimed generate first (same batch, 32-token prompt, 4 tokens).
        cache_memory_bytes (`int`): memory budget for the KV-capacity columns (1 GiB).

    Returns a dict: output tokens/s over prefill + decode (B * output_len / total wall time, as vLLM's
    throughput benchmark counts output tokens), decode-only tokens/s and time per output token
    (steps after the first token), prefill seconds (to the first generated token), peak RSS (see
    `rss_method`), KV bytes per token from the config formula and from the returned cache's tensors (both
    at the length it reached), and KV capacity in `cache_memory_bytes` (every layer caching every token, as
    `kv_bytes_per_token` without a context) with its ratio to the original model's.
    """
    from transmla.runtime.absorb import absorbed

    _check_backend(backend)
    config = model.config
    if backend == "absorb" and not is_mla(config):
        raise TransMLAError(f"The absorb backend needs an MLA (DeepseekV3) model, got {config.model_type!r}.",
                            "measure the original with backend 'hf'.")
    if backend == "static":
        raise TransMLAError("The static backend is measured per decode step only.", "use decode_step(..., backend='static').")
    check_counts(batch=(batch, 1), context=(context, 2))
    if output_len is not None and not 1 <= output_len < context:  # the prompt and the output both need a token
        raise TransMLAError(f"output_len={output_len} leaves no prompt or no output in context={context}.",
                            f"pass output_len between 1 and {context - 1}, or None (half the context).")
    out_len = context - context // 2 if output_len is None else output_len
    in_len = context - out_len
    vocab = vocab_size or config.vocab_size
    ids = prompt_ids if prompt_ids is not None else random_prompts(vocab, batch, in_len, seed, tokenizer)
    if ids.shape != (batch, in_len):
        raise TransMLAError(f"prompt_ids has shape {tuple(ids.shape)}, expected {(batch, in_len)}.", "pass [batch, input_len] ids.")
    ids = ids.to(model.device)
    dtype = next(model.parameters()).dtype
    threads = threads or default_threads()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with absorbed(model, enabled=backend == "absorb") if is_mla(config) else contextlib.nullcontext(), torch.inference_mode():
            if warmup:
                _generate(model, backend, ids[:, : min(in_len, 32)], min(out_len, 4))
            rss_method = reset_peak_rss()
            rss0 = rss_bytes()
            on_gpu = model.device.type == "cuda"  # weights and cache in GPU memory: RSS does not see them
            if on_gpu:
                torch.cuda.reset_peak_memory_stats(model.device)
            clock = _Clock(model.device)
            synchronize(model.device)
            t0 = time.perf_counter()
            out = _generate(model, backend, ids, out_len, streamer=clock)
            synchronize(model.device)
            t_end = time.perf_counter()
            peak = peak_rss_bytes()
            gpu_peak = torch.cuda.max_memory_allocated(model.device) if on_gpu else None
            cache = out.past_key_values
            cached_tokens = cache.get_seq_length()
            kv_measured = cache_nbytes(cache)
            del out, cache
    finally:
        torch.set_num_threads(old_threads)

    t_first = clock.times[1] if len(clock.times) > 1 else t_end
    total = t_end - t0
    decode = t_end - t_first
    # the formula at the length the returned cache reached (sliding layers of the hf cache keep their window
    # only); the capacity per token with every layer caching it, as the original's from the export's metadata
    kv_formula = kv_bytes_per_token(config, backend, dtype, context=cached_tokens or None)
    kv_orig = original_kv_bytes_per_token(config, dtype)
    capacity = kv_capacity_tokens(kv_bytes_per_token(config, backend, dtype), cache_memory_bytes)
    orig_capacity = kv_capacity_tokens(kv_orig, cache_memory_bytes) if kv_orig else None
    return {
        "backend": backend,
        "model_type": config.model_type,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": threads,
        "context": context,
        "batch": batch,
        "input_len": in_len,
        "output_len": out_len,
        "tokens_per_s": batch * out_len / total,
        "decode_tokens_per_s": batch * (out_len - 1) / decode if out_len > 1 and decode > 0 else None,
        "time_per_output_token_ms": 1e3 * decode / (out_len - 1) if out_len > 1 else None,
        "prefill_s": t_first - t0,
        "decode_s": decode,
        "total_s": total,
        "peak_rss_gib": peak / GIB,
        **({} if gpu_peak is None else {"peak_gpu_gib": gpu_peak / GIB}),  # on a GPU, where the model and cache are
        "rss_before_gib": None if rss0 is None else rss0 / GIB,
        "rss_method": rss_method,
        "hf_mla_cache_layout": hf_mla_cache_layout() if is_mla(config) and backend == "hf" else None,
        "kv_bytes_per_token": kv_formula,
        "kv_bytes_per_token_measured": kv_measured / (batch * cached_tokens) if cached_tokens else None,
        "kv_cache_bytes_measured": kv_measured,
        "kv_cache_memory_bytes": cache_memory_bytes,
        "kv_capacity_tokens": capacity,
        "original_kv_bytes_per_token": kv_orig,
        "kv_capacity_ratio_vs_original": capacity / orig_capacity if orig_capacity else None,
    }


def decode_step(
    model,
    backend: str = "hf",
    context: int = 1024,
    batch: int = 8,
    *,
    steps: int = 16,
    warmup_steps: int = 2,
    threads: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    bandwidth: float | None = None,
    flops: float | None = None,
    packed_weights: bool = False,
    compiled: bool = False,
    native: bool = False,
    gemm: str = "auto",
    hugepages: bool = False,
) -> dict:
    """Time per output token at a given context, without a full run: prefill ONE random sequence of
    `context` tokens, replicate its cache to `batch` rows (`Cache.batch_repeat_interleave`; the cost of a
    step does not depend on the cached values), then time `steps` single-token forwards + greedy argmax
    (what each `generate` step does, minus its bookkeeping). Far cheaper than `measure` at long contexts
    (one prefill of `context` tokens instead of `batch`), at the price of not being the paper's run.

    backend "static": the prefilled sequence is copied into a preallocated StaticCache of `batch` rows
    (the original's best stock decode). `bandwidth` (bytes/s, `memory_bandwidth`): adds the roofline,
    the step's bytes (`step_bytes`) over it and the measured median as a multiple of that bound. `flops`
    (operations/s, `peak_flops`): the compute floor too, the step's operations (`step_flops`) over it, and
    the median as a multiple of the larger of the two (the roofline).
    `packed_weights`: every linear layer on weights prepacked for the batch (`runtime.packed`; CPU
    float32 only, ignored elsewhere; the row records whether it applied). `compiled` (backend "absorb"
    only): the steps run as one torch.compile graph over a static latent cache (`runtime.compiled_decode`,
    inductor prepacks the weights itself, so `packed_weights` does not apply; with this project's GEMM kernels,
    "stream" or "tiled", the graph calls them on the stock or tiled weights); the first warm-up step
    compiles (or reuses the graph of an earlier call), its seconds are in the row as `compile_s`. `native` (with
    `compiled`): each step one native call instead (`runtime.native_decode`: every layer in one OpenMP region)
    where the model allows it (GEMM kernel "tiled", `native_decode.unsupported`), else the graph; the row's
    `decode_loop` says which ran ("native" or "compiled"; None for an eager run).
    `gemm`: the prepacked GEMM kernel of both (`runtime.packed.KERNELS`, or "auto": the faster on this CPU
    for the model's weights at this batch, `packed.fastest_kernel`); the row records the kernel used
    (`gemm`, None when nothing was packed) and, for "auto", each kernel's time for one pass over the
    weights (`gemm_pass_ms`).
    `hugepages`: the decode cache of a "static" or compiled "absorb" run in 2 MB pages (`cache_to_hugepages`;
    the row records `cache_hugepages`). The model's weights are the caller's to move
    (`runtime.hugepages.to_hugepages`, once: a compiled graph holds the weights it was traced with).

    Returns: median / min / max time per output token (ms), batch / median as decode tokens/s, the cache
    length reached, the single-sequence prefill seconds and the cache's measured bytes per token.
    """
    from transformers import DynamicCache

    from transmla.runtime import compiled_decode, native_decode, packed
    from transmla.runtime.absorb import LatentCache, absorbed, decode_kernel

    _check_backend(backend)
    # compiled: the first step compiles, and an untimed warm-up step is where its seconds go (compile_s)
    check_counts(batch=(batch, 1), context=(context, 1), steps=(steps, 1),
                 warmup_steps=(warmup_steps, 1 if compiled else 0))
    config = model.config
    if backend == "absorb" and not is_mla(config):
        raise TransMLAError(f"The absorb backend needs an MLA (DeepseekV3) model, got {config.model_type!r}.",
                            "measure the original with backend 'hf'.")
    dev = model.device
    ids = random_prompts(vocab_size or config.vocab_size, 1, context, seed).to(model.device)
    threads = threads or default_threads()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    compiled = compiled and backend == "absorb"
    packed_weights = packed_weights and not compiled and packed.available(model)
    compile_s = None
    decode_loop = None
    gemm_used, gemm_pass_ms = None, None
    try:
        # the prepacked GEMM kernel of the packed or compiled run, chosen once (after the thread count is set)
        if packed_weights or compiled:
            if gemm != "auto":
                gemm_used = gemm
            elif packed.available(model):
                gemm_used, per_kernel = packed.fastest_kernel(model, batch)  # measured once per process
                gemm_pass_ms = {k: 1e3 * v for k, v in per_kernel.items()}
            else:  # compiled, not float32: inductor's own choice at a static batch
                gemm_used = "mkl"
        # no_grad, not inference_mode, around a compiled run: its static cache is written in place by the
        # graph, and inductor freezes weights only with gradients off
        with absorbed(model, enabled=backend == "absorb") if is_mla(config) else contextlib.nullcontext(), \
                packed.packed(model, enabled=packed_weights or (compiled and gemm_used in packed.OP_KERNELS), batch=batch,
                              kernel=gemm_used), \
                torch.no_grad() if compiled else torch.inference_mode():
            total = context + warmup_steps + steps
            cache = LatentCache(config, max_cache_len=total) if backend == "absorb" else DynamicCache(config=config)
            synchronize(dev)
            t0 = time.perf_counter()
            out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            synchronize(dev)
            prefill = time.perf_counter() - t0
            nxt = out.logits[:, -1:].argmax(-1).repeat(batch, 1)  # [batch, 1]
            latent_layout = "rows" if backend == "absorb" else None
            if compiled:
                # native_decode.unsupported checks the packing too (the "tiled" kernel on every linear)
                decode_loop = "native" if native and native_decode.unsupported(model) is None else "compiled"
                cache = compiled_decode.StaticLatentCache.from_latent_cache(cache, batch, total,
                                                                            blocked=True if decode_loop == "native" else None)
                latent_layout = "blocked" if cache.blocked else "rows"
                step = (native_decode.native_step(model) if decode_loop == "native"
                        else compiled_decode.compiled_step(model, gemm=gemm_used))
            elif backend == "static":
                cache = static_copy(cache, config, batch, total, seen=ids.shape[-1])
            else:
                cache.batch_repeat_interleave(batch)
            cache_hugepages = hugepages and cache_to_hugepages(cache)
            for i in range(warmup_steps + steps):
                synchronize(dev)
                t = time.perf_counter()
                if compiled:
                    logits = step(nxt, cache)  # [batch, vocab]
                    cache.advance()
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
                synchronize(dev)
                if i >= warmup_steps:
                    times.append(time.perf_counter() - t)
                elif i == 0 and decode_loop == "compiled":
                    compile_s = time.perf_counter() - t
            length = int(cache.get_seq_length())
            kv_measured = cache_nbytes(cache) / (batch * length)
            times.sort()
            median = statistics.median(times)  # the mean of the middle two for an even number of steps
            roof = roofline(model, backend, context, batch, median, bandwidth=bandwidth, flops=flops)
            del out, cache
    finally:
        torch.set_num_threads(old_threads)
    row = {
        "backend": backend,
        "model_type": config.model_type,
        "device": str(dev),
        "threads": threads,
        "packed_weights": packed_weights,
        "compiled": compiled,
        "compile_s": compile_s,
        # how a compiled run stepped: "native" (runtime.native_decode) or "compiled" (the torch.compile graph)
        "decode_loop": decode_loop,
        "gemm": gemm_used,
        "gemm_pass_ms": gemm_pass_ms,
        # the absorbed single-token attention kernel ("auto" resolved: runtime.absorb.decode_kernel)
        "decode_attention": decode_kernel(dev, batch, length, next(model.parameters()).dtype) if backend == "absorb" else None,
        # the latent cache's layout: "blocked" = 16 tokens per block, keys in the vector lanes (compiled_decode)
        "latent_layout": latent_layout,
        "cache_hugepages": cache_hugepages,
        "context": context,
        "batch": batch,
        "steps": steps,
        "cache_length_end": length,
        "time_per_output_token_ms": 1e3 * median,
        "time_per_output_token_min_ms": 1e3 * times[0],
        "time_per_output_token_max_ms": 1e3 * times[-1],
        "decode_tokens_per_s": batch / median,
        "prefill_one_sequence_s": prefill,
        # at the length reached, as measured: sliding layers of the hf / static caches keep only their window
        "kv_bytes_per_token": kv_bytes_per_token(config, backend, next(model.parameters()).dtype, context=length),
        "kv_bytes_per_token_measured": kv_measured,
        **roof,
    }
    return row


def cache_to_hugepages(cache) -> bool:
    """Move a preallocated decode cache (a StaticCache's keys and values, a `StaticLatentCache`'s buffers)
    into 2 MB pages (`runtime.hugepages`), in place; False (nothing moved) for a cache that grows (DynamicCache,
    LatentCache), off CPU or where the kernel has no huge pages. Why: the original's StaticCache is 1.5 GB
    at 4K (batch 8) in 4 KB pages; in 2 MB pages its step took 123 ms instead of 129 (SmolLM2-135M, weights
    in 2 MB pages both times, 2 threads, median of 3 alternations). The latent cache is 8x smaller and
    read by a compute-bound kernel: the same move left the absorbed step unchanged (31.9 against 32.2 ms,
    10 alternations), and is made for both alike."""
    from transformers import StaticCache

    from transmla.runtime import hugepages as hp
    from transmla.runtime.compiled_decode import StaticLatentCache

    if not hp.supported():
        return False
    if isinstance(cache, StaticLatentCache):
        if cache.buffers[0].device.type != "cpu":
            return False
        cache.buffers = [hp.copy(b) for b in cache.buffers]
        for b in cache.buffers:  # as the constructor marks them: one graph for every capacity
            torch._dynamo.mark_dynamic(b, 1)
        return True
    if isinstance(cache, StaticCache) and all(layer.is_initialized for layer in cache.layers):
        if cache.layers[0].keys.device.type != "cpu":
            return False
        for layer in cache.layers:
            layer.keys, layer.values = hp.copy(layer.keys), hp.copy(layer.values)
        return True
    return False


def static_copy(cache, config, batch: int, max_cache_len: int, seen: int | None = None):
    """A preallocated StaticCache of `batch` rows holding the single prefilled sequence of `cache` (a
    DynamicCache of `seen` tokens) in every row: the original model's decode in its best stock form.

    A sliding layer's static buffer holds its window's last tokens in order once `seen` fills it (the
    layout its own update leaves); the dynamic layer keeps one token fewer, so the buffer's first slot
    stays empty: the next step rolls it out before attending. Both length counters are set, the
    tensor one and the int one that tells a sliding layer it is full.
    """
    from transformers import StaticCache

    static = StaticCache(config=config, max_cache_len=max_cache_len)
    for src, dst in zip(cache.layers, static.layers, strict=True):
        k, v = src.keys, src.values  # [1, kv_heads, n, d]: n = seen, or a sliding layer's last window - 1
        total = k.shape[-2] if seen is None else seen
        dst.lazy_initialization(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
        cap = dst.keys.shape[-2]
        if total > max_cache_len:
            raise ValueError(f"{total} cached tokens do not fit a static cache of {max_cache_len}")
        n = min(k.shape[-2], cap)
        at = cap - n if total >= cap else 0  # full: the newest tokens at the end
        dst.keys[:, :, at:at + n] = k[:, :, -n:]
        dst.values[:, :, at:at + n] = v[:, :, -n:]
        dst.cumulative_length.fill_(total)
        if hasattr(dst, "cumulative_length_int"):
            dst.cumulative_length_int = total
    return static


def sweep(
    model,
    backends=("hf",),
    contexts=(512, 1024, 2048),
    batches=(8,),
    *,
    progress: bool = True,
    **measure_kwargs,
) -> list[dict]:
    """`measure` over backends x contexts x batch sizes (tqdm progress on stderr); one dict per run."""
    from tqdm.auto import tqdm

    combos = [(b, c, n) for b in backends for c in contexts for n in batches]
    rows = []
    bar = tqdm(combos, desc="throughput", file=sys.stderr, disable=not progress)
    for backend, context, batch in bar:
        bar.set_postfix(backend=backend, context=context, batch=batch)
        rows.append(measure(model, backend, context, batch, **measure_kwargs))
    return rows

"""A conversion's plan from the source's config alone: shapes, memory and time, before any weight is read.

`transmla convert --dry-run` prints it. Memory is what the tensors need (bytes, from the shapes; the
Python process adds ~0.5 GiB on a CPU, a CUDA context ~0.5 GiB on a GPU):

    load = model    the float32 model + the calibration hidden states (N x T x D) + one batch's
                    activations + statistics + the export copy (when the export dtype is not float32)
    load = layers   the largest of: embeddings + hidden states (start), one decoder layer in float32 +
                    its export copy + hidden states + activations + statistics (each layer), the
                    embeddings / head in the export dtype (end)

Time: multiply-adds of the calibration passes (2 x parameters x tokens per pass, attention's T^2
terms, the passes a mode makes) over a matmul rate, plus the per-layer eigendecompositions (~9 n^3 for
n x n, float64) over a float64 rate; the rates are measured on the device in about a second
(`measure_rates`) or given. An estimate to plan a run (order of magnitude), not a promise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from transmla.adapters import GQASpec
from transmla.config import REFIT_MAX_DIM, ConvertOptions
from transmla.pipeline.budget import Budget

GIB = 2**30


@dataclass
class ConversionPlan:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    parameters: int
    float32_gib: float
    qk_rope_head_dim: int
    kv_lora_rank: int
    kv_values_per_token_per_layer: dict
    kv_cache_ratio: float
    calibration_tokens: int
    passes: float
    load: str
    device: str
    peak_memory_gib: dict
    flops: dict
    rates: dict
    estimated_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def _params(spec: GQASpec) -> tuple[int, int, int]:
    """(per decoder layer, embedding table, untied lm_head) parameter counts of the original model."""
    D, h, g, d, I = spec.D, spec.h, spec.g, spec.d, spec.intermediate_size
    attn = D * h * d + 2 * D * g * d + h * d * D
    experts = (spec.moe or {}).get("num_local_experts", 1)
    mlp = 3 * D * I * experts + (D * experts if spec.moe else 0)
    layer = attn + mlp + 2 * D
    emb = spec.vocab_size * D
    return layer, emb, 0 if spec.tie_word_embeddings else emb


def measure_rates(device: str = "cpu", seconds: float = 0.5) -> dict:
    """Matmul FLOP/s (float32) and float64 eigendecomposition FLOP/s (9 n^3 per n x n) on `device`."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)  # noqa: E731
    n = 2048 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev)
    a @ a
    sync()
    t, k = time.perf_counter(), 0
    while time.perf_counter() - t < seconds / 2:
        a @ a
        k += 1
    sync()
    mm = 2 * n**3 * k / (time.perf_counter() - t)
    m = 256
    s = torch.randn(m, m, dtype=torch.float64, device=dev)
    s = s @ s.T
    torch.linalg.eigh(s)
    sync()
    t, k = time.perf_counter(), 0
    while time.perf_counter() - t < seconds / 2:
        torch.linalg.eigh(s)
        k += 1
    sync()
    eig = 9 * m**3 * k / (time.perf_counter() - t)
    return {"matmul_flops_per_s": mm, "eigh_float64_flops_per_s": eig, "measured_on": str(dev)}


def conversion_plan(spec: GQASpec, budget: Budget, o: ConvertOptions, rates: dict) -> ConversionPlan:
    """The plan of converting the model `spec` describes with options `o` (see the module docstring)."""
    n = o.normalized()
    layer, emb, head = _params(spec)
    P = spec.n_layers * layer + emb + head + spec.D
    D, T, N, bs = spec.D, o.cal_seqlen, o.cal_nsamples, o.cal_batch_size
    tokens = N * T
    out_bytes = 2 if o.dtype == "bfloat16" else 4
    hidden = tokens * D * 4 if o.streamed or o.load == "layers" else 0
    acts = bs * T * (4 * D + 2 * spec.intermediate_size + spec.h * T) * 4
    refit_dim = min(spec.h * budget.kv_lora_rank, REFIT_MAX_DIM)
    stats = (D * D + (2 * spec.g * spec.d) ** 2 * 2) * 8 + (3 * refit_dim**2 * 8 if n.refit else 0)
    z = tokens * spec.h * budget.kv_lora_rank * 4 if n.refit and spec.h * budget.kv_lora_rank <= 2 * D else 0
    mla_layer = D * spec.h * (spec.d + budget.rope_dim) + D * budget.mla_kv + budget.kv_lora_rank * spec.h * 2 * spec.d
    mla_layer += spec.h * spec.d * D + layer - (D * spec.h * spec.d + 2 * D * spec.g * spec.d + spec.h * spec.d * D)
    export_copy = (spec.n_layers * mla_layer + emb + head) * out_bytes if out_bytes != 4 else 0
    # parallel and two_pass calibration collect every layer's input statistics in one pass and hold them all
    # beside the model until the export (sequential: one layer's at a time, in `stats`)
    all_stats = spec.n_layers * (D * D + D) * 8 if n.calibration != "sequential" else 0
    in_memory = P * 4 + hidden + acts + stats + z + export_copy + all_stats
    per_layer = layer * 4 + mla_layer * out_bytes + hidden + acts + stats + z
    streamed = max(emb * 4 + hidden + acts, per_layer, (emb + head) * out_bytes + emb * 4 // 8)
    passes = {"parallel": 1.0, "two_pass": 2.0, "sequential": 1.5}[n.calibration] + (0.5 if n.refit else 0.0)
    fwd = 2 * spec.n_layers * layer * tokens + 4 * spec.n_layers * N * T * T * spec.h * spec.d
    moments = 2 * spec.n_layers * tokens * D * D
    eig_n = [D, 2 * spec.g * spec.d] + ([refit_dim] if n.refit else [])
    eig = spec.n_layers * sum(9 * k**3 for k in eig_n)
    seconds = (fwd * passes + moments) / rates["matmul_flops_per_s"] + eig / rates["eigh_float64_flops_per_s"]
    return ConversionPlan(
        model_type=spec.model_type, layers=spec.n_layers, hidden=D, heads=spec.h, kv_heads=spec.g, head_dim=spec.d,
        intermediate=spec.intermediate_size, vocab=spec.vocab_size, parameters=P, float32_gib=round(P * 4 / GIB, 3),
        qk_rope_head_dim=budget.rope_dim, kv_lora_rank=budget.kv_lora_rank,
        kv_values_per_token_per_layer={"original": budget.original_kv, "mla": budget.cached_kv},
        kv_cache_ratio=round(budget.ratio, 6), calibration_tokens=tokens, passes=passes, load=o.load, device=o.device,
        peak_memory_gib={"load_model": round(in_memory / GIB, 3), "load_layers": round(streamed / GIB, 3),
                         "this_run": round((streamed if o.load == "layers" else in_memory) / GIB, 3),
                         "hidden_states": round(hidden / GIB, 3), "one_layer_float32": round(layer * 4 / GIB, 3)},
        flops={"calibration_forward": fwd, "moments": moments, "eigendecompositions": eig},
        rates=rates, estimated_seconds=round(seconds, 1),
    )


def format_plan(p: ConversionPlan) -> str:
    m = p.peak_memory_gib
    kv = p.kv_values_per_token_per_layer
    return "\n".join([
        f"{p.model_type}: {p.layers} layers, D={p.hidden}, {p.heads} heads / {p.kv_heads} KV heads of {p.head_dim}, "
        f"MLP {p.intermediate}, vocab {p.vocab}; {p.parameters / 1e9:.2f} B parameters ({p.float32_gib:.2f} GiB in float32)",
        f"MLA: RoPE {p.qk_rope_head_dim} + latent {p.kv_lora_rank} = {kv['mla']} values per token and layer "
        f"(original {kv['original']}: {1 - p.kv_cache_ratio:.2%} smaller)",
        f"calibration: {p.calibration_tokens} tokens, ~{p.passes:g} forward passes",
        f"peak tensor memory on {p.device}: load=model {m['load_model']:.2f} GiB, load=layers {m['load_layers']:.2f} GiB "
        f"(this run: load={p.load}, {m['this_run']:.2f} GiB; hidden states {m['hidden_states']:.2f}, "
        f"one layer {m['one_layer_float32']:.2f}); the process adds ~0.5 GiB",
        f"time: ~{p.estimated_seconds:.0f} s at {p.rates['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s matmul, "
        f"{p.rates['eigh_float64_flops_per_s'] / 1e9:.1f} GFLOP/s float64 eigh ({p.rates.get('measured_on', 'given')})",
    ])

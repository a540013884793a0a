"""GQA -> MLA conversion: options, budgets, and the per-layer steps wired together.

    stats   = calibration statistics (one forward pass)          calibration.collect_stats
    per layer:
      rot   = RoRoPE + FreqFold rotation  | MHA2MLA 2-norm pick   layer_rotation
      basis = BKV alpha + joint PCA of [k_nope/alpha; v]          layer_basis
      mla   = DeepSeek-V3 attention weights                       mla.build_mla_layer
    export  = stock DeepseekV3 checkpoint                         export.write_checkpoint

Each step is a pure function of (weights, statistics, options), so the pipeline can cache it.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from transmla.adapters import AttentionWeights, GQASpec, attention_weights, read_spec, shared_state_dict
from transmla.method.bkv import JointBasis, attention_metrics, bkv_alpha, joint_basis
from transmla.method.calibration import CalibrationStats, calibration_ids, collect_stats
from transmla.errors import TransMLAError
from transmla.method.linalg import affine_second_moment
from transmla.method.mha2mla import mha2mla_selection, two_norm_scores
from transmla.method.mla import LATENT_NORM_EPS, MLALayer, build_mla_layer
from transmla.io.paths import new_output_dir
from transmla.method.rope import is_standard, lossless_plan, standard_plan
from transmla.method.rorope import KeyRotation, rorope, validate_freqfold

METHODS = ("transmla", "mha2mla")


@dataclass
class ConvertOptions:
    """Everything that defines a conversion (the CLI flags, the params YAML)."""

    method: str = "transmla"
    kv_cache_ratio: float | None = None  # shorthand: picks qk_rope_dim and kv_lora_rank
    qk_rope_dim: int | None = None
    kv_lora_rank: int | None = None
    freqfold: int = 4
    q_lora_rank: int | None = None
    balance_kv: bool = True
    attention_aware: bool = False  # our extension: PCA in the metric attention sees (bkv.attention_metrics)
    pca: str = "activations"
    lossless: bool = False
    cal_dataset: str = "wikitext2-train"
    cal_nsamples: int = 128
    cal_seqlen: int = 256
    cal_batch_size: int = 8
    seed: int = 42
    dtype: str = "float32"
    device: str = "cpu"
    # eps the target runtime uses in kv_a_layernorm: transformers 1e-6 (fixed); None = that.
    latent_norm_eps: float | None = None

    @property
    def norm_eps(self) -> float:
        return LATENT_NORM_EPS if self.latent_norm_eps is None else self.latent_norm_eps

    def validate(self) -> None:
        if self.method not in METHODS:
            raise TransMLAError(f"Unknown method {self.method!r}.", f"use one of {METHODS}.")
        if self.dtype == "float16":
            raise TransMLAError(
                "float16 cannot hold the kv_a_layernorm identity (the scaled latent underflows).",
                "use --dtype bfloat16 or float32.",
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise TransMLAError(f"Unknown dtype {self.dtype!r}.", "use float32 or bfloat16.")
        if self.pca not in ("activations", "weights"):
            raise TransMLAError(f"Unknown pca mode {self.pca!r}.", "use activations or weights.")
        if self.kv_cache_ratio is not None and not 0 < self.kv_cache_ratio <= 1:
            raise TransMLAError(f"kv_cache_ratio={self.kv_cache_ratio} is not in (0, 1].", "e.g. 0.125 for an 87.5% cut.")
        for name in ("cal_nsamples", "cal_seqlen", "cal_batch_size"):
            if getattr(self, name) < 1:
                raise TransMLAError(f"{name} must be positive.", f"set {name} >= 1.")
        if self.lossless and self.method != "transmla":
            raise TransMLAError("--lossless is a TransMLA mode.", "drop --method mha2mla or --lossless.")


@dataclass(frozen=True)
class Budget:
    """Resolved MLA shapes: RoPE plan (frequency index of each RoPE pair) and kv_lora_rank."""

    plan: tuple[int, ...]
    kv_lora_rank: int
    original_kv: int  # values cached per token per layer by the GQA model: 2 g d

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.plan)

    @property
    def mla_kv(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def ratio(self) -> float:
        return self.mla_kv / self.original_kv


def resolve_budget(spec: GQASpec, o: ConvertOptions) -> Budget:
    """Pick RoPE dim and rank from the options; one clear error for anything impossible.

    --kv-cache-ratio X: budget B = round(X * 2 g d) values per token; RoPE dim R = the largest d/c
    (c | d, R even) with R <= min(d/2, B/3), rank = B - R. This reproduces the paper's settings
    (Llama-2-7B 92.97%: R=64, r=512; SmolLM2 68.75%: R=32, r=88; 87.5%: R=16, r=32).
    """
    g, d = spec.g, spec.d
    L = g * d
    validate_freqfold(o.freqfold, d)
    if o.lossless:
        return Budget(tuple(lossless_plan(d, g)), L, 2 * L)
    R = o.qk_rope_dim
    r = o.kv_lora_rank
    if o.kv_cache_ratio is not None or (R is None and r is None):
        ratio = 0.25 if o.kv_cache_ratio is None else o.kv_cache_ratio
        B = round(ratio * 2 * L)
        if R is None:
            options = [d // c for c in range(1, d + 1) if d % c == 0 and (d // c) % 2 == 0 and d // c <= min(d // 2, B / 3)]
            if not options:
                raise TransMLAError(f"kv_cache_ratio={ratio} leaves {B} values per token: too few for any RoPE dim.",
                                    "raise --kv-cache-ratio.")
            R = max(options)
        if r is None:
            r = B - R
    elif R is None:
        R = d // 2
    elif r is None:
        r = 2 * L - R  # full rank: only RoPE is dropped
    plan = standard_plan(d, R)
    if not 1 <= r <= 2 * L - R:
        raise TransMLAError(
            f"kv_lora_rank={r} is impossible for this model: with qk_rope_head_dim={R} the NoPE keys and values "
            f"span at most 2*g*d - R = {2 * L - R} dims.",
            f"choose kv_lora_rank between 1 and {2 * L - R}.",
        )
    return Budget(tuple(plan), r, 2 * L)


def layer_rotation(w: AttentionWeights, stats: CalibrationStats, layer: int, spec: GQASpec, budget: Budget, o: ConvertOptions) -> KeyRotation:
    """Which merged-key coordinates keep RoPE: RoRoPE (+FreqFold) or MHA2MLA's 2-norm selection."""
    xx, mu = stats.second_moment(layer), stats.mean(layer)
    if o.method == "mha2mla":
        scores = two_norm_scores(w.wq, w.bq, w.wk, w.bk, xx, mu, spec.h, spec.g, spec.d)
        return mha2mla_selection(scores, spec.g, spec.d, list(budget.plan))
    cov_k = affine_second_moment(w.wk, w.bk, xx, mu)
    fold = 1 if o.lossless else o.freqfold
    return rorope(cov_k, spec.g, spec.d, list(budget.plan), fold)


def layer_basis(
    w: AttentionWeights, stats: CalibrationStats, layer: int, spec: GQASpec, rot: KeyRotation, budget: Budget, o: ConvertOptions
) -> JointBasis:
    """BKV: alpha and the joint PCA basis of [k_nope/alpha; v] (MHA2MLA: weight SVD, alpha = 1)."""
    xx = stats.second_moment(layer)
    wk_nope = rot.T[rot.rope_dim :] @ w.wk
    if o.method == "mha2mla":
        return joint_basis(wk_nope, w.wv, None, budget.kv_lora_rank, 1.0, "weights")
    mk = mv = None
    if o.attention_aware and wk_nope.shape[0] > 0:
        mk, mv = attention_metrics(w, rot.T, rot.rope_dim, xx, stats.mean(layer), spec.h, spec.g, spec.d)
    if o.balance_kv and wk_nope.shape[0] > 0:
        k_rows = wk_nope if mk is None else mk @ wk_nope
        v_rows = w.wv if mv is None else mv @ w.wv
        alpha = bkv_alpha(k_rows, v_rows, xx)
    else:
        alpha = 1.0
    return joint_basis(wk_nope, w.wv, xx, budget.kv_lora_rank, alpha, o.pca, mk, mv)


def convert_layers(model, stats: CalibrationStats, spec: GQASpec, budget: Budget, o: ConvertOptions, progress=True):
    """All layers' MLA weights and diagnostics."""
    layers, diags = [], []
    for i in tqdm(range(spec.n_layers), desc="convert", file=sys.stderr, disable=not progress):
        w = attention_weights(model, i)
        rot = layer_rotation(w, stats, i, spec, budget, o)
        basis = layer_basis(w, stats, i, spec, rot, budget, o)
        layer, diag = build_mla_layer(
            w, rot, basis, spec.h, spec.g, spec.d, stats.second_moment(i), stats.mean(i), o.q_lora_rank, o.norm_eps
        )
        layers.append(layer)
        diags.append(diag)
    return layers, diags


def assemble(model, spec: GQASpec, budget: Budget, layers: list[MLALayer], o: ConvertOptions, metadata: dict):
    """(DeepseekV3 config, state dict) for the converted model."""
    from transmla.io.export import deepseek_config

    dtype = getattr(torch, o.dtype)
    has_bias = layers[0].kv_a_bias is not None
    q_lora = layers[0].q_a_proj.shape[0] if layers[0].q_a_proj is not None else None
    config = deepseek_config(spec, list(budget.plan), budget.kv_lora_rank, q_lora, has_bias, o.dtype)
    sd = {k: v.to(dtype) for k, v in shared_state_dict(model).items()}
    for i, layer in enumerate(layers):
        sd.update(layer.state_dict(f"model.layers.{i}.self_attn.", dtype))
    return config, sd


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def convert(source: str, out: str | Path, o: ConvertOptions, cache=None, data_dir=None, progress=True) -> dict:
    """Load `source`, calibrate, convert, export to `out`. Returns the metadata written with it."""
    from transmla.io.data import load_texts
    from transmla.io.export import write_checkpoint
    from transmla.io.sources import load_model, source_info

    o.validate()
    t0 = time.perf_counter()
    out = new_output_dir(out)  # fail before any work
    info = source_info(source, cache)
    model, tok = load_model(source, dtype="float32", device=o.device, cache=cache)  # the math runs in fp32/fp64
    spec = read_spec(model.config)
    budget = resolve_budget(spec, o)
    texts = load_texts(o.cal_dataset, data_dir)
    ids = calibration_ids(tok, texts, o.cal_nsamples, o.cal_seqlen, o.seed)
    t_cal = time.perf_counter()
    stats = collect_stats(model, ids, o.cal_batch_size, progress)
    cal_seconds = time.perf_counter() - t_cal
    layers, diags = convert_layers(model, stats, spec, budget, o, progress)
    metadata = conversion_metadata(info, spec, budget, o, diags)
    config, sd = assemble(model, spec, budget, layers, o, metadata)
    metadata["calibration_seconds"] = round(cal_seconds, 2)
    metadata["seconds"] = round(time.perf_counter() - t0, 2)
    metadata["peak_rss_gib"] = round(peak_rss_gib(), 3)
    write_checkpoint(out, config, sd, tok, metadata)
    return metadata


def conversion_metadata(info: dict, spec: GQASpec, budget: Budget, o: ConvertOptions, diags: list[dict]) -> dict:
    notes = []
    if o.norm_eps != spec.rms_norm_eps:
        notes.append(
            f"kv_a_layernorm identity built for eps={o.norm_eps:g} (transformers' fixed value); a runtime that "
            f"uses config.rms_norm_eps={spec.rms_norm_eps:g} there (vLLM) needs latent_norm_eps={spec.rms_norm_eps:g}."
        )
    if any(d.get("q_bias_carrier") for d in diags):
        notes.append("q bias carried exactly by a (hidden+1)-rank q_a/q_b pair (DeepSeek's q_proj has no bias).")
    if spec.model_type == "qwen2":
        notes.append("NoPE part of the key bias dropped (shifts all scores of a query equally: softmax-invariant); "
                     "value bias moved into o_proj.bias (exact).")
    if not is_standard(list(budget.plan), spec.d):
        notes.append("non-standard RoPE frequencies exported as LongRoPE factors: transformers only, not vLLM.")
    mean = lambda k: float(sum(d[k] for d in diags) / len(diags))  # noqa: E731
    return {
        "method": o.method,
        "options": asdict(o),
        "source": info.get("source"),
        "source_content_hash": info.get("content_hash"),
        "qk_rope_head_dim": budget.rope_dim,
        "kv_lora_rank": budget.kv_lora_rank,
        "rope_frequencies": list(budget.plan),
        "kv_cache_values_per_token_per_layer": {"original": budget.original_kv, "mla": budget.mla_kv},
        "kv_cache_ratio": round(budget.ratio, 6),
        "kv_cache_reduction": round(1 - budget.ratio, 6),
        "latent_norm_eps": o.norm_eps,
        "mean_rope_energy": mean("rope_energy"),
        "mean_kv_energy": mean("kv_energy"),
        "mean_alpha": mean("alpha"),
        "layers": diags,
        "notes": notes,
    }

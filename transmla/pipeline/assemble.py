"""Step: the converted model's config and state dict, and the conversion record (config.json `transmla`)."""

from __future__ import annotations

import torch

from transmla.adapters import GQASpec, attention_weights, shared_state_dict
from transmla.config import ConvertOptions
from transmla.io.export import deepseek_config
from transmla.method.mla import MLALayer
from transmla.method.qknorm import rebase_query
from transmla.method.rope import is_standard
from transmla.pipeline.budget import Budget


def export_config(spec: GQASpec, budget: Budget, first: MLALayer, o: ConvertOptions):
    """The converted model's config (the MLA shapes; biases and q-LoRA as the built layers have them)."""
    has_bias = first.kv_a_bias is not None
    q_lora = first.q_a_proj.shape[0] if first.q_a_proj is not None else None
    return deepseek_config(spec, list(budget.plan), budget.kv_lora_rank, q_lora, has_bias, o.dtype)


def attention_state_dict(model, spec: GQASpec, i: int, layer: MLALayer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer i's MLA attention tensors under the exported names (Qwen3: the query re-based on the
    normalised raw query, raw keys for the key norm, if not done yet; needs layer i's original weights)."""
    if spec.qk_norm:
        layer = rebase_query(layer, attention_weights(model, i), spec.h, spec.d)
    return layer.state_dict(f"model.layers.{i}.self_attn.", dtype)


def assemble(model, spec: GQASpec, budget: Budget, layers: list[MLALayer], o: ConvertOptions):
    """(DeepseekV3 config, state dict) of the converted model: the MLA layers + every other tensor of `model`."""
    dtype = getattr(torch, o.dtype)
    if spec.qk_norm:  # Qwen3: queries re-based on the normalised raw query, raw keys for the key norm
        layers = [rebase_query(layer, attention_weights(model, i), spec.h, spec.d) for i, layer in enumerate(layers)]
    config = export_config(spec, budget, layers[0], o)
    sd = {k: v.to(dtype) for k, v in shared_state_dict(model).items()}
    for i, layer in enumerate(layers):
        sd.update(attention_state_dict(model, spec, i, layer, dtype))
    return config, sd


def conversion_metadata(source: dict, spec: GQASpec, budget: Budget, o: ConvertOptions, diags: list[dict],
                        calibration_tokens: int | None) -> dict:
    """The deterministic record of a conversion (no timings: an identical conversion must give an
    identical checkpoint, whose content hash keys the evaluation cache). source: {"source", "content_hash"}."""
    notes = []
    if o.norm_eps != spec.rms_norm_eps:
        notes.append(
            f"kv_a_layernorm identity built for eps={o.norm_eps:g} (transformers' fixed value); a runtime that "
            f"uses config.rms_norm_eps={spec.rms_norm_eps:g} there (vLLM) needs latent_norm_eps={spec.rms_norm_eps:g}."
        )
    if any(d.get("q_bias_carrier") for d in diags):
        notes.append("q bias carried exactly by a (hidden+1)-rank q_a/q_b pair (DeepSeek's q_proj has no bias).")
    if spec.model_type == "qwen3":
        notes.append("Qwen3 QK-norm kept exactly by transmla.models.Qwen3MLAForCausalLM (per-head query norm in the "
                     "q-LoRA path, one cached key scale per token and KV head): transformers only, not vLLM.")
    if spec.model_type == "qwen2":
        notes.append("NoPE part of the key bias dropped (shifts all scores of a query equally: softmax-invariant); "
                     "value bias moved into o_proj.bias (exact).")
    rtype = (spec.rope_parameters or {}).get("rope_type", "default")
    if rtype != "default":
        notes.append(f"the original's {rtype} RoPE scaling carried exactly: transformers only (vLLM's DeepSeek RoPE "
                     "reads any scaled RoPE as DeepSeek-YaRN).")
    if spec.model_type == "gemma3_text":
        notes.append("Gemma 3: its own decoder layers (four norms, embedding scale, per-layer-type RoPE, sliding "
                     "windows) with MLA attention, transmla.models.Gemma3MLAForCausalLM: transformers only, not vLLM.")
    elif spec.model_type == "gemma2":
        notes.append("Gemma 2: its own decoder layers (four norms, embedding scale, sliding windows, logit "
                     "soft-capping) with MLA attention, transmla.models.Gemma2MLAForCausalLM: transformers only, not vLLM.")
    elif not is_standard(list(budget.plan), spec.d):
        notes.append("non-standard RoPE frequencies exported as LongRoPE factors: transformers only, not vLLM.")
    mean = lambda k: float(sum(d[k] for d in diags) / len(diags))  # noqa: E731
    return {
        "method": o.method,
        "options": o.normalized().model_dump(),
        "source": source.get("source"),
        "source_content_hash": source.get("content_hash"),
        "qk_rope_head_dim": budget.rope_dim,
        "kv_lora_rank": budget.kv_lora_rank,
        "rope_frequencies": list(budget.plan),
        "kv_cache_values_per_token_per_layer": {"original": budget.original_kv, "mla": budget.cached_kv},
        "kv_cache_ratio": round(budget.ratio, 6),
        "kv_cache_reduction": round(1 - budget.ratio, 6),
        "latent_norm_eps": o.norm_eps,
        "mean_rope_energy": mean("rope_energy"),
        "mean_kv_energy": mean("kv_energy"),
        "mean_alpha": mean("alpha"),
        "layers": diags,
        "notes": notes,
        "calibration_tokens": calibration_tokens,
    }

"""Export: a stock DeepSeek-V3 checkpoint directory (transformers `DeepseekV3ForCausalLM`, vLLM).

Written to a temporary sibling directory and renamed into place, so a failed export never leaves a
half-written model behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from transmla.adapters import GQASpec
from transmla.io.paths import atomic_dir, new_output_dir
from transmla.method.rope import is_standard, longrope_parameters


def deepseek_config(
    spec: GQASpec, plan: list[int], kv_lora_rank: int, q_lora_rank: int | None, attention_bias: bool, dtype: str
) -> dict:
    """config.json fields for an all-dense DeepSeek-V3 model with the given MLA shapes."""
    from transformers import DeepseekV3Config

    R = 2 * len(plan)
    rope = (
        {"rope_type": "default", "rope_theta": spec.rope_theta}
        if is_standard(plan, spec.d)
        else longrope_parameters(plan, spec.rope_theta, spec.d, spec.max_position_embeddings)
    )
    cfg = DeepseekV3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.D,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.h,
        num_key_value_heads=spec.h,
        # Every layer dense; the MoE fields stay valid integers (transformers 5 rejects null).
        first_k_dense_replace=spec.n_layers,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=R,
        qk_nope_head_dim=spec.d,
        v_head_dim=spec.d,
        hidden_act=spec.hidden_act,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=attention_bias,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.dtype = dtype
    return cfg


def check_state_dict(config, state_dict: dict[str, torch.Tensor]) -> None:
    """The tensors must be exactly those of DeepseekV3ForCausalLM(config), with the same shapes."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        ref = DeepseekV3ForCausalLM(config).state_dict()
    missing = sorted(set(ref) - set(state_dict))
    extra = sorted(set(state_dict) - set(ref))
    bad = [k for k in ref if k in state_dict and tuple(ref[k].shape) != tuple(state_dict[k].shape)]
    if missing or extra or bad:
        raise RuntimeError(f"export mismatch: missing={missing[:5]} extra={extra[:5]} shape={bad[:5]}")


def instantiate(config, state_dict: dict[str, torch.Tensor]):
    """The converted model in memory (no disk round trip), as stock DeepseekV3ForCausalLM."""
    from transformers import DeepseekV3ForCausalLM

    check_state_dict(config, state_dict)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(state_dict, assign=True, strict=True)
    model.model.rotary_emb.__init__(config)  # non-persistent RoPE buffers were created on meta
    return model.eval()


def write_checkpoint(out: str | Path, config, state_dict: dict[str, torch.Tensor], tokenizer, metadata: dict) -> Path:
    """Write config + safetensors + tokenizer + metadata atomically to `out`."""
    from huggingface_hub import save_torch_state_dict

    out = new_output_dir(out)
    check_state_dict(config, state_dict)
    with atomic_dir(out) as tmp:
        config.transmla = {k: v for k, v in metadata.items() if k != "layers"}  # per-layer details: report file
        config.save_pretrained(tmp)
        save_torch_state_dict(state_dict, tmp, max_shard_size="5GB", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "transmla_report.json").write_text(json.dumps(metadata, indent=2, default=str))
    return out

"""Model classes of this package, for what stock DeepSeek checkpoints cannot express.

`Qwen3MLAForCausalLM`: MLA whose scores keep Qwen3's QK-norm exactly. Qwen3 normalises each query
head and each KV head (RMSNorm over the head dim, weights g_q, g_k) before RoPE, so a score is

    s_j(t, u) = rho_q,j(t) rho_k,i(u) <RoPE(g_q * W_q,j x_t), RoPE(g_k * W_k,i x_u)> / sqrt(d),   i = j // (h/g)
    rho(v) = 1 / sqrt(mean(v^2) + eps)  of the raw head vector (W_q,j x_t or W_k,i x_u)

The bracket is a plain GQA score with the norm weights folded into W_q, W_k: TransMLA converts it as
for Llama. The query factor lives in DeepSeek's q-LoRA path: q_a_proj = W_q (raw), q_a_layernorm = a
per-head RMSNorm with g_q (`HeadRMSNorm`), q_b_proj = each head's converted query map. The key factor
is one scalar per token and KV head, from `k_norm_proj` = W_k (raw); it is cached beside k_pe (g
values per token, next to r + R) and multiplies the keys of that head group: exact, absorb included.

`MixtralMLAForCausalLM`: DeepSeek-V3's MLA attention (the converter's output, absorb included) with
Mixtral's own sparse MoE MLP (softmax over the experts, top-k, renormalised; experts carried exactly).
No stock transformers class does both: DeepSeek-V3's router scores with a sigmoid, and transformers'
DeepSeek-V2 router never renormalises the top-k weights and always adds shared experts.

`Gemma3MLAForCausalLM` / `Gemma2MLAForCausalLM`: Gemma's own model (post-norms, (1 + w) weights,
embedding scale, sliding layers; Gemma 2's logit soft-capping) with MLA attention layers.

Importing this module registers the classes with transformers' Auto classes (no remote code):

    import transmla.models  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(converted_dir)

`load_model` (transmla.io.sources) imports it, so every loader of this package reads such exports.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3TextConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    ALL_ATTENTION_FUNCTIONS,
    DeepseekV3Attention,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as softcapped_eager_attention
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from transmla.method.rope import rope_attention_scaling


@strict
class MixtralMLAConfig(DeepseekV3Config):
    """DeepseekV3Config (MLA shapes, every layer's MLP replaced) + Mixtral's MoE fields:
    num_local_experts (= n_routed_experts), num_experts_per_tok, intermediate_size (per expert)."""

    model_type = "transmla_mixtral_mla"
    router_jitter_noise: float = 0.0


class MixtralMLAForCausalLM(DeepseekV3ForCausalLM):
    """DeepseekV3ForCausalLM whose decoder layers use MixtralSparseMoeBlock as their MLP. State dict
    names: DeepSeek-V3's for attention and norms, Mixtral's (transformers 5) for the MoE:
    model.layers.{i}.mlp.gate.weight [E, D], .mlp.experts.gate_up_proj [E, 2I, D], .mlp.experts.down_proj [E, D, I]."""

    config_class = MixtralMLAConfig

    def __init__(self, config: MixtralMLAConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = MixtralSparseMoeBlock(config)
        self.post_init()


AutoConfig.register(MixtralMLAConfig.model_type, MixtralMLAConfig, exist_ok=True)
AutoModelForCausalLM.register(MixtralMLAConfig, MixtralMLAForCausalLM, exist_ok=True)


# ----------------------------------------------------------------------------- Qwen3: QK-norm


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head of a [..., n * d] vector over its d dims, one weight [d] for all heads
    (Qwen3's q_norm / k_norm, in float32 like Qwen3RMSNorm)."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.view(*shape[:-1], -1, self.weight.shape[0]).float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * x.to(dtype)).view(shape)


@strict
class Qwen3MLAConfig(DeepseekV3Config):
    """DeepseekV3Config with q_lora_rank = h * d (the raw query) + the QK-norm's constants:
    qk_norm_groups (the original's KV heads g) and qk_norm_eps."""

    model_type = "transmla_qwen3_mla"
    qk_norm_groups: int = 1
    qk_norm_eps: float = 1e-6


class Qwen3MLAAttention(DeepseekV3Attention):
    """DeepseekV3Attention + Qwen3's QK-norm (see the module docstring). Extra weights:
    q_a_layernorm.weight [d] (g_q, a HeadRMSNorm), k_norm_proj.weight [g d, D] (W_k, raw)."""

    def __init__(self, config: Qwen3MLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.groups = config.qk_norm_groups
        d = config.qk_nope_head_dim
        self.q_a_layernorm = HeadRMSNorm(d, config.qk_norm_eps)
        self.k_norm_proj = nn.Linear(config.hidden_size, self.groups * d, bias=False)
        self.k_norm_eps = config.qk_norm_eps

    def key_scale(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """rho_k per token and KV head: 1 / rms of the raw key. [B, S, D] -> [B, S, g]"""
        k = self.k_norm_proj(hidden_states).unflatten(-1, (self.groups, -1)).float()
        return torch.rsqrt(k.pow(2).mean(-1) + self.k_norm_eps).to(hidden_states.dtype)

    def head_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """Per-group scales [B, T, g] -> per-head [B, h, T, 1] (head j uses group j // (h / g))."""
        return scale.repeat_interleave(self.num_heads // self.groups, dim=-1).transpose(1, 2).unsqueeze(-1)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        B, S = hidden_states.shape[:-1]
        r, R = self.kv_lora_rank, self.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))  # rho_q inside the HeadRMSNorm
        q = q.view(B, S, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, R], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [r, R], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, S, r)
        k_rot = k_rot.view(B, 1, S, R)
        cos, sin = position_embeddings
        rope = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin)
        # the key scales travel in the cache beside k_pe: [k_pe ; rho_k], R + g values per token
        k_rot = torch.cat([k_rot, self.key_scale(hidden_states).view(B, 1, S, self.groups)], dim=-1)
        if past_key_values is not None:
            kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, self.layer_idx)
        k_rot, scale = k_rot.split([R, self.groups], dim=-1)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)
        key_states = key_states * self.head_scale(scale[:, 0])
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, torch.cat((q_pass, q_rot), dim=-1), key_states, value_states, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(B, S, -1).contiguous()), weights


class Qwen3MLAForCausalLM(DeepseekV3ForCausalLM):
    config_class = Qwen3MLAConfig

    def __init__(self, config: Qwen3MLAConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Qwen3MLAAttention(config, i)
        self.post_init()


AutoConfig.register(Qwen3MLAConfig.model_type, Qwen3MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(Qwen3MLAConfig, Qwen3MLAForCausalLM, exist_ok=True)


# ----------------------------------------------------------------------------- Gemma 3


@strict
class Gemma3MLAConfig(Gemma3TextConfig):
    """Gemma3TextConfig (everything but attention as in the original) + the MLA attention's shapes.
    rope_plan: the original frequency index carried by each RoPE pair of the MLA head."""

    model_type = "transmla_gemma3_mla"
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    rope_plan: list[int] | None = None
    rope_interleave: bool = True
    qk_norm_groups: int = 1
    qk_norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _carry_rope_attention_scaling(attn, config) -> None:
    """Gemma MLA layers gather the original's cos/sin, which carry the attention factor m (rope_attention_scaling):
    taken out of them and put on the softmax scale as m^2, every score dimension keeps it, NoPE ones included
    (left in cos/sin, a compressed conversion of a YaRN / LongRoPE Gemma lost it on every NoPE dimension)."""
    m = rope_attention_scaling(config, attn.layer_type)
    attn.rope_attention_scaling = m
    attn.scaling = attn.scaling * m * m


class Gemma3MLAAttention(Qwen3MLAAttention):
    """MLA attention inside Gemma 3's own decoder layer (its four norms, embedding scale, per-layer-type
    RoPE and sliding windows stay Gemma's). Differences from Qwen3MLAAttention: the RoPE cos/sin are the
    original layer type's own, gathered at `rope_plan` (any base, any scaling: exact by construction);
    the softmax scale is query_pre_attn_scalar^-1/2 (the converter folds sqrt((d + R) / d) into the
    queries); sliding layers pass their window; every KV head is materialised per query head."""

    def __init__(self, config: Gemma3MLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.num_key_value_groups = 1  # expand_kv gives one key per query head
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_sliding = self.layer_type == "sliding_attention"
        d, R = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.scaling = config.query_pre_attn_scalar**-0.5 * (d / (d + R)) ** 0.5
        _carry_rope_attention_scaling(self, config)
        # a plain attribute, not a buffer: from_pretrained builds on the meta device and would not restore it
        self.rope_plan = list(config.rope_plan)

    def mla_position_embeddings(self, position_embeddings):
        """Gemma's (cos, sin) [B, S, d] (rotate_half: [f ; f]) -> the MLA head's [B, S, R] at rope_plan, without
        the RoPE attention factor (it is on self.scaling: _carry_rope_attention_scaling)."""
        cos, sin = position_embeddings
        idx = torch.tensor(self.rope_plan, device=cos.device)
        cos, sin = cos[..., idx], sin[..., idx]
        if self.rope_attention_scaling != 1.0:
            cos, sin = cos / self.rope_attention_scaling, sin / self.rope_attention_scaling
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        return super().forward(hidden_states, self.mla_position_embeddings(position_embeddings), attention_mask,
                               past_key_values, sliding_window=self.sliding_window, **kwargs)


class Gemma3MLAForCausalLM(Gemma3ForCausalLM):
    """Gemma3ForCausalLM whose attention layers are `Gemma3MLAAttention` (weights under the DeepSeek
    names: q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj,
    k_norm_proj). Not servable by vLLM (no such model there)."""

    config_class = Gemma3MLAConfig

    def __init__(self, config: Gemma3MLAConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Gemma3MLAAttention(config, i)
        self.post_init()


AutoConfig.register(Gemma3MLAConfig.model_type, Gemma3MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(Gemma3MLAConfig, Gemma3MLAForCausalLM, exist_ok=True)


# ----------------------------------------------------------------------------- Gemma 2


@strict
class Gemma2MLAConfig(Gemma2Config):
    """Gemma2Config (everything but attention as in the original: four norms, (1 + w) weights, embedding
    scale, final logit soft-capping, alternating sliding layers) + the MLA attention's shapes.
    rope_plan: the original frequency index carried by each RoPE pair of the MLA head."""

    model_type = "transmla_gemma2_mla"
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    rope_plan: list[int] | None = None
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class Gemma2MLAAttention(DeepseekV3Attention):
    """DeepSeek MLA inside Gemma 2's own decoder layer. As Gemma3MLAAttention (the original's cos/sin at
    `rope_plan`, softmax scale query_pre_attn_scalar^-1/2 with the converter's sqrt((d + R) / d) folded
    into the queries, sliding windows), without a QK-norm, plus Gemma 2's attention logit soft-capping,
    s -> c tanh(s / c): element-wise on the scores, which MLA computes exactly, so the conversion stays
    exact and absorb applies it to the latent scores. Soft-capped scores need Gemma 2's eager kernel (SDPA
    has no soft-capping; the class, like Gemma 2's, does not support it), or runtime.fast_attention's."""

    def __init__(self, config: Gemma2MLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.num_key_value_groups = 1  # expand_kv gives one key per query head
        self.layer_type = config.layer_types[layer_idx]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        d, R = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.scaling = config.query_pre_attn_scalar**-0.5 * (d / (d + R)) ** 0.5
        _carry_rope_attention_scaling(self, config)
        self.softcap = config.attn_logit_softcapping
        self.rope_plan = list(config.rope_plan)  # a plain attribute: from_pretrained builds on meta

    mla_position_embeddings = Gemma3MLAAttention.mla_position_embeddings

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        B, S = hidden_states.shape[:-1]
        r, R = self.kv_lora_rank, self.qk_rope_head_dim
        q = self.q_proj(hidden_states) if self.q_lora_rank is None else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_pass, q_rot = torch.split(q.view(B, S, -1, self.qk_head_dim).transpose(1, 2), [self.qk_nope_head_dim, R], -1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [r, R], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, S, r)
        cos, sin = self.mla_position_embeddings(position_embeddings)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(B, 1, S, R), cos, sin)
        if past_key_values is not None:
            kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, self.layer_idx)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)
        # as Gemma2Attention: the configured kernel, Gemma 2's eager (soft-capping) by default
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, softcapped_eager_attention)
        out, weights = attention(self, torch.cat((q_pass, q_rot), dim=-1), key_states, value_states, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 sliding_window=self.sliding_window, softcap=self.softcap, **kwargs)
        return self.o_proj(out.reshape(B, S, -1).contiguous()), weights


class Gemma2MLAForCausalLM(Gemma2ForCausalLM):
    """Gemma2ForCausalLM whose attention layers are `Gemma2MLAAttention` (DeepSeek weight names:
    q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj).
    Not servable by vLLM (no such model there)."""

    config_class = Gemma2MLAConfig

    def __init__(self, config: Gemma2MLAConfig):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Gemma2MLAAttention(config, i)
        self.post_init()


AutoConfig.register(Gemma2MLAConfig.model_type, Gemma2MLAConfig, exist_ok=True)
AutoModelForCausalLM.register(Gemma2MLAConfig, Gemma2MLAForCausalLM, exist_ok=True)

MODEL_TYPES = (MixtralMLAConfig.model_type, Qwen3MLAConfig.model_type, Gemma3MLAConfig.model_type,
               Gemma2MLAConfig.model_type)


def causal_lm_class(config):
    """The class that loads a converted checkpoint's config: stock DeepseekV3ForCausalLM unless the
    original needs one of this module's classes."""
    if isinstance(config, Gemma3MLAConfig):
        return Gemma3MLAForCausalLM
    if isinstance(config, Gemma2MLAConfig):
        return Gemma2MLAForCausalLM
    if isinstance(config, Qwen3MLAConfig):
        return Qwen3MLAForCausalLM
    return MixtralMLAForCausalLM if isinstance(config, MixtralMLAConfig) else DeepseekV3ForCausalLM

"""Model adapters: read a GQA model (Llama, Qwen2/3, Mistral, Mixtral, Gemma 2/3, SmolLM) into one uniform description.

Everything downstream works on `GQASpec` + per-layer `AttentionWeights`, so supporting another
architecture means adding it here, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from transmla.errors import TransMLAError

# model_type -> whether q/k/v carry biases (read from the weights anyway; this is documentation).
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True, "mixtral": False, "qwen3": False, "gemma3_text": False,
             "gemma2": False}
# Gemma 2/3: converted into this package's classes keeping Gemma's own decoder layers (transmla.models)
GEMMA = ("gemma2", "gemma3_text")

# What in each known but unsupported family stock DeepSeek MLA cannot express (or this converter does
# not carry yet): the refusal names the obstacle, not just the family.
OBSTACLES = {
    "gemma": "(1 + w) RMSNorm weights and embedding scaling by sqrt(hidden) (not carried yet)",
    "qwen2_moe": "mixture-of-experts MLP with a sigmoid-gated shared expert: no DeepSeek router computes that gate, "
                 "so it needs a model class of this package keeping Qwen2MoeSparseMoeBlock (as MixtralMLAForCausalLM "
                 "keeps Mixtral's); not built yet",
    "qwen3_moe": "per-head QK-norm and a mixture-of-experts MLP together (not carried yet)",
    "phi3": "fused qkv projection and partial rotary embeddings (not carried yet)",
}
OBSTACLES["gemma3"] = ("the multimodal Gemma 3 wrapper (vision tower + text model): only its text model "
                       "(model_type gemma3_text, e.g. Gemma-3-270M/1B) is converted")

# RoPE types whose scaling is a function of each frequency alone and needs no head-dim-dependent
# constant, so a RoPE head that keeps a subset of the frequencies can carry it exactly.
ROPE_TYPES = ("default", "linear", "llama3")


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_parameters(cfg) -> dict:
    """The config's RoPE parameters (transformers 5 `rope_parameters`, or the older rope_theta +
    rope_scaling), as one dict with at least rope_type and rope_theta."""
    rp = dict(_get(cfg, "rope_parameters", None) or _get(cfg, "rope_scaling", None) or {})
    rp.setdefault("rope_theta", _get(cfg, "rope_theta", None))
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    return rp


def warn_past_positions(cfg, seqlen: int, setting: str) -> str | None:
    """Warn (and return the text) when `seqlen`-token sequences run past the config's max_position_embeddings:
    not an error (RoPE computes any position, and extrapolation can be what is measured), but every number
    from such sequences includes positions the model was not trained on."""
    import warnings

    limit = _get(cfg, "max_position_embeddings", None)
    if not isinstance(limit, int) or seqlen <= limit:
        return None
    text = (f"transmla: {setting} {seqlen} is longer than the model's max_position_embeddings ({limit}): positions "
            f"past {limit} are extrapolated, and what is measured or fitted on them includes that.")
    warnings.warn(text, stacklevel=2)
    return text


def check_architecture(model_type: str | None) -> None:
    """Refuse a model family the converter does not handle, naming what in it is missing."""
    families = ", ".join(sorted(SUPPORTED))
    if model_type not in SUPPORTED:
        why = OBSTACLES.get(model_type)
        raise TransMLAError(
            f"Unsupported architecture {model_type!r}" + (f": {why}." if why else ".")
            + f" The converter handles {families}.",
            "convert a model of one of those families (SmolLM2 is llama; Gemma-3-270M/1B are gemma3_text).",
        )


def _slides(cfg, mt: str) -> bool:
    """Whether any layer attends through a sliding window. Qwen2/3 slide only the layers from
    max_window_layers on (config.layer_types where transformers built it), so a config with the window
    switched on may still slide none; Mistral/Mixtral slide every layer when sliding_window is set."""
    if not _get(cfg, "sliding_window", None) or not _get(cfg, "use_sliding_window", mt in ("mistral", "mixtral")):
        return False
    types = _get(cfg, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    first, n = _get(cfg, "max_window_layers", None), _get(cfg, "num_hidden_layers", None)
    return first is None or n is None or first < n


def check_counts(cfg) -> None:
    """Refuse a head, width or layer count that is present but not a positive whole number (transformers loads
    `num_key_value_heads: 0` and divides by it when it builds the model)."""
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers", "head_dim"):
        v = _get(cfg, key, None)  # absent: transformers' default
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise TransMLAError(f"The model config's {key} is {v!r}, not a positive whole number.",
                                "correct it in config.json (from the model's original release).")


def _check_number(name: str, v, floor: str) -> None:
    """A config value, when present, must be a finite number above 0 (floor "> 0") or at least 0 (">= 0")."""
    import math

    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or floor == ">= 0"
                                                                                          and v == 0)
    if v is not None and not ok:
        raise TransMLAError(f"The model config's {name} is {v!r}, not a number {floor}.",
                            "correct it in config.json (from the model's original release).")


def check_values(cfg) -> None:
    """Refuse a RoPE base or norm eps no model can have: they give NaN cos/sin (theta <= 0) or NaN norms
    (eps < 0), which surfaced as an SVD failure after the whole calibration."""
    per_type = _get(cfg, "rope_parameters", None)
    nested = isinstance(per_type, dict) and all(isinstance(v, dict) for v in per_type.values()) and per_type
    for where, rp in (per_type.items() if nested else [("", rope_parameters(cfg))]):  # Gemma 3: one per layer type
        _check_number(f"rope_theta{f' ({where})' if where else ''}", rp.get("rope_theta"), "> 0")
    # Gemma 3's sliding layers, in configs before transformers 5
    _check_number("rope_local_base_freq", _get(cfg, "rope_local_base_freq", None), "> 0")
    _check_number("rms_norm_eps", _get(cfg, "rms_norm_eps", None), ">= 0")
    if _get(cfg, "model_type", None) == "deepseek_v3":  # MLA: every query head reads the one latent, as its own head
        h, g = _get(cfg, "num_attention_heads", None), _get(cfg, "num_key_value_heads", None)
        if h is not None and g is not None and g != h:  # trained and saved fine; every forward then failed on shapes
            raise TransMLAError(f"The DeepSeek-V3 config's num_key_value_heads is {g}, not its num_attention_heads {h} "
                                "(MLA expands the latent to one key and value per query head).",
                                f"set num_key_value_heads to {h} in config.json (what the export wrote).")


def check_config(cfg) -> None:
    """Refuse, with the obstacle named, any config the converter cannot handle. Reads only config
    fields (a transformers config or a plain dict, e.g. from a GGUF header): no weights needed."""
    mt = _get(cfg, "model_type")
    check_architecture(mt)
    check_counts(cfg)
    check_values(cfg)
    h = _get(cfg, "num_attention_heads")
    g = _get(cfg, "num_key_value_heads", None) or h
    if h and g and h % g:  # every family: before the Gemma returns below (a shape error in calibration otherwise)
        raise TransMLAError(f"{h} query heads are not a multiple of {g} KV heads.", "check the model config.")
    if mt == "gemma2":  # transmla.models.Gemma2MLAForCausalLM keeps Gemma 2's layers, soft-capping included
        return
    if mt in ("qwen3", "gemma3_text") and _get(cfg, "attention_bias", False):
        raise TransMLAError(f"{mt} with attention biases is not carried yet (the QK-norm path has no q/k bias).",
                            "convert a checkpoint with attention_bias: false (every released one).")
    if mt == "gemma3_text":  # transmla.models.Gemma3MLAForCausalLM keeps Gemma's RoPE and sliding layers as they are
        # the final cap is Gemma3ForCausalLM's own (the MLA class inherits it); the attention cap is not carried
        if _get(cfg, "attn_logit_softcapping", None) is not None:
            raise TransMLAError("Gemma 3 with attn_logit_softcapping is not carried yet.",
                                "convert a checkpoint without attention soft-capping (every released Gemma 3).")
        return
    if _slides(cfg, mt):
        raise TransMLAError(
            "Sliding-window attention cannot be expressed in DeepSeek-V3 checkpoints.",
            "use a checkpoint with sliding_window: null.",
        )
    if _get(cfg, "mlp_bias", False):
        raise TransMLAError("MLP biases cannot be expressed in DeepSeek-V3 checkpoints (its MLP has none).",
                            "convert a checkpoint with mlp_bias: false.")
    rp = rope_parameters(cfg)
    if rp["rope_type"] not in ROPE_TYPES:
        reason = {
            "dynamic": "its NTK base grows with a head-dim-dependent exponent, so a RoPE head of another size "
                       "would rotate at other frequencies past the original context",
            "yarn": "its ramp bounds are rounded in units of the head dim and its attention factor scales every "
                    "score, RoPE and NoPE dimensions alike",
            "longrope": "its per-frequency factors switch with the sequence length",
        }.get(rp["rope_type"], "unknown scaling")
        raise TransMLAError(
            f"RoPE scaling type {rp['rope_type']!r} cannot be carried exactly by the converter: {reason}.",
            f"use a model whose rope_type is one of {', '.join(ROPE_TYPES)}.",
        )
    if rp["rope_theta"] is None:
        raise TransMLAError("The model config has no rope_theta.", "use a Llama/Qwen2/Mistral checkpoint.")


@dataclass(frozen=True)
class GQASpec:
    """Shapes and constants of a GQA decoder. h query heads, g KV heads, head dim d, hidden D."""

    model_type: str
    D: int
    h: int
    g: int
    d: int
    n_layers: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list | None
    pad_token_id: int | None
    # the original's RoPE parameters (rope_type, rope_theta, scaling constants); empty = plain RoPE
    rope_parameters: dict = field(default_factory=dict, hash=False)
    # Mixtral's MoE (num_local_experts, num_experts_per_tok, router_jitter_noise), carried verbatim; empty = dense
    moe: dict = field(default_factory=dict, hash=False)
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm of queries and keys before RoPE (transmla.models)
    q_bias: bool = False  # the query projection has a bias (Qwen2; attention_bias: true): queries of rank D + 1
    # Gemma 3: the original config, kept whole by the export (its layers stay Gemma's but for attention)
    original_config: dict = field(default_factory=dict, hash=False)


@dataclass
class AttentionWeights:
    """One layer's attention projections, float64. Shapes:
    wq [h*d, D], wk/wv [g*d, D], wo [D, h*d]; biases bq [h*d], bk/bv [g*d], bo [D] or None."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    # Qwen3's QK-norm: wq / wk above have the norm weights folded in (rows scaled by g_q / g_k); the raw
    # projections and the weights [d] are kept for the export's normalisation (method.qknorm)
    wq_raw: torch.Tensor | None = None
    wk_raw: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def read_spec(cfg) -> GQASpec:
    """Validate a transformers config and describe it; unsupported models get one clear error."""
    check_config(cfg)
    mt = cfg.model_type
    gemma = mt in GEMMA
    # Gemma 3: RoPE per layer type; the MLA class gathers the original's own cos/sin, so only a base is recorded
    rp = dict(cfg.rope_parameters["full_attention"]) if mt == "gemma3_text" else rope_parameters(cfg)
    h = cfg.num_attention_heads
    g = getattr(cfg, "num_key_value_heads", None) or h
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return GQASpec(
        model_type=mt, D=cfg.hidden_size, h=h, g=g, d=d, n_layers=cfg.num_hidden_layers, rope_theta=float(rp["rope_theta"]),
        rope_parameters=rp,
        rms_norm_eps=float(cfg.rms_norm_eps), vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size,
        hidden_act=getattr(cfg, "hidden_act", None) or cfg.hidden_activation,  # Gemma names it hidden_activation
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
        moe={k: getattr(cfg, k) for k in ("num_local_experts", "num_experts_per_tok", "router_jitter_noise")}
        if mt == "mixtral" else {},
        qk_norm=mt in ("qwen3", "gemma3_text"),
        q_bias=SUPPORTED.get(mt, False) or bool(getattr(cfg, "attention_bias", False)),
        original_config=cfg.to_dict() if gemma else {},
    )


def attention_weights(model, layer: int) -> AttentionWeights:
    """Float64 copies of one layer's attention projections, on the CPU wherever the model is: the per-layer
    math runs there, beside the calibration statistics."""
    attn = model.model.layers[layer].self_attn

    def w(lin):
        return lin.weight.detach().to("cpu", torch.float64).clone()

    def b(lin):
        return None if lin.bias is None else lin.bias.detach().to("cpu", torch.float64).clone()

    out = AttentionWeights(
        wq=w(attn.q_proj), wk=w(attn.k_proj), wv=w(attn.v_proj), wo=w(attn.o_proj),
        bq=b(attn.q_proj), bk=b(attn.k_proj), bv=b(attn.v_proj), bo=b(attn.o_proj),
    )
    if getattr(attn, "q_norm", None) is not None:  # Qwen3, Gemma 3: fold the norm weights into the raw projections
        gq, gk = w(attn.q_norm), w(attn.k_norm)
        if model.config.model_type == "gemma3_text":  # Gemma's RMSNorm multiplies by (1 + weight)
            gq, gk = 1 + gq, 1 + gk
        d = gq.shape[0]
        out.wq_raw, out.wk_raw, out.q_norm, out.k_norm = out.wq, out.wk, gq, gk
        out.wq = (out.wq.view(-1, d, out.wq.shape[1]) * gq[:, None]).reshape(out.wq.shape)
        out.wk = (out.wk.view(-1, d, out.wk.shape[1]) * gk[:, None]).reshape(out.wk.shape)
    return out


def shared_state_dict(model) -> dict[str, torch.Tensor]:
    """Every non-attention tensor, under names DeepSeek-V3 also uses (embeddings, norms, dense MLP).

    lm_head is always explicit: vLLM's DeepSeek model has its own lm_head, tied or not. A tied one
    shares the embedding's storage here (no copy in memory); the writer stores it under both names.
    """
    out = {}
    for name, t in model.state_dict().items():
        if ".self_attn." in name or "rotary_emb" in name:
            continue
        out[name] = t.detach()
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = model.get_output_embeddings().weight.detach()
    return out

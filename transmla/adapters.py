"""Model adapters: read a GQA model (Llama, Qwen2, Mistral, SmolLM) into one uniform description.

Everything downstream works on `GQASpec` + per-layer `AttentionWeights`, so supporting another
architecture means adding it here, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transmla.errors import TransMLAError

# model_type -> whether q/k/v carry biases (read from the weights anyway; this is documentation).
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True}


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


def _rope_params(cfg) -> tuple[float, dict | None]:
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    rtype = rp.get("rope_type", "default")
    if rtype not in ("default", None):
        raise TransMLAError(
            f"RoPE scaling type {rtype!r} is not supported by the converter yet.",
            "use a model with plain RoPE (no rope_scaling), e.g. Llama-2, Qwen2/2.5, Mistral, SmolLM2.",
        )
    if theta is None:
        raise TransMLAError("The model config has no rope_theta.", "use a Llama/Qwen2/Mistral checkpoint.")
    return float(theta), rp


def read_spec(cfg) -> GQASpec:
    """Validate a transformers config and describe it; unsupported models get one clear error."""
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED:
        raise TransMLAError(
            f"Unsupported architecture {mt!r}: the converter handles {', '.join(sorted(SUPPORTED))}.",
            "convert a Llama-, Qwen2- or Mistral-family model (SmolLM2 is llama).",
        )
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", mt == "mistral"):
        raise TransMLAError(
            "Sliding-window attention cannot be expressed in DeepSeek-V3 checkpoints.",
            "use a checkpoint with sliding_window: null.",
        )
    theta, _ = _rope_params(cfg)
    h = cfg.num_attention_heads
    g = getattr(cfg, "num_key_value_heads", None) or h
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    if h % g:
        raise TransMLAError(f"{h} query heads are not a multiple of {g} KV heads.", "check the model config.")
    return GQASpec(
        model_type=mt, D=cfg.hidden_size, h=h, g=g, d=d, n_layers=cfg.num_hidden_layers, rope_theta=theta,
        rms_norm_eps=float(cfg.rms_norm_eps), vocab_size=cfg.vocab_size, intermediate_size=cfg.intermediate_size,
        hidden_act=cfg.hidden_act, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=getattr(cfg, "eos_token_id", None),
        pad_token_id=getattr(cfg, "pad_token_id", None),
    )


def attention_weights(model, layer: int) -> AttentionWeights:
    """Float64 copies of one layer's attention projections."""
    attn = model.model.layers[layer].self_attn

    def w(lin):
        return lin.weight.detach().to(torch.float64).clone()

    def b(lin):
        return None if lin.bias is None else lin.bias.detach().to(torch.float64).clone()

    return AttentionWeights(
        wq=w(attn.q_proj), wk=w(attn.k_proj), wv=w(attn.v_proj), wo=w(attn.o_proj),
        bq=b(attn.q_proj), bk=b(attn.k_proj), bv=b(attn.v_proj), bo=b(attn.o_proj),
    )


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

"""Absorbed decoding as one native call per step: every layer of the step inside one OpenMP region.

The compiled step (`runtime.compiled_decode`) runs a decode token as ~120 calls of this project's kernels and
as many small inductor kernels, each its own fork and join of the threads, with the main thread's serial work
(the dispatcher, the graph's wrapper, dynamo's cache lookup) in between while the other threads wait. Here
`transmla::absorbed_decode_step` (csrc/native_decode.cpp) runs the whole step, from the embedded tokens to the
logits, as one parallel region whose phases are separated by barriers: the same tiled GEMM and blocked latent
attention kernels, the norms, RoPE, the latent write and the MLP's activation in between them.

It covers the common export, and says why not otherwise (`unsupported`): a stock `DeepseekV3ForCausalLM`,
absorbed (`runtime.absorb`) with the query and output folded, no query LoRA, dense SiLU MLPs (no MoE), every
linear packed with the "tiled" kernel (`runtime.packed`, AVX-512), float32 on CPU, the blocked
`StaticLatentCache` of `runtime.compiled_decode`. Everything else keeps the compiled step.

    packed.pack(model, batch=8, kernel="tiled")    # model absorbed (runtime.absorb.enable_absorb)
    step = native_step(model)
    cache = StaticLatentCache.from_latent_cache(prefilled, batch=8, capacity=4096 + 64, blocked=True)
    logits = step(next_ids, cache)                 # [B, vocab]; writes the new latents at cache.position
    cache.advance()

Logits equal the eager absorbed forward's to float32 rounding (another summation order). The step reads the
packed copies it was built with: build a new one after changing or repacking the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from transmla.errors import TransMLAError
from transmla.runtime import cpu_kernels
from transmla.runtime import packed as packing


def unsupported(model) -> str | None:
    """Why `native_step` cannot run `model` (a sentence), or None when it can."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3ForCausalLM, DeepseekV3MLP, DeepseekV3Model,
                                                                      DeepseekV3RMSNorm)

    from transmla.runtime.absorb import is_absorbed

    if type(model) is not DeepseekV3ForCausalLM or type(model.model) is not DeepseekV3Model:
        return f"it runs stock DeepseekV3ForCausalLM models, not {type(model).__name__}"
    if not (cpu_kernels.available() and cpu_kernels.has_avx512()):
        return "it needs this project's CPU kernels on an AVX-512 CPU"
    if not is_absorbed(model):
        return "the model is not absorbed (runtime.absorb.enable_absorb)"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"its MLPs use {getattr(config, 'hidden_act', None)!r}, not SiLU"
    p = next(model.parameters())
    if p.dtype != torch.float32 or p.device.type != "cpu":
        return f"it runs float32 on CPU, not {p.dtype} on {p.device.type}"
    head = getattr(model.lm_head, packing.ATTR, None)
    if getattr(head, "kernel", None) != "tiled":
        return "the linears are not packed with the 'tiled' kernel (runtime.packed.pack(model, batch, kernel='tiled'))"
    norms = [model.model.norm]
    for i, layer in enumerate(model.model.layers[: config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        norms += [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
        if type(mlp) is not DeepseekV3MLP:
            return f"layer {i}'s MLP is a {type(mlp).__name__} (mixture of experts), not a dense MLP"
        if attn.q_lora_rank is not None:
            return f"layer {i} has a query LoRA"
        if "absorb_q_weight" not in attn._buffers or "absorb_o_weight" not in attn._buffers:
            return f"layer {i}'s query or output is not folded (runtime.absorb.enable_absorb(model, fold=True))"
        if any(hasattr(attn, a) for a in ("mla_position_embeddings", "key_scale", "softcap")):
            return f"layer {i}'s attention is {type(attn).__name__} with extras (key norm, soft cap or its own RoPE)"
        q, kv = packing.packed_buffer(attn, "absorb_q_weight"), getattr(attn.kv_a_proj_with_mqa, packing.ATTR, None)
        gate, up = getattr(mlp.gate_proj, packing.ATTR, None), getattr(mlp.up_proj, packing.ATTR, None)
        if not (packing.one_group(q, kv) and packing.one_group(gate, up)):
            return f"layer {i}'s query and kv_a, or gate and up, are not packed as one tiled group"
        if q.group.offsets[0] != 0 or gate.group.offsets[0] != 0:
            return f"layer {i}'s tiled groups are not in the order the step reads"
        if {getattr(getattr(mlp.down_proj, packing.ATTR, None), "kernel", None),
                getattr(packing.packed_buffer(attn, "absorb_o_weight"), "kernel", None)} != {"tiled"}:
            return f"layer {i}'s folded output or down projection is not packed with the 'tiled' kernel"
    if any(type(n) is not DeepseekV3RMSNorm for n in norms):
        return "a norm is not DeepseekV3RMSNorm"
    return None


def _or_empty(t: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if t is None else t.detach().contiguous()


def layer_tensors(layer: nn.Module) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """One decoder layer's operands of `transmla::absorbed_decode_step`, in its order: the tensors (input norm,
    fused query/kv_a tiles and bias, latent norm, folded output tiles and bias, post-attention norm, fused
    gate/up tiles and bias, down tiles and bias; empty where no bias), the ints (kv_a's and up's first columns
    in their fused outputs, the intermediate size) and the floats (the three norms' eps, the softmax scale)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = packing.packed_buffer(attn, "absorb_q_weight").group
    gu = getattr(mlp.gate_proj, packing.ATTR).group
    down = getattr(mlp.down_proj, packing.ATTR)
    o = packing.packed_buffer(attn, "absorb_o_weight")
    tensors = [layer.input_layernorm.weight, qkv.data, qkv.bias, attn.kv_a_layernorm.weight, o.data, attn.o_proj.bias,
               layer.post_attention_layernorm.weight, gu.data, gu.bias, down.data, mlp.down_proj.bias]
    ints = [qkv.offsets[1], gu.offsets[1], mlp.down_proj.in_features]
    floats = [layer.input_layernorm.variance_epsilon, attn.kv_a_layernorm.variance_epsilon,
              layer.post_attention_layernorm.variance_epsilon, attn.scaling]
    return [_or_empty(t) for t in tensors], ints, [float(f) for f in floats]


def native_step(model: nn.Module):
    """A decode step of `model` as one `transmla::absorbed_decode_step` call: step(ids [B, 1], cache) -> logits
    [B, vocab], writing the new latents at `cache.position` (a blocked float32 `StaticLatentCache` of B rows);
    call `cache.advance()` after it, as with `compiled_decode.compiled_step`. Raises TransMLAError naming the
    fix when `unsupported(model)` says why not, and at a call when the cache is not blocked or full."""
    why = unsupported(model)
    if why is not None:
        raise TransMLAError(f"The native decode step cannot run this model: {why}.",
                            "decode with the compiled step (throughput.native_decode: false).")
    inner, config = model.model, model.config
    layers = inner.layers[: config.num_hidden_layers]
    weights, ints, floats = [], [], []
    for layer in layers:
        t, i, f = layer_tensors(layer)
        weights += t
        ints += i
        floats += f
    attn = layers[0].self_attn
    head = getattr(model.lm_head, packing.ATTR)
    constants = dict(final_norm=inner.norm.weight.detach(), head=head.data, head_bias=_or_empty(model.lm_head.bias),
                     heads=attn.num_heads, rank=attn.kv_lora_rank, rope_dim=attn.qk_rope_head_dim,
                     vocab=model.lm_head.out_features, rope_interleave=bool(config.rope_interleave),
                     final_eps=float(inner.norm.variance_epsilon))
    op = torch.ops.transmla.absorbed_decode_step

    @torch.no_grad()
    def step(ids: torch.Tensor, cache) -> torch.Tensor:
        if not cache.blocked or cache.buffers[0].dtype != torch.float32:
            raise TransMLAError("The native decode step reads a blocked float32 StaticLatentCache.",
                                "make it with StaticLatentCache.from_latent_cache(..., blocked=True) from a float32 model.")
        cache.check_room()
        x = inner.embed_tokens(ids).reshape(ids.shape[0], -1)  # [B, D]
        cos, sin = inner.rotary_emb(x, cache.position.view(1, 1))  # [1, 1, R] each
        return op(x, weights, cache.buffers, ints, floats, cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(),
                  position=int(cache.position), **constants)

    return step

"""Absorbed MLA decoding for exported DeepSeek-V3 checkpoints (the paper's "Absorb" operation).

Stock transformers `DeepseekV3Attention` re-expands the latent through `kv_b_proj` into per-head keys
and values for every cached token at every step (transformers 5.23 caches the latent but repeats this
O(T) up-projection every step; earlier versions cached the expanded heads; `throughput.hf_mla_cache_layout()`
probes the installed one). The
absorbed form never materialises per-head keys or values. Per head i (shapes for h heads, NoPE dim
dn, value dim dv, RoPE dim R, latent rank r):

    k_i = [W_UK_i c ; k_pe]   W_UK_i = kv_b_proj rows of head i's key    [dn, r]
    v_i = W_UV_i c            W_UV_i = kv_b_proj rows of head i's value  [dv, r]

    score_i(t) = q_nope_i . W_UK_i c_t + q_rope_i . k_pe_t = [W_UK_i^T q_nope_i ; q_rope_i] . [c_t ; k_pe_t]
    out_i      = sum_t p_t W_UV_i c_t = W_UV_i (sum_t p_t c_t)

so attention runs MQA-like over one shared (r + R)-dim "key" [c_t ; k_pe_t] per token, the same
vector serves as the value (its first r coordinates), W_UK is folded into the query projection and
W_UV into `o_proj`. The cache holds exactly r + R values per token per layer: c after
`kv_a_layernorm`, k_pe after RoPE.

Usage (in place; `disable_absorb` restores the stock forward):

    model = AutoModelForCausalLM.from_pretrained(dir)       # DeepseekV3ForCausalLM
    enable_absorb(model)
    out = model.generate(ids, max_new_tokens=64, past_key_values=LatentCache(model.config))

Built on transformers' extension points: an instance-level forward on each `DeepseekV3Attention`
that reads that module's own weights (plus absorbed matrices precomputed once and kept as
non-persistent buffers, so `state_dict`/`save_pretrained` are unchanged), and a `Cache` subclass.
The absorbed matrices are a snapshot: call `enable_absorb` again after changing the weights.
Supported masks: those of the `sdpa` and `eager` attention implementations (None, bool or additive
float [B, 1, S, T]); left padding works through them.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from transmla.errors import TransMLAError
from transmla.runtime import packed as packing
from transmla.runtime.cpu_kernels import unblock_latent
from transmla.runtime.latent_decode import additive_mask

_BUFFERS = ("absorb_q_weight", "absorb_w_uk", "absorb_o_weight", "absorb_w_uv")


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


class LatentLayer(CacheLayerMixin):
    """One layer's latent cache: a buffer [batch, capacity, r + R] holding [c_kv ; k_pe] per token.

    The first `length` positions are valid. The buffer is preallocated (`max_cache_len`, when known) or
    grows geometrically, so an append writes S rows in place instead of re-concatenating the whole
    cache every step as `DynamicLayer` does. `keys`/`values` are views [batch, 1, length, r] and
    [batch, 1, length, R] so generic transformers code (and the stock forward) sees the usual layout.
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.buffer: torch.Tensor | None = None  # [B, capacity, r + R]
        self.length = 0
        self.rank = 0  # r: the first r coordinates are c_kv, the rest k_pe

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states [B, 1, S, r] (c_kv), value_states [B, 1, S, R] (k_pe): only shapes/dtype are read."""
        self._allocate(key_states.shape[0], key_states.shape[-1], value_states.shape[-1], key_states.dtype, key_states.device, 0)

    def _allocate(self, batch: int, r: int, R: int, dtype, device, need: int) -> None:
        cap = max(need, self.max_cache_len or 0, 1)
        self.buffer = torch.empty(batch, cap, r + R, dtype=dtype, device=device)
        self.rank, self.length = r, 0
        self.dtype, self.device = dtype, device
        self.is_initialized = True
        self._sync_views()

    def _reserve(self, need: int) -> None:
        """Room for `need` tokens; grows by >= 1.5x (amortised O(1) per token) beyond the preallocation."""
        cap = self.buffer.shape[1]
        if need <= cap:
            return
        new = torch.empty(self.buffer.shape[0], max(need, cap + cap // 2, 64), self.buffer.shape[2],
                          dtype=self.buffer.dtype, device=self.buffer.device)
        new[:, : self.length] = self.buffer[:, : self.length]
        self.buffer = new

    def _sync_views(self) -> None:
        valid = self.buffer[:, None, : self.length]  # [B, 1, T, r + R]
        self.keys, self.values = valid[..., : self.rank], valid[..., self.rank :]

    def _ready(self, batch: int, r: int, R: int, dtype, device, S: int) -> None:
        # (Re)allocate when empty: first use, or reuse after reset() with another batch size, dtype or device (the
        # model moved or was cast in between: latents cast silently into the old buffer failed later in SDPA).
        if not self.is_initialized or (self.length == 0 and (tuple(self.buffer.shape[::2]) != (batch, r + R)
                                                             or self.buffer.dtype != dtype
                                                             or self.buffer.device != torch.device(device))):
            self._allocate(batch, r, R, dtype, device, S)
        elif self.buffer.dtype != dtype or self.buffer.device != torch.device(device):
            raise TransMLAError(f"This LatentCache holds {self.length} {self.buffer.dtype} tokens on {self.buffer.device}; "
                                f"the model now makes {dtype} latents on {device}.",
                                "reset() the cache (or make a new LatentCache) after casting or moving the model.")

    def append(self, latent: torch.Tensor, rank: int) -> torch.Tensor:
        """latent [B, S, r + R] with r = rank -> all cached [B, T, r + R] (a view; T = previous length + S)."""
        B, S, E = latent.shape
        self._ready(B, rank, E - rank, latent.dtype, latent.device, S)
        self._reserve(self.length + S)
        self.buffer[:, self.length : self.length + S] = latent
        self.length += S
        self._sync_views()
        return self.buffer[:, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """The stock (non-absorbed) forward's call: key_states = c_kv [B, 1, S, r], value_states = k_pe
        [B, 1, S, R] -> all cached (c_kv [B, 1, T, r], k_pe [B, 1, T, R]) as views."""
        S = key_states.shape[-2]
        self._ready(key_states.shape[0], key_states.shape[-1], value_states.shape[-1], key_states.dtype, key_states.device, S)
        self._reserve(self.length + S)
        self.buffer[:, self.length : self.length + S, : self.rank] = key_states[:, 0]
        self.buffer[:, self.length : self.length + S, self.rank :] = value_states[:, 0]
        self.length += S
        self._sync_views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows without bound; max_cache_len is only the preallocation

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._sync_views()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove (transformers convention).")
        if tokens_to_remove and self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._sync_views()

    def _reindex(self, fn) -> None:
        if self.is_initialized:
            rows = fn(self.buffer[:, : self.length])
            # into a buffer of the old capacity: keeping only the valid tokens would make the next append
            # reallocate and copy the whole cache (the first timed step of a decode_step run)
            self.buffer = rows.new_empty(rows.shape[0], self.buffer.shape[1], rows.shape[2])
            self.buffer[:, : self.length] = rows
            self._sync_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(lambda b: b.index_select(0, beam_idx.to(b.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex(lambda b: b.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(lambda b: b[indices])

    def offload(self):
        if self.is_initialized:
            self.buffer = self.buffer.to("cpu", non_blocking=True)
            self._sync_views()

    def prefetch(self):
        if self.is_initialized and self.buffer.device != self.device:
            self.buffer = self.buffer.to(self.device, non_blocking=True)
            self._sync_views()

    # accounting
    def nbytes(self) -> int:
        """Bytes of the valid tokens: B * length * (r + R) * itemsize."""
        if not self.is_initialized:
            return 0
        return self.buffer.shape[0] * self.length * self.buffer.shape[2] * self.buffer.element_size()

    def allocated_nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()


class LatentCache(Cache):
    """A transformers `Cache` holding only the MLA latent [c_kv ; k_pe] per token and layer.

    Args:
        config (`DeepseekV3Config`, *optional*): creates one layer per `num_hidden_layers` up front;
            without it layers are created on first use.
        max_cache_len (`int`, *optional*): tokens to preallocate per layer (e.g. prompt + new tokens);
            the cache still grows past it.

    Works with the absorbed forward (`enable_absorb`, one write of [B, S, r + R] per layer) and with
    the stock DeepseekV3 forward (which calls `update(c_kv, k_pe)`), in `model(...)` and `generate`.
    """

    def __init__(self, config=None, max_cache_len: int | None = None):
        layer = functools.partial(LatentLayer, max_cache_len=max_cache_len)
        if config is not None:
            n = config.get_text_config(decoder=True).num_hidden_layers
            super().__init__(layers=[layer() for _ in range(n)])
        else:
            super().__init__(layer_class_to_replicate=layer)
        self._max_cache_len = max_cache_len

    # A property, not an attribute: some transformers versions (5.17) define a read-only
    # Cache.max_cache_len, and assigning to it raised in __init__.
    @property
    def max_cache_len(self) -> int | None:
        return self._max_cache_len

    def update_latent(self, latent: torch.Tensor, layer_idx: int, rank: int) -> torch.Tensor:
        """Append latent [B, S, r + R] (r = rank) to layer `layer_idx`; returns all cached [B, T, r + R]."""
        while len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class_to_replicate())
        return self.layers[layer_idx].append(latent, rank)

    def values_per_token_per_layer(self) -> list[int]:
        """Values stored per token in each initialised layer, read from the tensors (r + R each)."""
        return [layer.buffer.shape[-1] for layer in self.layers if layer.is_initialized]

    def values_per_token(self) -> int:
        """Values stored per token over all layers: n_layers * (kv_lora_rank + qk_rope_head_dim)."""
        return sum(self.values_per_token_per_layer())

    def nbytes(self) -> int:
        """Bytes of the cached tokens (all layers, all sequences); excludes preallocated slack."""
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Bytes per cached token of one sequence (all layers)."""
        first = next((layer for layer in self.layers if layer.is_initialized and layer.length), None)
        if first is None:
            return 0.0
        return self.nbytes() / (first.buffer.shape[0] * first.length)


# --------------------------------------------------------------------------------------------------
# Absorbed attention
# --------------------------------------------------------------------------------------------------


def _check_deepseek(model) -> list[nn.Module]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    mods = [m for m in model.modules() if isinstance(m, DeepseekV3Attention)]
    if not mods:
        raise TransMLAError(
            f"{type(model).__name__} has no DeepseekV3Attention layers: Absorb needs an MLA (DeepSeek-V3) model.",
            "convert the model first (transmla convert) or use the 'hf' backend.",
        )
    return mods


@torch.no_grad()
def _precompute(attn: nn.Module, fold: bool | None) -> None:
    """Absorbed matrices of one DeepseekV3Attention, computed in float64 and stored in the weights' dtype.

    absorb_q_weight [h (r + R), D_q]  per head [W_UK_i^T W_Qnope_i ; W_Qrope_i]   (folded query)
    absorb_w_uk     [h, dn, r]        W_UK per head                               (unfolded query)
    absorb_o_weight [D, h r]          per head block W_O,i W_UV_i                 (folded output)
    absorb_w_uv     [h, r, dv]        W_UV_i^T per head                           (unfolded output)

    Folding is a trade: it removes a per-head matmul but the folded matrix is larger when r > dn (or
    r > dv); fold=None picks the cheaper form per token by multiply-adds.
    """
    h, dn, dv, R, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    dtype = attn.kv_b_proj.weight.dtype
    kv_b = attn.kv_b_proj.weight.double().view(h, dn + dv, r)
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]  # [h, dn, r], [h, dv, r]
    q_lin = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj  # no bias in DeepSeek-V3
    Dq = q_lin.in_features
    D = attn.o_proj.out_features
    fold_q = fold if fold is not None else h * (r + R) * Dq <= h * (dn + R) * Dq + h * dn * r
    fold_o = fold if fold is not None else D * h * r <= h * r * dv + D * h * dv
    for name in _BUFFERS:
        attn._buffers.pop(name, None)
        packing.drop_packed_buffer(attn, name)  # a packed copy (runtime.packed) of the old matrix
    if fold_q:
        wq = q_lin.weight.double().view(h, dn + R, Dq)
        q_lat = torch.einsum("hdr,hdi->hri", w_uk, wq[:, :dn])  # [h, r, Dq]
        attn.register_buffer("absorb_q_weight", torch.cat([q_lat, wq[:, dn:]], 1).reshape(h * (r + R), Dq).to(dtype), persistent=False)
    else:
        attn.register_buffer("absorb_w_uk", w_uk.to(dtype).contiguous(), persistent=False)
    if fold_o:
        wo = attn.o_proj.weight.double().view(D, h, dv)
        attn.register_buffer("absorb_o_weight", torch.einsum("ohv,hvr->ohr", wo, w_uv).reshape(D, h * r).to(dtype), persistent=False)
    else:
        attn.register_buffer("absorb_w_uv", w_uv.transpose(1, 2).to(dtype).contiguous(), persistent=False)


# Single-token decode attention over the latent: "sdpa" (one fused call, heads folded into the query
# axis), "bmm" (two batched matmuls) or "triton" (transmla.runtime.latent_decode: split-K, the latent
# read once; its PyTorch form off CUDA); all exact. "auto" picks per device and shape from measurements
# (reports/throughput/gpu, H200, Llama-2-7B shape, graph-timed, one layer): bmm beat SDPA's one-head
# kernel at every context; the Triton kernel beats bmm once the batch's cache is large (88 vs 124 us
# at batch 16, 8K; 1.32 vs 3.00 ms at batch 425, 8K) but not at batch 16, 1K (35 vs 21 us).
# "cpu": this project's C++ kernel (transmla.runtime.cpu_kernels.latent_decode, float32), which reads
# the latent once with every head's dot product from one load of each key: on the 2-core EPYC of
# reports/throughput, 30 layers of batch 8 x 4106 keys in 29.6 ms against 46.4 ms for SDPA's CPU flash
# kernel; "auto" takes it on CPU where it is built, SDPA otherwise. Over the compiled step's blocked
# static cache (runtime.compiled_decode) "cpu" is its blocked form, transmla::latent_decode_blocked_cpu.
DECODE_KERNEL = "auto"
DECODE_KERNELS = ("auto", "sdpa", "bmm", "triton", "cpu")
# what "triton" runs where the Triton kernel cannot (off CUDA without Triton's interpreter, or no triton):
# the same split-K attention in PyTorch (latent_decode_torch), reported under its own name so a row never
# says "triton" for a run the Triton kernel took no part in
SPLITK_TORCH = "splitk_torch"
# "auto" on CUDA: the Triton kernel from this many cached tokens in the batch (B x T), bmm below
AUTO_TRITON_MIN_TOKENS = 32768


def decode_kernel(device: torch.device, batch: int = 1, length: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """The single-token kernel `latent_attention` uses on `device` for `batch` sequences of `length`
    cached tokens of `dtype`: "sdpa", "bmm", "triton", "cpu" or `SPLITK_TORCH` ("triton" asked for where
    the Triton kernel does not run)."""
    from transmla.runtime import cpu_kernels

    if DECODE_KERNEL not in DECODE_KERNELS:
        raise TransMLAError(f"Unknown absorb decode kernel {DECODE_KERNEL!r}.", f"use one of {DECODE_KERNELS}.")
    if DECODE_KERNEL == "cpu" and (device.type != "cpu" or dtype != torch.float32 or not cpu_kernels.available()):
        raise TransMLAError(f"The 'cpu' decode kernel runs float32 on a CPU with AVX2 where it could be built, "
                            f"not {dtype} on {device.type}.", "use DECODE_KERNEL 'auto'.")
    from transmla.runtime import latent_decode

    if DECODE_KERNEL == "triton":  # the name of what latent_decode will dispatch to on this device
        return "triton" if latent_decode.runs_triton(device) else SPLITK_TORCH
    if DECODE_KERNEL != "auto":
        return DECODE_KERNEL
    if device.type != "cuda":
        return "cpu" if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available() else "sdpa"
    return "triton" if batch * length >= AUTO_TRITON_MIN_TOKENS and latent_decode.triton_available() else "bmm"


def _mask_to(attention_mask, T: int):
    """The sdpa / eager 4D mask cut to the last T keys; anything else (a flash-attention 2D padding mask, which
    would broadcast against the wrong axes) is refused."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise TransMLAError(
            f"Absorb got an attention mask of type {type(attention_mask).__name__}"
            f"{'' if not isinstance(attention_mask, torch.Tensor) else f' with {attention_mask.dim()} dims'}: "
            "only sdpa/eager 4D masks are supported.",
            "load the model with attn_implementation='sdpa' (the default) or 'eager'.",
        )
    return attention_mask[..., -T:] if attention_mask.shape[-1] != T else attention_mask


def latent_attention(query: torch.Tensor, latent: torch.Tensor, attention_mask, scaling: float, rank: int,
                     q_offset: int | None = None) -> torch.Tensor:
    """Softmax attention of all heads over one shared latent key; the value is the key's first `rank` dims.

    Args:
        query (`torch.Tensor` of shape `[B, h, S, r + R]`): absorbed queries [W_UK^T q_nope ; q_rope].
        latent (`torch.Tensor` of shape `[B, T, r + R]`): cached [c_kv ; k_pe], queries are its last S tokens;
            or `[B, T / 16, r + R, 16]`, a blocked static cache (`runtime.compiled_decode`).
        attention_mask: None (causal: query s is the cache's token q_offset + s; one query sees every key),
            bool `[B, 1, S, T]` (True = attend) or additive float `[B, 1, S, T]`, as transformers' sdpa / eager
            mask functions build them.
        scaling (`float`): the module's softmax scale.
        rank (`int`): r.
        q_offset (`int`, *optional*): tokens cached before these queries; None: T - S (the latent holds the
            written tokens only). An empty preallocated StaticCache returns all its slots: 0 there.
    Returns:
        `torch.Tensor` of shape `[B, h, S, r]`: sum_t p_t c_t per head.
    """
    B, h, S, E = query.shape
    if latent.dim() == 4:  # runtime.compiled_decode's blocked static cache [B, T / 16, E, 16]
        T = latent.shape[1] * latent.shape[3]
        kernel = decode_kernel(query.device, B, T, query.dtype) if S == 1 else None
        if kernel == "cpu":
            from transmla.runtime.cpu_kernels import latent_decode_blocked

            return latent_decode_blocked(query.reshape(B, h, E), latent, additive_mask(attention_mask, None, T),
                                         scaling, rank).view(B, h, 1, rank)
        latent = unblock_latent(latent)  # another kernel: the rows (a copy)
    T = latent.shape[1]
    key = latent.unsqueeze(1)  # [B, 1, T, E]
    attention_mask = _mask_to(attention_mask, T)
    # The value is the key itself (its first r dims are c): equal q/k/v widths keep SDPA on its fused
    # kernel on CPU (a narrower value falls back to the slow math kernel); the extra R columns of
    # output are dropped.
    kernel = decode_kernel(query.device, B, T, query.dtype) if S == 1 else None
    if kernel == "cpu":
        from transmla.runtime.cpu_kernels import latent_decode

        return latent_decode(query.reshape(B, h, E), latent, additive_mask(attention_mask, None, T), scaling,
                             rank).view(B, h, 1, rank)
    if kernel == "bmm":
        # Decode as two batched matmuls over the latent: scores [B, h, T] = q [B, h, E] x latent^T, then
        # p x latent[:, :, :r]; no kernel dispatch on a one-head SDPA. The scale goes in as the GEMM's alpha,
        # applied before its output is rounded to the input dtype: a raw float16 score past 65504 is inf.
        scores = torch.baddbmm(query.new_zeros(()), query.view(B, h, E), latent.transpose(1, 2), beta=0.0,
                               alpha=scaling).float()
        if attention_mask is not None:
            m = attention_mask.view(B, 1, T) if attention_mask.shape[0] == B else attention_mask.view(1, 1, T)
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
        p = torch.softmax(scores, dim=-1).to(latent.dtype)
        return torch.bmm(p, latent[..., :rank]).view(B, h, 1, rank)
    if kernel == "triton":
        from transmla.runtime.latent_decode import latent_decode

        return latent_decode(query.view(B, h, E), latent, rank, scaling, attention_mask).view(B, h, 1, rank)
    if kernel == SPLITK_TORCH:
        from transmla.runtime.latent_decode import latent_decode_torch

        return latent_decode_torch(query.view(B, h, E), latent, rank, scaling, attention_mask).view(B, h, 1, rank)
    if S == 1:
        # Decode: fold the heads into the query-length axis of a single KV head (MQA). One [h, E] x
        # [E, T] product per sequence reads the cache once; a [B, 1, 1, T] mask broadcasts over heads.
        out = F.scaled_dot_product_attention(query.view(B, 1, h, E), key, key, attn_mask=attention_mask, scale=scaling)
        return out[..., :rank].view(B, h, 1, rank)
    # Prefill / multi-token: heads stay heads; the single latent head is broadcast (stride 0, no copy).
    key = key.expand(B, h, T, E)
    is_causal = False
    if attention_mask is None:
        off = T - S if q_offset is None else int(q_offset)
        if off == 0:  # SDPA's is_causal counts from the first key: T == S, or an empty StaticCache's prefill
            is_causal = True
        else:  # query s is the cache's token off + s
            pos = torch.arange(S, device=query.device)[:, None] + off
            attention_mask = (pos >= torch.arange(T, device=query.device)[None, :])[None, None]
    out = F.scaled_dot_product_attention(query, key, key, attn_mask=attention_mask, is_causal=is_causal, scale=scaling)
    return out[..., :rank]


def scaled_latent_attention(query: torch.Tensor, latent: torch.Tensor, key_scale: torch.Tensor | None, attention_mask,
                            scaling: float, rank: int, softcap: float | None = None,
                            q_offset: int | None = None) -> torch.Tensor:
    """`latent_attention` with every score of head j and key t multiplied by key_scale[j, t] (Qwen3's key
    norm) and/or soft-capped, s -> softcap tanh(s / softcap) (Gemma 2), as two batched matmuls over the latent.

    Args:
        query `[B, h, S, r + R]`, latent `[B, T, r + R]`, key_scale `[B, h, T, 1]` or None, attention_mask,
        scaling and q_offset as in `latent_attention`, rank r, softcap (optional).
    Returns:
        `torch.Tensor` of shape `[B, h, S, r]`.
    """
    B, h, S, _ = query.shape
    T = latent.shape[1]
    # float16 scores in float32: a raw score q.k can pass 65504 where the scaled one does not (inf, then NaN), and
    # a key scale below 1 (Qwen3's key norm of a large key) can bring a product past the range back into it
    q, lat = (query.float(), latent.float()) if query.dtype == torch.float16 else (query, latent)
    scores = torch.matmul(q * scaling, lat.unsqueeze(1).transpose(-1, -2)).float()  # [B, h, S, T]
    if key_scale is not None:
        scores = scores * key_scale.transpose(-1, -2).float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:  # causal, query s at the cache's token q_offset + s (as in latent_attention)
        off = T - S if q_offset is None or S == 1 else int(q_offset)
        pos = torch.arange(S, device=query.device)[:, None] + off
        attention_mask = (pos >= torch.arange(T, device=query.device)[None, :])[None, None]
    else:
        attention_mask = _mask_to(attention_mask, T)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        # A left-padded query row attends nothing: softmax of all -inf is NaN, which the next layer's latent
        # would carry into every later token; stock SDPA gives such a row zeros, and so does this.
        p = p.masked_fill(~attention_mask.any(dim=-1, keepdim=True), 0.0).to(latent.dtype)
    else:
        p = torch.softmax(scores + attention_mask.float(), dim=-1).to(latent.dtype)
    return torch.matmul(p, latent[..., :rank].unsqueeze(1))  # [B, h, S, r]


def absorbed_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Drop-in forward for a `DeepseekV3Attention` module (bound as an instance method).

    Args:
        hidden_states (`torch.Tensor` of shape `[B, S, D]`)
        position_embeddings (`tuple(torch.Tensor)`): (cos, sin) `[B, S, R]` from the model's rotary embedding.
        attention_mask: the model's causal mask (see `latent_attention`).
        past_key_values (`Cache`, *optional*): a `LatentCache` or `runtime.compiled_decode.StaticLatentCache`
            (one write per layer: `update_latent`), or any cache with the
            stock DeepseekV3 latent layout (`update(c_kv [B, 1, S, r], k_pe [B, 1, S, R])`).
    Returns:
        (`torch.Tensor` of shape `[B, S, D]`, None) - attention weights are never materialised.
    """
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

    B, S, _ = hidden_states.shape
    h, r, R, dn = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim
    if hasattr(self, "mla_position_embeddings"):  # Gemma 2/3 (transmla.models): the original's cos/sin at the RoPE plan
        position_embeddings = self.mla_position_embeddings(position_embeddings)

    # Queries, absorbed: [W_UK^T q_nope ; q_rope] per head.
    x_q = hidden_states if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden_states))
    kv_a, compressed = self.kv_a_proj_with_mqa, None
    if "absorb_q_weight" in self._buffers:
        q_pack, kv_pack = packing.packed_buffer(self, "absorb_q_weight"), getattr(kv_a, packing.ATTR, None)
        if packing.one_group(q_pack, kv_pack):  # packed as one weight (both read the hidden state): one kernel call
            q, compressed = packing.linears(x_q, [(self.absorb_q_weight, None, q_pack), (kv_a.weight, kv_a.bias, kv_pack)])
        else:
            q = packing.linear(x_q, self.absorb_q_weight, None, q_pack)
        q = q.reshape(B, S, h, r + R).transpose(1, 2)  # [B, h, S, r + R]
        q_lat, q_rot = q.split([r, R], dim=-1)
    else:
        q_lin = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        q = q_lin(x_q).view(B, S, h, dn + R).transpose(1, 2)  # [B, h, S, dn + R]
        q_nope, q_rot = q.split([dn, R], dim=-1)
        # per-head product as an einsum: matmul would broadcast W_UK into a copy per sequence and step
        q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, self.absorb_w_uk)  # [B, h, S, r]

    # The latent exactly as the stock module builds it: c after kv_a_layernorm, k_pe after RoPE.
    if compressed is None:
        compressed = kv_a(hidden_states)  # [B, S, r + R]
    c_kv, k_rot = compressed.split([r, R], dim=-1)
    c_kv = self.kv_a_layernorm(c_kv)
    cos, sin = position_embeddings
    rope = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rope(q_rot, k_rot.view(B, 1, S, R), cos, sin)
    # Qwen3 (transmla.models.Qwen3MLAAttention): one key scale per token and KV head, cached after k_pe
    scale = self.key_scale(hidden_states) if hasattr(self, "key_scale") else None  # [B, S, g]
    k_rot = k_rot.view(B, S, R) if scale is None else torch.cat([k_rot.view(B, S, R), scale], dim=-1)
    latent = torch.cat([c_kv, k_rot], dim=-1)  # [B, S, r + R (+ g)]

    q_offset = None  # the latent holds the written tokens only (T - S before these queries)
    if hasattr(past_key_values, "update_latent"):  # a LatentCache, or runtime.compiled_decode's static one
        latent = past_key_values.update_latent(latent, self.layer_idx, r)  # [B, T, r + R (+ g)]
    elif past_key_values is not None:  # e.g. a DynamicCache: stock layout, joined here
        if attention_mask is None and S > 1:  # causal from what this layer cached before: a StaticCache returns
            q_offset = past_key_values.get_seq_length(self.layer_idx)  # every slot, written or not
        c_all, k_all = past_key_values.update(c_kv.view(B, 1, S, r), k_rot.unsqueeze(1), self.layer_idx)
        latent = torch.cat([c_all[:, 0], k_all[:, 0]], dim=-1)

    query = torch.cat([q_lat, q_rot], dim=-1)  # [B, h, S, r + R]
    softcap = getattr(self, "softcap", None)  # Gemma 2 (transmla.models.Gemma2MLAAttention)
    if latent.dim() == 4 and (scale is not None or softcap is not None):  # a blocked static cache: rows for these
        latent = unblock_latent(latent)
    if scale is None and softcap is None:
        out = latent_attention(query, latent, attention_mask, self.scaling, r, q_offset)  # [B, h, S, r]
    elif scale is None:
        out = scaled_latent_attention(query, latent, None, attention_mask, self.scaling, r, softcap, q_offset)
    else:
        latent, scale = latent.split([r + R, scale.shape[-1]], dim=-1)
        out = scaled_latent_attention(query, latent, self.head_scale(scale), attention_mask, self.scaling, r, softcap,
                                      q_offset)

    # Values, absorbed: W_UV folded into o_proj (or applied per head on the r-dim result).
    if "absorb_o_weight" in self._buffers:
        out = packing.linear(out.transpose(1, 2).reshape(B, S, h * r), self.absorb_o_weight, self.o_proj.bias,
                             packing.packed_buffer(self, "absorb_o_weight"))
    else:
        out = torch.einsum("bhsr,hrv->bhsv", out, self.absorb_w_uv)  # [B, h, S, dv], no W_UV copy per sequence
        out = self.o_proj(out.transpose(1, 2).reshape(B, S, -1))
    return out, None


def enable_absorb(model, fold: bool | None = None):
    """Switch every DeepseekV3Attention of `model` to the absorbed forward, in place; returns `model`.

    Args:
        model: a `DeepseekV3ForCausalLM` (or anything containing `DeepseekV3Attention` modules).
        fold (`bool`, *optional*): fold W_UK into the query projection and W_UV into o_proj (True),
            apply them per head (False), or choose per layer by multiply-add count (None, default).
    Calling it again recomputes the absorbed matrices (after a weight change). The default cache of
    `model(...)`/`generate` (DynamicCache) keeps working; pass `LatentCache(model.config)` for the
    in-place latent cache. Raises `TransMLAError` for models without MLA layers.
    """
    for attn in _check_deepseek(model):
        _precompute(attn, fold)
        attn.forward = types.MethodType(absorbed_forward, attn)
    return model


def disable_absorb(model):
    """Restore the stock forward and drop the absorbed matrices; returns `model`."""
    for attn in _check_deepseek(model):
        attn.__dict__.pop("forward", None)
        for name in _BUFFERS:
            attn._buffers.pop(name, None)
            packing.drop_packed_buffer(attn, name)
    return model


def _fold_of(model) -> bool | None:
    """The `fold` argument that rebuilds an absorbed model's form: True / False when the query and output are
    both folded / both not, None (the per-shape choice, the only source of a mix) otherwise."""
    attn = next(iter(_check_deepseek(model)))
    q, o = "absorb_q_weight" in attn._buffers, "absorb_o_weight" in attn._buffers
    return q if q == o else None


def is_absorbed(model) -> bool:
    return any("forward" in m.__dict__ and getattr(m.forward, "__func__", None) is absorbed_forward for m in model.modules())


@contextlib.contextmanager
def absorbed(model, enabled: bool = True, fold: bool | None = None):
    """Context manager: the model absorbed (enabled=True) or stock (False) inside, as before after.

    An absorbed model made stock inside is absorbed again after in the form it had (folded or not), its
    matrices recomputed from the weights as they are then; packed copies of them (`runtime.packed`) are not
    kept: pack again."""
    was = is_absorbed(model)
    if enabled and not was:
        enable_absorb(model, fold)
    elif not enabled and was:
        fold = _fold_of(model)
        disable_absorb(model)
    try:
        yield model
    finally:
        if was and not enabled:
            enable_absorb(model, fold)
        elif enabled and not was:
            disable_absorb(model)

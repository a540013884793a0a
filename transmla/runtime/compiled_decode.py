"""Absorbed decoding as one compiled graph per step: static latent buffers and torch.compile.

An absorbed decode step on CPU is a few hundred small kernels (per layer: norms, RoPE, the latent
write, the attention, the folded projections, the MLP). In eager mode each pays PyTorch's dispatch
and an MKL call that repacks its weight; together that is about as long as the step's real work. Here the
step runs the model's own modules (embedding, rotary embedding, every decoder layer with the absorbed
attention of `runtime.absorb`, the final norm and head) over a `StaticLatentCache`: one buffer
[B, capacity, r + R] per layer, written at a position held in a tensor, attended over its whole
capacity with an additive mask. Every step then has the same shapes, so `torch.compile` traces it once
and one graph serves every step; with inductor's `freezing` the weights become constants that it
prepacks for its GEMMs and the elementwise work between them is fused. Measured on this project's
CPU (2 threads, SmolLM2-135M at 87.5%, batch 8, 4K context): eager 122 ms per step, eager on
`runtime.packed` weights 83 ms, compiled 67 ms; compiling takes about a minute, once per batch size
(the cache's capacity is a dynamic dimension: one graph serves every context length). On a CPU whose
decode kernels are built the buffers are blocked, [B, capacity / 16, r + R, 16] (16 tokens per block,
each latent dim's 16 values contiguous), the layout `cpu_kernels.latent_decode_blocked` scores 16 keys
per FMA from; a token is written as one strided column of its block.

    cache = StaticLatentCache.from_latent_cache(prefilled_latent_cache, batch=8, capacity=4096 + 64)
    step = compiled_step(model)                   # model absorbed (runtime.absorb.enable_absorb)
    logits = step(next_ids, cache)                # [B, vocab]; writes the new latents at cache.position
    cache.advance()

Greedy tokens equal the eager absorbed forward's (another summation order: logits agree to float32
rounding). The compiled graph holds the weights it saw: compile again after changing them.
"""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo.config as dynamo_config
import torch._dynamo.exc as dynamo_exc
import torch._inductor.config as inductor_config
from torch import nn

from transmla.errors import TransMLAError
from transmla.runtime import cpu_kernels


class StaticLatentCache:
    """The MLA latent [c_kv ; k_pe] of every layer in fixed buffers, for a compiled decode step.

    Args:
        buffers: one `torch.Tensor` per layer, [B, capacity, r + R] (rows) or [B, capacity / 16, r + R, 16]
            (blocked: `cpu_kernels.block_latent`'s layout, which `cpu_kernels.latent_decode_blocked`
            reads); the first `length` positions hold the cached tokens.
        length (`int`): cached tokens; the next step writes at this position.

    `position` is a 0-dim int64 tensor (not a Python int), so the compiled step reads it as data and
    one graph serves every position. `absorbed_forward` calls `update_latent`, as it does on a
    `LatentCache`; the returned buffer is the whole capacity and `attention_mask` hides the positions
    beyond the current token.
    """

    def __init__(self, buffers: list[torch.Tensor], length: int):
        if not buffers:
            raise TransMLAError("A StaticLatentCache needs one buffer per layer, got none.", "pass the model's layers' latents.")
        self.blocked = buffers[0].dim() == 4
        capacity = buffers[0].shape[1] * (buffers[0].shape[3] if self.blocked else 1)
        if not 0 <= length <= capacity:
            raise TransMLAError(f"A static latent cache of capacity {capacity} cannot take a token at position {length}.",
                                "allocate capacity for the prompt plus every new token.")
        for buf in buffers:  # one graph for every capacity (context length) instead of a compile per length
            torch._dynamo.mark_dynamic(buf, 1)
        self.buffers = buffers
        self.position = torch.tensor(length, dtype=torch.long, device=buffers[0].device)

    @classmethod
    @torch.no_grad()
    def from_latent_cache(cls, cache, batch: int, capacity: int, blocked: bool | None = None) -> StaticLatentCache:
        """The tokens of a prefilled `LatentCache` in new buffers of `capacity` tokens, each sequence of
        the cache repeated to `batch` rows (batch must be a multiple of the cache's batch). blocked: the
        blocked layout (capacity rounded up to whole blocks); None = where the absorbed attention reads it
        (`blocked_layout`: float32 on a CPU whose decode kernels are built). The step gives the whole batch one
        position and masks only what lies past it, so the cached sequences must be unpadded: a prefill of
        one sequence (as the throughput stage makes) or of sequences of one length."""
        layers = [layer for layer in cache.layers if layer.is_initialized]
        if not layers or len(layers) != len(cache.layers):
            raise TransMLAError("The latent cache to copy has uninitialised layers.", "prefill it first (one forward over the prompt).")
        src_batch, length = layers[0].buffer.shape[0], layers[0].length
        if batch < 1 or batch % src_batch:
            raise TransMLAError(f"Cannot repeat a cache of {src_batch} sequences to {batch}.", "use a positive batch that is a multiple of it.")
        if capacity <= length:
            raise TransMLAError(f"Capacity {capacity} leaves no room after the {length} cached tokens.",
                                "allocate capacity for the prompt plus every new token.")
        first = layers[0].buffer
        if blocked is None:
            blocked = blocked_layout(first.device, first.dtype)
        if blocked:  # whole blocks, at least 2: dynamo specialises a dynamic dimension of size 1 (a graph more)
            capacity = max(2, -(-capacity // cpu_kernels.BLOCK)) * cpu_kernels.BLOCK
        buffers = []
        for layer in layers:
            src = layer.buffer[:, :length]
            buf = torch.zeros(batch, capacity, src.shape[-1], dtype=src.dtype, device=src.device)
            # a fresh tensor (not an inference-mode one): the compiled step writes into it in place
            buf[:, :length] = src.repeat_interleave(batch // src_batch, dim=0)
            buffers.append(cpu_kernels.block_latent(buf) if blocked else buf)
        return cls(buffers, length)

    @property
    def capacity(self) -> int:
        b = self.buffers[0]
        return b.shape[1] * b.shape[3] if self.blocked else b.shape[1]

    def update_latent(self, latent: torch.Tensor, layer_idx: int, rank: int) -> torch.Tensor:
        """Write latent [B, 1, r + R] at `position` of layer `layer_idx`; returns the whole buffer
        ([B, capacity, r + R], or blocked [B, capacity / 16, r + R, 16])."""
        buf = self.buffers[layer_idx]
        if self.blocked:
            # token p, dim e sits at flat offset (p // 16) * E * 16 + e * 16 + p % 16 of its sequence
            B, _, E, blk = buf.shape
            base = torch.div(self.position, blk, rounding_mode="floor") * (E * blk) + self.position % blk
            idx = base + blk * torch.arange(E, device=buf.device)
            buf.view(B, -1).index_copy_(1, idx, latent.reshape(B, E))
        else:
            buf.index_copy_(1, self.position.view(1), latent)
        return buf

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [1, 1, 1, capacity]: 0 up to and including `position`, -inf beyond."""
        t = torch.arange(self.capacity, device=self.position.device)
        return torch.zeros(self.capacity, dtype=dtype, device=t.device).masked_fill(t > self.position, float("-inf")).view(1, 1, 1, -1)

    def advance(self, tokens: int = 1) -> None:
        """Move past the token(s) just written (in place: the compiled graph keeps reading the same tensor)."""
        self.position += tokens

    def get_seq_length(self) -> int:
        return int(self.position)

    def nbytes(self) -> int:
        """Bytes of the cached tokens (all layers and sequences); excludes the unused capacity."""
        n = int(self.position)
        return sum(b.shape[0] * n * b.shape[2 if self.blocked else -1] * b.element_size() for b in self.buffers)

    def check_room(self) -> None:
        """Raise TransMLAError when no position is left to write (the compiled graph does not bounds-check)."""
        if int(self.position) >= self.capacity:
            raise TransMLAError(f"The static latent cache is full ({self.capacity} tokens).",
                                "allocate capacity for the prompt plus every new token.")


def blocked_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a static cache on `device` of `dtype` is kept blocked: where the absorbed attention reads it
    with `cpu_kernels.latent_decode_blocked` (float32 on a CPU whose kernels are built, the decode kernel
    "cpu" or "auto")."""
    from transmla.runtime import absorb

    return (device.type == "cpu" and dtype == torch.float32 and absorb.DECODE_KERNEL in ("auto", "cpu")
            and cpu_kernels.available())


def decode_step(model: nn.Module, ids: torch.Tensor, cache: StaticLatentCache) -> torch.Tensor:
    """One token per sequence through an absorbed DeepseekV3ForCausalLM, the latents written to `cache`.

    Args:
        model: a `DeepseekV3ForCausalLM` with `runtime.absorb` enabled.
        ids (`torch.LongTensor` of shape `[B, 1]`): the tokens at `cache.position`.
        cache (`StaticLatentCache`): B rows.
    Returns:
        `torch.Tensor` of shape `[B, vocab]`: next-token logits.

    DeepseekV3Model.forward's body, with the mask and positions taken from the static cache instead of
    transformers' mask functions (which need a `Cache`).
    """
    inner = model.model
    x = inner.embed_tokens(ids)  # [B, 1, D]
    position_ids = cache.position.view(1, 1).expand(ids.shape[0], 1)
    position_embeddings = inner.rotary_emb(x, position_ids)
    mask = cache.attention_mask(x.dtype)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                  position_embeddings=position_embeddings)
    return model.lm_head(inner.norm(x))[:, -1]


def check_compilable(model: nn.Module) -> None:
    """Raise TransMLAError unless `model` is a stock DeepseekV3ForCausalLM with Absorb enabled."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Model

    from transmla.runtime.absorb import is_absorbed

    if type(model) is not DeepseekV3ForCausalLM or type(model.model) is not DeepseekV3Model:
        raise TransMLAError(f"The compiled decode step runs stock DeepseekV3ForCausalLM models, got {type(model).__name__}.",
                            "decode this model eagerly (throughput.compiled_decode: false).")
    if not is_absorbed(model):
        raise TransMLAError("The compiled decode step needs the absorbed model.", "call transmla.runtime.absorb.enable_absorb(model) first.")


_GRAPHS_DROPPED = [0]  # times decode_step's compiled graphs were dropped (dynamo's recompile limit reached)


def compiled_step(model: nn.Module, freezing: bool = True, gemm: str = "mkl"):
    """`decode_step` compiled by torch.compile (inductor, static shapes); call it under torch.no_grad().

    freezing: inductor treats the weights as constants (prepacked GEMMs; the graph keeps the weights it
    saw). gemm: the prepacked kernel of the frozen linears (`runtime.packed`: "mkl", inductor's choice
    at a static batch, or "onednn", its choice when the batch is a dynamic dimension, so "onednn" marks
    the batch of the ids and of the cache dynamic; `packed.fastest_kernel` says which is faster on this
    CPU; or "stream" / "tiled", `runtime.cpu_kernels`'s kernels (`packed.OP_KERNELS`): the model must be
    packed with it, `packed.pack(model, batch, kernel=gemm)`, so that every linear is one call of that
    operator in the graph, which inductor keeps as it is). The first call compiles (about a minute for a
    30-layer model on 2 CPU cores); a new batch size compiles again ("mkl", "stream", "tiled"), a new capacity does not
    (it is marked dynamic). A call whose inputs (`call_signature`) have run before skips dynamo's guard
    evaluation, so a model changed after the first call needs a new step (its frozen graph holds the old
    weights in any case). Every step shares decode_step's graphs (a sweep compiles once per batch size, not
    per cell); when dynamo's recompile_limit is reached, they are all dropped and the call compiles, never
    running eagerly. Raises TransMLAError when `check_compilable` fails, gemm is not one of
    `packed.KERNELS` or, for "stream" and "tiled", the model is not packed with it.
    """
    from transmla.runtime import cpu_kernels
    from transmla.runtime.packed import ATTR, KERNELS, OP_KERNELS

    check_compilable(model)
    cpu_kernels.available()  # built (or found missing) now, not while the graph is traced
    if gemm not in KERNELS:
        raise TransMLAError(f"Unknown GEMM kernel {gemm!r} for the compiled decode step.", f"use one of {KERNELS}.")
    if gemm in OP_KERNELS:
        kinds = {getattr(getattr(m, ATTR, None), "kernel", None) for m in model.modules() if isinstance(m, nn.Linear)}
        if kinds != {gemm}:
            raise TransMLAError(f"gemm={gemm!r} compiles that kernel's calls, but the model's linears are not packed with it.",
                                f"call transmla.runtime.packed.pack(model, batch, kernel={gemm!r}) first.")
    compiled = torch.compile(decode_step, dynamic=False)
    seen: set[tuple] = set()  # the call signatures (`call_signature`) a graph was compiled for
    generation = _GRAPHS_DROPPED[0]  # `seen` holds only while decode_step's graphs have not been dropped since

    def run(ids, cache, skip_guards: bool):
        with torch.no_grad(), inductor_config.patch(freezing=freezing, cpp_wrapper=gemm in OP_KERNELS), \
                dynamo_config.patch(fail_on_recompile_limit_hit=True), \
                torch.compiler.set_stance(skip_guard_eval_unsafe=True) if skip_guards else contextlib.nullcontext():
            return compiled(model, ids, cache)

    def step(ids: torch.Tensor, cache: StaticLatentCache) -> torch.Tensor:
        # freezing patched around every call, not passed as a compile option: inductor reads it when
        # it compiles, which is at the first call and at every recompile (torch.compile's `options`
        # did not reach it here: 111 ms per step unfrozen vs 69 ms frozen, SmolLM2 87.5%, 4K).
        # cpp_wrapper, on this project's kernels: the graph's ~300 kernel and operator calls made from C++,
        # not from a Python wrapper (2-4 ms less per step of 60-68 ms, same logits, two runs side by
        # side, SmolLM2 87.5%, batch 8, 4K). The MKL and oneDNN graphs keep the Python wrapper: from C++ inductor
        # calls their linears past the profiler, which is how one sees which of the two it chose.
        cache.check_room()
        if gemm == "onednn":  # a symbolic batch: inductor lowers the frozen linears to oneDNN, not MKL
            torch._dynamo.mark_dynamic(ids, 0)
            for buf in cache.buffers:
                torch._dynamo.mark_dynamic(buf, 0)
        # A signature that has run before reuses its graph without dynamo's guard evaluation, which
        # walks the model's modules and parameters on every call: about 1 ms of a 31-32 ms step (median
        # of 8 alternations in one process, SmolLM2 87.5%, batch 8, 4K, 2 threads). Skipping is safe only
        # for inputs a graph was compiled for, so the step checks those itself (`call_signature`); a new
        # one runs with the guards, which compile it. What the signature leaves out is the model, which
        # the frozen graph holds anyway: compile again after changing it.
        nonlocal generation
        if generation != _GRAPHS_DROPPED[0]:
            seen.clear()
            generation = _GRAPHS_DROPPED[0]
        sig = call_signature(ids, cache)
        try:
            logits = run(ids, cache, skip_guards=sig in seen)
        except dynamo_exc.FailOnRecompileLimitHit:
            # Every step compiles the one decode_step, and dynamo keeps its graphs per code object: a process
            # that made steps for more input signatures (a sweep's batch sizes) than its recompile_limit (8)
            # would have this call run eagerly, with a log line only. Drop all of decode_step's graphs
            # instead (steps still in use compile theirs again) and compile this one.
            torch._dynamo.reset_code(decode_step.__code__)
            _GRAPHS_DROPPED[0] += 1
            seen.clear()
            generation = _GRAPHS_DROPPED[0]
            logits = run(ids, cache, skip_guards=False)
        seen.add(sig)
        return logits

    return step


def call_signature(ids: torch.Tensor, cache: StaticLatentCache) -> tuple:
    """What of a compiled step's inputs can change from call to call and select another graph: the ids'
    and every latent buffer's shape (the capacity, a dynamic dimension, only as "one" or "more": dynamo
    specialises a size of 1), strides, dtype and device, the layout and the position's; and the module
    settings the trace reads (`absorb.DECODE_KERNEL`, whether the CPU kernels are built, the kernel it
    resolves to at this batch and capacity), which dynamo would otherwise guard on."""
    from transmla.runtime import absorb

    def tensor(t: torch.Tensor, dynamic: int | None = None) -> tuple:
        shape = tuple(min(n, 2) if i == dynamic else n for i, n in enumerate(t.shape))
        # the strides outside a dynamic dimension scale with it: whether the tensor is contiguous instead
        stride = t.stride() if dynamic is None else (t.is_contiguous(), t.stride()[dynamic:])
        return shape, stride, t.dtype, t.device, t.requires_grad

    # the kernel `auto` picks at this batch and capacity (on a GPU it switches from bmm to Triton with B x T): a
    # graph traced for one must not serve the other
    kernel = absorb.decode_kernel(ids.device, ids.shape[0], cache.capacity, cache.buffers[0].dtype)
    return (tensor(ids), cache.blocked, tensor(cache.position),
            tuple(tensor(b, dynamic=1) for b in cache.buffers), absorb.DECODE_KERNEL, cpu_kernels.available(), kernel)

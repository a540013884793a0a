"""Split-K (flash-decoding) attention of all heads over one shared latent: the absorbed decode step.

After Absorb (paper section 4.3) every query head attends to the same cached latent [c_kv ; k_pe]
(one "KV head" of width r + R whose first r dims are also the value). A decode step must read that
latent once; SDPA with one KV head leaves about B thread blocks for a whole GPU, and two batched
matmuls read it twice and round-trip the scores through memory in float32. Here the cache of each
sequence is cut into `num_splits` chunks along T; one Triton program per (sequence, chunk) loads its
tiles once, computes all heads' scores with a tensor-core dot, keeps the online softmax (running
max m, sum l) and the value accumulator in registers, and writes (m, l, acc) for its chunk; the
chunks are then merged exactly:

    out_j = sum_s exp(m_s,j - M_j) acc_s,j / sum_s exp(m_s,j - M_j) l_s,j,   M_j = max_s m_s,j

How many chunks: `choose_splits`, a wave model over the programs the GPU holds at once (read from the
compiled kernel's registers and shared memory). Product form: with few sequences the kernel computes
the transposed products (tokens and rank as the tensor cores' M dimension instead of the 32 heads).
The chunk length is a run-time argument, so one compiled kernel serves every length (CUDA graphs,
torch.compile), and the kernel is the custom op transmla::latent_decode for torch.compile.

`latent_decode` runs the Triton kernel for CUDA tensors (or in Triton's interpreter when
TRITON_INTERPRET=1, which is how the tests check the kernel on a CPU) and otherwise the same split /
merge in plain PyTorch (`latent_decode_torch`), the fallback and the tests' second reference.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

DEFAULT_BLOCK_T = 64
# Launch parameters of the Triton kernel (tokens per tile, warps, pipeline stages, the programs per SM
# assumed before the compiled kernel's own occupancy is known, product form: None = transposed
# products up to SWAP_MAX_BATCH sequences); measured per GPU with scripts/decode_gpu.py --kernel-bench
# (reports/throughput/gpu).
TUNING = {"block_t": DEFAULT_BLOCK_T, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2, "swap": None}
SWAP_MAX_BATCH = 64
# A program's fixed cost in tiles' worth of time: loading the queries, writing its (m, l, acc) partials
# and the merge reading them back (acc is h x r float32 per chunk, about one 64-token tile of latent).
OVERHEAD_TILES = 2
# Resident programs per (device index, compiled variant), read from the compiled kernel's registers and
# shared memory after its first launch.
_RESIDENT: dict = {}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_triton(device) -> bool:
    """Whether `latent_decode` runs the Triton kernel for tensors on `device` (CUDA, or Triton's interpreter),
    rather than its PyTorch form: one test for the dispatch and for the kernel name a run reports."""
    return (torch.device(device).type == "cuda" or _interpret()) and triton_available()


@functools.lru_cache(maxsize=4096)
def choose_splits(batch: int, length: int, block_t: int, resident: int) -> int:
    """Chunks per sequence that minimise the kernel's time under a wave model.

    `resident` programs run at once; B x S programs of c = ceil(tiles / S) tiles each take
    ceil(B x S / resident) waves of (c + OVERHEAD_TILES) tile-times. More chunks shorten the programs
    but add waves and partials to merge; ties go to fewer chunks. Every chunk holds at least one tile.
    """
    tiles = max(1, math.ceil(length / block_t))
    best, best_cost = 1, None
    for s in range(1, tiles + 1):
        c = math.ceil(tiles / s)
        s_eff = math.ceil(tiles / c)
        if s_eff != s:  # same chunking as a smaller s
            continue
        cost = math.ceil(batch * s / max(resident, 1)) * (c + OVERHEAD_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
        if batch * s >= 4 * max(resident, 1):  # past a few waves more chunks only add waves
            break
    return best


def _chunk_tiles(length: int, splits: int, block_t: int) -> int:
    """Tiles per chunk: the `splits` chunks cover the cache, each a whole number of tiles."""
    return max(1, math.ceil(math.ceil(length / block_t) / max(splits, 1)))


def resident_programs(compiled, device: torch.device, num_warps: int) -> int | None:
    """Programs of a compiled Triton kernel that fit on the device at once (its occupancy x SMs), from
    the kernel's registers per thread and shared memory and the device's per-SM limits; None when the
    compiled kernel does not say."""
    try:
        props = torch.cuda.get_device_properties(device)
        regs = getattr(compiled, "n_regs", None)
        shared = getattr(compiled, "shared", None)
        if shared is None:
            shared = getattr(getattr(compiled, "metadata", None), "shared", None)
        if not regs:
            return None
        threads = num_warps * 32
        limits = [getattr(props, "max_threads_per_multi_processor", 2048) // threads,
                  getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads)]
        smem = getattr(props, "shared_memory_per_multiprocessor", 0)
        if shared and smem:
            limits.append(smem // shared)
        return max(1, min(limits)) * props.multi_processor_count
    except Exception:  # noqa: BLE001 - occupancy is an optimisation; the TUNING guess stays
        return None


def additive_mask(mask: torch.Tensor | None, B: int | None, T: int) -> torch.Tensor | None:
    """A [B, 1, 1, T'] (or [1, 1, 1, T']) bool (True = attend) or additive mask as float32 [B, T] (its last T
    columns); B None keeps a shared mask [1, T] as it is (the CPU kernels broadcast it)."""
    if mask is None:
        return None
    m = mask.reshape(mask.shape[0], -1)[:, -T:]
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    else:
        m = m.float()
    return m.expand(B, T) if B is not None and m.shape[0] != B else m


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Exact merge of per-chunk softmax partials.

    Args: m, l `[B, h, S]` (running max and sum per chunk), acc `[B, h, S, r]` (unnormalised).
    Returns: `[B, h, r]` float32. A chunk that saw only masked tokens (m = -inf) weighs zero.
    The chunk axis is next to r, so the weighted sum over chunks is one batched [1, S] x [S, r]
    product that reads acc once (no weighted copy of it).
    """
    if m.shape[-1] == 1:  # one chunk: only the normalisation
        return acc[..., 0, :] / l
    M = m.amax(dim=-1, keepdim=True)  # [B, h, 1]
    w = torch.exp(m - M.masked_fill(torch.isinf(M), 0.0))  # exp(-inf) = 0 for empty chunks
    num = torch.matmul(w.unsqueeze(-2), acc).squeeze(-2)  # [B, h, r]
    return num / (l * w).sum(dim=-1, keepdim=True)


def latent_decode_torch(query: torch.Tensor, latent: torch.Tensor, rank: int, scaling: float,
                        mask: torch.Tensor | None = None, num_splits: int = 1, block_t: int = DEFAULT_BLOCK_T) -> torch.Tensor:
    """The kernel's algorithm in PyTorch: per-chunk (m, l, acc) in float32, then `merge_splits`.

    Args:
        query `[B, h, E]` (E = r + R), latent `[B, T, E]`, rank r, scaling (softmax scale),
        mask: None or `[B|1, 1, 1, T]` bool / additive; num_splits: chunks along T.
    Returns: `[B, h, r]` in the query's dtype.
    """
    B, h, E = query.shape
    T = latent.shape[1]
    add = additive_mask(mask, B, T)
    chunk = _chunk_tiles(T, num_splits, block_t) * block_t
    q = query.float()
    ms, ls, accs = [], [], []
    for t0 in range(0, T, chunk):
        k = latent[:, t0 : t0 + chunk].float()  # [B, c, E]
        s = torch.bmm(q, k.transpose(1, 2)) * scaling  # [B, h, c]
        if add is not None:
            s = s + add[:, None, t0 : t0 + chunk]
        m = s.amax(-1)  # [B, h]
        p = torch.exp(s - m.masked_fill(torch.isinf(m), 0.0).unsqueeze(-1))
        ms.append(m)
        ls.append(p.sum(-1))
        accs.append(torch.bmm(p, k[..., :rank]))  # [B, h, r]
    out = merge_splits(torch.stack(ms, -1), torch.stack(ls, -1), torch.stack(accs, -2))
    return out.to(query.dtype)


def _kernel():
    """The Triton kernel, imported on first use (triton is optional: the PyTorch form runs without it)."""
    from transmla.runtime.latent_decode_triton import latent_decode_kernel

    return latent_decode_kernel


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def variant_key(rank: int, rope: int, heads: int, block_t: int, num_warps: int, num_stages: int, swap: bool,
                has_mask: bool) -> tuple:
    """What makes one compiled kernel variant (the occupancy record `_RESIDENT` is kept per variant)."""
    return (rank, rope, heads, block_t, num_warps, num_stages, bool(swap), bool(has_mask))


def _resident(device: torch.device, key: tuple) -> int:
    """Programs resident at once for the compiled variant `key`: measured occupancy once known, else the
    TUNING guess (programs_per_sm x SMs; 4 programs in the interpreter)."""
    if device.type != "cuda":
        return 4
    got = _RESIDENT.get((device.index, key))
    if got:
        return got
    return TUNING["programs_per_sm"] * torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> dict:
    """The kernel's launch option for its products: IEEE float32 for float32 inputs (exact as the PyTorch forms),
    Triton's default (the tensor cores' native precision) for bfloat16 / float16."""
    return {"default_dot_input_precision": "ieee"} if dtype == torch.float32 else {}


def latent_decode_triton(query: torch.Tensor, latent: torch.Tensor, rank: int, scaling: float,
                         mask: torch.Tensor | None = None, num_splits: int | None = None,
                         block_t: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                         swap: bool | None = None) -> torch.Tensor:
    """`latent_decode_torch`'s result from the Triton kernel (same arguments; num_splits None = the wave
    model's choice for the device; launch parameters and product form None = `TUNING`)."""
    block_t = block_t or TUNING["block_t"]
    num_warps = num_warps or TUNING["num_warps"]
    num_stages = num_stages or TUNING["num_stages"]
    B, h, E = query.shape
    T = latent.shape[1]
    R = E - rank
    if swap is None:
        swap = TUNING["swap"] if TUNING["swap"] is not None else B <= SWAP_MAX_BATCH
    if query.stride(-1) != 1 or latent.stride(-1) != 1:
        raise ValueError("latent_decode_triton needs the last dimension of query and latent contiguous.")
    interpret = _interpret()
    key = variant_key(rank, R, h, block_t, num_warps, num_stages, swap, mask is not None)
    if num_splits is None:
        num_splits = choose_splits(B, T, block_t, _resident(query.device, key))
    tiles = _chunk_tiles(T, num_splits, block_t)
    S = math.ceil(math.ceil(T / block_t) / tiles)
    add = additive_mask(mask, B, T)
    acc = torch.empty(B, h, S, rank, dtype=torch.float32, device=query.device)  # merge_splits' layout
    m = torch.empty(B, h, S, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    # Triton launches on the current CUDA device, not the tensors' (a model on cuda:1 would fault); float32
    # inputs are multiplied in full precision (tl.dot's default on NVIDIA is TF32: ~1e-3 relative error)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        compiled = _kernel()[(B, S)](
            query, latent, add if add is not None else m, acc, m, l,
            query.stride(0), query.stride(1), latent.stride(0), latent.stride(1), add.stride(0) if add is not None else 0,
            acc.stride(0), acc.stride(2), acc.stride(1), m.stride(0), m.stride(2), m.stride(1),
            h, T, scaling, tiles,
            RANK=rank, ROPE=R, BLOCK_H=_pow2(h), BLOCK_T=block_t, BLOCK_R=_pow2(rank), BLOCK_P=_pow2(R), HAS_MASK=add is not None,
            SWAP=bool(swap), INTERPRET=interpret, CHUNK_TILES_INTERP=tiles if interpret else 1,
            num_warps=num_warps, num_stages=num_stages, **dot_precision(query.dtype),
        )
    if query.is_cuda and (query.device.index, key) not in _RESIDENT:
        _RESIDENT[(query.device.index, key)] = resident_programs(compiled, query.device, num_warps) or 0
    return merge_splits(m, l, acc).to(query.dtype)


def _define_op():
    """`latent_decode_triton` as the custom op transmla::latent_decode: torch.compile treats it as one
    opaque call with a known output shape (no graph break at the Triton launch), so the rest of a
    decode step (projections, RoPE, norms) can be compiled and fused around it."""
    try:
        from torch.library import custom_op
    except ImportError:  # torch < 2.4: called directly
        return latent_decode_triton

    @custom_op("transmla::latent_decode", mutates_args=())
    def op(query: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, rank: int, scaling: float) -> torch.Tensor:
        return latent_decode_triton(query, latent, rank, scaling, mask)

    @op.register_fake
    def _(query, latent, mask, rank, scaling):
        return query.new_empty(query.shape[0], query.shape[1], rank)

    return lambda query, latent, rank, scaling, mask=None: op(query, latent, mask, rank, scaling)


latent_decode_op = _define_op()


def latent_decode(query: torch.Tensor, latent: torch.Tensor, rank: int, scaling: float,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Single-token attention of every head over the shared latent.

    Args:
        query (`torch.Tensor` of shape `[B, h, E]`): absorbed queries [W_UK^T q_nope ; q_rope], E = r + R.
        latent (`torch.Tensor` of shape `[B, T, E]`): the cached [c_kv ; k_pe] (last dim contiguous).
        rank (`int`): r, the value width (the latent's first r dims).
        scaling (`float`): softmax scale.
        mask: None, or `[B|1, 1, 1, T]` bool (True = attend) / additive float.
    Returns:
        `torch.Tensor` of shape `[B, h, r]`.
    """
    if runs_triton(query.device):
        return latent_decode_op(query, latent, rank, scaling, mask)
    return latent_decode_torch(query, latent, rank, scaling, mask)

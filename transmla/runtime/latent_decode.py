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

`latent_decode` runs the Triton kernel for CUDA tensors (or in Triton's interpreter when
TRITON_INTERPRET=1, which is how the tests check the kernel on a CPU) and otherwise the same split /
merge in plain PyTorch (`latent_decode_torch`), the fallback and the tests' second reference.
"""

from __future__ import annotations

import math
import os

import torch

DEFAULT_BLOCK_T = 32
# Launch parameters of the Triton kernel (tokens per tile, warps, pipeline stages); measured per GPU
# with scripts/decode_gpu.py --kernel-bench (reports/throughput/gpu).
TUNING = {"block_t": DEFAULT_BLOCK_T, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def num_splits_for(batch: int, length: int, block_t: int, programs: int) -> int:
    """Chunks per sequence: enough (sequence, chunk) programs to fill `programs` slots, each chunk at
    least one tile of `block_t` tokens."""
    tiles = max(1, math.ceil(length / block_t))
    return max(1, min(tiles, math.ceil(programs / max(batch, 1))))


def _chunk_tiles(length: int, splits: int, block_t: int) -> int:
    """Tiles per chunk, a power of two: the kernel's loop count is a compile-time constant (a handful of
    variants over all lengths, and Triton's interpreter can run it), and chunks never share a tile."""
    return _pow2(math.ceil(math.ceil(length / splits) / block_t), lo=1)


def _additive_mask(mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor | None:
    """A [B, 1, 1, T] (or [1, 1, 1, T]) bool (True = attend) or additive mask as float32 [B, T]."""
    if mask is None:
        return None
    m = mask.reshape(mask.shape[0], -1)[:, -T:]
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    else:
        m = m.float()
    return m.expand(B, T) if m.shape[0] != B else m


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Exact merge of per-chunk softmax partials.

    Args: m, l `[B, S, h]` (running max and sum per chunk), acc `[B, S, h, r]` (unnormalised).
    Returns: `[B, h, r]` float32. A chunk that saw only masked tokens (m = -inf) weighs zero.
    """
    M = m.amax(dim=1, keepdim=True)  # [B, 1, h]
    w = torch.exp(m - M.masked_fill(torch.isinf(M), 0.0))  # exp(-inf) = 0 for empty chunks
    num = (acc * w.unsqueeze(-1)).sum(dim=1)
    den = (l * w).sum(dim=1)
    return num / den.unsqueeze(-1)


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
    add = _additive_mask(mask, B, T)
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
    out = merge_splits(torch.stack(ms, 1), torch.stack(ls, 1), torch.stack(accs, 1))
    return out.to(query.dtype)


def _kernel():
    """The Triton kernel, imported on first use (triton is optional: the PyTorch form runs without it)."""
    from transmla.runtime.latent_decode_triton import latent_decode_kernel

    return latent_decode_kernel


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def latent_decode_triton(query: torch.Tensor, latent: torch.Tensor, rank: int, scaling: float,
                         mask: torch.Tensor | None = None, num_splits: int | None = None,
                         block_t: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """`latent_decode_torch`'s result from the Triton kernel (same arguments; num_splits None = fill the GPU;
    launch parameters None = `TUNING`)."""
    block_t = block_t or TUNING["block_t"]
    num_warps = num_warps or TUNING["num_warps"]
    num_stages = num_stages or TUNING["num_stages"]
    B, h, E = query.shape
    T = latent.shape[1]
    R = E - rank
    if query.stride(-1) != 1 or latent.stride(-1) != 1:
        raise ValueError("latent_decode_triton needs the last dimension of query and latent contiguous.")
    if num_splits is None:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4
        num_splits = num_splits_for(B, T, block_t, TUNING["programs_per_sm"] * sms)
    tiles = _chunk_tiles(T, num_splits, block_t)
    S = math.ceil(T / (tiles * block_t))
    add = _additive_mask(mask, B, T)
    acc = torch.empty(B, S, h, rank, dtype=torch.float32, device=query.device)
    m = torch.empty(B, S, h, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    _kernel()[(B, S)](
        query, latent, add if add is not None else m, acc, m, l,
        query.stride(0), query.stride(1), latent.stride(0), latent.stride(1), add.stride(0) if add is not None else 0,
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        h, T, scaling,
        RANK=rank, ROPE=R, CHUNK_TILES=tiles, BLOCK_H=_pow2(h), BLOCK_T=block_t, BLOCK_R=_pow2(rank), BLOCK_P=_pow2(R), HAS_MASK=add is not None,
        INTERPRET=_interpret(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return merge_splits(m, l, acc).to(query.dtype)


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
    if (query.is_cuda or _interpret()) and triton_available():
        return latent_decode_triton(query, latent, rank, scaling, mask)
    return latent_decode_torch(query, latent, rank, scaling, mask)

"""This project's CPU decode kernels (C++ in csrc/: AVX2 + FMA, AVX-512 where the CPU has it), as registered torch operators.

A decode step on CPU is two reads: every weight (the skinny GEMMs of the batch's few rows) and, for
the absorbed MLA, the latent cache (one attention per layer). PyTorch's kernels do neither at the
machine's bandwidth on this project's 2-core AMD EPYC, so two operators do it directly:

- `transmla::stream_linear` (csrc/stream_linear.cpp): F.linear for a few rows, from PyTorch's own
  [out, in] weight. Each weight row is read once and multiplied by all the input rows held in L1, with
  software prefetches ahead of the stream into L1 and L2. One pass of batch 8 through every linear of
  the SmolLM2 87.5% export (2 threads, `packed.fastest_kernel`; reports/throughput gives each run's
  times of the three kernels) takes 19-20 ms on this project's AMD EPYC (26 ms with the L1 prefetch
  alone), faster than oneDNN's and MKL's packed weights there, and it needs no packed copy in memory.
  `runtime.packed` offers it as the kernel "stream" beside "mkl" and "onednn" and picks the fastest.
- `transmla::tiled_linear` (csrc/tiled_linear.cpp): the same product from a copy of the weight packed
  k-major in tiles of 48 output columns (`tile_weight`): per input dim, three AVX-512 vectors of weights
  and one broadcast per row feed 24 FMAs, where the stream kernel loads 8 input vectors per 8 weights. One
  pass of batch 8 through the same linears, alternated in one process: 15.6 against 18.1 ms, a read-only
  sum of the same weights 14.7 ms. AVX-512 CPUs only (`has_avx512`); `runtime.packed` offers it as "tiled".
- `transmla::latent_decode_cpu` (csrc/latent_decode.cpp): one query token per sequence over the shared
  latent, the latent read once (flash-decoding: chunks of keys in parallel, merged by their maxima
  and sums). Every head's dot product comes from one load of the key. 30 layers of batch 8 x 4106
  keys, 9 heads, a 48-wide latent, 2 threads: 29.6 ms against 46.4 ms for SDPA's CPU flash kernel.
  `runtime.absorb` uses it as the decode kernel "cpu" over a `LatentCache`.
- `transmla::latent_decode_blocked_cpu` (csrc/latent_decode_blocked.cpp): the same attention over a
  block-transposed latent ([B, T / 16, E, 16], `block_latent`), the layout of the compiled decode
  step's static cache (`runtime.compiled_decode`): sixteen keys sit in the lanes of one vector, so a
  score is an FMA per latent dim for 16 keys at once, with no horizontal sum per key (where the row
  kernel spends most of its time), and the value products read the same blocks; the score loop prefetches
  the blocks two ahead into L2 (30 layers at 4K, batch 8: 10.3 ms against 12.1 without). AVX-512 where the CPU
  has it (one zmm per block row), else AVX2 (two ymm), chosen at run time.

Both are built once per machine by torch.utils.cpp_extension (gcc and ninja, 15-45 s; cached under
~/.cache/torch_extensions) at the first `available()` call. `available()` is False on a CPU without
AVX2/FMA or where the build fails (the reason is warned once), and the callers then keep PyTorch's
kernels. Each operator has a fake (shape) implementation, so torch.compile keeps it as one call in a
compiled decode graph (`runtime.compiled_decode`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

# what the kernels are built from; tasks.codehash adds these files to the cache key of every task that can run them
NATIVE_SOURCES = ("csrc/stream_linear.cpp", "csrc/tiled_linear.cpp", "csrc/latent_decode.cpp", "csrc/latent_decode_blocked.cpp",
                  "csrc/native_decode.cpp", "csrc/latent_decode_blocked_impl.h", "csrc/latent_decode_blocked_kernels.h",
                  "csrc/latent_merge.h", "csrc/decode_gemm.h", "csrc/tiled_tile.h")
SOURCES = [str(Path(__file__).parent / f) for f in NATIVE_SOURCES if f.endswith(".cpp")]
BLOCK = 16  # keys per block of the blocked latent layout (latent_decode_blocked): one AVX-512 vector
TILE = 48  # output columns per tile of tiled_linear's packed weight: three AVX-512 vectors
NAME = "transmla_cpu_kernels"

_AVAILABLE: bool | None = None  # a plain flag (not functools.cache): read inside compiled graphs


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_supports() -> bool:
    """True on an x86 CPU with AVX2 and FMA (what the kernels are compiled for)."""
    return {"avx2", "fma"} <= _cpu_flags()


def has_avx512() -> bool:
    """True where the CPU has AVX-512F as well (`tiled_linear` needs it)."""
    return {"avx2", "fma", "avx512f"} <= _cpu_flags()


def available() -> bool:
    """Build (first use on this machine) and load the kernels; False when this CPU or toolchain cannot."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _load()
    return _AVAILABLE


def _load() -> bool:
    if not cpu_supports():
        return False
    if not hasattr(torch.ops.transmla, "stream_linear"):
        try:
            from torch.utils.cpp_extension import load

            # -fopenmp: ATen's parallel_for is an OpenMP region compiled into the kernels (torch's own libgomp)
            load(name=NAME, sources=SOURCES, extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=bool(os.environ.get("TRANSMLA_VERBOSE_BUILD")))
        except Exception as err:  # no compiler, no ninja, a build error: PyTorch's kernels remain
            warnings.warn(f"transmla: the CPU decode kernels could not be built ({type(err).__name__}: {err}); "
                          "decode uses PyTorch's kernels.", stacklevel=2)
            return False

        @torch.library.register_fake("transmla::stream_linear")
        def _(x, weight, bias):
            return x.new_empty(*x.shape[:-1], weight.shape[0])

        @torch.library.register_fake("transmla::tiled_linear")
        def _(x, packed, bias, out_features):
            return x.new_empty(*x.shape[:-1], out_features)

        @torch.library.register_fake("transmla::latent_decode_cpu")
        def _(q, latent, mask, scale, rank):
            return q.new_empty(q.shape[0], q.shape[1], rank)

        @torch.library.register_fake("transmla::latent_decode_blocked_cpu")
        def _(q, latent, mask, scale, rank):
            return q.new_empty(q.shape[0], q.shape[1], rank)

    return True


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., out] by the stream kernel: x [..., in], weight [out, in] float32 on
    CPU. For decode's few rows; any row count is correct (rows beyond 8 re-read weight tiles from cache)."""
    return torch.ops.transmla.stream_linear(x, weight, bias)


def tile_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / TILE), K, TILE], `tiled_linear`'s layout: tile t holds output columns
    t TILE .. t TILE + TILE - 1, k-major, zeros past N. Into `out` (that shape, contiguous) when given."""
    N, K = weight.shape
    tiles = -(-N // TILE)
    out = torch.empty(tiles, K, TILE, dtype=weight.dtype) if out is None else out
    out[-1].zero_()  # the last tile's columns past N
    full = N // TILE
    out[:full].copy_(weight[: full * TILE].view(full, TILE, K).transpose(1, 2))
    if full < tiles:
        out[full, :, : N - full * TILE].copy_(weight[full * TILE:].t())
    return out


def tiled_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., out_features] from packed = `tile_weight(weight)`: x [..., in]
    float32 on CPU, an AVX-512 CPU. For decode's few rows; any row count is correct (rows beyond 8
    re-read each tile from cache)."""
    return torch.ops.transmla.tiled_linear(x, packed, bias, out_features)


def latent_decode(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, scale: float, rank: int) -> torch.Tensor:
    """Single-token attention of every head over the shared latent, float32 on CPU.

    Args:
        q (`torch.Tensor` of shape `[B, h, E]`): absorbed queries.
        latent (`torch.Tensor` of shape `[B, T, E]`): the cached latent (rows may be strided, e.g. a view of a
            larger cache); its first `rank` dims are the value.
        mask (`torch.Tensor` of shape `[1 or B, T]` or None): additive (-inf: not attended).
    Returns:
        `torch.Tensor` of shape `[B, h, rank]`: softmax(scale q latent^T + mask) latent[..., :rank].
    """
    return torch.ops.transmla.latent_decode_cpu(q, latent, mask, scale, rank)


def latent_decode_blocked(q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor | None, scale: float,
                          rank: int) -> torch.Tensor:
    """`latent_decode` over the block-transposed latent of `block_latent`, float32 on CPU.

    Args:
        q (`torch.Tensor` of shape `[B, h, E]`): absorbed queries.
        latent (`torch.Tensor` of shape `[B, NB, E, BLOCK]`): keys BLOCK k .. BLOCK k + BLOCK - 1 in block k,
            each dim's BLOCK values contiguous (the keys in the vector lanes: one FMA scores BLOCK keys).
        mask (`torch.Tensor` of shape `[1 or B, NB * BLOCK]` or None): additive.
    Returns:
        `torch.Tensor` of shape `[B, h, rank]`, as `latent_decode` over `unblock_latent(latent)`.
    """
    return torch.ops.transmla.latent_decode_blocked_cpu(q, latent, mask, scale, rank)


def block_latent(latent: torch.Tensor) -> torch.Tensor:
    """[B, T, E] -> [B, ceil(T / BLOCK), E, BLOCK] (a copy; T padded with zero keys to whole blocks)."""
    B, T, E = latent.shape
    pad = -T % BLOCK
    if pad:
        latent = torch.cat([latent, latent.new_zeros(B, pad, E)], 1)
    return latent.view(B, -1, BLOCK, E).transpose(2, 3).contiguous()


def unblock_latent(latent: torch.Tensor) -> torch.Tensor:
    """[B, NB, E, BLOCK] -> [B, NB * BLOCK, E] (a copy)."""
    B, NB, E, _ = latent.shape
    return latent.transpose(2, 3).reshape(B, NB * BLOCK, E)

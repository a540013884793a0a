"""`transmla::stream_linear`: decode GEMMs that stream PyTorch's own [out, in] weights (csrc/stream_linear.cpp).

A decode step's linears have a handful of rows (the batch), so their cost is one read of every weight.
MKL and oneDNN reach that only on a copy of the weights packed for the batch (`runtime.packed`), and on
this project's 2-core AMD EPYC still read at about half the bandwidth a plain sum over the same bytes
gets. This kernel multiplies each weight row, as stored, by all the input rows at once, with a software
prefetch ahead of the stream: one pass of batch 8 through every linear of the SmolLM2 87.5% export
(2 threads, `packed.fastest_kernel`, reports/throughput) took 32 ms against 51 ms on oneDNN's packed
weights and 103 ms on MKL's, and it needs no packed copy in memory. `runtime.packed` offers it as the kernel "stream" beside "mkl" and
"onednn", and picks whichever is fastest on the host (`packed.fastest_kernel`).

The kernel is C++ (AVX2 + FMA), built once per machine by torch.utils.cpp_extension (gcc, about half a
minute; cached under ~/.cache/torch_extensions) on first use. `available()` is False on a CPU without
AVX2/FMA or where the build fails (the reason is warned once); nothing else depends on it. The op is a
registered torch operator with a fake (shape) implementation, so torch.compile keeps it as one call in a
compiled decode graph (`runtime.compiled_decode`, gemm="stream").
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

# what the kernel is built from; tasks.codehash adds these files to the cache key of every task that can run it
NATIVE_SOURCES = ("csrc/stream_linear.cpp",)
SOURCES = [str(Path(__file__).parent / f) for f in NATIVE_SOURCES]
NAME = "transmla_stream_linear"


def cpu_supports() -> bool:
    """True on an x86 CPU with AVX2 and FMA (what the kernel is compiled for)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


@functools.cache
def available() -> bool:
    """Build (first use on this machine) and load the kernel; False when this CPU or toolchain cannot."""
    if not cpu_supports():
        return False
    if not hasattr(torch.ops.transmla, "stream_linear"):
        try:
            from torch.utils.cpp_extension import load

            # -fopenmp: ATen's parallel_for is an OpenMP region compiled into the kernel (torch's own libgomp)
            load(name=NAME, sources=SOURCES, extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=bool(os.environ.get("TRANSMLA_VERBOSE_BUILD")))
        except Exception as err:  # no compiler, no ninja, a build error: the other kernels remain
            warnings.warn(f"transmla: the stream GEMM kernel could not be built ({type(err).__name__}: {err}); "
                          "decode GEMMs use MKL or oneDNN.", stacklevel=2)
            return False

        @torch.library.register_fake("transmla::stream_linear")
        def _(x, weight, bias):
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    return True


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., out] by the stream kernel: x [..., in], weight [out, in] float32 on
    CPU. For decode's few rows; any row count is correct (rows beyond 8 re-read weight tiles from cache)."""
    return torch.ops.transmla.stream_linear(x, weight, bias)

"""Prepacked decode GEMMs on CPU: every linear layer's weight reordered once for MKL's packed sgemm.

A decode step multiplies a handful of rows (the batch) by every weight of the model, so on a CPU it is
a stream of skinny GEMMs [B, in] x [in, out] whose cost is reading the weights. From PyTorch's
[out, in] layout MKL reaches a third to a half of the machine's read bandwidth at B = 8 (it repacks
panels of the weight on every call); from a weight packed once for B rows (MKL's
`cblas_sgemm_pack`, what torch.compile's CPU backend uses for frozen linears) the same products run
1.7-4.5x faster. Measured here (2 cores, B = 8, the SmolLM2 87.5% export's matrices): all linears of one
decode step 74 -> 30 ms; oneDNN's blocked layout, the other prepacked kernel PyTorch ships, 41 ms.
The packed copy costs memory, about the weights' size once more (measured: +0.57 GB of RSS for the
SmolLM2 87.5% export's 0.64 GB of parameters, +0.54 GB for the original's 0.54 GB), since the stock
weights stay: for saving, for prefill and any other number of rows, where the call falls back to
F.linear. CPU-only, float32.

    with packed(model, batch=8):   # every nn.Linear (and Absorb's folded matrices) on the packed kernel
        model(...)                 # same outputs to float32 rounding (another summation order)

The packed weight is a plain attribute of its module (`_packed_weight`), not a parameter or buffer:
`state_dict`, `save_pretrained` and `.to()` never see it. Packing is a snapshot: pack again after
changing the weights.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from transmla.errors import TransMLAError
from transmla.runtime.memory import trim_heap

ATTR = "_packed_weight"
# Absorb's folded matrices (transmla.runtime.absorb): packed beside the buffer (`packed_buffer`)
ABSORB_MATRICES = ("absorb_q_weight", "absorb_o_weight")


def available(model) -> bool:
    """True when `model` can run on packed weights: float32 on CPU and a PyTorch built with MKL."""
    p = next(model.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype == torch.float32
            and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))


class Packed:
    """A weight [out, in] packed for `batch` input rows, with the weight itself for any other count."""

    __slots__ = ("data", "weight", "batch")

    def __init__(self, weight: torch.Tensor, batch: int):
        self.weight = weight.detach()
        self.data = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, batch)
        self.batch = batch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed_weight: Packed | None) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., out], from `packed_weight` when there is one (MKL uses it when x has
    exactly its `batch` rows and falls back to F.linear otherwise). x [..., in]."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed_weight.data, packed_weight.weight, bias, packed_weight.batch)


def packed_buffer(module: nn.Module, name: str) -> Packed | None:
    """The packed copy of `module`'s buffer `name` (one of ABSORB_MATRICES), or None when unpacked."""
    return module.__dict__.get(name + "_packed")


def drop_packed_buffer(module: nn.Module, name: str) -> None:
    """Forget the packed copy of `module`'s buffer `name` (e.g. before the buffer is recomputed)."""
    module.__dict__.pop(name + "_packed", None)


def _forward(self, x: torch.Tensor) -> torch.Tensor:  # bound to a packed nn.Linear
    return linear(x, self.weight, self.bias, getattr(self, ATTR))


def is_packed(model) -> bool:
    return any(ATTR in m.__dict__ for m in model.modules())


@torch.no_grad()
def pack(model, batch: int = 8) -> None:
    """Pack every nn.Linear of `model` and Absorb's folded matrices (when absorbed) for `batch` rows, in
    place. Raises TransMLAError when `available(model)` is False."""
    if not available(model):
        raise TransMLAError("Packed weights need a float32 model on CPU and a PyTorch built with MKL.",
                            "run without packing (throughput.packed_weights: false) on this model or device.")
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            setattr(mod, ATTR, Packed(mod.weight, batch))
            mod.forward = types.MethodType(_forward, mod)
        for name in ABSORB_MATRICES:
            if name in mod._buffers:
                mod.__dict__[name + "_packed"] = Packed(mod._buffers[name], batch)


def unpack(model) -> None:
    """Drop every packed weight, restore nn.Linear's own forward and give the freed pages back to the OS
    (the packed copies are mostly heap allocations below glibc's mmap threshold: without a trim the
    process keeps their memory, and the next measurement's RSS would count it)."""
    for mod in model.modules():
        if ATTR in mod.__dict__:
            del mod.__dict__[ATTR]
            mod.__dict__.pop("forward", None)
        for name in ABSORB_MATRICES:
            drop_packed_buffer(mod, name)
    trim_heap()


@contextlib.contextmanager
def packed(model, enabled: bool = True, batch: int = 8):
    """Context manager: `model` on packed weights inside (enabled and not already packed), as before after."""
    mine = enabled and not is_packed(model)
    if mine:
        pack(model, batch)
    try:
        yield model
    finally:
        if mine:
            unpack(model)

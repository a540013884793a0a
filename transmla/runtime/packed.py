"""Prepacked decode GEMMs on CPU: every linear layer's weight reordered once for the batch.

A decode step multiplies a handful of rows (the batch) by every weight of the model, so on a CPU it is
a stream of skinny GEMMs [B, in] x [in, out] whose cost is reading the weights. From PyTorch's
[out, in] layout MKL reaches a third to a half of the machine's read bandwidth at B = 8 (it repacks
panels of the weight on every call). A weight packed once for B rows runs the same products 1.7-4.5x
faster. PyTorch ships two such kernels, and which one is faster depends on the CPU:

- `mkl`: MKL's packed sgemm (`cblas_sgemm_pack`, what torch.compile's CPU backend uses for frozen
  linears at a static batch);
- `onednn`: oneDNN's blocked layout (`mkldnn._reorder_linear_weight` / `_linear_pointwise`, what it uses
  at a dynamic batch).

Measured (2 cores, B = 8, one decode step's linears of the SmolLM2 87.5% export): on an AVX-512 Xeon
MKL 30 ms and oneDNN 41 ms (unpacked 74 ms); on an AMD EPYC without AVX-512 MKL reads the weights at
5.9 GB/s and oneDNN at 12.6 GB/s. A third kernel is this project's own:

- `stream`: `runtime.cpu_kernels`, which streams the stock [out, in] weights once per call with all
  the rows at once (no packed copy; built on first use, AVX2 CPUs): on that EPYC 32 ms per pass
  against oneDNN's 51 ms and MKL's 103 ms (one process).
- `tiled`: `runtime.cpu_kernels`'s kernel on a copy packed k-major in tiles of 48 output columns (AVX-512
  CPUs): on this project's AVX-512 EPYC 15.6 ms per pass against the stream kernel's 18.1 (one process,
  weights in 2 MB pages). Its copies are placed in 2 MB pages where the kernel offers them
  (`runtime.hugepages`), all of a model's in one mapping, since the kernel exists to stream them.

With "tiled", linears that read one input are packed side by side as one copy (`sibling_linears`: an MLP's
gate and up projections; an absorbed attention's folded query matrix and kv_a_proj_with_mqa) and run as one
kernel call (`linears`): 121 calls per step instead of 181 for the SmolLM2 87.5% export, wider outputs that
split evenly over the threads (kv_a_proj alone is one tile, which one thread computes while the other
waits). Measured (batch 8, 2 threads, the export's own copies, alternated in one process): one pass 14.38 against
14.69 ms; the compiled step at 4K 32.10 against 32.43 ms, faster in 36 of 60 rounds.

So `pack(kernel="auto")` times every kernel this build has on the model's own weights
(`fastest_kernel`: one pass over every linear, a fraction of a second) and packs with the fastest.
MKL's and oneDNN's packed copies cost memory, about the weights' size once more (measured with MKL:
+0.57 GB of RSS for the SmolLM2 87.5% export's 0.64 GB of parameters), since the stock weights stay:
for saving, for prefill and any other number of rows (`tiled`'s copy as well); `stream` costs none. CPU-only, float32.

    with packed(model, batch=8) as kernel:   # every nn.Linear (and Absorb's folded matrices) packed
        model(...)                           # same outputs to float32 rounding (another summation order)

The packed weight is a plain attribute of its module (`_packed_weight`), not a parameter or buffer:
`state_dict`, `save_pretrained` and `.to()` never see it. Packing is a snapshot: pack again after
changing the weights.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from transmla.errors import TransMLAError
from transmla.runtime.memory import trim_heap

ATTR = "_packed_weight"
# Absorb's folded matrices (transmla.runtime.absorb): packed beside the buffer (`packed_buffer`)
ABSORB_MATRICES = ("absorb_q_weight", "absorb_o_weight")


KERNELS = ("mkl", "onednn", "stream", "tiled")
# this project's kernels (`runtime.cpu_kernels`): a compiled decode graph calls them as operators, up to
# `batch` rows; more rows (a prefill) are a compute-bound GEMM, F.linear's
OP_KERNELS = ("stream", "tiled")


def kernels() -> list[str]:
    """The decode GEMM kernels this PyTorch build and CPU have, of KERNELS ("stream" is built on first call)."""
    from transmla.runtime import cpu_kernels

    have = []
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        have.append("mkl")
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        have.append("onednn")
    if cpu_kernels.available():
        have.append("stream")
        if cpu_kernels.has_avx512():
            have.append("tiled")
    return have


def available(model) -> bool:
    """True when `model` can run on packed weights: float32 on CPU and a PyTorch with MKL or oneDNN."""
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and bool(kernels())


class Packed:
    """A weight [out, in] packed for `batch` input rows by `kernel` (one of KERNELS), with the weight
    itself for the fallback at any other row count ("stream": the weight itself, nothing packed).
    "tiled": the weight's copy by `cpu_kernels.tile_weight`, made once while it is unchanged (`tiled_copies`);
    `group`: the `Fused` copy its copy is a slice of, when `pack` packed it with linears of the same input
    (`tiled_groups`), else None."""

    __slots__ = ("data", "weight", "batch", "kernel", "group")

    def __init__(self, weight: torch.Tensor, batch: int, kernel: str = "mkl", data: torch.Tensor | None = None):
        self.weight = weight.detach()
        self.batch = batch
        self.kernel = kernel
        self.group = None
        if kernel == "stream":
            self.data = None  # it reads the stock weight
        elif kernel == "tiled":  # `data`: this weight's copy when the caller has it (pack_all makes them together)
            self.data = tiled_copies([weight])[0] if data is None else data
        elif kernel == "onednn":
            self.data = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch)
        else:
            self.data = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, batch)


# the "tiled" copy of each weight tensor (the Parameter or buffer object), kept while it lives and is
# unchanged (its version counter and its memory, which `.data =` can replace): decode_step packs the
# model again for every run, and a compiled step holds the copies it was traced with as constants, so new
# copies of the same weights would compile again
_TILED = torch.utils.weak.WeakIdKeyDictionary()


def _tiled_copy(weight: torch.Tensor) -> torch.Tensor | None:
    state, data = _TILED.get(weight, (None, None))
    return data if state == (weight._version, weight.data_ptr()) else None


def tiled_copies(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight's `cpu_kernels.tile_weight` copy, made once while the weight lives unchanged (packing the
    same weights again returns the same copies); the new ones all in one mapping of 2 MB pages where the
    kernel offers them (`runtime.hugepages.empty_many`), else in ordinary memory."""
    from transmla.runtime import cpu_kernels, hugepages

    todo = list({id(w): w for w in weights if _tiled_copy(w) is None}.values())
    outs = [None] * len(todo)
    if todo and hugepages.supported():
        outs = hugepages.empty_many([((-(-w.shape[0] // cpu_kernels.TILE), w.shape[1], cpu_kernels.TILE), w.dtype)
                                     for w in todo])
    for w, out in zip(todo, outs):
        _TILED[w] = ((w._version, w.data_ptr()), cpu_kernels.tile_weight(w.detach(), out))
    return [_tiled_copy(w) for w in weights]


class Fused:
    """Linears of one input as one "tiled" weight: their tiled copies side by side in `data` [tiles, in, TILE]
    (`tiled_groups`), so one kernel call reads them all (one pass of the threads over a wider output instead of
    a fork and join per linear). Member i's outputs are columns offsets[i] .. offsets[i] + sizes[i] of the
    `width` = tiles * TILE the call writes; `bias` [width] joins their biases (zeros where one has none), None
    when none has one."""

    __slots__ = ("data", "bias", "offsets", "sizes")

    def __init__(self, data: torch.Tensor, bias: torch.Tensor | None, offsets: list[int], sizes: list[int]):
        self.data, self.bias, self.offsets, self.sizes = data, bias, offsets, sizes

    @property
    def width(self) -> int:
        return self.data.shape[0] * self.data.shape[2]


# each group's `Fused` copy, keyed on its first weight, with the state of all its weights and biases
_FUSED = torch.utils.weak.WeakIdKeyDictionary()


def _group_state(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> tuple:
    return tuple(None if t is None else (id(t), t._version, t.data_ptr()) for t in (*weights, *biases))


def _fused_copy(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> Fused | None:
    hit = _FUSED.get(weights[0])
    return hit[1] if hit is not None and hit[0] == _group_state(weights, biases) else None


def tiled_groups(groups: list[tuple[list[torch.Tensor], list[torch.Tensor | None]]]) -> list[Fused]:
    """The `Fused` copy of each group of linears of one input ((weights [out_i, in], their biases or None)),
    made once while its weights and biases are unchanged, the new ones all in one mapping of 2 MB pages where
    the kernel offers them (as `tiled_copies`). Each weight's `tiled_copies` entry becomes its slice of its
    group's copy: packed one by one it reads the same memory, no second copy."""
    from transmla.runtime import cpu_kernels, hugepages

    T = cpu_kernels.TILE
    for weights, biases in groups:
        if len(weights) != len(biases) or len({w.shape[1] for w in weights}) != 1:
            raise TransMLAError("Linears fused into one tiled weight need one bias slot each and one input width.",
                                "fuse linears of one input (weights [out_i, in], biases [out_i] or None).")
    todo = [(w, b) for w, b in groups if _fused_copy(w, b) is None]
    shapes = [((sum(-(-w.shape[0] // T) for w in ws), ws[0].shape[1], T), ws[0].dtype) for ws, _ in todo]
    datas = hugepages.empty_many(shapes) if todo and hugepages.supported() else [torch.empty(s, dtype=d) for s, d in shapes]
    for (weights, biases), data in zip(todo, datas):
        offsets, t0 = [], 0
        for w in weights:
            n = -(-w.shape[0] // T)
            _TILED[w] = ((w._version, w.data_ptr()), cpu_kernels.tile_weight(w.detach(), data[t0:t0 + n]))
            offsets.append(t0 * T)
            t0 += n
        bias = None
        if any(b is not None for b in biases):
            bias = weights[0].new_zeros(data.shape[0] * T)
            for b, off in zip(biases, offsets):
                if b is not None:
                    bias[off:off + b.numel()] = b.detach()
        _FUSED[weights[0]] = (_group_state(weights, biases), Fused(data, bias, offsets, [w.shape[0] for w in weights]))
    return [_fused_copy(w, b) for w, b in groups]


def one_group(*packs: Packed | None) -> bool:
    """True when `packs` are exactly the members of one `Fused` group, in its order (`linears` makes one call of them)."""
    group = getattr(packs[0], "group", None)
    return group is not None and len(packs) == len(group.sizes) and all(getattr(p, "group", None) is group for p in packs)


def linears(x: torch.Tensor, slots: list[tuple[torch.Tensor, torch.Tensor | None, Packed | None]]) -> list[torch.Tensor]:
    """[F.linear(x, weight, bias) for (weight, bias, packed) in slots], as one kernel call where the packs are
    one `Fused` group (`one_group`) and x has at most their `batch` rows (a decode step); else one `linear`
    each. x [..., in]; each output [..., out_i] (a view of the joint output when fused)."""
    packs = [p for _, _, p in slots]
    if not one_group(*packs) or x.numel() > packs[0].batch * x.shape[-1]:
        return [linear(x, w, b, p) for w, b, p in slots]
    y = fused_linear(x, packs[0].group)
    return [y[..., o:o + n] for o, n in zip(packs[0].group.offsets, packs[0].group.sizes)]


def fused_linear(x: torch.Tensor, group: Fused) -> torch.Tensor:
    """x [..., in] through every linear of `group` at once: [..., group.width] (`Fused` says which columns are whose)."""
    return torch.ops.transmla.tiled_linear(x, group.data, group.bias, group.width)


def pack_all(weights: list[torch.Tensor], batch: int, kernel: str) -> list[Packed]:
    """`Packed` of each weight ("tiled": their copies made together, `tiled_copies`)."""
    if kernel != "tiled":
        return [Packed(w, batch, kernel) for w in weights]
    return [Packed(w, batch, kernel, d) for w, d in zip(weights, tiled_copies(weights))]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed_weight: Packed | None) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., out], from `packed_weight` when there is one. x [..., in]. MKL runs
    its packed kernel when x has exactly `batch` rows and F.linear otherwise; oneDNN takes any rows; the
    stream and tiled kernels up to `batch` rows (more, a prefill, is a compute-bound GEMM: F.linear's)."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if packed_weight.kernel in OP_KERNELS:
        if x.numel() > packed_weight.batch * x.shape[-1]:
            return F.linear(x, weight, bias)
        if packed_weight.kernel == "tiled":
            return torch.ops.transmla.tiled_linear(x, packed_weight.data, bias, weight.shape[0])
        # `weight` (the module's own tensor), not a copy: a compiled step guards on its identity, and
        # packing the same model again must not compile again
        return torch.ops.transmla.stream_linear(x, weight, bias)
    if packed_weight.kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight.data, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed_weight.data, packed_weight.weight, bias, packed_weight.batch)


def time_kernels(weights: list[torch.Tensor], batch: int, repeats: int = 3) -> dict[str, float]:
    """Seconds for one pass of `batch` rows through every weight [out, in] of `weights` on each kernel
    this build has (packed once, one warm-up pass, the fastest of `repeats` passes)."""
    xs = {n: torch.randn(batch, n) for n in {w.shape[1] for w in weights}}
    out = {}
    for kernel in kernels():
        packs = pack_all(weights, batch, kernel)
        best = None
        for i in range(repeats + 1):
            t = time.perf_counter()
            for p in packs:
                linear(xs[p.weight.shape[1]], p.weight, None, p)
            dt = time.perf_counter() - t
            if i and (best is None or dt < best):
                best = dt
        out[kernel] = best
        del packs
    return out


# fastest_kernel's measurements per (weight shapes, batch, threads): the choice is the CPU's and the
# shapes', so it is made once per process (a choice that flipped on noise would recompile a compiled step)
_FASTEST: dict = {}


@torch.no_grad()
def fastest_kernel(model, batch: int) -> tuple[str, dict[str, float]]:
    """The packed kernel that runs `model`'s linear weights fastest at `batch` rows on this CPU, and the
    seconds per pass of each (`time_kernels`; measured once per process for these shapes, batch and
    thread count). Raises TransMLAError when `available(model)` is False."""
    if not available(model):
        raise TransMLAError("Packed weights need a float32 model on CPU and a PyTorch built with MKL or oneDNN.",
                            "run without packing (throughput.packed_weights: false) on this model or device.")
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    key = (tuple(tuple(w.shape) for w in weights), batch, torch.get_num_threads())
    if key not in _FASTEST:
        _FASTEST[key] = time_kernels(weights, batch)
    times = _FASTEST[key]
    return min(times, key=times.get), dict(times)


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
def pack(model, batch: int = 8, kernel: str = "auto") -> str:
    """Pack every nn.Linear of `model` and Absorb's folded matrices (when absorbed) for `batch` rows, in
    place, with `kernel` (one of KERNELS, or "auto": `fastest_kernel` on this CPU). Returns the kernel.
    Raises TransMLAError when `available(model)` is False or the kernel is not in this build."""
    if not available(model):
        raise TransMLAError("Packed weights need a float32 model on CPU and a PyTorch built with MKL or oneDNN.",
                            "run without packing (throughput.packed_weights: false) on this model or device.")
    if kernel == "auto":
        kernel = fastest_kernel(model, batch)[0]
    if kernel not in kernels():
        raise TransMLAError(f"Packed kernel {kernel!r} is not available in this PyTorch build (it has {kernels()}).",
                            f"use one of {kernels()} or 'auto'.")
    # (module, attribute the pack goes to, weight): every nn.Linear and Absorb's folded matrices
    slots = []
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            slots.append((mod, ATTR, mod.weight))
        slots += [(mod, name + "_packed", mod._buffers[name]) for name in ABSORB_MATRICES if name in mod._buffers]
    # "tiled": the linears of one input as one copy first, so that packing them one by one below finds their slices
    groups = sibling_linears(model) if kernel == "tiled" else []
    fused = tiled_groups([([w for _, _, w, _ in g], [b for _, _, _, b in g]) for g in groups])
    for (mod, attr, _), p in zip(slots, pack_all([w for _, _, w in slots], batch, kernel)):
        mod.__dict__[attr] = p
        if attr == ATTR:
            mod.forward = types.MethodType(_forward, mod)
    for g, f in zip(groups, fused):
        for mod, attr, _, _ in g:
            mod.__dict__[attr].group = f
    for mod in model.modules():
        if type(mod).__name__ in MLP_CLASSES and one_group(getattr(mod.gate_proj, ATTR, None), getattr(mod.up_proj, ATTR, None)):
            mod.forward = types.MethodType(_mlp_forward, mod)
    return kernel


# MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (transformers' modeling files): with
# gate and up packed as one group, `_mlp_forward` makes the two products one kernel call
MLP_CLASSES = ("DeepseekV3MLP", "LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def sibling_linears(model) -> list[list[tuple[nn.Module, str, torch.Tensor, torch.Tensor | None]]]:
    """The groups of linears that read one input in a decode step, each as (module, attribute its pack goes
    to, weight, bias): an absorbed attention's folded query matrix and kv_a_proj_with_mqa (without a query
    LoRA both read the hidden state; `runtime.absorb` calls them with `linears`), and an MLP's gate_proj and
    up_proj (`MLP_CLASSES`)."""
    groups = []
    for mod in model.modules():
        kv = getattr(mod, "kv_a_proj_with_mqa", None)
        if "absorb_q_weight" in mod._buffers and getattr(mod, "q_lora_rank", 0) is None and isinstance(kv, nn.Linear):
            groups.append([(mod, "absorb_q_weight_packed", mod.absorb_q_weight, None), (kv, ATTR, kv.weight, kv.bias)])
        if type(mod).__name__ in MLP_CLASSES and isinstance(mod.gate_proj, nn.Linear) and isinstance(mod.up_proj, nn.Linear):
            groups.append([(m, ATTR, m.weight, m.bias) for m in (mod.gate_proj, mod.up_proj)])
    return groups


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:  # bound to an MLP of MLP_CLASSES whose gate and up are one group
    gate, up = linears(x, [(m.weight, m.bias, getattr(m, ATTR)) for m in (self.gate_proj, self.up_proj)])
    return self.down_proj(self.act_fn(gate) * up)


def unpack(model) -> None:
    """Drop every packed weight, restore nn.Linear's own forward and give the freed pages back to the OS
    (the packed copies are mostly heap allocations below glibc's mmap threshold: without a trim the
    process keeps their memory, and the next measurement's RSS would count it). "tiled" copies stay while
    their weights live unchanged (`tiled_copies`)."""
    for mod in model.modules():
        if ATTR in mod.__dict__:
            del mod.__dict__[ATTR]
            mod.__dict__.pop("forward", None)
        if getattr(mod.__dict__.get("forward"), "__func__", None) is _mlp_forward:
            del mod.__dict__["forward"]
        for name in ABSORB_MATRICES:
            drop_packed_buffer(mod, name)
    trim_heap()


@contextlib.contextmanager
def packed(model, enabled: bool = True, batch: int = 8, kernel: str = "auto"):
    """Context manager: `model` on packed weights inside (enabled and not already packed), as before
    after. Yields the kernel it packed with (None when it did not pack)."""
    mine = enabled and not is_packed(model)
    used = pack(model, batch, kernel) if mine else None
    try:
        yield used
    finally:
        if mine:
            unpack(model)

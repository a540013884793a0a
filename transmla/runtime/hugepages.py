"""Tensors in 2 MB pages (Linux transparent huge pages), for decoding on CPU.

A decode step streams every weight once. A model loaded from safetensors is a private file mapping in
4 KB pages, so one step over SmolLM2-135M's 483 MB of linear weights crosses about 120,000 pages: as
many TLB misses (each a page walk, a nested one in a virtual machine), and the hardware prefetchers stop
at every page boundary. Copied into anonymous memory advised for 2 MB pages (madvise MADV_HUGEPAGE,
the region 2 MB-aligned so that whole huge pages fit), the same weights span about 250 pages.

    report = to_hugepages(model)    # every parameter and buffer moved into one region, values unchanged
    report["hugepage_bytes"]        # how much of it the kernel really backs with 2 MB pages

Only where the kernel offers them: `supported()` is False off Linux, where Python's mmap lacks
MADV_HUGEPAGE or where /sys/kernel/mm/transparent_hugepage/enabled is [never]; `to_hugepages` then
moves nothing and says why. Memory is only moved, never added: the file-mapped original is released
when no tensor refers to it (its pages are clean, so the kernel drops them).
"""

from __future__ import annotations

import math
import mmap
import re

import torch
from torch import nn

HUGE = 2 << 20  # bytes per huge page (x86-64, arm64 with 4 KB base pages)
ALIGN = 64  # bytes: where each moved tensor starts (a cache line)
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None where unknown."""
    try:
        m = re.search(r"\[(\w+)\]", open(THP_MODE).read())
    except OSError:
        return None
    return m.group(1) if m else None


def supported() -> bool:
    """Whether `empty` can ask for 2 MB pages here: Linux with MADV_HUGEPAGE and THP not [never]."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS") and thp_mode() in ("always", "madvise")


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping advised for 2 MB pages with room for `nbytes` from a 2 MB-aligned
    offset; returns it and that offset (mmap only promises 4 KB alignment, so it is one huge page longer)."""
    if not supported():
        raise RuntimeError("2 MB pages are not available here (see transmla.runtime.hugepages.supported).")
    buf = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return buf, -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % HUGE


def _view(buf: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `buf` from byte `offset`: its own storage (storage_offset 0), which keeps `buf` mapped
    (torch.frombuffer holds it). Own storages, not views of one: safetensors and save_pretrained take
    tensors that share a storage for tied weights."""
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)


def empty_many(specs) -> list[torch.Tensor]:
    """Uninitialised CPU tensors of the (shape, dtype) pairs in `specs`, all in one private anonymous
    mapping advised for 2 MB pages (its first byte 2 MB-aligned), each with its own storage on a cache line
    of its own (aligned vector loads, no false sharing). One mapping, not one per tensor: a tensor's last
    huge page is mostly empty, and small tensors come along without a page each. Raises RuntimeError where
    `supported()` is False, ValueError for an empty shape (no memory to map)."""
    specs = [(tuple(int(n) for n in shape), dtype) for shape, dtype in specs]
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    if not sizes or not all(sizes):
        raise ValueError("hugepages.empty_many: every tensor needs at least one element.")
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf, start = _mapping(total)
    return [_view(buf, start + off, shape, dtype) for (shape, dtype), off in zip(specs, offsets)]


def empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor in a mapping of its own (`empty_many`); the pages are the kernel's to
    give at first touch."""
    return empty_many([(shape, dtype)])[0]


def copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a new contiguous tensor from `empty` (same shape and dtype)."""
    return copy_many([t])[0]


def copy_many(tensors) -> list[torch.Tensor]:
    """Each tensor's values in a new contiguous tensor (same shape and dtype), all in one mapping (`empty_many`)."""
    tensors = list(tensors)
    out = empty_many([(t.shape, t.dtype) for t in tensors])
    for dst, t in zip(out, tensors):
        dst.copy_(t)
    return out


@torch.no_grad()
def to_hugepages(module: nn.Module) -> dict:
    """Move every CPU parameter and buffer of `module` into one mapping of 2 MB pages (`empty_many`), in
    place (`tensor.data` re-pointed: tied weights stay tied, the values are the same bits). Returns
    {"moved": tensors, "bytes": their size, "hugepage_bytes": how much of it the kernel backs with 2 MB
    pages (`hugepage_bytes`, at most "bytes"), "reason": why nothing was moved, or None}."""
    if not supported():
        return {"moved": 0, "bytes": 0, "hugepage_bytes": 0,
                "reason": f"no transparent huge pages here (mode {thp_mode()!r}, Linux madvise needed)"}
    tensors, seen = [], set()
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen and t.device.type == "cpu" and t.numel():
            seen.add(id(t))
            tensors.append(t)
    if not tensors:
        return {"moved": 0, "bytes": 0, "hugepage_bytes": 0, "reason": "no CPU tensors"}
    moved = copy_many(t.data for t in tensors)
    for t, dst in zip(tensors, moved):
        t.data = dst
    nbytes = sum(t.numel() * t.element_size() for t in moved)
    # the mapping's huge pages, less the slack around the tensors (a page of it can be huge too)
    return {"moved": len(tensors), "bytes": nbytes, "hugepage_bytes": min(hugepage_bytes(moved), nbytes), "reason": None}


def hugepage_bytes(tensors) -> int:
    """Bytes of the mappings holding `tensors` that the kernel backs with 2 MB pages now (the
    AnonHugePages of each of those mappings in /proc/self/smaps, each mapping counted once); 0 where
    smaps is not readable."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    if not spans:
        return 0
    total, start, end = 0, None, None
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            a, b = head.split("-")
            start, end = int(a, 16), int(b, 16)
        elif head == "AnonHugePages:" and start is not None:
            if any(start < hi and lo < end for lo, hi in spans):
                total += int(line.split()[1]) * 1024
    return total

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


def _view(buf: mmap.mmap, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over `buf` from byte `offset`: its own storage (storage_offset 0), which keeps `buf` mapped
    (torch.frombuffer holds it). Own storages, not views of one: safetensors and save_pretrained take
    tensors that share a storage for tied weights."""
    shape = tuple(int(n) for n in shape)
    numel = 1
    for n in shape:
        numel *= n
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)


def empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor in a private anonymous mapping advised for 2 MB pages, its first byte
    2 MB-aligned; the pages are the kernel's to give at first touch. Raises RuntimeError where
    `supported()` is False."""
    numel = 1
    for n in shape:
        numel *= int(n)
    buf, start = _mapping(max(1, numel * torch.empty((), dtype=dtype).element_size()))
    return _view(buf, start, shape, dtype)


def copy(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a new contiguous tensor from `empty` (same shape and dtype)."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


@torch.no_grad()
def to_hugepages(module: nn.Module) -> dict:
    """Move every CPU parameter and buffer of `module` into one mapping of 2 MB pages, in place
    (`tensor.data` re-pointed: tied weights stay tied, the values are the same bits). One mapping, not
    one per tensor: a tensor's last huge page is mostly empty, and the small tensors (norms, biases) come
    along without a page each; each tensor still has its own storage. Returns {"moved": tensors, "bytes":
    their size, "hugepage_bytes": how much of it the kernel backs with 2 MB pages (`hugepage_bytes`, at
    most "bytes"), "reason": why nothing was moved, or None}."""
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
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:  # each tensor on a cache line of its own (aligned vector loads; no false sharing)
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf, start = _mapping(total)
    moved = []
    for t, off in zip(tensors, offsets):
        dst = _view(buf, start + off, t.shape, t.dtype)
        dst.copy_(t.data)
        t.data = dst
        moved.append(dst)
    # the mapping's huge pages, less the slack around the tensors (a page of it can be huge too)
    huge = min(hugepage_bytes(moved), sum(sizes))
    return {"moved": len(tensors), "bytes": sum(sizes), "hugepage_bytes": huge, "reason": None}


def hugepage_bytes(tensors) -> int:
    """Bytes of the mappings holding `tensors` that the kernel backs with 2 MB pages now (the
    AnonHugePages of each of those mappings in /proc/self/smaps, each mapping counted once); 0 where
    smaps is not readable."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
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

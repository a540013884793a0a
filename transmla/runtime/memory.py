"""Process memory settings for conversion-sized workloads."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import resource

try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
except OSError:
    _LIBC = None


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc malloc_trim(0)); False where there is none.

    A conversion step allocates and frees many multi-MB activations; glibc then serves them from a
    heap that fragments, and its free pages count in RSS. Trimming after every step keeps RSS near
    the live data for a few percent of time (SmolLM2 default conversion: 54 s untrimmed, 58 s
    trimmed). The alternative, a fixed low mmap threshold (every large allocation its own zero-filled
    mapping), held the same peak but made that conversion 1.5x slower (85 s).
    """
    fn = getattr(_LIBC, "malloc_trim", None)
    return bool(fn(0)) if fn is not None else False


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def reset_peak_rss() -> str:
    """Reset the process's peak RSS (Linux: `echo 5 > /proc/self/clear_refs` resets VmHWM) so the next
    reading is the peak of one run. Returns how peaks are measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return "VmHWM after reset (per-run peak RSS of the whole process, incl. model weights)"
    except OSError:
        return "ru_maxrss (process-lifetime peak RSS: monotone across runs)"


def peak_rss_bytes() -> int:
    """Peak RSS of this process (VmHWM: the peak of its own address space, reset by exec; ru_maxrss
    is not: it inherits the peak of the parent that spawned it, e.g. a benchmark holding a model)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim the range's pages now (clean file pages are dropped, never lost)


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's file-backed mappings (/proc/self/maps lines with a path)."""
    out = []
    try:
        for line in open("/proc/self/maps"):
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                a, b = parts[0].split("-")
                out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def release_pages(tensors) -> int:
    """Drop the resident pages of mmapped (file-backed) tensors from this process's RSS; returns the
    bytes advised (0 off Linux or for tensors in anonymous memory, which are left alone).

    A model loaded from float32 safetensors is mapped from the file, and every page a forward touches
    stays resident. Once a decoder layer is converted, its source weights are not needed until the
    export reads the MLP and norms again, so the in-memory conversion releases them layer by layer
    instead of holding the whole model at its peak. madvise(MADV_PAGEOUT) never changes data: a clean
    file page is re-read from the file on its next access; a page that was written (copy-on-write) is
    not a file page any more and is only paged out to swap, if any. Only whole pages inside a tensor
    are advised, so neighbouring tensors are not touched."""
    fn = getattr(_LIBC, "madvise", None)
    maps = _file_mappings()
    if fn is None or not maps:
        return 0
    import mmap

    page = mmap.PAGESIZE
    done = 0
    for t in tensors:
        a = t.data_ptr()
        b = a + t.numel() * t.element_size()
        if not any(lo <= a and b <= hi for lo, hi in maps):
            continue
        a, b = -(-a // page) * page, b // page * page
        if b > a and fn(ctypes.c_void_p(a), ctypes.c_size_t(b - a), ctypes.c_int(MADV_PAGEOUT)) == 0:
            done += b - a
    return done

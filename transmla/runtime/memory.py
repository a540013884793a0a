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

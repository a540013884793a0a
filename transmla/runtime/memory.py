"""Process memory settings for conversion-sized workloads."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import resource

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 1 << 20


def limit_heap_fragmentation(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of >= `threshold` bytes from their own mappings (returned to the OS when freed).

    glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed; after that the
    calibration's short-lived multi-MB activations come from the heap and fragment it. Measured on
    Qwen2.5-Coder-0.5B (default conversion, 68.75% cut, float32 size 2.35 GiB): peak RSS 4.23 GiB
    with glibc's default, 3.27 GiB with a fixed 64 KiB threshold (a fixed one also stops the dynamic
    adjustment). The price is a page-zeroing mmap per large allocation: SmolLM2 forwards over 2048-token
    windows ran ~20% slower, so only conversions set it. False where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


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

"""runtime.memory.trim_heap: freed heap pages go back to the OS (what keeps a conversion's RSS near its live data)."""

import ctypes

import pytest

from transmla.runtime import memory


@pytest.mark.skipif(getattr(memory._LIBC, "malloc_trim", None) is None, reason="needs glibc's malloc_trim")
def test_trim_heap_returns_fragmented_free_pages():
    libc = memory._LIBC
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    n, size = 1500, 96 * 1024  # below glibc's initial mmap threshold: served from the heap
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touch every page
    for b in blocks[:-1]:
        libc.free(b)  # the last block pins the heap's top: only a trim can return the pages below it
    before = memory.rss_bytes()
    assert memory.trim_heap()
    after = memory.rss_bytes()
    libc.free(blocks[-1])
    assert before - after > n * size // 2, (before, after)

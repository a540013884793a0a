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


def test_release_pages_drops_mapped_weights_and_keeps_their_values(tmp_path):
    """A tensor mapped from a file (as float32 safetensors load) leaves RSS when released and reads back
    the same values; a tensor in anonymous memory is left alone (0 bytes advised, values intact)."""
    import torch

    n = 16 << 20  # 64 MiB of float32
    ref = torch.arange(n, dtype=torch.float32)
    (tmp_path / "w.bin").write_bytes(ref.numpy().tobytes())
    mapped = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=n, dtype=torch.float32)
    assert torch.equal(mapped, ref)  # every page touched: resident
    anon = ref.clone()
    before = memory.rss_bytes()
    assert memory.release_pages([anon]) == 0
    done = memory.release_pages([mapped])
    after = memory.rss_bytes()
    if done == 0:
        pytest.skip("madvise(MADV_PAGEOUT) not available here (Linux >= 5.4)")
    assert done > n * 4 * 0.99
    assert before - after > n * 4 // 2, (before, after)
    assert torch.equal(mapped, ref) and torch.equal(anon, ref)  # re-read from the file; nothing changed

"""The split-K latent decode kernel (transmla/runtime/latent_decode.py) against dense softmax attention:
its PyTorch form always, the Triton kernel in Triton's interpreter where triton is installed (the
test extra installs it; CI has no GPU)."""

import pytest
import torch

from transmla.runtime.latent_decode import choose_splits, latent_decode_torch, merge_splits


def dense(q, latent, rank, scaling, mask=None):
    s = torch.einsum("bhe,bte->bht", q.double(), latent.double()) * scaling
    if mask is not None:
        m = mask.reshape(mask.shape[0], -1)
        s = s.masked_fill(~m[:, None], float("-inf")) if m.dtype == torch.bool else s + m[:, None].double()
    return torch.einsum("bht,btr->bhr", torch.softmax(s, -1), latent[..., :rank].double())


def case(B, h, r, R, T, pad):
    g = torch.Generator().manual_seed(B * 1000 + T)
    q = torch.randn(B, h, r + R, generator=g)
    buf = torch.randn(B, T + 7, r + R, generator=g)  # a preallocated cache: the valid prefix is a strided view
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[0, ..., :pad] = False  # left padding, longer than one tile: some chunks see only masked tokens
    return q, buf[:, :T], mask


SHAPES = [(2, 4, 32, 16, 70, 40), (3, 9, 40, 8, 33, 5), (1, 32, 64, 16, 128, 100)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("masked", ["none", "bool", "additive"])
def test_torch_split_merge_is_exact(shape, splits, masked):
    q, lat, mask = case(*shape)
    m = {"none": None, "bool": mask,
         "additive": torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))}[masked]
    got = latent_decode_torch(q, lat, shape[2], 0.125, m, num_splits=splits, block_t=16)
    assert got.shape == (shape[0], shape[1], shape[2])
    assert (got.double() - dense(q, lat, shape[2], 0.125, m)).abs().max() < 1e-5


_INTERPRETED = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its standard library is jitted on import
sys.path.insert(0, sys.argv[1])
import torch
from tests.test_latent_decode import SHAPES, case, dense
from transmla.runtime.latent_decode import latent_decode, latent_decode_triton
worst = 0.0
for shape in SHAPES:
    q, lat, mask = case(*shape)
    for splits in (1, 3):
        for m in (None, mask):
            for swap in (False, True):  # both product forms
                got = latent_decode_triton(q, lat, shape[2], 0.125, m, num_splits=splits, block_t=16, swap=swap)
                assert got.shape == (shape[0], shape[1], shape[2])
                worst = max(worst, float((got.double() - dense(q, lat, shape[2], 0.125, m)).abs().max()))
    assert torch.allclose(latent_decode(q, lat, shape[2], 0.125, mask), latent_decode_triton(q, lat, shape[2], 0.125, mask))
# the custom op torch.compile sees: schema, fake (meta) implementation and dispatch are consistent
q, lat, mask = case(*SHAPES[0])
torch.library.opcheck(torch.ops.transmla.latent_decode.default, (q, lat, mask, SHAPES[0][2], 0.125),
                      test_utils=("test_schema", "test_faketensor"))
print(worst)
"""


def test_triton_kernel_in_the_interpreter():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (in a subprocess: the
    interpreter must be chosen before triton is first imported)."""
    import subprocess
    import sys
    from pathlib import Path

    import platform

    if platform.system() == "Linux" and platform.machine() == "x86_64":
        import triton  # noqa: F401  (the test extra installs it here: missing is a broken install, not a skip)
    else:
        pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _INTERPRETED, str(root)], capture_output=True, text=True, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


def test_merge_weighs_an_all_masked_chunk_zero():
    m = torch.tensor([[[float("-inf"), 0.5]]])  # [B=1, h=1, S=2]
    l = torch.tensor([[[0.0, 2.0]]])
    acc = torch.tensor([[[[0.0, 0.0], [4.0, 6.0]]]])  # [B, h, S, r=2]
    assert torch.equal(merge_splits(m, l, acc), torch.tensor([[[2.0, 3.0]]]))


def test_num_splits_fills_the_machine_and_never_exceeds_the_tiles():
    # 16 sequences, 264 resident programs: 16 chunks of 16 tiles fill one wave (more chunks need a second)
    assert choose_splits(batch=16, length=8192, block_t=32, resident=264) == 16
    assert choose_splits(batch=1, length=40, block_t=32, resident=264) == 2  # never more chunks than tiles
    assert choose_splits(batch=1, length=8192, block_t=64, resident=264) == 128


def test_wave_model_weighs_tails_and_overheads():
    """choose_splits minimises waves x (tiles per chunk + per-program overhead) over every chunking."""
    from transmla.runtime.latent_decode import OVERHEAD_TILES

    def cost(B, T, bt, res, s):
        tiles = -(-T // bt)
        c = -(-tiles // s)
        return -(-B * -(-tiles // c) // res) * (c + OVERHEAD_TILES)

    for B, T, bt, res in [(16, 8192, 64, 264), (425, 8192, 64, 264), (3, 1000, 64, 132), (64, 4096, 32, 528)]:
        s = choose_splits(B, T, bt, res)
        tiles = -(-T // bt)
        assert 1 <= s <= tiles
        assert cost(B, T, bt, res, s) == min(cost(B, T, bt, res, k) for k in range(1, tiles + 1))
    # a batch that fills the machine twice over: one chunk per sequence beats splitting (fewer partials)
    assert choose_splits(528, 8192, 64, 264) == 1


def _cpu_kernels():
    from transmla.runtime import cpu_kernels

    return cpu_kernels if cpu_kernels.available() else None


CPU_SHAPES = SHAPES + [(1, 17, 13, 3, 700, 600), (2, 16, 512, 64, 300, 0), (8, 9, 32, 16, 4106, 3)]


@pytest.mark.skipif(_cpu_kernels() is None, reason="no AVX2 CPU or no C++ toolchain for the CPU decode kernels")
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("masked", ["none", "one", "per-sequence"])
def test_cpu_kernel_equals_dense(shape, masked):
    """transmla::latent_decode_cpu (csrc/latent_decode.cpp) = dense softmax attention: head counts below,
    at and above one group of 16 (and a group of 1), widths and ranks that are not multiples of 8, a
    strided latent (a view of a larger cache), several key chunks with left padding that masks whole
    chunks, a mask shared by the batch or one per sequence; bad input is refused."""
    kernels = _cpu_kernels()
    q, lat, mask = case(*shape)
    B, T, r = shape[0], shape[4], shape[2]
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).view(B, T)
    m = {"none": None, "one": additive[-1:], "per-sequence": additive}[masked]
    got = kernels.latent_decode(q, lat, m, 0.125, r)
    assert got.shape == (B, shape[1], r)
    want = dense(q, lat, r, 0.125, None if m is None else m.view(m.shape[0], 1, 1, T))
    assert (got.double() - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item())
    if masked == "none":
        with pytest.raises(RuntimeError, match="float32"):
            kernels.latent_decode(q.double(), lat.double(), None, 0.125, r)
        with pytest.raises(RuntimeError, match="rank"):
            kernels.latent_decode(q, lat, None, 0.125, q.shape[-1] + 1)
        with pytest.raises(RuntimeError, match="mask"):
            kernels.latent_decode(q, lat, torch.zeros(1, T + 1), 0.125, r)


@pytest.mark.skipif(_cpu_kernels() is None, reason="no AVX2 CPU or no C++ toolchain for the CPU decode kernels")
@pytest.mark.parametrize("shape", CPU_SHAPES + [(2, 40, 24, 8, 16, 0), (3, 7, 5, 3, 1, 0)])
@pytest.mark.parametrize("masked", ["none", "one", "per-sequence"])
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_blocked_cpu_kernel_equals_dense(shape, masked, isa, monkeypatch):
    """transmla::latent_decode_blocked_cpu (csrc/latent_decode_blocked.cpp) over `block_latent`'s layout =
    dense softmax attention, in its AVX-512 form where the CPU has it and in its AVX2 form (forced by
    TRANSMLA_CPU_NO_AVX512): head counts below and above a group (6 for AVX2, 16 for AVX-512), widths and
    ranks that are not multiples of the register tiles, a length that is not a whole number of blocks
    (the padded keys masked, as a static cache's unused capacity is), whole chunks masked; bad input is
    refused. block_latent / unblock_latent are inverses."""
    kernels = _cpu_kernels()
    if isa == "avx2":
        monkeypatch.setenv("TRANSMLA_CPU_NO_AVX512", "1")
    q, lat, mask = case(*shape)
    B, T, r = shape[0], shape[4], shape[2]
    blocked = kernels.block_latent(lat)
    NB = blocked.shape[1]
    assert blocked.shape == (B, -(-T // kernels.BLOCK), lat.shape[-1], kernels.BLOCK)
    assert torch.equal(kernels.unblock_latent(blocked)[:, :T], lat) and not kernels.unblock_latent(blocked)[:, T:].any()
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")).view(B, T)
    m = {"none": None, "one": additive[-1:], "per-sequence": additive}[masked]
    padded = None if m is None and T == NB * kernels.BLOCK else torch.full((B if m is not None and m.shape[0] == B else 1, NB * kernels.BLOCK), float("-inf"))
    if padded is not None:
        padded[:, :T] = 0.0 if m is None else m
    got = kernels.latent_decode_blocked(q, blocked, padded, 0.125, r)
    assert got.shape == (B, shape[1], r)
    want = dense(q, lat, r, 0.125, None if m is None else m.view(m.shape[0], 1, 1, T))
    assert (got.double() - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item())
    if masked == "none":
        with pytest.raises(RuntimeError, match="float32"):
            kernels.latent_decode_blocked(q.double(), blocked.double(), None, 0.125, r)
        with pytest.raises(RuntimeError, match="rank"):
            kernels.latent_decode_blocked(q, blocked, None, 0.125, q.shape[-1] + 1)
        with pytest.raises(RuntimeError, match="mask"):
            kernels.latent_decode_blocked(q, blocked, torch.zeros(1, NB * kernels.BLOCK + 1), 0.125, r)
        with pytest.raises(RuntimeError, match="NB, E, 16"):
            kernels.latent_decode_blocked(q, lat, None, 0.125, r)

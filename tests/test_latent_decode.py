"""The split-K latent decode kernel (transmla/runtime/latent_decode.py) against dense softmax attention:
its PyTorch form always, the Triton kernel in Triton's interpreter where triton is installed (the
test extra installs it; CI has no GPU)."""

import pytest
import torch

from transmla.runtime.latent_decode import latent_decode_torch, merge_splits, num_splits_for


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
            got = latent_decode_triton(q, lat, shape[2], 0.125, m, num_splits=splits, block_t=16)
            assert got.shape == (shape[0], shape[1], shape[2])
            worst = max(worst, float((got.double() - dense(q, lat, shape[2], 0.125, m)).abs().max()))
    assert torch.allclose(latent_decode(q, lat, shape[2], 0.125, mask), latent_decode_triton(q, lat, shape[2], 0.125, mask))
print(worst)
"""


def test_triton_kernel_in_the_interpreter():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (in a subprocess: the
    interpreter must be chosen before triton is first imported)."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _INTERPRETED, str(root)], capture_output=True, text=True, cwd=root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


def test_merge_weighs_an_all_masked_chunk_zero():
    m = torch.tensor([[[float("-inf")], [0.5]]])  # [B=1, S=2, h=1]
    l = torch.tensor([[[0.0], [2.0]]])
    acc = torch.tensor([[[[0.0, 0.0]], [[4.0, 6.0]]]])
    assert torch.equal(merge_splits(m, l, acc), torch.tensor([[[2.0, 3.0]]]))


def test_num_splits_fills_the_machine_and_never_exceeds_the_tiles():
    assert num_splits_for(batch=16, length=8192, block_t=32, programs=264) == 17
    assert num_splits_for(batch=423, length=8192, block_t=32, programs=264) == 1
    assert num_splits_for(batch=1, length=40, block_t=32, programs=264) == 2

"""The checkpoint writer: safetensors written tensor by tensor, read back by safetensors and transformers."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from transmla.io.export import write_safetensors, write_sharded


def test_streamed_safetensors_round_trip(tmp_path):
    emb = torch.randn(7, 5)
    tensors = {
        "embed": emb,
        "lm_head": emb,  # tied: same storage, written under both names
        "half": torch.randn(3, 4).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(),
        "f64": torch.randn(3).double(),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "i32": torch.arange(3, dtype=torch.int32),
        "view": torch.randn(6, 4)[:, 1:3],  # non-contiguous
        "ids": torch.arange(5),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }
    write_safetensors(tmp_path / "m.safetensors", tensors)
    back = load_file(tmp_path / "m.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k], t), k
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    # byte for byte what safetensors writes (so exports keep their content hashes)
    tensors["lm_head"] = emb.clone()  # save_file refuses shared storage and views
    tensors["view"] = tensors["view"].contiguous()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(TypeError, match="complex"):
        write_safetensors(tmp_path / "m.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})


def test_sharded_layout_matches_hf(tmp_path):
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(6)}
    write_sharded(tmp_path, sd, max_shard_size=40_000)  # 16 KiB each: shards of two tensors
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 3 and index["metadata"]["total_size"] == 6 * 64 * 64 * 4
    back = {}
    for f in files:
        back.update(load_file(tmp_path / f))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

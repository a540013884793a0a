"""The recovery fine-tune in 2 processes (torchrun, gloo, CPU) trains like one process on the same global
batch: the same per-step losses (and their lm / kd parts), validation loss and KL and weights within float
tolerance; rank 0 alone writes."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from transmla.config import ConvertOptions
from transmla.convert import convert

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--corpora", "wikitext2-train", "--max-tokens", "4096", "--seqlen", "64", "--eval-every", "4",
        "--log-every", "1", "--val-tokens", "1024", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory, tiny_tokenizer):
    from conftest import _tiny_model

    d = tmp_path_factory.mktemp("ddp")
    _tiny_model("llama", len(tiny_tokenizer)).save_pretrained(d / "src")
    tiny_tokenizer.save_pretrained(d / "src")
    convert(f"dir:{d / 'src'}", d / "mla", ConvertOptions(qk_rope_dim=4, kv_lora_rank=12, cal_nsamples=8, cal_seqlen=32),
            progress=False)
    return d / "mla"


def _run(cmd, out):
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / "transmla_finetune.json").read_text())


@pytest.mark.parametrize("objective", ["lm", "kd+lm"])
def test_two_processes_train_like_one(tiny_mla, tmp_path, objective):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    args = [*ARGS, "--objective", objective]
    if objective != "lm":  # the validation KL and the logged parts are sums over every process's blocks;
        # 17 validation blocks: the sampler repeats one to fill the last batch of 2 x 4, counted once
        args += ["--teacher", str(tiny_mla.parent / "src"), "--val-tokens", "1088"]
    one = _run([sys.executable, "-m", "transmla.cli", "finetune", "--model", str(tiny_mla), "--out",
                str(tmp_path / "one"), "--batch-size", "8", *args], tmp_path / "one")
    with socket.socket() as sock:  # a free port for the rendezvous (torchrun's port 0 does not pick one)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    two = _run([torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port,
                "-m", "transmla.cli", "finetune", "--model", str(tiny_mla), "--out", str(tmp_path / "two"),
                "--batch-size", "4", *args], tmp_path / "two")
    losses = lambda r: [h["loss"] for h in r["log_history"] if "loss" in h]  # noqa: E731
    assert two["steps"] == one["steps"] == 8 and two["tokens_trained"] == one["tokens_trained"] == 4096
    assert max(abs(a - b) for a, b in zip(losses(one), losses(two), strict=True)) < 1e-4
    assert abs(one["val_loss_after"] - two["val_loss_after"]) < 1e-4
    parts = [k for k in ("lm_loss", "kd_loss") if any(k in h for h in one["log_history"])]
    assert parts == (["lm_loss"] if objective == "lm" else ["lm_loss", "kd_loss"])
    for k in parts:  # each process's part of the batch, averaged over both as `loss` is
        part = lambda r: [h[k] for h in r["log_history"] if "loss" in h]  # noqa: E731
        assert max(abs(a - b) for a, b in zip(part(one), part(two), strict=True)) < 1e-4
    if objective != "lm":
        for k in ("val_kd_before", "val_kd_after"):
            assert one[k] > 0 and abs(one[k] - two[k]) < 1e-4
    assert one["val_loss_after"] < one["val_loss_before"]  # it trained
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)) for k in a) < 1e-4
    assert not list(tmp_path.glob(".two.trainer*"))  # rank 0 cleaned the Trainer checkpoints up

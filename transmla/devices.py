"""Which torch device a run may use: checked before any work, by the CLI (--device) and the flows (params)."""

from __future__ import annotations

from transmla.errors import TransMLAError


def check_device(device: str, setting: str = "--device", pass_cpu: str = "pass --device cpu") -> None:
    """--device (or the params' `setting`) names a torch device this machine has (checked before any weight
    is loaded). pass_cpu: how the fix tells to choose the CPU."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise TransMLAError(f"{setting} {device!r} is not a torch device ({str(e).splitlines()[0]}).",
                            "pass cpu, cuda or cuda:N.") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise TransMLAError(f"{setting} {device}: no such CUDA device here ({torch.cuda.device_count()} visible).",
                            f"{pass_cpu}, or run on a machine with that GPU.")
    if dev.type in ("mps", "xpu"):  # torch parses them on any build: whether this one runs them is another matter
        backend = getattr(torch.backends, "mps") if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            raise TransMLAError(f"{setting} {device}: this machine's torch has no {dev.type} device.",
                                f"{pass_cpu}, or run on a machine with one.")
    elif dev.type not in ("cpu", "cuda"):
        raise TransMLAError(f"{setting} {device!r}: the pipeline runs on cpu or cuda.", "pass cpu or cuda.")


def rank_device(device: str) -> str:
    """The device one process of a distributed launch (torchrun / accelerate launch: LOCAL_RANK set) loads onto:
    a bare `cuda` is that rank's GPU, so N ranks do not all load their models onto GPU 0 first; a GPU index
    would put every rank on that one GPU, and is refused there."""
    import os

    rank = os.environ.get("LOCAL_RANK", "")
    if not rank.isdigit() or not device.startswith("cuda"):
        return device
    if device == "cuda":
        return f"cuda:{int(rank)}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TransMLAError(f"--device {device} in a distributed launch: every rank would load onto that one GPU.",
                            "pass --device cuda (each rank then uses its own GPU, LOCAL_RANK).")
    return device

"""Weights read when they are needed: one decoder layer in memory at a time (layer-streamed conversion).

    ckpt = LazyCheckpoint(model_dir)            safetensors file(s) of a Hugging Face directory, memory-mapped
    model = skeleton(config)                     the model with every parameter on the meta device (buffers real)
    load_module(model.model.layers[i], "model.layers.{i}.", ckpt)   materialise one layer ...
    release_module(model.model.layers[i])        ... and give its memory back

A layer is read from its shard into float32 (the conversion's compute dtype) on `device`; the rest
of the model never leaves the meta device. `tensor(name, dtype)` converts a large tensor in row
blocks, so a float32 source never has a second full-size copy in memory; the embedding table is never
held at all: `rows(name, ids)` reads the rows of the calibration tokens, and `lazy(name, dtype)` is
written to the export straight from the source file, a block of rows at a time.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from torch import nn

from transmla.errors import TransMLAError

INDEX = "model.safetensors.index.json"
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def safetensors_files(model_dir: str | Path) -> list[str] | None:
    """The safetensors files transformers' from_pretrained reads from a folder: model.safetensors first (a sharded
    save_pretrained followed by an unsharded one leaves the old index behind), else the shards its index names;
    None: neither file. A shard the index names but the folder lacks is refused here, not as a missing tensor."""
    d = Path(model_dir)
    if (d / "model.safetensors").is_file():
        return ["model.safetensors"]
    if not (d / INDEX).is_file():
        return None
    try:
        files = sorted(set(json.loads((d / INDEX).read_text()).get("weight_map", {}).values()))
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise TransMLAError(f"{d / INDEX} is not a readable weight index ({e}).",
                            "copy or download the model's model.safetensors.index.json again.") from None
    missing = [f for f in files if not (d / f).is_file()]
    if missing or not files:
        raise TransMLAError(
            f"{d} is missing weight shards named in {INDEX}: "
            f"{', '.join(missing[:3]) or 'its weight_map is empty'}{' ...' if len(missing) > 3 else ''}.",
            "copy or download the missing shard files into the directory.")
    return files


class LazyCheckpoint:
    """The tensors of a safetensors Hugging Face directory (one file or sharded with an index), by name.

    Read with plain file reads, not a memory map: a mapped file's pages count in the process's RSS as
    they are touched, so reading every layer through a map ends with the whole checkpoint resident
    (measured: Qwen2.5-0.5B layer-streamed peaked at 2.9 GiB, 2.0 GB of it the mapped file).
    """

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        # the files from_pretrained reads: both load modes must read the same weights
        files = safetensors_files(self.dir)
        if files is None:
            raise TransMLAError(f"{self.dir} has no safetensors weights (model.safetensors or {INDEX}).",
                                "layer-streamed conversion reads local safetensors: fetch the model first "
                                "(transmla fetch-model SOURCE --out DIR) or use `load: model`.")
        self.entries: dict[str, tuple[Path, int, str, list[int]]] = {}  # name -> (file, data offset, dtype, shape)
        for f in files:
            path = self.dir / f
            n, header = _header(path)
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if e["dtype"] not in _ST_DTYPES:  # F8_E4M3 and the like: a quantized checkpoint read as floats
                    raise TransMLAError(f"{path} stores {name} as {e['dtype']}, which the layer-streamed load does not "
                                        "read (a quantized checkpoint?).",
                                        "convert with `load: model` (transformers dequantizes on load), or from the "
                                        "model's float release.")
                self.entries[name] = (path, 8 + n + e["data_offsets"][0], e["dtype"], e["shape"])
        self.weight_map = {k: v[0].name for k, v in self.entries.items()}

    def names(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self.entries if k.startswith(prefix))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str, dtype: torch.dtype | None = None, device="cpu", block_rows: int = 8192) -> torch.Tensor:
        """One tensor in `dtype` (default: as stored) on `device`; a conversion goes in blocks of rows."""
        path, offset, code, shape = self.entries[name]
        stored = _ST_DTYPES[code]
        dtype = dtype or stored
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        out = torch.empty(shape, dtype=dtype)
        step = rows if dtype == stored else max(1, block_rows)
        with open(path, "rb") as fh:
            fh.seek(offset)
            flat = out.view(-1) if shape else out.view(1)
            for a in range(0, rows, step):
                k = min(step, rows - a) * row_numel
                buf = flat[a * row_numel : a * row_numel + k] if dtype == stored else torch.empty(k, dtype=stored)
                _read_exact(fh, buf, path, name)
                if dtype != stored:
                    flat[a * row_numel : a * row_numel + k] = buf
        return out.to(device)

    def rows(self, name: str, index: torch.Tensor, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """Rows `index` (sorted, unique) of a 2-D tensor: [len(index), cols] in `dtype`, read by seeking
        to each run of consecutive rows (the embedding rows of the calibration tokens, not the table)."""
        path, offset, code, shape = self.entries[name]
        stored = _ST_DTYPES[code]
        row_bytes = shape[1] * stored.itemsize
        idx = index.tolist()
        if idx and not 0 <= idx[0] <= idx[-1] < shape[0]:  # a seek past the table reads other tensors' bytes
            # (the embedding rows of token ids; the tokenizer check lets added special tokens past the table through)
            raise TransMLAError(f"Row {idx[-1] if idx[-1] >= shape[0] else idx[0]} of {name} was asked for; it has "
                                f"{shape[0]} rows (a token id past the embedding table: an added special token in "
                                "the text?).", "remove that token from the text (or use the tokenizer that came with "
                                "these weights).")
        out = torch.empty(len(idx), shape[1], dtype=dtype)
        with open(path, "rb") as fh:
            i = 0
            while i < len(idx):
                j = i + 1
                while j < len(idx) and idx[j] == idx[j - 1] + 1:
                    j += 1
                buf = torch.empty(j - i, shape[1], dtype=stored)
                fh.seek(offset + idx[i] * row_bytes)
                _read_exact(fh, buf, path, name)
                out[i:j] = buf
                i = j
        return out.to(device)

    def lazy(self, name: str, dtype: torch.dtype | None = None, block_rows: int = 8192) -> "LazyTensor":
        """The tensor as something `io.export.write_safetensors` writes from the source file directly."""
        return LazyTensor(self, name, dtype or _ST_DTYPES[self.entries[name][2]], block_rows)


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file; one error for a file that is not one (empty, cut short, or
    overwritten), whose bytes would otherwise be read as weights or fail as a struct/JSON traceback."""
    def damaged(why: str) -> TransMLAError:
        return TransMLAError(f"{path} is not a readable safetensors file ({why}).",
                             "the checkpoint file is damaged or incomplete: fetch the model again.")

    if not path.is_file():
        raise damaged("it is missing")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise damaged(f"{size} bytes, shorter than a header")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise damaged(f"its header claims {n} bytes, past the end of the file")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise damaged("its header is not JSON") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a table of tensors")
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = e["data_offsets"]
            dtype, shape = e["dtype"], e["shape"]
        except (KeyError, TypeError, ValueError):
            raise damaged(f"its entry for {name} has no dtype, shape and data offsets") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end and isinstance(dtype, str)
                and isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
            raise damaged(f"its entry for {name} is malformed")
        if 8 + n + end > size:
            raise damaged(f"it ends inside {name}")
    return n, header


def _read_exact(fh, buf: torch.Tensor, path, name: str) -> None:
    view = buf.view(torch.uint8).numpy().reshape(-1)
    if fh.readinto(view) != view.nbytes:
        raise TransMLAError(f"{path} ends inside {name}.", "the checkpoint file is truncated: fetch it again.")


class LazyTensor:
    """A checkpoint tensor that is written, never held: shape / dtype for the header, `write_to(file)`
    copies it in blocks of rows, converted to `dtype` (bytes equal to writing `ckpt.tensor(name, dtype)`)."""

    def __init__(self, ckpt: LazyCheckpoint, name: str, dtype: torch.dtype, block_rows: int = 8192):
        self.ckpt, self.name, self.dtype, self.block_rows = ckpt, name, dtype, block_rows
        self.shape = torch.Size(ckpt.entries[name][3])

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def write_to(self, f) -> None:
        path, offset, code, shape = self.ckpt.entries[self.name]
        stored = _ST_DTYPES[code]
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        with open(path, "rb") as fh:
            fh.seek(offset)
            for a in range(0, rows, self.block_rows):
                buf = torch.empty(min(self.block_rows, rows - a) * row_numel, dtype=stored)
                _read_exact(fh, buf, path, self.name)
                f.write(memoryview(buf.to(self.dtype).view(torch.uint8).numpy()))


def skeleton(config) -> nn.Module:
    """The model of `config` with its parameters on the meta device (no memory) and its buffers real
    (RoPE frequencies, Gemma's embedding scale), in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    import transmla.models  # noqa: F401  (this package's classes, for converted sources)

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def load_module(module: nn.Module, prefix: str, ckpt: LazyCheckpoint, dtype: torch.dtype = torch.float32,
                device="cpu", tied: dict[str, str] | None = None) -> nn.Module:
    """Materialise every parameter of `module` from `ckpt` (names `prefix` + parameter name); `tied`:
    parameter name -> the checkpoint name it shares (a tied lm_head has no tensor of its own)."""
    state = {}
    for name, _ in module.named_parameters():
        key = (tied or {}).get(name, prefix + name)
        if key not in ckpt:
            raise TransMLAError(f"{key} is missing from {ckpt.dir}.", "the checkpoint does not match its config.json.")
        state[name] = nn.Parameter(ckpt.tensor(key, dtype, device), requires_grad=False)
    for name, p in state.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, p)
    return module


def release_module(module: nn.Module) -> None:
    """Give a materialised module's parameter memory back (they return to the meta device)."""
    for sub in module.modules():
        for leaf, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, leaf, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


def float32_bytes(config) -> int:
    """Bytes of the model's parameters in float32, from its config alone (a meta-device model; tied
    weights counted once)."""
    from transformers import AutoModelForCausalLM

    import transmla.models  # noqa: F401

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) * 4

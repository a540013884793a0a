"""A GGUF file's header (its key/value metadata) without reading a single weight.

A GGUF file starts with its metadata: magic "GGUF", version, tensor count, key/value count, then the
key/value pairs (architecture, head counts, RoPE, tokenizer, ...); the tensors follow. Reading the
header is enough to know whether the converter can handle the model, so an unsupported architecture
is refused in seconds instead of after dequantising the whole file. The reader takes a list of files
read as one stream (a GGUF split into parts: the header lies in the first part, possibly spilling over).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian; v2 and v3).
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from transmla.errors import TransMLAError

# value type id -> struct format of a scalar (8 = string, 9 = array: handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 64  # arrays longer than this (tokenizer vocabularies) are skipped, only their length kept


class _Chain:
    """Sequential reads across several files, as if they were concatenated."""

    def __init__(self, paths: list[str | os.PathLike]):
        self.paths, self.i, self.f = list(paths), 0, None
        self.total = self.left = sum(os.path.getsize(p) for p in self.paths)

    def read(self, n: int) -> bytes:
        if n > self.left:  # a corrupt length (2^62) would otherwise be allocated first: MemoryError, not EOF
            raise EOFError
        self.left -= n
        out = bytearray()
        while len(out) < n:
            if self.f is None:
                if self.i >= len(self.paths):
                    break
                self.f = open(self.paths[self.i], "rb")  # noqa: SIM115 (closed below)
            chunk = self.f.read(n - len(out))
            if not chunk:
                self.f.close()
                self.f, self.i = None, self.i + 1
                continue
            out += chunk
        if len(out) < n:
            raise EOFError
        return bytes(out)

    def close(self):
        if self.f is not None:
            self.f.close()


def _unpack(s: BinaryIO, fmt: str):
    return struct.unpack("<" + fmt, s.read(struct.calcsize(fmt)))[0]


def _string(s: BinaryIO) -> str:
    return s.read(_unpack(s, "Q")).decode("utf-8", errors="replace")


def _value(s: BinaryIO, vtype: int):
    if vtype in _SCALAR:
        return _unpack(s, _SCALAR[vtype])
    if vtype == _STRING:
        return _string(s)
    if vtype == _ARRAY:
        etype, n = _unpack(s, "I"), _unpack(s, "Q")
        if n > _KEEP_ARRAY:
            if etype in _SCALAR:  # skip in one read
                s.read(n * struct.calcsize(_SCALAR[etype]))
            else:
                for _ in range(n):
                    _value(s, etype)
            return {"array_length": n}
        return [_value(s, etype) for _ in range(n)]
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_metadata(paths: str | os.PathLike | list) -> dict:
    """{key: value} of a GGUF file's header, plus "__tensor_names__" and "__tensor_shapes__" (no data).

    Long arrays (the tokenizer's vocabulary) come back as {"array_length": n}.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    s = _Chain(paths)
    try:
        if s.read(4) != b"GGUF":
            raise TransMLAError(f"{paths[0]} is not a GGUF file (no GGUF magic).", "give the path of a .gguf file.")
        raw = s.read(4)
        version = struct.unpack("<I", raw)[0]
        if version not in (2, 3) and struct.unpack(">I", raw)[0] in (2, 3):
            # GGUF has no byte-order flag: a big-endian file (s390x builds) shows as a huge version number
            raise TransMLAError(
                f"{paths[0]} is a big-endian GGUF (byte-swapped; version {struct.unpack('>I', raw)[0]} read "
                "big-endian); only little-endian GGUF files are loaded.",
                f"convert it: gguf-convert-endian {paths[0]} little (from the gguf package; it rewrites the file "
                "in place, so work on a copy).")
        if version not in (2, 3):
            raise TransMLAError(f"GGUF version {version} of {paths[0]} is not supported.", "use a GGUF v2 or v3 file.")
        n_tensors, n_kv = _unpack(s, "Q"), _unpack(s, "Q")
        meta = {}
        for _ in range(n_kv):
            key = _string(s)
            meta[key] = _value(s, _unpack(s, "I"))
        names, shapes, extents = [], [], []
        for _ in range(n_tensors):  # tensor infos: name, n_dims, dims, type, offset (the data comes later)
            names.append(_string(s))
            n_dims = _unpack(s, "I")
            shapes.append(struct.unpack(f"<{n_dims}Q", s.read(8 * n_dims)))
            extents.append((_unpack(s, "I"), _unpack(s, "Q")))  # (ggml type, offset into the data section)
        meta["__tensor_names__"] = names
        meta["__tensor_shapes__"] = shapes
        _check_data_extent(paths, s.total, meta, s.total - s.left, extents)
        return meta
    except (EOFError, struct.error, ValueError) as e:
        raise TransMLAError(f"Could not read the GGUF header of {paths[0]} ({str(e) or 'truncated'}).",
                            "check that the file is a complete GGUF file.") from e
    finally:
        s.close()


def _check_data_extent(paths: list, total: int, meta: dict, header_end: int, extents: list[tuple[int, int]]) -> None:
    """Refuse a file (or set of parts) that ends before its last tensor's data: a cut download passed the
    header, so a dry run called it fine and the load failed deep inside transformers' GGUF reader."""
    import math

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1:
        return
    start = -(-header_end // align) * align  # the data section begins at the next multiple of the alignment
    need, last = 0, None
    for name, shape, (kind, offset) in zip(meta["__tensor_names__"], meta["__tensor_shapes__"], extents):
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):  # a type this gguf release does not know: its size is unknown
            return
        end = start + offset + math.prod(shape) // block * size
        if end > need:
            need, last = end, name
    if need > total:
        what = f"{paths[0]}" if len(paths) == 1 else f"The GGUF split in {len(paths)} parts ({paths[0]} ... {paths[-1]})"
        raise TransMLAError(f"{what} is truncated: its tensors need {need:,} bytes (up to the end of {last}), "
                            f"the file{'s hold' if len(paths) > 1 else ' holds'} {total:,}.",
                            "download the GGUF file again (a complete copy).")


def parameter_count(meta: dict) -> int:
    """Parameters of the model a GGUF header describes: the element counts of its tensors (a tied output
    head is stored once, as in the loaded model)."""
    import math

    return sum(math.prod(d) for d in meta.get("__tensor_shapes__", ()))


# GGUF architecture name -> transformers model_type (llama.cpp files Mistral and Mixtral as "llama").
_MODEL_TYPE = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss"}


def _length(value) -> int | None:
    """The length of a header array (read_metadata returns a long one as {"array_length": n})."""
    if isinstance(value, dict):
        return value.get("array_length")
    return len(value) if isinstance(value, (list, tuple)) else None


def config_from_metadata(meta: dict) -> dict:
    """The config fields the converter's checks read (transformers names), from GGUF metadata."""
    arch = meta.get("general.architecture", "")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    model_type = _MODEL_TYPE.get(arch, arch)
    if arch == "llama" and (a("expert_count") or 0) > 0:
        model_type = "mixtral"
    elif arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"
    cfg = {
        "model_type": model_type,
        "num_attention_heads": a("attention.head_count"),
        # llama.cpp writes head_count_kv only when the HF config had num_key_value_heads, and reads its
        # absence as one KV head per query head: so does transformers' config, so do the checks here
        "num_key_value_heads": a("attention.head_count_kv", a("attention.head_count")),
        "hidden_size": a("embedding_length"),
        "num_hidden_layers": a("block_count"),
        "head_dim": a("attention.key_length"),
        "num_local_experts": a("expert_count"),
        "sliding_window": a("attention.sliding_window"),
        "rope_theta": a("rope.freq_base"),
        # what a dry run's plan sizes besides attention (without them transformers' defaults would stand in)
        "intermediate_size": a("feed_forward_length"),
        "vocab_size": a("vocab_size", _length(meta.get("tokenizer.ggml.tokens"))),
        "max_position_embeddings": a("context_length"),
    }
    names = meta.get("__tensor_names__")
    if names and "token_embd.weight" in names:  # llama.cpp writes no output.weight for tied embeddings
        cfg["tie_word_embeddings"] = "output.weight" not in names
    rtype = a("rope.scaling.type")
    if rtype and rtype != "none":
        cfg["rope_parameters"] = {"rope_type": rtype, "factor": a("rope.scaling.factor")}
    elif "rope_freqs.weight" in meta.get("__tensor_names__", ()):
        # llama.cpp stores Llama-3.1-style scaling as per-frequency factors in this tensor
        cfg["rope_parameters"] = {"rope_type": "llama3"}
    return {k: v for k, v in cfg.items() if v is not None}


SAFETENSORS_FIX = "convert the model's safetensors release instead (hf:ORG/NAME, or a local folder with its config.json)."


def loader_drops(meta: dict) -> str | None:
    """What transformers' GGUF loader would leave out of this file, so that it loads (and converts, exactly)
    another model than the one llama.cpp runs; None when nothing known is dropped. Its config mapping
    rebuilds RoPE scaling for gpt-oss alone, and maps experts for no "llama" file (llama.cpp's Mixtral:
    the MoE layers would load uninitialised)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = meta.get("general.architecture", "")
    shards = meta.get("split.count") or 0
    if isinstance(shards, int) and shards > 1:  # transformers reads the one file it is given
        return (f"it is part {int(meta.get('split.no') or 0) + 1} of a llama.cpp split GGUF of {shards} files: "
                "transformers' GGUF loader reads one file, so the other parts' tensors would be missing")
    experts = meta.get(f"{arch}.expert_count") or 0
    # only llama.cpp's "llama" files carry experts transformers cannot map (its qwen2moe / qwen3moe have mappings,
    # and those families are refused by the converter's own checks, with their own reasons)
    if experts > 0 and arch == "llama" and "expert_count" not in GGUF_CONFIG_MAPPING.get("llama", {}):
        return (f"transformers' GGUF loader maps no experts for a {arch!r} file, and this one has {experts} "
                "(llama.cpp's Mixtral): its MoE layers would load uninitialised")
    rtype = meta.get(f"{arch}.rope.scaling.type")
    typed = rtype not in (None, "", "none")
    if arch != "gpt-oss" and (typed or "rope_freqs.weight" in meta.get("__tensor_names__", ())):
        what = f"{rtype} x{meta.get(f'{arch}.rope.scaling.factor')}" if typed else \
            "per-frequency factors in rope_freqs.weight, as llama.cpp stores Llama-3.1-style scaling"
        return (f"transformers' GGUF loader drops this file's RoPE scaling ({what}): the model would load with "
                "plain RoPE, not the one llama.cpp runs")
    return None


def check_loadable(meta: dict, path) -> None:
    """loader_drops as an error naming the file and the fix."""
    dropped = loader_drops(meta)
    if dropped:
        merge = "merge the parts into one file first (llama-gguf-split --merge FIRST_PART.gguf MERGED.gguf), or "
        raise TransMLAError(f"{path}: {dropped}.", (merge if "split GGUF" in dropped else "") + SAFETENSORS_FIX)

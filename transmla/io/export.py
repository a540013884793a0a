"""Export: a stock DeepSeek-V3 checkpoint directory (transformers `DeepseekV3ForCausalLM`, vLLM).

Written to a temporary sibling directory and renamed into place, so a failed export never leaves a
half-written model behind.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

from transmla.adapters import GQASpec
from transmla.errors import TransMLAError
from transmla.io.paths import atomic_dir, check_output
from transmla.method.rope import inv_freq, is_standard, longrope_parameters


def original_inv_freq(spec: GQASpec) -> torch.Tensor:
    """The original model's inverse frequencies, scaling included, as transformers computes them. [d/2]"""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(spec.rope_parameters or {"rope_type": "default", "rope_theta": spec.rope_theta})
    if rp.get("rope_type", "default") == "default":
        return inv_freq(spec.rope_theta, spec.d)
    cfg = LlamaConfig(hidden_size=spec.h * spec.d, num_attention_heads=spec.h, head_dim=spec.d,
                      max_position_embeddings=spec.max_position_embeddings, rope_parameters=rp)
    return ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu")[0].to(torch.float64)


def export_rope_parameters(spec: GQASpec, plan: list[int]) -> dict:
    """rope_parameters of the exported RoPE head (dim 2*len(plan)), carrying exactly the planned
    original frequencies.

    A standard plan keeps every c-th frequency with the same base, and linear / llama3 scaling is a
    function of each frequency alone (no head-dim constant), so the original parameters carry over
    unchanged (servable by vLLM). Any other plan gets LongRoPE factors solved against the original's
    scaled frequencies (transformers only).
    """
    # partial_rotary_factor: the MLA RoPE head rotates all of its R dims, whatever the original's key said (the
    # families converted here rotate the whole head; a stray key is ignored by their default RoPE, not by vLLM's)
    rp = {k: v for k, v in (spec.rope_parameters or {}).items()
          if k not in ("type", "partial_rotary_factor") and v is not None}
    rp.setdefault("rope_type", "default")
    rp["rope_theta"] = spec.rope_theta
    if is_standard(plan, spec.d):
        return rp
    return longrope_parameters(plan, spec.rope_theta, spec.d, spec.max_position_embeddings,
                               target=original_inv_freq(spec)[plan])


def deepseek_config(
    spec: GQASpec, plan: list[int], kv_lora_rank: int, q_lora_rank: int | None, attention_bias: bool, dtype: str
) -> dict:
    """config.json fields for an all-dense DeepSeek-V3 model with the given MLA shapes."""
    from transformers import DeepseekV3Config

    from transmla.models import Gemma2MLAConfig, Gemma3MLAConfig, MixtralMLAConfig, Qwen3MLAConfig

    R = 2 * len(plan)
    if spec.model_type in ("gemma2", "gemma3_text"):  # Gemma's own layers, MLA attention (transmla.models)
        keep = {k: v for k, v in spec.original_config.items()
                if k not in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")}
        mla = dict(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=R, qk_nope_head_dim=spec.d,
                   v_head_dim=spec.d, rope_plan=list(plan), rope_interleave=True)
        if spec.model_type == "gemma2":
            cfg = Gemma2MLAConfig(**keep, **mla)
        else:
            cfg = Gemma3MLAConfig(**keep, **mla, qk_norm_groups=spec.g, qk_norm_eps=spec.rms_norm_eps)
        cfg.architectures = [f"{type(cfg).__name__[:-len('Config')]}ForCausalLM"]
        cfg.dtype = dtype
        return cfg
    rope = export_rope_parameters(spec, plan)
    # Mixtral: the same MLA fields, every MLP Mixtral's own sparse MoE (transmla.models), experts verbatim
    cls, extra = (MixtralMLAConfig, {"n_routed_experts": spec.moe["num_local_experts"],
                                   "num_experts_per_tok": spec.moe["num_experts_per_tok"],
                                   "router_jitter_noise": spec.moe["router_jitter_noise"]}) if spec.moe else (DeepseekV3Config, {})
    if spec.qk_norm:  # Qwen3: the QK-norm's constants (transmla.models.Qwen3MLAAttention)
        cls, extra = Qwen3MLAConfig, {"qk_norm_groups": spec.g, "qk_norm_eps": spec.rms_norm_eps}
    cfg = cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.D,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.h,
        num_key_value_heads=spec.h,
        # Every layer dense; the MoE fields stay valid integers (transformers 5 rejects null).
        first_k_dense_replace=spec.n_layers,
        **({"n_routed_experts": 1, "num_experts_per_tok": 1} | extra),
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=R,
        qk_nope_head_dim=spec.d,
        v_head_dim=spec.d,
        hidden_act=spec.hidden_act,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=attention_bias,
        bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
    )
    cfg.architectures = ["Qwen3MLAForCausalLM" if spec.qk_norm else "MixtralMLAForCausalLM" if spec.moe
                         else "DeepseekV3ForCausalLM"]
    cfg.dtype = dtype
    return cfg


def check_state_dict(config, state_dict: dict[str, torch.Tensor]) -> None:
    """The tensors must be exactly those of the config's class (DeepseekV3ForCausalLM, or a class of
    transmla.models), with the same shapes."""
    from transmla.models import causal_lm_class

    with torch.device("meta"):
        if getattr(config, "model_type", None) == "deepseek_v2":
            ref = _deepseek_v2_moe_reference(config)
        else:
            ref = causal_lm_class(config)(config).state_dict()
    missing = sorted(set(ref) - set(state_dict))
    extra = sorted(set(state_dict) - set(ref))
    bad = [k for k in ref if k in state_dict and tuple(ref[k].shape) != tuple(state_dict[k].shape)]
    if missing or extra or bad:
        raise RuntimeError(f"export mismatch: missing={missing[:5]} extra={extra[:5]} shape={bad[:5]}")


def _deepseek_v2_moe_reference(config) -> dict[str, torch.Tensor]:
    """Tensors of a DeepSeek-V2 MoE checkpoint as vLLM reads it (runtime.serving's layout of a Mixtral
    export): transformers' DeepseekV2ForCausalLM names, experts under DeepSeek's per-expert names
    (transformers stacks them only when loading), one shared expert."""
    from transformers import DeepseekV2ForCausalLM

    if config.n_shared_experts != 1 or config.first_k_dense_replace != 0:
        raise RuntimeError("only the all-MoE DeepSeek-V2 layout with one shared expert is written here")
    ref = DeepseekV2ForCausalLM(config).state_dict()
    E, D, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        for k in [k for k in ref if k.startswith(p + "experts.")]:
            del ref[k]
        for e in range(E):
            for name, shape in (("gate_proj", (inter, D)), ("up_proj", (inter, D)), ("down_proj", (D, inter))):
                ref[f"{p}experts.{e}.{name}.weight"] = torch.empty(shape, device="meta")
    return ref


def instantiate(config, state_dict: dict[str, torch.Tensor]):
    """The converted model in memory (no disk round trip), as stock DeepseekV3ForCausalLM (or the
    config's class of transmla.models)."""
    from transmla.models import causal_lm_class

    check_state_dict(config, state_dict)
    emb, head = state_dict["model.embed_tokens.weight"], state_dict["lm_head.weight"]
    if not config.tie_word_embeddings and head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr():
        state_dict = {**state_dict, "lm_head.weight": head.clone()}  # an untied model owns its lm_head
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    model.load_state_dict(state_dict, assign=True, strict=True)
    # non-persistent buffers were created on meta and are not in the state dict: RoPE's, Gemma 3's embedding scale
    model.model.rotary_emb.__init__(config)
    for m in model.modules():
        if isinstance(getattr(m, "embed_scale", None), torch.Tensor) and m.embed_scale.is_meta:
            m.embed_scale = torch.tensor(float(m.scalar_embed_scale))
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:  # a class with a buffer this does not know: a bug here, named rather than a device error later
        raise TransMLAError(f"instantiate left buffers uninitialised: {', '.join(left[:3])}.",
                            "report it; meanwhile save the export and load it with from_pretrained.")
    return model.eval()


# safetensors' dtype codes, in the order of its Rust Dtype enum (its writer sorts by it, see below)
_ST_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
_ST_RANK = {dt: i for i, dt in enumerate(_ST_DTYPES)}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written one tensor at a time.

    safetensors.torch.save_file first copies the whole file's bytes into memory (a second copy of the
    weights); this writes the same bytes (8-byte header length, JSON header, data; tensors ordered by
    dtype, widest first, then name, as safetensors orders them) from the tensors' own memory, so an
    export is byte-identical to one written by save_file. Tensors may share storage (a tied lm_head
    is written twice). A value with `write_to(file)` (io.lazy.LazyTensor: a source tensor never held in
    memory) writes its own bytes.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; this writer does not byte-swap")
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors code here")
    tensors = dict(sorted(tensors.items(), key=lambda kv: (-_ST_RANK[kv[1].dtype], kv[0])))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if hasattr(t, "write_to"):
                t.write_to(f)
            elif t.numel():  # .cpu(): a conversion on a GPU exports from there (one tensor at a time)
                f.write(memoryview(t.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy()))


def write_sharded(out: Path, state_dict: dict[str, torch.Tensor], max_shard_size: str = "5GB") -> None:
    """HF's sharded layout (huggingface_hub plans the shards; index.json when more than one), written
    with write_safetensors: no copy of the weights in memory."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        write_safetensors(out / filename, {k: state_dict[k] for k in names})
    if split.is_sharded:
        total = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {**split.metadata, "total_size": total}, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def read_generation(folder: str | Path):
    """The GenerationConfig a model folder holds (generation_config.json), None without one or with one that does
    not load (transformers' own model load falls back from it the same way: the conversion goes on, with a warning)."""
    from transformers import GenerationConfig

    if not (Path(folder) / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        print(f"[transmla] warning: {folder}/generation_config.json does not load ({' '.join(str(e).split())[:200]}); "
              "the export carries no generation settings", file=sys.stderr)
        return None


def _write_record(tmp: Path, config, tokenizer, metadata: dict, generation=None) -> None:
    config.transmla = {k: v for k, v in metadata.items() if k != "layers"}  # per-layer details: report file
    config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    # the source's generation settings where its authors wrote them (stop tokens, sampling defaults: an instruct
    # model's second stop token lives only there, so without it even a lossless export generated differently);
    # one transformers derived from config.json says nothing the export's own config does not derive again
    if generation is not None and not getattr(generation, "_from_model_config", False):
        generation.save_pretrained(tmp)
    (tmp / "transmla_report.json").write_text(json.dumps(metadata, indent=2, default=str))


def write_checkpoint(out: str | Path, config, state_dict: dict[str, torch.Tensor], tokenizer, metadata: dict,
                     replace: bool = False, generation=None) -> Path:
    """Write config + safetensors + tokenizer + metadata atomically to `out`. replace: `out` is a pipeline
    output the run owns (a DVC out), replaced whole; otherwise a non-empty `out` is refused. generation: the
    source model's GenerationConfig (written where its authors set it, `_write_record`)."""
    out = Path(out) if replace else check_output(out)
    check_state_dict(config, state_dict)
    with atomic_dir(out) as tmp:
        write_sharded(tmp, state_dict)
        _write_record(tmp, config, tokenizer, metadata, generation)
    return out


def write_checkpoint_parts(out: str | Path, parts, n_parts: int, finish, generation=None) -> Path:
    """Write a checkpoint whose tensors arrive in parts, one shard each, atomically to `out`.

    parts: an iterator of {name: tensor} dicts (layer-streamed conversion: one decoder layer per part,
    computed while the previous one is already on disk); n_parts: how many it yields; finish(): called
    once they are written, returns (config, tokenizer, metadata). Written as HF's sharded layout
    (model-0000k-of-0000N.safetensors + index), checked against the config's class like `write_checkpoint`
    (generation: as there).
    """
    out = check_output(out)
    with atomic_dir(out) as tmp:
        weight_map, shapes, total = {}, {}, 0
        for k, part in enumerate(parts):
            if k >= n_parts:
                raise RuntimeError(f"more than the {n_parts} announced parts")
            name = f"model-{k + 1:05d}-of-{n_parts:05d}.safetensors"
            write_safetensors(tmp / name, part)
            for key, t in part.items():
                weight_map[key] = name
                shapes[key] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                total += t.numel() * t.element_size()
            del part
        if len(set(weight_map.values())) != n_parts:
            raise RuntimeError(f"{len(set(weight_map.values()))} parts written, {n_parts} announced")
        config, tokenizer, metadata = finish()
        check_state_dict(config, shapes)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        _write_record(tmp, config, tokenizer, metadata, generation)
    return out

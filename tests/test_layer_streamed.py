"""Layer-streamed conversion (ConvertOptions.load = "layers", transmla/io/lazy.py): one decoder layer in
memory at a time, the same conversion as in memory (tensors and log-probs within float tolerance)."""

import json

import pytest
import torch
from safetensors import safe_open

from transmla.config import ConvertOptions
from transmla.convert import convert
from transmla.errors import TransMLAError
from transmla.io.lazy import LazyCheckpoint, float32_bytes, load_module, release_module, skeleton
from transmla.io.sources import load_model

MODES = {
    "default": {},  # sequential calibration, attention-aware, refit
    "paper": {"attention_aware": False, "calibration": "parallel", "refit": False},
    "parallel+refit": {"calibration": "parallel", "refit": True},
}


def _tensors(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] if (
        d / "model.safetensors.index.json").is_file() else None
    files = sorted(set(index.values())) if index else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(d / f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _logprobs(d, ids):
    model, _ = load_model(f"dir:{d}")
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), -1)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_layer_streamed_equals_in_memory(tiny_model_dir, tmp_path, mode):
    kw = dict(qk_rope_dim=4, kv_lora_rank=12, cal_nsamples=8, cal_seqlen=32, cal_batch_size=3, **MODES[mode])
    mem = tmp_path / "mem"
    lay = tmp_path / "lay"
    r_mem = convert(f"dir:{tiny_model_dir}", mem, ConvertOptions(**kw), progress=False)
    r_lay = convert(f"dir:{tiny_model_dir}", lay, ConvertOptions(load="layers", **kw), progress=False)
    assert r_lay["options"]["load"] == "layers" and r_mem["options"]["load"] == "model"
    assert all(isinstance(r["compute_cpu_seconds"], float) for r in (r_lay, r_mem))  # both paths report CPU time
    a, b = _tensors(mem), _tensors(lay)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4), (k, float((a[k] - b[k]).abs().max()))
    # one shard per decoder layer + one for the embeddings, norm and head
    index = json.loads((lay / "model.safetensors.index.json").read_text())
    n_layers = json.loads((lay / "config.json").read_text())["num_hidden_layers"]
    assert len(set(index["weight_map"].values())) == n_layers + 1
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    assert (_logprobs(mem, ids) - _logprobs(lay, ids)).abs().max() < 1e-4


def test_lazy_modules_load_and_release(tiny_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = skeleton(cfg)
    assert all(p.is_meta for p in model.parameters())
    ckpt = LazyCheckpoint(tiny_model_dir)
    layer = model.model.layers[1]
    load_module(layer, "model.layers.1.", ckpt)
    ref, _ = load_model(f"dir:{tiny_model_dir}")
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.model.layers[1].named_parameters(), strict=True):
        assert not p.is_meta and torch.equal(p, q), name
    release_module(layer)
    assert all(p.is_meta for p in layer.parameters())
    emb = ckpt.tensor("model.embed_tokens.weight", torch.bfloat16, block_rows=7)  # converted in row blocks
    assert torch.equal(emb, ref.model.embed_tokens.weight.to(torch.bfloat16))
    assert float32_bytes(cfg) == 4 * sum(p.numel() for p in {id(p): p for p in ref.parameters()}.values())


def test_two_pass_cannot_stream_layers():
    with pytest.raises(TransMLAError, match="two_pass"):
        ConvertOptions(load="layers", calibration="two_pass")


@pytest.mark.parametrize("kw", [{"lossless": True}, {"method": "mha2mla", "kv_cache_ratio": 0.25}], ids=["lossless", "mha2mla"])
def test_layer_streamed_lossless_and_mha2mla(tiny_model_dir, tmp_path, kw):
    """The two modes whose options normalize to parallel calibration stream too (their check of two_pass once
    normalized the options inside their own validator: a RecursionError), equal to the in-memory export."""
    cal = dict(cal_nsamples=8, cal_seqlen=32, cal_batch_size=3, **kw)
    convert(f"dir:{tiny_model_dir}", tmp_path / "mem", ConvertOptions(**cal), progress=False)
    convert(f"dir:{tiny_model_dir}", tmp_path / "lay", ConvertOptions(load="layers", **cal), progress=False)
    a, b = _tensors(tmp_path / "mem"), _tensors(tmp_path / "lay")
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in a)


def test_missing_weights_named(tmp_path):
    with pytest.raises(TransMLAError, match="safetensors"):
        LazyCheckpoint(tmp_path)


def test_both_load_modes_read_the_weights_from_pretrained_reads(tmp_path, tiny_tokenizer):
    """A sharded save_pretrained then an unsharded one into the same folder leaves the old index (its shards
    removed): `--load layers` read the index first and failed on the missing shards; with the shards kept it read
    other weights than `--load model` (transformers reads model.safetensors first), exit 0 both ways."""
    import shutil

    from conftest import _tiny_model

    a, b = _tiny_model("llama", len(tiny_tokenizer), seed=1), _tiny_model("llama", len(tiny_tokenizer), seed=2)
    d, kept = tmp_path / "m", tmp_path / "kept"
    a.save_pretrained(d, max_shard_size="100KB")
    tiny_tokenizer.save_pretrained(d)
    shutil.copytree(d, kept)
    b.save_pretrained(d)
    name = "model.layers.0.self_attn.q_proj.weight"
    for case in ("stale index", "both layouts"):
        if case == "both layouts":
            for shard in kept.glob("model-*.safetensors"):
                shutil.copy(shard, d / shard.name)
        assert (d / "model.safetensors.index.json").is_file()
        model, _ = load_model(str(d))
        assert torch.equal(model.state_dict()[name], b.state_dict()[name])
        assert torch.equal(LazyCheckpoint(d).tensor(name), b.state_dict()[name]), case


def test_a_quantized_checkpoint_is_refused_by_the_layer_streamed_load(tmp_path, tiny_tokenizer, capsys):
    """An FP8 checkpoint (float8 blocks + scales): the layer-streamed load stopped on a bare KeyError 'F8_E4M3' after
    the calibration data was read; now one error before any work, naming --load model (which dequantizes); an F8
    tensor without a quantization_config is refused by the reader itself."""
    from conftest import _tiny_model
    from safetensors.torch import load_file, save_file

    from transmla.cli import main

    src = tmp_path / "fp8"
    _tiny_model("llama", len(tiny_tokenizer)).save_pretrained(src)
    tiny_tokenizer.save_pretrained(src)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TransMLAError, match="stores model.layers.0.self_attn.q_proj.weight as F8_E4M3.*load: model"):
        LazyCheckpoint(src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    out = tmp_path / "o"
    assert main(["convert", "--model", str(src), "--out", str(out), "--load", "layers", "--kv-cache-ratio", "0.5",
                 "--cal-nsamples", "4", "--cal-seqlen", "32"]) == 2
    err = capsys.readouterr().err
    assert "is quantized (fp8)" in err and "--load model" in err and "Traceback" not in err, err
    assert not out.exists()


LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def test_plan_counts_every_layers_statistics_where_calibration_collects_them_at_once():
    """parallel / two_pass calibration hold all layers' D x D float64 input moments beside the model until the
    export (Llama-2-7B: 4 GiB); sequential one layer's at a time."""
    from transmla.convert import config_spec, check_request
    from transmla.pipeline.plan import GIB, conversion_plan

    spec = config_spec(LLAMA2_7B)
    rates = {"matmul_flops_per_s": 1e11, "eigh_float64_flops_per_s": 1e10}
    mem = {}
    for cal in ("sequential", "parallel", "two_pass"):
        o = ConvertOptions(kv_cache_ratio=0.0703125, calibration=cal, refit=False)
        mem[cal] = conversion_plan(spec, check_request(spec, o), o, rates).peak_memory_gib["load_model"]
    held = 32 * (4096 * 4096 + 4096) * 8 / GIB
    # two_pass and sequential both stream the hidden states: they differ by the held statistics alone
    assert abs(mem["two_pass"] - mem["sequential"] - held) < 0.01 and mem["parallel"] > mem["sequential"]


def test_dry_run_plans_a_7b_from_its_config_alone(tmp_path, capsys):
    """A 7B-shaped config and no weights: the plan (shapes, KV cache, memory of both load modes, time)."""
    from transmla.cli import main

    src = tmp_path / "llama2-7b"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(LLAMA2_7B))
    out = tmp_path / "out"
    rc = main(["convert", "--model", str(src), "--out", str(out), "--kv-cache-ratio", "0.0703125",
               "--dtype", "bfloat16", "--load", "layers", "--dry-run"])
    assert rc == 0 and not out.exists()
    captured = capsys.readouterr()
    plan = json.loads(captured.out)
    assert (plan["qk_rope_head_dim"], plan["kv_lora_rank"]) == (64, 512)  # the paper's Llama-2-7B setting
    assert abs(plan["parameters"] - 6_738_415_616) < 1e6  # Llama-2-7B's published count
    mem = plan["peak_memory_gib"]
    assert mem["this_run"] == mem["load_layers"] < mem["load_model"] / 5  # one layer at a time
    assert mem["load_model"] > plan["float32_gib"] > 25
    assert plan["estimated_seconds"] > 0 and "92.97% smaller" in captured.err


def test_dry_run_refuses_what_convert_refuses(tmp_path, capsys):
    from transmla.cli import main

    src = tmp_path / "moe"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**LLAMA2_7B, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}))
    assert main(["convert", "--model", str(src), "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    assert "qwen2_moe" in capsys.readouterr().err.lower()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gemma2"])
def test_layer_streamed_other_architectures(tmp_path, tiny_tokenizer, arch):
    """QK-norm (Qwen3), Gemma 3 (sliding + global layer types: the stream starts after reading the
    layers before the first global one) and Gemma 2 (soft-capping) stream layer by layer to the same export."""
    from tests import test_architectures as ta

    src = {"qwen3": ta._tiny_qwen3, "gemma3": ta._tiny_gemma3, "gemma2": ta._tiny_gemma2}[arch](tmp_path, tiny_tokenizer)
    kw = dict(qk_rope_dim=8, kv_lora_rank=12, cal_nsamples=8, cal_seqlen=40, cal_batch_size=4)
    mem, lay = tmp_path / "mem", tmp_path / "lay"
    convert(str(src), mem, ConvertOptions(**kw), progress=False)
    convert(str(src), lay, ConvertOptions(load="layers", **kw), progress=False)
    a, b = _tensors(mem), _tensors(lay)
    assert sorted(a) == sorted(b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, worst
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (_logprobs(mem, ids) - _logprobs(lay, ids)).abs().max() < 1e-4


def test_renamed_checkpoint_tensors_are_refused_before_work(tmp_path, tiny_tokenizer, monkeypatch):
    """Mixtral's checkpoint stores per-expert tensors that transformers fuses on load: load=layers is
    refused with the fix, before the calibration data is read, and no output is left."""
    import transmla.convert as conv
    from tests import test_architectures as ta

    src = ta._tiny_mixtral(tmp_path, tiny_tokenizer)
    monkeypatch.setattr(conv, "calibration_windows", lambda *a, **k: pytest.fail("calibration data was read"))
    out = tmp_path / "out"
    with pytest.raises(TransMLAError, match="--load model"):
        convert(str(src), out, ConvertOptions(load="layers", qk_rope_dim=8, kv_lora_rank=12), progress=False)
    assert not out.exists()
    # the dry run refuses it too (it printed a plan and exited 0, for a run that then refused)
    from transmla.cli import main

    assert main(["convert", "--model", str(src), "--out", str(out), "--load", "layers", "--qk-rope-dim", "8",
                 "--kv-lora-rank", "12", "--dry-run"]) == 2
    assert not out.exists()


def test_embedding_rows_and_lazy_tensors_equal_the_stored_tensor(tiny_model_dir, tmp_path):
    """The stream reads only the calibration tokens' embedding rows; the export writes the table from the
    source file in row blocks: the same rows, and the same file bytes as writing the loaded tensor."""
    from transmla.io.export import write_safetensors
    from transmla.io.lazy import LazyCheckpoint

    ckpt = LazyCheckpoint(tiny_model_dir)
    name = "model.embed_tokens.weight"
    full = ckpt.tensor(name, torch.float32)
    idx = torch.tensor([0, 1, 2, 7, 9, 10, full.shape[0] - 1])  # runs of consecutive rows and single rows
    assert torch.equal(ckpt.rows(name, idx), full[idx])
    norm = ckpt.tensor("model.norm.weight")
    for dtype in (torch.float32, torch.bfloat16):
        write_safetensors(tmp_path / "held.safetensors", {"e": ckpt.tensor(name, dtype), "n": norm})
        write_safetensors(tmp_path / "lazy.safetensors", {"e": ckpt.lazy(name, dtype, block_rows=3), "n": norm})
        assert (tmp_path / "held.safetensors").read_bytes() == (tmp_path / "lazy.safetensors").read_bytes()


def test_layer_streamed_hub_source_reads_its_revision(tmp_path, monkeypatch):
    """hf:ORG/NAME@REV streamed layer by layer downloads that revision (the in-memory path did, this one read
    the default branch while the record named @REV), and the files the in-memory path downloads."""
    import time

    import huggingface_hub

    from transmla.convert import convert_layer_streamed
    from transmla.io import sources

    calls = []

    class Downloaded(Exception):
        pass

    def snapshot_download(repo, **kw):
        calls.append((repo, kw.get("revision")))
        # the file set of every other hub load: its chat template, not Mistral's second copy of the weights
        assert kw.get("allow_patterns") == sources.HUB_FILES and kw.get("ignore_patterns") == sources.HUB_SKIP
        raise Downloaded

    monkeypatch.setattr(sources, "materialize", lambda src, cache=None: sources.parse_source(src).location)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(Downloaded):
        convert_layer_streamed("hf:org/model@v1.0", tmp_path / "out", ConvertOptions(load="layers"), {},
                               time.perf_counter(), progress=False)
    assert calls == [("org/model", "v1.0")] and not (tmp_path / "out").exists()

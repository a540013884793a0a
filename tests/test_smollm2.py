"""Tests on the real SmolLM2-135M-Instruct, loaded from its GGUF PyPI package."""

import math

import pytest
import torch

from transmla.evaluation.perplexity import wikitext2_perplexity
from transmla.io.sources import materialize

pytestmark = pytest.mark.slow


def test_loads_from_gguf_package(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (576, 9, 3, 30)
    assert model.dtype == torch.float32
    assert "transmla_source.json" in {p.name for p in __import__("pathlib").Path(materialize("smollm2-135m")).iterdir()}


def test_greedy_paris(smollm2):
    model, tok = smollm2
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_wikitext_ppl_16k(smollm2):
    model, tok = smollm2
    res = wikitext2_perplexity(model, tok, seqlen=2048, max_tokens=16384, progress=False)
    assert res["windows"] == 8
    assert math.isfinite(res["ppl"]) and res["ppl"] < 40

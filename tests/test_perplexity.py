import math

import pytest
import torch

from transmla.errors import TransMLAError
from transmla.evaluation.perplexity import perplexity, tokenize_corpus, wikitext2_perplexity
from transmla.io.sources import load_model


def test_perplexity_matches_hf_loss(tiny_model_dir):
    """Window NLL summed over predicted tokens equals HF's own mean loss, window by window."""
    model, tok = load_model(str(tiny_model_dir))
    ids = torch.randint(0, len(tok), (3 * 32 + 5,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, ids, seqlen=32, progress=False)
    assert res["windows"] == 3 and res["tokens"] == 96 and res["predicted"] == 3 * 31
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in ids[:96].view(3, 32)]
    assert res["nll"] == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(sum(losses) / 3), rel=1e-5)
    # max_tokens evaluates a prefix: one window only.
    assert perplexity(model, ids, seqlen=32, max_tokens=40, progress=False)["windows"] == 1


def test_perplexity_rejects_too_few_tokens(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    with pytest.raises(TransMLAError, match="fewer than one window"):
        perplexity(model, torch.arange(10), seqlen=32, progress=False)


def test_wikitext_joins_rows_with_blank_lines(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    res = wikitext2_perplexity(model, tok, seqlen=64, max_tokens=256, progress=False)
    assert res["windows"] == 4 and math.isfinite(res["ppl"])
    assert res["corpus_tokens"] == tokenize_corpus(tok, ["a", "b"]).numel() or res["corpus_tokens"] > 10_000

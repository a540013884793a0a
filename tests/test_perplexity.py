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
    # rows joined by a blank line (what the GPTQ/paper protocol reads), read back through the tokenizer
    assert tok.decode(tokenize_corpus(tok, ["a b", "c"]), skip_special_tokens=True) == "a b\n\nc"
    from transmla.io.data import load_texts

    texts = load_texts("wikitext2-test")
    assert len(texts) == 4358  # the test split's rows, empty ones included
    assert res["corpus_tokens"] == len(tok("\n\n".join(texts)).input_ids), "the whole split, tokenized once"


def test_windows_past_the_models_positions_are_warned_not_refused(tiny_model_dir, recwarn):
    """A window longer than max_position_embeddings (512 here) runs (extrapolation can be the point) with one
    warning naming the setting and the limit; a window inside it runs silently. So do finetune's blocks."""
    import warnings

    from transmla.config import FinetuneConfig
    from transmla.training.finetune import check_mla_model

    model, _ = load_model(str(tiny_model_dir))
    assert model.config.max_position_embeddings == 512
    ids = torch.randint(0, 100, (2 * 520,), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        perplexity(model, ids, seqlen=512, progress=False)
    with pytest.warns(UserWarning, match=r"seqlen 520 is longer than the model's max_position_embeddings \(512\)"):
        res = perplexity(model, ids, seqlen=520, progress=False)
    assert res["windows"] == 2 and math.isfinite(res["ppl"])
    mla = type("MLA", (), {"config": type("C", (), {"model_type": "deepseek_v3", "max_position_embeddings": 512})()})
    with pytest.warns(UserWarning, match="seqlen 1024 is longer"):
        check_mla_model(mla, FinetuneConfig(seqlen=1024))

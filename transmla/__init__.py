"""TransMLA: convert GQA models to DeepSeek-style multi-head latent attention.

Python API (the CLI is a thin layer over it):

    from transmla import ConvertOptions, convert, load_model, wikitext2_perplexity
    convert("smollm2-135m", "out/mla", ConvertOptions(kv_cache_ratio=0.125, freqfold=4))
    model, tok = load_model("out/mla")
    print(wikitext2_perplexity(model, tok, max_tokens=65536)["ppl"])
"""

from transmla.convert import ConvertOptions, convert
from transmla.errors import TransMLAError
from transmla.evaluation.perplexity import wikitext2_perplexity
from transmla.io.sources import load_model

__all__ = ["ConvertOptions", "TransMLAError", "convert", "load_model", "wikitext2_perplexity"]

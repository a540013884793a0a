"""TransMLA: convert GQA models to DeepSeek-style multi-head latent attention.

Python API (the CLI is a thin layer over it):

    from transmla import ConvertOptions, convert, load_model, wikitext2_perplexity
    convert("smollm2-135m", "out/mla", ConvertOptions(kv_cache_ratio=0.125, freqfold=4))
    model, tok = load_model("out/mla")
    print(wikitext2_perplexity(model, tok, max_tokens=65536)["ppl"])

Layout: `method/` the paper's math on tensors, `pipeline/` the conversion steps, `convert.py` runs
them, `io/` sources, data sets and checkpoints, `runtime/` absorb decoding, throughput and vLLM
serving, `evaluation/` perplexity and benchmarks, `training/` the recovery fine-tune,
`config.py` every option with its default.

The names below load on first use, so importing one submodule never imports the whole package
(the pipeline's cache keys hash exactly the modules a step imports).
"""

import importlib

_API = {
    "ConvertOptions": "transmla.config",
    "TransMLAError": "transmla.errors",
    "convert": "transmla.convert",
    "load_model": "transmla.io.sources",
    "wikitext2_perplexity": "transmla.evaluation.perplexity",
}
__all__ = sorted(_API)


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'transmla' has no attribute {name!r}")

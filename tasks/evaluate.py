"""Stage 5: evaluation. WikiText-2 perplexity and the six Table-1 benchmarks (lm-eval), cached on
the evaluated model's content hash, so a byte-identical re-conversion is not evaluated twice."""

from __future__ import annotations

from transmla.evaluation.benchmarks import evaluate
from transmla.evaluation.perplexity import dataset_perplexity
from transmla.evaluation.prompts import NEW_TOKENS

from .artifacts import cached_task, dir_ref, save_json, task_dir
from .model import data_dir_of


@cached_task("perplexity")
def perplexity(model: dict, data: dict, seqlen: int = 2048, max_tokens: int | None = None,
               dtype: str = "float32", device: str = "cpu") -> dict:
    """WikiText-2 test perplexity of a model directory -> ref to {"ppl", "tokens", ...}."""
    from transmla.io.sources import load_model

    m, tok = load_model(model["path"], dtype=dtype, device=device)
    return save_json("ppl", dataset_perplexity(m, tok, data["name"], seqlen, max_tokens, data_dir_of(data),
                                                 revision=data.get("revision")))


@cached_task("case_study")
def case_study(model: dict, new_tokens: int = NEW_TOKENS, dtype: str = "float32", device: str = "cpu") -> dict:
    """Greedy continuations of the paper's case-study prompts (Table 6) -> ref to [{prompt, continuation, ...}]."""
    from transmla.evaluation.prompts import case_study as run
    from transmla.io.sources import load_model

    m, tok = load_model(model["path"], dtype=dtype, device=device)
    return save_json("case_study", {"rows": run(m, tok, new_tokens=new_tokens)})


@cached_task("benchmarks")
def benchmarks(model: dict, data: list[dict], tasks: list[str], limit: int | None, batch_size: int = 8,
               seed: int = 1234, dtype: str = "float32", device: str = "cpu", protocol: str = "paper",
               limits: dict[str, int] | None = None, backend: dict | None = None,
               superset: dict[str, int] | None = None, engine: dict | None = None) -> dict:
    """lm-eval zero-shot on the local benchmark files -> ref to a dir with results.json + samples/.
    backend: {"backend", "tensor_parallel", "data_parallel", "parallelize"} (None: lm-eval's HF model here);
    superset: benchmark -> docs of a larger sample containing the shared one (the reference row);
    engine: the vLLM environment the vllm backend runs in (runtime.vllm_env.environment), in the key only."""
    d = task_dir()
    evaluate(model["path"], tasks=tuple(tasks), limit=limit, batch_size=batch_size, seed=seed, dtype=dtype,
             device=device, out_dir=d, data_dir=data_dir_of(data[0]), protocol=protocol, limits=limits,
             superset=superset, **(backend or {}))
    return dir_ref(d)

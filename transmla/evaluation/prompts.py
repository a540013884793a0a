"""Short-prompt check: greedy continuations, scored by a reference model and by their repetition.

Perplexity averages over long windows and one kind of text; a conversion can look moderate there and
still answer a short prompt with " 1000000000000000000". Measured on Qwen2.5-Coder-0.5B, that was the
calibration text's domain (code), not the early positions: the NLL gap to the original grows with the
position on prose (reports/ablation/qwen2.5-coder-0.5b-positions.md). So every conversion is also asked
a few short prompts (the paper's case-study four plus a code prompt):

    nll        mean negative log-likelihood of the continuation under the *original* model (nats/token):
               low = text the original model finds plausible
    repetition 1 - distinct tokens / tokens of the continuation: ~0.1-0.3 for prose, -> 1 for a loop
    degenerate repetition > 0.5 or one token repeated 8 times in a row
    loop       seq-rep-4 (Welleck et al. 2019): 1 - distinct 4-grams / 4-grams of the continuation.
               Unlike `repetition` it does not fire on a list of numbers (" 1, 2, 3, 5, 7, 11, 13,": few
               distinct tokens, no repeated 4-gram) and still fires on a phrase loop ("I am a developer.
               I am a developer. ..."); `loops` counts continuations with loop > 0.5 or a run of 8
"""

from __future__ import annotations

import torch

PROMPTS = (
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
    "def fibonacci(n):",
)
CASE_STUDY = PROMPTS[:4]  # the paper's case study (Table 6)
NEW_TOKENS = 24


def _has_run(ids: list[int], n: int = 8) -> bool:
    """One token repeated n times in a row."""
    return _longest_run(ids) >= n


def _longest_run(ids: list[int]) -> int:
    best = run = 1 if ids else 0
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


@torch.no_grad()
def greedy_continuations(model, tokenizer, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Token ids of each prompt's greedy continuation (exactly `new_tokens`; EOS does not stop it).

    Plain greedy search whatever the model's generation_config.json says (a repetition penalty, an n-gram
    ban, sampling): an original ships that file and its export does not, so the rows would otherwise not be
    decoded alike; only its EOS ids are read (the tokens min_new_tokens holds back)."""
    from transformers import GenerationConfig

    # generate() fills every setting its arguments leave unset from model.generation_config: a plain one
    # in its place for these calls (a GenerationConfig passed to generate() would be filled the same way)
    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id)
    out = []
    try:
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids.to(next(model.parameters()).device)
            gen = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            out.append(gen[0, ids.shape[1]:].tolist())
    finally:
        model.generation_config = own
    return out


@torch.no_grad()
def score_continuations(reference, tokenizer, continuations: list[list[int]], prompts=PROMPTS) -> list[dict]:
    """Per prompt: the text, the reference model's mean NLL of the continuation, repetition, degenerate."""
    rows = []
    device = next(reference.parameters()).device
    for p, cont in zip(prompts, continuations, strict=True):
        ids = tokenizer(p, return_tensors="pt").input_ids[0].tolist()
        full = torch.tensor([ids + cont], device=device)
        logp = torch.log_softmax(reference(full).logits[0, :-1].float(), -1)
        nll = -logp[len(ids) - 1:].gather(1, full[0, len(ids):, None]).mean().item()
        rows.append({"prompt": p, "continuation": tokenizer.decode(cont), "nll": round(nll, 4),
                     "repetition": round(repetition(cont), 4), "degenerate": is_degenerate(cont),
                     **loop_fields(cont)})
    return rows


def repetition(cont: list[int]) -> float:
    return 1 - len(set(cont)) / max(len(cont), 1)


def is_degenerate(cont: list[int]) -> bool:
    return repetition(cont) > 0.5 or _has_run(cont)


def loop_rate(cont: list[int], n: int = 4) -> float:
    """seq-rep-n: 1 - distinct n-grams / n-grams (0 for a continuation shorter than n)."""
    grams = [tuple(cont[i : i + n]) for i in range(len(cont) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def loop_fields(cont: list[int]) -> dict:
    """A continuation's seq-rep-4 and whether it loops (seq-rep-4 > 0.5 or one token 8 times in a row)."""
    rate = loop_rate(cont)
    return {"loop": round(rate, 4), "loops": rate > 0.5 or _has_run(cont)}


@torch.no_grad()
def case_study(model, tokenizer, prompts=CASE_STUDY, new_tokens: int = NEW_TOKENS) -> list[dict]:
    """The paper's case study: each prompt's greedy continuation with its repetition and degenerate flag
    (no reference model needed)."""
    conts = greedy_continuations(model, tokenizer, prompts, new_tokens)
    return [{"prompt": p, "continuation": tokenizer.decode(c), "repetition": round(repetition(c), 4),
             "degenerate": is_degenerate(c)} for p, c in zip(prompts, conts, strict=True)]


def summary(rows: list[dict]) -> dict:
    """Mean NLL, mean repetition, the number of degenerate continuations and of looping ones."""
    n = len(rows)
    return {"prompt_nll": round(sum(r["nll"] for r in rows) / n, 4),
            "prompt_repetition": round(sum(r["repetition"] for r in rows) / n, 4),
            "prompt_degenerate": sum(bool(r["degenerate"]) for r in rows),
            "prompt_loops": sum(bool(r["loops"]) for r in rows)}

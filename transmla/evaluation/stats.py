"""Samples and uncertainty for the Table-1 benchmarks.

A benchmark column is a mean accuracy over documents. Scoring a sample of them estimates the full
benchmark's score; the table must say how well, and differences between methods must be read against
it. Here:

    sample_plan    seeded docs per task, each task drawn with its own generator (adding or removing a
                   task never changes another task's documents); MMLU stratified by subject with
                   proportional allocation, so its weight_by_size mean estimates the full one; optionally
                   a superset of that sample for the reference row (more documents, same ones included)
    estimate       weighted mean and standard error of per-document scores x_i (weights w_i = the
                   document's stratum share N_h/N over its stratum's sampled count n_h):
                       est = sum_i w_i x_i,   se^2 = n/(n-1) sum_i w_i^2 (x_i - est)^2
                   (= s^2/n for a simple random sample; conservative for a stratified one)
    paired         the same for d_i = x_i(model) - x_i(reference) on the same documents: methods scored
                   on one sample differ by far less noise than two independent samples would
    average        the six-column mean (ARC = mean of Easy and Challenge) with its standard error,
                   columns independent

No I/O: per-document scores come from the evaluation's sample logs (transmla.evaluation.benchmarks).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


def task_rng(seed: int, task: str) -> random.Random:
    """The generator of one task's sample: seeded by (seed, task), independent of the other tasks."""
    return random.Random(f"{seed}/{task}")  # str seeds hash with sha512: stable across runs and platforms


def allocate(sizes: dict[str, int], n: int, floors: dict[str, int] | None = None) -> dict[str, int]:
    """Proportional allocation of n draws over strata (largest remainder), capped by each stratum's size;
    when n >= the number of strata every non-empty stratum gets at least one draw. floors: a least count per
    stratum (sum <= n), so a larger sample holds a smaller one's counts: largest remainders alone gave a
    stratum fewer draws at 57 than at 47, and the superset that topped it up came out larger than asked."""
    total = sum(sizes.values())
    if n >= total:
        return dict(sizes)
    least = floors or {}
    if any(f > sizes[k] for k, f in least.items()) or sum(least.values()) > n:
        raise ValueError(f"floors {least} exceed the strata's sizes or n={n}")
    quota = {k: n * v / total for k, v in sizes.items()}
    out = {k: max(least.get(k, 0), min(sizes[k], math.floor(q))) for k, q in quota.items()}
    floor = 0
    # (only where it leaves room for the floors: a superset keeps its base sample first)
    if n >= sum(max(1 if v else 0, least.get(k, 0)) for k, v in sizes.items()):
        floor = 1
        for k, v in sizes.items():
            if v and not out[k]:
                out[k] = 1
    # largest remainders first; ties broken by name so the plan is deterministic
    order = sorted(sizes, key=lambda k: (-(quota[k] - math.floor(quota[k])), k))
    i = 0
    while sum(out.values()) < n:
        k = order[i % len(order)]
        if out[k] < sizes[k]:
            out[k] += 1
        i += 1
    while sum(out.values()) > n:  # the minimum-one rule (or the floors) overshot: take back from the largest
        k = max((k for k in out if out[k] > max(floor, least.get(k, 0))), key=lambda k: (out[k] - quota[k], k))
        out[k] -= 1
    return out


def sample_plan(strata: dict[str, dict[str, int]], n: int | None, seed: int,
                overrides: dict[str, int] | None = None,
                superset: dict[str, int] | None = None) -> dict[str, list[int]] | None:
    """Document indices per lm-eval task. strata: benchmark -> {lm-eval task: number of docs} (MMLU: one
    task per subject; the others: one task). n: docs per benchmark (None: every doc, no plan);
    overrides: benchmark -> its own n; superset: benchmark -> a larger number of docs that contains the
    plan's own (the reference row of a table scores its absolute level on more documents, while every
    row's differences to it stay paired on the shared ones). Within each task the added documents are a
    simple random sample of the rest (own generator), so base + added is one of the whole task: the
    stratified estimate stays unbiased with the superset's per-task counts."""
    if n is None:
        return None
    plan: dict[str, list[int]] = {}
    for bench, sizes in strata.items():
        base = allocate(sizes, (overrides or {}).get(bench, n))
        big = allocate(sizes, max((superset or {}).get(bench, 0), sum(base.values())), floors=base)
        for task, k in sorted(base.items()):
            docs = task_rng(seed, task).sample(range(sizes[task]), k)
            rest = sorted(set(range(sizes[task])) - set(docs))
            extra = max(0, big[task] - k)
            plan[task] = sorted(docs + (task_rng(seed, task + "/superset").sample(rest, extra) if extra else []))
    return plan


@dataclass(frozen=True)
class Estimate:
    value: float
    se: float
    n: int

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(self.value + other.value, math.hypot(self.se, other.se), self.n + other.n)

    def scale(self, c: float) -> "Estimate":
        return Estimate(c * self.value, abs(c) * self.se, self.n)

    def as_dict(self) -> dict:
        return {"value": self.value, "se": self.se, "n": self.n}


def estimate(scores: dict[str, dict[int, float]], sizes: dict[str, int]) -> Estimate:
    """Weighted mean and standard error of per-document scores. scores: stratum -> {doc index: score};
    sizes: stratum -> its full number of docs (the weights N_h / N)."""
    total = sum(sizes[h] for h in scores)
    xs, ws = [], []
    for h, docs in scores.items():
        if not docs:
            continue
        w = sizes[h] / total / len(docs)
        xs += list(docs.values())
        ws += [w] * len(docs)
    n = len(xs)
    if n == 0:
        raise ValueError("no scored documents")
    s = sum(ws)
    ws = [w / s for w in ws]  # strata without scores drop out: renormalise
    est = sum(w * x for w, x in zip(ws, xs))
    var = n / (n - 1) * sum(w * w * (x - est) ** 2 for w, x in zip(ws, xs)) if n > 1 else float("nan")
    return Estimate(est, math.sqrt(var), n)


def paired(model: dict[str, dict[int, float]], reference: dict[str, dict[int, float]], sizes: dict[str, int]) -> Estimate:
    """model - reference on the documents both scored (the same sample), with the paired standard error."""
    missing = {h: sorted(set(d) ^ set(reference.get(h, {}))) for h, d in model.items()}
    missing = {h: m for h, m in missing.items() if m}
    if missing or set(reference) - set(model):
        raise ValueError(f"paired difference needs the same documents; differing: {missing or set(reference) - set(model)}")
    return estimate({h: {i: x - reference[h][i] for i, x in d.items()} for h, d in model.items()}, sizes)


def average(columns: dict[str, Estimate]) -> Estimate:
    """The Table-1 average: mean of MMLU, ARC (= mean of arc_easy and arc_challenge), PIQA, HellaSwag,
    OpenBookQA, WinoGrande; every one of them must be present (a missing column is an error, never a
    smaller denominator)."""
    need = ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande")
    missing = [c for c in need if c not in columns]
    if missing:
        raise ValueError(f"the average needs every Table-1 benchmark; missing {missing}")
    arc = (columns["arc_easy"] + columns["arc_challenge"]).scale(0.5)
    six = [columns[c] for c in ("mmlu", "piqa", "hellaswag", "openbookqa", "winogrande")] + [arc]
    tot = six[0]
    for e in six[1:]:
        tot = tot + e
    return tot.scale(1 / 6)


def docs_for_average_se(target_se: float, p: float = 0.5) -> int:
    """Docs per benchmark so that the six-column average's standard error is at most target_se (a
    fraction) when every benchmark's accuracy is p (0.5: the worst case): var = p(1-p)/n * (5 + 1/2)/36."""
    return math.ceil(p * (1 - p) * 5.5 / 36 / target_se**2)


# The average's weight on each benchmark's sampling variance: ARC is the mean of its two sets (1/2)^2.
AVERAGE_WEIGHTS = {"mmlu": 1.0, "arc_easy": 0.25, "arc_challenge": 0.25, "piqa": 1.0, "hellaswag": 1.0,
                   "openbookqa": 1.0, "winogrande": 1.0}


def worst_case_average_se(docs: dict[str, int], p: float = 0.5) -> float:
    """The six-column average's standard error when every benchmark's accuracy is p and benchmark b is
    scored on docs[b] documents: sqrt(p(1-p)/36 sum_b w_b / n_b)."""
    return math.sqrt(p * (1 - p) / 36 * sum(w / docs[b] for b, w in AVERAGE_WEIGHTS.items()))


def cost_optimal_docs(cost: dict[str, float], target_se: float, p: float = 0.5,
                      sizes: dict[str, int] | None = None, floors: dict[str, int] | None = None) -> dict[str, int]:
    """Docs per benchmark that make the six-column average's standard error at most target_se (a fraction)
    when every benchmark's accuracy is p (0.5: the worst case), at the least scoring time sum_b cost_b n_b.

    var(average) = p(1-p)/36 sum_b w_b / n_b (w: AVERAGE_WEIGHTS); minimising sum_b cost_b n_b under a
    bound on it gives n_b proportional to sqrt(w_b / cost_b) (Neyman allocation with costs): cheap
    benchmarks get more documents, expensive ones fewer (with equal costs each ARC set gets half as many as
    the others: it carries a quarter of their weight). cost: seconds (or tokens) per document; sizes caps
    a benchmark at its number of documents, floors holds one at a minimum (a column that must be precise
    on its own); the others share what is left of the bound. Rounded up, so the bound holds."""
    if set(cost) != set(AVERAGE_WEIGHTS):
        raise ValueError(f"cost must name exactly {sorted(AVERAGE_WEIGHTS)}, got {sorted(cost)}")
    if min(cost.values()) <= 0 or target_se <= 0:
        raise ValueError("costs and target_se must be positive")
    sizes, floors = sizes or {}, floors or {}
    budget = 36 * target_se**2 / (p * (1 - p))  # the bound on sum_b w_b / n_b
    fixed: dict[str, int] = {}
    while True:
        free = [b for b in AVERAGE_WEIGHTS if b not in fixed]
        left = budget - sum(AVERAGE_WEIGHTS[b] / n for b, n in fixed.items())
        if left <= 0:
            raise ValueError(f"target_se={target_se} is out of reach with {fixed}")
        scale = sum(math.sqrt(AVERAGE_WEIGHTS[b] * cost[b]) for b in free) / left
        n = {b: scale * math.sqrt(AVERAGE_WEIGHTS[b] / cost[b]) for b in free}
        bind = {b: sizes[b] for b in free if n[b] > sizes.get(b, math.inf)}
        bind |= {b: floors[b] for b in free if n[b] < floors.get(b, 0)}
        if not bind:
            return {b: fixed.get(b) or math.ceil(n[b] - 1e-9) for b in AVERAGE_WEIGHTS}
        fixed |= bind

"""Table-1 sampling and uncertainty (transmla.evaluation.stats): pure functions, no model."""

import math
import random
import statistics

import pytest

from transmla.evaluation.stats import (Estimate, allocate, average, docs_for_average_se, estimate, paired,
                                       sample_plan)


def test_allocation_is_proportional_and_complete():
    sizes = {f"s{i}": n for i, n in enumerate([100, 300, 12, 7, 581, 1])}
    for n in (6, 50, 200, 1001):
        a = allocate(sizes, n)
        assert sum(a.values()) == n
        assert all(0 < a[k] <= sizes[k] for k in sizes)  # n >= strata: every stratum drawn
        total = sum(sizes.values())
        assert all(abs(a[k] - n * sizes[k] / total) <= 1.0 + 1e-9 or a[k] == 1 for k in sizes)
    assert allocate(sizes, 10_000) == sizes  # more than there is: everything
    assert sum(allocate(sizes, 3).values()) == 3


def test_a_tasks_sample_does_not_depend_on_the_other_tasks():
    strata = {"piqa": {"offline_piqa": 1838}, "mmlu": {"offline_mmlu_a": 100, "offline_mmlu_b": 300}}
    both = sample_plan(strata, 40, seed=7)
    alone = sample_plan({"piqa": strata["piqa"]}, 40, seed=7)
    assert both["offline_piqa"] == alone["offline_piqa"]
    assert len(both["offline_mmlu_a"]) == 10 and len(both["offline_mmlu_b"]) == 30  # proportional
    assert sample_plan(strata, 40, seed=7) == both  # deterministic
    assert sample_plan(strata, 40, seed=8)["offline_piqa"] != both["offline_piqa"]
    assert sample_plan(strata, None, seed=7) is None


def test_estimate_of_a_simple_sample_is_the_mean_and_binomial_se():
    rng = random.Random(0)
    x = {i: float(rng.random() < 0.3) for i in range(200)}
    e = estimate({"t": x}, {"t": 1000})
    assert e.value == pytest.approx(statistics.mean(x.values()))
    assert e.se == pytest.approx(statistics.stdev(x.values()) / math.sqrt(200))
    assert e.n == 200


def test_stratified_estimate_weights_subjects_by_their_full_size():
    # every doc scored: the estimate is the full benchmark's weight_by_size mean, not the mean over subjects
    scores = {"a": {i: 1.0 for i in range(10)}, "b": {i: 0.0 for i in range(30)}}
    e = estimate(scores, {"a": 10, "b": 30})
    assert e.value == pytest.approx(0.25)
    # a proportional sample of it is unbiased: the mean over many seeded samples approaches 0.25
    rng = random.Random(1)
    full = {"a": [float(rng.random() < 0.8) for _ in range(100)], "b": [float(rng.random() < 0.2) for _ in range(300)]}
    truth = (sum(full["a"]) + sum(full["b"])) / 400
    plans = [sample_plan({"mmlu": {"a": 100, "b": 300}}, 40, seed=s) for s in range(300)]
    ests = [estimate({h: {i: full[h][i] for i in p[h]} for h in p}, {"a": 100, "b": 300}).value for p in plans]
    assert statistics.mean(ests) == pytest.approx(truth, abs=0.01)
    # and its standard error covers the spread of those estimates (conservative, within 25%)
    se = estimate({h: {i: full[h][i] for i in plans[0][h]} for h in plans[0]}, {"a": 100, "b": 300}).se
    assert 0.75 * statistics.stdev(ests) < se < 1.6 * statistics.stdev(ests)


def test_paired_difference_is_the_difference_with_a_smaller_error():
    rng = random.Random(2)
    ref = {"t": {i: float(rng.random() < 0.5) for i in range(300)}}
    # the model agrees with the reference on 90% of docs: correlated scores
    model = {"t": {i: (x if rng.random() < 0.9 else 1.0 - x) for i, x in ref["t"].items()}}
    sizes = {"t": 300}
    d = paired(model, ref, sizes)
    a, b = estimate(model, sizes), estimate(ref, sizes)
    assert d.value == pytest.approx(a.value - b.value)
    assert d.se < 0.5 * math.hypot(a.se, b.se)
    with pytest.raises(ValueError, match="same documents"):
        paired({"t": {0: 1.0, 1: 0.0}}, {"t": {0: 1.0, 2: 1.0}}, sizes)


def test_average_needs_every_column_and_halves_arc():
    cols = {c: Estimate(v, 0.03, 100) for c, v in zip(
        ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande"),
        (0.3, 0.6, 0.3, 0.7, 0.4, 0.35, 0.5))}
    avg = average(cols)
    assert avg.value == pytest.approx((0.3 + 0.45 + 0.7 + 0.4 + 0.35 + 0.5) / 6)
    assert avg.se == pytest.approx(math.sqrt(5 * 0.03**2 + 2 * (0.03 / 2) ** 2) / 6)
    del cols["winogrande"]
    with pytest.raises(ValueError, match="winogrande"):
        average(cols)


def test_docs_for_the_average_se():
    n = docs_for_average_se(0.015)
    cols = {c: Estimate(0.5, math.sqrt(0.25 / n), n) for c in
            ("mmlu", "arc_easy", "arc_challenge", "piqa", "hellaswag", "openbookqa", "winogrande")}
    assert average(cols).se <= 0.015
    cols = {c: Estimate(0.5, math.sqrt(0.25 / (n - 2)), n) for c in cols}
    assert average(cols).se > 0.015  # the smallest n that does

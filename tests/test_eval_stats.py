"""Table-1 sampling and uncertainty (transmla.evaluation.stats): pure functions, no model."""

import math
import random
import statistics

import pytest

from transmla.evaluation.stats import (AVERAGE_WEIGHTS, Estimate, allocate, average, cost_optimal_docs,
                                      docs_for_average_se, estimate, paired, worst_case_average_se,
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


COST = {"mmlu": 0.34, "arc_easy": 0.14, "arc_challenge": 0.15, "piqa": 0.18, "hellaswag": 0.50,
        "openbookqa": 0.09, "winogrande": 0.13}


def _seconds(docs):
    return sum(COST[b] * n for b, n in docs.items())


def test_cost_optimal_docs_keep_the_bound_at_the_least_cost():
    docs = cost_optimal_docs(COST, 0.015)
    assert worst_case_average_se(docs) <= 0.015
    # the worst-case formula is the average's own standard error (stats.average over binomial columns)
    cols = {b: Estimate(0.5, math.sqrt(0.25 / n), n) for b, n in docs.items()}
    assert average(cols).se == pytest.approx(worst_case_average_se(docs))
    # cheaper per document -> more documents (per unit of weight)
    assert docs["openbookqa"] > docs["winogrande"] > docs["piqa"] > docs["mmlu"] > docs["hellaswag"]
    # no allocation meeting the bound is cheaper: every uniform one and every pairwise trade of documents
    # (keeping the variance) costs more
    uniform = docs_for_average_se(0.015)
    assert _seconds({b: uniform for b in COST}) > _seconds(docs)
    w = AVERAGE_WEIGHTS
    for a in COST:
        for b in COST:
            if a == b:
                continue
            for f in (0.8, 1.25):
                na = docs[a] * f  # move variance from a to b, keeping sum w / n
                nb = w[b] / (w[b] / docs[b] + w[a] / docs[a] - w[a] / na)
                if nb > 0:
                    assert _seconds({**docs, a: na, b: nb}) >= _seconds(docs) - 1e-6


def test_cost_optimal_docs_with_equal_costs_halves_arc_and_respects_caps_and_floors():
    flat = cost_optimal_docs({b: 1.0 for b in COST}, 0.015)
    assert flat["arc_easy"] == flat["arc_challenge"] == pytest.approx(flat["mmlu"] / 2, abs=1)
    capped = cost_optimal_docs(COST, 0.015, sizes={"openbookqa": 100})
    assert capped["openbookqa"] == 100 and worst_case_average_se(capped) <= 0.015
    assert capped["winogrande"] > cost_optimal_docs(COST, 0.015)["winogrande"]  # the others take up the slack
    floored = cost_optimal_docs(COST, 0.015, floors={"mmlu": 400})
    assert floored["mmlu"] == 400 and worst_case_average_se(floored) <= 0.015
    assert floored["hellaswag"] < cost_optimal_docs(COST, 0.015)["hellaswag"]
    with pytest.raises(ValueError, match="out of reach"):
        cost_optimal_docs(COST, 0.001, sizes={b: 50 for b in COST})
    with pytest.raises(ValueError, match="exactly"):
        cost_optimal_docs({"mmlu": 1.0}, 0.015)


def test_the_default_profile_sample_keeps_the_average_se_bound():
    from flows.params import load_profile

    ev = load_profile(None).evaluation
    docs = {t: ev.limits.get(t, ev.limit) for t in ev.tasks}
    assert worst_case_average_se(docs) <= 0.015


def test_superset_plan_contains_the_shared_sample_and_estimates_without_bias():
    strata = {"mmlu": {"a": 100, "b": 300, "c": 7}, "piqa": {"p": 500}}
    base = sample_plan(strata, 20, seed=3, overrides={"piqa": 30})
    big = sample_plan(strata, 20, seed=3, overrides={"piqa": 30}, superset={"mmlu": 200})
    assert sample_plan(strata, 20, seed=3, overrides={"piqa": 30}, superset={}) == base  # no superset: unchanged
    assert big["p"] == base["p"]  # a benchmark not named keeps its sample
    assert all(set(base[t]) <= set(big[t]) for t in base)  # the shared sample is inside
    assert sum(len(big[t]) for t in ("a", "b", "c")) == 200
    assert all(len(set(big[t])) == len(big[t]) and max(big[t]) < strata["mmlu"][t] for t in ("a", "b", "c"))
    # within a stratum, base + added is one simple random sample: each doc equally likely over seeds
    hits = [0] * 100
    for s in range(400):
        for i in sample_plan({"m": {"a": 100}}, 5, seed=s, superset={"m": 20})["a"]:
            hits[i] += 1
    assert statistics.mean(hits) == 80 and max(hits) < 2.3 * 80 and min(hits) > 0.3 * 80


def test_a_superset_is_exactly_the_size_asked_and_holds_every_base_sample():
    """Allocated alone, the larger sample gave some strata fewer documents than the base one (largest
    remainders), the base's were kept anyway and the superset came out larger than asked (67 for 57), which the
    report then refused as stale; with many strata it could not give each one a document and keep the base's."""
    sizes = {"law": 1534, "misc": 783, "moral": 895, "psych": 612, **{f"s{i}": 100 + (37 * i) % 250 for i in range(53)}}
    for lim in range(1, 160, 3):
        base = sample_plan({"mmlu": sizes}, lim, seed=0)
        for sup in range(lim, 400, 7):
            big = sample_plan({"mmlu": sizes}, lim, seed=0, superset={"mmlu": sup})
            assert sum(map(len, big.values())) == sup, (lim, sup)
            assert all(set(base[t]) <= set(big[t]) for t in base), (lim, sup)
    floors = {"a": 5, "b": 0, "c": 0}
    assert allocate({"a": 100, "b": 1, "c": 1}, 5, floors=floors) == {"a": 5, "b": 0, "c": 0}
    assert allocate({"a": 100, "b": 1, "c": 1}, 7, floors=floors) == {"a": 5, "b": 1, "c": 1}
    for bad in ({"a": 2, "b": 2}, {"a": 6}):  # past a stratum's size; more than n in all
        with pytest.raises(ValueError, match="floors"):
            allocate({"a": 100, "b": 1, "c": 1}, 5, floors=bad)


def test_paired_columns_use_the_shared_docs_of_a_superset_reference():
    from transmla.evaluation.benchmarks import paired_columns

    rng = random.Random(5)
    sizes = {"piqa": {"p": 500}}
    ref_docs = {i: float(rng.random() < 0.6) for i in range(0, 500, 2)}  # 250 docs
    mine = {i: ref_docs[i] if i % 3 else 1.0 - ref_docs[i] for i in list(ref_docs)[:60]}  # 60 of them
    wrap = lambda d: {"scores": {"piqa": {"p": {str(i): x for i, x in d.items()}}}, "sizes": sizes}  # noqa: E731
    d = paired_columns(wrap(mine), wrap(ref_docs))["piqa"]
    want = paired({"p": mine}, {"p": {i: ref_docs[i] for i in mine}}, sizes["piqa"])
    assert d["value"] == pytest.approx(want.value) and d["se"] == pytest.approx(want.se) and d["n"] == 60
    with pytest.raises(ValueError, match="same documents"):  # a doc the reference never scored
        paired_columns(wrap({**mine, 1: 1.0}), wrap(ref_docs))


def test_reference_limits_must_be_a_superset():
    from transmla.config import EvaluationOptions
    from transmla.errors import TransMLAError

    assert EvaluationOptions(limit=100, limits={"mmlu": 146}, reference_limits={"mmlu": 1000}).reference_limits
    with pytest.raises(TransMLAError, match="smaller than the shared sample"):
        EvaluationOptions(limit=100, limits={"mmlu": 146}, reference_limits={"mmlu": 120})
    with pytest.raises(TransMLAError, match="reference_limits needs a limit"):
        EvaluationOptions(reference_limits={"mmlu": 1000})
    # limits without a limit would be ignored (every doc scored): refused, naming how to score all docs
    with pytest.raises(TransMLAError, match="limits needs a limit.*limits: {}"):
        EvaluationOptions(limits={"mmlu": 146})
    assert EvaluationOptions(limit=None, limits={}).limit is None
    with pytest.raises(TransMLAError, match="unknown benchmarks"):
        EvaluationOptions(limit=10, reference_limits={"mmlux": 1000})

"""Size the Table-1 benchmark samples: the fewest scoring seconds for a bound on the average's standard error.

Reads the per-benchmark speed an evaluation recorded (results.json of `transmla eval --out DIR` or of
the pipeline's benchmarks step: {"speed": {benchmark: {"docs", "seconds"}}}), takes seconds per
document as each benchmark's cost and prints the documents per benchmark that keep the six-column
average's standard error at most --target-se at any accuracy (p = 0.5) for the least total time
(transmla.evaluation.stats.cost_optimal_docs), next to what the measured sample cost and would cost.

    .venv/bin/python scripts/eval_sizing.py /tmp/eval/results.json --target-se 0.015 [--min mmlu=400]

The numbers it prints go into params/default.yaml (evaluation.limits); tests/test_eval_stats.py checks
that the profile's sample keeps the bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transmla.errors import TransMLAError
from transmla.evaluation.benchmarks import task_strata
from transmla.evaluation.stats import AVERAGE_WEIGHTS, cost_optimal_docs, worst_case_average_se


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="an evaluation's results.json (with its per-benchmark speed)")
    ap.add_argument("--target-se", type=float, default=0.015, help="bound on the average's standard error (fraction)")
    ap.add_argument("--min", action="append", default=[], metavar="BENCH=N",
                    help="a benchmark's floor (e.g. mmlu=400); the others are re-solved around it")
    ap.add_argument("--data-dir", default=None, help="offline data folder (default $TRANSMLA_DATA_DIR or ../shared/data)")
    a = ap.parse_args(argv)
    floors = {}
    for m in a.min:
        k, _, v = m.partition("=")
        if k not in AVERAGE_WEIGHTS or not v.isdigit():
            ap.error(f"--min {m!r}: write BENCH=N with BENCH one of {', '.join(AVERAGE_WEIGHTS)}")
        floors[k] = int(v)
    if not 0 < a.target_se < 1:
        ap.error(f"--target-se {a.target_se}: a standard error as a fraction, e.g. 0.015")
    try:
        speed = json.loads(Path(a.results).read_text())["speed"]
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"{a.results}: not an evaluation's results.json with its per-benchmark speed ({type(e).__name__}: {e})")
    if missing := [b for b in AVERAGE_WEIGHTS if not speed.get(b, {}).get("docs")]:
        ap.error(f"{a.results} has no speed for {missing}: evaluate every Table-1 benchmark (transmla eval --out DIR)")
    cost = {b: speed[b]["seconds"] / speed[b]["docs"] for b in AVERAGE_WEIGHTS}
    if free := [b for b, c in cost.items() if c <= 0]:
        ap.error(f"{a.results}: {free} took no time: not a measured run's speed")
    # each benchmark capped at the documents its local file has (620 of OpenBookQA's 500 broke the bound it printed)
    try:
        strata = task_strata(list(AVERAGE_WEIGHTS), a.data_dir)
    except TransMLAError as e:
        ap.error(str(e))
    sizes = {b: sum(strata[b].values()) for b in AVERAGE_WEIGHTS}
    if over := [f"{b}={n} (of {sizes[b]})" for b, n in floors.items() if n > sizes[b]]:
        ap.error(f"--min {', '.join(over)}: more documents than the benchmark has")
    try:
        docs = cost_optimal_docs(cost, a.target_se, sizes=sizes, floors=floors)
    except ValueError as e:  # every benchmark whole and the bound still not met
        ap.error(f"--target-se {a.target_se}: out of reach even with every document of every benchmark ({e})")
    measured = {b: speed[b]["docs"] for b in AVERAGE_WEIGHTS}
    out = {
        "cost_s_per_doc": {b: round(c, 4) for b, c in cost.items()},
        "measured": {"docs": measured, "seconds": round(sum(speed[b]["seconds"] for b in AVERAGE_WEIGHTS), 1),
                     "worst_case_se": round(worst_case_average_se(measured), 5)},
        "sized": {"docs": docs, "seconds": round(sum(cost[b] * docs[b] for b in AVERAGE_WEIGHTS), 1),
                  "worst_case_se": round(worst_case_average_se(docs), 5)},
    }
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()

"""Flow: the whole pipeline in one process (what `dvc repro` runs stage by stage).

    for each model:  calibrate -> [convert -> evaluate] per budget x method, evaluate original
                     -> [finetune -> evaluate --finetuned] per finetune.budgets x finetune.methods
                     -> figures -> throughput per throughput.budgets x throughput.methods
    report (Table 1 + figures)

    python -m flows.paper [--params params/paper.yaml] [-S runner.kind=dask]

The per-(model, budget, method) chains (`variant`) run one after another in this process, or in
parallel on a Dask cluster with `runner: {kind: dask}` (flows/cluster.py).

Same tasks, same cache, same output paths as the DVC stages: a DVC run and a paper-flow run reuse
each other's cached steps. On a GPU machine run it with the paper profile.
"""

from __future__ import annotations

import shutil

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tasks.model import resolve_model, spec_of
from transmla.convert import config_spec
from transmla.errors import TransMLAError
from transmla.io.sources import check_source
from transmla.pipeline.budget import resolve_budget

from . import _cli, cluster, layout
from .calibrate import calibrate
from .convert import convert
from .evaluate import evaluate
from .figures import check_figures, figures
from .finetune import finetune
from .params import Profile
from .report import report
from .throughput import throughput_flow


def variant_rows(profile: Profile, model: str, method: str, budget: float, stats: str) -> dict:
    """One Table-1 row and its fine-tuned row: convert -> evaluate [-> finetune -> evaluate --finetuned]."""
    ckpt = layout.checkpoint_dir(model, method, budget)
    if ckpt.exists():  # outputs are replaced, as `dvc repro` does; cached steps make it cheap
        shutil.rmtree(ckpt)
    convert(profile, model, method, budget, stats_file=stats)
    rows = {"converted": evaluate(profile, model, method, budget)}
    if profile.finetuned(method, budget):
        ft = layout.finetuned_dir(model, method, budget)
        if ft.exists():
            shutil.rmtree(ft)
        finetune(profile, model, method, budget)
        rows["finetuned"] = evaluate(profile, model, method, budget, finetuned=True)
    return rows


def check_plan(profile: Profile, no_figures: bool = False) -> None:
    """Every model's conversions (and figures) against its shapes, before the first calibration: otherwise an
    impossible budget, or a second model that cannot be read, fails after the work on the models before it.
    Reads each model's config alone, as `transmla convert --dry-run` does (a hub model's config.json, a GGUF's header);
    only a source whose config gives no shapes (a catalog entry without its header) is fetched for it."""
    p = profile.pipeline
    for model in p.models:
        source = profile.model(model).source
        spec = config_spec(check_source(source)) or spec_of(resolve_model.fn(source))
        try:
            for budget in p.budgets:
                for method in p.methods:
                    where = f", {method} at budget {budget:g}"
                    resolve_budget(spec, profile.convert_options(method, budget))
            where = ""  # the figures' errors name their params
            if not no_figures:
                check_figures(profile, spec)
        except TransMLAError as e:
            raise TransMLAError(f"{model}{where}: {e.problem}", e.fix) from None


def pipeline(profile: Profile, no_figures: bool = False, no_throughput: bool = False) -> str:
    """Every model of the profile, then the report."""
    p, tp = profile.pipeline, profile.throughput
    for model in p.models:
        stats = calibrate(profile, model)["path"]
        evaluate(profile, model, "original")
        cells = [(budget, method) for budget in p.budgets for method in p.methods]
        cluster.run_matrix(variant, [(profile, model, method, budget, stats) for budget, method in cells],
                           profile.runner, names=[f"{model} {method} {budget:g}" for budget, method in cells])
        if not no_figures:
            figures(profile, model, stats_file=stats)
        # appendix F, one run at a time on this machine (the params keep these rows inside the matrix above)
        for budget in () if no_throughput else tp.budgets:
            for method in tp.methods:
                throughput_flow(profile, model, method, budget)
    return report(profile)


# Prefect's task and flow around the module-level functions above, not decorators: a runner that
# ships them to other processes (Dask pickles the task and the flow run's context) then pickles the
# functions by name; by value, their globals would drag in every flow and cached task below them.
# `variant` is the unit a runner places; its steps are cached, the chain has nothing of its own to cache.
variant = task(variant_rows, name="variant", persist_result=False, cache_policy=NO_CACHE)
paper_flow = flow(pipeline, name="paper")


def paper(profile: Profile, no_figures: bool = False, no_throughput: bool = False) -> str:
    """The paper flow on the profile's `runner:` (in-process, or a Dask cluster)."""
    check_plan(profile, no_figures)
    return paper_flow.with_options(task_runner=cluster.task_runner(profile.runner))(profile, no_figures, no_throughput)


if __name__ == "__main__":
    _cli.entry(paper, __doc__, model=False, no_figures="flag: skip Figs. 4-5",
               no_throughput="flag: skip the decode throughput runs (appendix F)")

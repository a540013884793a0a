"""Flow: the whole pipeline in one process (what `dvc repro` runs stage by stage).

    for each model:  calibrate -> [convert -> evaluate] per budget x method, evaluate original
                     -> [finetune -> evaluate --finetuned] per finetune.budgets x finetune.methods
                     -> figures
    report (Table 1 + figures)

    python -m flows.paper [--params params/paper.yaml]

Same tasks, same cache, same output paths as the DVC stages: a DVC run and a paper-flow run reuse
each other's cached steps. On a GPU machine run it with the paper profile.
"""

from __future__ import annotations

import shutil

from prefect import flow

from . import _cli, layout
from .calibrate import calibrate
from .convert import convert
from .evaluate import evaluate
from .figures import figures
from .finetune import finetune
from .params import Profile
from .report import report


@flow(name="paper")
def paper(profile: Profile, no_figures: bool = False) -> str:
    p = profile.pipeline
    for model in p.models:
        stats = calibrate(profile, model)["path"]
        evaluate(profile, model, "original")
        for budget in p.budgets:
            for method in p.methods:
                ckpt = layout.checkpoint_dir(model, method, budget)
                if ckpt.exists():  # outputs are replaced, as `dvc repro` does; cached steps make it cheap
                    shutil.rmtree(ckpt)
                convert(profile, model, method, budget, stats_file=stats)
                evaluate(profile, model, method, budget)
                if profile.finetuned(method, budget):
                    ft = layout.finetuned_dir(model, method, budget)
                    if ft.exists():
                        shutil.rmtree(ft)
                    finetune(profile, model, method, budget)
                    evaluate(profile, model, method, budget, finetuned=True)
        if not no_figures:
            figures(profile, model, stats_file=stats)
    return report(profile)


if __name__ == "__main__":
    _cli.entry(paper, __doc__, model=False, no_figures="flag: skip Figs. 4-5")

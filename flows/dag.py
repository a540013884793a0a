"""The DAG's one declaration is dvc.yaml; this keeps its code and data dependencies true.

Each stage runs one flow (`python -m flows.<name>`); its code deps are exactly the import closure
of that flow module (tasks.codehash, the same closure the Prefect cache keys hash), so DVC re-runs
a stage when, and only when, code it can execute changed. Its data deps are the files of the data
sets the params make it read (`data_deps`: calibration.dataset, evaluation's perplexity set and
benchmarks, finetune.corpora), so editing a data set in params/default.yaml moves the deps with it.
`python -m flows.dag` rewrites both in dvc.yaml (other deps, the artifacts/ a stage reads, are kept);
tests/test_cache_keys.py fails when they drift. flows/paper.py composes the same flows in one process.
"""

from __future__ import annotations

import re

from tasks.codehash import PROJECT, REPO_ROOT, closure
from transmla.evaluation.benchmarks import BENCHMARK_DATA
from transmla.io.data import PATH_PREFIX, spec, split_calibration

from .params import Profile, load_profile

DVC_YAML = REPO_ROOT / "dvc.yaml"
STAGE = re.compile(r"^  ([a-z_]+):\s*$")
FLOW = re.compile(r"-m (flows\.[a-z_]+)")
DEP = re.compile(r"^(\s+)- (\S+)\s*(# params path:)?\s*$")
PATH_MARK = "# params path:"  # after a calibration path: part's dep, so a regeneration replaces it like the others
DATA = "${data}"  # dvc.yaml's var for the shared data folder


def _flows() -> dict[str, str]:
    """stage name -> flow module, from the cmds in dvc.yaml."""
    out, stage = {}, None
    for line in DVC_YAML.read_text().splitlines():
        if m := STAGE.match(line):
            stage = m.group(1)
        elif stage and (m := FLOW.search(line)):
            out.setdefault(stage, m.group(1))
    return out


def code_deps(stage: str) -> list[str]:
    return list(closure(_flows()[stage])[0])


def _cal_parts(dataset: str) -> list[str]:
    return split_calibration(dataset)


def data_names(stage: str, profile: Profile) -> list[str]:
    """The data sets (registry names or `path:` parts) a stage's flow reads under these params."""
    ev, p = profile.evaluation, profile.pipeline
    if stage == "calibrate":
        return _cal_parts(profile.calibration.dataset)
    if stage == "convert":  # a streamed conversion (sequential calibration) draws its own windows
        streamed = any(profile.convert_options(m, b).streamed for m in p.methods for b in p.budgets)
        return _cal_parts(profile.calibration.dataset) if streamed else []
    if stage in ("evaluate", "evaluate_finetuned", "evaluate_original"):
        return [ev.ppl_dataset, *(n for t in ev.tasks for n in BENCHMARK_DATA[t])]
    if stage == "finetune":
        return list(profile.finetune.corpora)
    if stage == "figures":
        return [ev.ppl_dataset]
    return []


def data_deps(stage: str, profile: Profile | None = None) -> list[str]:
    """dvc.yaml deps for a stage's data: `${data}/<file>` per registry set, the path itself for a
    `path:` part; hub-only sets have no file for DVC to watch (their cache keys carry the hub revision)."""
    out = []
    for name in data_names(stage, profile or load_profile()):
        if name.startswith(PATH_PREFIX):
            out.append(name.removeprefix(PATH_PREFIX))
        elif spec(name).local_file is not None:
            out.append(f"{DATA}/{spec(name).local_file}")
    return list(dict.fromkeys(out))


def regenerate(text: str, profile: Profile | None = None) -> str:
    """dvc.yaml with every stage's project-code deps replaced by its flow's closure and its data deps
    by the data sets the params name."""
    profile = profile or load_profile()
    flows, out, stage, in_deps = _flows(), [], None, False
    for line in text.splitlines():
        if m := STAGE.match(line):
            stage, in_deps = m.group(1), False
        if line.strip() == "deps:":
            in_deps = True
            out.append(line)
            indent = line[: len(line) - len(line.lstrip())] + "  "  # until a dep line shows its own
            continue
        if in_deps:
            m = DEP.match(line)
            if m:
                indent = m.group(1)
                if m.group(2).split("/")[0] in PROJECT or m.group(2).startswith(DATA + "/") or m.group(3):
                    continue  # regenerated below
                out.append(line)
                continue
            out += _generated(stage, flows, indent, profile)
            in_deps = False
        out.append(line)
    if in_deps:  # the file ends inside a stage's deps
        out += _generated(stage, flows, indent, profile)
    return "\n".join(out) + "\n"


def _generated(stage: str, flows: dict[str, str], indent: str, profile: Profile) -> list[str]:
    data = [f if f.startswith(DATA + "/") else f"{f}  {PATH_MARK}" for f in data_deps(stage, profile)]
    return [f"{indent}- {f}" for f in data + list(closure(flows[stage])[0])]


if __name__ == "__main__":
    import argparse

    from transmla.io.paths import write_text_atomic

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    write_text_atomic(DVC_YAML, regenerate(DVC_YAML.read_text()))
    print(f"{DVC_YAML.name}: code deps regenerated for {len(_flows())} stages")

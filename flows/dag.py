"""The DAG's one declaration is dvc.yaml; this keeps its code dependencies true.

Each stage runs one flow (`python -m flows.<name>`); its code deps are exactly the import closure
of that flow module (tasks.codehash, the same closure the Prefect cache keys hash), so DVC re-runs
a stage when, and only when, code it can execute changed. `python -m flows.dag` rewrites the deps
lists in dvc.yaml from the closures (data deps such as artifacts/ and ${data} are kept);
tests/test_cache_keys.py fails when they drift. flows/paper.py composes the same flows in one process.
"""

from __future__ import annotations

import re

from tasks.codehash import PROJECT, REPO_ROOT, closure

DVC_YAML = REPO_ROOT / "dvc.yaml"
STAGE = re.compile(r"^  ([a-z_]+):\s*$")
FLOW = re.compile(r"-m (flows\.[a-z_]+)")
DEP = re.compile(r"^(\s+)- (\S+)\s*$")


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


def regenerate(text: str) -> str:
    """dvc.yaml with every stage's project-code deps replaced by its flow's closure."""
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
                if m.group(2).split("/")[0] in PROJECT:
                    continue  # regenerated below
                out.append(line)
                continue
            out += [f"{indent}- {f}" for f in closure(flows[stage])[0]]
            in_deps = False
        out.append(line)
    if in_deps:  # the file ends inside a stage's deps
        out += [f"{indent}- {f}" for f in closure(flows[stage])[0]]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    from transmla.io.paths import write_text_atomic

    write_text_atomic(DVC_YAML, regenerate(DVC_YAML.read_text()))
    print(f"{DVC_YAML.name}: code deps regenerated for {len(_flows())} stages")

"""dvc.lock must be current for the code and params in the checkout (scripts/check_lock.py).

test_repository_lock_is_current checks this repository's own lock. The other tests build a small DVC project in a temp git repo, let DVC itself write its dvc.lock (`Repo.commit`), and show
the check passes on it (without its data, outputs or cache) and names each kind of staleness.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_lock", REPO / "scripts" / "check_lock.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_lock"] = mod
    spec.loader.exec_module(mod)
    return mod


check_lock = _load_checker()


def _problems(root) -> list[str]:
    return [str(p) for p in check_lock.check_lock(root).problems]


def test_repository_lock_is_current():
    """The committed dvc.lock was made by the code and params in this checkout (a fresh clone
    needs no data for this): a stale lock cannot land."""
    problems = _problems(REPO)
    assert not problems, "dvc.lock is stale:\n" + "\n".join(problems[:40])


def _about(problems: list[str], stage: str, path: str) -> list[str]:
    return [p for p in problems if p.startswith(f"{stage}: {path}:")]


PARAMS = """\
names: [a, b]
models:
  a: {size: 1, tags: [x, y]}
  b: {size: 2, tags: []}
seed: 1
"""

DVC_YAML = """\
stages:
  prep:
    foreach: ${names}
    do:
      cmd: python src/prep.py ${item}
      deps:
        - src/prep.py
        - src/lib
        - ../shared/data.txt
      params:
        - models.${item}
        - seed
      outs:
        - out/${item}.txt
  report:
    cmd: python src/report.py
    deps:
      - src/report.py
      - out
    params:
      - seed
    outs:
      - report.md:
          cache: false
"""


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture
def project(tmp_path) -> Path:
    """A git + DVC project whose dvc.lock DVC wrote itself: a foreach stage (prep@a, prep@b) with a
    file, a directory and an external data dependency, and a stage on the outputs of the others."""
    from dvc.repo import Repo

    root = tmp_path / "repo"
    root.mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data.txt").write_text("data\n")
    _git(root, "init", "-q")
    Repo.init(str(root)).close()
    files = {
        "dvc.yaml": DVC_YAML,
        "params.yaml": PARAMS,
        "src/prep.py": "print('prep')\n",
        "src/report.py": "print('report')\n",
        "src/lib/a.py": "A = 1\n",
        "src/lib/sub/b.py": "B = 2\n",
        "out/a.txt": "a\n",
        "out/b.txt": "b\n",
        "report.md": "# report\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    with contextlib.chdir(root), Repo(str(root)) as repo:  # DVC writes the lock itself
        repo.commit(force=True)
    assert (root / "dvc.lock").exists()
    (root / ".gitignore").write_text("/out\n")
    _git(root, "add", "-A")
    return root


def test_fresh_lock_passes(project, capsys):
    report = check_lock.check_lock(project)
    assert report.problems == []
    # 3 stages; code: src/prep.py + src/lib for prep@a and prep@b, src/report.py for report
    # (../shared/data.txt is external data, `out` holds pipeline outputs: neither is hashed).
    assert (report.stages, report.code_deps) == (3, 5)
    assert report.params == 2 + 2 + 1
    assert check_lock.main([str(project)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("dvc.lock is current: 3 stages, 5 code dependencies")


def test_lock_records_dir_hash_as_dvc(project):
    """The directory dependency is DVC's `<md5>.dir` tree hash, and the check reproduces it."""
    import yaml

    lock = yaml.safe_load((project / "dvc.lock").read_text())
    (lib,) = [d for d in lock["stages"]["prep@a"]["deps"] if d["path"] == "src/lib"]
    assert lib["md5"].endswith(".dir")
    assert _problems(project) == []


def test_passes_without_data_outputs_or_cache(project, tmp_path):
    """A fresh clone has no ../shared data, no artifacts and no DVC cache."""
    shutil.rmtree(tmp_path / "shared")
    shutil.rmtree(project / "out")
    shutil.rmtree(project / ".dvc" / "cache", ignore_errors=True)
    (project / "report.md").unlink()
    assert _problems(project) == []


def test_modified_code_file(project, capsys):
    (project / "src" / "prep.py").write_text("print('prep, changed')\n")
    problems = _problems(project)
    assert len(problems) == 2, problems
    for stage in ("prep@a", "prep@b"):
        (p,) = _about(problems, stage, "src/prep.py")
        assert "modified" in p and f"dvc repro -s {stage}" in p and "commit dvc.lock" in p
    # DVC agrees: its own status reports the same dependency changed, for the same stages.
    from dvc.repo import Repo

    with contextlib.chdir(project), Repo(str(project)) as repo:
        status = repo.status()
    changed = {
        name
        for name, entries in status.items()
        for e in entries
        if isinstance(e, dict) and "src/prep.py" in e.get("changed deps", {})
    }
    assert changed == {"prep@a", "prep@b"}
    assert check_lock.main([str(project)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and all("src/prep.py" in line for line in out)


def test_modified_file_in_code_directory(project):
    (project / "src" / "lib" / "sub" / "c.py").write_text("C = 3\n")
    problems = _problems(project)
    assert len(problems) == 2, problems
    assert _about(problems, "prep@a", "src/lib") and _about(problems, "prep@b", "src/lib")
    assert all(".dir" in p for p in problems)


def test_deleted_code_file(project):
    (project / "src" / "report.py").unlink()
    (p,) = _problems(project)
    assert p.startswith("report: src/report.py:") and "does not exist" in p


def test_code_not_tracked_by_git(project):
    _git(project, "rm", "-q", "--cached", "src/report.py")
    (p,) = _problems(project)
    assert p.startswith("report: src/report.py:") and "not tracked by git" in p


def test_changed_param(project):
    params = project / "params.yaml"
    params.write_text(PARAMS.replace("tags: [x, y]", "tags: [x]"))
    (p,) = _problems(project)
    assert p.startswith("prep@a: params.yaml:models.a:") and "param changed" in p

    params.write_text(PARAMS.replace("seed: 1", "seed: 2"))
    problems = _problems(project)
    assert {p.split(":")[0] for p in problems} == {"prep@a", "prep@b", "report"}
    assert all("params.yaml:seed" in p for p in problems)


def test_deleted_param(project):
    # names stays [a, b]: the stage still expands, but models.b is gone from the params file
    (project / "params.yaml").write_text(PARAMS.replace("  b: {size: 2, tags: []}\n", ""))
    problems = _problems(project)
    assert _about(problems, "prep@b", "params.yaml:models.b")


def test_missing_stage(project):
    (project / "params.yaml").write_text(
        PARAMS.replace("names: [a, b]", "names: [a, b, c]").replace("seed: 1", "  c: {size: 3, tags: []}\nseed: 1")
    )
    (p,) = _problems(project)
    assert p.startswith("prep@c:") and "no entry in dvc.lock" in p and "dvc repro -s prep@c" in p


def test_stage_removed_from_dvc_yaml(project):
    (project / "params.yaml").write_text(PARAMS.replace("names: [a, b]", "names: [a]"))
    (p,) = _problems(project)
    assert p.startswith("prep@b:") and "dvc.yaml does not define" in p


def test_changed_dep_list(project):
    dvc_yaml = project / "dvc.yaml"
    (project / "src" / "extra.py").write_text("X = 1\n")
    dvc_yaml.write_text(DVC_YAML.replace("        - src/prep.py\n", "        - src/prep.py\n        - src/extra.py\n"))
    problems = _problems(project)
    assert len(problems) == 2, problems
    for stage in ("prep@a", "prep@b"):
        (p,) = _about(problems, stage, "src/extra.py")
        assert "missing from dvc.lock" in p

    dvc_yaml.write_text(DVC_YAML.replace("      - src/report.py\n", ""))
    (p,) = _problems(project)
    assert p.startswith("report: src/report.py:") and "not in dvc.yaml" in p


def test_changed_params_list_and_outs(project):
    dvc_yaml = project / "dvc.yaml"
    dvc_yaml.write_text(DVC_YAML.replace("    params:\n      - seed\n", "    params:\n      - seed\n      - names\n"))
    (p,) = _problems(project)
    assert p.startswith("report: params.yaml:names:") and "missing from dvc.lock" in p

    dvc_yaml.write_text(DVC_YAML.replace("report.md:", "summary.md:"))
    problems = _problems(project)
    assert _about(problems, "report", "summary.md") and _about(problems, "report", "report.md")


def test_changed_cmd(project):
    (project / "dvc.yaml").write_text(DVC_YAML.replace("python src/report.py", "python src/report.py --all"))
    (p,) = _problems(project)
    assert p.startswith("report: cmd:") and "--all" in p and "dvc repro -s report" in p

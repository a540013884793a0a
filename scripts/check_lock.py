"""Is dvc.lock current for the code and params in this checkout?  (No data, no cache needed.)

A stale lock (code or params changed, the lock not regenerated) makes `dvc status` report the
committed code as modified and a warm-cache `dvc repro` rerun every stage.  This check runs in
seconds on a fresh clone, without ../shared/data, the artifacts or a DVC cache:

  (a) every dependency in dvc.lock that is code (a path inside the repository that no stage
      outputs: flows/, tasks/, transmla/ ...) hashes to the recorded md5, exactly as DVC computes
      it: the lock entry becomes a DVC `Dependency` (dvc.dependency.loadd_from) whose
      `workspace_status()` / `get_hash()` does the hashing (dvc_data's build: the md5 of the
      bytes for a file, the `<md5>.dir` tree hash for a directory, .dvcignore honoured).
      Paths outside the repository (../shared/data/...) and pipeline outputs (artifacts/...,
      reports/... that a stage outputs) are data and skipped.  Code must also be tracked by git,
      or a fresh clone lacks it;
  (b) every params value recorded under `params:` equals the params file now (a DVC
      `ParamsDependency` built from the lock entry: DVC's own dotted-key lookup and comparison);
  (c) every stage of dvc.yaml, expanded (foreach/matrix -> `name@item`, from DVC's own
      `Repo(root).index.stages`), has a lock entry with the same cmd, the same set of dep
      paths, params keys and out paths; and the lock has no entry for a stage dvc.yaml lacks.

Prints one line per problem and exits 1, or one summary line and exits 0.
Usage: .venv/bin/python scripts/check_lock.py [REPO_ROOT]
"""

from __future__ import annotations

import os
import posixpath
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Problem:
    stage: str
    path: str  # the dependency / params key the problem is about ("" for the whole stage)
    what: str
    fix: str = ""

    def __str__(self) -> str:
        where = f"{self.stage}: {self.path}" if self.path else self.stage
        fix = self.fix or (f"run `make repro` (or `dvc repro -s {self.stage}`) and commit dvc.lock")
        return f"{where}: {self.what}; {fix}"


@dataclass
class Report:
    problems: list[Problem]
    stages: int = 0  # stages of dvc.yaml checked
    code_deps: int = 0  # code dependencies hashed
    params: int = 0  # params values compared

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return (
            f"dvc.lock is current: {self.stages} stages, {self.code_deps} code dependencies and "
            f"{self.params} params values match the working tree"
        )


# --------------------------------------------------------------------------------------------
# helpers


def _norm(path: str) -> str:
    """A dvc.yaml / dvc.lock path as a normalised posix path relative to the repository root."""
    return posixpath.normpath(str(path).replace(os.sep, "/"))


def _outside(path: str) -> bool:
    return posixpath.isabs(path) or path == ".." or path.startswith("../")


def _overlaps(path: str, others: set[str]) -> bool:
    """`path` is, lies under, or contains one of `others` (all normalised, repo-relative)."""
    for o in others:
        if path == o or path.startswith(o + "/") or o.startswith(path + "/"):
            return True
    return False


def _git_tracked(root: Path) -> Optional[set[str]]:
    """Files git tracks under `root` (repo-relative posix paths), or None outside a git repo."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--full-name", "."],
            capture_output=True,
            check=True,
        ).stdout
        prefix = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-prefix"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {f for f in out.decode().split("\0") if f}
    if prefix:  # dvc root below the git root: make the paths relative to the dvc root
        files = {f[len(prefix) :] for f in files if f.startswith(prefix)}
    return files


def _is_tracked(path: str, tracked: set[str]) -> bool:
    return path in tracked or any(f.startswith(path + "/") for f in tracked)


def _lock_dep_paths(entry: dict) -> list[str]:
    return [_norm(d["path"]) for d in entry.get("deps") or []]


def _lock_out_paths(entry: dict) -> list[str]:
    return [_norm(o["path"]) for o in entry.get("outs") or []]


def _fmt_set(s) -> str:
    return ", ".join(sorted(s))


def _check_definition(name: str, stage, entry: dict) -> list[Problem]:
    """(c) The lock entry was made from this stage definition: cmd, dep paths, params keys, outs."""
    from dvc.dependency import ParamsDependency

    out: list[Problem] = []
    if (entry.get("cmd") or "") != (stage.cmd or ""):
        out.append(Problem(name, "cmd", f"dvc.lock has `{entry.get('cmd')}`, dvc.yaml has `{stage.cmd}`"))

    def diff(kind: str, want: set, have: set) -> None:
        for p in sorted(want - have):
            out.append(Problem(name, p, f"{kind} of dvc.yaml missing from dvc.lock"))
        for p in sorted(have - want):
            out.append(Problem(name, p, f"{kind} in dvc.lock is not in dvc.yaml"))

    diff(
        "dependency",
        {_norm(d.def_path) for d in stage.deps if not isinstance(d, ParamsDependency)},
        set(_lock_dep_paths(entry)),
    )
    diff(
        "param",
        {f"{_norm(d.def_path)}:{k}" for d in stage.deps if isinstance(d, ParamsDependency) for k in d.params},
        {f"{_norm(f)}:{k}" for f, values in (entry.get("params") or {}).items() for k in (values or {})},
    )
    diff("output", {_norm(o.def_path) for o in stage.outs}, set(_lock_out_paths(entry)))
    return out


def _check_code(name: str, stage, entry: dict, outputs: set[str], tracked, report: "Report") -> list[Problem]:
    """(a) Every code dependency recorded in the lock hashes, as DVC computes it, to its md5.

    The lock's dep record becomes a DVC Dependency (dvc.dependency.loadd_from, the way DVC's
    lockfile loader fills a stage); its workspace_status() / get_hash() are DVC's own check and
    hash (dvc_data.hashfile.build: file md5, or the `<md5>.dir` tree hash, .dvcignore honoured).
    """
    from dvc.dependency import ParamsDependency, loadd_from

    out: list[Problem] = []
    declared = {_norm(d.def_path) for d in stage.deps if not isinstance(d, ParamsDependency)}
    for raw in entry.get("deps") or []:
        path = _norm(raw["path"])
        if path not in declared:
            continue  # reported by _check_definition: DVC would not look at it
        if _outside(path) or _overlaps(path, outputs):
            continue  # data: ../shared/data/..., artifacts/..., reports/... that stages write
        (dep,) = loadd_from(stage, [dict(raw)])
        if not dep.exists:
            out.append(Problem(name, path, "code dependency does not exist"))
            continue
        if tracked is not None and not _is_tracked(path, tracked):
            out.append(
                Problem(
                    name,
                    path,
                    "code dependency is not tracked by git (a fresh clone lacks it)",
                    "`git add` it (or drop it from dvc.yaml), run `make repro` and commit dvc.lock",
                )
            )
        report.code_deps += 1
        status = dep.workspace_status()
        if not status:
            continue
        state = next(iter(status.values()))
        if state == "modified":
            now = dep.get_hash().value
            out.append(Problem(name, path, f"modified: dvc.lock has md5 {dep.hash_info.value}, the working tree {now}"))
        else:
            out.append(Problem(name, path, f"{state} (no md5 recorded in dvc.lock)"))
    return out


def _check_params(name: str, stage, entry: dict, report: "Report") -> list[Problem]:
    """(b) Every params value in the lock equals the params file now.

    The lock's `params: {file: {key: value}}` becomes a DVC ParamsDependency: DVC's own
    dotted-key lookup (dpath) and comparison (ParamsDependency.workspace_status).
    """
    from dvc.dependency import ParamsDependency

    out: list[Problem] = []
    for pfile, values in (entry.get("params") or {}).items():
        values = dict(values or {})
        pfile_n = _norm(pfile)
        report.params += len(values)
        dep = ParamsDependency(stage, pfile, values)
        if not dep.exists:
            out.append(Problem(name, pfile_n, "params file does not exist"))
            continue
        now = dep.read_params()
        for per_key in dep.workspace_status().values():
            for key, state in per_key.items():
                if state == "modified":
                    what = f"param changed: dvc.lock has {values[key]!r}, {pfile_n} now {now.get(key)!r}"
                elif state == "deleted":
                    what = f"param no longer in {pfile_n}"
                else:
                    what = f"param {state}"
                out.append(Problem(name, f"{pfile_n}:{key}", what))
    return out


# --------------------------------------------------------------------------------------------
# the check


def check_lock(root: Path | str = ROOT) -> Report:
    """Check dvc.lock against dvc.yaml, the params files and the code in the working tree."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.stage import PipelineStage
    from dvc.utils.serialize import load_yaml

    root = Path(root).resolve()
    lock_path = root / "dvc.lock"
    yaml_path = root / "dvc.yaml"
    problems: list[Problem] = []
    report = Report(problems)

    if not yaml_path.exists():
        problems.append(Problem("dvc.yaml", "", "missing", "restore dvc.yaml"))
        return report
    try:
        lock = load_yaml(str(lock_path)) if lock_path.exists() else {}
    except DvcException as exc:
        problems.append(Problem("dvc.lock", "", f"unreadable ({exc})", "regenerate it with `make repro`"))
        return report
    lock_stages: dict[str, Any] = dict((lock or {}).get("stages") or {})

    try:
        repo = Repo(str(root))
    except DvcException as exc:
        problems.append(Problem("dvc.yaml", "", f"DVC cannot load the repository ({exc})", "fix dvc.yaml"))
        return report
    with repo:
        try:
            all_stages = list(repo.index.stages)
        except DvcException as exc:
            problems.append(Problem("dvc.yaml", "", f"DVC cannot load the stages ({exc})", "fix dvc.yaml"))
            return report
        dvcyaml = os.path.join(repo.root_dir, "dvc.yaml")
        yaml_stages = {
            s.name: s for s in all_stages if isinstance(s, PipelineStage) and os.path.abspath(s.path) == dvcyaml
        }

        # Pipeline outputs (of dvc.yaml, of the lock, of .dvc files): data, not code.
        outputs: set[str] = set()
        for s in all_stages:
            outputs.update(_norm(os.path.relpath(o.fs_path, repo.root_dir)) for o in s.outs if o.is_in_repo)
        for entry in lock_stages.values():
            outputs.update(_lock_out_paths(entry or {}))

        tracked = _git_tracked(root)

        for name, stage in yaml_stages.items():
            report.stages += 1
            entry = lock_stages.get(name)
            if entry is None:
                problems.append(Problem(name, "", "stage of dvc.yaml has no entry in dvc.lock"))
                continue
            problems.extend(_check_definition(name, stage, entry))
            problems.extend(_check_code(name, stage, entry, outputs, tracked, report))
            problems.extend(_check_params(name, stage, entry, report))

        for name in lock_stages:
            if name not in yaml_stages:
                problems.append(
                    Problem(
                        name,
                        "",
                        "entry in dvc.lock for a stage dvc.yaml does not define",
                        "delete the entry from dvc.lock (or run `make repro`) and commit dvc.lock",
                    )
                )
    return report


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else ROOT
    report = check_lock(root)
    for p in report.problems:
        print(p)
    if report.problems:
        print(f"dvc.lock is stale: {len(report.problems)} problem(s)", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

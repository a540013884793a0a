"""Shared artifacts (issue 21): the pipeline's DVC outs go to a remote and come back.

A clone of this repository (its real dvc.yaml) records an out of the `calibrate` stage with
`dvc commit`, pushes it to a local-directory remote (what an S3 / GCS / SSH remote is to DVC), loses
the out and the cache, and pulls it back byte for byte; `dvc status` then finds the stage unchanged.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DVC = Path(sys.executable).with_name("dvc")


def dvc(cwd, *args):
    out = subprocess.run([str(DVC), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert out.returncode == 0, f"dvc {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_push_and_pull_the_pipelines_outs(tmp_path):
    if not DVC.exists() or shutil.which("git") is None:
        pytest.skip("dvc (the project's dependency) or git is not installed")
    work = tmp_path / "work"
    work.mkdir()
    (work / "shared").symlink_to(REPO.parent / "shared")  # dvc.yaml's data deps: ../shared/data
    subprocess.run(["git", "clone", "-q", str(REPO), str(work / "repo")], check=True, timeout=120)
    repo = work / "repo"
    stage = "calibrate@smollm2-135m"
    out = repo / "artifacts" / "smollm2-135m" / "calibration.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = os.urandom(4096)
    out.write_bytes(payload)
    dvc(repo, "commit", "-f", stage)  # as if the stage had run: its out in the cache and dvc.lock

    remote = tmp_path / "remote"
    dvc(repo, "remote", "add", "-d", "shared", str(remote))
    dvc(repo, "push", stage)
    assert any(p.is_file() for p in remote.rglob("*")), "nothing reached the remote"

    out.unlink()
    shutil.rmtree(repo / ".dvc" / "cache")
    dvc(repo, "pull", stage)
    assert out.read_bytes() == payload
    assert "changed" not in dvc(repo, "status", stage)

"""The paper flow's matrix on a Dask cluster (flows/cluster.py): a local cluster of 2 worker processes
runs a small matrix through the real runner (prefect-dask), on both workers, with the same results as
the in-process run and the same cached steps; the `runner:` params."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tasks  # noqa: F401,I001  (the Prefect defaults, before prefect is imported; conftest pointed the store at a temp dir)
from prefect import flow, task
from transmla.errors import TransMLAError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_dir(tmp_path, tiny_tokenizer):
    """A tiny random Llama of its own (seeded for this module: its own cache keys)."""
    from conftest import _tiny_model

    d = tmp_path / "tiny-model"
    _tiny_model("llama", len(tiny_tokenizer), seed=2121).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@task
def cell(model_ref: dict, seqlen: int) -> tuple:
    """One matrix cell: a real cached step (perplexity of the tiny model at one window length)
    -> (seqlen, ppl, the step's state: computed or cached, the process it ran in, its torch threads)."""
    import torch

    from tasks.artifacts import load_json
    from tasks.evaluate import perplexity
    from tasks.model import dataset_ref

    state = perplexity(model_ref, dataset_ref("wikitext2-test"), seqlen, 256, return_state=True)
    return seqlen, load_json(state.result())["ppl"], state.name, os.getpid(), torch.get_num_threads()


@flow
def matrix(model_dir: str, seqlens: list[int], runner) -> list:
    """A small matrix the way the paper flow runs its variants."""
    from flows.cluster import run_matrix
    from tasks.model import resolve_model

    ref = resolve_model(model_dir)
    return run_matrix(cell, [(ref, s) for s in seqlens], runner)


def run(runner, model_dir, seqlens: list[int]) -> list:
    from flows.cluster import task_runner

    return matrix.with_options(task_runner=task_runner(runner))(str(model_dir), seqlens, runner)


def test_matrix_on_two_dask_workers(tiny_dir):
    from flows.params import RunnerParams

    from transmla.evaluation.perplexity import dataset_perplexity
    from transmla.io.sources import load_model

    here = run(RunnerParams(), tiny_dir, [16, 32])
    assert [(s, state, pid) for s, _, state, pid, _ in here] == [(16, "Completed", os.getpid()), (32, "Completed", os.getpid())]

    there = run(RunnerParams(kind="dask", workers=2), tiny_dir, [16, 32, 48, 64])
    assert [r[2] for r in there] == ["Cached", "Cached", "Completed", "Completed"]  # the in-process run's cache
    assert [r[:2] for r in there[:2]] == [r[:2] for r in here]
    m, tok = load_model(str(tiny_dir))
    for s, ppl, *_ in there[2:]:  # computed on the workers: what this process computes
        assert ppl == pytest.approx(dataset_perplexity(m, tok, "wikitext2-test", s, 256)["ppl"], rel=1e-5)
    pids = {r[3] for r in there}
    assert len(pids) == 2 and os.getpid() not in pids  # both worker processes, none of it in this one
    assert {r[4] for r in there} == {max(1, os.cpu_count() // 2)}  # each worker its share of the cores, not dask's 1

    again = run(RunnerParams(), tiny_dir, [48, 64])  # and back: the workers' steps are cached here too
    assert [r[:3] for r in again] == [(*r[:2], "Cached") for r in there[2:]]


def _wait_for(path: Path, procs, seconds: float = 120) -> None:
    import time

    t0 = time.monotonic()
    while not path.exists():
        for pr in procs:
            if pr.poll() is not None:
                raise RuntimeError(f"{pr.args[:3]} exited {pr.returncode}")
        if time.monotonic() - t0 > seconds:
            raise TimeoutError(f"{path} not written in {seconds} s")
        time.sleep(0.5)


def test_matrix_on_a_remote_dask_scheduler(tiny_dir, tmp_path):
    """`runner.address`: an existing cluster, as on SLURM or Kubernetes: a `dask scheduler` and a `dask
    worker` started as their own processes on 127.0.0.1 (not by this process), told only the scheduler's
    address. The workers see the flow's store, code and Prefect API through their environment, as the
    module's docstring asks of a real cluster; the cells run there, with this process's results."""
    import json
    import subprocess
    import sys

    from flows.cluster import _prefect_api
    from flows.params import RunnerParams
    from transmla.evaluation.perplexity import dataset_perplexity
    from transmla.io.sources import load_model

    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_API_URL": _prefect_api(), "OMP_NUM_THREADS": "1",
           # the workers import the flow's modules (tasks, flows, transmla) and this test module's `cell` by name
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    sched_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([str(bin_dir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", str(sched_file)], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait_for(sched_file, procs)
        address = json.loads(sched_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        procs.append(subprocess.Popen([str(bin_dir / "dask"), "worker", address, "--host", "127.0.0.1", "--nworkers", "2",
                                       "--nthreads", "1", "--no-dashboard"], env=env, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        from distributed import Client

        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            workers = set(client.run(os.getpid).values())  # the worker processes' pids
        out = run(RunnerParams(kind="dask", address=address), tiny_dir, [24, 40])
        assert [r[2] for r in out] == ["Completed", "Completed"]
        assert {r[3] for r in out} <= workers and os.getpid() not in workers
        m, tok = load_model(str(tiny_dir))
        for s, ppl, *_ in out:
            assert ppl == pytest.approx(dataset_perplexity(m, tok, "wikitext2-test", s, 256)["ppl"], rel=1e-5)
        again = run(RunnerParams(), tiny_dir, [24, 40])  # the remote workers' steps are in the shared store
        assert [r[:3] for r in again] == [(*r[:2], "Cached") for r in out]
    finally:
        for pr in reversed(procs):
            pr.terminate()
        for pr in reversed(procs):
            try:
                pr.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pr.kill()


def test_runner_params():
    from flows.params import load_profile

    assert load_profile(REPO / "params" / "default.yaml").runner.kind == "local"
    assert load_profile(REPO / "params" / "paper.yaml").runner.kind == "local"
    p = load_profile(REPO / "params" / "default.yaml", {"runner.kind": "dask", "runner.address": "tcp://10.0.0.1:8786"})
    assert (p.runner.kind, p.runner.address) == ("dask", "tcp://10.0.0.1:8786")


@pytest.mark.parametrize("override, message", [
    ({"runner.kind": "ray"}, "runner.kind: Input should be 'local' or 'dask'"),
    ({"runner.workers": 0}, "runner.workers"),
    ({"runner.address": "tcp://10.0.0.1:8786"}, "set runner.kind: dask"),
    ({"runner.processes": True}, "runner.processes"),
])
def test_bad_runner_params_name_the_field(override, message):
    from flows.params import load_profile

    with pytest.raises(TransMLAError) as e:
        load_profile(REPO / "params" / "default.yaml", override)
    assert message in str(e.value) and "Fix:" in str(e.value)


def test_task_runner_kinds():
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from flows.cluster import task_runner
    from flows.params import RunnerParams

    assert isinstance(task_runner(RunnerParams()), ThreadPoolTaskRunner)
    remote = task_runner(RunnerParams(kind="dask", address="tcp://10.0.0.1:8786"))
    assert isinstance(remote, DaskTaskRunner) and remote.address == "tcp://10.0.0.1:8786"


def test_a_local_cluster_shares_the_cores_among_the_variants_it_runs_at_once(monkeypatch):
    """workers x threads_per_worker variants run at once, each one torch job: each gets cores / (their number)
    threads (per worker alone, 2 workers x 4 variants on 16 cores made 64 compute threads)."""
    import flows.cluster as C
    from flows.params import RunnerParams

    monkeypatch.setattr(C.os, "cpu_count", lambda: 16)
    for workers, per_worker, want in ((2, 1, "8"), (2, 4, "2"), (4, 8, "1")):
        kw = C.task_runner(RunnerParams(kind="dask", workers=workers, threads_per_worker=per_worker)).cluster_kwargs
        assert kw["n_workers"] == workers and kw["threads_per_worker"] == per_worker
        assert kw["env"]["OMP_NUM_THREADS"] == kw["env"]["MKL_NUM_THREADS"] == want, (workers, per_worker)


def test_paper_flow_ships_to_workers():
    """Dask pickles the variant task and the flow run's context (the flow): by name, not by value
    (by value, their globals drag in the cached tasks' context variables, which do not pickle)."""
    from distributed.protocol.pickle import dumps, loads

    from flows.cluster import task_runner
    from flows.params import RunnerParams
    from flows.paper import paper_flow, variant, variant_rows

    assert loads(dumps(variant)).fn is variant_rows
    flow_on_dask = paper_flow.with_options(task_runner=task_runner(RunnerParams(kind="dask", address="tcp://127.0.0.1:1")))
    assert loads(dumps(flow_on_dask)).fn is paper_flow.fn


@task(persist_result=False)
def checked(i: int) -> int:
    """A matrix cell that fails for some inputs: a user's mistake (TransMLAError) or a bug (ValueError)."""
    if i in (1, 3):
        raise TransMLAError(f"cell {i} got bad input.", f"give cell {i} good input.")
    if i == 4:
        raise ValueError("cell 4 has a bug")
    return i * 10


@flow
def failing_matrix(cells: list[int], runner) -> list:
    from flows.cluster import run_matrix

    return run_matrix(checked, [(i,) for i in cells], runner, names=[f"cell {i}" for i in cells])


def test_every_failed_run_of_a_dask_matrix_is_reported():
    """All the matrix's failures come back once every run has finished, not the first alone (the others were
    only in the workers' logs): input errors as one line naming each run and its fix, a bug among them as an
    ExceptionGroup keeping every traceback; a single failure as itself."""
    from flows.cluster import task_runner
    from flows.params import RunnerParams

    runner = RunnerParams(kind="dask", workers=2)

    def go(cells):
        return failing_matrix.with_options(task_runner=task_runner(runner))(cells, runner)

    assert go([0, 2]) == [0, 20]
    with pytest.raises(TransMLAError) as e:
        go([0, 1, 2, 3])
    msg = str(e.value)
    assert msg.startswith("2 of 4 runs failed: [cell 1] cell 1 got bad input. Fix: give cell 1 good input. | "
                          "[cell 3] cell 3 got bad input. Fix: give cell 3 good input.") and "\n" not in msg, msg
    with pytest.raises(ExceptionGroup) as g:
        go([1, 4, 5])
    assert "2 of 3 runs failed: cell 1, cell 4" in str(g.value)
    assert [type(x) for x in g.value.exceptions] == [TransMLAError, ValueError]
    with pytest.raises(ValueError, match="cell 4 has a bug"):
        go([4, 5])


def test_run_matrix_refuses_names_that_do_not_match_the_calls():
    """A `names` list shorter than the calls would have dropped the unnamed calls' results and failures."""
    from flows.cluster import run_matrix
    from flows.params import RunnerParams

    with pytest.raises(ValueError, match="2 names for 3 calls"):
        run_matrix(checked, [(0,), (1,), (2,)], RunnerParams(kind="dask"), names=["a", "b"])

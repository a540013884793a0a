"""Where the paper flow runs its models x budgets x methods matrix: in the flow's process (`runner:
kind: local`, the default) or in parallel on a Dask cluster (`kind: dask`).

Dask through Prefect's own integration, prefect-dask's DaskTaskRunner: it runs Prefect tasks on a
dask.distributed cluster (a LocalCluster here, or an existing scheduler: dask-jobqueue on SLURM,
dask-kubernetes, ...) with no Prefect server-side work pool to run, and the tasks stay Prefect tasks,
so the cached steps inside each variant keep their keys and a Dask run and an in-process run reuse
each other's results. Scheduling is Dask's; this module only picks the runner.

The workers must see what the flow's process sees: the same working directory (outputs are
relative paths), TRANSMLA_STORE (the cache), the model sources and data, and one Prefect API
(PREFECT_API_URL; a local cluster is handed this process's temporary server).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prefect import Task
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from transmla.errors import TransMLAError

from .params import RunnerParams


def task_runner(runner: RunnerParams) -> TaskRunner:
    """The flow's task runner for `runner:` (local: Prefect's default, as every flow here runs)."""
    if runner.kind == "local":
        return ThreadPoolTaskRunner()
    from prefect_dask import DaskTaskRunner

    if runner.address:
        return DaskTaskRunner(address=runner.address)
    # Dask's nanny starts workers with OMP/MKL/OpenBLAS at 1 thread (sized for many small numpy
    # tasks); a variant is one long torch job, so each of the workers x threads_per_worker variants running at
    # once gets its share of this machine's cores (per worker alone, threads_per_worker > 1 oversubscribed them)
    threads = str(max(1, (os.cpu_count() or 1) // (runner.workers * runner.threads_per_worker)))
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
        "n_workers": runner.workers, "threads_per_worker": runner.threads_per_worker, "processes": True,
        "host": "127.0.0.1", "dashboard_address": None,
        "env": {**dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), threads),
                # without it every worker process would start its own temporary Prefect server (8-21 s each)
                "PREFECT_API_URL": _prefect_api()}})


def run_matrix(fn: Task, calls: Sequence[tuple], runner: RunnerParams, names: Sequence[str] | None = None) -> list:
    """fn(*call) for every call, in order -> their results, inside a flow run with `task_runner(runner)`.

    local: its function called one after another in the flow's thread, as plain steps of the flow
    (what the flow did before it had a runner; an interrupt stops the running call at once,
    flows/_cli.py). dask: each call a task run on the cluster, all submitted, then awaited; once every
    call has finished (the others' outputs are kept) the failures are raised together: one failure as
    itself, several input errors as one TransMLAError naming each call (`names`, default fn's name and
    the call's index) with its own fix, anything else as an ExceptionGroup (each its traceback).
    """
    if names is not None and len(names) != len(calls):
        raise ValueError(f"run_matrix: {len(names)} names for {len(calls)} calls")
    if runner.kind == "local":
        return [fn.fn(*call) for call in calls]
    futures = [fn.submit(*call) for call in calls]
    for f in futures:
        f.wait()
    names = list(names) if names is not None else [f"{fn.name} #{i}" for i in range(len(calls))]
    results, failed = [], []
    for name, f in zip(names, futures, strict=True):  # a short `names` would drop calls: a bug, raised
        try:
            results.append(f.result())
        except Exception as e:  # noqa: BLE001  (collected: raised below, with the other calls' failures)
            failed.append((name, e))
    if not failed:
        return results
    if len(failed) == 1:
        raise failed[0][1]
    what = f"{len(failed)} of {len(calls)} runs failed"
    if all(isinstance(e, TransMLAError) for _, e in failed):
        raise TransMLAError(f"{what}: " + " | ".join(f"[{name}] {e}" for name, e in failed),
                            "apply each one's fix and rerun: the runs that finished are cached.")
    raise ExceptionGroup(f"{what}: {', '.join(name for name, _ in failed)}", [e for _, e in failed])


def _prefect_api() -> str:
    """The API this process's flow runs report to: PREFECT_API_URL, or its temporary local server
    (started now; Prefect's client reuses the same one)."""
    from prefect.settings import PREFECT_API_URL

    if url := PREFECT_API_URL.value():
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url

"""MLflow tracking against a tracking server (issue 21: shared artifacts): `mlflow server` bound to
127.0.0.1 in a subprocess, MLFLOW_TRACKING_URI pointing at it, the pipeline's tracking calls logging
runs, metrics and files that a second client reads back from the server."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination",
           str(tmp_path / "server-artifacts"), "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"mlflow server exited: {proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer within 120 s")
        yield url, tmp_path / "server-artifacts"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_pipeline_tracking_logs_to_a_server(mlflow_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from tasks import tracking

    url, artifacts = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    tracking.track("server-test", "tiny", "transmla", 0.125, config={"a": 1}, params={"rank": 8},
                   metrics={"ppl": 42.0}, history={"loss": [(1, 3.0), (2, 2.5)]})
    table = tmp_path / "table1.md"
    table.write_text("| method | ppl |\n")
    tracking.log_files("server-test", "tiny", [table])

    client = MlflowClient(tracking_uri=url)  # a second client: what anyone pointing at the server sees
    exp = client.get_experiment_by_name("server-test")
    assert exp.artifact_location.startswith("mlflow-artifacts:")  # the server's store, not this machine's path
    runs = {r.data.tags.get(tracking.ROLE): r for r in client.search_runs([exp.experiment_id])}
    variant = runs["variant"]
    assert variant.data.metrics["ppl"] == 42.0 and variant.data.params["rank"] == "8"
    assert [m.value for m in client.get_metric_history(variant.info.run_id, "loss")] == [3.0, 2.5]
    assert [f.path for f in client.list_artifacts(runs["pipeline"].info.run_id)] == ["table1.md"]
    assert any(p.name == "table1.md" for p in artifacts.rglob("*"))  # stored where the server keeps artifacts

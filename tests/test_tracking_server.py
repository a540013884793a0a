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


# ------------------------------------------------------------------ a store that does not answer


def _closed_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"  # nothing listens there once the probe socket is closed


def test_an_absent_server_is_refused_before_the_flow_starts(tmp_path):
    """MLFLOW_TRACKING_URI at a server that is not running: the flow command says so, with the fix, before
    its run starts (MLflow found out only when the stage logged, after its work, and retried for minutes).
    PREFECT_API_URL points at a closed port too: a flow run that started would fail otherwise."""
    import yaml

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    params = tmp_path / "profile.yaml"
    params.write_text(yaml.safe_dump({"models": {"tiny": {"source": str(tmp_path / "no-such-model")}},
                                      "pipeline": {"models": ["tiny"], "budgets": [0.25], "methods": ["transmla"]}}))
    url = _closed_url()
    env = {**os.environ, "PYTHONPATH": repo, "MLFLOW_TRACKING_URI": url, "PREFECT_API_URL": _closed_url() + "/api",
           "PREFECT_CLIENT_MAX_RETRIES": "0"}
    r = subprocess.run([sys.executable, "-m", "flows.convert", "--params", str(params), "--model", "tiny",
                        "--method", "transmla", "--budget", "0.25"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    for words in (f"transmla: error: MLflow tracking server {url}", "does not answer", "Fix:",
                  "mlflow server --host 127.0.0.1", "unset MLFLOW_TRACKING_URI"):
        assert words in lines[0], lines[0]
    assert not (tmp_path / "artifacts").exists()


def test_check_store_accepts_any_http_answer_and_usable_sqlite(tmp_path):
    """Any HTTP answer counts (a proxy may refuse /health; MLflow then says why); a new sqlite file in a
    new folder, or an existing MLflow database, passes."""
    import http.server
    import threading

    from tasks import tracking

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        tracking.check_store(f"http://127.0.0.1:{srv.server_address[1]}")
    finally:
        srv.shutdown()
    tracking.check_store(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")
    assert not (tmp_path / "new").exists()  # checked, not created
    db = tmp_path / "mlflow.db"
    tracking.check_store(f"sqlite:///{db}")
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{db}").create_experiment("x")
    tracking.check_store(f"sqlite:///{db}")


def test_check_store_refuses_what_is_not_a_store(tmp_path):
    from tasks import tracking
    from transmla.errors import TransMLAError

    not_db = tmp_path / "notes.db"
    not_db.write_text("my notes")
    with pytest.raises(TransMLAError, match="is not an SQLite database"):
        tracking.check_store(f"sqlite:///{not_db}")
    assert not_db.read_text() == "my notes"
    with pytest.raises(TransMLAError, match="is a file, not a folder"):
        tracking.check_store(f"sqlite:///{not_db / 'sub' / 'mlflow.db'}")
    with pytest.raises(TransMLAError, match="does not answer"):
        tracking.check_store(_closed_url())


def test_a_store_lost_while_logging_is_one_error(monkeypatch):
    """A server that goes away after the up-front check: the stage's last step (logging) fails as one line
    naming the store and the fix, after few retries, not MLflow's exception after minutes of them; a bug in
    what is logged keeps its traceback."""
    from tasks import tracking
    from transmla.errors import TransMLAError

    url = _closed_url()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(TransMLAError, match=f"MLflow tracking into {url} failed") as e:
        tracking.track("lost", "tiny", "transmla", 0.125, metrics={"ppl": 1.0})
    assert "\n" not in str(e.value) and "rerun" in str(e.value)
    with pytest.raises(TransMLAError, match="failed"):
        tracking.log_files("lost", "tiny", [])
    monkeypatch.setattr(tracking, "stage_run", lambda *a, **k: (_ for _ in ()).throw(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        tracking.track("lost", "tiny", "transmla", 0.125)


def test_mlflow_retries_a_lost_server_briefly():
    """The pipeline's defaults for MLflow's HTTP retries (a stage's logging gives up in seconds, not minutes),
    unless the environment sets its own."""
    code = ("import tasks, os; print(os.environ['MLFLOW_HTTP_REQUEST_MAX_RETRIES'], "
            "os.environ['MLFLOW_HTTP_REQUEST_TIMEOUT'])")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["3", "30"], out.stderr
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "7"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["7", "30"], out.stderr


def test_check_store_names_a_bad_port_or_another_service_and_lets_tls_through(tmp_path):
    """A port that is not a number, or a service that is not HTTP (one that greets first, as SSH does), is one
    error (they escaped as http.client's exceptions); an HTTPS server whose certificate this machine does not
    trust answers, so it passes: MLflow decides with its own TLS settings (MLFLOW_TRACKING_INSECURE_TLS, ...)."""
    import shutil
    import socket
    import ssl
    import threading

    from tasks import tracking
    from transmla.errors import TransMLAError

    with pytest.raises(TransMLAError, match="nonnumeric port"):
        tracking.check_store("http://localhost:50OO")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def greet():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()

    threading.Thread(target=greet, daemon=True).start()
    try:
        with pytest.raises(TransMLAError, match="does not answer .*SSH-2.0") as e:
            tracking.check_store(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=5)
        assert "\n" not in str(e.value)
    finally:
        sock.close()
    if shutil.which("openssl") is None:
        return
    import http.server

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")], check=True,
                   capture_output=True)

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Ok)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        tracking.check_store(f"https://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()


def test_a_file_missing_from_what_is_logged_is_not_the_stores_fault(tmp_path):
    """A file to log that is not there is a bug of the flow, raised as itself before anything is logged, not
    reported as the store's failure with a fix about reaching it."""
    from tasks import tracking

    with pytest.raises(FileNotFoundError, match="no file .*missing.png to log"):
        tracking.track("missing", "tiny", "transmla", 0.125, files=[tmp_path / "missing.png"])
    with pytest.raises(FileNotFoundError, match="missing.md"):
        tracking.log_files("missing", "tiny", [tmp_path / "missing.md"])


def test_a_one_off_evaluation_needs_no_tracking_store(tmp_path):
    """`flows.evaluate --out FILE` logs nothing to MLflow: an absent tracking server does not stop it (the store
    is checked only for the runs that log to it)."""
    code = ("import sys; from flows import _cli; sys.argv = ['x', '--params', sys.argv[1], *sys.argv[2:]]; "
            "_cli.entry(lambda profile, *pos, **kw: print('ran', sorted(kw)), 'doc', tracked='out', out='output')")
    import yaml

    params = tmp_path / "profile.yaml"
    params.write_text(yaml.safe_dump({"models": {"tiny": {"source": str(tmp_path / "m")}},
                                      "pipeline": {"models": ["tiny"], "budgets": [0.25], "methods": ["transmla"]}}))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo, "MLFLOW_TRACKING_URI": _closed_url()}
    one_off = subprocess.run([sys.executable, "-c", code, str(params), "--model", "tiny", "--out", str(tmp_path / "o.json")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert one_off.returncode == 0 and one_off.stdout.split() == ["ran", "['out']"], one_off.stderr[-2000:]
    logged = subprocess.run([sys.executable, "-c", code, str(params), "--model", "tiny"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert logged.returncode == 2 and "does not answer" in logged.stderr, logged.stderr[-2000:]


def test_the_evaluation_tags_are_the_last_runs_whole_set():
    """The evaluate stage tags the variant's run with its config (eval.*); after evaluation.limits changed, the
    old eval.limits.<task> tags stayed on the run beside the new config, which never scored them."""
    from tasks import tracking

    first = {"eval.limit": 170, "eval.limits": {"mmlu": 146, "piqa": 200}}
    tracking.track("tags-test", "tiny", "transmla", 0.125, tags=first, tag_prefix="eval.")
    tracking.track("tags-test", "tiny", "transmla", 0.125, tags={"eval.limit": 5, "eval.limits": {"piqa": 3}},
                   tag_prefix="eval.")
    client, run_id = tracking.stage_run("tags-test", "tiny", "transmla", 0.125)
    tags = client.get_run(run_id).data.tags
    assert {k: v for k, v in tags.items() if k.startswith("eval.")} == {"eval.limit": "5", "eval.limits.piqa": "3"}
    assert tags["transmla.model"] == "tiny"  # the run's own tags, outside the prefix, stay


def test_a_store_that_answers_but_refuses_mlflow_is_one_error_before_the_work(monkeypatch):
    """check_store takes any HTTP answer (an auth proxy's 403 too); the experiment check that follows it then
    asked MLflow outside the store-error wrapper, and every tracked flow ended in a bare MlflowException traceback."""
    from mlflow.exceptions import MlflowException

    from tasks import tracking
    from transmla.errors import TransMLAError

    def refused(*a, **k):
        raise MlflowException("API request to endpoint /api/2.0/mlflow/experiments/get-by-name failed with error "
                              "code 403 != 200")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setattr(tracking, "_client", refused)
    with pytest.raises(TransMLAError, match="MLflow tracking into http://127.0.0.1:9 failed: .*403"):
        tracking.check_experiment("transmla")

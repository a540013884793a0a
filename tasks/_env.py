"""Prefect defaults for a machine with no network and no configured server.

Set before Prefect is imported; every value can be overridden from the environment:
  TRANSMLA_STORE (default <repo>/.transmla): the artifact store, Prefect's home (its sqlite DB and
    persisted task results) and the MLflow store live under it.
  PREFECT_API_URL unset: Prefect starts a temporary local server (127.0.0.1) per process;
    `scripts/repro.sh` (make repro) starts one for all DVC stages instead.
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STORE = Path(os.environ.get("TRANSMLA_STORE", REPO_ROOT / ".transmla")).resolve()

_DEFAULTS = {
    "PREFECT_HOME": str(STORE / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # The temporary server takes 8-21 s to start here; the default timeout is too tight.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_TO_API_ENABLED": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
    "PREFECT_UI_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_TRACKING_URI": f"sqlite:///{STORE / 'mlflow.db'}",
    # A tracking server that went away mid-run: MLflow's defaults (7 retries, 2^k s apart, 120 s per request)
    # hold a finished stage for minutes before it fails; these fail it in about 15 s.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
for _k, _v in _DEFAULTS.items():
    os.environ.setdefault(_k, _v)

# Prefect's server cannot create its sqlite file in a missing directory ("unable to open database file").
Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
STORE.mkdir(parents=True, exist_ok=True)

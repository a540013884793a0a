#!/usr/bin/env bash
# `make repro`: run `dvc repro` with ONE local Prefect server (127.0.0.1) shared by all DVC stages,
# instead of a temporary server started (8-21 s) inside every stage's process. Stopped on exit.
# Plain `dvc repro` works too (each stage then starts its own temporary server).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
STORE=${TRANSMLA_STORE:-$PWD/.transmla}
export PREFECT_HOME=${PREFECT_HOME:-$STORE/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_ENABLED=false DO_NOT_TRACK=1
mkdir -p "$PREFECT_HOME"

# Nothing to run (dvc status -q exits 0): skip the server start-up.
if [ -z "${PREFECT_API_URL:-}" ] && [ $# -eq 0 ] && "$BIN/dvc" status -q >/dev/null 2>&1; then
  NEED_SERVER=0
else
  NEED_SERVER=1
fi
if [ -z "${PREFECT_API_URL:-}" ] && [ "$NEED_SERVER" = 1 ]; then
  PORT=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >"$PREFECT_HOME/server.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 1 180); do
    if "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/api/health', timeout=2)" 2>/dev/null; then
      export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
      break
    fi
    kill -0 $SERVER 2>/dev/null || break
    sleep 1
  done
  if [ -z "${PREFECT_API_URL:-}" ]; then
    echo "repro: the shared Prefect server did not start (see $PREFECT_HOME/server.log); stages will start their own." >&2
  else
    echo "repro: Prefect server on $PREFECT_API_URL (one for all stages)" >&2
  fi
fi
start=$(date +%s)
"$BIN/dvc" repro "$@"
echo "repro: dvc repro took $(( $(date +%s) - start )) s" >&2

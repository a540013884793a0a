#!/usr/bin/env bash
# Create the project's virtual environment and install the project with its pins.
# Called by `make setup`; safe to run again (pip skips what is already satisfied).
set -euo pipefail
PYTHON=${1:-python3}
VENV=${2:-.venv}
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"transmla needs Python >= 3.11, found {sys.version.split()[0]}; set PYTHON=python3.11 (make PYTHON=...)")
PY
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# constraints.txt pins torch to the CPU build and keeps FastAPI compatible with Prefect.
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[test]'

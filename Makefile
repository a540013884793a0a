# Two entry points for a fresh machine:
#   make repro   set up, then run the main job on the default model (SmolLM2-135M, CPU)
#   make test    set up, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.transmla-installed

.PHONY: setup repro test test-fast clean-venv

setup: $(STAMP)

# Idempotent: re-installs only when the dependency declarations change.
$(STAMP): pyproject.toml constraints.txt
	@bash scripts/setup.sh "$(PYTHON)" "$(VENV)"
	@touch $(STAMP)

repro: setup
	BIN=$(BIN) bash scripts/repro.sh

test: setup
	$(BIN)/python -m pytest -q tests

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

clean-venv:
	rm -rf $(VENV)

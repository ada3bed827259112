# Two promises on a fresh machine: `make run` sets up and runs the main job; `make test` sets up and
# passes the tests. Both create .venv and install torch==2.13.0 (CPU wheel) before the project, so
# pip never pulls a CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml
	@echo "==> [1/4] virtualenv $(VENV)"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "==> [2/4] pip"
	$(PY) -m pip install --progress-bar on --upgrade pip
	@echo "==> [3/4] torch==2.13.0 (the largest download)"
	$(PY) -m pip install --progress-bar on torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	@echo "==> [4/4] chameleond and its development tools"
	$(PY) -m pip install --progress-bar on -e '.[worker,local,hf,dev,compare]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/chameleonctl up

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: setup lint
	bash scripts/test-peers.sh
	$(PY) -m pytest -q --durations=15

bench: setup
	$(VENV)/bin/chameleonctl bench planner
	$(VENV)/bin/chameleonctl bench ingest
	$(VENV)/bin/chameleonctl bench recovery

clean:
	rm -rf $(VENV) build dist *.egg-info

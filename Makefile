# `make demo` and `make test` both create or reuse .venv in the repo root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONHASHSEED := 0

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,hf,remote,datasets]'
	# the megatron test extra, without dependencies (x86-64 Linux wheels for CPython 3.10-3.12; elsewhere its comparison tests skip)
	$(BIN)/python -m pip install -q --no-deps 'megatron-core==0.16.1' || echo "megatron-core not installed: its comparison tests skip"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python tools/demo.py

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x --durations=15

bench: $(STAMP)
	$(BIN)/python tools/bench_loader.py
	$(BIN)/python tools/bench_planner.py

clean:
	rm -rf $(VENV) build *.egg-info .demo

# The two commands of the README: `make demo` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The exact CPU wheel on disk, installed before remat: pyproject only asks for torch>=2.4
# (remat installs beside a user's CUDA build), which pip could satisfy with a multi-GB CUDA wheel.
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-fast bench clean

$(BIN)/remat: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,models,plot]'
	touch $@

setup: $(BIN)/remat

demo: setup
	$(BIN)/remat demo

test: setup
	$(BIN)/python -m pytest -q

# A quick subset while working (not what CI runs): every test not marked slow, gpu or heavy.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not heavy"

# Every zoo model beside torch's options; rewrites its section of BENCHMARKS.md and docs/pareto-*.png.
bench: setup
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

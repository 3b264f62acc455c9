# The two commands of the README: `make demo` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The exact CPU wheel on disk, installed before remat: pyproject asks for a range
# (remat installs beside a user's CUDA build), which pip could satisfy with a multi-GB CUDA wheel.
TORCH ?= torch==2.13.0

# The compatibility lane: the newest torch remat declares, from PyPI (its CUDA build, which runs on
# CPU), with the oldest transformers it declares, in a venv of its own beside the main one.
# COMPAT_TESTS: the four directories in full, as CI (.ci/run) runs them; docs/drop-in.md "Versions tested"
# has the results and times.
COMPAT_VENV := .venv-compat
COMPAT_BIN := $(COMPAT_VENV)/bin
COMPAT_TORCH ?= torch==2.14.1
COMPAT_TRANSFORMERS ?= transformers==4.57.6
# torchvision's and timm's models (DenseNet's list arguments, ViT's attention, timm's own checkpointing switch)
# run in this lane only: torchvision's wheel pins torch
COMPAT_EXTRAS ?= torchvision==0.29.1 timm==1.0.31
COMPAT_TESTS ?= tests/core tests/planning tests/profiling tests/diagnosis

.PHONY: setup demo test test-fast test-compat lint bench clean

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

# What CI checks besides the tests: ruff's rules and format, and mypy on src/ (pyproject.toml).
lint: setup
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

# A quick subset while working (not what CI runs): every test not marked slow, gpu or heavy.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not heavy"

# Every zoo model beside torch's options; rewrites its section of BENCHMARKS.md and docs/pareto-*.png.
bench: setup
	$(BIN)/python benchmarks/bench.py

$(COMPAT_BIN)/remat: pyproject.toml
	$(PY) -m venv $(COMPAT_VENV)
	$(COMPAT_BIN)/pip install -q --upgrade pip
	$(COMPAT_BIN)/pip install -q $(COMPAT_TORCH)
	$(COMPAT_BIN)/pip install -q -e '.[test,models,plot]' $(COMPAT_TRANSFORMERS) $(COMPAT_EXTRAS)
	touch $@

test-compat: $(COMPAT_BIN)/remat
	$(COMPAT_BIN)/python -c 'import torch, transformers; print("compat lane: torch", torch.__version__, "transformers", transformers.__version__)'
	$(COMPAT_BIN)/python -m pytest -q $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build src/*.egg-info .pytest_cache

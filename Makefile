# The two commands of the README: `make demo` (set up + main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/remat: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,models,plot]'
	touch $@

setup: $(BIN)/remat

demo: setup
	$(BIN)/remat demo

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

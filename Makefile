# Two commands: `make demo` and `make test`. Each creates/refreshes .venv and installs what it needs.
# torch is installed first as the CPU build (TORCH_SPEC); on a GPU machine, install your own torch
# into the venv (or set TORCH_SPEC) — a torch that already satisfies it is left alone.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# NeMo Automodel's diffusion recipe (knapformer.integrations.automodel and its tests). --no-deps:
# its declared dependencies pin transformers 5.18 (torchtitan's extra needs 5.25) and pull CUDA
# packages; what its diffusion recipe imports on a CPU (transformers, torchdata, diffusers, pyyaml)
# the extras above already install.
AUTOMODEL_SPEC ?= nemo-automodel==0.7.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo plan-demo test docs bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev,diffusers,torchtitan]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(AUTOMODEL_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

# The main job on its built-in default: 2 CPU ranks train a small MMDiT on a heterogeneous
# batch with and without balancing (per-sequence groups, `--bags auto`; report + charts in runs/demo).
demo: setup
	$(PY) -m knapformer demo

plan-demo: setup
	$(PY) -m knapformer.tools.plan_demo --out runs/plan-demo

# compileall: every spawned test rank imports knapformer; cached bytecode saves each ~0.3 s
# (where PYTHONDONTWRITEBYTECODE is set, Python still reads what compileall wrote).
# TEST_WORKERS pytest-xdist processes share the tests (most of a multi-rank test's time is
# waiting); no test's verdict depends on machine load, so running two at once is safe.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check knapformer tests benchmarks examples
	$(PY) -m compileall -q knapformer tests examples > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The documentation site (MkDocs + Material + mkdocstrings) into site/; warnings fail the build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: setup
	$(PY) benchmarks/plan_quality.py
	$(PY) benchmarks/plan_latency.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis

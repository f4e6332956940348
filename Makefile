# Entry points: `make demo`, `make test` and `make bench`. All create .venv and install on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/ray-train-xla demo

lint: setup
	$(PY) -m ruff check src tests examples benchmarks

# Whole suite under Ray Train V2 (the default), then the Ray tests again under Train V1.
test: setup lint
	$(PYTEST) -q tests
	RAY_TRAIN_V2_ENABLED=0 $(PYTEST) -q -m train_v1 tests

# Every figure of benchmarks/run.py (about 15 minutes here); BENCH_ARGS=--quick for a few.
bench: setup
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info

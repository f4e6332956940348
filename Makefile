# Entry points: `make demo`, `make test` and `make bench`. All create .venv and install on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup demo test test-e2e lint bench clean

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

# The suite under Ray Train V2 (the default): within 20 minutes on 2 cores. The tests on Ray and
# the others run side by side (tests/run_suite.py). The long end-to-end scenarios (marker e2e),
# then the Ray tests marked train_v1 again under Train V1, are `make test-e2e` (about 30 minutes
# more); CI runs both.
test: setup lint
	$(PY) tests/run_suite.py -q -m "not e2e" tests

test-e2e: setup
	$(PYTEST) -q -m e2e tests
	RAY_TRAIN_V2_ENABLED=0 $(PYTEST) -q -m train_v1 tests

# Every figure of benchmarks/run.py (about 15 minutes here); BENCH_ARGS=--quick for a few.
bench: setup
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info

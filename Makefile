# Entry points: `make demo`, `make test` and `make bench`. All create .venv and install on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest -p no:cacheprovider
# The native path again on the torch the native stacks ship (TorchNeuron, Neuron SDK 2.34: torch
# 2.13/2.14; torch-tpu 0.2: 2.11 to 2.15), without torch_xla: a second environment, on the newest
# TorchNeuron's torch.
NATIVE_TORCH ?= 2.14.1
NATIVE_VENV ?= .venv-native
NATIVE_PY := $(NATIVE_VENV)/bin/python
NATIVE_STAMP := $(NATIVE_VENV)/.installed-torch-$(NATIVE_TORCH)

.PHONY: setup setup-native demo test test-e2e test-native lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

$(NATIVE_STAMP): pyproject.toml
	rm -f $(NATIVE_VENV)/.installed-torch-*
	$(PYTHON) -m venv $(NATIVE_VENV)
	$(NATIVE_PY) -m pip install --quiet --upgrade pip
	$(NATIVE_PY) -m pip install --quiet "torch==$(NATIVE_TORCH)" -e ".[test,hf,metrics,plot]"
	touch $(NATIVE_STAMP)

setup-native: $(NATIVE_STAMP)

demo: setup
	$(VENV)/bin/ray-train-xla demo

lint: setup
	$(PY) -m ruff check src tests examples benchmarks

# The suite under Ray Train V2 (the default): within 12 minutes on 2 cores. The tests on Ray and
# the others run side by side (tests/run_suite.py). The long end-to-end scenarios (marker e2e),
# then the Ray tests marked train_v1 again under Train V1, are `make test-e2e` (about 30 minutes
# more); the native configs' long scenarios (marker native_only) are `make test-native`'s; CI
# runs all three.
test: setup lint
	$(PY) tests/run_suite.py -q -m "not e2e and not native_only" tests

test-e2e: setup
	$(PYTEST) -q -m e2e tests
	RAY_TRAIN_V2_ENABLED=0 $(PYTEST) -q -m train_v1 tests

# The tests marked native (FSDP2, the sliced pretrained load and export, staging, the writer
# processes, the memory tier, consolidate, elastic, goodput, the private names of torch) on
# torch $(NATIVE_TORCH) without torch_xla, as the two halves of `make test`; CI runs it last.
test-native: setup-native
	$(NATIVE_PY) tests/run_suite.py -q -m native tests

# Every figure of benchmarks/run.py (about 15 minutes here); BENCH_ARGS=--quick for a few.
bench: setup
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(NATIVE_VENV) build src/*.egg-info

# loraplane — `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# Tiers this machine can run (gpu runs through the device tool, see docs/testing.md).
TIERS ?= unit kernels multirank integration cluster
PYTEST_ARGS ?=

help: ## List the targets
	@grep -hE '^[a-z][a-zA-Z%_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || bash scripts/preflight.sh
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## Create or reuse .venv and install loraplane with its dev extras

demo: install ## Run the whole stack on this machine and show adapters served in mixed batches
	$(VENV)/bin/loraplane demo run

test: install ## Install, start the real services the tests need, run every tier this machine can run
	bash scripts/test.sh $(TIERS)

test-%: install ## Run one tier: make test-unit, test-kernels, test-multirank, test-integration, test-cluster
	bash scripts/test.sh $*

lint: install ## ruff, mypy and the import-layer contracts
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=worker/src:controlplane/src:operator/src $(VENV)/bin/lint-imports

bench: install ## CPU benchmarks (JSON in bench/results/cpu/); GPU ones: bash bench/run_gpu.sh on an H200
	@mkdir -p bench/results/cpu
	$(VENV)/bin/loraplane bench worker-cpu | tee bench/results/cpu/worker_cpu.json
	@if [ -f bench/controlplane_bench.py ]; then \
	  bash scripts/services.sh start && eval "$$(bash scripts/services.sh env)" && \
	  $(PY) bench/controlplane_bench.py --pg-url "$$LORAPLANE_TEST_PG_URL" | tee bench/results/cpu/controlplane.json; \
	fi

.PHONY: help install demo test lint bench

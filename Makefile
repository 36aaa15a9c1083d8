# The two commands a new machine needs: `make run` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONF ?= conf/migratorydata.conf

.PHONY: run test lint unit venv deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,spark]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/migratory serve -c $(CONF)

LINT_DIRS := $(wildcard migratory cli tests spark tools bench images)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)
	$(BIN)/mypy

deps:
	bash .ci/deps.sh

unit: $(STAMP) deps
	$(BIN)/pytest -q

test: lint unit

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

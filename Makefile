# The two commands a new machine needs: `make run` and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONF ?= conf/migratorydata.conf

.PHONY: run test lint unit venv deps clean deb rpm packages image image-base

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,spark]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/migratory serve -c $(CONF)

LINT_DIRS := $(wildcard migratory cli tests spark tools bench images packaging)
# Build scripts outside the installed packages, type-checked on their own (MYPYPATH finds migratory_cli and migratory_spark).
SCRIPT_PY := $(wildcard packaging/*.py images/*.py)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)
	$(BIN)/mypy
	MYPYPATH=cli:spark:. $(BIN)/mypy --strict $(SCRIPT_PY)

deps:
	bash .ci/deps.sh

unit: $(STAMP) deps
	$(BIN)/pytest -q

test: lint unit

# Packages and image, version from pyproject.toml, into dist/ (reproducible: same commit, same bytes).
deb: $(STAMP)
	$(BIN)/python packaging/build_packages.py deb

rpm: $(STAMP)
	$(BIN)/python packaging/build_packages.py rpm

packages: $(STAMP)
	$(BIN)/python packaging/build_packages.py all

# A bootable Debian disk made locally (debootstrap + qemu-img; root), then Packer installs the DEB into it.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BASE_IMAGE := dist/debian-12-base.qcow2

$(BASE_IMAGE): images/base_image.py
	$(PYTHON) images/base_image.py --out $@

image-base: $(BASE_IMAGE)

image: deb $(BASE_IMAGE)
	$(BIN)/python images/build_image.py build --force --base $(BASE_IMAGE) --output dist/image \
		--deb dist/migratorydata_$(VERSION)_$$(dpkg --print-architecture).deb

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

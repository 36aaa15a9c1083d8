# The two commands a new machine needs: `make run` and `make test` (and `make check` while iterating).
# `make run` installs what serving needs; the test targets add the dev and spark extras (PySpark is 0.5 GB).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
CONF ?= conf/migratorydata.conf

.PHONY: run test check lint unit venv deps clean deb rpm analytics packages repo image image-base jar

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml migratory/server/transport/_tlsseal.c | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(DEV_STAMP): pyproject.toml migratory/server/transport/_tlsseal.c | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,spark]'
	touch $@ $(RUN_STAMP)

venv: $(DEV_STAMP)

# The log analytics' JVM line parser (spark/java), compiled against the venv's PySpark; without it the
# analytics still run, on Spark's slower from_json (the test suite requires it: tests/test_spark_jar.py).
JAR := spark/migratory_spark/jars/migratory-spark.jar
$(JAR): $(wildcard spark/java/migratory/spark/*.java) spark/build_jar.py $(DEV_STAMP)
	$(BIN)/python spark/build_jar.py --out $@

jar: $(JAR)

run: $(RUN_STAMP)
	$(BIN)/migratory serve -c $(CONF)

LINT_DIRS := $(wildcard migratory cli tests spark tools bench images packaging)
# Build scripts outside the installed packages, type-checked on their own (MYPYPATH finds migratory_cli and migratory_spark).
SCRIPT_PY := $(wildcard packaging/*.py images/*.py spark/build_jar.py)

lint: $(DEV_STAMP)
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)
	$(BIN)/mypy
	MYPYPATH=cli:spark:. $(BIN)/mypy --strict $(SCRIPT_PY)
	$(BIN)/lint-imports  # the import rules of migratory/server/__init__.py (pyproject.toml)

deps:
	bash .ci/deps.sh

# The packaging tests run beside the rest, in a pytest of their own (tools/test_beside.sh).
unit: $(DEV_STAMP) deps $(JAR)
	bash tools/test_beside.sh $(BIN)/pytest

# Everything: lint, then every test (cluster, Spark, packages, repositories, the VM image); see README.md.
test: lint unit

# The quick tier: lint and the tests that need no VM, Spark, packaging or cluster (a few minutes, no root needed).
CHECK_SKIP := --ignore=tests/test_packaging.py --ignore=tests/test_spark.py --ignore=tests/test_spark_cli.py
check: lint
	$(BIN)/pytest -q -m "not slow and not packaging and not image and not spark" $(CHECK_SKIP)

# Packages and image, version from pyproject.toml, into dist/ (reproducible: same commit, same bytes).
# A missing tool (rpmbuild, dpkg-deb, createrepo_c, ...) is named with the package that provides it.
deb: $(RUN_STAMP)
	$(BIN)/python packaging/build_packages.py deb

rpm: $(RUN_STAMP)
	$(BIN)/python packaging/build_packages.py rpm

analytics: $(RUN_STAMP)
	$(BIN)/python packaging/build_packages.py analytics

packages: $(RUN_STAMP)
	$(BIN)/python packaging/build_packages.py everything

# Signed apt and yum repositories in dist/repo from every package in dist/ (REPO_KEY: a GnuPG key id
# in $GNUPGHOME; without it a throwaway test key is generated in dist/repo-gnupg). REPO_URL: where
# dist/repo will be served, written into dist/repo/migratorydata.sources and migratorydata.repo.
REPO_KEY ?=
REPO_URL ?= https://packages.example.com/migratorydata
REPO_ARGS = $(if $(REPO_KEY),--key $(REPO_KEY),--generate-key) --url $(REPO_URL)
repo: $(RUN_STAMP)
	$(BIN)/python packaging/build_repo.py --check-tools
	$(BIN)/python packaging/build_packages.py everything
	$(BIN)/python packaging/build_repo.py $(REPO_ARGS)

# A bootable Debian disk made locally (debootstrap + qemu-img; root), then Packer installs the DEB into it
# (and the analytics DEB with `make image ANALYTICS=1`).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
ARCH = $$(dpkg --print-architecture)
BASE_IMAGE := dist/debian-12-base.qcow2
ANALYTICS ?=

$(BASE_IMAGE): images/base_image.py
	$(PYTHON) images/base_image.py --out $@

image-base: $(BASE_IMAGE)

image: $(RUN_STAMP) $(BASE_IMAGE)
	$(BIN)/python packaging/build_packages.py deb $(if $(ANALYTICS),analytics-deb)
	$(BIN)/python images/build_image.py build --force --base $(BASE_IMAGE) --output dist/image \
		--deb dist/migratorydata_$(VERSION)_$(ARCH).deb \
		$(if $(ANALYTICS),--analytics-deb dist/migratorydata-analytics_$(VERSION)_$(ARCH).deb)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache spark/migratory_spark/jars

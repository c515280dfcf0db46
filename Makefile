# aenv — the two commands are `make run` and `make test`; both install what is missing first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.aenv-installed
export AENV_HOME ?= /var/lib/aenv

.PHONY: install system venv console base code-interpreter run test test-unit test-integration lint contracts bench soak floors version dist image lock compose-test e2b-suites e2b-suites-qemu proto clean

install: system venv console base

system:
	@scripts/install-system.sh
	@scripts/install-guest-kernel.sh

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# Until 0.2.0 the distribution was called `aenv`: an older venv still has it installed.
	@! $(BIN)/pip show -q aenv 2>/dev/null || $(BIN)/pip uninstall -q -y aenv
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[server,test]'
	@touch $(STAMP)

# The web console's front-end packages (xterm.js), exactly as package-lock.json pins them;
# again only when package.json or the lock changed. The console is served as it is: no build.
CONSOLE := src/aenv/console
CONSOLE_STAMP := $(CONSOLE)/node_modules/.aenv-installed

console: $(CONSOLE_STAMP)

$(CONSOLE_STAMP): $(CONSOLE)/package.json $(CONSOLE)/package-lock.json
	@cd $(CONSOLE) && npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error
	@touch $@

base: venv
	@$(BIN)/aenv template build-base --quiet

# Needs the server running (`make run` in another shell): its start command is built there.
code-interpreter: base
	@$(BIN)/aenv template build-code-interpreter

run: install
	$(BIN)/aenv server

# The linters, then the whole suite (unit tests first: they are fast), every failure
# reported and every skip with its reason; a skip for something `make install` provides
# fails the run (AENV_STRICT_SKIPS, tests/conftest.py). The import contracts run first (lint).
test: install lint
	AENV_STRICT_SKIPS=1 $(BIN)/python -m pytest -q -rs --timeout=600 tests/unit tests/contract tests/integration

test-unit: venv
	$(BIN)/python -m pytest -q -rs tests/unit

test-integration: install
	$(BIN)/python -m pytest -q -rs --timeout=600 tests/contract tests/integration

lint: venv contracts
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# The import contracts: the layer order, no circles, the orchestrator seen only through its
# package (every import counts, in functions and under TYPE_CHECKING too).
contracts: venv
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_import_layers.py

bench: install
	$(BIN)/aenv bench $(if $(QUICK),--quick,)

# Rollouts kept running AT_ONCE at a time for MINUTES on a server of its own, then a check
# that none failed and nothing leaked (bench/soak.py).
MINUTES ?= 30
AT_ONCE ?= 8
soak: install
	$(BIN)/python -m bench.soak --minutes $(MINUTES) --at-once $(AT_ONCE)

# The lowest version each dependency's bound allows, in a scratch venv, and the unit tests
# there (scripts/floors.sh; minutes, and not part of `make test`). ARGS go to pytest.
floors:
	@scripts/floors.sh $(ARGS)

# Releases (docs/releasing.md). The version is the git tag's (setuptools-scm); an image tag
# cannot hold a `+`, so a development version's local part is joined with a `-`.
VERSION = $(shell $(BIN)/python -m setuptools_scm 2>/dev/null)
TAG = $(subst +,-,$(VERSION))

version: venv
	@echo $(VERSION)

# The wheel, checked to hold the `aenv` package and nothing beside it.
dist: venv
	rm -rf dist
	$(BIN)/pip wheel -q --disable-pip-version-check --no-deps -w dist .
	@$(BIN)/python -c 'import sys, zipfile; names = {n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()}; extra = sorted(n for n in names if n != "aenv" and not n.endswith(".dist-info")); sys.exit(f"stray top-level entries in the wheel: {extra}" if extra else 0)' dist/*.whl
	@ls dist

# The container images (deploy/docker/Dockerfile), tagged with the version (the build context
# has no .git, so it goes in as a build argument): aenv:TAG (the node) and aenv-gateway:TAG,
# and :latest. BASE_IMAGE and DEBIAN_MIRROR pass on.
IMAGE_ARGS = --build-arg AENV_VERSION=$(VERSION) \
	$(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE),) \
	$(if $(DEBIAN_MIRROR),--build-arg DEBIAN_MIRROR=$(DEBIAN_MIRROR),) \
	$(if $(wildcard /etc/ssl/certs/ca-certificates.crt),--secret id=ca,src=/etc/ssl/certs/ca-certificates.crt,)
image: venv
	@scripts/install-docker.sh
	DOCKER_BUILDKIT=1 /usr/bin/docker build -f deploy/docker/Dockerfile --target node $(IMAGE_ARGS) -t aenv:$(TAG) -t aenv:latest .
	DOCKER_BUILDKIT=1 /usr/bin/docker build -f deploy/docker/Dockerfile --target gateway $(IMAGE_ARGS) -t aenv-gateway:$(TAG) -t aenv-gateway:latest .

# The image's Python packages, pinned with hashes (deploy/docker/requirements.lock), from
# pyproject.toml (the server's extra) and what builds the project: run after changing a
# dependency (a unit test says when it is due).
lock: venv
	@$(BIN)/python -m uv --version >/dev/null 2>&1 || $(BIN)/pip install -q uv
	$(BIN)/python -m uv pip compile pyproject.toml deploy/docker/build-system.in --extra server \
		--universal --python-version 3.11 --generate-hashes --no-header -q \
		-o deploy/docker/requirements.lock

# The compose deployment for real: images built with Debian's Docker engine, the cluster
# of deploy/compose up, the stock SDK through a gateway, a node restarted (tests/deploy/).
compose-test: install
	@scripts/install-docker.sh
	AENV_COMPOSE_TEST=1 $(BIN)/python -m pytest -q -rs -s --timeout=3600 tests/deploy

# E2B's own SDK test suites (an E2B checkout: E2B=/path/to/E2B), run as E2B's CI runs them:
# a node on 127.0.0.1:443 with a test CA for api.e2b.localhost and *.e2b.localhost, the
# clients given only E2B_DOMAIN and E2B_API_KEY. SUITES: py-sync py-async py-shared js.
e2b-suites: install
	@test -n "$(E2B)" || { echo "usage: make e2b-suites E2B=/path/to/E2B [SUITES='py-sync js']"; exit 2; }
	scripts/e2b-suites.sh $(E2B) $(SUITES)

# The same suites against a node whose sandboxes are QEMU microVMs (AENV_RUNTIME=qemu), in a
# home and network range of their own: TCG-emulated where KVM cannot boot a standard guest,
# so too slow for `make test` (its QEMU tests are the runtime contract and the SDK's flows).
QEMU_HOME ?= /var/lib/aenv-qemu
e2b-suites-qemu: install
	@test -n "$(E2B)" || { echo "usage: make e2b-suites-qemu E2B=/path/to/E2B [SUITES='py-sync js']"; exit 2; }
	AENV_HOME=$(QEMU_HOME) $(BIN)/aenv template build-base --quiet
	AENV_HOME=$(QEMU_HOME) AENV_RUNTIME=qemu AENV_NET_PREFIX=aenvq AENV_NET_CIDR=10.201.0.0/16 \
		scripts/e2b-suites.sh $(E2B) $(SUITES)

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info

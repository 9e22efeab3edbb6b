# gpu-train: the two first commands are `make train` and `make test`; both set everything up.
#   make train              set up, then train the tiny preset locally on 2 CPU workers (torchrun, elastic)
#   make test               set up, then ruff and pytest (all tests, the policy check over every stack's plan among them)
#   make test-fast          set up, then ruff and the unit tests (no stack plans, no real training or servers)
#   make e2e                set up, then the cluster lane alone: tests/cluster against the local control plane
#   make cluster-up         build (once) and start the local control plane on 127.0.0.1; cluster-down stops it
#   make plan STACK=aws-dev offline plan of one stack under Pulumi mocks -> build/plan/
#   make bench              benchmarks, side by side, -> build/bench/results.json
#   make docs               regenerate docs/configuration.md's settings tables from the settings models
#   make schemas            maintainers (network + helm): regenerate tests/schemas from the pinned charts and CRDs
#                           (the stacks' plans and the serving variants' of tools/variants.py)
SHELL := /bin/bash
# Python's bytecode caches (__pycache__/, which git ignores) for the project's own modules, and pytest's for its
# rewritten test modules: an environment that turns them off (PYTHONDONTWRITEBYTECODE) makes every test process
# and every trainer subprocess compile the tree again (about 7 s per test process to collect).
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CHECKOV_VENV := .venv-checkov
STACKS := $(patsubst stacks/Pulumi.%.yaml,%,$(wildcard stacks/Pulumi.*.yaml))
# Re-install only when the pinned dependencies change: the stamp's name is a hash of pyproject.toml's content, so a
# file whose timestamp changed (a checkout) but whose content did not reuses the venv.
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
# Where torch 2.13.0 comes from. Empty: pip's own index, which on Linux serves the CUDA build (several GB) to every
# machine; a CPU-only machine can ask for the CPU build: make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed-3.3.30
# A pip install over a connection that drops: pip resumes a broken download itself (--resume-retries, pip >= 25.1, so
# only after pip's own upgrade), and when a download still fails the whole install runs again, up to 3 times, after
# saying why; the wheels already downloaded come from pip's cache. $(call pip_retry,COMMAND)
pip_retry = for try in 1 2 3; do $(1) && break; [ $$try = 3 ] && exit 1; \
  echo "setup: '$(strip $(1))' failed (attempt $$try of 3; most often a dropped download): running it again in 30 s" >&2; \
  sleep 30; done
PIP := $(BIN)/python -m pip install -q --resume-retries 10

.PHONY: setup tools cluster-build cluster-up cluster-down e2e train test test-fast lint plan plans policy bench schemas docs clean

setup: $(STAMP)

$(STAMP):
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(call pip_retry,$(BIN)/python -m pip install -q --upgrade pip setuptools wheel)
	# torch first and exactly pinned, so that nothing else can pull another build.
	@$(call pip_retry,$(PIP) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "torch==2.13.0")
	@$(call pip_retry,$(PIP) -e ".[dev]")
	@rm -f $(VENV)/.installed-* && touch $@

# checkov pins versions that conflict with ours, so it lives in its own virtualenv.
$(CHECKOV_STAMP):
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	@$(call pip_retry,$(CHECKOV_VENV)/bin/python -m pip install -q "checkov==3.3.30")
	@touch $@

# promtool (Debian package `prometheus`) checks and unit-tests the alert rules; apt tries a dropped download again.
APT_GET := apt-get -o Acquire::Retries=5
tools: $(CHECKOV_STAMP)
	@command -v promtool >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then $(APT_GET) update -qq && DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq prometheus >/dev/null; \
	  elif command -v sudo >/dev/null; then sudo $(APT_GET) update -qq && sudo DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y -qq prometheus >/dev/null; \
	  else echo "promtool is missing: install the Debian/Ubuntu package 'prometheus'" >&2; exit 1; fi; }
	@promtool --version 2>&1 | head -1

# The tiny preset (examples/tiny.yaml), byte-level, on the Python standard library's own source files (every machine
# with Python has them; tests, site-packages and idlelib left out, 2% of the files held out for validation), on 2
# local CPU workers through the one launcher (`gpu-train run --local`: the same trainer settings and torchrun
# arguments a cluster job gets): the validation loss every 100 steps and a sample at the end; then the run's
# checkpoint is sampled and exported, as a user would. A fresh run each time: an existing run directory would resume
# its finished checkpoint and train nothing. `prepare` finds an unchanged dataset up to date and returns at once.
train: setup
	rm -rf runs/make-train
	$(BIN)/python -m trainer.data prepare "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
	    --include '*.py' --exclude 'site-packages/' --exclude 'test/' --exclude 'tests/' --exclude 'idlelib/' \
	    --val-fraction 0.02 --shard-tokens 4194304 --out file://$(CURDIR)/runs/data/stdlib
	$(BIN)/gpu-train run --local examples/tiny.yaml --nproc 2 --data file://$(CURDIR)/runs/data/stdlib --runs runs
	$(BIN)/python -m trainer.sample --run-dir runs/make-train --prompt 'def ' --max-tokens 200
	$(BIN)/python -m trainer.export --run-dir runs/make-train --out runs/make-train/export

lint: setup
	$(BIN)/ruff check .

plans: setup
	@rm -rf build/plan
	@for s in $(STACKS); do $(BIN)/python -m infra.plan --stack $$s --out build/plan --quiet || exit 1; done

plan: setup
	@test -n "$(STACK)" || { echo "usage: make plan STACK=<$(STACKS)>" >&2; exit 2; }
	$(BIN)/python -m infra.plan --stack $(STACK) --out build/plan

policy: plans
	$(BIN)/python -m policies.check build/plan/*.json

# The local control plane (docs/testing.md): etcd, kube-apiserver, -controller-manager, -scheduler, Kueue, JobSet and
# kwok, built from the Go modules tools/cluster/go pins into build/cluster/bin (rebuilt only when a pin changes).
cluster-build:
	@bash tools/cluster/build.sh

cluster-up: setup cluster-build
	$(BIN)/python -m tools.cluster up

cluster-down: setup
	$(BIN)/python -m tools.cluster down

# The cluster lane alone: one control plane for the whole run, its tests one after another.
e2e: setup cluster-build
	$(BIN)/pytest -q -p no:xdist tests/cluster

# All tests, on TEST_WORKERS processes (pytest-xdist), each test file on one worker (its module fixtures built once);
# the stacks are planned once for all workers (tests/conftest.py), and tests/policies/test_plans.py runs the policy
# check (`python -m policies.check`, what `make policy` runs) over every stack's plan and every fabric variant's.
# The two virtualenvs install side by side: each pip run keeps one core busy.
TEST_WORKERS ?= 2
# The cluster lane (tests/cluster) runs beside them in a pytest of its own, with one control plane; its report follows.
# Each lane's report ends with its slowest tests (--durations), where the time of a run goes.
test:
	@$(MAKE) --no-print-directory -j3 setup tools cluster-build
	@$(MAKE) --no-print-directory lint
	@mkdir -p build; $(BIN)/pytest -q -p no:xdist --durations=15 tests/cluster > build/e2e.log 2>&1 & lane=$$!; \
	  $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 --ignore=tests/cluster; main=$$?; \
	  wait $$lane; e2e=$$?; echo "--- the cluster lane (tests/cluster):"; cat build/e2e.log; \
	  [ $$main = 0 ] && [ $$e2e = 0 ]

# The unit lane: everything not marked `integration` (tests/conftest.py marks the tests that plan the stacks, train
# for real or start servers), on every core: 2,079 tests in 100 to 120 s on an idle 2-core machine.
test-fast: setup lint
	$(BIN)/pytest -q -m "not integration" -n auto

bench: setup
	$(BIN)/python -m bench

# Chart and CRD snapshots the offline checks use (docs/validation.md): helm pull at every pinned version,
# what each chart renders for every stack's plan, the repositories' indexes, the CRD files at their tags.
schemas: plans
	@for f in $$($(BIN)/python -m tools.variants --out build/variants); do \
	  $(BIN)/python -m infra.plan --stack-file $$f --out build/plan --quiet || exit 1; done
	$(BIN)/python -m tools.validation.refresh

# docs/configuration.md's settings tables, regenerated from the settings models (a test keeps them in step).
docs: setup
	$(BIN)/python -m tools.settings_reference --write docs/configuration.md

clean:
	rm -rf build runs .pytest_cache .ruff_cache

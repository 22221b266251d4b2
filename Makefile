# The two commands a newcomer runs are `make demo` and `make test`; everything else is a step of those.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY := .venv/bin/python
VENV_STAMP := .venv/.deps

.PHONY: help lock setup binaries images deps test test-quick test-unit lint crds cluster-up cluster-down demo clean soak kind-e2e

help:
	@echo "make demo    - run the CPU quickstart job end to end on the local cluster"
	@echo "make test    - install everything needed, then lint and run the whole test suite"
	@echo "make test-quick - lint and the unit tier only (the inner loop; make test stays the whole suite)"
	@echo "make crds    - regenerate crds/ from the pydantic models"
	@echo "make lock    - re-resolve requirements/ (the locked dependency set) after editing pyproject.toml"
	@echo "make soak    - the chaos soak for several seeds: make soak SEEDS=\"1 2 3\" or SEED=1 (default: 5 random ones)"
	@echo "make cluster-up / cluster-down - a local control plane with KWOK GPU nodes, for kubectl"
	@echo "                 (REAL_NODES=2 adds nodes run by the real kubelet and containerd; needs root;"
	@echo "                 REAL_TRAINER=1 also puts the trainer image in them, so jobs train there)"
	@echo "make kind-e2e - hack/kind-e2e.sh (users' CI: kind, the chart, the CPU quickstart to Succeeded) on a"
	@echo "                 kind node image made here (hack/kindnode.py; needs root and Docker); KIND_DELETE=0 keeps it"

$(VENV_STAMP): pyproject.toml requirements/lock.txt hack/setup-env.sh hack/lock.py
	@bash hack/setup-env.sh

setup: $(VENV_STAMP)

binaries:
	@bash hack/build-binaries.sh >/dev/null

# dockerd (started, installed if missing), a Debian base made with debootstrap, and both images built
# from the repo's Dockerfiles; Docker's layer cache keys the multi-GB dependency layer on the lock.
images: setup
	@$(PY) hack/images.py

lint: setup binaries
	@echo "[lint] ruff (rules, and the formatter the '# fmt: skip' markers are for)"
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check --quiet .
	@echo "[lint] import-linter (the layers of docs/architecture.md: api -> render -> decide -> run -> cli)"
	@.venv/bin/lint-imports --no-cache
	@echo "[lint] shellcheck, hadolint, actionlint, helm lint"
	@.venv/bin/shellcheck -x --source-path=SCRIPTDIR hack/*.sh bench/*.sh .ci/run
	@.venv/bin/hadolint operator/Dockerfile trainer/Dockerfile
	@BIN="$$(bash hack/build-binaries.sh 2>/dev/null | tail -n1)"; \
	  "$$BIN/actionlint" -shellcheck .venv/bin/shellcheck .github/workflows/*.yaml && \
	  "$$BIN/helm" lint --quiet charts/sharded-training-operator

lock:
	@python3 hack/lock.py compile

crds: setup
	@$(PY) -m sharded_operator.api.crdgen > crds/training.sharded.dev_shardedtrainingjobs.yaml
	@cp crds/training.sharded.dev_shardedtrainingjobs.yaml charts/sharded-training-operator/files/crds/
	@$(PY) -c 'import sys; from sharded_operator.api import overrides; sys.stdout.write(overrides.render())' \
	  > charts/sharded-training-operator/files/pod-overrides.yaml
	@echo "wrote crds/training.sharded.dev_shardedtrainingjobs.yaml, charts/sharded-training-operator/files/pod-overrides.yaml"

# On a new machine the control plane compiles (CPU-bound) while the Python set-up and the images download
# and install (network and disk): side by side they take the longer of the two, not the sum.
deps:
	@$(MAKE) --no-print-directory -j2 binaries images

# The whole suite, in three lanes side by side (hack/suite.py says why); at the end it prints (and writes to
# build/suite-times.txt) where the time went, per tier, per module and per expensive fixture, and it refuses
# to run fewer tests per tier than tests/floor.json.
test: deps lint
	@echo "[test] unit, trainer (real torchrun), integration (real control plane), realnode (the real kubelet), e2e (processes and containers), one soak seed, in three lanes"
	@SHARDED_BIN_DIR="$$(bash hack/build-binaries.sh 2>/dev/null | tail -n1)" $(PY) hack/suite.py

# The inner loop: lint and the unit tier (no cluster, no torchrun), under a minute warm.
test-quick: setup binaries lint
	@$(PY) -m pytest -q tests/unit

SEEDS ?= $(or $(SEED),$(shell for i in 1 2 3 4 5; do echo $$RANDOM$$RANDOM; done))
soak: setup binaries
	@for seed in $(SEEDS); do \
	  echo "[soak] seed $$seed"; \
	  SOAK_SEED=$$seed SHARDED_BIN_DIR="$$(bash hack/build-binaries.sh 2>/dev/null | tail -n1)" \
	    $(PY) -m pytest -q -s -m soak tests/soak || { echo "[soak] seed $$seed FAILED (replay: make soak SEEDS=$$seed)"; exit 1; }; \
	done

test-unit: setup
	@$(PY) -m pytest -q tests/unit

cluster-up: setup binaries
	@PYTHONPATH=hack $(PY) -m localstack up --dir .cluster --real-nodes $(or $(REAL_NODES),0) $(if $(REAL_TRAINER),--trainer-image) >/dev/null

cluster-down: setup
	@PYTHONPATH=hack $(PY) -m localstack down --dir .cluster

# kind as users' CI runs it (hack/kind-e2e.sh, .github/workflows/e2e-kind.yaml), on a node image made here
# without a registry (hack/kindnode.py). Not part of `make test`: a 6 GB trainer image loaded into a new
# cluster each time does not fit the suite's budget.
kind-e2e: setup
	@$(PY) hack/kindnode.py e2e

demo: setup binaries
	@PYTHONPATH=hack $(PY) hack/demo.py $(ARGS)

clean: cluster-down
	rm -rf .venv .pytest_cache .ruff_cache

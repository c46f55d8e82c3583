# Two commands on a fresh machine: `make test` and `make run`. Everything else is set up here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run lint typecheck unit crd clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[operator,trainer,dev]'
	touch $(STAMP)

## test: set up .venv and run every check (lint, strict types, the CRD is current, pytest)
test: $(STAMP) lint typecheck crd unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## crd: fail when crds/gputraining.yaml is not what the spec model generates
crd: $(STAMP)
	$(BIN)/gpuop crd --check crds/gputraining.yaml

unit: $(STAMP)
	$(BIN)/pytest

## run: set up and train examples/local-digits.yaml here (2 CPU workers, gloo) and print its status
run: $(STAMP)
	$(BIN)/gpuop run -f examples/local-digits.yaml

## crds: regenerate crds/gputraining.yaml from the spec model
crds: $(STAMP)
	$(BIN)/gpuop crd > crds/gputraining.yaml

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

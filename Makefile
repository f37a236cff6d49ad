# Thin targets; CI and the README call exactly these.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: help setup run test unit lint gen-proto check-proto bench clean

help:
	@echo "make run    - set up, start the bridge and run a demo episode"
	@echo "make test   - set up and run lint, type checks, proto freshness and the test suite"
	@echo "make bench  - run the benchmarks (figures appended to bench/RESULTS.md)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) examples/demo.py

test: setup check-proto lint
	$(PY) -m pytest -q

unit: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

gen-proto: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/primerl/v1/primerl.proto

check-proto: setup
	@tmp=$$(mktemp -d) && PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I . --python_out=$$tmp \
		--grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp proto/primerl/v1/primerl.proto >/dev/null \
	&& for f in $$tmp/proto/primerl/v1/*; do \
		cmp -s $$f proto/primerl/v1/$$(basename $$f) || { echo "stale generated stub: proto/primerl/v1/$$(basename $$f); run 'make gen-proto'"; exit 1; }; \
	done && rm -rf $$tmp && echo "generated stubs are fresh"

bench: setup
	$(PY) bench/bridge_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

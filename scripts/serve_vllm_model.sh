#!/usr/bin/env bash
# Container entrypoint of the `engine-vllm` image: convert the bundled SmolLM2 once (cached in
# $PRIMERL_MODEL_CACHE), then exec scripts/serve_vllm.sh on it.
#
# Usage: scripts/serve_vllm_model.sh [PORT] [extra vllm args...]   (PORT defaults to 8000)
# Env: PRIMERL_MODEL  a local HF model directory or .gguf file instead of the bundled SmolLM2.
set -euo pipefail
PORT="${1:-8000}"
shift || true
MODEL_DIR="$(python -c 'import os, sys; from engines.model_store import resolve_model_dir; print(resolve_model_dir(os.environ.get("PRIMERL_MODEL") or None))')"
exec "$(dirname "${BASH_SOURCE[0]}")/serve_vllm.sh" "$MODEL_DIR" "$PORT" "$@"

#!/usr/bin/env bash
# Provision a virtualenv holding one of the peer routers bench/peer_routing.py compares the bridge against:
#   vllm-router==0.1.17  vLLM's router (round_robin, consistent_hash, cache_aware, kv_aware from KV events)
#   smg==1.13.0          SGLang's model gateway (cache_aware, prefix_hash, ...)
#
# Usage: scripts/provision_router.sh vllm-router|smg [--force] [VENV_DIR]
#   VENV_DIR defaults to ${PRIMERL_ROUTER_VENVS:-$HOME/.cache/primerl}/<router>-venv.
#   --force   wipe VENV_DIR and rebuild from scratch.
# Env:
#   PRIMERL_ROUTER_PYTHON  interpreter used to create the venv (default: python3.11, then python3).
#
# Why venvs of their own: each is a Rust binary in a wheel with a few Python helpers (vllm-router brings
# fastapi/uvicorn at its own pins); users install them beside their engines, not into the bridge's venv.
# Both are pinned exactly (the releases the benchmark was run with).
#
# Idempotent: after a successful --help check, VENV_DIR/.primerl-router-stamp is written, keyed by this
# script's sha256; a later run with that stamp exits at once. Concurrent runs are serialised with flock.
# Output: progress on stderr; the venv path alone on stdout.
set -euo pipefail

ROUTER="${1:-}"
case "$ROUTER" in
  vllm-router) DIST=vllm-router DIST_VERSION=0.1.17 BIN=vllm-router ;;
  smg) DIST=smg DIST_VERSION=1.13.0 BIN=smg ;;
  *) printf 'usage: %s vllm-router|smg [--force] [VENV_DIR]\n' "$0" >&2; exit 2 ;;
esac
shift

TOOL="provision_router $ROUTER"
SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
PINS=/dev/null
DEFAULT_VENV="${PRIMERL_ROUTER_VENVS:-$HOME/.cache/primerl}/$ROUTER-venv"
PYTHON_VAR=PRIMERL_ROUTER_PYTHON
STAMP_NAME=.primerl-router-stamp
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$SCRIPT_PATH")/venv_lib.sh"

venv_args "$@"
venv_lock 600
venv_create

log "step 1/2: $DIST==$DIST_VERSION"
pip_ install -q "$DIST==$DIST_VERSION" || die "pip install $DIST==$DIST_VERSION failed"

log "step 2/2: $BIN --help"
"$VENV/bin/$BIN" --help >/dev/null 2>&1 || die "$VENV/bin/$BIN --help failed"
venv_stamp "$DIST=$DIST_VERSION"

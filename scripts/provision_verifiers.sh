#!/usr/bin/env bash
# Provision a virtualenv holding verifiers==0.4.0 (PrimeIntellect's RL environment library) with its
# `renderers` dependency, unmodified, for the HTTP front door tests (tests/integration/test_http_verifiers.py).
#
# Usage: scripts/provision_verifiers.sh [--force] [VENV_DIR]
#   VENV_DIR defaults to ${PRIMERL_VERIFIERS_VENV:-$HOME/.cache/primerl/verifiers-venv}.
#   --force   wipe VENV_DIR and rebuild from scratch.
# Env:
#   PRIMERL_VERIFIERS_PYTHON  interpreter used to create the venv (default: python3.11, then python3).
#
# Why a venv of its own: verifiers' pins do not conflict with constraints.txt today, but it drags ~40
# packages the bridge never uses (anthropic, mcp, prime-sandboxes, gepa, math-verify, ...) and must stay
# exactly the release prime-rl runs, so it lives beside the project like the vLLM venv and the tests run
# it as a subprocess (tests/integration/verifiers_driver.py). No torch: verifiers and renderers only
# need transformers' tokenizers; the script fails if torch appears (an unpinned torch would resolve to
# a multi-GB CUDA build).
#
# Idempotent: after a successful import check, VENV_DIR/.primerl-verifiers-stamp is written, keyed by the
# sha256 of this script and scripts/verifiers-constraints.txt (exact pins of the whole tree); a later run
# with that stamp exits in ~0.1 s. Editing either file invalidates the stamp and the next run re-installs
# into the existing venv in place. Concurrent runs are serialised with flock on VENV_DIR.lock.
# Output: progress on stderr; the venv path alone on stdout. Also written into VENV_DIR: .primerl-freeze.txt.
set -euo pipefail

VERIFIERS_VERSION="0.4.0"

log() { printf '[provision_verifiers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[provision_verifiers] ERROR: %s\n' "$*" >&2; exit 1; }

FORCE=0
VENV=""
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) die "unknown option: $arg" ;;
    *) [[ -z "$VENV" ]] || die "only one VENV_DIR may be given"; VENV="$arg" ;;
  esac
done
VENV="${VENV:-${PRIMERL_VERIFIERS_VENV:-$HOME/.cache/primerl/verifiers-venv}}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"

SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
PINS="$(dirname "$SCRIPT_PATH")/verifiers-constraints.txt"
[[ -f "$PINS" ]] || die "missing $PINS"
SCRIPT_HASH="$(cat "$SCRIPT_PATH" "$PINS" | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.primerl-verifiers-stamp"
PY="$VENV/bin/python"

stamp_ok() {
  [[ -f "$STAMP" && -x "$PY" ]] || return 1
  [[ "$(head -n1 "$STAMP")" == "hash=$SCRIPT_HASH" ]] || return 1
  # Cheap liveness check (no heavy import): the interpreter runs and the dist is the pinned one.
  "$PY" - "$VERIFIERS_VERSION" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as md
sys.exit(0 if md.version("verifiers") == sys.argv[1] else 1)
EOF
}

if [[ "$FORCE" == 0 ]] && stamp_ok; then
  log "up to date: $VENV (stamp $(sed -n 2p "$STAMP"))"
  echo "$VENV"
  exit 0
fi

# Serialise concurrent provisioners (e.g. parallel test workers).
exec 9>"$VENV.lock"
if ! flock -n 9; then
  log "another provisioner holds $VENV.lock; waiting (up to 10 min)"
  flock -w 600 9 || die "timed out waiting for $VENV.lock"
fi
if [[ "$FORCE" == 0 ]] && stamp_ok; then
  log "up to date after waiting: $VENV"
  echo "$VENV"
  exit 0
fi

T0=$(date +%s)

pick_python() {
  if [[ -n "${PRIMERL_VERIFIERS_PYTHON:-}" ]]; then echo "$PRIMERL_VERIFIERS_PYTHON"; return; fi
  local c
  for c in python3.11 python3; do
    # verifiers 0.4.0: Requires-Python >=3.11,<3.15
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(0 if (3,11) <= sys.version_info[:2] < (3,15) else 1)' >/dev/null 2>&1; then
      echo "$c"; return
    fi
  done
  die "no Python 3.11-3.14 interpreter found (set PRIMERL_VERIFIERS_PYTHON)"
}

if [[ "$FORCE" == 1 && -e "$VENV" ]]; then
  log "--force: removing $VENV"
  rm -rf "$VENV"
fi
rm -f "$STAMP"

if [[ ! -x "$PY" ]]; then
  BASE_PY="$(pick_python)"
  log "creating venv $VENV with $BASE_PY ($("$BASE_PY" --version 2>&1))"
  "$BASE_PY" -m venv "$VENV" || die "venv creation failed"
else
  log "reusing existing (unstamped) venv $VENV"
fi

# pip wrapper: keeps pip's exit status, drops the harmless "Location 'file:///opt/...' is ignored" warnings
# this machine's extra-index-url produces.
pip_() {
  "$PY" -m pip --disable-pip-version-check --no-input "$@" \
    2> >(grep -vE "is ignored: it is neither a file nor a directory" >&2)
}

log "step 1/2: verifiers==$VERIFIERS_VERSION with its dependencies at the pinned versions"
pip_ install -q -c "$PINS" "verifiers==$VERIFIERS_VERSION" || die "pip install verifiers==$VERIFIERS_VERSION failed"
if "$PY" -c 'import importlib.metadata as m; m.version("torch")' >/dev/null 2>&1; then
  die "torch was installed into $VENV (verifiers does not need it; check $PINS)"
fi
CONFLICTS="$("$PY" -m pip check 2>/dev/null | grep -v 'No broken requirements' || true)"
[[ -z "$CONFLICTS" ]] || log "WARNING: pip check reports:
$CONFLICTS"

log "step 2/2: import check"
CHECK_OUT="$("$PY" - <<'EOF' 2>&1
import importlib.metadata as md
from verifiers.v1.clients.train import TrainClient  # noqa: F401  (the client the tests drive)
from renderers.client import generate  # noqa: F401
import transformers
print(f"verifiers={md.version('verifiers')} renderers={md.version('renderers')} "
      f"openai={md.version('openai')} transformers={transformers.__version__}")
EOF
)" || die "verifiers import check failed:
$CHECK_OUT"
VERSIONS="$(tail -n1 <<<"$CHECK_OUT")"
log "$VERSIONS"

"$PY" -m pip freeze --disable-pip-version-check > "$VENV/.primerl-freeze.txt" 2>/dev/null || true

T1=$(date +%s)
SIZE="$(du -sh "$VENV" | cut -f1)"
{
  echo "hash=$SCRIPT_HASH"
  echo "$VERSIONS install_s=$((T1 - T0)) size=$SIZE date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$STAMP"
log "done in $((T1 - T0)) s; venv size $SIZE"
echo "$VENV"

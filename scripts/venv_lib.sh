# shellcheck shell=bash
# Shared by scripts/provision_vllm.sh and scripts/provision_verifiers.sh (sourced, never run): the parts of
# provisioning a cached, stamped virtualenv beside the project that do not depend on what goes into it.
#
# The caller sets, before sourcing:
#   TOOL          log prefix (e.g. provision_vllm)
#   DEFAULT_VENV  the venv used when no VENV_DIR argument is given
#   PYTHON_VAR    name of the env var that may name the interpreter (e.g. PRIMERL_VLLM_PYTHON)
#   DIST, DIST_VERSION  the distribution whose installed version proves the venv is the pinned one
#   STAMP_NAME    stamp file name inside the venv
#   SCRIPT_PATH, PINS   the caller's absolute path and its pins file: with this file, the stamp's key
#   PIP_NOISE     optional extra `grep -E` pattern of harmless pip stderr lines to drop
# then calls `venv_args "$@"`, `venv_lock WAIT_S`, `venv_create`, installs with `pip_`, and ends with
# `venv_stamp "VERSIONS LINE"` (which prints the venv path on stdout, the scripts' only stdout).

log() { printf '[%s %s] %s\n' "$TOOL" "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$TOOL" "$*" >&2; exit 1; }

# [--force | --check] [VENV_DIR] -> FORCE, VENV (absolute), SCRIPT_HASH, STAMP, PY.
# --check: exit 0 when the venv is current, 1 when a run would install something; no lock, no output.
venv_args() {
  FORCE=0
  VENV=""
  local arg check=0
  for arg in "$@"; do
    case "$arg" in
      --force) FORCE=1 ;;
      --check) check=1 ;;
      -h|--help) sed -n '2,22p' "$SCRIPT_PATH"; exit 0 ;;
      -*) die "unknown option: $arg" ;;
      *) [[ -z "$VENV" ]] || die "only one VENV_DIR may be given"; VENV="$arg" ;;
    esac
  done
  VENV="${VENV:-$DEFAULT_VENV}"
  mkdir -p "$(dirname "$VENV")"
  VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
  SCRIPT_HASH="$(cat "$SCRIPT_PATH" "$PINS" "${BASH_SOURCE[0]}" 2>/dev/null | sha256sum | cut -d' ' -f1)"
  STAMP="$VENV/$STAMP_NAME"
  PY="$VENV/bin/python"
  if [[ "$check" == 1 ]]; then
    if stamp_ok; then exit 0; else exit 1; fi
  fi
}

# The stamp matches this script's key, and the pinned distribution is what the venv holds (no heavy import).
stamp_ok() {
  [[ -f "$STAMP" && -x "$PY" ]] || return 1
  [[ "$(head -n1 "$STAMP")" == "hash=$SCRIPT_HASH" ]] || return 1
  "$PY" - "$DIST" "$DIST_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys, importlib.metadata as md
sys.exit(0 if md.version(sys.argv[1]) == sys.argv[2] else 1)
PYEOF
}

exit_if_fresh() {
  if [[ "$FORCE" == 0 ]] && stamp_ok; then
    log "up to date$1: $VENV (stamp $(sed -n 2p "$STAMP"))"
    echo "$VENV"
    exit 0
  fi
}

# Exit at once when up to date; else serialise concurrent provisioners (parallel test workers) on
# VENV.lock, waiting up to $1 seconds, and check again: the holder may have just finished.
venv_lock() {
  exit_if_fresh ""
  exec 9>"$VENV.lock"
  if ! flock -n 9; then
    log "another provisioner holds $VENV.lock; waiting (up to $(($1 / 60)) min)"
    flock -w "$1" 9 || die "timed out waiting for $VENV.lock"
  fi
  exit_if_fresh " after waiting"
  T0=$(date +%s)
}

# Create the venv (or reuse an unstamped one) with $PYTHON_VAR's interpreter, else python3.11, else python3.
venv_create() {
  if [[ "$FORCE" == 1 && -e "$VENV" ]]; then
    log "--force: removing $VENV"
    rm -rf "$VENV"
  fi
  rm -f "$STAMP"
  if [[ -x "$PY" ]]; then
    log "reusing existing (unstamped) venv $VENV"
    return
  fi
  local base="${!PYTHON_VAR:-}" c
  if [[ -z "$base" ]]; then
    for c in python3.11 python3; do
      if command -v "$c" >/dev/null 2>&1 \
        && "$c" -c 'import sys; sys.exit(0 if (3,11) <= sys.version_info[:2] < (3,15) else 1)' >/dev/null 2>&1; then
        base="$c"
        break
      fi
    done
  fi
  [[ -n "$base" ]] || die "no Python 3.11-3.14 interpreter found (set $PYTHON_VAR)"
  log "creating venv $VENV with $base ($("$base" --version 2>&1))"
  "$base" -m venv "$VENV" || die "venv creation failed"
}

# `pip_ install ARGS`: scripts/pip_install.sh (uv when there is one, else pip), keeping its exit status, without
# the harmless "Location 'file:///opt/...' is ignored" warnings this machine's extra-index-url produces (and the
# caller's PIP_NOISE).
pip_() {
  [[ "$1" == install ]] || die "pip_ only installs"
  shift
  "$(dirname "${BASH_SOURCE[0]}")/pip_install.sh" "$PY" "$@" \
    2> >(grep -vE "is ignored: it is neither a file nor a directory${PIP_NOISE:+|$PIP_NOISE}" >&2)
}

# Record exactly what was installed, write the stamp, print the venv path.
venv_stamp() {
  "$PY" -m pip freeze --disable-pip-version-check > "$VENV/.primerl-freeze.txt" 2>/dev/null || true
  local t1 size
  t1=$(date +%s)
  size="$(du -sh "$VENV" | cut -f1)"
  {
    echo "hash=$SCRIPT_HASH"
    echo "$1 install_s=$((t1 - T0)) size=$size date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  } > "$STAMP"
  log "done in $((t1 - T0)) s; venv size $size"
  echo "$VENV"
}

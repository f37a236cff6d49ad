#!/usr/bin/env bash
# `pip install ARGS` into PYTHON's environment, done by uv when there is one (make setup, the side virtualenvs).
#
# Usage: scripts/pip_install.sh PYTHON [pip install arguments: -q, -c FILE, -r FILE, -e PATH, --no-deps, specs]
#
# Why: on a fresh 2-core machine pip took 87 s for make setup's venv, and 269 s and 170 s for the vLLM and
# verifiers venvs (provisioned beside the test suite, so every second of it is taken from the tests); uv downloads
# and unpacks in parallel and did the same in 57 s, 48 s and 22 s (empty uv cache), with the same packages at the
# same versions (docs/testing.md).
# uv reads none of pip's configuration, so what pip would use is handed over: index-url, extra-index-url,
# find-links, constraint and no-index from `pip config list` (files and PIP_* variables; a machine whose CPU
# build of torch lies in a find-links directory gets it, as with pip). `--index-strategy unsafe-best-match` is
# pip's rule (the best version over every index); `--compile-bytecode` because pip compiles at install and the
# suite's processes may run with PYTHONDONTWRITEBYTECODE. When no uv is found, or uv fails (a certificate or
# index only pip is configured for), the same arguments go to pip.
# uv: $PRIMERL_UV, else the one beside PYTHON, else the project's .venv/bin/uv (constraints.txt pins it), else PATH.
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 PYTHON [pip install arguments]" >&2; exit 2; }
PY=$1
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

pip_() {  # pip, without the harmless "Location 'file:///...' is ignored" warnings of a partial local index
  "$PY" -m pip --disable-pip-version-check --no-input install "$@" \
    2> >(grep -vE "is ignored: it is neither a file nor a directory" >&2)
}

UV="${PRIMERL_UV:-}"
if [[ -z "$UV" ]]; then
  for c in "$(dirname "$PY")/uv" "$ROOT/.venv/bin/uv" "$(command -v uv || true)"; do
    if [[ -n "$c" && -x "$c" ]]; then UV=$c; break; fi
  done
fi
[[ -n "$UV" ]] || { pip_ "$@"; exit; }

# pip's configuration as uv arguments. `pip config list` prints key='value' per source (global., user., site.,
# :env:.); lists are whitespace-separated. index-url: the PIP_INDEX_URL variable wins over files, as in pip.
uv_args=(--python "$PY" --index-strategy unsafe-best-match --compile-bytecode)
index_url=""
while IFS= read -r line; do
  key=${line%%=*}
  val=${line#*=}
  val=${val#\'}
  val=${val%\'}
  case "${key#*.}" in
    index-url) [[ -n "$index_url" && "$key" != :env:* ]] || index_url=$val ;;
    extra-index-url) for v in $val; do uv_args+=(--extra-index-url "$v"); done ;;
    find-links) for v in $val; do uv_args+=(--find-links "$v"); done ;;
    constraint) for v in $val; do uv_args+=(--constraint "$v"); done ;;
    no-index) [[ "$val" =~ ^(1|true|yes|on)$ ]] && uv_args+=(--no-index) ;;
  esac
done < <("$PY" -m pip config list 2>/dev/null || true)
[[ -z "$index_url" ]] || uv_args+=(--index-url "$index_url")

if ! "$UV" pip install "${uv_args[@]}" "$@"; then
  echo "pip_install.sh: uv failed (above); installing the same with pip" >&2
  pip_ "$@"
fi

#!/usr/bin/env bash
# Start a real vLLM (CPU build) OpenAI-compatible server for an HF-format fp32 model directory.
#
# Usage: scripts/serve_vllm.sh MODEL_DIR PORT [extra vllm args...]
#   Runs in the foreground and exec's into vLLM, so this script's PID is the API server's PID.
#   SIGTERM to that PID shuts vLLM's child processes down too; for belt and braces start it
#   with `setsid scripts/serve_vllm.sh ... &` and stop it with `kill -TERM -- -$PID`.
#   Ready when GET /health and GET /v1/models answer 200.
#
# Env (all optional):
#   PRIMERL_VLLM_VENV      venv made by scripts/provision_vllm.sh
#                          (default $HOME/.cache/primerl/vllm-venv)
#   PRIMERL_VLLM_HOST      bind address (default 127.0.0.1)
#   PRIMERL_VLLM_SERVED_NAME   served model name (default smollm2)
#   PRIMERL_VLLM_MAX_MODEL_LEN (default 2048)
#   PRIMERL_VLLM_BLOCK_SIZE    KV block size = prefix-cache granularity (default 32; vLLM's CPU
#                          default is 128, which never caches a prompt shorter than 128 tokens;
#                          the CPU attention backend wants a multiple of 32)
#   PRIMERL_VLLM_EXECUTOR  uni (default): the model runs inside the EngineCore process
#                          (2 processes, ~35 s start-up on 2 cores, no core pinning).
#                          mp: vLLM's CPU default (3 processes, ~47 s; the worker is pinned to
#                          core 0 with core 1 reserved, so two mp servers on a 2-core box
#                          share core 0 unless VLLM_CPU_OMP_THREADS_BIND differs).
#   PRIMERL_VLLM_THREADS   OMP/torch threads of the model in uni mode (default 1; 2 is ~10%
#                          faster on an idle box and 2-3x slower when anything else runs).
#   PRIMERL_VLLM_COMPILE   0 (default): --enforce-eager. 1: torch.compile/inductor, ~15-20%
#                          faster decode, but ~2.5-3 min first start (~60 s once VLLM_CACHE_ROOT
#                          holds the compiled graphs).
#   PRIMERL_VLLM_KV_EVENTS 1 (default): publish KV events (blocks stored, evicted, cache reset) over ZMQ on
#                          loopback, so the bridge's prefix index follows what vLLM really holds; 0: off.
#   PRIMERL_VLLM_KV_EVENTS_PORT  the events' PUB port (default PORT+1); the replay socket is the next one.
#                          The script prints the engine URL to register: URL#kv-events=...&kv-events-replay=...
#   PRIMERL_VLLM_LORA_RANK 0 (default): no LoRA. N: serve LoRA adapters of rank <= N loaded at run time
#                          (UpdateWeights with adapter: /v1/load_lora_adapter), up to 4 versions at once.
#   PRIMERL_VLLM_LORA_TARGETS  the modules LoRA applies to (--lora-target-modules), space-separated; default the
#                          decoder's linear layers (q/k/v/o_proj, gate/up/down_proj), not lm_head.
#   PRIMERL_VLLM_STAGED_RELOAD 1 (default): load engines/http/vllm_worker/ as a worker extension, so a
#                          full-weight update loads into a twin of the model while vLLM serves and only the
#                          swap is paused (one more copy of the weights in memory); 0: vLLM's in-place reload.
#   VLLM_CPU_KVCACHE_SPACE KV cache size in GiB (default 2)
#   VLLM_SERVER_DEV_MODE   1 (default here): /collective_rpc, /reset_prefix_cache, /pause,
#                          /resume, /sleep, /weight_info, ... Set 0 to disable.
#   VLLM_CACHE_ROOT        vLLM's cache dir (compile artefacts); default
#                          $HOME/.cache/primerl/vllm-cache.
# Extra args are appended last, so they override the defaults below.
set -euo pipefail

die() { printf '[serve_vllm] ERROR: %s\n' "$*" >&2; exit 1; }

[[ $# -ge 2 ]] || die "usage: $0 MODEL_DIR PORT [extra vllm args...]"
MODEL_DIR="$1"
PORT="$2"
shift 2

[[ "$PORT" =~ ^[0-9]+$ ]] && (( PORT > 0 && PORT < 65536 )) || die "invalid PORT: $PORT"
[[ -f "$MODEL_DIR/config.json" ]] || die "$MODEL_DIR has no config.json (need an HF-format model directory)"
compgen -G "$MODEL_DIR/*.safetensors" >/dev/null || die "$MODEL_DIR has no *.safetensors weights"

VENV="${PRIMERL_VLLM_VENV:-$HOME/.cache/primerl/vllm-venv}"
PY="$VENV/bin/python"
[[ -x "$PY" && -f "$VENV/.primerl-vllm-stamp" ]] \
  || die "no provisioned vLLM venv at $VENV; run scripts/provision_vllm.sh $VENV first"

# --- environment -----------------------------------------------------------------------------
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
export VLLM_SERVER_DEV_MODE="${VLLM_SERVER_DEV_MODE:-1}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$HOME/.cache/primerl/vllm-cache}"
# No hub and no telemetry: everything is local.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

ARGS=(--enforce-eager)
if [[ "${PRIMERL_VLLM_COMPILE:-0}" == 1 ]]; then
  ARGS=()
  # 0.32.0's AOT-compiled artefact fails to load on the next start on CPU ("'function' object
  # has no attribute 'finalize_loading'") and is recompiled every time; the classic inductor
  # cache under VLLM_CACHE_ROOT does work across restarts.
  export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"
  # ...and that cache is torch inductor's own (default /tmp/torchinductor_$USER): keep it with
  # vLLM's so that it survives /tmp being cleaned.
  export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VLLM_CACHE_ROOT/torchinductor}"
fi

case "${PRIMERL_VLLM_EXECUTOR:-uni}" in
  uni)
    # AsyncLLM always runs the EngineCore in its own process; with the uni executor the model
    # runs inside it instead of in a third (spawned, thread-pinned) worker process.
    export VLLM_ENABLE_V1_MULTIPROCESSING=0
    export OMP_NUM_THREADS="${PRIMERL_VLLM_THREADS:-1}"
    ARGS+=(--distributed-executor-backend uni)
    ;;
  mp) ;;
  *) die "PRIMERL_VLLM_EXECUTOR must be uni or mp" ;;
esac

LORA_RANK="${PRIMERL_VLLM_LORA_RANK:-0}"
[[ "$LORA_RANK" =~ ^[0-9]+$ ]] || die "invalid PRIMERL_VLLM_LORA_RANK: $LORA_RANK"
if (( LORA_RANK > 0 )); then
  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
  # The decoder's linear layers, not lm_head (engines/launch.py, LORA_TARGET_MODULES: why, and the same list).
  read -r -a LORA_TARGETS <<< "${PRIMERL_VLLM_LORA_TARGETS:-q_proj k_proj v_proj o_proj gate_proj up_proj down_proj}"
  ARGS+=(--enable-lora --max-lora-rank "$LORA_RANK" --max-loras 4 --lora-target-modules "${LORA_TARGETS[@]}")
fi

HOST="${PRIMERL_VLLM_HOST:-127.0.0.1}"
# Fail fast on a busy port rather than after the model has loaded.
"$PY" -c '
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
s.bind((host, port))
s.close()
' "$HOST" "$PORT" 2>/dev/null || die "cannot bind $HOST:$PORT (port in use?)"

if [[ "${PRIMERL_VLLM_KV_EVENTS:-1}" == 1 ]]; then
  EV_PORT="${PRIMERL_VLLM_KV_EVENTS_PORT:-$((PORT + 1))}"
  [[ "$EV_PORT" =~ ^[0-9]+$ ]] && (( EV_PORT > 0 && EV_PORT < 65535 )) || die "invalid PRIMERL_VLLM_KV_EVENTS_PORT: $EV_PORT"
  # vLLM binds an endpoint that contains '::' or '*' and connects to any other: '::ffff:' is loopback, bound.
  EV_BIND="tcp://[::ffff:$HOST]:$EV_PORT"
  [[ "$HOST" == *:* ]] && EV_BIND="tcp://[$HOST]:$EV_PORT"
  ARGS+=(--kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"$EV_BIND\", \"replay_endpoint\": \"tcp://$HOST:$((EV_PORT + 1))\"}")
  printf '[serve_vllm] KV events on tcp://%s:%s (replay tcp://%s:%s); register this replica as\n' \
    "$HOST" "$EV_PORT" "$HOST" "$((EV_PORT + 1))" >&2
  printf '[serve_vllm]   http://%s:%s#kv-events=tcp://%s:%s&kv-events-replay=tcp://%s:%s\n' \
    "$HOST" "$PORT" "$HOST" "$EV_PORT" "$HOST" "$((EV_PORT + 1))" >&2
fi

if [[ "${PRIMERL_VLLM_STAGED_RELOAD:-1}" == 1 ]]; then
  # Imports nothing of PrimeRL: only this directory goes on the path.
  export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/engines/http/vllm_worker${PYTHONPATH:+:$PYTHONPATH}"
  ARGS+=(--worker-extension-cls primerl_vllm_worker.StagedWeights)
fi

exec "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" \
  --served-model-name "${PRIMERL_VLLM_SERVED_NAME:-smollm2}" \
  --dtype float32 \
  --max-model-len "${PRIMERL_VLLM_MAX_MODEL_LEN:-2048}" \
  --block-size "${PRIMERL_VLLM_BLOCK_SIZE:-32}" \
  --enable-prefix-caching \
  --logprobs-mode processed_logprobs \
  --enable-prompt-tokens-details \
  --generation-config vllm \
  --host "$HOST" \
  --port "$PORT" \
  "${ARGS[@]}" \
  "$@"

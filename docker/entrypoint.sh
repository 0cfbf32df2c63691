#!/bin/sh
# Starts `specserve serve` with flags taken from SPECSERVE_* environment variables (see README.md).
# Arguments given to the container (`docker run IMAGE --copy-gamma 4`) come last, so they win.
set -eu
[ -n "${SPECSERVE_DRAIN_TIMEOUT:-}" ] && set -- --drain-timeout "$SPECSERVE_DRAIN_TIMEOUT" "$@"
[ -n "${SPECSERVE_ENGINE_START_TIMEOUT:-}" ] && set -- --engine-start-timeout "$SPECSERVE_ENGINE_START_TIMEOUT" "$@"
[ -n "${SPECSERVE_ENGINE_MAX_RESTARTS:-}" ] && set -- --engine-max-restarts "$SPECSERVE_ENGINE_MAX_RESTARTS" "$@"
[ -n "${SPECSERVE_MAX_SESSIONS:-}" ] && set -- --max-sessions "$SPECSERVE_MAX_SESSIONS" "$@"
[ -n "${SPECSERVE_SESSION_TTL:-}" ] && set -- --session-ttl "$SPECSERVE_SESSION_TTL" "$@"
[ -n "${SPECSERVE_SESSION_MODE:-}" ] && set -- --session-mode "$SPECSERVE_SESSION_MODE" "$@"
[ -n "${SPECSERVE_SERVED_MODEL_NAME:-}" ] && set -- --served-model-name "$SPECSERVE_SERVED_MODEL_NAME" "$@"
[ -n "${SPECSERVE_MAX_WAITING:-}" ] && set -- --max-waiting "$SPECSERVE_MAX_WAITING" "$@"
[ -n "${SPECSERVE_MAX_NUM_BATCHED_TOKENS:-}" ] && set -- --max-num-batched-tokens "$SPECSERVE_MAX_NUM_BATCHED_TOKENS" "$@"
[ -n "${SPECSERVE_KV_CACHE_MEMORY:-}" ] && set -- --kv-cache-memory "$SPECSERVE_KV_CACHE_MEMORY" "$@"
[ -n "${SPECSERVE_ATTENTION_BACKEND:-}" ] && set -- --attention-backend "$SPECSERVE_ATTENTION_BACKEND" "$@"
[ -n "${SPECSERVE_MAX_NUM_SEQS:-}" ] && set -- --max-num-seqs "$SPECSERVE_MAX_NUM_SEQS" "$@"
[ -n "${SPECSERVE_MAX_MODEL_LEN:-}" ] && set -- --max-model-len "$SPECSERVE_MAX_MODEL_LEN" "$@"
[ -n "${SPECSERVE_NUM_THREADS:-}" ] && set -- --num-threads "$SPECSERVE_NUM_THREADS" "$@"
[ -n "${SPECSERVE_DTYPE:-}" ] && set -- --dtype "$SPECSERVE_DTYPE" "$@"
[ -n "${SPECSERVE_DEVICE:-}" ] && set -- --device "$SPECSERVE_DEVICE" "$@"
[ -n "${SPECSERVE_DRAFTER:-}" ] && set -- --drafter "$SPECSERVE_DRAFTER" "$@"
[ -n "${SPECSERVE_MODEL:-}" ] && set -- --model "$SPECSERVE_MODEL" "$@"
set -- serve --host "${SPECSERVE_HOST:-0.0.0.0}" --port "${SPECSERVE_PORT:-8000}" "$@"
# SPECSERVE_API_KEY is read by specserve itself, so the key never shows in the process list.
exec specserve "$@"

#!/usr/bin/env bash
# Serving benchmark: aggregate tokens/s and time to first token at several concurrency
# levels, continuous batching against the same server with --max-batch 1, resident and
# under a memory budget (experts streamed). Results: docs/serving.md.
#
# Usage: bash scripts/serving-bench.sh [BIN] [MODEL_DIR] [OUT.jsonl]
#   LEVELS="1 4 16 64" MAX_TOKENS=32 PROMPT_WORDS=48 BUDGET=92MiB to change the load.
# Needs python3 (standard library only). Each configuration starts its own server on a
# free loopback port and stops it afterwards.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$(realpath "${1:-$ROOT/target/release/strata}")
MODEL=$(realpath "${2:-$ROOT/models/strata-tiny}")
OUT=${3:-$ROOT/target/serving-bench.jsonl}
LEVELS=${LEVELS:-1 4 16 64}
MAX_TOKENS=${MAX_TOKENS:-32}
PROMPT_WORDS=${PROMPT_WORDS:-48}
BUDGET=${BUDGET:-92MiB}
SERVER=
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null' EXIT
: >"$OUT"

run() {
  local label=$1
  shift
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$BIN" serve --model "$MODEL" --port "$port" --usage off "$@" 2>"$OUT.$label.log" &
  SERVER=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT.$label.log"; exit 1; }
    sleep 0.1
  done
  # shellcheck disable=SC2086
  python3 "$ROOT/scripts/loadgen.py" --base "http://127.0.0.1:$port" --label "$label" --pid "$SERVER" \
    --concurrency $LEVELS --max-tokens "$MAX_TOKENS" --prompt-words "$PROMPT_WORDS" --json "$OUT"
  kill "$SERVER"
  wait "$SERVER" 2>/dev/null || true
  SERVER=
}

# ORDER=reverse runs the configurations the other way round (a second sample on a
# shared machine).
CONFIGS=(resident-batch64 resident-batch1 "budget-$BUDGET-batch64" "budget-$BUDGET-batch1")
[ "${ORDER:-}" = reverse ] && CONFIGS=("budget-$BUDGET-batch1" "budget-$BUDGET-batch64" resident-batch1 resident-batch64)
for c in "${CONFIGS[@]}"; do
  case $c in
    resident-batch64) run "$c" --max-batch 64 --kv-tokens 8192 ;;
    resident-batch1) run "$c" --max-batch 1 --queue 128 ;;
    *batch64) run "$c" --budget "$BUDGET" --max-batch 64 ;;
    *batch1) run "$c" --budget "$BUDGET" --max-batch 1 --queue 128 ;;
  esac
done
echo "results: $OUT"

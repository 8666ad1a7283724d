#!/usr/bin/env bash
# On the GPU machine: strata-tiny decode with and without MTP (fixed and adaptive draft
# lengths), on the CPU (pinned, 8 and 16 threads) and on the H200, in one call.
# Needs $C/strata.xz: a stripped `cargo build --release -p strata-cli --features cuda`.
# Writes $OUT/mtp-bench.jsonl.
set -uo pipefail
C=${C:-.devcarry}
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/lib64:${LD_LIBRARY_PATH:-}
xz -d -k -f "$C/strata.xz" && chmod +x "$C/strata"
S=$C/strata
res="$OUT/mtp-bench.jsonl"
: >"$res"
one() { # label, then bench decode arguments
  local label=$1; shift
  ${PIN:-} $C/strata-bench decode --model models/strata-tiny --prompt-tokens 64 --decode-tokens 256 --json "$@" 2>>"$OUT/strata.err" |
    python3 -c "
import json,sys; r=json.load(sys.stdin); m=r.get('mtp') or {}
print(json.dumps({'run':'$label','decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s'],
  'acceptance':m.get('acceptance_rate'),'tokens_per_target_forward':m.get('tokens_per_target_forward'),
  'plain_rounds':m.get('plain_rounds'),'rounds':m.get('rounds'),'device':r['device']}))" >>"$res"
}
for rep in 1 2 3; do
  for t in 8 16; do
    PIN="taskset -c $(seq -s, 0 $((t - 1)))"
    one "cpu-t$t-off" --threads $t
    one "cpu-t$t-fixed" --threads $t --draft-tokens 3 --draft-policy fixed
    one "cpu-t$t-adaptive" --threads $t --draft-tokens 3 --draft-policy adaptive
  done
  PIN=
  one cuda-off --device cuda --warmup
  one cuda-fixed --device cuda --warmup --draft-tokens 3 --draft-policy fixed
  one cuda-adaptive --device cuda --warmup --draft-tokens 3 --draft-policy adaptive
done
cat "$res"

#!/usr/bin/env bash
# On the GPU machine's CPU: strata-tiny decode and prefill, strata vs llama.cpp on the
# same bf16 weights and the same cores (pinned with taskset), at several thread counts.
#
# Needs, in .devcarry/ (built here: the device has no Rust toolchain and no network):
#   strata.xz              stripped release binary, xz-compressed
#   llama-src.tar.xz       llamacpp-peer.sh source .devcarry
#   llamacpp-peer.sh       copy of ../shared/tools/llamacpp-peer.sh
#   pool_bench.xz, matvec_bench.xz   (optional) kernel examples
# Writes $OUT/cpu-bench.jsonl (one JSON object per measurement) and logs.
# The tracked tree is over the device tool's 64 MiB: run `scripts/device/slim.sh on` before
# the call and `slim.sh off` after it.
set -uo pipefail
C=${C:-.devcarry}
OUT=${OUT:-/tmp/strata-out}
mkdir -p "$OUT"
THREADS=${THREADS:-"1 2 4 8 16"}
lscpu >"$OUT/lscpu.txt" 2>&1
for f in strata pool_bench matvec_bench; do
  [ -f "$C/$f.xz" ] && xz -d -k -f "$C/$f.xz" && chmod +x "$C/$f"
done
S=$C/strata
res="$OUT/cpu-bench.jsonl"
: >"$res"
cpus() { seq -s, 0 $(($1 - 1)); }

# llama.cpp: build and convert (in the background of nothing else: this machine is ours).
if [ -z "${SKIP_LLAMA:-}" ]; then
  t0=$(date +%s)
  TARGETS="llama-bench llama-completion llama-batched-bench" bash $C/llamacpp-peer.sh build $C/llama-src.tar.xz /tmp/llama >"$OUT/llama-build.log" 2>&1 \
    || { echo "llama.cpp build failed"; tail -20 "$OUT/llama-build.log"; }
  bash $C/llamacpp-peer.sh convert $C/llama-src.tar.xz models/strata-tiny /tmp/tiny-bf16.gguf bf16 >"$OUT/llama-convert.log" 2>&1 \
    || { echo "convert failed"; tail -20 "$OUT/llama-convert.log"; }
  echo "llama.cpp build+convert: $(($(date +%s) - t0)) s"
fi

for t in $THREADS; do
  for rep in 1 2 3; do
    taskset -c "$(cpus $t)" $C/strata-bench decode --model models/strata-tiny --prompt-tokens 64 --decode-tokens 128 \
      --threads "$t" --json 2>>"$OUT/strata.err" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','threads':$t,'rep':$rep,'decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s'],'allocs_per_token':r['allocations_per_decode_token']}))" >>"$res"
  done
  if [ -f /tmp/tiny-bf16.gguf ]; then
    taskset -c "$(cpus $t)" /tmp/llama/bin/llama-bench -m /tmp/tiny-bf16.gguf -t "$t" -p 64 -n 128 -r 3 -o json 2>>"$OUT/llama.err" \
      | python3 -c "
import json,sys
for r in json.load(sys.stdin):
    kind = 'prefill_tps' if r['n_prompt'] else 'decode_tps'
    print(json.dumps({'engine':'llama.cpp','threads':$t,kind:r['avg_ts'],'stddev':r['stddev_ts']}))" >>"$res"
  fi
done
# MTP: the same decode with the draft layer, fixed and adaptive draft lengths.
for t in ${MTP_THREADS:-"1 4 16"}; do
  for pol in fixed adaptive; do
    for rep in 1 2 3; do
      taskset -c "$(cpus $t)" $C/strata-bench decode --model models/strata-tiny --prompt-tokens 64 --decode-tokens 128 \
        --threads "$t" --draft-tokens 3 --draft-policy $pol --json 2>>"$OUT/strata.err" | python3 -c "
import json,sys; r=json.load(sys.stdin); m=r['mtp']
print(json.dumps({'engine':'strata','mtp':'$pol','threads':$t,'rep':$rep,'decode_tps':r['decode_tokens_per_s'],'acceptance':m['acceptance_rate'],'tokens_per_target_forward':m['tokens_per_target_forward'],'plain_rounds':m['plain_rounds'],'rounds':m['rounds']}))" >>"$res"
    done
  done
done
# One profile of a decode token at 1 and at all threads.
for t in 1 ${THREADS##* }; do
  taskset -c "$(cpus $t)" $C/strata-bench decode --model models/strata-tiny --prompt-tokens 64 --decode-tokens 256 --threads "$t" --profile \
    >"$OUT/profile-t$t.txt" 2>&1
done
[ -x $C/pool_bench ] && for t in 2 16; do taskset -c "$(cpus $t)" $C/pool_bench $t; done >"$OUT/pool.txt" 2>&1
[ -x $C/matvec_bench ] && taskset -c 0 $C/matvec_bench >"$OUT/matvec.txt" 2>&1
cat "$res"

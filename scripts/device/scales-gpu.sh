#!/usr/bin/env bash
# On the GPU machine: int4 experts by scale type and group. The CUDA tests (TESTS=0 skips
# them; strata-tiny left out unless TINY=1), the expert-bandwidth test (BANDWIDTH=0 skips
# it), then decode of the GLM-5-shaped slice (vocabulary 16384) with its experts as int4-g64
# (f32 scales, as the public container) and converted as each of VARIANTS (gN-TYPE: group N,
# TYPE scales; bf16: the slice's own bf16 experts; default "g64-bf16 g64-e4m3 g128-bf16"),
# alternated REPS times (2); VOCAB=154880 uses GLM-5's vocabulary. Writes
# $OUT/tests.log, $OUT/bandwidth.log, $OUT/scales.jsonl, $OUT/side.log. PROMPT / DECODE:
# tokens of the prompt and the decode.
set -uo pipefail
STALL_S=60
TINY=${TINY:-0}
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/scales.jsonl"
touch "$res"
tests_then_slice
VARIANTS=${VARIANTS:-"g64-bf16 g64-e4m3 g128-bf16"}
for name in $VARIANTS; do
  [ "$name" = bf16 ] && continue
  g=${name%%-*}
  t=${name#*-}
  [ "$t" = "$name" ] && t=f32
  [ -d "$slice-$name" ] || timeout 200 $S convert --model "$slice" --out "$slice-$name" --experts int4 \
    --group "${g#g}" --scales "$t" >>"$OUT/side.log" 2>&1 || echo "convert $name failed (see side.log)"
done
if [ "${BANDWIDTH:-1}" = 1 ]; then
  since "bandwidth"
  timeout 150 $C/cuda-tests --ignored --nocapture cuda_kernel_bandwidth 2>&1 | grep -E "GB/s" >"$OUT/bandwidth.log"
  cat "$OUT/bandwidth.log"
fi
for rep in $(seq 1 ${REPS:-2}); do
  for d in "$slice-int4 int4-g64" $(for n in $VARIANTS; do
    if [ "$n" = bf16 ]; then echo "$slice:bf16"; else echo "$slice-$n:int4-$n"; fi
  done); do
    set -- ${d/:/ }
    since "decode $2 ($rep)"
    timeout 120 $C/strata-bench decode --model "$1" --device cuda --prompt-tokens ${PROMPT:-64} \
      --decode-tokens ${DECODE:-128} --warmup --usage off --mtp off --json 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'experts':'$2','vocab':${VOCAB:-16384},'rep':$rep,'decode_tps':round(r['decode_tokens_per_s'],1),
  'bytes_per_token':r['decode_bytes_read_per_token'],
  'of_floor':round(r['decode_bytes_read_per_token']/4.3e12*r['decode_tokens_per_s'],3)}))" >>"$res"
  done
done
since "done"
python3 - "$res" <<'PY'
import json, sys, collections
g = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); g[(r.get('vocab', 16384), r['experts'])].append((r['decode_tps'], r['of_floor'], r['bytes_per_token']))
for k, v in sorted(g.items()): print(k, v)
PY

#!/usr/bin/env bash
# On the GPU machine, in one call (issue 43, DeepSeek-V3 / Kimi K2): the CUDA test suite
# (its deepseek_v3 fixtures among the rest), then a DeepSeek-V3-wide slice
# (`strata-bench synth --preset deepseek-v3`: hidden 7168, 128 MLA heads, experts 7168 x
# 2048, YaRN; 2 layers, the first dense, EXPERTS routed experts, default 48) decoded
# resident on CUDA with bf16 and int4-g64 experts. Writes $OUT/tests.log and
# $OUT/deepseek.jsonl (one JSON line a measurement: decode and prefill tok/s, bytes read a
# token, and the share of the HBM floor at 4.3 TB/s on the H200, 3.35 on the H100).
set -uo pipefail
. "$(dirname "$0")/env.sh"
res="$OUT/deepseek.jsonl"
: >"$res"
slice=/tmp/slice-ds
(
  timeout 200 $C/strata-bench synth --out "$slice" --preset deepseek-v3 --layers 2 --dense-layers 1 \
    --experts "${EXPERTS:-48}" --vocab 16384 >>"$OUT/side.log" 2>&1
  timeout 200 $C/strata convert --model "$slice" --out "$slice-int4" --experts int4 --scales f32 >>"$OUT/side.log" 2>&1
  touch /tmp/ds.done
) &
[ -z "${SKIP_TESTS:-}" ] && cuda_tests "^test .*FAILED|test result|panicked|STALL|deepseek"
for _ in $(seq 1 300); do [ -f /tmp/ds.done ] && break; sleep 1; done
since "slice ready"
hbm=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && echo 3.35e12 || echo 4.3e12)
for w in bf16 int4-g64; do
  d=$slice; [ $w = int4-g64 ] && d=$slice-int4
  for rep in 1 2; do
    timeout 120 $C/strata-bench decode --model "$d" --device cuda --prompt-tokens 64 --decode-tokens 64 --warmup \
      --usage off --mtp off --json 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','slice':'deepseek-v3','weights':'$w','rep':$rep,'decode_tps':r['decode_tokens_per_s'],
  'prefill_tps':r['prefill_tokens_per_s'],'bytes_per_token':r['decode_bytes_read_per_token'],
  'of_floor':r['decode_bytes_read_per_token']/$hbm*r['decode_tokens_per_s']}))" >>"$res" ||
      echo "strata $w failed" | tee -a "$OUT/side.log"
  done
done
since "done"
cat "$res"
tail -5 "$OUT/side.log"

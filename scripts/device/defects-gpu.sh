#!/usr/bin/env bash
# On the GPU machine, after the defects of issue 41: the whole CUDA suite, then MTP's
# default against --mtp off on CUDA (scripts/mtp_matrix.py: bench decode and bench serve
# at 1, 4 and 16 requests, greedy and sampled), then the bounded load test of strata serve
# on CUDA (tests/server/soak.py). Needs .devcarry/ as gpu-check.sh describes, and
# .devcarry/tiny-model.safetensors.xz when slim.sh took the model's weights out of the
# upload. Writes tests.log, mtp.jsonl, mtp.txt and soak.json under $OUT.
set -uo pipefail
. "$(dirname "$0")/env.sh"
if [ ! -s models/strata-tiny/model.safetensors ] && [ -f $C/tiny-model.safetensors.xz ]; then
  xz -d -T4 -c $C/tiny-model.safetensors.xz >models/strata-tiny/model.safetensors
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cuda_tests "^test .*FAILED|test result|panicked|STALL|vision-large"
since "mtp matrix"
timeout 300 python3 scripts/mtp_matrix.py --bin $C/strata-bench --device cuda --reps ${REPS:-2} --json "$OUT/mtp.jsonl" \
  >"$OUT/mtp.txt" 2>&1
tail -12 "$OUT/mtp.txt"
since "soak"
timeout 150 python3 tests/server/soak.py --bin $C/strata --seconds ${SOAK_S:-45} --clients 12 -- --device cuda \
  --context 1024 --queue 8 >"$OUT/soak.json" 2>&1
python3 -c "import json; d=json.load(open('$OUT/soak.json')); print({k: d[k] for k in ['answered','cancelled','refused_4xx','refused_429','failed_5xx','transport_errors','rss_mib_first_last_max']})" ||
  tail -5 "$OUT/soak.json"
since "done"

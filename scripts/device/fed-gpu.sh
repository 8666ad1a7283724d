#!/usr/bin/env bash
# On the GPU machine: the CUDA test suite, then greedy decoding with the picks fed on the
# device against the picks read back (`bench decode --fed-decoding on|off`), graphs on, on
# the GLM-5-shaped slice (bf16; int4 experts; and with GLM-5's full vocabulary of 154880,
# where the logits read back is 620 KB a token) and on strata-tiny; and the fed runs again
# with programmatic dependent launch off (STRATA_CUDA_PDL=0). Runs alternate so drift hits
# every variant. Run from the repository root; binaries in .devcarry/ (see env.sh).
# TINY=0 when models/strata-tiny is not in the tree (the tests then skip it too).
# Writes $OUT/tests.log, $OUT/fed.jsonl, $OUT/side.log.
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/fed.jsonl"
: >"$res"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader

if [ "${TESTS:-1}" = 1 ]; then
  cuda_tests "^test .*(FAILED|ok)$|test result|panicked|fed decoding|argmax" | grep -v " ok$" | head -40
  grep -c " ok$" "$OUT/tests.log" | sed 's/^/tests ok: /'
fi

since "slices"
slice=/tmp/slice48
glm5_slice $slice
glm5_slice $slice-v154k 154880
bench() {  # dir label fed rep [flags...]
  local dir=$1 label=$2 fed=$3 rep=$4
  shift 4
  timeout 120 $S bench decode --model "$dir" --device cuda --prompt-tokens 64 --decode-tokens ${DECODE:-128} --warmup \
    --usage off --mtp off --json --fed-decoding "$fed" "$@" 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'weights':'$label','fed':'$fed','pdl':'${STRATA_CUDA_PDL:-1}','flags':'$*','rep':$rep,'decode_tps':round(r['decode_tokens_per_s'],1),
  'decode_fed':r.get('decode_fed',False),'ms_per_token':round(1e3/r['decode_tokens_per_s'],4),
  'bytes_per_token':r['decode_bytes_read_per_token'],'graph_launches_per_token':r.get('cuda_graph_launches_per_decode_token'),
  'kernels_alone_per_token':r.get('cuda_kernels_alone_per_decode_token')}))" >>"$res" ||
    echo "strata $label fed=$fed failed" | tee -a "$OUT/side.log"
}
for rep in $(seq 1 ${REPS:-2}); do
  for v in on off pdl0; do
    fed=${v/pdl0/on}
    pdl=1
    [ $v = pdl0 ] && pdl=0
    STRATA_CUDA_PDL=$pdl bench $slice bf16 $fed $rep
    STRATA_CUDA_PDL=$pdl bench $slice-int4 int4-g64 $fed $rep
    STRATA_CUDA_PDL=$pdl bench $slice-v154k bf16-vocab154880 $fed $rep
    STRATA_CUDA_PDL=$pdl bench $slice-v154k-int4 int4-g64-vocab154880 $fed $rep
    [ "${TINY:-1}" = 1 ] && STRATA_CUDA_PDL=$pdl bench models/strata-tiny strata-tiny $fed $rep
  done
done
since "graphs off, fed on/off (bf16)"
bench $slice bf16 on 1 --cuda-graphs off
bench $slice bf16 off 1 --cuda-graphs off
since "done"
python3 - "$res" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
g = collections.defaultdict(list)
for r in rows:
    g[(r['weights'], r['flags'], 'fed ' + r['fed'], 'pdl ' + r['pdl'])].append(r['decode_tps'])
for k, v in sorted(g.items()):
    print(k, 'tok/s', v, 'best', max(v))
PY

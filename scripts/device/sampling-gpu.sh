#!/usr/bin/env bash
# On the GPU machine: sampled decoding with the draws made on the device against the host
# path (logits read back, drawn on the host) and greedy, on the GLM-5-shaped slices
# (SLICES: bf16, int4-g64, bf16-vocab154880), after the CUDA tests (TESTS=0 skips them).
# MODES: greedy, drawn (device draws), host (--fed-decoding off: the host draws), each with
# SAMPLING's flags (default: temperature 0.8, top-p 0.95; several sets separated by `;`,
# each its own rows). BIN=NAME runs .devcarry/NAME (a carried A/B binary) instead of
# strata. Writes $OUT/tests.log and $OUT/sampling.jsonl; prints a summary.
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
S=$C/strata
[ -n "${BIN:-}" ] && { S=$(carried_bin "$BIN") || exit 1; }
res="$OUT/sampling.jsonl"
touch "$res"
tests_then_slice
SLICES=${SLICES:-bf16 int4-g64 bf16-vocab154880}
[[ " $SLICES " == *"-vocab154880 "* ]] && glm5_slice $slice-v154k 154880
IFS=';' read -ra SETS <<<"${SAMPLING:---temperature 0.8 --top-p 0.95}"
MODES=${MODES:-greedy drawn host}
runs=()
for mode in $MODES; do
  if [ "$mode" = greedy ]; then runs+=("greedy|"); else for f in "${SETS[@]}"; do runs+=("$mode|$f"); done; fi
done
for rep in $(seq 1 ${REPS:-2}); do
  for run in "${runs[@]}"; do
    mode=${run%%|*} sampling=${run#*|}
    since "decode $mode $sampling ($rep)"
    case $mode in
      greedy) flags=() ;;
      drawn) flags=($sampling) ;;
      host) flags=($sampling --fed-decoding off) ;;
      *) echo "MODES: unknown mode $mode" >&2; exit 1 ;;
    esac
    for d in "$slice bf16" "$slice-int4 int4-g64" "$slice-v154k bf16-vocab154880"; do
      set -- $d
      [[ " $SLICES " == *" $2 "* ]] || continue
      timeout 120 $C/strata-bench decode --model "$1" --device cuda --prompt-tokens ${PROMPT:-64} --decode-tokens ${DECODE:-128} \
        --warmup --usage off --mtp off --json "${flags[@]}" 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'weights':'$2','mode':'$mode','flags':'$sampling','rep':$rep,'decode_tps':round(r['decode_tokens_per_s'],1),
  'ms_per_token':round(1000/r['decode_tokens_per_s'],3),
  'fed':r['decode_fed'],'of_floor':round(r['decode_bytes_read_per_token']/4.3e12*r['decode_tokens_per_s'],3),
  'graphs_per_token':r.get('cuda_graph_launches_per_decode_token'),'kernels_per_token':r.get('cuda_kernels_in_graphs_per_decode_token'),
  'allocs_per_token':r.get('allocations_per_decode_token')}))" >>"$res"
    done
  done
done
since "done"
python3 - "$res" <<'PY'
import json, sys, collections
g = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); g[(r['weights'], r['mode'], r.get('flags', ''))].append((r['decode_tps'], r['ms_per_token'], r['fed'], r['graphs_per_token']))
for k, v in sorted(g.items()): print(k, v)
PY

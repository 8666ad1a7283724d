#!/usr/bin/env bash
# On the GPU machine: kernel variants chosen by definitions passed to NVRTC
# (STRATA_CUDA_DEFINES), e.g. VARIANTS="ROW_UNROLL=1 ROW_UNROLL=2 ROW_UNROLL=4" or
# VARIANTS="I4_TILES=0 I4_TILES=1" (several definitions in one variant joined by commas:
# "XT_QDEPTH=4,XT_MINB=1"), or by the backend's comparison switches (a variant
# STRATA_...=VALUE is set in the environment instead, several joined by commas; `_` is the
# defaults; BIN=NAME decodes with another binary, .devcarry/NAME[.xz]): one a variant;
# results stay the same or within the stated tolerance, speed may not. Timed on the
# expert-bandwidth test (BANDWIDTH=0 skips it) and on decode of the GLM-5-shaped slices
# (bf16, int4 experts, full vocabulary), after the CUDA tests at the defaults (TESTS=0
# skips them). Binaries in .devcarry/ (see env.sh). Writes $OUT/tests.log,
# $OUT/defines.jsonl, $OUT/bandwidth-*.log, $OUT/side.log. PROMPT / DECODE: the tokens of
# the prompt and of the decode (64 and 128).
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/defines.jsonl"
# (Appended to: a second run in the same call adds its variants; the slices are made once.)
touch "$res"
tests_then_slice
# SLICES: which slices to time (labels as in defines.jsonl): bf16, int4-g64 (experts;
# int4-g64-e4m3 with e4m3 scales),
# bf16-vocab154880 and int4-g64-vocab154880 (GLM-5's vocabulary), fp8 and fp8-int4-g64 (projections in FP8 e4m3,
# 128 x 128 blocks, as GLM-5's FP8 checkpoints; experts FP8 or int4).
SLICES=${SLICES:-bf16 int4-g64 bf16-vocab154880}
[[ " $SLICES " == *" fp8 "* ]] &&
  { [ -d $slice-fp8 ] || timeout 200 $S bench synth --out $slice-fp8 --preset glm5 --layers 2 --dense-layers 1 \
    --experts 48 --vocab 16384 --fp8 >>"$OUT/side.log" 2>&1; }
[[ " $SLICES " == *" fp8-int4-g64 "* ]] &&
  { [ -d $slice-fp8-int4 ] || timeout 200 $S bench synth --out $slice-fp8-int4 --preset glm5 --layers 2 \
    --dense-layers 1 --experts 48 --vocab 16384 --fp8 --container int4-g64 >>"$OUT/side.log" 2>&1; }
[[ " $SLICES " == *" int4-g64-e4m3 "* ]] &&
  { [ -d $slice-g64-e4m3 ] || timeout 200 $S convert --model $slice --out $slice-g64-e4m3 --experts int4 --scales e4m3 \
    >>"$OUT/side.log" 2>&1; }
[[ " $SLICES " == *"-vocab154880 "* ]] &&
  { [ -d $slice-v154k ] || timeout 200 $S bench synth --out $slice-v154k --preset glm5 --layers 2 --dense-layers 1 \
    --experts 48 --vocab 154880 >>"$OUT/side.log" 2>&1; }
[[ " $SLICES " == *" int4-g64-vocab154880 "* ]] &&
  { [ -d $slice-v154k-int4 ] || timeout 200 $S convert --model $slice-v154k --out $slice-v154k-int4 --experts int4 --scales f32 \
    >>"$OUT/side.log" 2>&1; }
VARIANTS=${VARIANTS:-ROW_UNROLL=1 ROW_UNROLL=2 ROW_UNROLL=4}
setenv=()
bin=$S
variant() {  # sets up variant $1: STRATA_CUDA_DEFINES, setenv, or (BIN=NAME) the binary $C/NAME
  unset STRATA_CUDA_DEFINES
  setenv=()
  bin=$S
  case $1 in
    _) ;;
    STRATA_*) setenv=(${1//,/ }) ;;
    BIN=*) bin=$(carried_bin "${1#BIN=}") || exit 1 ;;
    *) export STRATA_CUDA_DEFINES="${1//,/ }" ;;
  esac
}
if [ "${BANDWIDTH:-1}" = 1 ]; then
  for u in $VARIANTS; do
    since "bandwidth $u"
    variant "$u"
    env "${setenv[@]}" timeout 120 $C/cuda-tests --ignored --nocapture cuda_kernel_bandwidth 2>&1 | grep -E "GB/s" \
      >"$OUT/bandwidth-${u//[=,]/-}.log"
  done
fi
# Variants alternate within a repetition, so drift hits each alike.
for rep in $(seq 1 ${REPS:-2}); do
  for u in $VARIANTS; do
    since "decode $u ($rep)"
    variant "$u"
    for d in "$slice bf16" "$slice-int4 int4-g64" "$slice-g64-e4m3 int4-g64-e4m3" "$slice-v154k bf16-vocab154880" "$slice-v154k-int4 int4-g64-vocab154880" \
      "$slice-fp8 fp8" "$slice-fp8-int4 fp8-int4-g64"; do
      set -- $d
      [[ " $SLICES " == *" $2 "* ]] || continue
      env "${setenv[@]}" timeout 120 $bin bench decode --model "$1" --device cuda --prompt-tokens ${PROMPT:-64} --decode-tokens ${DECODE:-128} \
        --warmup --usage off --mtp off --json 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'weights':'$2','defines':'$u','rep':$rep,'decode_tps':round(r['decode_tokens_per_s'],1),
  'ms_per_token':round(1e3/r['decode_tokens_per_s'],4),'prefill_tps':round(r['prefill_tokens_per_s'],1),'of_floor':round(r['decode_bytes_read_per_token']/4.3e12*r['decode_tokens_per_s'],3),
  'graphs_per_token':r.get('cuda_graph_launches_per_decode_token'),'kernels_per_token':r.get('cuda_kernels_in_graphs_per_decode_token')}))" >>"$res"
    done
  done
done
unset STRATA_CUDA_DEFINES
since "done"
[ "${BANDWIDTH:-1}" = 1 ] && for u in $VARIANTS; do echo "$u:"; cat "$OUT/bandwidth-${u//[=,]/-}.log"; done
python3 - "$res" <<'PY'
import json, sys, collections
g = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); g[(r['weights'], r['defines'])].append((r['decode_tps'], r['of_floor']))
for k, v in sorted(g.items()): print(k, v)
PY

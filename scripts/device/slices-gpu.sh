#!/usr/bin/env bash
# On the GPU machine, in one call (issue 43, the families' GPU figures): the CUDA test
# suite, then for each family in FAMILIES (default "gpt_oss qwen3_moe minimax_m2 qwen3_next") a slice
# with the released model's layer widths (`scripts/make_slice_checkpoint.py FAMILY`, vocab
# 512, the family fixture's tokenizer beside it) decoded on CUDA by strata resident and
# with the GPU slab at ~30% of the routed experts (the rest in pinned host RAM), and by
# llama.cpp's CUDA build on the same weights (GGUF by `llamacpp-peer.sh convert`, bf16; gpt-oss's
# MXFP4 experts stay MXFP4). llama.cpp builds and the slices are written and converted while
# the tests run. Run from the repository root.
#
# Needs, in .devcarry/ (built here): strata.xz, strata-bench.xz, cuda-tests.xz (see
# gpu-check.sh), llama-src.tar.xz and llamacpp-peer.sh (see peer-gpu.sh).
# SKIP_TESTS=1 skips the suite (SKIP_TESTS_MATCHING names tests to skip). Writes under
# $OUT: machine.txt, tests.log, slices.jsonl (one JSON object a measurement, with the
# share of the HBM floor: 3.35 TB/s on the H100, 4.3 on the H200), llama.log, side.log.
set -uo pipefail
. "$(dirname "$0")/env.sh"
PEER=${PEER:-$C/llamacpp-peer.sh}
S=$C/strata
res="$OUT/slices.jsonl"
: >"$res"
{ nvidia-smi; date -u; nproc; free -g; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } \
  >"$OUT/machine.txt" 2>&1
L=/tmp/llama-cuda
FAMILIES=${FAMILIES:-gpt_oss qwen3_moe minimax_m2 qwen3_next}
# Each family's fixture whose tokenizer (512 ids, the family's chat template) the slice takes.
declare -A TOK=([gpt_oss]=gpt_oss/mxfp4-yarn [qwen3_moe]=qwen3_moe/gqa-renorm [minimax_m2]=minimax_m2/gqa-full
  [qwen3_next]=qwen3_next/hybrid-f32)

(
  # (A second call on the same warm machine reuses the build and the slices.)
  [ -x "$L/bin/llama-bench" ] || TARGETS="llama-bench" bash "$PEER" build "$C/llama-src.tar.xz" "$L" cuda >/tmp/llama-build.log 2>&1 &
  for fam in $FAMILIES; do
    d=/tmp/slice-$fam
    [ -f "$d.done" ] && continue
    timeout 240 python3 scripts/make_slice_checkpoint.py "$fam" "$d" --vocab 512 >>"$OUT/side.log" 2>&1 ||
      echo "slice $fam failed" >>"$OUT/side.log"
    cp "fixtures/${TOK[$fam]}/tokenizer.json" "fixtures/${TOK[$fam]}/tokenizer_config.json" "$d/"
    timeout 300 bash "$PEER" convert "$C/llama-src.tar.xz" "$d" "$d.gguf" bf16 >>"$OUT/side.log" 2>&1 ||
      echo "convert $fam to GGUF failed" >>"$OUT/side.log"
    touch "$d.done"
  done
  wait
  touch /tmp/llama.done
) &

[ -z "${SKIP_TESTS:-}" ] && cuda_tests "^test .*FAILED|test result|panicked|STALL"
hbm=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && echo 3.35e12 || echo 4.3e12)

strata_bench() {  # dir family mode [flags...]
  local dir=$1 fam=$2 mode=$3
  shift 3
  for rep in 1 2; do
    timeout 150 $S-bench decode --model "$dir" --device cuda --prompt-tokens 64 --decode-tokens 64 --warmup --usage off \
      --mtp off --json "$@" 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','family':'$fam','mode':'$mode','rep':$rep,'decode_tps':r['decode_tokens_per_s'],
  'prefill_tps':r['prefill_tokens_per_s'],'bytes_per_token':r['decode_bytes_read_per_token'],
  'of_floor':r['decode_bytes_read_per_token']/$hbm*r['decode_tokens_per_s'],
  'gpu_hit':r.get('gpu_tier_hit_rate'),'copy_per_token':r.get('gpu_tier_copy_bytes_per_token')}))" >>"$res" ||
      echo "strata $fam $mode failed" | tee -a "$OUT/side.log"
  done
}

for fam in $FAMILIES; do
  d=/tmp/slice-$fam
  for _ in $(seq 1 300); do [ -f "$d.done" ] && break; sleep 1; done
  since "$fam slice $( [ -f "$d.done" ] && echo ready || echo 'NOT ready') ($(du -sh "$d" 2>/dev/null | cut -f1))"
  strata_bench "$d" "$fam" resident
  # The GPU slab at ~30% of the routed experts: the plan's fixed bytes and 8 working slots,
  # then per-layer slots up to 30% of the experts.
  read -r g30 <<<"$($S fit --model "$d" --device cuda --working-slots 8 --context 512 --mtp off --json 2>>"$OUT/side.log" |
    python3 -c "
import json,sys; j=json.load(sys.stdin); p=j['gpu']['plan']['input']
layers=p['sparse_layers']; n=layers*p['max_slots_per_layer']; per=max(1,(int(0.3*n)-8)//layers)
print(p['fixed_bytes']+(8+layers*per)*p['slot_bytes'])")"
  echo "$fam: gpu budget (30%) $g30" | tee -a "$OUT/side.log"
  [ -n "$g30" ] && strata_bench "$d" "$fam" gpu30 --working-slots 8 --context 512 --gpu-budget "$g30"
done

for _ in $(seq 1 400); do [ -f /tmp/llama.done ] && break; sleep 1; done
since "llama.cpp $(ls $L/bin 2>/dev/null | tr '\n' ' ')"
tail -3 /tmp/llama-build.log | tee -a "$OUT/side.log"
for fam in $FAMILIES; do
  g=/tmp/slice-$fam.gguf
  [ -x "$L/bin/llama-bench" ] && [ -f "$g" ] || { echo "no llama.cpp run for $fam" | tee -a "$OUT/side.log"; continue; }
  timeout 150 "$L/bin/llama-bench" -m "$g" -ngl 99 -p 64 -n 64 -r 3 -o json 2>>"$OUT/side.log" | tee -a "$OUT/llama.log" |
    python3 -c "
import json,sys
for r in json.load(sys.stdin):
    kind = 'prefill_tps' if r['n_prompt'] else 'decode_tps'
    print(json.dumps({'engine':'llama.cpp','family':'$fam',kind:r['avg_ts'],'stddev':r['stddev_ts'],'model_bytes':r['model_size']}))" \
    >>"$res" || echo "llama-bench $fam failed" | tee -a "$OUT/side.log"
done
since "done"
cat "$res"
tail -5 "$OUT/side.log"

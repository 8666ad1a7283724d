#!/usr/bin/env bash
# On the GPU machine, in one go (issue 9, the peers): the CUDA test suite and the
# expert-kernel bandwidth test, then a GLM-5-shaped slice decoded resident on the H200 by
# strata (bf16 experts; int4 experts from `strata convert`), by llama.cpp's CUDA build on
# the same weights (GGUF bf16, and Q4_0 from llama-quantize) and by transformers (bf16,
# `grouped_mm` experts). llama.cpp builds and the GGUF converts while the tests run.
# Run from the repository root.
#
# Needs, in .devcarry/ (built here): strata.xz and cuda-tests.xz (see gpu-check.sh) and
# llama-src.tar.xz (`../shared/tools/llamacpp-peer.sh source .devcarry`) with a copy of
# that script, llamacpp-peer.sh.
# Each strata figure is taken with CUDA graphs (the default) and with `--cuda-graphs off`.
# SKIP_TESTS_MATCHING names tests to skip (the device tool's 64 MiB limit can leave
# fixtures behind), SKIP_TESTS=1 skips the suite; PRESET (glm5, or deepseek-v3) the
# slice's widths; EXPERTS (default 48) the slice's routed experts; FULL_VOCAB=1 also
# times the slice with GLM-5's vocabulary (154880): strata (bf16, int4 experts),
# llama.cpp (bf16, Q4_0) and transformers (bf16); SERVE=1
# times the serving engine on the bf16 slice with device picks on and off; FP8=1 also times
# strata on the slice with its projections in FP8 (128 x 128 blocks, as GLM-5's FP8
# checkpoints), bf16 and int4 experts; P512=1 adds 512-token prompts (strata and llama.cpp).
# Writes under $OUT: machine.txt, tests.log, bandwidth.log, peer.jsonl (one JSON object
# per measurement), llama.log (llama-bench's own output), profile.txt (strata's per-stage
# decode profile of both slices), side.log.
set -uo pipefail
. "$(dirname "$0")/env.sh"
PEER=${PEER:-$C/llamacpp-peer.sh}
S=$PWD/$C/strata
res="$OUT/peer.jsonl"
: >"$res"
{ nvidia-smi; date -u; nproc; free -g; } >"$OUT/machine.txt" 2>&1
slice=/tmp/slice-peer
L=/tmp/llama-cuda

# CPU work in the background while the GPU runs the tests: build llama.cpp, write the
# slice, convert it to GGUF and to strata's int4 container.
(
  TARGETS="llama-bench llama-quantize" bash "$PEER" build "$C/llama-src.tar.xz" "$L" cuda >/tmp/llama-build.log 2>&1 &
  timeout 200 $C/strata-bench synth --out "$slice" --preset "${PRESET:-glm5}" --layers 2 --dense-layers 1 \
    --experts "${EXPERTS:-48}" --vocab 16384 >>"$OUT/side.log" 2>&1
  # llama.cpp's converter needs a tokenizer; strata-tiny's (8192 ids) is padded to the vocab.
  tok=${TOKENIZER_DIR:-models/strata-tiny}
  cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$slice/"
  timeout 300 bash "$PEER" convert "$C/llama-src.tar.xz" "$slice" /tmp/slice.gguf bf16 >>"$OUT/side.log" 2>&1 ||
    echo "convert to GGUF failed" >>"$OUT/side.log"
  timeout 200 $S convert --model "$slice" --out "$slice-int4" --experts int4 --scales f32 >>"$OUT/side.log" 2>&1 ||
    echo "strata convert int4 failed" >>"$OUT/side.log"
  if [ "${FULL_VOCAB:-0}" = 1 ]; then
    timeout 200 $C/strata-bench synth --out "$slice-v154k" --preset glm5 --layers 2 --dense-layers 1 --experts "${EXPERTS:-48}" \
      --vocab 154880 >>"$OUT/side.log" 2>&1
    timeout 200 $S convert --model "$slice-v154k" --out "$slice-v154k-int4" --experts int4 --scales f32 >>"$OUT/side.log" 2>&1
    cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$slice-v154k/"
    timeout 300 bash "$PEER" convert "$C/llama-src.tar.xz" "$slice-v154k" /tmp/slice-v154k.gguf bf16 >>"$OUT/side.log" 2>&1 ||
      echo "convert of the GLM-5-vocabulary slice to GGUF failed" >>"$OUT/side.log"
  fi
  if [ "${FP8:-0}" = 1 ]; then
    timeout 200 $C/strata-bench synth --out "$slice-fp8" --preset glm5 --layers 2 --dense-layers 1 --experts "${EXPERTS:-48}" \
      --vocab 16384 --fp8 >>"$OUT/side.log" 2>&1
    timeout 200 $C/strata-bench synth --out "$slice-fp8-int4" --preset glm5 --layers 2 --dense-layers 1 \
      --experts "${EXPERTS:-48}" --vocab 16384 --fp8 --container int4-g64 >>"$OUT/side.log" 2>&1
  fi
  wait
  touch /tmp/cpu-work.done
) &

if [ -z "${SKIP_TESTS:-}" ]; then
  cuda_tests "^test |test result|panicked|FAILED|STALL"
  timeout 120 $C/cuda-tests --ignored --nocapture cuda_kernel_bandwidth 2>&1 | tee "$OUT/bandwidth.log" |
    grep -E "GB/s|test result|panicked"
fi

since "waiting for llama.cpp and the slice"
for _ in $(seq 1 300); do [ -f /tmp/cpu-work.done ] && break; sleep 1; done
since "cpu work $( [ -f /tmp/cpu-work.done ] && echo done || echo 'NOT done')"; ls "$L/bin" 2>&1 | tr '\n' ' '; echo
tail -3 /tmp/llama-build.log | tee -a "$OUT/side.log"

strata_bench() {  # dir label [flags...]
  local dir=$1 label=$2
  shift 2
  for rep in 1 2; do
    timeout 120 $C/strata-bench decode --model "$dir" --device cuda --prompt-tokens ${PT:-64} --decode-tokens 64 --warmup \
      --usage off --mtp off --json "$@" 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','weights':'$label','flags':'$*','rep':$rep,'prompt_tokens':${PT:-64},'decode_tps':r['decode_tokens_per_s'],
  'decode_fed':r.get('decode_fed',False),'of_floor':r['decode_bytes_read_per_token']/4.3e12*r['decode_tokens_per_s'],
  'prefill_tps':r['prefill_tokens_per_s'],'bytes_per_token':r['decode_bytes_read_per_token'],
  'graph_launches_per_token':r.get('cuda_graph_launches_per_decode_token'),
  'kernels_in_graphs_per_token':r.get('cuda_kernels_in_graphs_per_decode_token'),
  'kernels_alone_per_token':r.get('cuda_kernels_alone_per_decode_token')}))" >>"$res" ||
      echo "strata $label failed" | tee -a "$OUT/side.log"
  done
}
llama_bench() {  # gguf label
  local prompts=64
  [ "${P512:-0}" = 1 ] && prompts=64,512
  timeout 150 "$L/bin/llama-bench" -m "$1" -ngl 99 -p $prompts -n 64 -r 3 -o json 2>>"$OUT/side.log" | tee -a "$OUT/llama.log" |
    python3 -c "
import json,sys
for r in json.load(sys.stdin):
    kind = 'prefill_tps' if r['n_prompt'] else 'decode_tps'
    print(json.dumps({'engine':'llama.cpp','weights':'$2','prompt_tokens':r['n_prompt'],kind:r['avg_ts'],'stddev':r['stddev_ts'],'model_bytes':r['model_size']}))" \
    >>"$res" || echo "llama-bench $2 failed" | tee -a "$OUT/side.log"
}

since "strata bf16"; strata_bench "$slice" bf16
since "strata int4"; strata_bench "$slice-int4" int4-g64
if [ "${FP8:-0}" = 1 ]; then
  since "strata fp8"; strata_bench "$slice-fp8" fp8
  since "strata fp8, int4 experts"; strata_bench "$slice-fp8-int4" fp8-int4-g64
fi
if [ "${P512:-0}" = 1 ]; then
  since "strata, 512-token prompts"
  PT=512 strata_bench "$slice" bf16
  PT=512 strata_bench "$slice-int4" int4-g64
fi
if [ "${SERVE:-0}" = 1 ]; then
  # The serving engine (continuous batching, in process): 8 greedy requests, their steps
  # picked on the device (one id a request read back) or their logits read.
  for rep in 1 2; do
    for picks in on off; do
      since "strata-bench serve, device picks $picks ($rep)"
      timeout 120 $C/strata-bench serve --model "$slice" --device cuda --requests 8 --prompt-tokens 64 --decode-tokens 64 \
        --warmup --usage off --mtp off --json --device-picks $picks 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata serve','weights':'bf16','device_picks':'$picks','rep':$rep,'tokens_per_s':round(r['tokens_per_s'],1),
  'steps':r['steps'],'picked_steps':r['picked_steps'],'rows_per_step':r['rows_per_step']}))" >>"$res" ||
        echo "bench serve (picks $picks) failed" | tee -a "$OUT/side.log"
    done
  done
fi
# GRAPHS_OFF=0 skips the runs without CUDA graphs and the per-stage profile.
if [ "${GRAPHS_OFF:-1}" = 1 ]; then
  since "strata, CUDA graphs off"
  strata_bench "$slice" bf16 --cuda-graphs off
  strata_bench "$slice-int4" int4-g64 --cuda-graphs off
  for d in "$slice" "$slice-int4"; do
    echo "== $d" >>"$OUT/profile.txt"
    timeout 60 $C/strata-bench decode --model "$d" --device cuda --prompt-tokens 64 --decode-tokens 64 --warmup --usage off --mtp off \
      --profile >>"$OUT/profile.txt" 2>&1
  done
fi
if [ -x "$L/bin/llama-bench" ] && [ -f /tmp/slice.gguf ]; then
  since "llama.cpp bf16"; llama_bench /tmp/slice.gguf bf16
  timeout 120 "$L/bin/llama-quantize" /tmp/slice.gguf /tmp/slice-q4_0.gguf Q4_0 >>"$OUT/side.log" 2>&1 &&
    { since "llama.cpp q4_0"; llama_bench /tmp/slice-q4_0.gguf q4_0; }
fi
since "transformers bf16"
timeout 150 python3 scripts/bench_transformers_gpu.py "$slice" --dtype bfloat16 --prompt-tokens 64 --decode-tokens 64 \
  --reps 2 --experts grouped_mm >>"$res" 2>>"$OUT/side.log" || echo "transformers failed" | tee -a "$OUT/side.log"
if [ "${FULL_VOCAB:-0}" = 1 ]; then
  since "strata, GLM-5's vocabulary"
  strata_bench "$slice-v154k" bf16-vocab154880
  strata_bench "$slice-v154k-int4" int4-g64-vocab154880
  if [ -x "$L/bin/llama-bench" ] && [ -f /tmp/slice-v154k.gguf ]; then
    since "llama.cpp, GLM-5's vocabulary"
    llama_bench /tmp/slice-v154k.gguf bf16-vocab154880
    timeout 120 "$L/bin/llama-quantize" /tmp/slice-v154k.gguf /tmp/slice-v154k-q4_0.gguf Q4_0 >>"$OUT/side.log" 2>&1 &&
      llama_bench /tmp/slice-v154k-q4_0.gguf q4_0-vocab154880
  fi
  since "transformers, GLM-5's vocabulary"
  timeout 150 python3 scripts/bench_transformers_gpu.py "$slice-v154k" --dtype bfloat16 --prompt-tokens 64 --decode-tokens 64 \
    --reps 2 --experts grouped_mm >>"$res" 2>>"$OUT/side.log" ||
    echo "transformers (GLM-5's vocabulary) failed" | tee -a "$OUT/side.log"
fi
since "done"
cat "$res"

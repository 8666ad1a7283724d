#!/usr/bin/env bash
# On the GPU machine, in one go: the CUDA test suite (kernels vs the CPU backend, every
# parity fixture and strata-tiny on CUDA), the expert-kernel bandwidth test, and decode /
# prefill throughput of strata-tiny on CUDA next to transformers on the same GPU (and a
# GLM-5-shaped slice when SLICE=1; TRANSFORMERS_TINY=0 skips transformers on strata-tiny).
# Run from the repository root.
#
# Needs, in .devcarry/ (built here: the GPU machine has no Rust toolchain):
#   strata.xz       stripped `cargo build --release --features cuda -p strata-cli` binary
#   cuda-tests.xz   stripped `cargo test --release --features cuda -p strata-engine --test cuda --no-run` binary
#   bench_transformers_gpu.py   copy of scripts/bench_transformers_gpu.py
# The device tool sends the checkout its session started in (not a helper's worktree):
# .devcarry/ must be in that checkout, ignored by git, and named in `carry`.
# Writes at most 7 files under $OUT (the tool returns 8): machine.txt, tests.log,
# bandwidth.log, gpu-check.jsonl (one JSON object per measurement), profile-*.txt and
# side.log (stderr of the benchmarks, the slice's synthesis).
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/gpu-check.jsonl"
: >"$res"
{ nvidia-smi; date -u; git log -1 --format='%H %s' 2>/dev/null; } >"$OUT/machine.txt" 2>&1
head -20 "$OUT/machine.txt"

echo "== tests"
t0=$(date +%s)
timeout 240 $C/cuda-tests --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log" | grep -E "^test |parity ok|strata-tiny prompt|test result|panicked|FAILED|STALL"
echo "tests: $(($(date +%s) - t0)) s"
timeout 120 $C/cuda-tests --ignored --nocapture cuda_kernel_bandwidth 2>&1 | tee "$OUT/bandwidth.log" | grep -E "GB/s|test result|panicked"

echo "== strata-tiny on CUDA"
$S --version >/dev/null 2>&1 || true
tiny() {  # prompt decode reps device
  for rep in $(seq 1 "$3"); do
    timeout 60 $C/strata-bench decode --model models/strata-tiny --device "$4" --prompt-tokens "$1" --decode-tokens "$2" --warmup --json \
      2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','model':'strata-tiny','device':r['device'],'prompt':$1,'decode':$2,'rep':$rep,'decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s'],'load_s':r['load_seconds']}))" >>"$res"
  done
}
tiny 64 128 3 cuda
tiny 512 256 3 cuda
tiny 64 128 1 cpu
timeout 60 $C/strata-bench decode --model models/strata-tiny --device cuda --prompt-tokens 64 --decode-tokens 256 --profile >"$OUT/profile-cuda.txt" 2>&1
timeout 60 $S generate --help >/dev/null 2>&1
echo "no GPU path check:"; CUDA_VISIBLE_DEVICES= timeout 30 $C/strata-bench decode --model models/strata-tiny --device cuda 2>&1 | tail -1

[ "${TRANSFORMERS_TINY:-1}" = 1 ] && echo "== transformers on the GPU" && for cfg in "bfloat16 64 128" "bfloat16 512 256" "float32 64 128"; do
  set -- $cfg
  timeout 120 python3 $C/bench_transformers_gpu.py models/strata-tiny --dtype $1 --prompt-tokens $2 --decode-tokens $3 \
    --reps 2 >>"$res" 2>>"$OUT/side.log" || { echo "transformers $cfg failed"; tail -5 "$OUT/side.log"; }
done

if [ -n "${SLICE:-}" ]; then
  echo "== GLM-5-shaped slice (bf16, 48 experts), resident on CUDA"
  timeout 200 $C/strata-bench synth --out /tmp/slice48 --preset glm5 --layers 2 --dense-layers 1 --experts 48 --vocab 16384 >>"$OUT/side.log" 2>&1
  for rep in 1 2; do
    timeout 120 $C/strata-bench decode --model /tmp/slice48 --device cuda --prompt-tokens 64 --decode-tokens 64 --warmup --json 2>>"$OUT/side.log" \
      | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','model':'slice48','device':r['device'],'prompt':64,'decode':64,'rep':$rep,'decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s'],'bytes_per_token':r['decode_bytes_read_per_token']}))" >>"$res"
  done
  timeout 60 $C/strata-bench decode --model /tmp/slice48 --device cuda --prompt-tokens 64 --decode-tokens 64 --profile >"$OUT/profile-slice.txt" 2>&1
  timeout 150 python3 $C/bench_transformers_gpu.py /tmp/slice48 --dtype bfloat16 --prompt-tokens 64 --decode-tokens 64 \
    --reps 2 --experts grouped_mm >>"$res" 2>>"$OUT/side.log" || echo "transformers slice failed"
fi
echo "== results"
cat "$res"

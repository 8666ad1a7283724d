#!/usr/bin/env bash
# On the GPU machine's 16-core host (issue 43's CPU figures): a slice with a real model's
# widths (`strata-bench synth --preset PRESET`, default deepseek-v3; 2 layers, the first
# dense, EXPERTS routed experts, default 48, vocabulary 16384) decoded on the CPU by strata
# (bf16, and int4-g64 experts from `strata convert`) and by llama.cpp's CPU build on the
# same GGUF-converted bf16 weights (and Q4_0), the same cores pinned with taskset, at
# THREADS (default 16). Writes $OUT/cpu-peer.jsonl (one JSON line a measurement).
# Needs in .devcarry/: strata.xz, strata-bench.xz, llama-src.tar.xz, llamacpp-peer.sh.
set -uo pipefail
. "$(dirname "$0")/env.sh"
res="$OUT/cpu-peer.jsonl"
: >"$res"
slice=/tmp/slice-cpu
L=/tmp/llama-cpu
T=${THREADS:-16}
cores=$(seq -s, 0 $((T - 1)))
TARGETS="llama-bench llama-quantize" bash $C/llamacpp-peer.sh build $C/llama-src.tar.xz $L >"$OUT/llama-build.log" 2>&1 &
timeout 200 $C/strata-bench synth --out "$slice" --preset "${PRESET:-deepseek-v3}" --layers 2 --dense-layers 1 \
  --experts "${EXPERTS:-48}" --vocab 16384 >>"$OUT/side.log" 2>&1
cp models/strata-tiny/tokenizer.json models/strata-tiny/tokenizer_config.json "$slice/"
timeout 200 $C/strata convert --model "$slice" --out "$slice-int4" --experts int4 --scales f32 >>"$OUT/side.log" 2>&1
timeout 300 bash $C/llamacpp-peer.sh convert $C/llama-src.tar.xz "$slice" /tmp/slice-cpu.gguf bf16 >>"$OUT/side.log" 2>&1 ||
  echo "convert to GGUF failed" | tee -a "$OUT/side.log"
wait
since "built and converted"
for w in bf16 int4-g64; do
  d=$slice; [ $w = int4-g64 ] && d=$slice-int4
  taskset -c "$cores" timeout 200 $C/strata-bench decode --model "$d" --threads "$T" --prompt-tokens 64 --decode-tokens 32 \
    --warmup --usage off --mtp off --json 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','weights':'$w','threads':$T,'decode_tps':r['decode_tokens_per_s'],
  'prefill_tps':r['prefill_tokens_per_s'],'bytes_per_token':r['decode_bytes_read_per_token']}))" >>"$res" ||
    echo "strata $w failed" | tee -a "$OUT/side.log"
done
llama() {  # gguf label
  taskset -c "$cores" timeout 200 $L/bin/llama-bench -m "$1" -t "$T" -ngl 0 -p 64 -n 32 -r 2 -o json 2>>"$OUT/side.log" |
    python3 -c "
import json,sys
for r in json.load(sys.stdin):
    kind = 'prefill_tps' if r['n_prompt'] else 'decode_tps'
    print(json.dumps({'engine':'llama.cpp','weights':'$2','threads':$T,kind:r['avg_ts'],'stddev':r['stddev_ts'],'model_bytes':r['model_size']}))" \
    >>"$res" || echo "llama-bench $2 failed" | tee -a "$OUT/side.log"
}
if [ -x $L/bin/llama-bench ] && [ -f /tmp/slice-cpu.gguf ]; then
  llama /tmp/slice-cpu.gguf bf16
  timeout 120 $L/bin/llama-quantize /tmp/slice-cpu.gguf /tmp/slice-cpu-q4_0.gguf Q4_0 >>"$OUT/side.log" 2>&1 &&
    llama /tmp/slice-cpu-q4_0.gguf q4_0
fi
since "done"
cat "$res"
tail -3 "$OUT/side.log"

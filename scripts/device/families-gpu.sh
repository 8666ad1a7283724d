#!/usr/bin/env bash
# On the GPU machine, in one go (issue 14's GPU figures, and the CUDA tests after Gemma 4
# came to the CUDA backend): the CUDA test suite, decode/prefill throughput of the
# glm4_moe and Gemma 4 parity fixtures on CUDA and on the host's CPU, then the slice-sized
# checkpoints (scripts/make_slice_checkpoint.py: GLM-4.5-Air and Gemma 4 26B-A4B widths,
# random bf16 weights, generated there) on CUDA next to transformers on the same GPU, and
# strata-tiny's serving engine on CUDA with and without MTP drafts. Run from the
# repository root.
#
# Needs, in .devcarry/ (built here: the GPU machine has no Rust toolchain), as
# scripts/device/gpu-check.sh: strata.xz, cuda-tests.xz, bench_transformers_gpu.py.
# SKIP_TESTS=1 skips the test suite; SKIP_TESTS_MATCHING names tests to skip (the device
# tool's 64 MiB limit can leave fixtures behind); FIXTURES lists the fixtures to time
# (default: all four); SLICES=0 and SERVE=0 skip those parts.
# Writes under $OUT: machine.txt, tests.log, families.jsonl (one JSON object per
# measurement), side.log, profile-*.txt.
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/families.jsonl"
: >"$res"
{ nvidia-smi; date -u; nproc; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; } >"$OUT/machine.txt" 2>&1
head -12 "$OUT/machine.txt"

[ -z "${SKIP_TESTS:-}" ] && cuda_tests "^test |parity ok|test result|panicked|FAILED|STALL"

# bench decode -> one JSON line: engine, model, device, P, D, rep, decode/prefill tok/s, bytes.
bench() {  # model-dir label device prompt decode reps [extra args]
  local dir=$1 label=$2 dev=$3 p=$4 d=$5 reps=$6
  shift 6
  for rep in $(seq 1 "$reps"); do
    timeout 180 $C/strata-bench decode --model "$dir" --device "$dev" --prompt-tokens "$p" --decode-tokens "$d" --warmup --json "$@" \
      2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'engine':'strata','model':'$label','device':r['device'],'prompt':$p,'decode':$d,'rep':$rep,
  'decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s'],
  'bytes_per_token':r.get('decode_bytes_read_per_token'),'load_s':r.get('load_seconds')}))" >>"$res" ||
      echo "bench $label $dev failed" | tee -a "$OUT/side.log"
  done
}

since "fixtures"
for fx in ${FIXTURES:-glm4_moe/bf16-mha glm4_moe/gqa-bias gemma4/dense-ple gemma4/moe}; do
  bench "fixtures/$fx" "$fx" cuda 64 128 2
  bench "fixtures/$fx" "$fx" cpu 64 128 1 --threads 16
done

since "slices"
mk() {  # family dir
  timeout 240 python3 scripts/make_slice_checkpoint.py "$1" "$2" >>"$OUT/side.log" 2>&1 ||
    { echo "slice $1 failed"; tail -5 "$OUT/side.log"; return 1; }
}
peer() {  # dir label experts
  timeout 200 python3 $C/bench_transformers_gpu.py "$1" --dtype bfloat16 --prompt-tokens 64 --decode-tokens 64 --reps 2 \
    --experts "$3" 2>>"$OUT/side.log" | python3 -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); r['model']='$2'; print(json.dumps(r))" >>"$res" || echo "transformers $2 failed" | tee -a "$OUT/side.log"
}
[ "${SLICES:-1}" = 1 ] && for fam in glm4_moe:glm45air-slice gemma4:gemma4-26b-slice; do
  f=${fam%%:*} label=${fam#*:} dir=/tmp/${fam#*:}
  mk "$f" "$dir" || continue
  since "$label written ($(du -sh "$dir" | cut -f1))"
  bench "$dir" "$label" cuda 64 64 2
  timeout 120 $C/strata-bench decode --model "$dir" --device cuda --prompt-tokens 64 --decode-tokens 64 --profile \
    >"$OUT/profile-$label.txt" 2>&1
  since "$label strata done"
  peer "$dir" "$label" grouped_mm
  since "$label transformers done"
  rm -rf "$dir"
done

since "serving on CUDA (strata-tiny)"
[ "${SERVE:-1}" = 1 ] && for cfg in "1 0" "1 3" "8 0" "8 3"; do
  set -- $cfg
  timeout 120 $C/strata-bench serve --model models/strata-tiny --device cuda --requests $1 --prompt-tokens 32 --decode-tokens 128 \
    --draft-tokens $2 --warmup --json 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin); r['bench']='serve'; print(json.dumps(r))" >>"$res" ||
    echo "bench serve $cfg failed" | tee -a "$OUT/side.log"
done
git checkout -q -- models/strata-tiny/.coli_usage 2>/dev/null || true
since "done"
cat "$res"

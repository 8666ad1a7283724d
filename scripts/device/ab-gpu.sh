#!/usr/bin/env bash
# On the GPU machine: two builds side by side, alternating, on the same weights: decode of
# strata-tiny (CUDA, and the host CPU) and of the GLM-5-shaped slice (bf16 and int4-g64
# experts, vocabulary 16384), `bench decode --json`, REPS rounds. A is the command that
# runs a build's benchmarks (default "$C/strata-before bench", a build from before a
# change, carried as .devcarry/strata-before.xz), B the other (default "$C/strata-bench").
# Writes $OUT/ab.jsonl and prints a table of medians and B/A.
set -uo pipefail
. "$(dirname "$0")/env.sh"
[ -f $C/strata-before.xz ] && [ ! -f $C/strata-before ] && xz -d -k $C/strata-before.xz && chmod +x $C/strata-before
if [ ! -s models/strata-tiny/model.safetensors ] && [ -f $C/tiny-model.safetensors.xz ]; then
  xz -d -T4 -c $C/tiny-model.safetensors.xz >models/strata-tiny/model.safetensors
fi
A=${A:-$C/strata-before bench}
B=${B:-$C/strata-bench}
res="$OUT/ab.jsonl"
: >"$res"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
since "slices"
glm5_slice /tmp/slice48
one() {  # label build model device prompt decode
  local cmd=$1 label=$2 model=$3 dev=$4 p=$5 d=$6
  timeout 120 $cmd decode --model "$model" --device "$dev" --prompt-tokens "$p" --decode-tokens "$d" --warmup --json \
    --usage off --mtp off 2>>"$OUT/side.log" | python3 -c "
import json,sys; r=json.load(sys.stdin)
print(json.dumps({'build':'$label','model':'$model','device':'$dev','decode_tps':r['decode_tokens_per_s'],'prefill_tps':r['prefill_tokens_per_s']}))" >>"$res" ||
    echo "$label $model $dev failed" | tee -a "$OUT/side.log"
}
for rep in $(seq 1 ${REPS:-3}); do
  for build in A B; do
    cmd=$A
    [ $build = B ] && cmd=$B
    one "$cmd" $build models/strata-tiny cuda 64 128
    one "$cmd" $build /tmp/slice48 cuda 64 64
    one "$cmd" $build /tmp/slice48-int4 cuda 64 64
    one "$cmd" $build models/strata-tiny cpu 64 128
  done
done
since "done"
python3 - "$res" <<'PY'
import json, sys, statistics, collections
g = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l)
    g[(r['model'], r['device'], r['build'])].append((r['decode_tps'], r['prefill_tps']))
print("| model | device | A decode | B decode | B/A | A prefill | B prefill |")
print("|---|---|---|---|---|---|---|")
for (m, dev) in sorted({(k[0], k[1]) for k in g}):
    a, b = g.get((m, dev, 'A'), []), g.get((m, dev, 'B'), [])
    if not a or not b:
        continue
    ad, bd = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
    ap, bp = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
    print(f"| {m} | {dev} | {ad:.1f} | {bd:.1f} | {bd / ad:.3f} | {ap:.0f} | {bp:.0f} |")
PY

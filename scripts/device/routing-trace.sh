#!/usr/bin/env bash
# On the GPU machine: routing traces from a model trained here at GLM-5's routing shape
# (256 routed experts a layer, top-8; strata-tiny's 32 / top-4 otherwise), for the
# residency replays that the full-model extrapolation rests on (docs/performance.md).
# 1. trains it (training/train_tiny.py, BUDGET_S seconds, EXPERTS / TOPK / MOE_INTER);
# 2. merges the weights into an HF directory with strata-tiny's tokenizer;
# 3. with strata, samples PROMPTS (one a text category, MAX_TOKENS each, MTP off) with
#    --trace, and once with --pilot measure under a budget (next-layer prediction recall).
# 4. TIERS=1: generates on the GPU with the experts in two tiers sized as full GLM-5.2's
#    on one H200 (GPU slab 26.7% of them, host tier 27%, the rest read from disk), the host
#    tier exclusive of the GPU's: the engine's own hit rates on trained routing ($OUT/tiers-<mode>-<category>.json, --stats-json).
# TESTS=1 runs the CUDA suite beside the training (the GPU has room for both). QUALITY=1
# (with TIERS=1) adds held-out perplexity, exact and approximate (see the end).
# Needs in .devcarry: strata(.xz), cuda-tests(.xz) for TESTS=1, and route/ (the tokenised
# corpus: training/corpus.py + training/tokenizer.py's tok/ folder, and strata-tiny's
# tokenizer.json and tokenizer_config.json). Writes $OUT/train.log, $OUT/metrics.json,
# $OUT/traces.tar.xz (trace-<category>.txt), $OUT/pilot.json, $OUT/route.log.
set -uo pipefail
STALL_S=60
. "$(dirname "$0")/env.sh"
R=$C/route
RUN=/tmp/route-run
MODEL=/tmp/route-model
since "train (${BUDGET_S:-210} s budget)"
python3 training/train_tiny.py --data "$R/tok" --out "$RUN" --tokenizer "$R/tokenizer.json" \
  --budget-s "${BUDGET_S:-210}" --experts "${EXPERTS:-256}" --top-k "${TOPK:-8}" --moe-inter "${MOE_INTER:-32}" \
  >"$OUT/train.log" 2>&1 &
train=$!
[ "${TESTS:-1}" = 1 ] && cuda_tests
wait $train || { echo "training failed:"; tail -20 "$OUT/train.log"; exit 1; }
grep -E "^params|^trained|routing JSD|ppl" "$OUT/train.log"
since "merge"
mkdir -p "$MODEL"
python3 -c "import sys; sys.path.insert(0, 'training'); import finalize; finalize.merge('$RUN', '$MODEL')" ||
  { echo "merge failed"; exit 1; }
cp "$R/tokenizer.json" "$R/tokenizer_config.json" "$MODEL/"
cp "$RUN/metrics.json" "$OUT/"
# One prompt a text category (those of train_tiny's samples, and the river-town prose of
# the earlier strata-tiny trace).
PROMPTS=(
  "fiction|The history of the river town begins with"
  "bible|In the beginning God created the heaven and the earth. And the earth was without form"
  "python|def read_config(path):"
  "dictionary|Lantern \\Lan\"tern\\, n."
  "jargon|hacker n. [originally, someone who makes furniture with an axe]"
  "press|The city council voted on Tuesday to"
)
mkdir -p /tmp/traces
for p in "${PROMPTS[@]}"; do
  cat=${p%%|*}
  since "trace $cat"
  timeout 120 $C/strata generate --model "$MODEL" --prompt "${p#*|}" --max-tokens "${MAX_TOKENS:-600}" --context 1024 \
    --temperature 0.8 --top-p 0.95 --seed 3 --usage off --mtp off --trace "/tmp/traces/trace-$cat.txt" \
    >>"$OUT/route.log" 2>&1 || echo "trace $cat failed (see route.log)"
done
tar -C /tmp -cJf "$OUT/traces.tar.xz" traces
since "pilot"
timeout 120 $C/strata generate --model "$MODEL" --prompt "${PROMPTS[1]#*|}" --max-tokens 300 --context 1024 \
  --temperature 0.8 --top-p 0.95 --seed 3 --usage off --mtp off --budget "${PILOT_BUDGET:-96MiB}" --pilot measure \
  --stats --stats-json "$OUT/pilot.json" >>"$OUT/route.log" 2>&1 || echo "pilot run failed (see route.log)"
grep -E "^pilot|^experts|^slots" "$OUT/route.log"
wc -l /tmp/traces/*.txt
if [ "${TIERS:-1}" = 1 ]; then
  since "tiers"
  common=(--working-slots 8 --context 1024 --mtp off)
  # (Any --budget: the host plan's fixed items come with it.)
  read -r gb hb <<<"$($C/strata fit --model "$MODEL" --device cuda "${common[@]}" --budget 64GiB --json 2>>"$OUT/route.log" | python3 -c "
import json, sys; j = json.load(sys.stdin); g = j['gpu']['plan']['input']; h = j['host']['plan']['input']
experts = g['sparse_layers'] * ${EXPERTS:-256}
print(g['fixed_bytes'] + round(0.267 * experts) * g['slot_bytes'], h['fixed_bytes'] + round(0.270 * experts) * h['slot_bytes'])")"
  echo "GPU budget $gb, host budget $hb" | tee -a "$OUT/route.log"
  # TIER_MODES: exclusive (the host tier), optionally -lru (--eviction lru; the
  # default is lfru), -global (--eviction-scope global: victims from any layer), -skipR
  # (approximate decode, --skip-misses-from-rank R), then -prefetch (--pilot prefetch: next-layer predictions read into the
  # host tier while the current layer computes) or -prefetchN (only the first N ranks of
  # each prediction, --pilot-ranks N).
  for mode in ${TIER_MODES:-exclusive}; do
    pilot=(--pilot off)
    eviction=()
    [[ $mode == *-lru* ]] && eviction=(--eviction lru)
    [[ $mode == *-global* ]] && eviction+=(--eviction-scope global)
    [[ $mode =~ -skip([0-9]+) ]] && eviction+=(--skip-misses-from-rank "${BASH_REMATCH[1]}")
    [[ $mode == *-prefetch ]] && pilot=(--pilot prefetch)
    [[ $mode =~ -prefetch([1-9])$ ]] && pilot=(--pilot prefetch --pilot-ranks "${BASH_REMATCH[1]}")
    for p in "${PROMPTS[@]:0:3}"; do
      cat=${p%%|*}
      timeout 120 $C/strata generate --model "$MODEL" --device cuda --prompt "${p#*|}" \
        --max-tokens "${MAX_TOKENS:-600}" --temperature 0.8 --top-p 0.95 --seed 3 --usage off "${common[@]}" \
        --gpu-budget "$gb" --budget "$hb" "${pilot[@]}" "${eviction[@]}" --stats-json "$OUT/tiers-$mode-$cat.json" >>"$OUT/route.log" 2>&1 ||
        echo "tiers $mode $cat failed (see route.log)"
      python3 -c "
import json; r = json.load(open('$OUT/tiers-$mode-$cat.json')); e = r['experts']; t = e['device_tier']['traffic']
d = e['turn']['demand']; n = t['hits'] + t['misses']; p = e.get('pilot') or {}
print('$mode $cat: GPU hits %.1f%%, host hits %.1f%%, disk %.1f%%, skipped %.1f%% of %d uses; %.1f tok/s; kept %d, copied down %d; '
  'wait %.1f ms; prefetches %s, used %s' % (
  100 * t['hits'] / n, 100 * d['hits'] / n, 100 * d['misses'] / n, 100 * d.get('skipped', 0) / n, n, r['decode_tokens_per_s'],
  t['demotions_kept'], t['demotions_copied'], 1e3 * d['foreground_wait']['total_s'], p.get('prefetches'),
  p.get('prefetch_hits')))" 2>&1 | tail -1
    done
  done
fi
# QUALITY=1: held-out perplexity ($R/heldout/<category>.txt, written by
# training/heldout_text.py) a token a forward (--forward-rows 1, as decode runs) through the
# same tiers, exact and with each rank of SKIP_RANKS left out on disk misses.
if [ "${QUALITY:-0}" = 1 ] && [ "${TIERS:-1}" = 1 ]; then
  since "quality"
  for cat in fiction bible python; do
    for r in "" ${SKIP_RANKS:-7 6}; do
      skip=()
      [ -n "$r" ] && skip=(--skip-misses-from-rank "$r")
      timeout 200 $C/strata perplexity --model "$MODEL" --device cuda --text "$R/heldout/$cat.txt" --forward-rows 1 \
        --limit-tokens "${PPL_TOKENS:-2048}" --context 512 --stride 512 --usage off --mtp off --working-slots 8 \
        --gpu-budget "$gb" --budget "$hb" "${skip[@]}" --json >"$OUT/ppl-$cat-${r:-exact}.json" 2>>"$OUT/route.log" &&
        python3 -c "import json; r = json.load(open('$OUT/ppl-$cat-${r:-exact}.json')); print('perplexity $cat skip=${r:-off}: %.4f over %d tokens (%.1f s)' % (r['perplexity'], r['scored'], r['seconds']))" ||
        echo "perplexity $cat ${r:-exact} failed (see route.log)"
    done
  done
fi
since "done"

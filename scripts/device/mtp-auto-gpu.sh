#!/usr/bin/env bash
# On the GPU machine: is `--mtp auto` (the default) ever slower than `--mtp off` on CUDA?
# strata-tiny, REPS rounds alternating auto/off: `strata generate` of 200 tokens (greedy
# and T=0.8), `bench decode` (64 + 256 tokens), and `bench serve` at 1, 4 and 16 requests
# (greedy and sampled; auto = the default draft length, off = --draft-tokens 0).
# Starts from no kept speculation rates (models/strata-tiny/.strata/speculation.json is
# removed), so the first auto run of each case measures both sides and later ones start
# from what it kept. Writes $OUT/mtp-auto.jsonl; prints medians, auto/off per case, and the
# first round's auto/off (the run that had to measure).
set -uo pipefail
. "$(dirname "$0")/env.sh"
if [ ! -s models/strata-tiny/model.safetensors ] && [ -f $C/tiny-model.safetensors.xz ]; then
  xz -d -T4 -c $C/tiny-model.safetensors.xz >models/strata-tiny/model.safetensors
fi
res="$OUT/mtp-auto.jsonl"
: >"$res"
rm -f models/strata-tiny/.strata/speculation.json
M=models/strata-tiny
rec() { # case mode tok/s
  echo "{\"case\":\"$1\",\"mode\":\"$2\",\"tps\":${3:-null}}" >>"$res"
}
gen() { # case mode temperature
  local mtp=$2
  timeout 120 $C/strata generate --model $M --device cuda --prompt "The history of the city begins" \
    --max-tokens 200 --temperature "$3" --seed 7 --mtp "$mtp" --stats-json "$OUT/g.json" \
    >/dev/null 2>>"$OUT/side.log"
  rec "$1" "$2" "$(python3 -c "import json; print(json.load(open('$OUT/g.json'))['decode_tokens_per_s'])" 2>/dev/null)"
}
dec() { # case mode
  rec "$1" "$2" "$(timeout 120 $C/strata-bench decode --model $M --device cuda --warmup --json --usage off \
    --prompt-tokens 64 --decode-tokens 256 --mtp "$2" 2>>"$OUT/side.log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])')"
}
srv() { # case mode requests temperature
  local d=()
  [ "$2" = off ] && d=(--draft-tokens 0)
  timeout 120 $C/strata-bench serve --model $M --device cuda --warmup --json --usage off \
    --requests "$3" --prompt-tokens 32 --decode-tokens 128 --temperature "$4" "${d[@]}" 2>>"$OUT/side.log" \
    >"$OUT/s.json"
  echo "{\"case\":\"$1\",\"mode\":\"$2\",\"report\":$(cat "$OUT/s.json")}" >>"$OUT/serve-reports.jsonl"
  rec "$1" "$2" "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens_per_s"])' "$OUT/s.json")"
}
since "start"
# SERVE_ONLY=1 runs only the serve cases.
for rep in $(seq 1 "${REPS:-3}"); do
  for mode in auto off; do
    if [ -z "${SERVE_ONLY:-}" ]; then
      gen gen-greedy $mode 0
      gen gen-t0.8 $mode 0.8
      dec decode $mode
    fi
    for n in 1 4 16; do
      srv serve-$n-greedy $mode $n 0
      srv serve-$n-t0.8 $mode $n 0.8
    done
  done
done
since "done"
cp models/strata-tiny/.strata/speculation.json "$OUT/" 2>/dev/null
python3 - "$res" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cases = list(dict.fromkeys(r["case"] for r in rows))
print(f"{'case':18} {'auto tok/s':>10} {'off tok/s':>10} {'auto/off':>8} {'first':>6}")
for c in cases:
    med = {}
    for m in ("auto", "off"):
        v = [r["tps"] for r in rows if r["case"] == c and r["mode"] == m and r["tps"] is not None]
        med[m] = statistics.median(v) if v else None
    ratio = med["auto"] / med["off"] if med["auto"] and med["off"] else None
    first = [next((r["tps"] for r in rows if r["case"] == c and r["mode"] == m), None) for m in ("auto", "off")]
    first = round(first[0] / first[1], 3) if all(first) else None
    fmt = lambda x: f"{x:10.0f}" if x else f"{'-':>10}"
    print(f"{c:18} {fmt(med['auto'])} {fmt(med['off'])} {ratio if ratio is None else round(ratio, 3)!s:>8} {first!s:>6}")
PY

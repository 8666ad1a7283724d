#!/usr/bin/env bash
# On the GPU machine, in one go (issue 9, the expert tiers): the CUDA test suite (the
# tier tests among them), the pinned host -> GPU copy rate (PyTorch), then a GLM-5-shaped
# slice (4 layers: 1 dense + 3 MoE of 48 experts, written as an expert container) decoded
# with every expert in GPU slots, with the GPU slab holding ~30% of the experts and the
# rest in the host tier, and with the host tier short too (the container on disk engaged).
# Run from the repository root.
#
# Needs, in .devcarry/ (built here): strata.xz and cuda-tests.xz (see gpu-check.sh).
# TESTS=0 skips the test suite; SKIP_TESTS_MATCHING names tests to skip (the device tool's 64 MiB limit can leave
# fixtures behind); ENCODINGS (default "int4-g64 bf16") the slices' expert encodings; MODES
# (default "resident gpu30 gpu30-host40") the runs;
# a suffix -pagecache reads the misses through the (warmed) page cache, -prefetch reads
# PILOT's next-layer predictions ahead (--pilot prefetch), -prefetchN only the first N
# ranks of each (--pilot-ranks N), -lru evicts by LRU (--eviction lru; lfru is the default),
# -global takes victims from any layer (--eviction-scope global), -skipR is approximate
# decode (--skip-misses-from-rank R): e.g. gpu30-host40-skip6-lru-pagecache-prefetch2.
# Writes under $OUT: machine.txt, tests.log, tiers.jsonl (one JSON object per
# measurement), side.log.
set -uo pipefail
. "$(dirname "$0")/env.sh"
S=$C/strata
res="$OUT/tiers.jsonl"
: >"$res"
{ nvidia-smi; date -u; nproc; free -g; df -h /tmp; } >"$OUT/machine.txt" 2>&1

[ "${TESTS:-1}" = 1 ] && cuda_tests "^test |parity ok|equal;|in use by the model|test result|panicked|FAILED|STALL"

since "pinned host -> GPU copy rate"
python3 - >>"$res" 2>>"$OUT/side.log" <<'EOF'
import json, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
for _ in range(2):
    y.copy_(x, non_blocking=True)
torch.cuda.synchronize()
best = 0.0
for _ in range(5):
    t = time.perf_counter(); y.copy_(x, non_blocking=True); torch.cuda.synchronize()
    best = max(best, (1 << 30) / (time.perf_counter() - t) / 1e9)
print(json.dumps({"measure": "pinned_h2d_gb_per_s", "value": best, "bytes": 1 << 30}))
EOF

for enc in ${ENCODINGS:-int4-g64 bf16}; do
  dir=/tmp/slice-$enc
  since "slice $enc"
  timeout 240 $C/strata-bench synth --out "$dir" --preset glm5 --layers 4 --dense-layers 1 --experts 48 --container "$enc" \
    >>"$OUT/side.log" 2>&1 || { echo "synth $enc failed"; tail -3 "$OUT/side.log"; continue; }
  since "written ($(du -sh "$dir" | cut -f1))"
  common=(--working-slots 8 --context 512 --mtp off --usage off --prompt-tokens 64 --decode-tokens 64 --warmup --json)
  fit=$($S fit --model "$dir" --device cuda --working-slots 8 --context 512 --mtp off --json 2>>"$OUT/side.log")
  read -r g30 h40 slot <<<"$(echo "$fit" | python3 -c "
import json,sys; j=json.load(sys.stdin); p=j['gpu']['plan']['input']; h=j['host']['plan']['input']
slot=p['slot_bytes']; experts=3*48
per=(int(0.3*experts)-8)//3            # GPU: 8 working + per-layer slots ~ 30% of the experts
host=(int(0.4*experts)-8)//3           # host tier: ~40% of the experts, beside the host plan's fixed items
print(p['fixed_bytes']+(8+3*per)*slot, h['fixed_bytes']+(8+3*host)*slot, slot)")"
  echo "gpu budget (30%) $g30, host budget (40%) $h40, slot $slot" | tee -a "$OUT/side.log"
  for mode in ${MODES:-resident gpu30 gpu30-host40}; do
    tier=()
    base=${mode%%-skip*}
    base=${base%%-lru*}
    base=${base%%-global*}
    base=${base%%-pagecache*}
    base=${base%%-prefetch*}
    case $base in
    resident) extra=() ;;
    gpu30) extra=(--gpu-budget "$g30") ;;
    gpu30-host40) extra=(--gpu-budget "$g30" --budget "$h40" --floor) ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    # -pagecache: misses read through the page cache (warmed first), a disk many times
    # this machine's; -prefetch[N]: PILOT reads the next layer's predictions ahead.
    if [[ $mode == *-pagecache* ]]; then
      extra+=(--page-cache)
      cat "$dir"/experts/* >/dev/null
    fi
    [[ $mode == *-lru* ]] && extra+=(--eviction lru)
    [[ $mode == *-global* ]] && extra+=(--eviction-scope global)
    [[ $mode =~ -skip([0-9]+) ]] && extra+=(--skip-misses-from-rank "${BASH_REMATCH[1]}")
    [[ $mode =~ -prefetch([1-9]?)$ ]] && extra+=(--pilot prefetch) && [ -n "${BASH_REMATCH[1]}" ] &&
      extra+=(--pilot-ranks "${BASH_REMATCH[1]}")
    for rep in 1 2; do
      env "${tier[@]}" timeout 200 $C/strata-bench decode --model "$dir" --device cuda "${common[@]}" "${extra[@]}" 2>>"$OUT/side.log" |
        python3 -c "
import json,sys; r=json.load(sys.stdin); r['slice']='$enc'; r['mode']='$mode'; r['rep']=$rep
e=r.pop('experts', None) or {}; p=r.pop('pilot', None) or {}
r['skipped']=(e.get('demand') or {}).get('skipped')
r.update({'pilot_'+k: p[k] for k in ('recall', 'prefetches', 'prefetch_hits') if k in p}); print(json.dumps(r))" >>"$res" || echo "bench $enc $mode failed" | tee -a "$OUT/side.log"
      [[ "$mode" = gpu30-host40* ]] && break
    done
  done
  rm -rf "$dir"
done
since "done"
python3 - "$res" <<'EOF'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if "mode" in r:
        print(r["slice"], r["mode"], "decode %.1f tok/s" % r["decode_tokens_per_s"], "prefill %.1f" % r["prefill_tokens_per_s"],
              "gpu hit", r.get("gpu_tier_hit_rate"), "copy/token", r.get("gpu_tier_copy_bytes_per_token"),
              "copied down/token", r.get("gpu_tier_demotion_bytes_per_token"),
              "host hit", r.get("expert_hit_rate"), "read/token", r.get("decode_expert_read_bytes_per_token"),
              "bytes/token", r.get("decode_bytes_read_per_token"), "skipped", r.get("skipped"),
              "read service GB/s", r.get("expert_read_gb_per_s_in_service"),
              *(["pilot recall", r["pilot_recall"], "prefetches", r.get("pilot_prefetches"), "used", r.get("pilot_prefetch_hits")]
                if "pilot_recall" in r else []))
    else:
        print(r)
    if r.get("budget_bytes"):
        ok = r["peak_rss_bytes"] <= r["budget_bytes"]
        print("  host RSS peak %d %s --budget %d" % (r["peak_rss_bytes"], "<=" if ok else "EXCEEDS", r["budget_bytes"]))
EOF

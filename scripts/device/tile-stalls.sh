#!/usr/bin/env bash
# On the GPU machine: why the prompt tiles (k_experts_up / k_experts_down, kernels/
# expert_tiles.cu) read quantized experts slowly when an expert has few rows. Nsight
# Compute profiles the expert launches of the bandwidth bench (decode, then prompts of 1,
# 2, 4 and 16 rows an expert; every encoding) with the warp-state, scheduler, occupancy
# and memory sections, and lists per kernel launch its duration, DRAM read rate and the
# top warp stall reasons. KERNELS (regex, default "k_experts_(up|down)$") picks kernels;
# SKIP and COUNT the matching launches profiled: the bench runs bf16, int8, int4, FP8, each
# with prompts of 1, 2, 4 and 16 rows an expert, 23 launches of both kernels each (46
# matching), so SKIP=368 COUNT=184 (the defaults) are int4's. DECODE=DIR profiles
# `strata-bench decode` of the model at DIR instead (8 prompt and 4 decode tokens, graphs
# off), e.g. KERNELS="k_experts_(up|down)_row$" SKIP=0 COUNT=16 DECODE=/tmp/slice48-g64-e4m3
# for the one-row expert kernels of its decode tokens (after TESTS=0 scales-gpu.sh).
# Writes $OUT/tile-stalls.csv (raw) and $OUT/tile-stalls.txt.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
# Warps stalled per issued instruction, by reason (what WarpStateStats charts).
stalls=$(for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle lg_throttle wait \
  not_selected selected dispatch_stall no_instruction imc_miss drain membar branch_resolving tex_throttle; do
  printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $r; done)
stalls=${stalls%,}
timeout 400 "$NCU" --clock-control none --csv --kernel-name "regex:${KERNELS:-k_experts_(up|down)$}" \
  --launch-skip "${SKIP:-368}" --launch-count "${COUNT:-184}" --section WarpStateStats --section SchedulerStats --section Occupancy \
  --metrics "gpu__time_duration.sum,dram__bytes_read.sum,$stalls" \
  $(if [ -n "${DECODE:-}" ]; then
    echo "$C/strata-bench decode --model $DECODE --device cuda --prompt-tokens 8 --decode-tokens 4 --cuda-graphs off --usage off --mtp off"
  else
    echo "$C/cuda-tests --ignored --nocapture --test-threads=1 cuda_kernel_bandwidth"
  fi) >"$OUT/tile-stalls.csv" 2>>"$OUT/side.log"
python3 - "$OUT/tile-stalls.csv" >"$OUT/tile-stalls.txt" <<'PY'
import csv, sys, collections
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
k = collections.OrderedDict()
for r in csv.DictReader(rows):
    e = k.setdefault(r["ID"], {"name": r["Kernel Name"].split("(")[0], "m": {}})
    try:
        e["m"][r["Metric Name"]] = (float(r["Metric Value"].replace(",", "")), r["Metric Unit"])
    except ValueError:
        pass
for i, e in k.items():
    m = e["m"]
    t = m.get("gpu__time_duration.sum", (0, ""))
    b = m.get("dram__bytes_read.sum", (0, ""))
    us = t[0] * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(t[1], 1.0)
    mb = b[0] * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(b[1], 1.0)
    stalls = sorted(((v[0], n) for n, v in m.items() if "issue_stalled_" in n), reverse=True)[:5]
    name = lambda n: n.split("issue_stalled_")[1].split("_per_issue")[0]
    print(f"{i:>4} {e['name']:<16} {us:9.1f} us {mb:8.1f} MB {mb / max(us, 1e-9):7.0f} GB/s  "
          + "; ".join(f"{name(n)} {v:.2f}" for v, n in stalls))
PY
cat "$OUT/tile-stalls.txt"

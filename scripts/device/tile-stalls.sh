#!/usr/bin/env bash
# On the GPU machine: why the prompt tiles (k_experts_up / k_experts_down, kernels/
# expert_tiles.cu) read quantized experts slowly when an expert has few rows. Nsight
# Compute profiles the expert launches of the bandwidth bench (decode, then prompts of 1,
# 2, 4 and 16 rows an expert; every encoding) with the warp-state, scheduler, occupancy
# and memory sections, and lists per kernel launch its duration, DRAM read rate and the
# top warp stall reasons. KERNELS (regex, default "k_experts_(up|down)$") picks kernels;
# COUNT (default 48) caps the launches profiled.
# Writes $OUT/tile-stalls.csv (raw) and $OUT/tile-stalls.txt.
set -uo pipefail
. "$(dirname "$0")/env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 400 "$NCU" --clock-control none --csv --kernel-name "regex:${KERNELS:-k_experts_(up|down)$}" \
  --launch-count "${COUNT:-48}" --section WarpStateStats --section SchedulerStats --section Occupancy \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  $C/cuda-tests --ignored --nocapture --test-threads=1 cuda_kernel_bandwidth >"$OUT/tile-stalls.csv" 2>>"$OUT/side.log"
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
    us = t[0] * {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(t[1], 1.0)
    mb = b[0] * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}.get(b[1], 1.0)
    stalls = sorted(((v[0], n) for n, v in m.items() if "Stall" in n or "stall" in n), reverse=True)[:5]
    print(f"{i:>4} {e['name']:<16} {us:9.1f} us {mb:8.1f} MB {mb / max(us, 1e-9):7.0f} GB/s  "
          + "; ".join(f"{n.split('.')[-1] if '.' in n else n} {v:.2f}" for v, n in stalls))
PY
cat "$OUT/tile-stalls.txt"

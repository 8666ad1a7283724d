#!/usr/bin/env bash
# On the GPU machine: where a decode token's time goes, kernel by kernel. Nsight Compute
# times every kernel of a short decode of a GLM-5-shaped slice (bf16 experts, and int4
# experts from `strata convert`), launched one by one (`--cuda-graphs off`, so each
# kernel is its own launch), and reads the bytes each one read from HBM; the last decode
# token's kernels are listed with their share of the token and their read rate.
# Run from the repository root, with .devcarry/strata.xz (see gpu-check.sh).
# PREFILL=N: list the prompt of N tokens instead (its kernels, every chunk's forward: from
# the first embed to the first one-row embed).
# Writes under $OUT: kernels-bf16.txt, kernels-int4.txt (kernels-prefill-*.txt), side.log.
set -uo pipefail
. "$(dirname "$0")/env.sh"
S=$PWD/$C/strata
# KSLICE: an existing slice (and KSLICE-int4) to reuse; KT: which of bf16 and int4 to list.
slice=${KSLICE:-/tmp/slice-k}
glm5_slice "$slice" 16384 "${EXPERTS:-48}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
prompt=${PREFILL:-8}; decode=4; tag=""
[ -n "${PREFILL:-}" ] && { decode=2; tag=prefill-; }
for v in ${KT:-bf16 int4}; do
  d=$slice; [ $v = int4 ] && d=$slice-int4
  timeout 240 "$NCU" --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    $C/strata-bench decode --model "$d" --device cuda --prompt-tokens $prompt --decode-tokens $decode --cuda-graphs off --usage off \
    --mtp off >/tmp/ncu-$v.csv 2>>"$OUT/side.log"
  python3 - /tmp/ncu-$v.csv "${PREFILL:-}" >"$OUT/kernels-$tag$v.txt" <<'PY'
import csv, sys, collections
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
k = collections.OrderedDict()
for r in csv.DictReader(rows):
    e = k.setdefault(r["ID"], {"name": r["Kernel Name"].split("(")[0], "grid": r.get("Grid Size", ""), "m": {}})
    v = float(r["Metric Value"].replace(",", ""))
    unit = r["Metric Unit"]
    if r["Metric Name"] == "gpu__time_duration.sum":
        v *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1.0)
    else:
        v *= {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1.0)
    e["m"][r["Metric Name"]] = v
ks = list(k.values())
# The last token: from the last embed kernel on; with a prefill length, the first forward.
embeds = [i for i, e in enumerate(ks) if e["name"] == "k_embed"]
# A prompt's forwards (one a chunk) embed many rows, a decode step's one (grid "(1, ...").
first_decode = next(i for i in embeds if ks[i]["grid"].startswith("(1,"))
tok = ks[embeds[0]:first_decode] if sys.argv[2] else ks[embeds[-1]:]
tot_t = sum(e["m"]["gpu__time_duration.sum"] for e in tok)
tot_b = sum(e["m"]["dram__bytes_read.sum"] for e in tok)
what = f"the prompt's forwards ({sys.argv[2]} tokens)" if sys.argv[2] else "the last decode token"
print(f"{len(ks)} kernels profiled; {what}: {len(tok)} kernels, {tot_t:.1f} us, {tot_b/1e6:.1f} MB read, {tot_b/tot_t/1e3:.0f} GB/s")
print(f"{'kernel':<24} {'grid':<16} {'us':>8} {'share':>6} {'MB':>9} {'GB/s':>7}")
for e in tok:
    t, b = e["m"]["gpu__time_duration.sum"], e["m"]["dram__bytes_read.sum"]
    print(f"{e['name']:<24} {e['grid']:<16} {t:8.1f} {100*t/tot_t:5.1f}% {b/1e6:9.2f} {b/t/1e3:7.0f}")
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for e in tok:
    a = agg[e["name"]]; a[0] += 1; a[1] += e["m"]["gpu__time_duration.sum"]; a[2] += e["m"]["dram__bytes_read.sum"]
print("\nby kernel:")
for n, (c, t, b) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{n:<24} x{c:<3} {t:8.1f} us {100*t/tot_t:5.1f}% {b/1e6:9.2f} MB {b/t/1e3:7.0f} GB/s")
PY
  cat "$OUT/kernels-$tag$v.txt"
done

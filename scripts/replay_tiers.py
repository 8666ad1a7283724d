#!/usr/bin/env python3
"""Replay a routing trace through GPU + host expert tiers sized as full GLM-5.2 on one H200.

The tiers' capacities are fractions of the trace's experts (layers x experts a layer):
by default 26.7% in the GPU slab and 27.0% in the page-locked host tier, the figures of the
extrapolation in docs/performance.md (HBM and 128 GB of host RAM over 19,200 int4 experts).
Runs `strata replay` for each policy, with exclusive tiers (the engine's default: the host
keeps what the GPU evicts) and inclusive ones, and prints a markdown table of GPU hits, host
hits, disk reads and device -> host copies (all as fractions of the expert uses), plus the
one-tier bounds (mostly pinned, LFRU, Belady) at both tiers' capacity.

  python3 scripts/replay_tiers.py --strata target/release/strata --trace T [--trace T2 ...]

Several traces are replayed as one, each a segment (a turn) in the given order, as a
server taking those requests one after another would see them. A trace may be xz-compressed
(docs/traces/routing-256-experts-top8.trace.xz: the one docs/performance.md replays).
"""
import argparse
import json
import lzma
import os
import subprocess
import sys
import tempfile


def concat(paths, out):
    """v1 traces joined as consecutive segments, forwards renumbered."""
    out.write("# strata route trace v1: segment forward row layer experts...\n")
    off = 0
    layers, experts, top = set(), 0, 0
    for seg, path in enumerate(paths):
        last = -1
        opener = lzma.open if path.endswith(".xz") else open
        with opener(path, "rt") as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                fields = line.split()
                if any(":" in x for x in fields[4:]):
                    sys.exit(f"{path}: only strata's v1 traces are joined here (no id:gate fields)")
                fw = int(fields[1]) + off
                last = max(last, fw)
                ids = [int(x) for x in fields[4:]]
                layers.add(int(fields[3]))
                experts = max(experts, max(ids) + 1)
                top = max(top, len(ids))
                out.write(" ".join([str(seg), str(fw)] + fields[2:]) + "\n")
        if last < 0:
            sys.exit(f"{path}: no routing records")
        off = last + 1
    return len(layers), experts, top


def replay(strata, trace, args):
    r = subprocess.run([strata, "replay", "--trace", trace, "--json"] + [str(a) for a in args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"strata replay {' '.join(map(str, args))}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--gpu-frac", type=float, default=0.267)
    ap.add_argument("--host-frac", type=float, default=0.270)
    ap.add_argument("--experts", type=int, help="experts a layer (default: the largest id in the trace + 1)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as t:
        layers, seen, top = concat(a.trace, t)
    try:
        experts = a.experts or seen
        total = layers * experts
        gpu, host = round(total * a.gpu_frac), round(total * a.host_frac)
        # A working bank of one forward's decode misses at most (top-k), as the plans give.
        w = top
        rows = []

        def tiers(label, g_args, h_args):
            d = replay(a.strata, t.name, g_args + h_args)
            for kind, key in (("exclusive", "pinned_lru"), ("inclusive", "inclusive_pinned_lru")):
                tr = d["tiers"][key]
                rows.append({"policy": f"{label}, {kind}", "gpu_slots": tr["gpu_slots"],
                             "host_slots": tr["host_slots"], "gpu_hit": tr["gpu_hit_rate"],
                             "host_hit": tr["host_hit_rate"], "disk": tr["disk_rate"], "accesses": tr["accesses"],
                             "copied_down": tr["demotions_copied"] / max(tr["accesses"], 1)})

        per_g, per_h = (gpu - w) // layers, (host - w) // layers
        tiers("LRU in both tiers", ["--slots-per-layer", per_g, "--working", gpu - per_g * layers],
              ["--host-slots-per-layer", per_h, "--host-working", host - per_h * layers])
        pg, ph = (gpu - w) // 2, (host - w) // 2
        sg, sh = (gpu - w - pg) // layers, (host - w - ph) // layers
        tiers("about half of each tier pinned (most used), LRU for the rest",
              ["--slots-per-layer", sg, "--working", gpu - pg - sg * layers, "--pinned", pg],
              ["--host-slots-per-layer", sh, "--host-working", host - ph - sh * layers, "--host-pinned", ph])
        tiers("mostly pinned (one LRU slot a layer)",
              ["--slots-per-layer", 1, "--working", w, "--pinned", gpu - w - layers],
              ["--host-slots-per-layer", 1, "--host-working", w, "--host-pinned", host - w - layers])
        one = gpu + host
        d = replay(a.strata, t.name, ["--slots-per-layer", 1, "--working", w, "--pinned", one - w - layers])
        pin = next(p for p in d["policies"] if p["name"] == "pinned+LRU")
        rows.append({"policy": "one tier of both capacities, mostly pinned", "gpu_slots": one, "host_slots": 0,
                     "gpu_hit": pin["hit_rate"], "host_hit": 0.0, "disk": 1 - pin["hit_rate"],
                     "accesses": d["accesses"]})
        d = replay(a.strata, t.name, ["--slots-per-layer", (one - w) // layers, "--working", one - (one - w) // layers * layers])
        for name in ("LRU", "LFRU", "Belady"):
            p = next(p for p in d["policies"] if p["name"] == name)
            rows.append({"policy": f"one tier of both capacities, {name}", "gpu_slots": one, "host_slots": 0,
                         "gpu_hit": p["hit_rate"], "host_hit": 0.0, "disk": 1 - p["hit_rate"],
                         "accesses": d["accesses"]})
        summary = {"traces": a.trace, "layers": layers, "experts": experts, "top_k": top, "gpu_slots": gpu,
                   "host_slots": host, "accesses": rows[0]["accesses"], "rows": rows}
        if a.json:
            print(json.dumps(summary, indent=1))
            return
        print(f"{layers} MoE layers x {experts} experts, top-{top}; {rows[0]['accesses']} expert uses "
              f"(after each forward's union); GPU {gpu} slots ({a.gpu_frac:.1%}), host {host} ({a.host_frac:.1%})")
        print("| policy | GPU slots | host slots | GPU hits | host hits | disk | copied down |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            host_cell = f"{r['host_slots']}" if r["host_slots"] else "-"
            hh = f"{r['host_hit']:.1%}" if r["host_slots"] else "-"
            down = f"{r['copied_down']:.1%}" if "copied_down" in r else "-"
            print(f"| {r['policy']} | {r['gpu_slots']} | {host_cell} | {r['gpu_hit']:.1%} | {hh} | {r['disk']:.1%} "
                  f"| {down} |")
    finally:
        os.unlink(t.name)


if __name__ == "__main__":
    main()

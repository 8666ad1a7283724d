#!/usr/bin/env python3
"""Replay a routing trace through GPU + host expert tiers sized as full GLM-5.2 on one H200.

The tiers' capacities are fractions of the trace's experts (layers x experts a layer):
by default 26.7% in the GPU slab and 27.0% in the page-locked host tier, the figures of the
extrapolation in docs/performance.md (HBM and 128 GB of host RAM over 19,200 int4 experts).
Runs `strata replay` for each policy, with exclusive tiers (the engine's default: the host
keeps what the GPU evicts) and inclusive ones, LFRU eviction on the GPU (`--eviction lfru`), and prints a markdown table of GPU hits, host
hits, disk reads and device -> host copies (all as fractions of the expert uses), plus the
one-tier bounds (mostly pinned, LFRU, Belady) at both tiers' capacity.

  python3 scripts/replay_tiers.py --strata target/release/strata --trace T [--trace T2 ...]

Then it prices each two-tier row at full GLM-5.2's scale (docs/performance.md, "Full GLM-5.2
... extrapolation"): a token is `--layers` layers of `--compute-ms` resident compute in all,
and in each of its `--moe-layers` MoE layers the GPU misses of one of the replay's access
groups (one forward at one layer), drawn in the replay's proportions: each host hit a copy
of `--expert-mb` over the link (`--link-gbs`), each disk read that plus a read at
`--disk-gbs`. Three timings a layer, for h host hits and d disk reads:
- serial: compute + (h + d) copies + d reads;
- pipelined, as the engine runs a layer: its disk reads start once its routing is known,
  beside the hits' compute and the host hits' copies; the reads' copies follow them:
  compute + max(h copies, d reads) + d copies;
- overlapped (a bound: every read started early enough, e.g. by PILOT a layer ahead, and
  hidden): per token, the larger of all reads and all compute + copies.
With `--prefetch-share F --prefetch-waste W` (from the engine's `--pilot prefetch` telemetry:
F = prefetch hits / (prefetch hits + disk misses), W = unused prefetches / used ones) a
fourth timing: a share F of each layer's disk reads was read a layer ahead and is copied
up with the host hits, the rest as pipelined; the disk also reads the W wasted, and the
token takes at least all its reads:
  max(compute + max((h + F d) copies, (1 - F) d reads) + (1 - F) d copies, all reads).

With `--mtp-drafts K --mtp-acceptance P` it prices MTP speculative decoding instead of one
token a forward: each segment's run of one-row (decode) forwards is regrouped into verify
forwards of K + 1 rows (the last accepted token and K drafts), a draft accepted with
probability P while the ones before it were (seeded by `--mtp-seed`), so a round emits the
accepted drafts + 1 tokens and the next round starts after them. An accepted draft's row
routes as the trace's token there; a rejected one's as a token half the run away (a wrong
token's routing). Each verify forward is one access group (the union of its rows' experts),
and its price adds, to one token's, the union's extra experts read from HBM
(`--expert-hbm-gbs`) and K draft forwards of the MTP layer (`--draft-ms` each); every
figure is then per generated token. The MTP layer's own experts are taken as resident:
lower `--gpu-frac` by their share (256 / 19,200 = 1.3% at GLM-5.2's scale).

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


def mtp_regroup(src, out, drafts, acceptance, seed):
    """The joined trace `src` with each segment's runs of one-row forwards regrouped into
    MTP rounds (see the module comment), written to `out`; returns (rounds, tokens)."""
    import random
    rng = random.Random(seed)
    fws = {}  # (segment, forward) -> {row: [(layer, ids)]}, in file order
    with open(src) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            seg, fw, row, rest = line.split(maxsplit=3)
            fws.setdefault((int(seg), int(fw)), {}).setdefault(int(row), []).append(rest.strip())
    out.write("# strata route trace v1: segment forward row layer experts...\n")
    rounds = tokens = 0
    next_fw = 0
    run = []  # one-row forwards of the current run: [(segment, [layer records])]

    def emit(seg, rows):
        nonlocal next_fw
        for r, recs in enumerate(rows):
            for rec in recs:
                out.write(f"{seg} {next_fw} {r} {rec}\n")
        next_fw += 1

    def flush():
        nonlocal rounds, tokens
        n, i = len(run), 0
        while i < n:
            accepted = 0
            while accepted < drafts and rng.random() < acceptance:
                accepted += 1
            rows = []
            for j in range(i, min(i + drafts + 1, n)):
                # Row 0 is the token the round starts from; rows past the accepted
                # drafts carry a wrong token's routing.
                rows.append(run[j][1] if j - i <= accepted else run[(j + n // 2) % n][1])
            emit(run[i][0], rows)
            step = min(accepted + 1, n - i)
            rounds, tokens, i = rounds + 1, tokens + step, i + step
        run.clear()

    for (seg, _), rows in fws.items():
        if len(rows) == 1 and (not run or run[-1][0] == seg):
            run.append((seg, rows[0]))
            continue
        flush()
        if len(rows) == 1:
            run.append((seg, rows[0]))
        else:
            emit(seg, [rows[r] for r in sorted(rows)])
    flush()
    return rounds, tokens


# Extra `strata replay` arguments for every run (--eviction-scope, --skip-misses-from-rank).
EXTRA = []


def replay(strata, trace, args):
    r = subprocess.run([strata, "replay", "--trace", trace, "--json"] + [str(a) for a in args + EXTRA],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"strata replay {' '.join(map(str, args))}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def price(mix, a, accesses=0, top=0):
    """ms a token at full GLM-5.2's scale from a replay's layer mix ([host hits, disk reads,
    groups]); see the module comment. With MTP (a.mtp_drafts), a group is a verify forward
    of `accesses / groups` experts on average (of `top` a token), and the figures are per
    generated token (a.tokens_per_round)."""
    groups = sum(n for _, _, n in mix)
    if not groups:
        return {}
    copy = a.expert_mb / a.link_gbs  # ms: MB / (GB/s)
    read = a.expert_mb / a.disk_gbs
    tc = a.compute_ms / a.layers
    mean = lambda f: sum(n * f(h, d) for h, d, n in mix) / groups
    dense = (a.layers - a.moe_layers) * tc
    if a.mtp_drafts:
        dense += a.mtp_drafts * a.draft_ms
        tc_moe = tc + max(accesses / groups - top, 0) * a.expert_mb / a.expert_hbm_gbs
        out = price_layers(a, copy, read, tc_moe, dense, mean)
        return {k: v / a.tokens_per_round for k, v in out.items()}
    return price_layers(a, copy, read, tc, dense, mean)


def price_layers(a, copy, read, tc, dense, mean):
    """The timings of the module comment: `dense` the non-MoE layers' time, `tc` a MoE
    layer's compute."""
    reads = a.moe_layers * mean(lambda h, d: d * read)
    rest = a.moe_layers * mean(lambda h, d: tc + (h + d) * copy)
    out = {
        "serial_ms": dense + a.moe_layers * mean(lambda h, d: tc + (h + d) * copy + d * read),
        "pipelined_ms": dense + a.moe_layers * mean(lambda h, d: tc + max(h * copy, d * read) + d * copy),
        "overlapped_ms": max(reads, dense + rest),
    }
    f, w = a.prefetch_share, a.prefetch_waste
    if f > 0:
        late = dense + a.moe_layers * mean(lambda h, d: tc + max((h + f * d) * copy, (1 - f) * d * read)
                                            + (1 - f) * d * copy)
        out["prefetch_ms"] = max(late, reads * (1 + f * w))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--gpu-frac", type=float, default=0.267)
    ap.add_argument("--host-frac", type=float, default=0.270)
    ap.add_argument("--experts", type=int, help="experts a layer (default: the largest id in the trace + 1)")
    ap.add_argument("--lfru-half-life", type=float, default=32.0,
                    help="half-life of the LFRU rows' heat, forwards (the engine's --eviction lfru:H)")
    ap.add_argument("--skip-misses-from-rank", type=int, metavar="R",
                    help="replay approximate decode (the engine's --skip-misses-from-rank R)")
    ap.add_argument("--eviction-scope", choices=["layer", "global"], default="layer",
                    help="where the runtime rows' tiers find a victim (the engine's --eviction-scope)")
    ap.add_argument("--json", action="store_true")
    m = ap.add_argument_group("pricing at full GLM-5.2's scale (int4-g64 experts, one H200, a 14 GB/s NVMe)")
    m.add_argument("--expert-mb", type=float, default=21.23, help="bytes of one expert, MB (1e6): 21.23 int4-g64, 20.05 int4-g128 or int4-g64-bf16, 19.46 int4-g128-bf16, 19.47 int4-g64-e4m3, 20.06 int4-g32-e4m3")
    m.add_argument("--link-gbs", type=float, default=55.5, help="host -> GPU copies, GB/s (pinned, measured)")
    m.add_argument("--disk-gbs", type=float, default=14.0, help="disk reads, GB/s")
    m.add_argument("--compute-ms", type=float, default=16.0, help="a token's resident compute, ms")
    m.add_argument("--layers", type=int, default=78)
    m.add_argument("--moe-layers", type=int, default=75)
    m.add_argument("--prefetch-share", type=float, default=0.0,
                   help="share of the disk reads PILOT prefetch read a layer ahead (engine telemetry)")
    m.add_argument("--prefetch-waste", type=float, default=0.0,
                   help="unused prefetches per used one (engine telemetry)")
    t = ap.add_argument_group("MTP speculative decoding (see the module comment)")
    t.add_argument("--mtp-drafts", type=int, default=0, metavar="K", help="drafts a round (0: off)")
    t.add_argument("--mtp-acceptance", type=float, metavar="P", help="probability a draft is accepted")
    t.add_argument("--mtp-seed", type=int, help="the acceptance draws' seed (default 1)")
    t.add_argument("--draft-ms", type=float,
                   help="one draft forward of the MTP layer, ms (a layer's compute + the LM head; default 0.75)")
    t.add_argument("--expert-hbm-gbs", type=float,
                   help="a resident expert's read in a decode forward, GB/s (default 2400)")
    a = ap.parse_args()
    if not a.lfru_half_life > 0:
        ap.error("--lfru-half-life must be positive")
    if a.skip_misses_from_rank is not None:
        if a.skip_misses_from_rank < 2:
            ap.error("--skip-misses-from-rank must be at least 2")
        EXTRA.extend(["--skip-misses-from-rank", a.skip_misses_from_rank])
    EXTRA.extend(["--eviction-scope", a.eviction_scope])
    if not 0 <= a.prefetch_share < 1 or a.prefetch_waste < 0:
        ap.error("--prefetch-share must be in [0, 1) and --prefetch-waste at least 0")
    if min(a.expert_mb, a.link_gbs, a.disk_gbs) <= 0 or a.compute_ms < 0 or not 0 < a.moe_layers <= a.layers:
        ap.error("--expert-mb, --link-gbs and --disk-gbs must be positive, --compute-ms at least 0, "
                 "and --moe-layers in 1..=--layers")
    if a.mtp_drafts < 0 or (a.mtp_drafts > 0) != (a.mtp_acceptance is not None):
        ap.error("--mtp-drafts K (K >= 1) and --mtp-acceptance P go together")
    for name in ("mtp_seed", "draft_ms", "expert_hbm_gbs"):
        if getattr(a, name) is not None and not a.mtp_drafts:
            ap.error(f"--{name.replace('_', '-')} applies to MTP rounds only: give --mtp-drafts K too")
    a.mtp_seed = 1 if a.mtp_seed is None else a.mtp_seed
    a.draft_ms = 0.75 if a.draft_ms is None else a.draft_ms
    a.expert_hbm_gbs = 2400.0 if a.expert_hbm_gbs is None else a.expert_hbm_gbs
    if a.mtp_drafts and (not 0 <= a.mtp_acceptance <= 1 or a.draft_ms < 0 or a.expert_hbm_gbs <= 0):
        ap.error("--mtp-acceptance must be in [0, 1], --draft-ms at least 0, --expert-hbm-gbs positive")
    if a.mtp_drafts and a.skip_misses_from_rank is not None:
        ap.error("--skip-misses-from-rank applies to one-row forwards only: not with --mtp-drafts")
    with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as t:
        layers, seen, top = concat(a.trace, t)
    if a.mtp_drafts:
        with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as g:
            rounds, tokens = mtp_regroup(t.name, g, a.mtp_drafts, a.mtp_acceptance, a.mtp_seed)
        os.replace(g.name, t.name)
        a.tokens_per_round = tokens / max(rounds, 1)
    try:
        experts = a.experts or seen
        total = layers * experts
        gpu, host = round(total * a.gpu_frac), round(total * a.host_frac)
        # A working bank of one forward's decode misses at most (top-k a row), as the plans
        # give.
        w = top * (a.mtp_drafts + 1)
        rows = []

        def tiers(label, g_args, h_args, lfru=False):
            d = replay(a.strata, t.name, g_args + h_args + ["--lfru-half-life", a.lfru_half_life])
            kinds = [(f"{label}, exclusive", "pinned_lru"), (f"{label}, inclusive", "inclusive_pinned_lru")]
            if lfru:
                kinds.insert(1, (f"LFRU (half-life {a.lfru_half_life:g}) on the GPU, LRU host, exclusive", "lfru"))
            for name, key in kinds:
                tr = d["tiers"][key]
                rows.append({"policy": name, "gpu_slots": tr["gpu_slots"],
                             "host_slots": tr["host_slots"], "gpu_hit": tr["gpu_hit_rate"],
                             "host_hit": tr["host_hit_rate"], "disk": tr["disk_rate"], "accesses": tr["accesses"],
                             "skipped": tr["skip_rate"],
                             "copied_down": tr["demotions_copied"] / max(tr["accesses"], 1),
                             **price(tr["layer_mix"], a, tr["accesses"], top)})

        per_g, per_h = (gpu - w) // layers, (host - w) // layers
        tiers("LRU in both tiers", ["--slots-per-layer", per_g, "--working", gpu - per_g * layers],
              ["--host-slots-per-layer", per_h, "--host-working", host - per_h * layers], lfru=True)
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
        d = replay(a.strata, t.name, ["--slots-per-layer", (one - w) // layers, "--working",
                                      one - (one - w) // layers * layers, "--lfru-half-life", a.lfru_half_life])
        for name in ("LRU", "LFRU", "LFRU/turn", "Belady"):
            p = next(p for p in d["policies"] if p["name"] == name)
            skipped = p["skipped"] / max(d["accesses"], 1)
            rows.append({"policy": f"one tier of both capacities, {name}", "gpu_slots": one, "host_slots": 0,
                         "gpu_hit": p["hit_rate"], "host_hit": 0.0, "disk": 1 - p["hit_rate"] - skipped,
                         "skipped": skipped, "accesses": d["accesses"]})
        summary = {"traces": a.trace, "layers": layers, "experts": experts, "top_k": top, "gpu_slots": gpu,
                   "host_slots": host, "accesses": rows[0]["accesses"], "rows": rows}
        if a.mtp_drafts:
            summary["mtp"] = {"drafts": a.mtp_drafts, "acceptance": a.mtp_acceptance, "rounds": rounds,
                              "tokens": tokens, "tokens_per_round": a.tokens_per_round}
        if a.json:
            print(json.dumps(summary, indent=1))
            return
        print(f"{layers} MoE layers x {experts} experts, top-{top}; {rows[0]['accesses']} expert uses "
              f"(after each forward's union); GPU {gpu} slots ({a.gpu_frac:.1%}), host {host} ({a.host_frac:.1%})")
        if a.mtp_drafts:
            print(f"MTP: {a.mtp_drafts} drafts a round, each accepted with probability {a.mtp_acceptance}: "
                  f"{tokens} tokens in {rounds} verify forwards ({a.tokens_per_round:.2f} a round); "
                  "hit rates are of the verify forwards' expert uses, prices per generated token.")
        if EXTRA:
            print(f"Approximate decode: one-row forwards leave out misses of rank {a.skip_misses_from_rank} or "
                  "lower (skipped: read by no one, priced at nothing); the offline rows are exact.")
        skip_head, skip_rule = (" skipped |", "---|") if EXTRA else ("", "")
        print("| policy | GPU slots | host slots | GPU hits | host hits | disk | copied down |" + skip_head)
        print("|---|---|---|---|---|---|---|" + skip_rule)
        for r in rows:
            host_cell = f"{r['host_slots']}" if r["host_slots"] else "-"
            hh = f"{r['host_hit']:.1%}" if r["host_slots"] else "-"
            down = f"{r['copied_down']:.1%}" if "copied_down" in r else "-"
            sk = f" {r.get('skipped', 0.0):.1%} |" if EXTRA else ""
            print(f"| {r['policy']} | {r['gpu_slots']} | {host_cell} | {r['gpu_hit']:.1%} | {hh} | {r['disk']:.1%} "
                  f"| {down} |" + sk)
        print()
        print(f"Priced at full GLM-5.2's scale ({a.moe_layers} of {a.layers} layers MoE, experts of "
              f"{a.expert_mb} MB, copies at {a.link_gbs} GB/s, disk at {a.disk_gbs} GB/s, {a.compute_ms} ms of "
              "resident compute a token): ms a token (tok/s)")
        keys = ["serial_ms", "pipelined_ms", "overlapped_ms"] + (["prefetch_ms"] if a.prefetch_share > 0 else [])
        heads = ["serial", "pipelined (the engine)", "overlapped (bound)",
                 f"pipelined, {a.prefetch_share:.0%} of the reads a layer ahead, {a.prefetch_waste:.0%} wasted"]
        print("| tiers, policy | " + " | ".join(heads[:len(keys)]) + " |")
        print("|---|" + "---|" * len(keys))
        for r in rows:
            if "serial_ms" in r:
                cells = " | ".join(f"{r[k]:.1f} ({1e3 / r[k]:.2f})" for k in keys)
                print(f"| {r['policy']} | {cells} |")
    finally:
        os.unlink(t.name)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""First-turn expert hit rate with a warm start from the Expert Atlas, against no pins and
against pins taken from a usage ledger.

For each topic, every held-out prompt (a probe-set file of prompts the atlas never saw)
runs as a fresh process (a first turn: empty slab, no history) through
`strata generate --budget B` with greedy decoding, and the turn's expert hit rate is read
from `--stats-json`. Conditions:

  none          no pins
  ledger-all    the N most-counted experts of a ledger filled by running every probe
                prompt (the atlas's own prompts) through `strata generate --usage`
  ledger-topic  the same from a ledger of that topic's probe prompts only (a user whose
                history is that topic)
  atlas-all     --pin-from-atlas ATLAS (every topic)
  atlas-topic   --pin-from-atlas ATLAS --topics TOPIC

N is the number of pins --pin-from-atlas chooses for the budget (auto-pin's budget at
full confidence; auto-pin itself would not pin at all on strata-tiny, whose pin budget
is far below its 500 MB floor), so every pinned condition pins the same number of experts.

Usage:
  python3 scripts/atlas/warm_start.py --strata target/release/strata --model DIR \
      --atlas models/strata-tiny/atlas/atlas.json --probes models/strata-tiny/atlas/probes.json \
      --heldout models/strata-tiny/atlas/heldout.json --budget 68MiB [--context 1024] [--max-tokens 32]
      [--mtp off]
DIR must be an expert container (`strata convert --experts bf16`), so nothing is converted.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--model", required=True)
    ap.add_argument("--atlas", required=True)
    ap.add_argument("--probes", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--budget", required=True)
    ap.add_argument("--context", default="1024")
    ap.add_argument("--max-tokens", default="32")
    ap.add_argument("--mtp", default="off", help="--mtp of strata (off: the main tier alone, one token a forward)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    probes = json.load(open(a.probes))["categories"]
    heldout = json.load(open(a.heldout))["categories"]
    layers = json.load(open(a.atlas))["model"]["layers"]
    tmp = tempfile.mkdtemp(prefix="warm-start-")
    fit = [a.strata, "fit", "--model", a.model, "--budget", a.budget, "--context", a.context, "--mtp", a.mtp]
    base = [a.strata, "generate", "--model", a.model, "--max-tokens", a.max_tokens, "--temperature", "0",
            "--budget", a.budget, "--context", a.context, "--mtp", a.mtp]

    # Ledgers: each topic's probe prompts, one process per prompt, counts accumulating.
    ledgers = {}
    for topic, prompts in sorted(probes.items()):
        path = os.path.join(tmp, f"ledger-{topic}")
        for p in prompts:
            run(base + ["--prompt", p, "--usage", path])
        counts = {}
        for line in open(path):
            f = line.split()
            if len(f) == 3 and int(f[0]) in layers:
                counts[(int(f[0]), int(f[1]))] = int(f[2])
        ledgers[topic] = counts
    total = {}
    for c in ledgers.values():
        for k, v in c.items():
            total[k] = total.get(k, 0) + v

    def top(counts, n):
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        return ",".join(f"{l}:{e}" for (l, e), _ in ranked)

    def pin_count(topics):
        extra = ["--topics", topics] if topics else []
        err = run(fit + ["--pin-from-atlas", a.atlas] + extra).stderr
        return int(re.search(r"pin-from-atlas: (\d+) pins", err).group(1))

    n = pin_count(None)
    stats = os.path.join(tmp, "stats.json")

    def hit(extra, prompt):
        run(base + ["--prompt", prompt, "--usage", "off", "--stats-json", stats] + extra)
        d = json.load(open(stats))["experts"]["turn"]["demand"]
        return d["hits"], d["misses"]

    conds = ["none", "ledger-all", "ledger-topic", "atlas-all", "atlas-topic"]
    results = {}
    for topic, prompts in sorted(heldout.items()):
        args = {
            "none": [],
            "ledger-all": ["--pin", top(total, n)],
            "ledger-topic": ["--pin", top(ledgers[topic], n)],
            "atlas-all": ["--pin-from-atlas", a.atlas],
            "atlas-topic": ["--pin-from-atlas", a.atlas, "--topics", topic],
        }
        row = {}
        for c in conds:
            h = m = 0
            for p in prompts:
                x, y = hit(args[c], p)
                h, m = h + x, m + y
            row[c] = h / max(1, h + m)
        results[topic] = row
        print(topic, " ".join(f"{c}={row[c]*100:.1f}%" for c in conds), file=sys.stderr)

    print(f"budget {a.budget}, context {a.context}, {n} pins in every pinned condition, "
          f"{a.max_tokens} greedy tokens per held-out prompt; first-turn hit rate:\n")
    print("| topic | " + " | ".join(conds) + " |")
    print("|---|" + "---:|" * len(conds))
    for topic, row in results.items():
        print(f"| {topic} | " + " | ".join(f"{row[c]*100:.1f}%" for c in conds) + " |")
    mean = {c: sum(r[c] for r in results.values()) / len(results) for c in conds}
    print("| **mean** | " + " | ".join(f"**{mean[c]*100:.1f}%**" for c in conds) + " |")
    if a.json:
        json.dump({"budget": a.budget, "pins": n, "results": results, "mean": mean}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

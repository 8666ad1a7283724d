#!/usr/bin/env python3
"""Offline coupling recall (`strata trace coupling`) next to PILOT's online recall
(`--pilot measure`) on the same generations.

Every prompt of the given probe-set files runs as its own `strata generate` process
(greedy, `--pilot measure`, `--trace`), with the topics interleaved so that both halves
of the temporal split see every topic. The traces are joined into one (each process's
segment renumbered) and `strata trace coupling --score-max-rows 8` fits on the first
half of the rows and scores the second half's narrow rows (PILOT skips forwards wider
than 8 rows, so only decode steps and short prompts count on both sides). PILOT's recall
is summed over the processes whose rows fall in the test half.

Usage:
  python3 scripts/atlas/coupling_vs_pilot.py --strata target/release/strata --model DIR \
      --probes models/strata-tiny/atlas/probes.json models/strata-tiny/atlas/heldout.json \
      [--budget 256MiB] [--max-tokens 64] [--out trace.txt]
DIR must be an expert container (PILOT runs in the streamed expert runtime).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--model", required=True)
    ap.add_argument("--probes", nargs="+", required=True)
    ap.add_argument("--budget", default="256MiB")
    ap.add_argument("--context", default="1024")
    ap.add_argument("--max-tokens", default="64")
    ap.add_argument("--mtp", default="off", help="--mtp of strata (off: one token a forward)")
    ap.add_argument("--pilot", default="measure", help="--pilot mode to score (measure or two-step)")
    ap.add_argument("--out", help="keep the joined trace here")
    a = ap.parse_args()
    by_topic = {}
    for f in a.probes:
        for topic, prompts in json.load(open(f))["categories"].items():
            by_topic.setdefault(topic, []).extend(prompts)
    order = []
    for i in range(max(len(p) for p in by_topic.values())):
        for topic in sorted(by_topic):
            if i < len(by_topic[topic]):
                order.append(by_topic[topic][i])
    tmp = tempfile.mkdtemp(prefix="coupling-")
    joined = a.out or os.path.join(tmp, "trace.txt")
    pilot = []  # per process: (rows in its trace, matched, actual)
    with open(joined, "w") as out:
        out.write("# strata route trace v1: segment forward row layer experts...\n")
        for seg, prompt in enumerate(order):
            trace, stats = os.path.join(tmp, "t.txt"), os.path.join(tmp, "s.json")
            cmd = [a.strata, "generate", "--model", a.model, "--prompt", prompt, "--max-tokens", a.max_tokens,
                   "--temperature", "0", "--budget", a.budget, "--context", a.context, "--mtp", a.mtp, "--usage", "off",
                   "--pilot", a.pilot, "--trace", trace, "--stats-json", stats]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
            rows = set()
            for line in open(trace):
                if line.startswith("#") or not line.strip():
                    continue
                f = line.split()
                rows.add((f[1], f[2]))
                out.write(" ".join([str(seg)] + f[1:]) + "\n")
            s = json.load(open(stats))["experts"]["pilot"]
            pilot.append((len(rows), s["matched"], s["actual"]))
    total_rows = sum(r for r, _, _ in pilot)
    half, seen, m, n = total_rows // 2, 0, 0, 0
    for rows, matched, actual in pilot:
        if seen >= half:
            m, n = m + matched, n + actual
        seen += rows
    report = json.loads(subprocess.run([a.strata, "trace", "coupling", "--trace", joined, "--score-max-rows", "8",
                                        "--json"], capture_output=True, text=True, check=True).stdout)
    text = subprocess.run([a.strata, "trace", "coupling", "--trace", joined, "--score-max-rows", "8"],
                          capture_output=True, text=True, check=True).stdout
    print(text)
    all_m = sum(x for _, x, _ in pilot)
    all_n = sum(x for _, _, x in pilot)
    print(f"PILOT (--pilot {a.pilot}, next layer): recall {m / max(1, n) * 100:.1f}% on the test-half processes "
          f"({n} selections), {all_m / max(1, all_n) * 100:.1f}% over all {len(pilot)} processes")
    d1 = next(d for d in report["by_delta"] if d["delta"] == 1)
    print(f"coupling delta 1: recall {d1['recall'] * 100:.1f}% (baseline {d1['baseline_recall'] * 100:.1f}%) "
          f"on {report['scored_rows']} scored rows")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""strata-tiny's held-out perplexity per category for each expert encoding, and the
convert report (KL divergence, logit difference) of each conversion.

Needs the held-out texts: `python3 training/corpus.py --out D` then
`python3 training/heldout_text.py --data D --out D/heldout` (one `<category>.txt` each:
the documents training never saw).

Usage:
  python3 scripts/quality/perplexity_table.py --strata target/release/strata \
      --model models/strata-tiny --heldout D/heldout [--context 256] [--stride 128] [--work /tmp/ppl]
"""
import argparse
import glob
import json
import os
import subprocess
import sys

# (label, strata convert arguments); None = the source checkpoint itself (bf16).
FORMATS = [
    ("bf16", None),
    ("int8", ["--experts", "int8"]),
    ("int4 g32", ["--experts", "int4", "--group", "32", "--scales", "f32"]),
    ("int4 g64", ["--experts", "int4", "--group", "64", "--scales", "f32"]),
    ("int4 g64, bf16 scales", ["--experts", "int4", "--group", "64", "--scales", "bf16"]),
    ("int4 g128", ["--experts", "int4", "--group", "128", "--scales", "f32"]),
    ("int4 g128, bf16 scales", ["--experts", "int4", "--group", "128", "--scales", "bf16"]),
    ("int4 g64, e4m3 scales", ["--experts", "int4", "--group", "64", "--scales", "e4m3"]),
    ("int4 g32, e4m3 scales", ["--experts", "int4", "--group", "32", "--scales", "e4m3"]),
    # A group at least as wide as every expert row (gate/up 256, down 64): one scale a row.
    ("int4 per row", ["--experts", "int4", "--group", "256", "--scales", "f32"]),
]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", default="target/release/strata")
    ap.add_argument("--model", default="models/strata-tiny")
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--context", default="256")
    ap.add_argument("--stride", default="128")
    ap.add_argument("--work", default="/tmp/strata-ppl")
    ap.add_argument("--json", help="also write the numbers here")
    a = ap.parse_args()
    texts = sorted(p for p in glob.glob(os.path.join(a.heldout, "*.txt")) if not p.endswith("mixed.txt"))
    cats = [os.path.basename(p)[:-4] for p in texts]
    os.makedirs(a.work, exist_ok=True)
    # The report's text: the first 6,000 characters of every category.
    mixed = os.path.join(a.work, "mixed.txt")
    with open(mixed, "w") as f:
        for p in texts:
            f.write(open(p).read()[:6000])
    table, reports = {}, {}
    for label, conv in FORMATS:
        model = a.model
        if conv:
            model = os.path.join(a.work, label.replace(" ", "-"))
            report = model + ".report.json"
            run([a.strata, "convert", "--model", a.model, "--out", model, *conv, "--report", report,
                 "--eval-text", mixed, "--eval-context", a.context, "--eval-stride", a.stride])
            reports[label] = json.load(open(report))
        row = {}
        for cat, text in zip(cats, texts):
            r = json.loads(run([a.strata, "perplexity", "--model", model, "--text", text, "--context", a.context,
                                "--stride", a.stride, "--json"]))
            row[cat] = r
            print(f"{label} {cat}: {r['perplexity']:.3f} ({r['scored']} tokens)", file=sys.stderr)
        table[label] = row

    labels = [label for label, _ in FORMATS]
    print(f"Perplexity on held-out text (windows of {a.context} tokens, stride {a.stride}):\n")
    print("| category | tokens | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---:|" * len(labels))
    for cat in cats:
        print(f"| {cat} | {table['bf16'][cat]['scored']:,} | "
              + " | ".join(f"{table[l][cat]['perplexity']:.2f}" for l in labels) + " |")
    import math
    alln = {l: sum(r["mean_nll"] * r["scored"] for r in table[l].values()) / sum(r["scored"] for r in table[l].values())
            for l in labels}
    total = sum(r["scored"] for r in table["bf16"].values())
    print(f"| **all (token-weighted)** | {total:,} | " + " | ".join(f"**{math.exp(alln[l]):.2f}**" for l in labels) + " |")
    print("\nconvert --report on the mixed sample (the first 6,000 characters of each category):\n")
    print("| experts | expert bytes | perplexity source -> converted | mean KL (nats) | max abs logit diff | top-1 agreement |")
    print("|---|---:|---:|---:|---:|---:|")
    for label in labels[1:]:
        r = reports[label]
        print(f"| {label} | {r['convert']['expert_bytes'] / 2**20:.2f} MiB | {r['source_perplexity']:.3f} -> "
              f"{r['converted_perplexity']:.3f} ({r['perplexity_increase_pct']:+.2f}%) | {r['mean_kl']:.5f} | "
              f"{r['max_abs_logit_diff']:.3f} | {r['top1_agreement'] * 100:.1f}% |")
    if a.json:
        json.dump({"table": table, "reports": reports}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()

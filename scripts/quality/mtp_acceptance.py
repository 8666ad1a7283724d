#!/usr/bin/env python3
"""MTP acceptance per expert encoding on strata-tiny's held-out prompts.

Converts the model once per encoding (main experts; MTP tier int8 unless named), then runs
every held-out prompt of models/strata-tiny/atlas/heldout.json greedily for 64 tokens with
3 draft tokens a round and sums the `mtp` object of --stats-json.

    python3 scripts/quality/mtp_acceptance.py --strata target/release/strata --model models/strata-tiny
"""
import argparse
import json
import os
import subprocess
import tempfile

FORMATS = [  # name, main experts, group, MTP-tier experts
    ("bf16", "bf16", 64, "int8"),
    ("int8", "int8", 64, "int8"),
    ("int4 g32", "int4", 32, "int8"),
    ("int4 g64", "int4", 64, "int8"),
    ("int4 g128", "int4", 128, "int8"),
    ("int4 per row", "int4", 256, "int8"),
    ("int8, MTP tier int4", "int8", 64, "int4"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=3)
    a = ap.parse_args()
    held = json.load(open(os.path.join(a.model, "atlas", "heldout.json")))
    prompts = [p for ps in held["categories"].values() for p in ps]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind, group, mtp in FORMATS:
            out = os.path.join(tmp, name.replace(" ", "_").replace(",", ""))
            subprocess.run([a.strata, "convert", "--model", a.model, "--out", out, "--experts", kind,
                            "--group", str(group), "--mtp-experts", mtp], check=True, capture_output=True)
            drafted = accepted = rounds = 0
            for p in prompts:
                sj = os.path.join(tmp, "stats.json")
                subprocess.run([a.strata, "generate", "--model", out, "--prompt", p, "--max-tokens", str(a.max_tokens),
                                "--temperature", "0", "--mtp", "on", "--draft-tokens", str(a.draft_tokens),
                                "--context", "512", "--stats-json", sj], check=True, capture_output=True)
                s = json.load(open(sj))["mtp"]
                drafted += s["drafted"]
                accepted += s["accepted"]
                rounds += s.get("rounds", 0)
            rows.append(dict(format=name, prompts=len(prompts), drafted=drafted, accepted=accepted,
                             acceptance_rate=round(accepted / drafted, 4)))
            print(json.dumps(rows[-1]), flush=True)
    print("| experts | drafted | accepted | acceptance |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['drafted']} | {r['accepted']} | {r['acceptance_rate']:.3f} |")


if __name__ == "__main__":
    main()

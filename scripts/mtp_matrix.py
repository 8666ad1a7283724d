#!/usr/bin/env python3
"""Decode speed with the default MTP settings next to `--mtp off`: `strata-bench decode`
(one request, the CLI's loop) and `strata-bench serve` at 1, 4 and 16 requests, greedy
and sampled. Runs alternate between the two settings (this machine's speed drifts), and
each cell is the median of --reps runs; one table in Markdown at the end.

    python3 scripts/mtp_matrix.py --bin target/release/strata-bench --model models/strata-tiny \\
        [--reps 5] [--cores 0,1] [--device cpu] [--tokens 256] [--json out.jsonl]
"""
import argparse
import json
import statistics
import subprocess
import sys


def run(args, cmd):
    pre = ["taskset", "-c", args.cores] if args.cores else []
    r = subprocess.run(pre + [args.bin] + cmd[1:] + ["--json"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    out = r.stdout.strip()
    return json.loads(out[out.index("{"):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/strata-bench")
    ap.add_argument("--model", default="models/strata-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cores", default="", help="taskset list, e.g. 0,1")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", default="1,4,16")
    ap.add_argument("--json", help="append every run as a JSON line here")
    args = ap.parse_args()
    common = ["--model", args.model, "--device", args.device, "--context", "2048", "--warmup"]
    rows = []
    log = open(args.json, "a") if args.json else None
    for temp in ["0", "0.8"]:
        cases = [("bench decode", 1, ["bench", "decode", "--prompt-tokens", "32", "--decode-tokens", str(args.tokens)])]
        for n in args.requests.split(","):
            cases.append((f"bench serve", int(n), ["bench", "serve", "--requests", n, "--prompt-tokens", "32",
                                                    "--decode-tokens", str(args.tokens // 2)]))
        for name, n, cmd in cases:
            got = {"default": [], "off": []}
            extra = {}
            for _ in range(args.reps):
                for setting in ["default", "off"]:
                    c = cmd + common + ["--temperature", temp] + (["--mtp", "off"] if setting == "off" else [])
                    r = run(args, c)
                    rate = r.get("decode_tokens_per_s") or r.get("tokens_per_s")
                    got[setting].append(rate)
                    if setting == "default":
                        m = r.get("mtp") or {}
                        extra = {"acceptance": m.get("acceptance_rate"), "dormant_after": m.get("dormant_after_tokens"),
                                 "drafted": m.get("drafted")}
                    if log:
                        log.write(json.dumps({"case": name, "requests": n, "temperature": temp, "setting": setting,
                                              "result": r}) + "\n")
            d, o = statistics.median(got["default"]), statistics.median(got["off"])
            rows.append((name, n, temp, d, o, extra))
            print(f"{name} x{n} T={temp}: default {d:.0f} tok/s, --mtp off {o:.0f} ({d / o:.2f}) {extra}", flush=True)
    print("\n| command | requests | temperature | default tok/s | `--mtp off` tok/s | ratio | drafts (last run) |")
    print("|---|---|---|---|---|---|---|")
    for name, n, temp, d, o, e in rows:
        note = "none (dormant)" if e.get("dormant_after") is not None or not e.get("drafted") else f"{e['drafted']}, {e['acceptance']:.2f} accepted"
        print(f"| `{name}` | {n} | {temp} | {d:.0f} | {o:.0f} | {d / o:.2f} | {note} |")


if __name__ == "__main__":
    main()

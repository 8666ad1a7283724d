#!/usr/bin/env python3
"""Load generator for `strata serve` (or any OpenAI-compatible server): N concurrent
streams of /v1/completions, each request streamed so the time to its first token is
seen. Python's standard library only (threads + http.client), so it runs on a machine
without internet access.

Usage:
  python3 scripts/loadgen.py --base http://127.0.0.1:8080 --concurrency 1 4 16 64 \
      [--requests-per-stream 1] [--prompt-words 48] [--max-tokens 32] [--api-key KEY] [--json OUT]

For each concurrency C it sends C * requests-per-stream requests, C at a time, and
prints aggregate generated tokens per second (completion tokens over the level's wall
time), p50/p99 time to first token, with --pid the tokens per CPU-second the server
used (steadier on a shared machine), and, when the server is strata with streamed
experts, the expert bytes read per generated token (from /metrics). Every request asks
for exactly --max-tokens tokens (`ignore_eos`, as llama.cpp's batched bench does);
a server without that extension may stop earlier, and its numbers count what came.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import sys
import threading
import time
import urllib.parse

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near the old river bank").split()


def prompt_for(i, words):
    # Distinct prompts (no prompt-cache hits across requests), same length.
    body = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))
    return f"Request {i}: {body}"


class Client:
    def __init__(self, base, api_key):
        u = urllib.parse.urlparse(base)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path):
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        c.request("GET", path, headers=self.headers)
        r = c.getresponse()
        data = r.read().decode()
        c.close()
        return r.status, data

    def stream(self, body):
        """POSTs a streamed completion; returns (ttft seconds, completion tokens, error)."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", json.dumps(body), self.headers)
        r = c.getresponse()
        if r.status != 200:
            err = r.read().decode()[:200]
            c.close()
            return None, 0, f"HTTP {r.status}: {err}"
        ttft, tokens, chunks = None, None, 0
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
        c.close()
        return ttft, tokens if tokens is not None else chunks, None


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def snapshot(client):
    status, text = client.get("/metrics")
    if status != 200:
        return {}
    keys = ['strata_expert_read_bytes_total{cause="demand"}', "strata_generated_tokens_total"]
    return {k: metric(text, k) for k in keys}


def cpu_seconds(pid):
    """User + system CPU seconds the process has used (Linux /proc), or None."""
    if not pid:
        return None
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_level(client, model, conc, per_stream, words, max_tokens, pid=None):
    n = conc * per_stream
    next_i = [0]
    lock = threading.Lock()
    ttfts, tokens, errors = [], [], []

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= n:
                    return
                next_i[0] += 1
            body = {"prompt": prompt_for(i, words), "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            if model:
                body["model"] = model
            ttft, toks, err = client.stream(body)
            with lock:
                if err:
                    errors.append(err)
                else:
                    tokens.append(toks)
                    if ttft is not None:
                        ttfts.append(ttft)

    before = snapshot(client)
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = cpu_seconds(pid)
    # The expert counters reach /metrics at the runtime's turn boundary, right after the
    # batch empties: give it a moment.
    time.sleep(0.5)
    after = snapshot(client)
    total = sum(tokens)
    q = sorted(ttfts)

    def pct(p):
        return q[min(len(q) - 1, int(round(p / 100 * (len(q) - 1))))] if q else float("nan")

    row = {"concurrency": conc, "requests": n, "errors": len(errors), "tokens": total,
           "seconds": round(wall, 3), "tokens_per_s": round(total / wall, 1),
           "ttft_p50_s": round(pct(50), 3), "ttft_p99_s": round(pct(99), 3)}
    if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
        # Tokens per CPU-second of the server: steadier than wall time on a shared machine.
        row["server_cpu_s"] = round(cpu1 - cpu0, 2)
        row["tokens_per_cpu_s"] = round(total / (cpu1 - cpu0), 1)
    rb, gt = 'strata_expert_read_bytes_total{cause="demand"}', "strata_generated_tokens_total"
    if before.get(rb) is not None and after.get(rb) is not None and after[gt] > before[gt]:
        row["expert_bytes_per_token"] = round((after[rb] - before[rb]) / (after[gt] - before[gt]))
    if errors:
        row["first_error"] = errors[0]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-stream", type=int, default=1)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--label", default="")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid: also report tokens per server CPU-second")
    ap.add_argument("--json", default=None, help="append one JSON line per level to this file")
    a = ap.parse_args()
    client = Client(a.base, a.api_key)
    status, _ = client.get("/health")
    if status != 200:
        sys.exit(f"{a.base}/health answered {status}")
    # One short request first, so start-up costs are not in the first level.
    client.stream({"prompt": "warm up", "max_tokens": 2, "stream": True, **({"model": a.model} if a.model else {})})
    print(f"{'label':<22} {'conc':>4} {'reqs':>5} {'tok/s':>8} {'tok/cpu-s':>9} {'ttft p50':>9} {'ttft p99':>9} {'B/token':>10} err")
    for c in a.concurrency:
        row = run_level(client, a.model, c, a.requests_per_stream, a.prompt_words, a.max_tokens, a.pid)
        row["label"] = a.label
        bpt = row.get("expert_bytes_per_token", "-")
        print(f"{a.label:<22} {c:>4} {row['requests']:>5} {row['tokens_per_s']:>8} {row.get('tokens_per_cpu_s', '-'):>9} {row['ttft_p50_s']:>9} "
              f"{row['ttft_p99_s']:>9} {bpt:>10} {row['errors']}", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if row["errors"]:
            print(f"  first error: {row['first_error']}", file=sys.stderr)


if __name__ == "__main__":
    main()

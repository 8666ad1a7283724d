#!/usr/bin/env python3
"""A bounded load test of `strata serve` on loopback: starts the server, runs --clients
threads for --seconds with a mix of chat requests (1-120 tokens, greedy and sampled, a
fifth streamed and half of those dropped early, json_object requests, malformed bodies),
samples the server's RSS every second, stops it, and prints one JSON summary: answered
(2xx), refused (4xx, 429 included), failed (5xx, which must be 0), cancelled, RSS.
Exits 1 if any request failed with 5xx or the server died. Standard library only.

    python3 tests/server/soak.py --bin target/release/strata --model models/strata-tiny \\
        --seconds 90 --clients 12 -- --budget 72MiB --context 1024 --queue 8
"""
import argparse
import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


WORDS = "the old house on the hill stood quiet while rain fell over river stones and seven birds".split()


def body_for(rng, i, model):
    """(kind, body bytes, stream?, cancel early?)"""
    r = rng.random()
    if r < 0.08:
        bad = [b"{not json", b'{"messages": 5}', b'{"model": "x", "messages": [], "max_tokens": -1}',
               b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}']
        return "malformed", rng.choice(bad), False, False
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    req = {
        "model": model,
        "messages": [{"role": "user", "content": f"{i}: {words}"}],
        "max_tokens": rng.randint(1, 120),
    }
    if rng.random() < 0.5:
        req.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 1 << 30))
    else:
        req["temperature"] = 0
    kind = "chat"
    if rng.random() < 0.12:
        req["response_format"] = {"type": "json_object"}
        req["max_tokens"] = rng.randint(8, 60)
        kind = "json"
    stream = rng.random() < 0.2
    if stream:
        req["stream"] = True
        kind += "-stream"
    return kind, json.dumps(req).encode(), stream, stream and rng.random() < 0.5


def client(port, model, deadline, seed, tally, lock):
    rng = random.Random(seed)
    i = 0
    while time.time() < deadline:
        i += 1
        kind, body, stream, cancel = body_for(rng, seed * 100000 + i, model)
        outcome = None
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            status = r.status
            if stream and status == 200 and cancel:
                r.read1(64)  # a first piece, then drop the connection
                c.close()
                outcome = "cancelled"
            else:
                data = r.read()
                c.close()
                if status >= 500:
                    outcome = "failed"
                    with lock:
                        tally["errors"].append(f"{status} {kind}: {data[:300].decode(errors='replace')}")
                elif status >= 400:
                    outcome = "refused_429" if status == 429 else "refused"
                    if kind != "malformed":
                        with lock:
                            tally["refusals"].append(f"{status} {kind}: {data[:200].decode(errors='replace')}")
                else:
                    outcome = "answered"
        except (OSError, http.client.HTTPException) as e:
            outcome = "transport_error"
            with lock:
                tally["errors"].append(f"transport {kind}: {e}")
        with lock:
            tally[outcome] = tally.get(outcome, 0) + 1
            tally["kinds"][kind] = tally["kinds"].get(kind, 0) + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/strata")
    ap.add_argument("--model", default="models/strata-tiny")
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("serve_args", nargs="*", help="after --: flags for strata serve")
    a = ap.parse_args()
    port = free_port()
    cmd = [a.bin, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(port)] + a.serve_args
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if server.poll() is not None:
                sys.exit(f"strata serve exited at start: {server.stderr.read()[-2000:]}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("strata serve did not answer /health")
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/v1/models")
        model = json.loads(c.getresponse().read())["data"][0]["id"]
        tally = {"kinds": {}, "errors": [], "refusals": []}
        lock = threading.Lock()
        deadline = time.time() + a.seconds
        threads = [threading.Thread(target=client, args=(port, model, deadline, a.seed * 1000 + k, tally, lock))
                   for k in range(a.clients)]
        rss = []
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            v = rss_bytes(server.pid)
            if v:
                rss.append(v)
            time.sleep(1)
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    mib = [v / (1 << 20) for v in rss]
    summary = {
        "command": " ".join(cmd[1:]),
        "seconds": a.seconds,
        "clients": a.clients,
        "answered": tally.get("answered", 0),
        "cancelled": tally.get("cancelled", 0),
        "refused_4xx": tally.get("refused", 0),
        "refused_429": tally.get("refused_429", 0),
        "failed_5xx": tally.get("failed", 0),
        "transport_errors": tally.get("transport_error", 0),
        "kinds": tally["kinds"],
        "rss_mib_first_last_max": [round(mib[0], 1), round(mib[-1], 1), round(max(mib), 1)] if mib else None,
        "server_alive_at_end": alive,
        "first_errors": tally["errors"][:5],
        "first_refusals_of_valid_requests": tally["refusals"][:5],
    }
    print(json.dumps(summary, indent=1))
    if summary["failed_5xx"] or summary["transport_errors"] or not alive:
        sys.exit(1)


if __name__ == "__main__":
    main()

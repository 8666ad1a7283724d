#!/usr/bin/env python3
# On the GPU machine: how much page-locked host memory it gives a CUDA process (the
# extrapolation's host tier, docs/performance.md): pinned chunks of 2 GiB until MemAvailable falls to the
# margin (GiB, the first argument; default 2) plus one chunk, or pinning fails.
#   python3 scripts/device/pinned-capacity.py [MARGIN_GIB]
import sys, time, torch
def avail():
    for l in open("/proc/meminfo"):
        if l.startswith("MemAvailable:"):
            return int(l.split()[1]) * 1024
print("MemTotal/MemAvailable before:", open("/proc/meminfo").read().split("\n")[:3], flush=True)
torch.zeros(1, device="cuda")
print("MemAvailable with a CUDA context: %.1f GiB" % (avail() / 2**30), flush=True)
chunks, t0 = [], time.time()
margin = int(sys.argv[1]) << 30 if len(sys.argv) > 1 else 2 << 30
while avail() > margin + (2 << 30):
    try:
        chunks.append(torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True))
    except Exception as e:
        print("pin failed:", e, flush=True); break
    if len(chunks) % 8 == 0:
        print("pinned %d GiB, %.0f s, MemAvailable %.1f GiB" % (2 * len(chunks), time.time() - t0, avail() / 2**30), flush=True)
print("pinned %d GiB in %.0f s; MemAvailable left %.1f GiB" % (2 * len(chunks), time.time() - t0, avail() / 2**30), flush=True)
# A copy from the last chunk, to show it is usable.
y = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
t = time.time(); y.copy_(chunks[-1], non_blocking=True); torch.cuda.synchronize()
print("H2D from the last chunk: %.1f GB/s" % ((2 << 30) / (time.time() - t) / 1e9), flush=True)

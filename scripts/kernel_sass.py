#!/usr/bin/env python3
"""Static look at the CUDA kernels without a GPU: registers, spills and loops per kernel, and
whether two versions of the source compile to the same SASS.

The kernels are NVRTC source (crates/strata-backend/src/cuda/kernels, joined in module.rs's
order). This compiles them as the H200's driver would (nvcc's ptxas at the driver's CUDA
version, sm_90, --fmad=false) and reads the result with cuobjdump. nvcc comes from PyPI:

    python3 -m venv /tmp/cudavenv
    /tmp/cudavenv/bin/pip install nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \\
        nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump
    export CUDA_BIN=/tmp/cudavenv/lib/python3.11/site-packages/nvidia/cu13/bin

    python3 scripts/kernel_sass.py                      # regs, spills a kernel
    python3 scripts/kernel_sass.py --loops k_experts_up_row
    python3 scripts/kernel_sass.py --against HEAD~1     # kernels whose SASS differs from a commit's

(`--against` compares instructions with addresses dropped; `--loops` lists each loop of a
kernel with its instruction mix, the form to check a change's effect on a hot loop.)
"""
import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = "crates/strata-backend/src/cuda/kernels"


def parts(rev):
    """The kernel source files in module.rs's order, at `rev` (None: the working tree)."""
    def read(path):
        if rev is None:
            return open(os.path.join(ROOT, path)).read()
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True,
                              text=True).stdout
    module = read("crates/strata-backend/src/cuda/module.rs")
    names = re.findall(r'include_str!\("kernels/([\w.]+)"\)', module)
    return "".join(read(f"{KDIR}/{n}") for n in names)


def tool(name):
    d = os.environ.get("CUDA_BIN")
    return os.path.join(d, name) if d else name


def compile_sass(src, defines, work):
    cu, cubin = os.path.join(work, "k.cu"), os.path.join(work, "k.cubin")
    open(cu, "w").write(src)
    cmd = [tool("nvcc"), "-arch=sm_90", "-cubin", "--fmad=false", "-std=c++17", "-Xptxas", "-v", "-o", cubin, cu]
    cmd += [f"-D{d}" for d in defines]
    env = dict(os.environ, PATH=os.path.dirname(tool("nvcc")) + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"nvcc failed:\n{r.stderr[-4000:]}")
    stats, cur = {}, None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            stats[cur] = list(map(int, m.groups()))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            stats[cur].insert(0, int(m.group(1)))
    sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True,
                          env=env).stdout
    funcs, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\w+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur:
            funcs[cur].append((int(m.group(1), 16), m.group(2)))
    return stats, funcs


def loops(ins):
    """(start, end, instructions) of each loop: a branch back to a lower address."""
    out = []
    for a, t in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", t)
        if m and int(m.group(1), 16) < a:
            s = int(m.group(1), 16)
            body = [x for b, x in ins if s <= b <= a]
            if 20 <= len(body) < 2000:
                out.append((s, a, body))
    return out


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-D", dest="defines", action="append", default=[],
                    help="NAME=VALUE: an extra definition (an experiment on a copy of the source)")
    ap.add_argument("--rev", help="compile the kernels of this commit instead of the working tree")
    ap.add_argument("--against", help="list the kernels whose SASS differs from this commit's")
    ap.add_argument("--loops", metavar="KERNEL", help="list KERNEL's loops and their instruction mix")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        stats, funcs = compile_sass(parts(a.rev), a.defines, work)
        if a.loops:
            for s, e, body in loops(funcs[a.loops]):
                mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body)
                top = " ".join(f"{k}:{v}" for k, v in mix.most_common(8))
                print(f"{s:#8x}-{e:#8x} {len(body):5d} instr  {top}")
            return
        if a.against:
            with tempfile.TemporaryDirectory() as w2:
                _, old = compile_sass(parts(a.against), a.defines, w2)
            norm = lambda ins: [re.sub(r"0x[0-9a-f]+", "X", t) for _, t in ins]
            differ = 0
            for k in sorted(set(funcs) | set(old)):
                if k not in funcs or k not in old:
                    print(f"{k}: only in {'the working tree' if k in funcs else a.against}")
                    differ += 1
                elif norm(funcs[k]) != norm(old[k]):
                    print(f"{k}: differs ({len(old[k])} -> {len(funcs[k])} instructions)")
                    differ += 1
            print(f"{differ} of {len(funcs)} kernels differ" if differ else "identical SASS")
            return
        for k in sorted(stats):
            regs, stack, st, ld = stats[k]
            print(f"{k:28s} {regs:4d} registers  stack {stack:4d}  spill stores {st:4d}  loads {ld:4d}")


if __name__ == "__main__":
    main()

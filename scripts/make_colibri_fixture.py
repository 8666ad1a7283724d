#!/usr/bin/env python3
"""Builds a small container in the public GLM-5.2 "Colibri" layout from an f32 fixture.

    python scripts/make_colibri_fixture.py \
        [--src fixtures/glm5/dsa-sparse] [--out fixtures/colibri/dsa-sparse-int4] [--group 16]

Layout (see shared/reference/residency.md, "Artifacts"):
  out-NNNNN.safetensors      main weights (here two shards)
  out-idx-NNNNN.safetensors  the DSA indexer tensors (self_attn.indexer.*)
  out-mtp-NNNNN.safetensors  the MTP layer (only when the source has one; dsa-sparse has none)
Every 2-D linear weight is a U8 payload `<name>` plus an F32 scale tensor `<name>.qs`:
  routed experts   int4, grouped (`--group`, default 16; per-row when group >= in)
  everything else  int8 per row (attention, indexer, dense and shared MLPs, embeddings,
                   lm_head)
Norms, the router (`mlp.gate.weight`) and `e_score_correction_bias` stay F32.
Encodings are exactly strata_kernels::quant's (symmetric absmax; int8 s = amax/127,
int4 s = amax/7 with q in [-8, 7] stored as nibble q + 8, low nibble = even column,
rounding half away from zero, all arithmetic in f32), so a Rust test can recompute them.
Tensors are written in a fixed order with each routed expert's six tensors adjacent
(gate, gate.qs, up, up.qs, down, down.qs): one expert is one coalesced read.
No model.safetensors.index.json is written.
"""

import argparse
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

F32 = np.float32


def round_half_away(x):
    t = np.trunc(x)
    frac = x - t  # exact in floating point
    return t + np.where(np.abs(frac) >= F32(0.5), np.sign(x), F32(0.0)).astype(F32)


def quant_int8_row(w):
    w = w.astype(F32)
    amax = np.max(np.abs(w), axis=1)
    s = np.where(amax > 0, amax / F32(127.0), F32(1.0)).astype(F32)
    q = np.clip(round_half_away(w / s[:, None]), -127, 127).astype(np.int8)
    return q.view(np.uint8), s


def quant_int4_group(w, group):
    w = w.astype(F32)
    rows, cols = w.shape
    groups = -(-cols // group)
    scales = np.empty((rows, groups), dtype=F32)
    nib = np.empty((rows, cols), dtype=np.uint8)
    for g in range(groups):
        chunk = w[:, g * group:(g + 1) * group]
        amax = np.max(np.abs(chunk), axis=1)
        s = np.where(amax > 0, amax / F32(7.0), F32(1.0)).astype(F32)
        scales[:, g] = s
        q = np.clip(round_half_away(chunk / s[:, None]), -8, 7).astype(np.int32) + 8
        nib[:, g * group:(g + 1) * group] = q.astype(np.uint8)
    half = -(-cols // 2)
    padded = np.zeros((rows, half * 2), dtype=np.uint8)
    padded[:, :cols] = nib
    packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)
    if groups == 1:
        scales = scales.reshape(rows)
    return packed, scales


def write_safetensors(path, tensors):
    """tensors: list of (name, array) written in this order (safetensors' own writer
    reorders by dtype, which would split an expert's payloads from its scales)."""
    header = {}
    offset = 0
    blobs = []
    for name, a in tensors:
        a = np.ascontiguousarray(a)
        dtype = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32"}[a.dtype]
        b = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def is_f32_kept(name, a):
    return a.ndim != 2 or name.endswith("mlp.gate.weight") or "e_score_correction_bias" in name


def encode(name, a, group):
    """[(name, array)] for one source tensor."""
    if is_f32_kept(name, a):
        return [(name, a.astype(F32))]
    if EXPERT.match(name):
        p, s = quant_int4_group(a, group)
    else:
        p, s = quant_int8_row(a)
    return [(name, p), (name + ".qs", s)]


def layer_of(name):
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="fixtures/glm5/dsa-sparse")
    ap.add_argument("--out", default="fixtures/colibri/dsa-sparse-int4")
    ap.add_argument("--group", type=int, default=16)
    args = ap.parse_args()
    src, out = Path(args.src), Path(args.out)
    cfg = json.loads((src / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    n_experts = cfg["n_routed_experts"]
    w = load_file(str(src / "model.safetensors"))

    def layer_tensors(layer, want_indexer):
        names = sorted(n for n in w if layer_of(n) == layer and (".self_attn.indexer." in n) == want_indexer)
        plain = [n for n in names if not EXPERT.match(n)]
        order = []
        for n in plain:
            order.extend(encode(n, w[n], args.group))
        for e in range(n_experts if not want_indexer else 0):
            for proj in ("gate", "up", "down"):
                n = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                if n in w:
                    order.extend(encode(n, w[n], args.group))
        return order

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    split = (n_layers + 1) // 2
    shard0 = encode("model.embed_tokens.weight", w["model.embed_tokens.weight"], args.group)
    for l in range(split):
        shard0 += layer_tensors(l, False)
    shard1 = []
    for l in range(split, n_layers):
        shard1 += layer_tensors(l, False)
    shard1 += encode("model.norm.weight", w["model.norm.weight"], args.group)
    if "lm_head.weight" in w:
        shard1 += encode("lm_head.weight", w["lm_head.weight"], args.group)
    write_safetensors(out / "out-00000.safetensors", shard0)
    write_safetensors(out / "out-00001.safetensors", shard1)
    idx = []
    for l in range(n_layers):
        idx += layer_tensors(l, True)
    if idx:
        write_safetensors(out / "out-idx-00000.safetensors", idx)
    # The MTP layer (index num_hidden_layers), int8 experts as the real container has.
    mtp = [n for n in w if layer_of(n) is not None and layer_of(n) >= n_layers]
    if mtp:
        tensors = []
        for n in sorted(mtp):
            a = w[n]
            if is_f32_kept(n, a):
                tensors.append((n, a.astype(F32)))
            else:
                p, s = quant_int8_row(a)
                tensors += [(n, p), (n + ".qs", s)]
        write_safetensors(out / "out-mtp-00000.safetensors", tensors)
    written = [n for n, _ in shard0 + shard1 + idx]
    assert len(written) == len(set(written)), "a tensor was written twice"
    covered = set(written) | set(mtp)
    missing = [n for n in w if n not in covered]
    assert not missing, missing
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out}: {total} bytes in {len(list(out.iterdir()))} files")


if __name__ == "__main__":
    main()

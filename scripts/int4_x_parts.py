#!/usr/bin/env python3
"""How exactly the int4 tiles' x survives being split into parts for the tensor cores.

The one-row int4 tiles (kernels/tiles.cu) multiply int4 weights by x entered as two f16
parts (hi + lo) per 128-column chunk, scaled by a power of two. An integer-mma version would
take x as s8 limbs of a fixed step per chunk instead (u8 nibbles x s8 limbs, exact integer
sums). This prints, for both, the worst error of a 6144-term dot product against the CUDA
tests' bound (3e-5 of the sum of |terms|, crates/strata-engine/tests/cuda/products.rs), with
x Gaussian and with a few activations 100x and 1000x the rest (as LLM hidden states have).

    python3 scripts/int4_x_parts.py
"""
import numpy as np

K, CHUNK, TRIALS = 6144, 128, 20


def f16_parts(x):
    """x as the tiles take it now: per chunk, x * 2^k (max in [2^14, 2^15)) as f16 hi + lo."""
    out = np.empty_like(x)
    for c in range(0, len(x), CHUNK):
        ch = x[c : c + CHUNK]
        s = 2.0 ** (14 - np.floor(np.log2(np.abs(ch).max())))
        hi = (ch * s).astype(np.float16).astype(np.float64)
        lo = (ch * s - hi).astype(np.float16).astype(np.float64)
        out[c : c + CHUNK] = (hi + lo) / s
    return out


def s8_limbs(x, limbs):
    """x as `limbs` s8 limbs per chunk: a power-of-two step from the chunk's max, each limb
    128 times finer than the one before."""
    out = np.empty_like(x)
    for c in range(0, len(x), CHUNK):
        ch = x[c : c + CHUNK]
        unit = 2.0 ** (np.ceil(np.log2(np.abs(ch).max())) - 7)
        acc = np.zeros_like(ch)
        for _ in range(limbs):
            acc += np.clip(np.round((ch - acc) / unit), -127, 127) * unit
            unit /= 128
        out[c : c + CHUNK] = acc
    return out


def main():
    rng = np.random.default_rng(1)
    ways = {"f16 hi+lo": f16_parts, "s8 x2": lambda x: s8_limbs(x, 2), "s8 x3": lambda x: s8_limbs(x, 3)}
    print("worst |error| / sum |terms| over %d dot products of %d terms (the tests allow 3e-5):" % (TRIALS, K))
    for outlier in (1, 100, 1000):
        worst = dict.fromkeys(ways, 0.0)
        for _ in range(TRIALS):
            x = rng.standard_normal(K)
            if outlier > 1:
                x[rng.integers(0, K, 4)] *= outlier
            w = rng.integers(-8, 8, K).astype(np.float64)
            ref, mag = (w * x).sum(), np.abs(w * x).sum()
            for name, f in ways.items():
                worst[name] = max(worst[name], abs((w * f(x)).sum() - ref) / mag)
        label = "Gaussian x" if outlier == 1 else "4 activations %dx" % outlier
        print("  %-22s" % label + "  ".join("%s %.1e" % (k, v) for k, v in worst.items()))
    x = rng.standard_normal(CHUNK)
    x[5] *= 1000
    print("median error of the other elements of a chunk holding one 1000x activation:")
    for name, f in ways.items():
        rel = np.abs(f(x) - x) / np.abs(x)
        rel[5] = 0
        print("  %-10s %.1e" % (name, np.median(rel)))


if __name__ == "__main__":
    main()

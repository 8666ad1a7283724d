"""Peer benchmark: transformers (PyTorch eager) prefill and greedy decode on a CUDA GPU, on
the same checkpoint that `strata-bench decode --device cuda` measures. Usage:

    python scripts/bench_transformers_gpu.py MODEL_DIR [--dtype bfloat16|float32]
        [--prompt-tokens 64] [--decode-tokens 128] [--reps 3]
        [--attn eager|sdpa] [--experts eager|grouped_mm|batched_mm]

Prints one JSON line per repetition: prefill and decode tokens/s (CUDA-synchronised wall
time), after one untimed warm-up repetition. Random prompt ids (seed 42), KV cache on,
one sequence, no CUDA graphs, no torch.compile. The model class is the checkpoint's own
(`architectures[0]`), so Gemma 4's multimodal wrapper loads too.
"""
import argparse
import json
import time

import torch
import transformers


def once(model, ids, decode_tokens):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    cache = out.past_key_values
    t0 = time.perf_counter()
    for _ in range(decode_tokens - 1):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return prefill_s, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--experts", default="eager")
    a = ap.parse_args()
    t0 = time.time()
    kw = dict(dtype=getattr(torch, a.dtype), attn_implementation=a.attn)
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    cls = getattr(transformers, cfg.architectures[0])
    try:
        model = cls.from_pretrained(a.model, experts_implementation=a.experts, **kw)
    except (TypeError, ValueError):
        model = cls.from_pretrained(a.model, **kw)
    model = model.to("cuda").eval()
    load_s = time.time() - t0
    g = torch.Generator().manual_seed(42)
    ids = torch.randint(0, cfg.get_text_config().vocab_size, (1, a.prompt_tokens), generator=g).to("cuda")
    with torch.no_grad():
        once(model, ids, a.decode_tokens)  # warm-up
        for rep in range(a.reps):
            p, d = once(model, ids, a.decode_tokens)
            print(json.dumps({
                "engine": "transformers",
                "model": a.model,
                "dtype": a.dtype,
                "attn": a.attn,
                "experts": a.experts,
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rep": rep,
                "load_seconds": load_s,
                "prompt_tokens": a.prompt_tokens,
                "decode_tokens": a.decode_tokens,
                "prefill_tps": a.prompt_tokens / p,
                "decode_tps": (a.decode_tokens - 1) / d,
            }), flush=True)


if __name__ == "__main__":
    main()

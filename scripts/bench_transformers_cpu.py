"""Peer benchmark: transformers (PyTorch eager, CPU) decode on the same checkpoint that
`strata-bench decode` measures. Usage:

    python scripts/bench_transformers_cpu.py MODEL_DIR [--dtype bfloat16|float32] [--prompt-tokens 16] [--decode-tokens 16]

Prints JSON: prefill and decode tokens/s, torch threads, dtype. Greedy, KV cache on,
random prompt ids (seed 42), eager attention and experts.
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=16)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        a.model, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    load_s = time.time() - t0
    g = torch.Generator().manual_seed(42)
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens), generator=g)
    with torch.no_grad():
        t0 = time.time()
        out = model(ids, use_cache=True)
        prefill_s = time.time() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.time()
        for _ in range(a.decode_tokens - 1):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
        decode_s = time.time() - t0
    print(json.dumps({
        "model": a.model,
        "dtype": a.dtype,
        "torch_threads": torch.get_num_threads(),
        "load_seconds": load_s,
        "prefill_tokens_per_s": a.prompt_tokens / prefill_s,
        "decode_tokens_per_s": (a.decode_tokens - 1) / decode_s,
    }, indent=1))


if __name__ == "__main__":
    main()

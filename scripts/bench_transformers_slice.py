#!/usr/bin/env python3
"""Peer benchmark for the slice checkpoints of scripts/make_slice_checkpoint.py: transformers
(PyTorch eager, CPU, bf16, KV cache, greedy) prefill and decode on the same directory that
`strata-bench decode` measures. Loads the class named by config.json's `architectures`, so
it also takes Gemma 4's multimodal wrapper (scripts/bench_transformers_cpu.py uses
AutoModelForCausalLM and `config.vocab_size`, which the wrapper lacks).

    /tmp/gemmavenv/bin/python scripts/bench_transformers_slice.py /work/bench/glm45air-slice

Prints JSON: tokens/s, torch threads, and how many distinct tokens the greedy decode produced
(random-weight models tend to repeat a token, which makes expert routing repeat too).
"""
import argparse
import json
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    a = ap.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    cls = getattr(transformers, cfg.architectures[0])
    t0 = time.time()
    model = cls.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="eager",
                                experts_implementation="eager").eval()
    load_s = time.time() - t0
    vocab = cfg.get_text_config().vocab_size
    g = torch.Generator().manual_seed(42)
    ids = torch.randint(0, vocab, (1, a.prompt_tokens), generator=g)
    out_ids = []
    with torch.no_grad():
        t0 = time.time()
        out = model(input_ids=ids, use_cache=True)
        prefill_s = time.time() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        out_ids.append(int(nxt))
        t0 = time.time()
        for _ in range(a.decode_tokens - 1):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            out_ids.append(int(nxt))
        decode_s = time.time() - t0
    print(json.dumps({
        "model": a.model,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_seconds": load_s,
        "prefill_tokens_per_s": a.prompt_tokens / prefill_s,
        "decode_tokens_per_s": (a.decode_tokens - 1) / decode_s,
        "distinct_generated_tokens": len(set(out_ids)),
        "generated_ids": out_ids,
    }))


if __name__ == "__main__":
    main()

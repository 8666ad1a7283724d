#!/usr/bin/env python3
"""Train the strata-tiny byte-level BPE tokenizer and tokenise the corpus.

Input:  training/data/corpus.jsonl (from corpus.py)
Output: models/strata-tiny/tokenizer.json, tokenizer_config.json
        training/data/tok/train.bin        uint16 token stream (documents joined by <|endoftext|>)
        training/data/tok/val_<cat>.bin    uint16 held-out stream per category
        training/data/tok/meta.json

Special tokens (ids 0..6): <|endoftext|> [gMASK] <sop> <|system|> <|user|> <|assistant|> <|observation|>
The post-processor adds nothing: encode(text) is exactly the BPE of text.  The chat template
(GLM style) puts "[gMASK]<sop>" in front and role tokens before each turn.

A fraction of the training stream also renders Jargon File entries as chat turns
("<|user|>\nWhat does "X" mean?<|assistant|>\n<definition>"), so that the chat template
yields sensible continuations; those are labelled "derived" in meta.json.
"""
import argparse
import json
import os
import random
import re

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'observation' or message['role'] == 'tool' -%}<|observation|>\n{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{% endif -%}"
)


def chat_render(msgs, gen=False):
    s = "[gMASK]<sop>"
    for m in msgs:
        s += f"<|{m['role']}|>\n{m['content']}"
    if gen:
        s += "<|assistant|>\n"
    return s


def jargon_chat(text, rng):
    m = re.match(r":([^:\n]{1,60}):\s*(.*)", text, re.S)
    if not m:
        return None
    head, body = m.group(1).strip(), m.group(2).strip()
    # drop the part-of-speech / pronunciation line
    parts = body.split("\n\n", 1)
    if len(parts) == 2 and len(parts[0]) < 80:
        body = parts[1]
    q = rng.choice([f'What does "{head}" mean?', f"Define {head}.", f'What is "{head}" in hacker jargon?',
                    f"Explain the term {head}."])
    return chat_render([{"role": "user", "content": q}, {"role": "assistant", "content": body}]) + "<|endoftext|>"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "strata-tiny"))
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()

    docs = [json.loads(l) for l in open(os.path.join(args.data, "corpus.jsonl"))]
    train_docs = [d for d in docs if d["split"] == "train"]

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d["text"] for d in train_docs), trainer=trainer, length=len(train_docs))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    os.makedirs(args.model_dir, exist_ok=True)
    tok.save(os.path.join(args.model_dir, "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "additional_special_tokens": SPECIALS[1:],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)

    eot = tok.token_to_id("<|endoftext|>")
    rng = random.Random(0)
    out = os.path.join(args.data, "tok")
    os.makedirs(out, exist_ok=True)
    # training stream: shuffled documents, each followed by <|endoftext|>
    items = [(d["cat"], d["text"]) for d in train_docs]
    n_chat = 0
    for d in train_docs:
        if d["cat"] == "jargon" and rng.random() < 0.5:
            c = jargon_chat(d["text"], rng)
            if c:
                items.append(("derived-chat", c))
                n_chat += 1
    rng.shuffle(items)
    texts = [t for _, t in items]
    enc = tok.encode_batch(texts)
    stream = []
    counts = {}
    for (cat, t), e in zip(items, enc):
        ids = e.ids if cat == "derived-chat" else e.ids + [eot]
        stream.extend(ids)
        counts[cat] = counts.get(cat, 0) + len(ids)
    np.array(stream, dtype=np.uint16).tofile(os.path.join(out, "train.bin"))
    val_counts = {}
    cats = sorted({d["cat"] for d in docs})
    for cat in cats:
        vd = [d["text"] for d in docs if d["split"] == "val" and d["cat"] == cat]
        vs = []
        for e in tok.encode_batch(vd):
            vs.extend(e.ids + [eot])
        np.array(vs, dtype=np.uint16).tofile(os.path.join(out, f"val_{cat}.bin"))
        val_counts[cat] = len(vs)
    chars = sum(len(t) for t in texts)
    meta = {"vocab_size": tok.get_vocab_size(), "specials": SPECIALS, "train_tokens": len(stream),
            "train_tokens_per_cat": counts, "val_tokens_per_cat": val_counts, "categories": cats,
            "chars_per_token": chars / len(stream), "derived_chat_docs": n_chat}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Write strata-tiny's held-out documents as one text file per category.

Reads `corpus.jsonl` from `training/corpus.py` (documents whose id hashes into the
lowest 3% are "val" and were never trained on) and writes `<out>/<category>.txt`: the
category's held-out documents in corpus order, each followed by `<|endoftext|>`, so that
strata's tokenizer gives the same token stream as `training/tokenizer.py`'s
`val_<category>.bin` (the stream the model card's held-out tables use).

Usage:  python3 training/heldout_text.py [--data training/data] [--out training/data/heldout]
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(args.data, "heldout")
    os.makedirs(out, exist_ok=True)
    texts = {}
    with open(os.path.join(args.data, "corpus.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            if d["split"] == "val" and d["cat"] != "derived-chat":
                texts.setdefault(d["cat"], []).append(d["text"] + "<|endoftext|>")
    for cat, docs in sorted(texts.items()):
        with open(os.path.join(out, f"{cat}.txt"), "w") as f:
            f.write("".join(docs))
        print(f"{cat}: {len(docs)} documents, {sum(map(len, docs))} characters")


if __name__ == "__main__":
    main()

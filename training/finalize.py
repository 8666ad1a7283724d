#!/usr/bin/env python3
"""Turn a train_tiny.py output folder into the shipped model + parity fixtures (CPU).

  python3 training/finalize.py --run RUN_DIR [--model-dir models/strata-tiny] [--fixtures fixtures/strata-tiny]

1. merges RUN_DIR/part*.safetensors into MODEL_DIR/model.safetensors (one file, sorted keys),
   copies config.json, writes generation_config.json;
2. loads it with transformers `GlmMoeDsaForCausalLM.from_pretrained(..., attn_implementation="eager",
   dtype=float32)` and checks its logits against train_tiny's own implementation (which also
   runs the MTP layer transformers ignores);
3. writes FIXTURES/reference.safetensors (`prompt_ids_i` I64 [T], `prompt_logits_i` F32 [T, V],
   `prompt_mtp_logits_i` F32 [T-1, V] from our MTP module) and reference.json, after checking
   that the DSA top-k boundaries and router top-k boundaries have no near-ties;
4. draws the loss curve (RUN_DIR/metrics.json) to MODEL_DIR/loss_curve.png.
"""
import argparse
import glob
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import train_tiny as tt  # noqa: E402

# Fixture prompts: for each (category, token length), candidates are cut from held-out documents of
# that category, and the one whose smallest DSA-indexer and router top-k boundary gaps are largest
# is kept, with the smallest greedy-argmax margins (main and MTP logits, /10) in the same minimum
# (so a port that differs from transformers by float rounding selects the same keys and
# experts).  The bible prompt is longer than index_topk, so sparse attention is exercised.
FIXTURE_SPECS = [("fiction", 20), ("bible", 80), ("python", 32)]
N_CANDIDATES = 40


def candidates(tok, corpus, cat, n_tok, k):
    import random
    docs = [json.loads(l) for l in open(corpus)]
    docs = [d["text"] for d in docs if d["cat"] == cat and d["split"] == "val"]
    rng = random.Random(cat)
    out = []
    for _ in range(k * 5):
        d = rng.choice(docs)
        ids = tok.encode(d).ids
        if len(ids) < n_tok + 2:
            continue
        # start at a line/sentence start
        starts = [0] + [i + 1 for i, t in enumerate(ids[:-n_tok - 1]) if tok.decode([t]).endswith(("\n", ". "))]
        st = rng.choice(starts)
        text = tok.decode(ids[st: st + n_tok])
        if text.strip() and text not in out:
            out.append(text)
        if len(out) >= k:
            break
    return out


def merge(run, model_dir):
    from safetensors.torch import load_file, save_file
    sd = {}
    for p in sorted(glob.glob(os.path.join(run, "part*.safetensors"))):
        sd.update(load_file(p))
    sd = {k: sd[k].contiguous() for k in sorted(sd)}
    save_file(sd, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(run, "config.json")))
    cfg["transformers_version"] = "5.17.0"
    json.dump(cfg, open(os.path.join(model_dir, "config.json"), "w"), indent=2)
    gen = {"_from_model_config": False, "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "do_sample": False, "max_new_tokens": 128, "transformers_version": "5.17.0"}
    json.dump(gen, open(os.path.join(model_dir, "generation_config.json"), "w"), indent=2)
    return sd, cfg


def own_model(sd, cfg):
    base = {k: v for k, v in cfg.items() if k in tt.CONFIG}
    m = tt.GlmMoeDsaTiny(base)
    tt.load_hf_state_dict(m, {k: v.float() for k, v in sd.items()})
    return m.float().eval()


def boundary_gaps(model, ids):
    """Smallest gap at the DSA top-k boundary (per layer/query with more causal keys than index_topk)
    and at the router top-k boundary, over one prompt (float32)."""
    gaps = {"indexer": float("inf"), "router": float("inf")}
    hooks = []
    topk = model.cfg["index_topk"]

    def ih(mod, inp, out):
        S = out.shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        sc = out.masked_fill(~causal, float("-inf"))
        for q in range(topk, S):  # rows with > topk causal keys
            v = sc[0, q, : q + 1].sort(descending=True).values
            gaps["indexer"] = min(gaps["indexer"], float(v[topk - 1] - v[topk]))

    def rh(mod, inp, out):
        x = inp[0]
        s = torch.sigmoid(x.float() @ mod.weight.float().t()) + mod.e_score_correction_bias
        v = s.sort(-1, descending=True).values
        gaps["router"] = min(gaps["router"], float((v[:, mod.k - 1] - v[:, mod.k]).min()))

    for mod in model.modules():
        if isinstance(mod, tt.Indexer):
            hooks.append(mod.register_forward_hook(ih))
        if isinstance(mod, tt.Router):
            hooks.append(mod.register_forward_hook(rh))
    with torch.no_grad():
        logits, mtp_logits, _, _ = model(ids[None], sparse=True, mtp=True)
    for h in hooks:
        h.remove()
    for name, lg in (("argmax", logits[0]), ("mtp_argmax", mtp_logits[0])):
        t2 = lg.topk(2, dim=-1).values
        gaps[name] = float((t2[:, 0] - t2[:, 1]).min())
    return gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "strata-tiny"))
    ap.add_argument("--fixtures", default=os.path.join(ROOT, "fixtures", "strata-tiny"))
    ap.add_argument("--corpus", default=os.path.join(HERE, "data", "corpus.jsonl"))
    args = ap.parse_args()
    os.makedirs(args.model_dir, exist_ok=True)
    os.makedirs(args.fixtures, exist_ok=True)
    sd, cfg = merge(args.run, args.model_dir)
    print("merged", len(sd), "tensors")

    from tokenizers import Tokenizer
    from transformers import GlmMoeDsaForCausalLM
    tok = Tokenizer.from_file(os.path.join(args.model_dir, "tokenizer.json"))
    hf = GlmMoeDsaForCausalLM.from_pretrained(args.model_dir, attn_implementation="eager", dtype=torch.float32)
    hf.eval()
    own = own_model(sd, cfg)

    from safetensors.torch import save_file
    tensors, meta = {}, {"prompts": [], "model": "models/strata-tiny", "dtype_compute": "float32",
                         "attn_implementation": "eager", "index_topk": cfg["index_topk"],
                         "note": "prompt_logits_i: transformers GlmMoeDsaForCausalLM on CPU, float32, from the "
                                 "bf16 weights; prompt_mtp_logits_i: training/train_tiny.py's MTP module (row j "
                                 "predicts token j+2 from hidden j and token j+1)"}
    worst = 0.0
    chosen = []
    for cat, n_tok in FIXTURE_SPECS:
        best = None
        for text in candidates(tok, args.corpus, cat, n_tok, N_CANDIDATES):
            ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
            if cat == "bible" and len(ids) <= cfg["index_topk"]:
                continue
            g = boundary_gaps(own, ids)
            score = min(g["router"], g["indexer"], g["argmax"] / 10, g["mtp_argmax"] / 10)
            if best is None or score > best[0]:
                best = (score, text)
        print(f"[{cat}] best min boundary gap {best[0]:.2e}")
        chosen.append((cat, best[1]))
    for i, (cat, text) in enumerate(chosen):
        ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
            mine, mtp, _, _ = own(ids[None], sparse=True, mtp=True)
        diff = (ref - mine[0]).abs().max().item()
        worst = max(worst, diff)
        gaps = boundary_gaps(own, ids)
        top2 = ref.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1])
        print(f"prompt {i} [{cat}] T={len(ids)} max|hf-own|={diff:.2e} min argmax margin={margins.min():.4f} "
              f"median margin={margins.median():.4f} gaps={gaps}")
        tensors[f"prompt_ids_{i}"] = ids.clone()
        tensors[f"prompt_logits_{i}"] = ref.contiguous()
        tensors[f"prompt_mtp_logits_{i}"] = mtp[0].float().contiguous()
        meta["prompts"].append({"index": i, "category": cat, "text": text, "num_tokens": len(ids),
                                "exceeds_index_topk": len(ids) > cfg["index_topk"],
                                "max_abs_diff_hf_vs_train_tiny": diff,
                                "min_argmax_margin": float(margins.min()),
                                "median_argmax_margin": float(margins.median()),
                                "min_indexer_topk_boundary_gap": (gaps["indexer"] if gaps["indexer"] != float("inf")
                                                                  else None),  # None: T <= index_topk (dense)
                                "min_router_topk_boundary_gap": gaps["router"],
                                "greedy_next": tok.decode([int(ref[-1].argmax())])})
    save_file(tensors, os.path.join(args.fixtures, "reference.safetensors"), metadata={"format": "pt"})
    json.dump(meta, open(os.path.join(args.fixtures, "reference.json"), "w"), indent=1)
    print(f"worst |hf - own| = {worst:.3e}")

    mp = os.path.join(args.run, "metrics.json")
    if os.path.exists(mp):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            m = json.load(open(mp))
            c = m["curve"]
            fig, ax = plt.subplots(1, 2, figsize=(11, 4))
            ax[0].plot([p["tokens"] / 1e6 for p in c], [p["loss"] for p in c], label="train next-token")
            ax[0].plot([p["tokens"] / 1e6 for p in c], [p["mtp_loss"] for p in c], label="train MTP (next-next)")
            ax[0].plot([p["tokens"] / 1e6 for p in m["val_curve"]], [p["val_loss_mean_over_cats"] for p in m["val_curve"]],
                       "o-", label="held-out next-token (mean over categories)")
            ax[0].set_xlabel("tokens seen (M)")
            ax[0].set_ylabel("cross-entropy (nats)")
            ax[0].set_ylim(1.5, 9.5)
            ax[0].legend()
            ax[0].grid(alpha=0.3)
            ax[1].plot([p["tokens"] / 1e6 for p in c], [p["indexer_kl"] for p in c])
            ax[1].set_xlabel("tokens seen (M)")
            ax[1].set_ylabel("DSA indexer KL (summed over layers)")
            ax[1].set_yscale("log")
            ax[1].grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(os.path.join(args.model_dir, "loss_curve.png"), dpi=80)
            print("wrote loss_curve.png")
        except ImportError:
            print("matplotlib missing: no figure")


if __name__ == "__main__":
    main()

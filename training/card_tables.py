#!/usr/bin/env python3
"""Print the MODEL_CARD.md tables from a train_tiny.py run (metrics.json) and the corpus metadata,
and draw models/strata-tiny/routing.png (per-category expert usage per MoE layer).

  python3 training/card_tables.py --run RUN_DIR
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", default=os.path.join(HERE, "data"))
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "strata-tiny"))
    a = ap.parse_args()
    m = json.load(open(os.path.join(a.run, "metrics.json")))
    prov = json.load(open(os.path.join(a.data, "provenance.json")))
    meta = json.load(open(os.path.join(a.data, "tok", "meta.json")))

    print("## corpus\n| category | documents | characters | train tokens | held-out docs | held-out tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for c, s in prov["categories"].items():
        print(f"| {c} | {s['docs']:,} | {s['chars']:,} | {meta['train_tokens_per_cat'].get(c, 0):,} | "
              f"{s['val_docs']:,} | {meta['val_tokens_per_cat'].get(c, 0):,} |")
    print(f"| derived-chat (Jargon entries as chat turns) | {meta['derived_chat_docs']} | | "
          f"{meta['train_tokens_per_cat']['derived-chat']:,} | | |")
    print(f"| **total** | | | {meta['train_tokens']:,} | | |\n")

    print("## eval\n| category | held-out tokens | loss (nats) | perplexity | MTP loss | MTP acceptance (= main greedy) "
          "| MTP top-1 (= true t+2) | main top-1 at t+2 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ev = m["eval"]
    tot = {k: 0.0 for k in ("n", "loss", "acc", "mt", "mm")}
    for c, v in ev.items():
        print(f"| {c} | {v['val_tokens']:,} | {v['loss']:.3f} | {v['ppl']:.2f} | {v['mtp_loss']:.3f} | "
              f"{v['mtp_accept_vs_main_greedy']:.3f} | {v['mtp_top1_vs_true']:.3f} | "
              f"{v['main_top1_vs_true_next_next_position']:.3f} |")
        n = v["val_tokens"]
        tot["n"] += n
        tot["loss"] += v["loss"] * n
        tot["acc"] += v["mtp_accept_vs_main_greedy"] * n
        tot["mt"] += v["mtp_top1_vs_true"] * n
        tot["mm"] += v["main_top1_vs_true_next_next_position"] * n
    import math
    n = tot["n"]
    print(f"| **all (token-weighted)** | {int(n):,} | {tot['loss'] / n:.3f} | {math.exp(tot['loss'] / n):.2f} | | "
          f"{tot['acc'] / n:.3f} | {tot['mt'] / n:.3f} | {tot['mm'] / n:.3f} |\n")

    r = m["routing"]
    layers = [str(l) for l in r["layers"]]
    print("## top experts (4 most used, by count of top-k selections on the held-out text)")
    print("| category | " + " | ".join(f"layer {l}" + (" (MTP)" if int(l) == m["config"]["num_hidden_layers"] else "")
                                      for l in layers) + " |")
    print("|---|" + "---|" * len(layers))
    for c, d in r["top_experts"].items():
        print(f"| {c} | " + " | ".join(",".join(map(str, d[l])) for l in layers) + " |")
    print("\n## JSD\n| layer | mean pairwise JSD between categories (nats) | same, category labels shuffled over 256-token windows | ratio | top expert's share (max over categories) |")
    print("|---|---:|---:|---:|---:|")
    for l in layers:
        mx = max(max(r["usage"][c][l]) for c in r["usage"])
        print(f"| {l} | {r['jsd'][l]:.4f} | {r['jsd_shuffled'][l]:.4f} | {r['jsd'][l] / r['jsd_shuffled'][l]:.0f}x | "
              f"{mx:.3f} (uniform: {1 / len(r['usage'][next(iter(r['usage']))][l]):.3f}) |")
    print("\n## samples")
    for s in m["samples"]:
        print(f"**[{s['category']}]** prompt `{s['prompt']!r}`\n\n```\n{s['prompt']}{s['completion']}\n```\n")
    print(f"steps {m['steps']} chosen {m['chosen_step']} tokens {m['tokens']:,} time {m['train_time_s']:.1f}s "
          f"batch {m['batch']}x{m['seq']} lr {m['lr']} dropout {m.get('dropout')} params {m['params']:,} "
          f"bytes {m['weight_bytes']:,} idx-mass {m['indexer_topk_mass_kept']:.3f} device {m['device']} torch {m['torch']}")
    c = m["curve"]
    print("\n## loss table\n| step | tokens (M) | time (s) | train loss | train MTP loss | indexer KL | held-out loss |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    vc = {v["step"]: v["val_loss_mean_over_cats"] for v in m["val_curve"]}
    for p in c:
        if p["step"] in (1, 100, 250) or p["step"] % 500 == 0 or p is c[-1]:
            near = min(vc, key=lambda s: abs(s - p["step"]))
            vl = f"{vc[near]:.3f} (step {near})" if abs(near - p["step"]) <= 125 else ""
            print(f"| {p['step']} | {p['tokens'] / 1e6:.1f} | {p['time_s']} | {p['loss']:.3f} | {p['mtp_loss']:.3f} | "
                  f"{p['indexer_kl']:.3f} | {vl} |")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        cats = list(r["usage"])
        fig, axs = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.6))
        for ax, l in zip(axs, layers):
            u = np.array([r["usage"][c][l] for c in cats])
            ax.imshow(u, aspect="auto", cmap="viridis", vmin=0, vmax=max(0.2, u.max()))
            ax.set_title(f"layer {l}" + (" (MTP)" if int(l) == m["config"]["num_hidden_layers"] else ""))
            ax.set_xlabel("expert")
            ax.set_yticks(range(len(cats)))
            ax.set_yticklabels(cats if l == layers[0] else [""] * len(cats))
        fig.suptitle("share of top-k selections per expert, held-out text by category")
        fig.tight_layout()
        fig.savefig(os.path.join(a.model_dir, "routing.png"), dpi=70)
    except ImportError:
        pass


if __name__ == "__main__":
    main()

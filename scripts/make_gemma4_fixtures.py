#!/usr/bin/env python3
"""Generate the Gemma 4 parity fixtures under fixtures/gemma4/<name>/.

Reference: Hugging Face transformers `Gemma4ForCausalLM` / `Gemma4ForConditionalGeneration`,
CPU, float32, eager attention and experts. CI never runs this script; it is committed so the
fixtures can be regenerated:

    /tmp/torchvenv/bin/python scripts/make_gemma4_fixtures.py            # all fixtures
    /tmp/torchvenv/bin/python scripts/make_gemma4_fixtures.py dense-ple  # just one

Requirements: torch, transformers (>= 5.24), safetensors, tokenizers. The tokenizer is the
GLM-5 fixtures' small BPE (scripts/make_glm5_fixtures.py): parity does not depend on which
tokenizer made the ids.

Each directory holds config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, reference.safetensors (prompt_ids, prompt_logits, generated_ids,
generated_logits) and reference.json (prompt, seed, margins, versions).

Fixtures (every prompt is longer than the sliding window of 8, and decoding runs 32 more):
  dense-ple  `gemma4_text`: 6 layers (sliding, sliding, full, sliding, sliding, full), sliding
             head_dim 16 / full 32, Per-Layer Embeddings (8 per layer), the last 2 layers share
             the K/V of layers 3 and 2 (double-wide MLP there), proportional RoPE on full
             layers, final logit soft cap 5 (logits are O(1) here), random layer scalars, tied
             embeddings.
  moe        `gemma4` (the multimodal wrapper, text only: weights under model.language_model.):
             the 26B-A4B block: a dense GELU MLP in parallel with 8 GELU experts (top-2, softmax
             router with learned scale and per-expert scales), attention_k_eq_v on full layers
             with 1 global KV head, no PLE, 5 layers (s, s, f, s, f), soft cap 30.

Seeds are searched until the greedy top-1/top-2 gap and every router decision (the log-prob gap
at the top-k boundary) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm5_fixtures as g5  # noqa: E402  (tokenizer, tokenizer_config)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "fixtures", "gemma4")
N_NEW = 32
MARGIN = 1e-3
MIN_DISTINCT = 12  # generated tokens: a decode that repeats one token tests little

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
)

S, F = "sliding_attention", "full_attention"

FIXTURES = {
    "dense-ple": dict(
        wrapper=False, seed=100,
        cfg=dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], hidden_size_per_layer_input=8,
                 vocab_size_per_layer_input=512, num_kv_shared_layers=2, use_double_wide_mlp=True,
                 final_logit_softcapping=5.0),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "moe": dict(
        wrapper=True, seed=200,
        cfg=dict(num_hidden_layers=5, layer_types=[S, S, F, S, F], hidden_size_per_layer_input=0,
                 intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                 enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def make_config(spec, tok):
    kw = copy.deepcopy(BASE)
    kw.update(spec["cfg"])
    eos = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|user|>")]
    kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
    text = Gemma4TextConfig(**kw)
    if not spec["wrapper"]:
        return text
    return Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)


def new_model(cfg, wrapper):
    model = Gemma4ForConditionalGeneration(cfg) if wrapper else Gemma4ForCausalLM(cfg)
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.float().eval()


def text_config(model):
    return model.config.get_text_config()


@torch.no_grad()
def init_random(model, seed):
    """Random weights with O(1) activations so decisions are well separated."""
    g = torch.Generator().manual_seed(seed)
    tc = text_config(model)

    def randn(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, p in model.named_parameters():
        shp = p.shape
        if name.endswith("embed_tokens.weight"):
            # The tied head too (its inputs are normed); inputs are scaled by sqrt(hidden).
            p.copy_(randn(shp, 0.75 / math.sqrt(shp[1])))
        elif name.endswith("embed_tokens_per_layer.weight"):
            p.copy_(randn(shp, 1.0 / math.sqrt(tc.hidden_size_per_layer_input)))
        elif name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
            # Attention scaling is 1: smaller q/k keep the softmax from saturating (and
            # the reference's own cache / no-cache paths within 1e-5 of each other).
            p.copy_(0.5 * (1.0 + randn(shp, 0.1)))
        elif "norm" in name and "post_" in name:
            # Sublayer outputs outweigh the token's own embedding in the residual (with a
            # tied head the model would otherwise repeat its input).
            p.copy_(3.0 * (1.0 + randn(shp, 0.1)))
        elif "norm" in name or name.endswith("router.scale"):
            p.copy_(1.0 + randn(shp, 0.1))
        elif name.endswith("router.per_expert_scale"):
            p.copy_(1.0 + randn(shp, 0.2))
        elif name.endswith("router.proj.weight"):
            p.copy_(randn(shp, 3.0))
        elif p.dim() >= 2:
            p.copy_(randn(shp, 1.2 / math.sqrt(shp[-1])))
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(shp)}")
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
    # EOS ids and the unused vocab tail never win greedy decoding (see make_glm5_fixtures.py).
    rows = [i for i in range(tc.vocab_size) if i >= g5.TOKENIZER_VOCAB or i in list(tc.eos_token_id)]
    model.get_input_embeddings().weight[rows] *= 0.1


class RouterMargins:
    """Forward hooks on every router: the smallest log-probability gap at a top-k boundary."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "Gemma4TextRouter"]

    def hook(self, name):
        def f(mod, _inputs, out):
            probs = out[0].float()
            k = mod.config.top_k_experts
            top = probs.sort(dim=-1, descending=True)[0]
            gaps = torch.log(top[:, k - 1]) - torch.log(top[:, k])
            self.rows += probs.shape[0]
            gap, at = gaps.min(0)
            if float(gap) < self.min[0]:
                self.min = (float(gap), name)
        return f

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def run_reference(model, prompt_ids):
    T = prompt_ids.numel()
    ids = prompt_ids[None]
    tc = text_config(model)
    rec = RouterMargins(model)
    try:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
            min_new_tokens=N_NEW, output_logits=True, return_dict_in_generate=True, use_cache=True,
            eos_token_id=list(tc.eos_token_id), pad_token_id=tc.pad_token_id,
        )
        gen_ids = out.sequences[0, T:].clone()
        gen_logits = torch.stack([l[0] for l in out.logits]).float()
        prompt_logits = model(input_ids=ids, use_cache=False).logits[0].float()
        full = model(input_ids=out.sequences, use_cache=False).logits[0].float()
    finally:
        rec.remove()
    top2 = torch.topk(torch.cat([gen_logits, full[T - 1:T - 1 + N_NEW]]), 2, dim=-1).values
    return dict(
        prompt_logits=prompt_logits, gen_ids=gen_ids, gen_logits=gen_logits, router=rec,
        greedy_min=(top2[:, 0] - top2[:, 1]).min().item(),
        argmax_ok=bool((gen_logits.argmax(-1) == gen_ids).all() and (full[T - 1:T - 1 + N_NEW].argmax(-1) == gen_ids).all()),
        row0_diff=(gen_logits[0] - prompt_logits[-1]).abs().max().item(),
        full_vs_cache_diff=(full[T - 1:T - 1 + N_NEW] - gen_logits).abs().max().item(),
    )


def problems(res, moe):
    p = []
    if not res["argmax_ok"]:
        p.append("generated token != argmax(raw logits)")
    if res["greedy_min"] <= MARGIN:
        p.append(f"greedy margin {res['greedy_min']:.2e}")
    if moe and res["router"].min[0] <= MARGIN:
        p.append(f"router margin {res['router'].min[0]:.2e}")
    if len(set(res["gen_ids"].tolist())) < MIN_DISTINCT:
        p.append(f"only {len(set(res['gen_ids'].tolist()))} distinct generated tokens")
    if res["full_vs_cache_diff"] > 1e-5 or res["row0_diff"] > 1e-5:
        p.append(f"cache/no-cache logits differ by {res['full_vs_cache_diff']:.2e}")
    return p


def write_json(path, obj):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def build_fixture(name, spec, tok, tok_json_path):
    t0 = time.time()
    prompt_ids = torch.tensor(tok.encode(spec["prompt"]).ids, dtype=torch.long)
    cfg = make_config(spec, tok)
    tc = cfg.get_text_config()
    assert prompt_ids.numel() > tc.sliding_window, "the prompt must be longer than the sliding window"
    moe = bool(tc.enable_moe_block)
    seed, attempts = spec["seed"], 0
    while True:
        attempts += 1
        assert attempts <= 2000, f"{name}: no tie-free seed found"
        model = new_model(copy.deepcopy(cfg), spec["wrapper"])
        init_random(model, seed)
        res = run_reference(model, prompt_ids)
        bad = problems(res, moe)
        if not bad:
            break
        print(f"  [{name}] seed {seed} rejected: {'; '.join(bad)}", flush=True)
        seed += 1
    out_dir = os.path.join(OUT_ROOT, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        disk = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                disk.update(load_file(os.path.join(d, f)))
        shutil.copy(os.path.join(d, "config.json"), os.path.join(out_dir, "config.json"))
    save_file({k: v.contiguous() for k, v in sorted(disk.items())}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    write_json(os.path.join(out_dir, "generation_config.json"), {
        "_from_model_config": False, "eos_token_id": list(tc.eos_token_id),
        "pad_token_id": tc.pad_token_id, "do_sample": True, "temperature": 1.0, "top_p": 0.95,
        "transformers_version": transformers.__version__,
    })
    shutil.copy(tok_json_path, os.path.join(out_dir, "tokenizer.json"))
    write_json(os.path.join(out_dir, "tokenizer_config.json"), g5.tokenizer_config(tok))
    save_file({
        "prompt_ids": prompt_ids.contiguous(),
        "prompt_logits": res["prompt_logits"].contiguous(),
        "generated_ids": res["gen_ids"].long().contiguous(),
        "generated_logits": res["gen_logits"].contiguous(),
    }, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})
    # Reload from disk and check the reference again.
    cls = Gemma4ForConditionalGeneration if spec["wrapper"] else Gemma4ForCausalLM
    m2 = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        d1 = (m2(input_ids=prompt_ids[None], use_cache=False).logits[0].float() - res["prompt_logits"]).abs().max().item()
    assert d1 <= 1e-5, f"reload differs by {d1}"
    write_json(os.path.join(out_dir, "reference.json"), {
        "config_name": name, "prompt": spec["prompt"], "prompt_num_tokens": prompt_ids.numel(), "seed": seed,
        "seed_attempts": attempts, "weights_dtype": "float32", "compute_dtype": "float32",
        "sliding_window": tc.sliding_window,
        "generated_text": tok.decode(res["gen_ids"].tolist(), skip_special_tokens=False),
        "num_new_tokens": N_NEW,
        "margins": {"required": MARGIN, "router_min_log_prob_gap": res["router"].min[0] if moe else None,
                    "router_min_where": res["router"].min[1], "router_rows_checked": res["router"].rows,
                    "greedy_min_top1_minus_top2": res["greedy_min"]},
        "checks": {"generated_logits_row0_vs_prompt_logits_last_maxabs": res["row0_diff"],
                   "nocache_forward_vs_generated_logits_maxabs": res["full_vs_cache_diff"], "reload_maxabs": d1},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
    })
    print(f"  [{name}] seed {seed} after {attempts} attempt(s), {time.time() - t0:.1f}s; router gap "
          f"{res['router'].min[0]:.3g}, greedy gap {res['greedy_min']:.3g}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(FIXTURES))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    tok = g5.build_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok_path = os.path.join(d, "tokenizer.json")
        tok.save(tok_path)
        for name in args.names:
            print(f"building {name}", flush=True)
            build_fixture(name, FIXTURES[name], tok, tok_path)


if __name__ == "__main__":
    main()

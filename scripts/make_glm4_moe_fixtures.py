#!/usr/bin/env python3
"""Generate the GLM-4.5 (`glm4_moe`) parity fixtures under fixtures/glm4_moe/<name>/.

Reference: Hugging Face transformers `Glm4MoeForCausalLM`, CPU, float32, eager attention and
experts. CI never runs this script; it is committed so the fixtures can be regenerated:

    python scripts/make_glm4_moe_fixtures.py            # all fixtures
    python scripts/make_glm4_moe_fixtures.py gqa-bias   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers. The tokenizer and chat
template are the GLM-5 fixtures' (scripts/make_glm5_fixtures.py).

Each directory holds config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, reference.safetensors (prompt_ids, prompt_logits, generated_ids,
generated_logits) and reference.json (prompt, seed, margins, versions).

Fixtures:
  gqa-bias  f32; 2 KV heads for 4 query heads, q/k/v biases, per-head q/k RMSNorm, RoPE on half of
            each head, 8 experts in 2 groups (topk_group 1), top-2, one dense layer first.
  bf16-mha  bf16 weights (reference in f32 from the rounded weights); no biases, no q/k norm,
            4 KV heads (plain MHA), partial_rotary_factor 0.25, tied embeddings, 2 dense layers.

Seeds are searched until the greedy top-1/top-2 gap and every router decision (group choice and
expert top-k boundary) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
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
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm5_fixtures as g5  # noqa: E402  (tokenizer, tokenizer_config, chat template)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_ROOT = os.path.join(REPO, "fixtures", "glm4_moe")
N_NEW = 32
MARGIN = 1e-3

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    hidden_act="silu",
    tie_word_embeddings=False,
)

FIXTURES = {
    "gqa-bias": dict(
        dtype="float32", seed=100,
        cfg=dict(attention_bias=True, use_qk_norm=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "bf16-mha": dict(
        dtype="bfloat16", seed=200,
        cfg=dict(attention_bias=False, use_qk_norm=False, num_key_value_heads=4, num_hidden_layers=4,
                 first_k_dense_replace=2, n_group=1, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def make_config(spec, tok):
    kw = dict(BASE)
    kw.update(spec["cfg"])
    eos = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|user|>")]
    kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
    return Glm4MoeConfig(**kw)


def new_model(cfg, cls=Glm4MoeForCausalLM):
    """A `cls` model with eager attention and experts, in f32, for inference."""
    model = cls(cfg)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    return model.float().eval()


@torch.no_grad()
def init_random(model, seed):
    """Random weights with O(1) activations so decisions are well separated."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, p in model.named_parameters():
        shp = p.shape
        if "norm" in name:
            p.copy_(1.0 + randn(shp, 0.1))
        elif name.endswith(".bias"):
            p.copy_(randn(shp, 0.3))
        elif name.endswith("embed_tokens.weight"):
            # A tied table is also the head: scaled like one (inputs are normed anyway).
            p.copy_(randn(shp, 1.5 / math.sqrt(shp[1]) if model.config.tie_word_embeddings else 1.0))
        elif name.endswith("lm_head.weight"):
            p.copy_(randn(shp, 1.5 / math.sqrt(shp[1])))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(randn(shp, 3.0 / math.sqrt(shp[1])))
        elif p.dim() >= 2:
            p.copy_(randn(shp, 1.2 / math.sqrt(shp[-1])))
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(shp)}")
    # EOS ids and the unused vocab tail never win greedy decoding (see make_glm5_fixtures.py).
    rows = [i for i in range(model.config.vocab_size)
            if i >= g5.TOKENIZER_VOCAB or i in list(model.config.eos_token_id)]
    head = model.lm_head.weight if not model.config.tie_word_embeddings else model.model.embed_tokens.weight
    head[rows] *= 0.1
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.rand(b.shape, generator=g) - 0.5) * 1.5)


class RouterMargins:
    """Forward hooks on every router: the smallest gap at each routing decision."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ in ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter")]

    def hook(self, name):
        def f(mod, inputs, _out):
            x = inputs[0].reshape(-1, mod.weight.shape[1]).float()
            s = torch.sigmoid(x @ mod.weight.float().t()) + mod.e_score_correction_bias
            ng, per = mod.num_group, mod.num_experts // mod.num_group
            for r in range(s.shape[0]):
                row = s[r]
                if ng > 1:
                    gs = row.view(ng, per).topk(2, dim=-1)[0].sum(-1).sort(descending=True)[0]
                    self.note(gs[mod.topk_group - 1] - gs[mod.topk_group], name)
                    keep = row.view(ng, per).topk(2, dim=-1)[0].sum(-1).topk(mod.topk_group)[1]
                    row = torch.cat([row.view(ng, per)[gi] for gi in keep.tolist()])
                top = row.sort(descending=True)[0]
                self.note(top[mod.top_k - 1] - top[mod.top_k], name)
                self.rows += 1
        return f

    def note(self, gap, where):
        gap = float(gap)
        if gap < self.min[0]:
            self.min = (gap, where)

    def remove(self):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def run_reference(model, prompt_ids, margins=None):
    T = prompt_ids.numel()
    ids = prompt_ids[None]
    rec = (margins or RouterMargins)(model)
    try:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW,
            min_new_tokens=N_NEW, output_logits=True, return_dict_in_generate=True, use_cache=True,
            eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id,
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


@torch.no_grad()
def quantize_fp8(model):
    """Stores the weights GLM-5's fixtures store as FP8 (attention, dense MLP, experts) in
    128x128 blocks with `weight_scale_inv`, and loads the dequantized values back into
    `model` so the reference is computed from exactly what the checkpoint holds."""
    disk, _ = g5.disk_state_dict(model)
    out, deq = {}, {}
    for k, v in disk.items():
        if g5.is_fp8_target(k):
            q, s = g5.fp8_quantize(v)
            out[k], out[k + "_scale_inv"], deq[k] = q, s, g5.fp8_dequantize(q, s)
        else:
            out[k] = v.contiguous()
    g5.load_disk_into_model(model, {**disk, **deq})
    return out


def dequantize_fp8(disk):
    return {k: (g5.fp8_dequantize(v, disk[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v.float())
            for k, v in disk.items() if not k.endswith("_scale_inv")}


def added_tokens(tok, special, plain):
    """`added_tokens_decoder` for the tokenizer's added tokens: `special` ones and `plain`
    (not special) ones, by id."""
    return {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": t not in plain}
            for t in list(special) + list(plain)}


def problems(res):
    p = []
    if not res["argmax_ok"]:
        p.append("generated token != argmax(raw logits)")
    if res["greedy_min"] <= MARGIN:
        p.append(f"greedy margin {res['greedy_min']:.2e}")
    if res["router"].min[0] <= MARGIN:
        p.append(f"router margin {res['router'].min[0]:.2e}")
    if res["full_vs_cache_diff"] > 1e-5 or res["row0_diff"] > 1e-5:
        p.append(f"cache/no-cache logits differ by {res['full_vs_cache_diff']:.2e}")
    return p


def write_json(path, obj):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


class Family:
    """What build_fixture needs of a family (make_qwen3_moe_fixtures.py brings its own)."""
    cls = Glm4MoeForCausalLM
    out_root = OUT_ROOT
    margins = None  # RouterMargins, set below

    @staticmethod
    def make_config(spec, tok):
        return make_config(spec, tok)

    @classmethod
    def new_model(cls, cfg):
        return new_model(cfg, cls.cls)

    @staticmethod
    def init_random(model, seed):
        init_random(model, seed)

    @staticmethod
    def tokenizer_config(tok):
        return g5.tokenizer_config(tok)


def build_fixture(name, spec, tok, tok_json_path, fam=Family):
    t0 = time.time()
    prompt_ids = torch.tensor(tok.encode(spec["prompt"]).ids, dtype=torch.long)
    cfg = fam.make_config(spec, tok)
    seed, attempts = spec["seed"], 0
    while True:
        attempts += 1
        assert attempts <= 2000, f"{name}: no tie-free seed found"
        model = fam.new_model(copy.deepcopy(cfg))
        fam.init_random(model, seed)
        fp8_disk = None
        if spec["dtype"] == "bfloat16":
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        elif spec["dtype"] == "fp8":
            fp8_disk = quantize_fp8(model)
        res = run_reference(model, prompt_ids, fam.margins)
        bad = problems(res)
        if not bad:
            break
        print(f"  [{name}] seed {seed} rejected: {'; '.join(bad)}", flush=True)
        seed += 1
    out_dir = os.path.join(fam.out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        disk = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                disk.update(load_file(os.path.join(d, f)))
        shutil.copy(os.path.join(d, "config.json"), os.path.join(out_dir, "config.json"))
    if spec["dtype"] == "bfloat16":
        disk = {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in disk.items()}
    elif fp8_disk is not None:
        disk = fp8_disk
    save_file({k: v.contiguous() for k, v in sorted(disk.items())}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    cj = json.load(open(os.path.join(out_dir, "config.json")))
    cj["dtype"] = "float32" if fp8_disk is not None else spec["dtype"]
    if fp8_disk is not None:
        cj["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [g5.FP8_BLOCK, g5.FP8_BLOCK]}
    cj.update(spec.get("config_extra", {}))
    write_json(os.path.join(out_dir, "config.json"), cj)
    write_json(os.path.join(out_dir, "generation_config.json"), {
        "_from_model_config": False, "eos_token_id": list(model.config.eos_token_id),
        "pad_token_id": model.config.pad_token_id, "do_sample": True, "temperature": 1.0, "top_p": 0.95,
        "transformers_version": transformers.__version__,
    })
    shutil.copy(tok_json_path, os.path.join(out_dir, "tokenizer.json"))
    write_json(os.path.join(out_dir, "tokenizer_config.json"), fam.tokenizer_config(tok))
    save_file({
        "prompt_ids": prompt_ids.contiguous(),
        "prompt_logits": res["prompt_logits"].contiguous(),
        "generated_ids": res["gen_ids"].long().contiguous(),
        "generated_logits": res["gen_logits"].contiguous(),
    }, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})
    # Reload from disk and check the reference again (an FP8 checkpoint dequantized here:
    # transformers' FP8 loader needs a GPU).
    if fp8_disk is None:
        m2 = fam.cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                     experts_implementation="eager").eval()
    else:
        m2 = fam.new_model(copy.deepcopy(model.config))
        g5.load_disk_into_model(m2, dequantize_fp8(load_file(os.path.join(out_dir, "model.safetensors"))))
    with torch.no_grad():
        d1 = (m2(input_ids=prompt_ids[None], use_cache=False).logits[0].float() - res["prompt_logits"]).abs().max().item()
    assert d1 <= 1e-5, f"reload differs by {d1}"
    write_json(os.path.join(out_dir, "reference.json"), {
        "config_name": name, "prompt": spec["prompt"], "prompt_num_tokens": prompt_ids.numel(), "seed": seed,
        "seed_attempts": attempts, "weights_dtype": spec["dtype"], "compute_dtype": "float32",
        "expert_layout_on_disk": "as save_pretrained writes it: " + (
            "per-expert" if any(".experts.0." in k for k in disk) else "fused"),
        "generated_text": tok.decode(res["gen_ids"].tolist(), skip_special_tokens=False),
        "num_new_tokens": N_NEW,
        "margins": {"required": MARGIN, "router_min_gap": res["router"].min[0], "router_min_where": res["router"].min[1],
                    "router_rows_checked": res["router"].rows, "greedy_min_top1_minus_top2": res["greedy_min"]},
        "checks": {"generated_logits_row0_vs_prompt_logits_last_maxabs": res["row0_diff"],
                   "nocache_forward_vs_generated_logits_maxabs": res["full_vs_cache_diff"], "reload_maxabs": d1},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
    })
    print(f"  [{name}] seed {seed} after {attempts} attempt(s), {time.time() - t0:.1f}s; router gap "
          f"{res['router'].min[0]:.3g}, greedy gap {res['greedy_min']:.3g}", flush=True)


def run_main(doc, fixtures, build_tokenizer, fam):
    """The fixture scripts' command line: build the named fixtures (default all)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(fixtures))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    tok = build_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok_path = os.path.join(d, "tokenizer.json")
        tok.save(tok_path)
        for name in args.names:
            print(f"building {name}", flush=True)
            # `fam`: the family, or a function of the fixture's spec naming its family.
            f = fam if isinstance(fam, type) else fam(fixtures[name])
            build_fixture(name, fixtures[name], tok, tok_path, f)


def main():
    run_main(__doc__, FIXTURES, g5.build_tokenizer, Family)


if __name__ == "__main__":
    main()

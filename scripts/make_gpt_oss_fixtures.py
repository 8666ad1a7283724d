#!/usr/bin/env python3
"""Generate the gpt-oss (`gpt_oss`) parity fixtures under fixtures/gpt_oss/<name>/.

Reference: Hugging Face transformers `GptOssForCausalLM`, CPU, float32, eager attention and
experts. CI never runs this script; it is committed so the fixtures can be regenerated:

    python scripts/make_gpt_oss_fixtures.py              # all fixtures
    python scripts/make_gpt_oss_fixtures.py mxfp4-yarn   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers. The tokenizer is the GLM-5
fixtures' BPE (scripts/make_glm5_fixtures.py) with harmony's special tokens appended; the chat
template is gpt-oss's official one (fixtures/chat_templates/templates/gpt-oss.jinja).

Fixtures:
  mxfp4-yarn  f32 dense part; the experts stored as the released checkpoints store them, MXFP4
              (`*_blocks` u8 nibbles [E, rows, cols/32, 16], `*_scales` u8 e8m0 [E, rows, cols/32],
              gate and up rows interleaved; f32 biases); the reference runs on the dequantized
              nibbles. YaRN (factor 4 over 32 original positions, no truncation),
              sliding window 6 on layers 0 and 2, sinks, biases everywhere, 8 experts top-2.
  bf16-plain  bf16 weights (reference in f32 from the rounded weights), the experts in
              transformers' own fused layout (`gate_up_proj [E, H, 2I]`); plain RoPE, 3 layers
              typed full/sliding/sliding, top-3 of 16 experts.

The experts' gate/up weights are drawn large enough that the clamped SwiGLU's limit (7) is
crossed. Seeds are searched until the greedy top-1/top-2 gap and every router top-k boundary (in
biased logits) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
"""

import copy
import json
import math
import os
import sys

import torch
from tokenizers import AddedToken
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_glm5_fixtures as g5  # noqa: E402  (the tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "fixtures", "chat_templates", "templates", "gpt-oss.jinja")
SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=6,
    rms_norm_eps=1e-5,
    max_position_embeddings=1024,
    hidden_act="silu",
    tie_word_embeddings=False,
)

FIXTURES = {
    "mxfp4-yarn": dict(
        dtype="mxfp4", seed=700,
        cfg=dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "bf16-plain": dict(
        dtype="bfloat16", seed=800,
        cfg=dict(num_hidden_layers=3, num_local_experts=16, num_experts_per_tok=3, intermediate_size=48,
                 layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def build_tokenizer():
    tok = g5.build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def mxfp4_quantize(w):
    """`w [E, rows, cols]` (out x in) -> (blocks [E, rows, cols/32, 16] u8, scales [E, rows, cols/32]
    u8, dequantized f32). Each group of 32 takes the least power of two that keeps it within
    FP4's +-6; each value the nearest FP4 code (low nibble = even column)."""
    E, rows, cols = w.shape
    g = w.reshape(E, rows, cols // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    scale = torch.pow(2.0, exp)
    codes = (g / scale).unsqueeze(-1).sub(FP4).abs().argmin(-1).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    deq = (FP4[codes.long()] * scale).reshape(E, rows, cols)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous(), deq


def mxfp4_dequantize(blocks, scales):
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.stack([FP4[lo], FP4[hi]], -1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.float() - 127.0).unsqueeze(-1)
    return vals.reshape(blocks.shape[0], blocks.shape[1], -1)


@torch.no_grad()
def quantize_experts(model):
    """Stores the experts as MXFP4 (out x in, as the released checkpoints do) and loads the
    dequantized values back into `model`: the reference runs on exactly the stored nibbles."""
    disk, _ = g5.disk_state_dict(model)
    out = {}
    for k, v in disk.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            blocks, scales, deq = mxfp4_quantize(v.transpose(1, 2).float())
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales
            model.get_parameter(k).copy_(deq.transpose(1, 2))
        else:
            out[k] = v.contiguous()
    return out


def dequantize_experts(disk):
    out = {}
    for k, v in disk.items():
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            out[base] = mxfp4_dequantize(v, disk[base + "_scales"]).transpose(1, 2).contiguous()
        elif not k.endswith("_scales"):
            out[k] = v.float()
    return out


class Family(g4.Family):
    cls = GptOssForCausalLM
    out_root = os.path.join(REPO, "fixtures", "gpt_oss")

    @staticmethod
    def make_config(spec, tok):
        kw = dict(BASE)
        kw.update(spec["cfg"])
        eos = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
        kw.update(eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
        return GptOssConfig(**kw)

    @staticmethod
    @torch.no_grad()
    def init_random(model, seed):
        """Random weights with O(1) activations so decisions are well separated; the experts'
        gate/up products large enough to cross the clamp."""
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            shp = p.shape
            if "norm" in name:
                p.copy_(1.0 + torch.randn(shp, generator=g) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(shp, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(shp, generator=g) * 0.5)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(shp, generator=g))
            elif name.endswith("lm_head.weight"):
                p.copy_(torch.randn(shp, generator=g) * 1.5 / math.sqrt(shp[1]))
            elif name.endswith("router.weight"):
                p.copy_(torch.randn(shp, generator=g) * 3.0 / math.sqrt(shp[1]))
            elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I]: in x out
                p.copy_(torch.randn(shp, generator=g) * 4.0 / math.sqrt(shp[1]))
            elif name.endswith("experts.down_proj"):  # [E, I, H]
                p.copy_(torch.randn(shp, generator=g) * 0.6 / math.sqrt(shp[1]))
            elif p.dim() >= 2:
                p.copy_(torch.randn(shp, generator=g) * 1.2 / math.sqrt(shp[-1]))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(shp)}")
        rows = [i for i in range(model.config.vocab_size)
                if i >= g5.TOKENIZER_VOCAB or i in list(model.config.eos_token_id)]
        model.lm_head.weight[rows] *= 0.1

    @staticmethod
    def tokenizer_config(tok):
        added = g4.added_tokens(tok, g5.SPECIALS + SPECIAL, [])
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "eos_token": "<|return|>",
            "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1024,
            "chat_template": open(TEMPLATE).read(),
        }


class RouterMargins(g4.RouterMargins):
    """Logits plus bias: the gap at each row's top-k boundary; also counts clamped products."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "GptOssTopKRouter"]

    def hook(self, name):
        def f(mod, inputs, _out):
            x = inputs[0].reshape(-1, mod.weight.shape[1]).float()
            s = x @ mod.weight.float().t() + mod.bias.float()
            for r in range(s.shape[0]):
                top = s[r].sort(descending=True)[0]
                self.note(top[mod.top_k - 1] - top[mod.top_k], name)
                self.rows += 1
        return f


Family.margins = RouterMargins
_build = g4.build_fixture


def build_fixture(name, spec, tok, tok_json_path, fam=Family):
    """g4's builder, with MXFP4 experts: the model is quantized before the reference runs
    (quantize_experts inside init_random's successor) and the checkpoint written from the nibbles."""
    if spec["dtype"] != "mxfp4":
        return _build(name, spec, tok, tok_json_path, fam)
    spec = dict(spec, dtype="float32")

    class Quantized(fam):
        disk = None

        @staticmethod
        def init_random(model, seed):
            fam.init_random(model, seed)
            Quantized.disk = quantize_experts(model)

    _build(name, spec, tok, tok_json_path, Quantized)
    out_dir = os.path.join(fam.out_root, name)
    save_file({k: v.contiguous() for k, v in sorted(Quantized.disk.items())},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(out_dir, "config.json")
    cj = json.load(open(cfg_path))
    cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    g4.write_json(cfg_path, cj)
    # The stored nibbles, dequantized, give the reference logits again.
    ref = load_file(os.path.join(out_dir, "reference.safetensors"))
    m2 = fam.new_model(copy.deepcopy(GptOssConfig(**{k: v for k, v in cj.items() if k != "quantization_config"})))
    m2.load_state_dict(dequantize_experts(load_file(os.path.join(out_dir, "model.safetensors"))))
    with torch.no_grad():
        d = (m2(input_ids=ref["prompt_ids"][None], use_cache=False).logits[0].float() - ref["prompt_logits"]).abs().max()
    assert d.item() <= 1e-5, f"MXFP4 reload differs by {d.item()}"
    info_path = os.path.join(out_dir, "reference.json")
    info = json.load(open(info_path))
    info["weights_dtype"] = "float32, experts mxfp4"
    info["expert_layout_on_disk"] = "fused MXFP4 (gate_up_proj_blocks/_scales, down_proj_blocks/_scales), out x in"
    info["checks"]["mxfp4_reload_maxabs"] = d.item()
    g4.write_json(info_path, info)


def main():
    g4.run_main(__doc__, FIXTURES, build_tokenizer, Family)


g4.build_fixture = build_fixture

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Generate the Qwen3-MoE (`qwen3_moe`) parity fixtures under fixtures/qwen3_moe/<name>/.

Reference: Hugging Face transformers `Qwen3MoeForCausalLM`, CPU, float32, eager attention and
experts. CI never runs this script; it is committed so the fixtures can be regenerated:

    python scripts/make_qwen3_moe_fixtures.py              # all fixtures
    python scripts/make_qwen3_moe_fixtures.py gqa-renorm   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers, jinja2. The tokenizer is
the GLM-5 fixtures' BPE (scripts/make_glm5_fixtures.py) with Qwen3's special and added tokens
appended; the chat template is Qwen3's official one (fixtures/chat_templates/templates/qwen3.jinja).

Each directory holds what make_glm4_moe_fixtures.py writes (config.json, model.safetensors,
generation_config.json, tokenizer files, reference.safetensors, reference.json).

Fixtures:
  gqa-renorm   f32; 2 KV heads for 4 query heads, per-head q/k RMSNorm, 8 experts top-2 with
               renormalised weights (norm_topk_prob), layer 0 dense by `mlp_only_layers`.
  sparse-step  bf16 weights (reference in f32 from the rounded weights); head_dim 32 (wider
               than hidden / heads), top-3 of 8 without renormalisation, every second layer
               sparse (`decoder_sparse_step` 2), tied embeddings, sliding-window attention
               (window 8, shorter than the prompt) on every layer.

Seeds are searched until the greedy top-1/top-2 gap and every router top-k boundary (in
router logits) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
"""

import math
import os
import sys

import torch
import transformers
from tokenizers import AddedToken
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_glm5_fixtures as g5  # noqa: E402  (the tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "fixtures", "chat_templates", "templates", "qwen3.jinja")
# Qwen3's own specials (their ids follow the GLM-5 fixture vocabulary's 448).
SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    # Room for the official template's tools section (the server test renders it).
    max_position_embeddings=1024,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
)

FIXTURES = {
    "gqa-renorm": dict(
        dtype="float32", seed=300,
        cfg=dict(mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "sparse-step": dict(
        dtype="bfloat16", seed=400,
        cfg=dict(num_hidden_layers=4, head_dim=32, num_experts_per_tok=3, norm_topk_prob=False,
                 decoder_sparse_step=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def build_tokenizer():
    tok = g5.build_tokenizer()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


class Family(g4.Family):
    cls = Qwen3MoeForCausalLM
    out_root = os.path.join(REPO, "fixtures", "qwen3_moe")

    @staticmethod
    def make_config(spec, tok):
        kw = dict(BASE)
        kw.update(spec["cfg"])
        eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
        return Qwen3MoeConfig(**kw)


    @staticmethod
    @torch.no_grad()
    def init_random(model, seed):
        """Random weights with O(1) activations so decisions are well separated."""
        g = torch.Generator().manual_seed(seed)
        tied = model.config.tie_word_embeddings
        for name, p in model.named_parameters():
            shp, std = p.shape, None
            if "norm" in name:
                p.copy_(1.0 + torch.randn(shp, generator=g) * 0.1)
                continue
            if name.endswith("embed_tokens.weight"):
                std = 1.5 / math.sqrt(shp[1]) if tied else 1.0
            elif name.endswith("lm_head.weight"):
                std = 1.5 / math.sqrt(shp[1])
            elif name.endswith("mlp.gate.weight"):
                std = 3.0 / math.sqrt(shp[1])
            elif p.dim() >= 2:
                std = 1.2 / math.sqrt(shp[-1])
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(shp)}")
            p.copy_(torch.randn(shp, generator=g) * std)
        # EOS ids and the vocabulary past the BPE's never win greedy decoding.
        rows = [i for i in range(model.config.vocab_size)
                if i >= g5.TOKENIZER_VOCAB or i in list(model.config.eos_token_id)]
        head = model.model.embed_tokens.weight if tied else model.lm_head.weight
        head[rows] *= 0.1

    @staticmethod
    def tokenizer_config(tok):
        added = g4.added_tokens(tok, g5.SPECIALS + SPECIAL, ADDED)
        return {
            "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": added,
            "additional_special_tokens": SPECIAL,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 1024,
            "split_special_tokens": False,
            "chat_template": open(TEMPLATE).read(),
        }


class RouterMargins(g4.RouterMargins):
    """Softmax routing: the gap at each row's top-k boundary, in router logits."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "Qwen3MoeTopKRouter"]

    def hook(self, name):
        def f(mod, inputs, _out):
            x = inputs[0].reshape(-1, mod.weight.shape[1]).float()
            logits = x @ mod.weight.float().t()
            for r in range(logits.shape[0]):
                top = logits[r].sort(descending=True)[0]
                self.note(top[mod.top_k - 1] - top[mod.top_k], name)
                self.rows += 1
        return f


Family.margins = RouterMargins


def main():
    g4.run_main(__doc__, FIXTURES, build_tokenizer, Family)


if __name__ == "__main__":
    main()

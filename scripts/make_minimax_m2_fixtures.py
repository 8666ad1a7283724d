#!/usr/bin/env python3
"""Generate the MiniMax-M2 (`minimax_m2`) parity fixtures under fixtures/minimax_m2/<name>/.

Reference: Hugging Face transformers `MiniMaxM2ForCausalLM`, CPU, float32, eager attention and
experts. CI never runs this script; it is committed so the fixtures can be regenerated:

    python scripts/make_minimax_m2_fixtures.py            # all fixtures
    python scripts/make_minimax_m2_fixtures.py gqa-full   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers. The tokenizer is the GLM-5
fixtures' BPE (scripts/make_glm5_fixtures.py) with MiniMax-M2's special and added tokens
appended; the chat template is MiniMax-M2's official one
(fixtures/chat_templates/templates/minimax-m2.jinja).

Fixtures:
  gqa-full   f32; 2 KV heads for 4 query heads, q/k RMSNorm over the whole projections, RoPE on
             half of each head, 8 experts top-2 scored by sigmoid plus a correction bias.
  bf16-rot   bf16 weights (reference in f32 from the rounded weights); head_dim 32 with a quarter
             rotary, 3 layers, top-3 of 16 experts, tied embeddings.

Seeds are searched until the greedy top-1/top-2 gap and every router top-k boundary (in
biased sigmoid scores) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
"""

import math
import os
import sys

import torch
import transformers
from tokenizers import AddedToken
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_glm5_fixtures as g5  # noqa: E402  (the tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "fixtures", "chat_templates", "templates", "minimax-m2.jinja")
SPECIAL = ["]~!b[", "]~b]", "[e~["]
ADDED = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    hidden_act="silu",
    tie_word_embeddings=False,
)

FIXTURES = {
    "gqa-full": dict(
        dtype="float32", seed=501,
        cfg=dict(rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "bf16-rot": dict(
        dtype="bfloat16", seed=600,
        cfg=dict(num_hidden_layers=3, head_dim=32, num_local_experts=16, num_experts_per_tok=3,
                 tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def build_tokenizer():
    tok = g5.build_tokenizer()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


class Family(g4.Family):
    cls = MiniMaxM2ForCausalLM
    out_root = os.path.join(REPO, "fixtures", "minimax_m2")

    @staticmethod
    def make_config(spec, tok):
        kw = dict(BASE)
        kw.update(spec["cfg"])
        eos = [tok.token_to_id("[e~["), tok.token_to_id("<|endoftext|>")]
        kw.update(bos_token_id=tok.token_to_id("]~!b["), eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
        return MiniMaxM2Config(**kw)


    @staticmethod
    @torch.no_grad()
    def init_random(model, seed):
        """Random weights with O(1) activations so decisions are well separated."""
        g = torch.Generator().manual_seed(seed)
        tied = model.config.tie_word_embeddings
        for name, p in model.named_parameters():
            shp = p.shape
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
        rows = [i for i in range(model.config.vocab_size)
                if i >= g5.TOKENIZER_VOCAB or i in list(model.config.eos_token_id)]
        head = model.model.embed_tokens.weight if tied else model.lm_head.weight
        head[rows] *= 0.1
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((torch.rand(b.shape, generator=g) - 0.5) * 1.5)

    @staticmethod
    def tokenizer_config(tok):
        added = g4.added_tokens(tok, g5.SPECIALS + SPECIAL, ADDED)
        return {
            "tokenizer_class": "GPT2Tokenizer",
            "added_tokens_decoder": added,
            "additional_special_tokens": SPECIAL,
            "bos_token": "]~!b[",
            "eos_token": "[e~[",
            "pad_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1024,
            "chat_template": open(TEMPLATE).read(),
        }


class RouterMargins(g4.RouterMargins):
    """Sigmoid plus bias: the gap at each row's top-k boundary of the biased scores."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "MiniMaxM2SparseMoeBlock"]

    def hook(self, name):
        def f(mod, inputs, _out):
            x = inputs[0].reshape(-1, mod.gate.weight.shape[1]).float()
            s = torch.sigmoid(x @ mod.gate.weight.float().t()) + mod.e_score_correction_bias
            for r in range(s.shape[0]):
                top = s[r].sort(descending=True)[0]
                self.note(top[mod.top_k - 1] - top[mod.top_k], name)
                self.rows += 1
        return f


Family.margins = RouterMargins


def main():
    g4.run_main(__doc__, FIXTURES, build_tokenizer, Family)


if __name__ == "__main__":
    main()

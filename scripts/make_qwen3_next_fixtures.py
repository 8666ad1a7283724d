#!/usr/bin/env python3
"""Generate the Qwen3-Next (`qwen3_next`) parity fixtures under fixtures/qwen3_next/<name>/.

Reference: Hugging Face transformers `Qwen3NextForCausalLM`, CPU, float32, eager attention and
experts, the torch fallback of the causal convolution, and transformers' recurrent form of the
gated delta rule (`torch_recurrent_gated_delta_rule`) for prompts as for decode steps: its
chunked form is the same rule reassociated, and moves a prompt's logits by up to ~7e-4 from
the token-by-token ones, more than the parity bound. CI never runs this script; it is committed so the
fixtures can be regenerated:

    python scripts/make_qwen3_next_fixtures.py              # all fixtures
    python scripts/make_qwen3_next_fixtures.py hybrid-f32   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers, jinja2. The tokenizer and
chat template are the Qwen3-MoE fixtures' (scripts/make_qwen3_moe_fixtures.py).

Fixtures:
  hybrid-f32  f32; 4 layers, three gated DeltaNet (2 key heads, 4 value heads of 16, a
              convolution of 4) then gated full attention (2 KV heads for 4 query heads, RoPE
              on a quarter of each head); every layer 8 experts top-2, renormalised, beside
              the sigmoid-gated shared expert.
  bf16-dense  bf16 weights (reference in f32 from the rounded weights); 4 layers typed
              linear/full/linear/full, one value head per key head (16-wide keys,
              8-wide values), a convolution of 3, layer 0 dense (`mlp_only_layers`), top-3
              of 8 without renormalisation, RoPE on half of each head, tied embeddings.

Seeds are searched until the greedy top-1/top-2 gap and every router top-k boundary (in
router logits) exceed MARGIN, in the prefill, each decode step and a no-cache forward. The
cached decode and the no-cache forward of the same tokens may differ by up to CACHE_DRIFT (not
1e-5 as for the other families): a decode step adds ~3e-6, which the recurrent state carries
and grows over the 32 steps.
"""

import copy
import math
import os
import sys

import torch
import transformers
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

import make_qwen3_moe_fixtures as q3  # noqa: E402  (the tokenizer and template)
from transformers.models.qwen3_next import modeling_qwen3_next as mq

# The recurrent form for prompts too (see the module docstring).
mq.torch_chunk_gated_delta_rule = mq.torch_recurrent_gated_delta_rule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_glm5_fixtures as g5  # noqa: E402  (the tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
)

FIXTURES = {
    "hybrid-f32": dict(
        dtype="float32", seed=900,
        cfg=dict(rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "bf16-dense": dict(
        dtype="bfloat16", seed=1000,
        cfg=dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=3, mlp_only_layers=[0], num_experts_per_tok=3, norm_topk_prob=False,
                 tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


CACHE_DRIFT = 1e-4
# How far the f32 reference may be from the same model in f64: random DeltaNet weights can
# make the gated norm rescale a cancelling difference (v - S^T k) to O(1), so that any f32
# implementation is 1e-4 from any other; such seeds are rejected.
F64_BOUND = 2e-5


def problems(res):
    """g4.problems, the cache/no-cache bound CACHE_DRIFT, and the f64 bound F64_BOUND."""
    drift = res["full_vs_cache_diff"]
    p = _problems(dict(res, full_vs_cache_diff=0.0) if drift <= CACHE_DRIFT else res)
    if res["f64_diff"] > F64_BOUND:
        p.append(f"f32 vs f64 logits differ by {res['f64_diff']:.2e}")
    return p


@torch.no_grad()
def run_reference(model, prompt_ids, margins=None):
    """g4.run_reference, and the prompt's and decode steps' distance from f64 (the model's
    conditioning)."""
    res = _run_reference(model, prompt_ids, margins)
    m64 = copy.deepcopy(model).double()
    seq = torch.cat([prompt_ids, res["gen_ids"]])[None]
    l64 = m64(input_ids=seq, use_cache=False).logits[0].float()
    T = prompt_ids.numel()
    res["f64_diff"] = max((l64[:T] - res["prompt_logits"]).abs().max().item(),
                          (l64[T - 1:T - 1 + res["gen_logits"].shape[0]] - res["gen_logits"]).abs().max().item())
    return res


_problems, g4.problems = g4.problems, problems
_run_reference, g4.run_reference = g4.run_reference, run_reference


def build_tokenizer():
    return q3.build_tokenizer()


class Family(g4.Family):
    cls = Qwen3NextForCausalLM
    out_root = os.path.join(REPO, "fixtures", "qwen3_next")

    @staticmethod
    def make_config(spec, tok):
        kw = dict(BASE)
        kw.update(spec["cfg"])
        eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
        return Qwen3NextConfig(**kw)


    @staticmethod
    @torch.no_grad()
    def init_random(model, seed):
        """Random weights with O(1) activations so decisions are well separated."""
        g = torch.Generator().manual_seed(seed)
        tied = model.config.tie_word_embeddings
        for name, p in model.named_parameters():
            shp, std = p.shape, None
            if name.endswith("linear_attn.norm.weight"):  # the gated norm: x * w
                p.copy_(1.0 + torch.randn(shp, generator=g) * 0.1)
                continue
            if "norm" in name:  # zero-centred: x * (1 + w)
                p.copy_(torch.randn(shp, generator=g) * 0.1)
                continue
            if name.endswith("A_log"):
                p.copy_(torch.log(1.0 + torch.rand(shp, generator=g) * 7.0))
                continue
            if name.endswith("dt_bias"):
                p.copy_(torch.randn(shp, generator=g) * 0.5)
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
        return q3.Family.tokenizer_config(tok)


class RouterMargins(g4.RouterMargins):
    """Softmax routing: the gap at each row's top-k boundary, in router logits."""

    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "Qwen3NextTopKRouter"]

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

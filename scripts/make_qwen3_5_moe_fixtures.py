#!/usr/bin/env python3
"""Generate the Qwen3.5-MoE (`qwen3_5_moe`) parity fixtures under fixtures/qwen3_5_moe/<name>/.

Reference: Hugging Face transformers `Qwen3_5MoeForCausalLM` (the text model alone) and
`Qwen3_5MoeForConditionalGeneration` (the released checkpoints' class: text weights under
`model.language_model.`, a vision tower beside them, here driven with text only), CPU, float32,
eager attention and experts, the torch causal convolution and the recurrent form of the gated
delta rule for prompts as for decode steps (as scripts/make_qwen3_next_fixtures.py, whose seed
checks, f64 bound and weight initialisation these reuse). CI never runs this script:

    python scripts/make_qwen3_5_moe_fixtures.py              # all fixtures
    python scripts/make_qwen3_5_moe_fixtures.py text-f32     # just one

Fixtures:
  text-f32  f32, `Qwen3_5MoeForCausalLM` (model_type qwen3_5_moe_text); 4 layers, three gated
            DeltaNet (2 key heads, 4 value heads of 16, convolution 4) then gated full
            attention (2 KV heads for 4 query heads, multimodal RoPE on a quarter of each head);
            8 experts top-2 beside the sigmoid-gated shared expert.
  vl-bf16   bf16 weights (reference in f32 from the rounded weights),
            `Qwen3_5MoeForConditionalGeneration` (model_type qwen3_5_moe) with a small vision
            tower; 4 layers typed linear/full/linear/full, one value head per key head, a
            convolution of 3, top-3 of 8, RoPE on half of each head.
"""

import os
import sys

import torch
from transformers import (Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration,
                          Qwen3_5MoeTextConfig)
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_qwen3_next_fixtures as qn  # noqa: E402  (seed checks, tokenizer, initialisation)

# The recurrent form for prompts too (see make_qwen3_next_fixtures.py).
m35.torch_chunk_gated_delta_rule = m35.torch_recurrent_gated_delta_rule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3-Next's fixture base without the fields Qwen3.5-MoE does not have.
TEXT = {k: v for k, v in qn.BASE.items()
        if k not in ("intermediate_size", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}

# A small vision tower: present in the checkpoint as the released ones, never run.
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)

FIXTURES = {
    "text-f32": dict(
        dtype="float32", seed=1100, wrapped=False,
        cfg=dict(rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "vl-bf16": dict(
        dtype="bfloat16", seed=1200, wrapped=True,
        cfg=dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=3, num_experts_per_tok=3,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def build_tokenizer():
    return qn.build_tokenizer()


class Family(qn.Family):
    """The text model alone; `VlFamily` the vision-language wrapper (its class reloads the
    fixture in g4.build_fixture's check)."""

    cls = Qwen3_5MoeForCausalLM
    out_root = os.path.join(REPO, "fixtures", "qwen3_5_moe")

    @staticmethod
    def make_config(spec, tok):
        kw = dict(TEXT)
        kw.update(spec["cfg"])
        eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
        kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
        text = Qwen3_5MoeTextConfig(**kw)
        if not spec["wrapped"]:
            return text
        return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=dict(VISION), tie_word_embeddings=False,
                                eos_token_id=eos, pad_token_id=kw["pad_token_id"])


    @staticmethod
    @torch.no_grad()
    def init_random(model, seed):
        # qn.Family.init_random reads `model.model.embed_tokens`: the text model's, wherever
        # it sits; the vision tower keeps transformers' initialisation (never run).
        text = model.model.language_model if hasattr(model.model, "language_model") else model.model
        shim = _TextView(model, text)
        qn.Family.init_random(shim, seed)


class _TextView(torch.nn.Module):
    """The text parts of `model` under the names qn.Family.init_random expects."""

    def __init__(self, model, text):
        super().__init__()
        object.__setattr__(self, "config", model.config.get_text_config())
        object.__setattr__(self, "model", text)
        object.__setattr__(self, "lm_head", model.lm_head)

    def named_parameters(self, *a, **k):
        yield from (("model." + n, p) for n, p in self.model.named_parameters())
        yield from (("lm_head." + n, p) for n, p in self.lm_head.named_parameters())


class VlFamily(Family):
    cls = Qwen3_5MoeForConditionalGeneration


class RouterMargins(qn.RouterMargins):
    def __init__(self, model):
        self.min = (float("inf"), None)
        self.rows = 0
        self.handles = [m.register_forward_hook(self.hook(n)) for n, m in model.named_modules()
                        if type(m).__name__ == "Qwen3_5MoeTopKRouter"]


Family.margins = RouterMargins


def main():
    g4.run_main(__doc__, FIXTURES, build_tokenizer, lambda spec: VlFamily if spec["wrapped"] else Family)


if __name__ == "__main__":
    main()

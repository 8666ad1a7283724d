#!/usr/bin/env python3
"""Generate the DeepSeek-V3 / Kimi K2 (`deepseek_v3`, `kimi_k2`) parity fixtures under
fixtures/deepseek_v3/<name>/.

Reference: Hugging Face transformers `DeepseekV3ForCausalLM` (Kimi K2 runs the same class),
CPU, float32, eager attention and experts. CI never runs this script; it is committed so the
fixtures can be regenerated:

    python scripts/make_deepseek_v3_fixtures.py               # all fixtures
    python scripts/make_deepseek_v3_fixtures.py yarn-groups   # just one

Requirements: torch, transformers (>= 5.x), safetensors, tokenizers. The tokenizer is the
GLM-5 fixtures' BPE (scripts/make_glm5_fixtures.py) with the model's own special tokens
appended; the chat templates are the official ones in fixtures/chat_templates/templates/.

Each directory holds what make_glm4_moe_fixtures.py writes (config.json, model.safetensors,
generation_config.json, tokenizer files, reference.safetensors, reference.json).

Fixtures:
  yarn-groups  f32 DeepSeek-V3 in miniature: MLA (q and kv low-rank latents), YaRN RoPE
               (factor 4 over an original 256 positions, mscale = mscale_all_dim = 1, so the
               softmax scale grows by mscale(4)^2 and the low frequencies are interpolated),
               16 experts in 4 groups of which 2 are kept, top-4, a shared expert, layer 0
               dense. DeepSeek-V3.1's chat template.
  kimi-tiktoken  a tokenizer only, shipped as Kimi K2's is: `tiktoken.model` (ranks trained
               here as tiktoken's `bpe_train` does, with Kimi's split pattern on license texts and
               Chinese), `tokenizer_config.json` with Kimi's special tokens past the ranks, and
               `encodings.json`: what the `tiktoken` library encodes for a set of texts.
  kimi-fp8     Kimi K2 in miniature (`model_type` kimi_k2): one group, 12 experts top-3,
               routed_scaling_factor 2.827, YaRN factor 32; hidden 128 with attention, dense
               MLP and experts stored as F8_E4M3 in 128x128 blocks with `weight_scale_inv`
               (the reference computed from the dequantized weights). Kimi K2's chat template.

Seeds are searched until the greedy top-1/top-2 gap and every routing boundary (group and
expert, in biased scores) exceed MARGIN, in the prefill, each decode step and a no-cache forward.
"""

import argparse
import base64
import json
import os
import sys
import tempfile

import torch
import transformers
from tokenizers import AddedToken
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_glm4_moe_fixtures as g4  # noqa: E402  (the fixture builder)
import make_glm5_fixtures as g5  # noqa: E402  (the tokenizer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO, "fixtures", "chat_templates", "templates")

DEEPSEEK = dict(
    template="deepseek-v3.1.jinja", bos="<｜begin▁of▁sentence｜>", eos=["<｜end▁of▁sentence｜>"],
    special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
             "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
             "<｜tool▁output▁end｜>"],
    added=["<think>", "</think>"],
)
KIMI = dict(
    template="kimi-k2.jinja", bos="[BOS]", eos=["<|im_end|>", "[EOS]"],
    special=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
             "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>"],
    added=["<think>", "</think>"],
)

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_shared_experts=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    rope_interleave=True,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
)

FIXTURES = {
    "yarn-groups": dict(
        dtype="float32", seed=500, chat=DEEPSEEK,
        cfg=dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}),
        prompt="The licenses for most software are designed to take away your freedom to share and change it.",
    ),
    "kimi-fp8": dict(
        dtype="fp8", seed=600, chat=KIMI, config_extra={"model_type": "kimi_k2"},
        cfg=dict(hidden_size=128, n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1,
                 routed_scaling_factor=2.827,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                  "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}),
        prompt="You may convey verbatim copies of the Program's source code as you receive it, in any medium.",
    ),
}


def build_tokenizer(chat):
    tok = g5.build_tokenizer()
    tok.add_special_tokens(chat["special"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat["added"]])
    return tok


def family(chat):
    class Family(g4.Family):
        cls = DeepseekV3ForCausalLM
        out_root = os.path.join(REPO, "fixtures", "deepseek_v3")
        margins = g4.RouterMargins

        @staticmethod
        def make_config(spec, tok):
            kw = dict(BASE)
            kw.update(spec["cfg"])
            eos = [tok.token_to_id(t) for t in chat["eos"]]
            kw.update(bos_token_id=tok.token_to_id(chat["bos"]), eos_token_id=eos,
                      pad_token_id=tok.token_to_id(chat["eos"][-1]))
            return DeepseekV3Config(**kw)

        @staticmethod
        def init_random(model, seed):
            g4.init_random(model, seed)

        @staticmethod
        def tokenizer_config(tok):
            added = g4.added_tokens(tok, g5.SPECIALS + chat["special"], chat["added"])
            return {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "added_tokens_decoder": added,
                "bos_token": chat["bos"],
                "eos_token": chat["eos"][0],
                "pad_token": chat["eos"][-1],
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1024,
                "chat_template": open(os.path.join(TEMPLATES, chat["template"])).read(),
            }

    return Family


# Kimi K2's `pat_str` (tokenization_kimi.py).
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TIKTOKEN_TEXTS = [
    "The licenses for most software are designed to take away your freedom to share and change it.",
    "I'm sure you'LL see: DON'T panic; it's 12345 or 3.14159 -- isn't it?",
    "你好，世界！今天的天气很好。Mixed 中文 and English 2024年",
    "  leading spaces\n\n\ttabs\r\n  and trailing   ",
    "emoji 😀 and accents: café naïve Ångström",
    "<|im_user|>user<|im_middle|>Hi there<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS] and a <|reserved_token_9|> wait",
]


def build_tiktoken_fixture():
    """Kimi K2's tokenizer files with small trained ranks, and tiktoken's encodings."""
    import collections

    import regex
    import tiktoken

    out_dir = os.path.join(REPO, "fixtures", "deepseek_v3", "kimi-tiktoken")
    os.makedirs(out_dir, exist_ok=True)
    text = "".join(open(f).read()[:20000] for f in g5.TRAIN_FILES[:3])
    text += "你好世界今天的天气很好我们一起学习中文吧这是一个测试" * 20
    # Byte-level BPE training as tiktoken's `_educational.bpe_train` does it, splitting with
    # `regex` in V1 mode (where `&&` is class intersection, as in tiktoken's own engine).
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in regex.findall(KIMI_PAT, text, flags=regex.V1)]
    while len(ranks) < 600:
        pairs = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        ranks[a + b] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    base = len(ranks)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as fh:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            fh.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    named = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", None, "<|start_header_id|>",
             "<|end_header_id|>", None, "[EOT]", "<|im_system|>", None, None, None, None, "<|im_middle|>"]
    special = {}
    for i in range(256):
        name = named[i] if i < len(named) and named[i] else f"<|reserved_token_{base + i}|>"
        special[name] = base + i
    enc = tiktoken.Encoding(name="kimi-fixture", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=special)
    added = {str(i): {"content": n, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for n, i in special.items() if not n.startswith("<|reserved_token_")}
    g4.write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[EOS]",
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
    })
    texts = TIKTOKEN_TEXTS[:6] + [TIKTOKEN_TEXTS[6].replace("_9|", f"_{base + 9}|")]
    g4.write_json(os.path.join(out_dir, "encodings.json"), {
        "generated_by": "scripts/make_deepseek_v3_fixtures.py kimi-tiktoken",
        "tiktoken": tiktoken.__version__, "ranks": base,
        "cases": [{"text": t, "ids": enc.encode(t, allowed_special="all")} for t in texts],
    })
    print(f"  [kimi-tiktoken] {base} ranks, {len(texts)} encodings", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(FIXTURES) + ["kimi-tiktoken"])
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    for name in args.names:
        if name == "kimi-tiktoken":
            build_tiktoken_fixture()
            continue
        spec = FIXTURES[name]
        tok = build_tokenizer(spec["chat"])
        with tempfile.TemporaryDirectory() as d:
            tok_path = os.path.join(d, "tokenizer.json")
            tok.save(tok_path)
            print(f"building {name}", flush=True)
            g4.build_fixture(name, spec, tok, tok_path, family(spec["chat"]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Random-weight "slice" checkpoints: a family's real widths, few layers, small vocab.

For CPU speed measurements (docs/performance.md, issue 14) of families whose real checkpoints
do not fit this machine. GLM-5 has its own generator (`strata-bench synth`); this covers the
families that transformers defines:

    /tmp/gemmavenv/bin/python scripts/make_slice_checkpoint.py glm4_moe /work/bench/glm45air-slice
    /tmp/gemmavenv/bin/python scripts/make_slice_checkpoint.py gemma4 /work/bench/gemma4-26b-slice
    /tmp/gemmavenv/bin/python scripts/make_slice_checkpoint.py gpt_oss /work/bench/gpt-oss-120b-slice --vocab 512
    /tmp/gemmavenv/bin/python scripts/make_slice_checkpoint.py qwen3_moe /work/bench/qwen3-235b-slice --vocab 512

Presets (widths from the released configs; `--layers` and `--vocab` override the cut):
  glm4_moe  GLM-4.5-Air (`Glm4MoeForCausalLM`): hidden 4096, 96 query heads x 128, 8 KV heads,
            q/k/v biases, no q/k norm, RoPE on half of each head (theta 1e6), dense MLP 10944
            on the first layer, then 128 routed experts of 1408 top-8 + 1 shared expert
            (sigmoid router, one group, routed_scaling_factor 1). 2 layers (1 dense + 1 MoE),
            vocab 16384 (151552 in the release), untied head, no MTP layer.
  gemma4    Gemma 4 26B-A4B text model (`Gemma4ForConditionalGeneration`, no vision tower):
            hidden 2816, 16 query heads, sliding layers 8 KV heads x 256 (window 1024), full
            layers 2 KV heads x 512 with K = V, dense GELU MLP of 2112 beside 128 experts of 704
            top-8, soft cap 30, tied embeddings. 6 layers (5 sliding + 1 full: the release's
            repeating unit), vocab 16384 (262144 in the release).
  gpt_oss   gpt-oss-120b (`GptOssForCausalLM`): hidden 2880, 64 query heads x 64, 8 KV heads,
            biases on every projection, sinks, YaRN (theta 150000, factor 32), sliding window
            128 on even layers; experts of 2880 top-4, stored as the release stores them: MXFP4
            (`*_blocks` random nibbles, `*_scales` e8m0 codes 116-120, so weights of ~0.01-0.1),
            with `quantization_config.quant_method` mxfp4. 2 layers (sliding + full), 32
            experts a layer (128 in the release: a decode token reads 4 either way).
  qwen3_moe Qwen3-235B-A22B (`Qwen3MoeForCausalLM`): hidden 4096, 64 query heads x 128, 4 KV heads,
            q/k RMSNorm per head, experts of 1536 top-8 (softmax, renormalised), no shared expert.
            2 layers, 32 experts a layer (128 in the release).
  minimax_m2 MiniMax-M2 (`MiniMaxM2ForCausalLM`): hidden 3072, 48 query heads x 128, 8 KV heads,
            q/k RMSNorm over all heads, rotary on half of each head (theta 5e6), experts of 1536
            top-8 (sigmoid with a correction bias), under the release's names (Mixtral's
            `block_sparse_moe.experts.E.w1/w3/w2`). 2 layers, 32 experts a layer (256 in the
            release; bf16 here, FP8 in the release).
  qwen3_next Qwen3-Next-80B-A3B (`Qwen3NextForCausalLM`): hidden 2048; 3 Gated DeltaNet layers
            (16 key heads, 32 value heads, 128 wide, convolution 4) then 1 gated full-attention
            layer (16 query heads x 256, 2 KV heads, rotary on a quarter); experts of 512 top-10
            plus a gated shared expert of 512. 4 layers, 64 experts a layer (512 in the release),
            and the release's draft layer (`mtp.*`, shaped as the full-attention layer).

Weights are drawn from one seeded generator (torch.manual_seed and a torch.Generator), bf16:
matrices N(0, 1/fan_in) so every projection keeps O(1) activations, norms and scales 1,
biases N(0, 0.02^2), router correction biases 0; Gemma 4's post-sublayer norms 3 (see
PRESETS). Random routers are not trained ones: greedy decoding repeats tokens (Gemma 4's tied
head: 6 distinct tokens in 32 on the default slice) and routing concentrates on some experts,
so streamed hit rates flatter trained routing. These checkpoints measure bytes and
arithmetic, not caching on trained routes.

Written as bf16 safetensors shards of at most 2 GB with model.safetensors.index.json,
config.json and generation_config.json; no tokenizer (drive strata with `--ids` /
`bench decode`). The model is built on the meta device, so memory stays at one tensor.
"""

import argparse
import json
import math
import os
import time

import torch
import transformers
from safetensors.torch import save_file

SHARD_BYTES = 2 * 10**9
S, F = "sliding_attention", "full_attention"


def glm4_moe_config(layers, vocab):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        attention_bias=True,
        use_qk_norm=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        bos_token_id=None,
        eos_token_id=[vocab - 1],
        pad_token_id=vocab - 1,
    )


def gemma4_config(layers, vocab):
    from transformers import Gemma4Config, Gemma4TextConfig

    # The release repeats (5 sliding, 1 full); the last layer is always full.
    types = [F if (i % 6 == 5 or i == layers - 1) else S for i in range(layers)]
    text = Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=layers,
        layer_types=types,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        sliding_window=1024,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        use_bidirectional_attention="vision",
        tie_word_embeddings=True,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        bos_token_id=2,
        eos_token_id=[1, 106],
        pad_token_id=0,
    )
    return Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None, tie_word_embeddings=True)


def gpt_oss_config(layers, vocab):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        eos_token_id=[vocab - 1],
        pad_token_id=vocab - 2,
    )


def qwen3_moe_config(layers, vocab):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=32,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=[vocab - 1],
        pad_token_id=vocab - 2,
    )


def minimax_m2_config(layers, vocab):
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(
        vocab_size=vocab,
        hidden_size=3072,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=32,
        num_experts_per_tok=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=196608,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[vocab - 1],
        pad_token_id=vocab - 2,
    )


def qwen3_next_config(layers, vocab):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=5120,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=64,
        num_experts_per_tok=10,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        full_attention_interval=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=[vocab - 1],
        pad_token_id=vocab - 2,
    )


PRESETS = {
    "glm4_moe": dict(config=glm4_moe_config, cls="Glm4MoeForCausalLM", layers=2),
    # Gemma 4: the sandwich norms after each sublayer at 3 (as scripts/make_gemma4_fixtures.py):
    # with scale 1 the token's own embedding dominates the residual and the tied head makes
    # the greedy decode repeat its input token, so every decode step routes alike.
    "gemma4": dict(config=gemma4_config, cls="Gemma4ForConditionalGeneration", layers=6, post_norm=3.0),
    "gpt_oss": dict(config=gpt_oss_config, cls="GptOssForCausalLM", layers=2, mxfp4=True),
    "qwen3_moe": dict(config=qwen3_moe_config, cls="Qwen3MoeForCausalLM", layers=2),
    # (`rotary_dim` and `scoring_func` as the release's config gives them: llama.cpp's
    # converter reads it.)
    "minimax_m2": dict(config=minimax_m2_config, cls="MiniMaxM2ForCausalLM", layers=2, mixtral_names=True,
                       config_extra={"rotary_dim": 64, "scoring_func": "sigmoid"}),
    "qwen3_next": dict(config=qwen3_next_config, cls="Qwen3NextForCausalLM", layers=4, mtp=True),
}


def mxfp4_entries(name, shape):
    """A fused expert tensor `[E, in, out]` as the release stores it: `_blocks [E, out, in/32, 16]`
    and `_scales [E, out, in/32]` (u8)."""
    e, cin, cout = shape
    return [(name + "_blocks", (e, cout, cin // 32, 16)), (name + "_scales", (e, cout, cin // 32))]


def mixtral_entries(name, shape):
    """An MoE tensor of transformers' runtime state dict under the name the release stores it by
    (MiniMax-M2: Mixtral's `block_sparse_moe.*`, one `w1`/`w3`/`w2` per expert)."""
    for old, new in ((".mlp.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                     (".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
        if name.endswith(old):
            return [(name[: -len(old)] + new, shape)]
    p = name.rsplit(".mlp.experts.", 1)[0] + ".block_sparse_moe.experts"
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        e, two_i, h = shape
        return [(f"{p}.{x}.{w}.weight", (two_i // 2, h)) for x in range(e) for w in ("w1", "w3")]
    if name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
        e, h, i = shape
        return [(f"{p}.{x}.w2.weight", (h, i)) for x in range(e)]
    return [(name, shape)]


def mtp_entries(entries, cfg):
    """Qwen3-Next's draft layer as the release stores it (`mtp.*`: transformers does not model
    it): the input projection of [embedding; hidden] and its two norms, one decoder layer shaped
    as the last full-attention layer, and a final norm. strata describes it; llama.cpp's converter
    wants it."""
    h = cfg.hidden_size
    last = max(i for i, t in enumerate(cfg.layer_types) if t == F)
    src = f"model.layers.{last}."
    layer = [("mtp.layers.0." + k[len(src):], s) for k, s in entries if k.startswith(src)]
    return [("mtp.fc.weight", (h, 2 * h)), ("mtp.pre_fc_norm_embedding.weight", (h,)),
            ("mtp.pre_fc_norm_hidden.weight", (h,))] + layer + [("mtp.norm.weight", (h,))]


def mxfp4_value(name, shape, g):
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randint(116, 121, shape, generator=g, dtype=torch.uint8)


def init_value(name, shape, g, post_norm=1.0):
    """bf16 tensor for one state-dict entry (see the module docstring)."""
    if len(shape) >= 2:
        std = 1.0 / math.sqrt(shape[-1])  # [.., out, in]: the last axis is the input
        return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(torch.bfloat16)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    if ".post_" in name and "norm" in name:
        return torch.full(shape, post_norm, dtype=torch.bfloat16)
    # norms, layer scalars, router scales and per-expert scales
    return torch.ones(shape, dtype=torch.bfloat16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=sorted(PRESETS))
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, help="number of layers (preset default otherwise)")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    p = PRESETS[a.family]
    layers = a.layers or p["layers"]
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(a.seed)

    cfg = p["config"](layers, a.vocab)
    cls = getattr(transformers, p["cls"])
    with torch.device("meta"):
        model = cls(cfg)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    entries = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    if tied:
        entries = [(k, s) for k, s in entries if k != "lm_head.weight"]
    if p.get("mxfp4"):
        entries = [e for k, s in entries
                   for e in (mxfp4_entries(k, s) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else [(k, s)])]
    if p.get("mixtral_names"):
        entries = [e for k, s in entries for e in mixtral_entries(k, s)]
    if p.get("mtp"):
        entries += mtp_entries(entries, cfg)

    # Shard plan (bf16 = 2 bytes per value), in state-dict order.
    shards, cur, cur_bytes = [], [], 0
    for k, s in entries:
        nbytes = 2 * math.prod(s)
        if cur and cur_bytes + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((k, s))
        cur_bytes += nbytes
    shards.append(cur)

    os.makedirs(a.out, exist_ok=True)
    n = len(shards)
    weight_map, total = {}, 0
    t0 = time.time()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: (mxfp4_value(k, s, g) if k.endswith(("_blocks", "_scales")) else
                       init_value(k, s, g, p.get("post_norm", 1.0))) for k, s in shard}
        save_file(tensors, os.path.join(a.out, fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
        del tensors
        print(f"{fname}: {len(shard)} tensors ({time.time() - t0:.0f} s)", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    cfg.architectures = [p["cls"]]
    cfg.dtype = "bfloat16"
    if p.get("mxfp4"):
        cfg.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg.save_pretrained(a.out)
    if p.get("config_extra"):
        path = os.path.join(a.out, "config.json")
        with open(path) as f:
            written = json.load(f)
        written.update(p["config_extra"])
        with open(path, "w") as f:
            json.dump(written, f, indent=2)
    text = cfg.get_text_config()
    gen = {"do_sample": False, "bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id,
           "pad_token_id": text.pad_token_id}
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    params = total // 2
    print(json.dumps({"out": a.out, "family": a.family, "layers": layers, "vocab": a.vocab, "seed": a.seed,
                      "params": params, "bytes": total, "shards": n,
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()

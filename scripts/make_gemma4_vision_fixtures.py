#!/usr/bin/env python3
"""Generate the Gemma 4 image fixtures under fixtures/gemma4/<name>/ and the image processor's
reference outputs under fixtures/gemma4/processor/.

Reference: Hugging Face transformers `Gemma4ForConditionalGeneration` and `Gemma4ImageProcessor`,
CPU, float32, eager attention. CI never runs this script:

    /tmp/gemmavenv/bin/python scripts/make_gemma4_vision_fixtures.py

Model fixtures (text as the `dense-ple` fixture of make_gemma4_fixtures.py: PLE, KV sharing,
sliding window 8; a 2-layer vision tower, hidden 32, 2 heads of 16, 2-D RoPE theta 100):
  vision         `use_bidirectional_attention` unset: attention is causal everywhere.
  vision-bidir   `use_bidirectional_attention: "vision"`: image tokens also see later tokens of
                 their own image, on sliding layers only.
  vision-large   as vision-bidir with the processor's default max_soft_tokens 280 and an image
                 of 272 soft tokens: more rows than a CPU forward's 256, which must hold it.
Each holds image.png (288 x 480: the processor keeps it as it is, 18 x 30 patches, 60 soft tokens
at max_soft_tokens 70; vision-large: 768 x 816, 48 x 51 patches, 272 soft tokens at 280) and a
prompt `text <boi> <image> x N <eoi> text`; reference.safetensors
holds prompt_ids, pixel_values (the real patches), image_features (the projected soft tokens),
prompt_logits, generated_ids, generated_logits.

Processor fixtures: a few images of other sizes and modes, each with the processor's patches
(real ones only, as the uint8 values they are over 255), positions and soft-token count, at
max_soft_tokens 70 (and 280 for one).
"""

import copy
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_gemma4_fixtures as g4  # noqa: E402
import make_glm5_fixtures as g5  # noqa: E402

OUT_ROOT = g4.OUT_ROOT
IMAGE_ID, BOI_ID, EOI_ID = 500, 501, 502
N_NEW = 32

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=64, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
              rope_parameters={"rope_type": "default", "rope_theta": 100.0}, standardize=False)


def processor(max_soft_tokens):
    try:
        from transformers import Gemma4ImageProcessor as P
    except ImportError:
        from transformers.models.gemma4.image_processing_gemma4 import Gemma4ImageProcessor as P
    return P(max_soft_tokens=max_soft_tokens)


def synthetic_image(h, w, seed, mode="RGB", noise=0.05):
    """Smooth gradients, a few discs and some noise: structure at every scale."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([x / w, y / h, 0.5 + 0.5 * np.sin((x + y) / 17.0)], axis=-1)
    for _ in range(5):
        cy, cx, r = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(5, max(6, min(h, w) / 3))
        img[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 1, 3)
    img = np.clip(img + rng.normal(0, noise, img.shape), 0, 1)
    im = Image.fromarray((img * 255).round().astype(np.uint8), "RGB")
    if mode == "RGBA":
        a = Image.fromarray((255 * (x / w)).astype(np.uint8), "L")
        im = im.copy()
        im.putalpha(a)
    elif mode != "RGB":
        im = im.convert(mode)
    return im


def real_patches(out):
    """The processor's patches and positions without padding."""
    pos = out["image_position_ids"][0]
    keep = (pos != -1).any(-1)
    return out["pixel_values"][0][keep].float(), pos[keep].long()


def make_config(bidir, tok, positions=None):
    spec = copy.deepcopy(g4.FIXTURES["dense-ple"])
    kw = copy.deepcopy(g4.BASE)
    kw.update(spec["cfg"])
    if positions:
        kw.update(max_position_embeddings=positions)
    eos = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|user|>")]
    kw.update(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.token_to_id("<|endoftext|>"))
    if bidir:
        kw.update(use_bidirectional_attention="vision")
    text = Gemma4TextConfig(**kw)
    return Gemma4Config(text_config=text.to_dict(), vision_config=dict(VISION), audio_config=None,
                        image_token_id=IMAGE_ID, boi_token_id=BOI_ID, eoi_token_id=EOI_ID)


def text_params_init(model, seed):
    """g4.init_random over the text model only (it refuses parameters it does not know)."""
    g = torch.Generator().manual_seed(seed)
    tc = model.config.get_text_config()
    text = [(n, p) for n, p in model.named_parameters() if "vision" not in n]

    def randn(shape, std):
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, p in text:
            shp = p.shape
            if name.endswith("embed_tokens.weight"):
                p.copy_(randn(shp, 0.75 / math.sqrt(shp[1])))
            elif name.endswith("embed_tokens_per_layer.weight"):
                p.copy_(randn(shp, 1.0 / math.sqrt(tc.hidden_size_per_layer_input)))
            elif name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.copy_(0.5 * (1.0 + randn(shp, 0.1)))
            elif "norm" in name and "post_" in name:
                p.copy_(3.0 * (1.0 + randn(shp, 0.1)))
            elif "norm" in name:
                p.copy_(1.0 + randn(shp, 0.1))
            elif p.dim() >= 2:
                p.copy_(randn(shp, 1.2 / math.sqrt(shp[-1])))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(shp)}")
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
        rows = [i for i in range(tc.vocab_size)
                if (i >= g5.TOKENIZER_VOCAB and i not in (BOI_ID, EOI_ID)) or i in list(tc.eos_token_id)]
        model.get_input_embeddings().weight[rows] *= 0.1
        gv = torch.Generator().manual_seed(seed + 7)
        for n, p in model.named_parameters():
            if "vision" not in n:
                continue
            shp = p.shape
            if n.endswith("position_embedding_table"):
                p.copy_(torch.randn(shp, generator=gv) * 0.5)
            elif n.endswith("q_norm.weight") or n.endswith("k_norm.weight"):
                p.copy_(0.5 * (1.0 + torch.randn(shp, generator=gv) * 0.1))
            elif "norm" in n:
                p.copy_(1.0 + torch.randn(shp, generator=gv) * 0.1)
            else:
                p.copy_(torch.randn(shp, generator=gv) * (1.2 / math.sqrt(shp[-1])))


@torch.no_grad()
def reference(model, ids, pv, pos, bidir):
    T = ids.numel()
    kw = dict(pixel_values=pv, image_position_ids=pos)
    # The image blocks of the bidirectional rule come from mm_token_type_ids (1: image token).
    mm = (ids == IMAGE_ID).long()[None]
    gkw = dict(kw, mm_token_type_ids=mm) if bidir else kw
    out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                         max_new_tokens=N_NEW, min_new_tokens=N_NEW, output_logits=True,
                         return_dict_in_generate=True, use_cache=True,
                         eos_token_id=list(model.config.get_text_config().eos_token_id),
                         pad_token_id=model.config.get_text_config().pad_token_id, **gkw)
    gen_ids = out.sequences[0, T:].clone()
    gen_logits = torch.stack([l[0] for l in out.logits]).float()
    prompt_logits = model(input_ids=ids[None], use_cache=False, **gkw).logits[0].float()
    full_mm = torch.cat([mm, torch.zeros(1, N_NEW, dtype=torch.long)], 1)
    fkw = dict(kw, mm_token_type_ids=full_mm) if bidir else kw
    full = model(input_ids=out.sequences, use_cache=False, **fkw).logits[0].float()
    if bidir:
        causal = model(input_ids=ids[None], use_cache=False, **kw).logits[0].float()
        assert (causal - prompt_logits).abs().max().item() > 1e-3, "the bidirectional rule changed nothing"
    feats = model.get_image_features(pixel_values=pv, image_position_ids=pos)
    feats = getattr(feats, "pooler_output", feats)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat(list(feats), 0)
    top2 = torch.topk(torch.cat([gen_logits, full[T - 1:T - 1 + N_NEW]]), 2, dim=-1).values
    return dict(prompt_logits=prompt_logits, gen_ids=gen_ids, gen_logits=gen_logits,
                features=feats.reshape(-1, feats.shape[-1]).float(),
                greedy_min=(top2[:, 0] - top2[:, 1]).min().item(),
                full_vs_cache=(full[T - 1:T - 1 + N_NEW] - gen_logits).abs().max().item(),
                argmax_ok=bool((gen_logits.argmax(-1) == gen_ids).all()))


# name: (image height, width, noise, max_soft_tokens, soft tokens it gives)
IMAGES = {"vision": (288, 480, 0.05, 70, 60), "vision-bidir": (288, 480, 0.05, 70, 60),
          "vision-large": (768, 816, 0.0, 280, 272)}


def build_model_fixture(name, bidir, tok, tok_json):
    h, w, noise, budget, want_soft = IMAGES[name]
    img = synthetic_image(h, w, seed=3, noise=noise)
    proc = processor(budget)
    out = proc(images=[img], return_tensors="pt")
    pv_all, pos_all = out["pixel_values"], out["image_position_ids"]
    n_soft = int(out["num_soft_tokens_per_image"][0])
    patches, _ = real_patches(out)
    ph, pw = h // 16, w // 16
    direct = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    direct = direct.reshape(3, ph, 16, pw, 16).permute(1, 3, 2, 4, 0).reshape(ph * pw, -1)
    assert n_soft == want_soft and patches.shape[0] == ph * pw, (n_soft, patches.shape)
    assert (patches - direct).abs().max().item() < 1e-6, "the processor resized the fixture image"
    a = tok.encode("The licenses for most software are designed").ids
    b = tok.encode(" to take away your freedom to share and change it.").ids
    ids = torch.tensor(a + [BOI_ID] + [IMAGE_ID] * n_soft + [EOI_ID] + b, dtype=torch.long)
    cfg = make_config(bidir, tok, 1024 if ids.numel() > 256 else None)
    seed = 300 + 10 * bidir
    for attempt in range(200):
        model = Gemma4ForConditionalGeneration(copy.deepcopy(cfg))
        model.set_attn_implementation("eager")
        model = model.float().eval()
        text_params_init(model, seed)
        res = reference(model, ids, pv_all, pos_all, bidir)
        bad = []
        if not res["argmax_ok"] or res["greedy_min"] <= g4.MARGIN:
            bad.append(f"greedy margin {res['greedy_min']:.2e}")
        if len(set(res["gen_ids"].tolist())) < g4.MIN_DISTINCT:
            bad.append("too few distinct tokens")
        if res["full_vs_cache"] > 1e-5:
            bad.append(f"cache/no-cache differ by {res['full_vs_cache']:.2e}")
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
    tc = model.config.get_text_config()
    g4.write_json(os.path.join(out_dir, "generation_config.json"), {
        "eos_token_id": list(tc.eos_token_id), "pad_token_id": tc.pad_token_id, "do_sample": False,
        "transformers_version": transformers.__version__})
    shutil.copy(tok_json, os.path.join(out_dir, "tokenizer.json"))
    g4.write_json(os.path.join(out_dir, "tokenizer_config.json"), g5.tokenizer_config(tok))
    g4.write_json(os.path.join(out_dir, "preprocessor_config.json"), {
        "image_processor_type": "Gemma4ImageProcessor", "patch_size": 16, "max_soft_tokens": budget,
        "pooling_kernel_size": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False})
    img.save(os.path.join(out_dir, "image.png"))
    # A noiseless image is kept as it is: its patches are its bytes over 255, stored as such.
    q = torch.round(patches * 255)
    exact = noise == 0.0 and (q / 255 - patches).abs().max().item() < 1e-6
    pixels = {"pixel_bytes": q.to(torch.uint8).contiguous()} if exact else {"pixel_values": patches.contiguous()}
    save_file({
        "prompt_ids": ids.contiguous(),
        **pixels,
        "image_features": res["features"].contiguous(),
        "prompt_logits": res["prompt_logits"].contiguous(),
        "generated_ids": res["gen_ids"].long().contiguous(),
        "generated_logits": res["gen_logits"].contiguous(),
    }, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})
    g4.write_json(os.path.join(out_dir, "reference.json"), {
        "config_name": name, "seed": seed, "soft_tokens": n_soft, "image": f"image.png ({h} x {w})",
        "image_token_id": IMAGE_ID, "boi_token_id": BOI_ID, "eoi_token_id": EOI_ID,
        "use_bidirectional_attention": "vision" if bidir else None, "sliding_window": tc.sliding_window,
        "prompt_num_tokens": ids.numel(), "num_new_tokens": N_NEW,
        "margins": {"required": g4.MARGIN, "greedy_min_top1_minus_top2": res["greedy_min"]},
        "checks": {"nocache_forward_vs_generated_logits_maxabs": res["full_vs_cache"]},
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    })
    print(f"  [{name}] seed {seed}, greedy gap {res['greedy_min']:.3g}", flush=True)


def build_processor_fixture():
    out_dir = os.path.join(OUT_ROOT, "processor")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cases = [("wide", 160, 224, "RGB"), ("tall-rgba", 500, 333, "RGBA"), ("gray", 97, 311, "L"),
             ("strip", 40, 1000, "RGB"), ("small", 30, 20, "RGB")]
    tensors, meta = {}, []
    for name, h, w, mode in cases:
        img = synthetic_image(h, w, seed=len(meta) + 11, mode=mode)
        img.save(os.path.join(out_dir, f"{name}.png"))
        for budget in (70, 280) if name == "wide" else (70,):
            out = processor(budget)(images=[img], return_tensors="pt")
            patches, pos = real_patches(out)
            key = f"{name}.{budget}"
            # Resized uint8 pixels over 255: stored as the bytes.
            q = torch.round(patches * 255)
            assert (q / 255 - patches).abs().max().item() < 1e-6
            tensors[f"{key}.patches"] = q.to(torch.uint8).contiguous()
            tensors[f"{key}.positions"] = pos.contiguous()
            meta.append({"image": f"{name}.png", "size": [h, w], "mode": mode, "max_soft_tokens": budget,
                         "soft_tokens": int(out["num_soft_tokens_per_image"][0]),
                         "patches": int(patches.shape[0])})
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"), metadata={"format": "pt"})
    g4.write_json(os.path.join(out_dir, "reference.json"), {
        "cases": meta, "versions": {"transformers": transformers.__version__, "torch": torch.__version__}})
    print(f"  [processor] {len(meta)} cases", flush=True)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    tok = g5.build_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        tok_path = os.path.join(d, "tokenizer.json")
        tok.save(tok_path)
        names = sys.argv[1:] or ["vision", "vision-bidir", "vision-large", "processor"]
        for name in names:
            print(f"building {name}", flush=True)
            if name == "processor":
                build_processor_fixture()
            else:
                build_model_fixture(name, name != "vision", tok, tok_path)


if __name__ == "__main__":
    main()

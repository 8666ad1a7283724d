#!/usr/bin/env python3
"""Train strata-tiny: a small GLM-5-architecture (glm_moe_dsa) MoE, from scratch, in < 10 minutes on one H200.

The model is written here in plain PyTorch, mirroring transformers' `modeling_glm_moe_dsa.py`
tensor for tensor (same parameter names, same maths), plus the MTP layer that transformers
ignores (glm5.md "MTP layer"):

    e = enorm(embed(t[i+1]));  h = hnorm(h_i)   (h_i: main model's last hidden state, before model.norm)
    z = eh_proj(cat[e, h]);    z = DecoderLayer_L(z)   (full MLA + DSA + MoE layer, index L = num_hidden_layers)
    logits_mtp = lm_head(shared_head.norm(z))  -> predicts t[i+2]

Losses: next-token CE + 0.3 * next-next-token CE (MTP) + DSA indexer KL loss.  The indexer
(DeepSeek-V3.2 style) sees detached inputs and is trained to match the main attention
distribution (softmax over causal keys, summed over heads, L1-normalised, detached), so it gets
gradient only from that loss.  After a dense warm-up the forward uses real sparse attention:
each query attends only to the index_topk keys its layer's indexer selects (index_topk <
sequence length, so this is exercised during training).

Routing: sigmoid scores, noaux_tc top-k on score + e_score_correction_bias, weights normalised and
scaled by routed_scaling_factor; the bias is updated aux-loss-free (DeepSeek-V3): after each
step bias_e += rate * sign(mean_load - load_e).  Experts are computed densely for all tokens
and combined with the (sparse) routing weights: identical maths, simpler and fast at this size.

Writes to --out: train.log (via tee), metrics.json (loss curve, evals, routing stats, samples),
config.json, generation_config.json, and the weights in HF layout (per-expert tensors, as
save_pretrained writes them) split into part{0,1,2}.safetensors (< 16 MiB each; bf16, except
e_score_correction_bias in F32).  `training/finalize.py` merges the parts into
models/strata-tiny/model.safetensors and checks it against transformers.

Usage: python3 training/train_tiny.py --data training/data/tok --out OUT   (defaults = the shipped run)
       python3 training/train_tiny.py --smoke   (tiny config, a few CPU steps)
"""
import argparse
import copy
import json
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CONFIG = dict(
    architectures=["GlmMoeDsaForCausalLM"],
    model_type="glm_moe_dsa",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=32,
    num_experts_per_tok=4,
    routed_scaling_factor=2.5,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=64,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    hidden_act="silu",
    max_position_embeddings=4096,
    initializer_range=0.02,
    rms_norm_eps=1e-5,
    use_cache=True,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=[0, 4, 6],
    tie_word_embeddings=False,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    attention_bias=False,
    attention_dropout=0.0,
    index_topk=64,
    index_head_dim=64,
    index_n_heads=8,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
    dtype="bfloat16",
)

SMOKE_CONFIG = dict(CONFIG, vocab_size=8192, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                    num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                    qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=64, index_n_heads=4)


def full_config(cfg):
    """Add the derived fields transformers' GlmMoeDsaConfig writes, so config.json is explicit."""
    c = dict(cfg)
    L = c["num_hidden_layers"]
    c["qk_head_dim"] = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    c["head_dim"] = c["qk_rope_head_dim"]
    c["mlp_layer_types"] = ["dense"] * c["first_k_dense_replace"] + ["sparse"] * (L - c["first_k_dense_replace"])
    c["indexer_types"] = ["full"] * L
    # "deepseek_sparse_attention": the name transformers 5.17 knows; 5.18 renamed it
    # "indexed_attention" and still accepts (and maps) the old name, so both load.
    c["layer_types"] = ["deepseek_sparse_attention"] * L
    return c


# ============================================================================ model
class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_cos_sin(cfg, positions, device):
    d = cfg["qk_rope_head_dim"]
    theta = cfg["rope_parameters"]["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    fr = positions.float()[:, None] * inv[None, :]  # [S, d/2]
    return fr.cos(), fr.sin()


def rope_interleave(x, cos, sin):
    """x [..., S, (heads,) d]; cos/sin [S, d/2] broadcast on the middle dims by the caller."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh = cfg["index_n_heads"]
        self.hd = cfg["index_head_dim"]
        self.rope = cfg["qk_rope_head_dim"]
        self.wq_b = nn.Linear(cfg["q_lora_rank"], self.nh * self.hd, bias=False)
        self.wk = nn.Linear(cfg["hidden_size"], self.hd, bias=False)
        self.k_norm = nn.LayerNorm(self.hd, eps=1e-6)
        self.weights_proj = nn.Linear(cfg["hidden_size"], self.nh, bias=False)

    def forward(self, x, q_resid, cos, sin):
        """Index scores [B, S, T] (before the causal mask)."""
        B, S, _ = x.shape
        q = self.wq_b(q_resid).view(B, S, self.nh, self.hd)
        q = torch.cat([rope_interleave(q[..., : self.rope], cos[:, None, :], sin[:, None, :]), q[..., self.rope:]], -1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([rope_interleave(k[..., : self.rope], cos, sin), k[..., self.rope:]], -1)
        s = torch.einsum("bshd,btd->bsht", q.float(), k.float()) * self.hd ** -0.5
        s = F.relu(s)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.nh ** -0.5
        return torch.einsum("bsh,bsht->bst", w, s)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nope, self.rope, self.vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.kvl = cfg["kv_lora_rank"]
        self.q_a_proj = nn.Linear(H, cfg["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], 1e-6)
        self.q_b_proj = nn.Linear(cfg["q_lora_rank"], self.nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kvl + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kvl, 1e-6)
        self.kv_b_proj = nn.Linear(self.kvl, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, H, bias=False)
        self.indexer = Indexer(cfg)
        self.scaling = (self.nope + self.rope) ** -0.5

    def forward(self, x, cos, sin, sparse, want_index_loss, stats=None):
        B, S, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, S, self.nh, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = q[..., : self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        kv_pass, k_rot = ckv[..., : self.kvl], ckv[..., self.kvl:]
        k_pass = self.kv_a_layernorm(kv_pass)
        q_rot = rope_interleave(q_rot, cos, sin)
        k_rot = rope_interleave(k_rot, cos, sin)[:, None]  # [B,1,S,rope]
        q = torch.cat([q_pass, q_rot], -1)
        kv = self.kv_b_proj(k_pass).view(B, S, self.nh, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
        k = torch.cat([k_nope, k_rot.expand(B, self.nh, S, self.rope)], -1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scaling  # [B,nh,S,S]
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        # indexer: detached inputs, so it learns only from the KL loss
        if want_index_loss:
            idx = self.indexer(x.detach(), q_resid.detach(), cos, sin)
        else:
            with torch.no_grad():
                idx = self.indexer(x, q_resid, cos, sin)
        idx_masked = idx.masked_fill(~causal, float("-inf"))
        allowed = causal[None, None]
        if sparse and S > self.cfg["index_topk"]:
            top = idx_masked.detach().topk(self.cfg["index_topk"], dim=-1).indices
            sel = torch.zeros(B, S, S, dtype=torch.bool, device=x.device).scatter(-1, top, True)
            allowed = (causal[None] & sel)[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).reshape(B, S, self.nh * self.vd)
        out = self.o_proj(out)
        iloss = None
        if want_index_loss:
            with torch.no_grad():
                dense = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
                tgt = dense.sum(1)
                tgt = tgt / tgt.sum(-1, keepdim=True)
            logq = torch.log_softmax(idx_masked, dim=-1).masked_fill(~causal, 0.0)
            iloss = (tgt * (torch.log(tgt.clamp_min(1e-12)) - logq)).sum(-1).mean()
        if stats is not None:
            # attention mass the indexer's top-k keeps (of the dense distribution), for the card
            with torch.no_grad():
                if S > self.cfg["index_topk"]:
                    dense = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).sum(1) / self.nh
                    top = idx_masked.topk(self.cfg["index_topk"], dim=-1).indices
                    kept = dense.gather(-1, top).sum(-1)[:, self.cfg["index_topk"]:]
                    stats.setdefault("idx_recall", []).append(kept.mean().item())
        return out, iloss


class MLP(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.k = cfg["num_experts_per_tok"]
        self.rsf = cfg["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.zeros(cfg["n_routed_experts"], cfg["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg["n_routed_experts"]))

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        s = logits.sigmoid()
        top = (s + self.e_score_correction_bias).topk(self.k, dim=-1).indices
        w = s.gather(1, top)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.rsf
        return top, w


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        E, H, I = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.E, self.I = E, I
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x, combine):
        """x [N,H], combine [N,E] (zero for unselected experts)."""
        N, H = x.shape
        gu = (x @ self.gate_up_proj.reshape(self.E * 2 * self.I, H).t()).view(N, self.E, 2 * self.I)
        a = F.silu(gu[..., : self.I]) * gu[..., self.I:]
        a = a * combine.to(a.dtype)[..., None]
        wd = self.down_proj.transpose(1, 2).reshape(self.E * self.I, H)
        return a.reshape(N, self.E * self.I) @ wd


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.experts = Experts(cfg)
        self.gate = Router(cfg)
        self.shared_experts = MLP(cfg["hidden_size"], cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        self.last_top = None

    def forward(self, x):
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        top, w = self.gate(xf)
        self.last_top = top.detach()
        combine = torch.zeros(xf.shape[0], self.experts.E, device=x.device, dtype=torch.float32).scatter(1, top, w)
        y = self.experts(xf, combine).view(shp)
        return y + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if i >= cfg["first_k_dense_replace"] else MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    dropout = 0.0  # residual-branch dropout, training only (set by main)

    def forward(self, x, cos, sin, sparse, want_index_loss, stats=None):
        a, il = self.self_attn(self.input_layernorm(x), cos, sin, sparse, want_index_loss, stats)
        x = x + F.dropout(a, self.dropout, self.training)
        x = x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout, self.training)
        return x, il


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class MTPLayer(DecoderLayer):
    def __init__(self, cfg, i):
        super().__init__(cfg, i)
        H = cfg["hidden_size"]
        self.enorm = RMSNorm(H, cfg["rms_norm_eps"])
        self.hnorm = RMSNorm(H, cfg["rms_norm_eps"])
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(cfg)


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        L = cfg["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        layers = [DecoderLayer(cfg, i) for i in range(L)]
        layers += [MTPLayer(cfg, L) for _ in range(cfg["num_nextn_predict_layers"])]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class GlmMoeDsaTiny(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.L = cfg["num_hidden_layers"]

    def init_weights(self):
        std = self.cfg["initializer_range"]
        for n, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, std)
        for m in self.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        # scale residual-branch outputs down with depth (GPT-2 style)
        for n, p in self.named_parameters():
            if n.endswith("o_proj.weight") or n.endswith("down_proj.weight") or n.endswith("experts.down_proj"):
                p.data.mul_(1 / math.sqrt(2 * (self.L + 1)))

    def forward(self, ids, sparse=True, want_index_loss=False, mtp=True, stats=None):
        """Returns main logits [B,S,V], mtp logits [B,S-1,V] (position i predicts t[i+2]) or None,
        the summed indexer loss, and the per-layer router top-k."""
        B, S = ids.shape
        pos = torch.arange(S, device=ids.device)
        cos, sin = rope_cos_sin(self.cfg, pos, ids.device)
        x = self.model.embed_tokens(ids)
        ilosses = []
        tops = []
        for layer in self.model.layers[: self.L]:
            x, il = layer(x, cos, sin, sparse, want_index_loss, stats)
            if il is not None:
                ilosses.append(il)
            if isinstance(layer.mlp, MoE):
                tops.append(layer.mlp.last_top.view(B, S, -1))
        h_last = x
        logits = self.lm_head(self.model.norm(x))
        mtp_logits = None
        if mtp and S > 1:
            m = self.model.layers[self.L]
            e = m.enorm(self.model.embed_tokens(ids[:, 1:]))
            h = m.hnorm(h_last[:, :-1])
            z = m.eh_proj(torch.cat([e, h], -1))
            cos2, sin2 = cos[:-1], sin[:-1]
            z, il = DecoderLayer.forward(m, z, cos2, sin2, sparse, want_index_loss, stats)
            if il is not None:
                ilosses.append(il)
            tops.append(m.mlp.last_top.view(B, S - 1, -1))
            mtp_logits = self.lm_head(m.shared_head.norm(z))
        iloss = torch.stack(ilosses).sum() if ilosses else None
        return logits, mtp_logits, iloss, tops


# ============================================================================ export
def hf_state_dict(model):
    """Tensors under the names save_pretrained writes (per-expert), + the MTP layer."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            I = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = v[e, :I]
                out[f"{pre}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    res = {}
    for k, v in out.items():
        v = v.detach().cpu().contiguous()
        res[k] = v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    return res


def load_hf_state_dict(model, sd):
    """Inverse of hf_state_dict (fuses the per-expert tensors)."""
    own = model.state_dict()
    new = {}
    for k in own:
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            E = own[k].shape[0]
            new[k] = torch.stack([torch.cat([sd[f"{pre}{e}.gate_proj.weight"], sd[f"{pre}{e}.up_proj.weight"]], 0)
                                  for e in range(E)])
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            new[k] = torch.stack([sd[f"{pre}{e}.down_proj.weight"] for e in range(own[k].shape[0])])
        else:
            new[k] = sd[k]
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in new.items()})


def save_parts(sd, out_dir, n_parts=3):
    from safetensors.torch import save_file
    keys = sorted(sd)
    total = sum(sd[k].numel() * sd[k].element_size() for k in keys)
    per = total / n_parts
    parts, cur, acc = [], [], 0
    for k in keys:
        b = sd[k].numel() * sd[k].element_size()
        if acc + b > per and cur and len(parts) < n_parts - 1:
            parts.append(cur)
            cur, acc = [], 0
        cur.append(k)
        acc += b
    parts.append(cur)
    for i, p in enumerate(parts):
        save_file({k: sd[k] for k in p}, os.path.join(out_dir, f"part{i}.safetensors"), metadata={"format": "pt"})
    return total


def param_count(cfg):
    m = GlmMoeDsaTiny(cfg)
    n = sum(p.numel() for p in m.parameters())
    nb = sum(b.numel() for b in m.buffers())
    return n, nb


# ============================================================================ data
class Data:
    def __init__(self, d, device):
        self.train = torch.from_numpy(np.fromfile(os.path.join(d, "train.bin"), dtype=np.uint16).astype(np.int64))
        self.meta = json.load(open(os.path.join(d, "meta.json")))
        self.val = {c: torch.from_numpy(np.fromfile(os.path.join(d, f"val_{c}.bin"), dtype=np.uint16).astype(np.int64))
                    for c in self.meta["categories"]}
        self.device = device
        self.train_gpu = self.train.to(device)

    def batch(self, B, S, gen):
        ix = torch.randint(0, len(self.train) - S - 1, (B,), generator=gen)
        ar = torch.arange(S + 1)
        return self.train_gpu[(ix[:, None] + ar[None, :]).to(self.device)]

    def val_windows(self, cat, S, max_windows=None):
        v = self.val[cat]
        n = (len(v) - 1) // S
        if max_windows:
            n = min(n, max_windows)
        return torch.stack([v[i * S: i * S + S + 1] for i in range(n)])


# ============================================================================ eval
@torch.no_grad()
def evaluate(model, data, S, device, max_windows=None, collect=False, amp=True):
    model.eval()
    res = {}
    routing = {}
    for cat in data.meta["categories"]:
        w = data.val_windows(cat, S, max_windows).to(device)
        nll = n = 0.0
        mnll = mn = 0.0
        agree = correct_mtp = correct_main = tot = 0
        tops_all = None
        for i in range(0, len(w), 32):
            x = w[i: i + 32]
            inp, tgt = x[:, :-1], x[:, 1:]
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits, mtp_logits, _, tops = model(inp, sparse=True, want_index_loss=False, mtp=True)
            logits, mtp_logits = logits.float(), mtp_logits.float()
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum").item()
            n += tgt.numel()
            # MTP: position i (input t[0..i], t[i+1]) predicts t[i+2] = tgt[:, i+1]
            mt = tgt[:, 1:]
            mnll += F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), mt.reshape(-1),
                                    reduction="sum").item()
            mn += mt.numel()
            mtp_pred = mtp_logits.argmax(-1)          # [B, S-1]
            main_pred = logits.argmax(-1)[:, 1:]      # main model's greedy token for the same position
            agree += (mtp_pred == main_pred).sum().item()
            correct_mtp += (mtp_pred == mt).sum().item()
            correct_main += (main_pred == mt).sum().item()
            tot += mt.numel()
            if collect:
                t = torch.stack([tp[:, : S - 1] for tp in tops], 0).cpu()  # [layers, B, S-1, k]
                tops_all = t if tops_all is None else torch.cat([tops_all, t], 1)
        res[cat] = {"val_tokens": int(n), "loss": nll / n, "ppl": math.exp(nll / n), "mtp_loss": mnll / mn,
                    "mtp_accept_vs_main_greedy": agree / tot, "mtp_top1_vs_true": correct_mtp / tot,
                    "main_top1_vs_true_next_next_position": correct_main / tot}
        if collect:
            routing[cat] = tops_all
    model.train()
    return res, routing


def js_div(p, q):
    m = 0.5 * (p + q)

    def kl(a, b):
        mask = a > 0
        return float((a[mask] * np.log(a[mask] / b[mask])).sum())
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def routing_report(routing, E, moe_layer_ids, seed=0):
    """Per category and layer: usage distribution, top experts; mean pairwise JSD vs shuffled-window baseline."""
    cats = sorted(routing)
    rep = {"layers": moe_layer_ids, "top_experts": {}, "usage": {}, "jsd": {}, "jsd_shuffled": {}}
    rng = np.random.default_rng(seed)

    def usage(t):  # t [B, S, k]
        return np.bincount(t.reshape(-1).numpy(), minlength=E).astype(np.float64)

    for li, lid in enumerate(moe_layer_ids):
        dists = {}
        for c in cats:
            u = usage(routing[c][li])
            dists[c] = u / u.sum()
            rep["top_experts"].setdefault(c, {})[str(lid)] = [int(e) for e in np.argsort(-u)[:4]]
            rep["usage"].setdefault(c, {})[str(lid)] = [round(float(x), 5) for x in dists[c]]
        pairs = [(a, b) for i, a in enumerate(cats) for b in cats[i + 1:]]
        rep["jsd"][str(lid)] = float(np.mean([js_div(dists[a], dists[b]) for a, b in pairs]))
        # baseline: the same windows with category labels shuffled (window counts kept)
        wins = [(c, routing[c][li][j]) for c in cats for j in range(routing[c][li].shape[0])]
        labels = [c for c, _ in wins]
        vals = []
        for _ in range(5):
            perm = rng.permutation(len(labels))
            d2 = {}
            for c in cats:
                sel = [wins[j][1] for j, lab in zip(perm, labels) if lab == c]
                u = usage(torch.stack(sel))
                d2[c] = u / u.sum()
            vals.append(np.mean([js_div(d2[a], d2[b]) for a, b in pairs]))
        rep["jsd_shuffled"][str(lid)] = float(np.mean(vals))
    return rep


@torch.no_grad()
def greedy(model, tok, prompt_ids, n, device, stop_ids=()):
    model.eval()
    ids = list(prompt_ids)
    for _ in range(n):
        x = torch.tensor([ids[-512:]], device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, _, _, _ = model(x, sparse=True, mtp=False)
        t = int(logits[0, -1].float().argmax())
        ids.append(t)
        if t in stop_ids:
            break
    model.train()
    return ids[len(prompt_ids):]


SAMPLE_PROMPTS = [
    ("press", "The city council voted on Tuesday to"),
    ("fiction", "She opened the door and saw"),
    ("bible", "And the LORD spake unto Moses, saying,"),
    ("learned", "The results of the experiment show that"),
    ("fortunes", "A wise man once said"),
    ("python", "def read_config(path):\n    \"\"\"Read the configuration file"),
    ("jargon", ":hacker: n."),
    ("dictionary", "Lantern \\Lan\"tern\\, n."),
    ("chat", "[gMASK]<sop><|user|>\nWhat does \"cruft\" mean?<|assistant|>\n"),
]


# ============================================================================ train
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "data", "tok"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/strata-tiny-out"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "models", "strata-tiny", "tokenizer.json"))
    ap.add_argument("--budget-s", type=float, default=360.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=10 ** 9)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--dense-frac", type=float, default=0.1, help="fraction of the budget with dense attention")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=250)  # shipped run: defaults throughout
    ap.add_argument("--dropout", type=float, default=0.25, help="residual dropout (training only)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true")
    # Routing-shape variants (the shipped run: 32 experts, top-4, 64 wide). GLM-5's own
    # routing is 256 experts, top-8: `--experts 256 --top-k 8 --moe-inter 32` keeps the
    # active expert parameters a token of the shipped model's, for routing traces.
    ap.add_argument("--experts", type=int, help="routed experts a MoE layer (n_routed_experts)")
    ap.add_argument("--top-k", type=int, help="experts a token (num_experts_per_tok)")
    ap.add_argument("--moe-inter", type=int, help="an expert's intermediate width (moe_intermediate_size)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = dict(SMOKE_CONFIG if args.smoke else CONFIG)
    for key, val in (("n_routed_experts", args.experts), ("num_experts_per_tok", args.top_k),
                     ("moe_intermediate_size", args.moe_inter)):
        if val is not None:
            if val < 1:
                sys.exit(f"--{key}: must be at least 1, got {val}")
            cfg[key] = val
    if cfg["num_experts_per_tok"] > cfg["n_routed_experts"]:
        sys.exit(f"--top-k {cfg['num_experts_per_tok']} exceeds the {cfg['n_routed_experts']} routed experts")
    if args.smoke:
        args.batch, args.seq, args.max_steps, args.eval_every, args.warmup = 4, 48, 12, 6, 2
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    data = Data(args.data, device)
    assert data.meta["vocab_size"] == cfg["vocab_size"], data.meta["vocab_size"]
    DecoderLayer.dropout = args.dropout
    model = GlmMoeDsaTiny(cfg).to(device)
    model.init_weights()
    n_params, n_buf = param_count(cfg)
    n_bytes = n_params * 2 + n_buf * 4
    print(f"device {device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}")
    print(f"params {n_params:,} (+{n_buf} buffer floats) -> {n_bytes / 1e6:.2f} MB in bf16")
    print(f"train tokens {len(data.train):,}")

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed_tokens" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    moe_layers = [l.mlp for l in model.model.layers if isinstance(l.mlp, MoE)]
    moe_layer_ids = [i for i, l in enumerate(model.model.layers) if isinstance(l.mlp, MoE)]
    gen = torch.Generator().manual_seed(args.seed)

    curve = []
    val_curve = []
    best = (float("inf"), None, 0)
    t0 = time.time()
    step = 0
    tokens = 0
    amp = device.type == "cuda"
    while True:
        el = time.time() - t0
        frac = el / args.budget_s
        if frac >= 1.0 or step >= args.max_steps:
            break
        if args.smoke:
            frac = step / args.max_steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup:
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        sparse = frac >= args.dense_frac
        x = data.batch(args.batch, args.seq, gen)
        inp, tgt = x[:, :-1], x[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits, mtp_logits, iloss, tops = model(inp, sparse=sparse, want_index_loss=True, mtp=True)
        V = logits.shape[-1]
        loss_main = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1))
        loss_mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), tgt[:, 1:].reshape(-1))
        loss = loss_main + args.mtp_weight * loss_mtp + iloss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # aux-loss-free balancing of e_score_correction_bias
        with torch.no_grad():
            for m in moe_layers:
                E = m.gate.e_score_correction_bias.numel()
                load = torch.bincount(m.last_top.reshape(-1), minlength=E).float()
                m.gate.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
        step += 1
        tokens += inp.numel()
        if step % 25 == 0 or step == 1 or args.smoke:
            lm, lt, li = loss_main.item(), loss_mtp.item(), iloss.item()
            el = time.time() - t0
            curve.append({"step": step, "tokens": tokens, "time_s": round(el, 1), "loss": lm, "mtp_loss": lt,
                          "indexer_kl": li, "lr": lr, "sparse": sparse})
            print(f"step {step:5d} tok {tokens / 1e6:7.2f}M t {el:6.1f}s lr {lr:.2e} loss {lm:.4f} "
                  f"mtp {lt:.4f} idxKL {li:.4f} gn {gn.item():.2f} sparse {int(sparse)} "
                  f"tok/s {tokens / max(el, 1e-9):,.0f}", flush=True)
        if step % args.eval_every == 0:
            ev, _ = evaluate(model, data, args.seq, device, max_windows=16, amp=amp)
            vl = float(np.mean([v["loss"] for v in ev.values()]))
            val_curve.append({"step": step, "tokens": tokens, "val_loss_mean_over_cats": vl})
            print(f"  eval step {step}: mean val loss {vl:.4f} " +
                  " ".join(f"{c}={v['loss']:.3f}" for c, v in ev.items()), flush=True)
            if vl < best[0] and sparse:
                best = (vl, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
    train_time = time.time() - t0
    print(f"trained {step} steps, {tokens:,} tokens in {train_time:.1f}s")

    # final eval of the last weights; keep the best checkpoint if it is better
    ev, _ = evaluate(model, data, args.seq, device, max_windows=16, amp=amp)
    vl = float(np.mean([v["loss"] for v in ev.values()]))
    val_curve.append({"step": step, "tokens": tokens, "val_loss_mean_over_cats": vl})
    chosen = step
    if best[1] is not None and best[0] < vl:
        model.load_state_dict(best[1])
        chosen = best[2]
        print(f"restored best checkpoint from step {best[2]} (val {best[0]:.4f} < final {vl:.4f})")

    # round-trip through bf16 so the evals below describe the shipped weights
    sd = hf_state_dict(model)
    load_hf_state_dict(model, {k: v.float() for k, v in sd.items()})

    full, routing = evaluate(model, data, args.seq, device, collect=True, amp=amp)
    rr = routing_report(routing, cfg["n_routed_experts"], moe_layer_ids)  # includes the MTP layer
    stats = {}
    with torch.no_grad():
        w = data.val_windows("fiction", args.seq, 8).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            model.eval()
            model(w[:, :-1], sparse=True, mtp=True, stats=stats)
            model.train()
    idx_recall = float(np.mean(stats.get("idx_recall", [float("nan")])))
    for c, v in full.items():
        print(f"  {c:10s} ppl {v['ppl']:8.2f}  mtp-accept {v['mtp_accept_vs_main_greedy']:.3f}  "
              f"mtp-top1 {v['mtp_top1_vs_true']:.3f}  jsd-layers")
    print("routing JSD per layer:", rr["jsd"], "shuffled:", rr["jsd_shuffled"])
    print(f"indexer top-{cfg['index_topk']} keeps {idx_recall:.3f} of the dense attention mass (fiction, S={args.seq})")

    samples = []
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(args.tokenizer)
        for cat, p in SAMPLE_PROMPTS:
            ids = tok.encode(p).ids
            outi = greedy(model, tok, ids, 8 if args.smoke else 80, device, stop_ids=(0, 4, 6))
            samples.append({"category": cat, "prompt": p, "completion": tok.decode(outi, skip_special_tokens=False)})
            print(f"--- [{cat}] {p!r}\n{samples[-1]['completion']!r}", flush=True)
    except Exception as e:  # noqa
        print("sampling failed:", repr(e))

    total_bytes = save_parts(sd, args.out)
    fc = full_config(cfg)
    json.dump(fc, open(os.path.join(args.out, "config.json"), "w"), indent=2)
    metrics = {
        "config": fc, "params": n_params, "weight_bytes": total_bytes, "steps": step, "chosen_step": chosen,
        "tokens": tokens, "train_time_s": train_time, "batch": args.batch, "seq": args.seq, "lr": args.lr,
        "mtp_weight": args.mtp_weight, "dropout": args.dropout, "warmup": args.warmup, "dense_frac": args.dense_frac, "budget_s": args.budget_s,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "curve": curve, "val_curve": val_curve, "eval": full, "routing": rr,
        "indexer_topk_mass_kept": idx_recall, "samples": samples, "train_tokens_available": len(data.train),
    }
    json.dump(metrics, open(os.path.join(args.out, "metrics.json"), "w"), indent=1)
    print("done; wrote", sorted(os.listdir(args.out)))


if __name__ == "__main__":
    main()

//! Gemma 4 (`gemma4`, `gemma4_text`). Reference: transformers
//! `models/gemma4/modeling_gemma4.py`; notes in `shared/reference/gemma4.md`.
//!
//! The text model, as the paper draws it:
//! - **Embedding** times `sqrt(hidden)`; the head is the embedding (tied); final logits
//!   soft-capped (`final_logit_softcapping`).
//! - **Layers** of two kinds (`layer_types`): *sliding* (a window of `sliding_window`
//!   positions, `head_dim`, default RoPE) and *full* (every position, `global_head_dim`,
//!   fewer KV heads, proportional RoPE: a fraction of the frequency pairs rotates over the
//!   whole head, the rest stay put). Queries and keys are RMSNorm'd per head with a scale,
//!   values without; attention scaling is 1. With `attention_k_eq_v`, full layers take
//!   their values from the key projection. The last `num_kv_shared_layers` layers read
//!   the K/V cache of the last earlier layer of their kind ([`attention`]).
//! - **Sandwich norms**: every sublayer's input and output are normalised before the
//!   residual add; a per-layer scalar multiplies the residual at the end of the layer.
//! - **Feed-forward**: a GELU-tanh gated MLP; on MoE models (26B-A4B) routed experts in
//!   parallel with it, behind a softmax router with per-expert scales ([`ffn`]).
//! - **Per-Layer Embeddings** (E2B/E4B): a small per-layer input per token gated into the
//!   residual after the feed-forward ([`ple`]).
//!
//! Caches: full layers in KV blocks, sliding layers in per-sequence rings of
//! `window + rows - 1` positions ([`ring`]), shared layers none.
//!
//! Files: `config.rs` (config.json, validated), `weights.rs` (every tensor's name, shape
//! and role), `load.rs` (tensors onto a backend), `attention.rs`, `ffn.rs`, `ple.rs`,
//! `ring.rs` (the blocks), `model.rs` (the forward pass and its session), `vision.rs`
//! (the vision tower's configuration).

mod attention;
mod config;
mod ffn;
mod load;
mod model;
mod ple;
mod ring;
pub mod vision;
pub mod weights;

pub use config::{Gemma4Config, LayerKind, LayerSpec, MoeSpec, PleSpec, Rope, TextConfig};
pub use model::{Gemma4, Gemma4Session};

use crate::registry::{Arch, ChatFormat, Device, Family, LoadSpec, MoeLayout};
use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::{bail, Result};
use attention::AttnScratch;
use ffn::FfnScratch;
use ple::PleScratch;
use serde_json::{json, Value};
use std::sync::Arc;
use strata_backend::cpu::CpuBackend;
use strata_storage::WeightStore;

pub static FAMILY: Family =
    Family { name: "gemma4", model_types: &config::MODEL_TYPES, chat: ChatFormat::Gemma, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(Gemma4Config::from_json(json)?))
}

fn info(cfg: &Gemma4Config) -> ModelInfo {
    let t = &cfg.text;
    ModelInfo {
        family: FAMILY.name,
        model_type: cfg.model_type.clone(),
        vocab_size: t.vocab_size,
        hidden_size: t.hidden_size,
        max_context: t.max_position_embeddings,
        eos_token_ids: t.eos_token_ids.clone(),
        bos_token_id: t.bos_token_id,
        num_layers: t.num_layers(),
    }
}

impl Gemma4Config {
    /// KV bytes of one position in the layers with their own cache, by kind.
    fn kv_bytes_by_kind(&self) -> [u64; 2] {
        let mut by = [0u64; 2];
        for l in self.text.layers.iter().filter(|l| l.kv_from.is_none()) {
            by[(l.kind == LayerKind::Full) as usize] += 4 * (2 * l.kv_heads * l.head_dim) as u64;
        }
        by
    }
}

impl Arch for Gemma4Config {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    fn model_type(&self) -> &str {
        &self.model_type
    }

    fn info(&self) -> ModelInfo {
        info(self)
    }

    fn weight_map(&self) -> WeightMap {
        weights::weight_map(self)
    }

    fn moe(&self) -> Option<MoeLayout> {
        let m = self.text.moe?;
        Some(MoeLayout {
            layers: (0..self.text.num_layers()).collect(),
            experts_per_layer: m.experts,
            top_k: m.top_k,
            hidden: self.text.hidden_size,
            inter: m.inter,
            mtp_layers: Vec::new(),
        })
    }

    /// Every layer with its own cache, as if each held every position (sliding layers
    /// hold at most their ring: see [`Arch::kv_bytes`]).
    fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_by_kind().iter().sum()
    }

    fn kv_bytes(&self, context: usize, rows: usize) -> u64 {
        let [sliding, full] = self.kv_bytes_by_kind();
        let ring = (self.text.sliding_window + rows.max(1) - 1).min(context).next_multiple_of(crate::kv::BLOCK_SIZE);
        full * context as u64 + sliding * ring.min(context.next_multiple_of(crate::kv::BLOCK_SIZE)) as u64
    }

    fn vision_tower(&self) -> bool {
        self.vision.is_some()
    }

    fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        let t = &self.text;
        let (h, r) = (t.hidden_size, rows);
        let q = t.layers.iter().map(|l| t.num_attention_heads * l.head_dim).max().unwrap_or(0);
        let kv = t.layers.iter().map(|l| l.kv_heads * l.head_dim).max().unwrap_or(0);
        let half: usize =
            [LayerKind::Sliding, LayerKind::Full].iter().filter_map(|k| t.kind_shape(*k)).map(|(hd, _)| hd / 2).sum();
        let moe = t.moe.map(|m| (m.experts, m.top_k));
        let ple = t.ple.map_or(0, |p| PleScratch::<CpuBackend>::bytes(rows, h, t.num_layers(), p.dim));
        let inter = t.layers.iter().map(|l| l.mlp_width).max().unwrap_or(0).max(t.moe.map_or(0, |m| m.inter * m.top_k));
        let threads = strata_kernels::pool::default_threads() as u64;
        let group = t.layers.iter().map(|l| t.num_attention_heads / l.kv_heads).max().unwrap_or(1) as u64;
        // Residual and normed input, rotary tables; attention, feed-forward and PLE
        // scratch; one row of logits; the expert runner's gathered inputs and
        // intermediates; per-thread attention scores.
        4 * (2 * r * h + 2 * r * half) as u64
            + AttnScratch::<CpuBackend>::bytes(rows, h, q, kv)
            + FfnScratch::<CpuBackend>::bytes(rows, h, moe)
            + ple
            + 4 * (2 * h + t.vocab_size) as u64
            + 4 * (r * (h * moe.map_or(1, |m| m.1 + 1) + 2 * inter)) as u64
            + 4 * threads * group * context.max(1) as u64
    }

    fn fp8_block(&self) -> Option<(usize, usize)> {
        self.fp8_block
    }

    fn describe(&self) -> Value {
        let t = &self.text;
        let kind = |k: LayerKind| {
            let layers: Vec<usize> = (0..t.num_layers()).filter(|&i| t.layers[i].kind == k).collect();
            let (head_dim, kv_heads) = t.kind_shape(k).unwrap_or((0, 0));
            let r = t.rope(k);
            json!({"layers": layers, "head_dim": head_dim, "kv_heads": kv_heads, "rope_theta": r.theta,
                   "rotated_fraction": r.partial})
        };
        json!({
            "model_type": self.model_type,
            "hidden_size": t.hidden_size,
            "layers": t.num_layers(),
            "attention_heads": t.num_attention_heads,
            "sliding": kind(LayerKind::Sliding),
            "full": kind(LayerKind::Full),
            "sliding_window": t.sliding_window,
            "attention_k_eq_v": t.layers.iter().any(|l| l.k_eq_v),
            "kv_shared_layers": t.num_kv_shared_layers,
            "intermediate_size": t.intermediate_size,
            "per_layer_input": t.ple.map(|p| p.dim),
            "routed_experts": t.moe.map(|m| m.experts),
            "experts_per_token": t.moe.map(|m| m.top_k),
            "moe_intermediate_size": t.moe.map(|m| m.inter),
            "final_logit_softcapping": t.final_logit_softcapping,
            "vocab_size": t.vocab_size,
            "max_position_embeddings": t.max_position_embeddings,
            "vision_tower": self.vision.as_ref().map(|v| json!({
                "layers": v.layers, "hidden_size": v.hidden_size, "heads": v.heads, "patch_size": v.patch_size,
                "pooling": v.pooling, "image_attention": if t.bidirectional_vision {
                    "bidirectional within an image on sliding layers"
                } else {
                    "causal"
                },
            })),
            "audio_tower": if self.audio { "present, not run (audio input is refused)" } else { "none" },
            "fp8_block": self.fp8_block,
        })
    }

    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        if spec.draft.is_some() {
            bail!("--mtp on: Gemma 4 has no draft (MTP) layer (use --mtp off)");
        }
        match spec.device {
            Device::Cpu => {
                let provider = crate::registry::cpu_provider(spec.experts)?;
                Ok(Box::new(model::Gemma4::load(CpuBackend::new(), self.clone(), store, provider)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let provider = crate::registry::cuda_provider(spec.experts)?;
                let b = crate::registry::cuda_backend(n)?;
                Ok(Box::new(model::Gemma4::load(b, self.clone(), store, provider)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => bail!("{}", crate::registry::no_cuda(n)),
        }
    }
}

//! Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B): a hybrid of linear and full attention.
//! Three of every four layers are a gated DeltaNet (a short causal convolution over q, k
//! and v, then the gated delta rule on a per-head recurrent state, its output RMS-normed
//! and gated by `silu(z)`); the fourth is full attention whose q_proj also yields an
//! output gate (`o_proj(attn * sigmoid(gate))`), with per-head q/k norms and RoPE on a
//! quarter of each head. Every layer's MLP is the routed MoE (softmax top-k, renormalised)
//! beside a shared expert weighted by `sigmoid(x . w)`, or a dense SwiGLU by
//! `mlp_only_layers` / `decoder_sparse_step`. Its norms are `x * (1 + w)`. The
//! checkpoint's MTP layer (`mtp.*`) is described, not run. Reference: transformers
//! `models/qwen3_next/modeling_qwen3_next.py`.
//!
//! Qwen3.5-MoE (`qwen3_5_moe`, `qwen3_5_moe_text`) is the same network ([`Variant`]): its
//! DeltaNet's input projections are separate tensors already in q, k, v, z order, and
//! every layer is routed. Its rotary embedding is multimodal (t/h/w sections), which for
//! text, every section at the same position, is the plain one. Reference:
//! `models/qwen3_5_moe/modular_qwen3_5_moe.py`.
//!
//! Files: `config.rs`, `weights.rs` (every tensor's name, shape and role), `load.rs`,
//! `model.rs` (the forward and the session, whose sequences carry recurrent state).
//! The DeltaNet runs as the backend's `gated_delta_net` (CPU: `strata_kernels::deltanet`;
//! CUDA: `kernels/deltanet.cu`).

mod config;
mod load;
mod model;
pub mod weights;

pub use config::{Qwen3NextConfig, Variant};
pub use model::{Qwen3Next, Qwen3NextSession};

use crate::blocks::{GqaScratch, MoeScratch};
use crate::registry::{Arch, ChatFormat, Device, Family, LoadSpec, MoeLayout};
use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::sync::Arc;
use strata_backend::cpu::CpuBackend;
use strata_backend::GqaDims;
use strata_storage::WeightStore;

pub static FAMILY: Family =
    Family { name: "qwen3_next", model_types: &["qwen3_next"], chat: ChatFormat::Qwen, parse: parse_arch };

/// Qwen3.5-MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): this network with the DeltaNet's
/// projections apart ([`Variant::Qwen35`]); its text model, the vision tower not run.
pub static QWEN35_FAMILY: Family = Family {
    name: "qwen3_5_moe",
    model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
    chat: ChatFormat::Qwen,
    parse: parse_arch,
};

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(Qwen3NextConfig::from_json(json)?))
}

impl Qwen3NextConfig {
    pub fn gqa_dims(&self) -> GqaDims {
        GqaDims {
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rotary: self.rotary_dim,
            scale: (self.head_dim as f32).powf(-0.5),
            window: None,
        }
    }

    /// The `model_type` this config came as.
    pub fn model_type_name(&self) -> &'static str {
        match self.variant {
            Variant::Next => "qwen3_next",
            Variant::Qwen35 { wrapped: true } => "qwen3_5_moe",
            Variant::Qwen35 { wrapped: false } => "qwen3_5_moe_text",
        }
    }

    fn attention_layers(&self) -> usize {
        self.linear.iter().filter(|&&l| !l).count()
    }

    /// A sequence's DeltaNet state (every linear layer's), in bytes.
    pub fn state_bytes(&self) -> u64 {
        let d = &self.delta;
        4 * ((self.num_hidden_layers - self.attention_layers()) * (d.state_len() + d.conv_state_len())) as u64
    }
}

impl Arch for Qwen3NextConfig {
    fn family(&self) -> &'static Family {
        match self.variant {
            Variant::Next => &FAMILY,
            Variant::Qwen35 { .. } => &QWEN35_FAMILY,
        }
    }

    fn model_type(&self) -> &str {
        self.model_type_name()
    }

    fn info(&self) -> ModelInfo {
        ModelInfo {
            family: self.family().name,
            model_type: self.model_type_name().into(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            max_context: self.max_position_embeddings,
            eos_token_ids: self.eos_token_ids.clone(),
            bos_token_id: self.bos_token_id,
            num_layers: self.num_hidden_layers,
        }
    }

    fn weight_map(&self) -> WeightMap {
        weights::weight_map(self)
    }

    fn moe(&self) -> Option<MoeLayout> {
        let layers: Vec<usize> = (0..self.num_hidden_layers).filter(|&l| self.is_sparse(l)).collect();
        if layers.is_empty() {
            return None;
        }
        Some(MoeLayout {
            layers,
            experts_per_layer: self.num_experts,
            top_k: self.num_experts_per_tok,
            hidden: self.hidden_size,
            inter: self.moe_intermediate_size,
            mtp_layers: Vec::new(),
        })
    }

    fn kv_bytes_per_token(&self) -> u64 {
        4 * (self.attention_layers() * 2 * self.num_key_value_heads * self.head_dim) as u64
    }

    fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        let (h, r) = (self.hidden_size as u64, rows as u64);
        let d = &self.delta;
        let moe = match self.sparse_layers() > 0 {
            true => MoeScratch::<CpuBackend>::bytes(
                rows,
                self.hidden_size,
                self.num_experts,
                self.num_experts_per_tok,
                true,
            ),
            false => 0,
        };
        let k = self.num_experts_per_tok as u64;
        let inter = self.intermediate_size.max(self.moe_intermediate_size * self.num_experts_per_tok) as u64;
        let threads = strata_kernels::pool::default_threads() as u64;
        let group = (self.num_attention_heads / self.num_key_value_heads) as u64;
        // Residual, normed input, MLP output, rotary tables; attention, DeltaNet and MoE
        // scratch; one row of logits; the expert runner's gathered inputs and
        // intermediates; per-thread attention scores; one sequence's recurrent state.
        4 * (3 * r * h + r * self.rotary_dim as u64)
            + GqaScratch::<CpuBackend>::bytes(&self.gqa_dims(), rows, false, true)
            + 4 * r * (d.qkvz_width() + 2 * d.v_heads + d.value_dim()) as u64
            + moe
            + 4 * (2 * h + self.vocab_size as u64)
            + 4 * r * (h * (k + 1) + 2 * inter)
            + 4 * threads * group * context.max(1) as u64
            + self.state_bytes()
    }

    fn describe(&self) -> Value {
        let d = &self.delta;
        json!({
            "model_type": self.model_type_name(),
            "hidden_size": self.hidden_size,
            "layers": self.num_hidden_layers,
            "linear_attention_layers": self.num_hidden_layers - self.attention_layers(),
            "full_attention_layers": self.attention_layers(),
            "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "rope_theta": self.rope_theta,
            "linear_key_heads": d.k_heads,
            "linear_value_heads": d.v_heads,
            "linear_key_head_dim": d.k_dim,
            "linear_value_head_dim": d.v_dim,
            "linear_conv_kernel": d.kernel,
            "recurrent_state_bytes_per_sequence": self.state_bytes(),
            "moe_layers": self.sparse_layers(),
            "routed_experts": self.num_experts,
            "experts_per_token": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "shared_experts": 1,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        })
    }

    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        if spec.draft.is_some() {
            bail!("--mtp on: speculative decoding is not implemented for {} (use --mtp off)", self.model_type_name());
        }
        match spec.device {
            Device::Cpu => {
                let provider = crate::registry::cpu_provider(spec.experts)?;
                Ok(Box::new(Qwen3Next::load(CpuBackend::new(), self.clone(), Arch::info(self), store, provider)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let provider = crate::registry::cuda_provider(spec.experts)?;
                let b = crate::registry::cuda_backend(n)?;
                Ok(Box::new(Qwen3Next::load(b, self.clone(), Arch::info(self), store, provider)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => bail!("{}", crate::registry::no_cuda(n)),
        }
    }
}

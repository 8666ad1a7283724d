//! GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention (optional q/k/v biases and
//! per-head q/k RMSNorm, half-split RoPE over the leading `partial_rotary_factor` of each
//! head) and the DeepSeek-V3 `noaux_tc` MoE with a shared expert, after
//! `first_k_dense_replace` dense layers. Reference: transformers
//! `models/glm4_moe/modeling_glm4_moe.py`.
//!
//! Files: `config.rs` (config.json, validated), `weights.rs` (every tensor's name, shape
//! and role), `load.rs` (tensors onto a backend), `model.rs` (the forward pass over the
//! shared blocks). The checkpoint's MTP layer is described (inspect, convert, the plan)
//! but not run: speculative decoding is GLM-5's for now.

mod config;
mod load;
mod model;
pub mod weights;

pub use config::Glm4MoeConfig;
pub use model::{Glm4, Glm4Session};

use crate::blocks::{GqaScratch, MoeScratch};
use crate::registry::{Arch, ChatFormat, Device, Family, LoadSpec, MoeLayout};
use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::sync::Arc;
use strata_backend::cpu::CpuBackend;
use strata_storage::WeightStore;

pub static FAMILY: Family =
    Family { name: "glm4_moe", model_types: &["glm4_moe"], chat: ChatFormat::Glm, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(Glm4MoeConfig::from_json(json)?))
}

fn info(cfg: &Glm4MoeConfig) -> ModelInfo {
    ModelInfo {
        family: FAMILY.name,
        model_type: Glm4MoeConfig::MODEL_TYPE.into(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        max_context: cfg.max_position_embeddings,
        eos_token_ids: cfg.eos_token_ids.clone(),
        bos_token_id: cfg.bos_token_id,
        num_layers: cfg.num_hidden_layers,
    }
}

impl Arch for Glm4MoeConfig {
    fn family(&self) -> &'static Family {
        &FAMILY
    }

    fn model_type(&self) -> &str {
        Self::MODEL_TYPE
    }

    fn info(&self) -> ModelInfo {
        info(self)
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
            experts_per_layer: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            hidden: self.hidden_size,
            inter: self.moe_intermediate_size,
            // The MTP layer is not run (see the module docs), so its experts are not planned.
            mtp_layers: Vec::new(),
        })
    }

    fn kv_bytes_per_token(&self) -> u64 {
        4 * (self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim) as u64
    }

    fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        let (h, r) = (self.hidden_size as u64, rows as u64);
        let k = self.num_experts_per_tok as u64;
        let moe = match self.sparse_layers() > 0 {
            true => MoeScratch::<CpuBackend>::bytes(
                rows,
                self.hidden_size,
                self.n_routed_experts,
                self.num_experts_per_tok,
                true,
            ),
            false => 0,
        };
        let inter = self.intermediate_size.max(self.moe_intermediate_size * (self.num_experts_per_tok + 1)) as u64;
        let threads = strata_kernels::pool::default_threads() as u64;
        let group = (self.num_attention_heads / self.num_key_value_heads) as u64;
        // Residual, normed input, MLP output, rotary tables; attention and MoE scratch;
        // one row of logits; the expert runner's gathered inputs and intermediates;
        // per-thread attention scores.
        4 * (3 * r * h + r * self.rotary_dim() as u64)
            + GqaScratch::<CpuBackend>::bytes(&load::gqa_dims(self), rows)
            + moe
            + 4 * (2 * h + self.vocab_size as u64)
            + 4 * r * (h * (k + 1) + 2 * inter)
            + 4 * threads * group * context.max(1) as u64
    }

    fn fp8_block(&self) -> Option<(usize, usize)> {
        self.fp8_block
    }

    fn describe(&self) -> Value {
        json!({
            "model_type": Self::MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "layers": self.num_hidden_layers,
            "dense_layers": self.num_hidden_layers - self.sparse_layers(),
            "moe_layers": self.sparse_layers(),
            "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim(),
            "attention_bias": self.attention_bias,
            "qk_norm": self.use_qk_norm,
            "routed_experts": self.n_routed_experts,
            "experts_per_token": self.num_experts_per_tok,
            "shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mtp_layers": self.num_nextn_predict_layers,
            "fp8_block": self.fp8_block,
        })
    }

    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        if spec.draft.is_some() {
            bail!("--mtp on: speculative decoding is not implemented for glm4_moe (use --mtp off)");
        }
        match spec.device {
            Device::Cpu => {
                let provider = crate::registry::cpu_provider(spec.experts)?;
                Ok(Box::new(model::Glm4::load(CpuBackend::new(), self.clone(), store, provider)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let provider = crate::registry::cuda_provider(spec.experts)?;
                let b = crate::registry::cuda_backend(n)?;
                Ok(Box::new(model::Glm4::load(b, self.clone(), store, provider)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => bail!("{}", crate::registry::no_cuda(n)),
        }
    }
}

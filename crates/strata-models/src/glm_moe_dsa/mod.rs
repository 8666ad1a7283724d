//! GLM-5.x (`glm_moe_dsa`): MLA attention with a compressed latent KV cache, DeepSeek
//! Sparse Attention (the lightning indexer), and a DeepSeek-V3 `noaux_tc` MoE with a
//! shared expert. Reference: transformers `models/glm_moe_dsa/modeling_glm_moe_dsa.py`.
//!
//! Files: `config.rs` (config.json, validated), `weights.rs` (every tensor's name, shape
//! and role), `model.rs` (loading and the forward pass over the shared blocks),
//! `synth.rs` (random checkpoints with real shapes).

mod config;
mod load;
mod model;
mod synth;
pub mod weights;

pub use config::{GlmMoeDsaConfig, IndexerKind, MlpKind, Variant};
pub use model::{Glm, GlmSession};
pub use synth::{synth_config, synthesize, Preset, SynthFormat, SynthRng, SynthSpec};

use crate::blocks::{MlaConfig, MlaScratch, MoeScratch};
use crate::registry::{Arch, ChatFormat, Device, ExpertsChoice, Family, LoadSpec, MoeLayout};
use crate::weights::WeightMap;
use crate::{Model, ModelInfo};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;
use strata_backend::cpu::CpuBackend;
use strata_storage::WeightStore;

pub static FAMILY: Family =
    Family { name: "glm_moe_dsa", model_types: &["glm_moe_dsa"], chat: ChatFormat::Glm, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(GlmMoeDsaConfig::from_json(json)?))
}

pub(crate) fn info(cfg: &GlmMoeDsaConfig) -> ModelInfo {
    ModelInfo {
        family: cfg.family().name,
        model_type: cfg.model_type.clone(),
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        max_context: cfg.max_position_embeddings,
        eos_token_ids: cfg.eos_token_ids.clone(),
        bos_token_id: cfg.bos_token_id,
        num_layers: cfg.num_hidden_layers,
    }
}

impl GlmMoeDsaConfig {
    fn full_layers(&self) -> usize {
        self.indexer_types.iter().filter(|k| **k == IndexerKind::Full).count()
    }

    fn mla_config(&self) -> MlaConfig {
        load::mla_config(self)
    }
}

impl Arch for GlmMoeDsaConfig {
    fn family(&self) -> &'static Family {
        // GLM-5, DeepSeek-V3 and Kimi K2 share this config: the registry knows whose it is.
        crate::registry::family_of(&self.model_type).expect("a config is parsed through its family")
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
        let layers: Vec<usize> =
            (0..self.num_hidden_layers).filter(|&l| self.mlp_layer_types[l] == MlpKind::Sparse).collect();
        if layers.is_empty() {
            return None;
        }
        Some(MoeLayout {
            layers,
            experts_per_layer: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            hidden: self.hidden_size,
            inter: self.moe_intermediate_size,
            mtp_layers: (self.num_hidden_layers..self.num_hidden_layers + self.num_nextn_predict_layers).collect(),
        })
    }

    fn kv_bytes_per_token(&self) -> u64 {
        4 * (self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.full_layers() * self.index_head_dim) as u64
    }

    fn activation_bytes(&self, rows: usize, context: usize) -> u64 {
        let h = self.hidden_size as u64;
        let r = rows as u64;
        let moe = if self.sparse_layers() > 0 {
            MoeScratch::<CpuBackend>::bytes(
                rows,
                self.hidden_size,
                self.n_routed_experts,
                self.num_experts_per_tok,
                true,
            )
        } else {
            0
        };
        // Residual, normed input, MLP output, rotary tables; MLA and MoE scratch; one row
        // of logits per sequence; the expert runner's gathered inputs and intermediates;
        // per-thread attention scores.
        let inter = self.intermediate_size.max(self.moe_intermediate_size * (self.num_experts_per_tok + 1)) as u64;
        let threads = strata_kernels::pool::default_threads() as u64;
        let heads = self.num_attention_heads.max(self.index_n_heads) as u64;
        4 * (3 * r * h + r * self.qk_rope_head_dim as u64)
            + MlaScratch::<CpuBackend>::bytes(&self.mla_config(), rows, context)
            + moe
            + 4 * (2 * h + self.vocab_size as u64)
            + 4 * r * (h * (self.num_experts_per_tok as u64 + 1) + 2 * inter)
            + 4 * threads * heads * self.index_topk.min(context.max(1)) as u64
    }

    fn fp8_block(&self) -> Option<(usize, usize)> {
        self.fp8_block
    }

    fn describe(&self) -> Value {
        let mut d = json!({
            "model_type": self.model_type,
            "rope": {"theta": self.rope.theta, "yarn_factor": self.rope.yarn.as_ref().map(|y| y.factor)},
            "hidden_size": self.hidden_size,
            "layers": self.num_hidden_layers,
            "dense_layers": self.mlp_layer_types.iter().filter(|k| **k == MlpKind::Dense).count(),
            "moe_layers": self.sparse_layers(),
            "attention_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "routed_experts": self.n_routed_experts,
            "experts_per_token": self.num_experts_per_tok,
            "shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "index_topk": self.index_topk,
            "index_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "indexer_layers_full": self.full_layers(),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mtp_layers": self.num_nextn_predict_layers,
            "fp8_block": self.fp8_block,
        });
        if self.variant == Variant::DeepseekV3 {
            // No DSA: its fields mean nothing here.
            d.as_object_mut().expect("an object").retain(|k, _| !k.starts_with("index_") && k != "indexer_layers_full");
        }
        d
    }

    fn has_draft(&self, store: &WeightStore) -> bool {
        load::has_mtp(self, store)
    }

    fn load(&self, store: &WeightStore, spec: LoadSpec) -> Result<Box<dyn Model>> {
        match spec.device {
            Device::Cpu => {
                let cpu = |c: ExpertsChoice| -> Result<_> {
                    Ok(match crate::registry::cpu_provider(c)? {
                        None => load::ExpertsFrom::Checkpoint,
                        Some(p) => load::ExpertsFrom::Provider(p),
                    })
                };
                let draft = spec.draft.map(cpu).transpose()?;
                Ok(Box::new(Glm::load(CpuBackend::new(), self.clone(), store, cpu(spec.experts)?, draft)?))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let cuda = |c: ExpertsChoice| -> Result<_> {
                    Ok(match crate::registry::cuda_provider(c)? {
                        None => load::ExpertsFrom::Checkpoint,
                        Some(p) => load::ExpertsFrom::Provider(p),
                    })
                };
                let (experts, draft) = (cuda(spec.experts)?, spec.draft.map(cuda).transpose()?);
                let b = crate::registry::cuda_backend(n)?;
                Ok(Box::new(Glm::load(b, self.clone(), store, experts, draft)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => anyhow::bail!("{}", crate::registry::no_cuda(n)),
        }
    }
}

//! GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention (optional q/k/v biases and
//! per-head q/k RMSNorm, half-split RoPE over the leading `partial_rotary_factor` of each
//! head) and the DeepSeek-V3 `noaux_tc` MoE with a shared expert, after
//! `first_k_dense_replace` dense layers. Reference: transformers
//! `models/glm4_moe/modeling_glm4_moe.py`.
//!
//! The model is the shared [`crate::decoder`]: this folder holds the config and how it
//! fills a [`DecoderSpec`]. The checkpoint's MTP layer is described (inspect, convert,
//! the plan) but not run: speculative decoding is GLM-5's for now.

mod config;

pub use config::Glm4MoeConfig;

use crate::decoder::{DecoderConfig, DecoderSpec, Naming, QkNorm, Routing};
use crate::registry::{Arch, ChatFormat, Family};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;

pub static FAMILY: Family =
    Family { name: "glm4_moe", model_types: &["glm4_moe"], chat: ChatFormat::Glm, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(Glm4MoeConfig::from_json(json)?))
}

impl Glm4MoeConfig {
    pub fn decoder(&self) -> DecoderSpec {
        DecoderSpec {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim(),
            rope: crate::rope::Rope::plain(self.rope_theta),
            rms_norm_eps: self.rms_norm_eps,
            max_position_embeddings: self.max_position_embeddings,
            windows: vec![None; self.num_hidden_layers],
            attention_bias: self.attention_bias,
            o_bias: false,
            sinks: false,
            qk_norm: if self.use_qk_norm { QkNorm::PerHead } else { QkNorm::None },
            naming: Naming::Llama,
            tie_word_embeddings: self.tie_word_embeddings,
            intermediate_size: self.intermediate_size,
            sparse: (0..self.num_hidden_layers).map(|l| self.is_sparse(l)).collect(),
            experts: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            moe_intermediate_size: self.moe_intermediate_size,
            routing: Routing::Noaux {
                n_group: self.n_group,
                topk_group: self.topk_group,
                norm_topk_prob: self.norm_topk_prob,
                scaling: self.routed_scaling_factor,
            },
            router_bias: false,
            expert_act: strata_backend::GateAct::Silu,
            expert_biases: false,
            shared_intermediate_size: self.n_shared_experts * self.moe_intermediate_size,
            mtp_layers: self.num_nextn_predict_layers,
            fp8_block: self.fp8_block,
        }
    }
}

impl DecoderConfig for Glm4MoeConfig {
    const MODEL_TYPE: &'static str = "glm4_moe";

    fn family() -> &'static Family {
        &FAMILY
    }

    fn decoder(&self) -> DecoderSpec {
        Glm4MoeConfig::decoder(self)
    }

    fn special_ids(&self) -> (Vec<u32>, Option<u32>) {
        (self.eos_token_ids.clone(), self.bos_token_id)
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
}

//! Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): grouped-query
//! attention with per-head q/k RMSNorm and RoPE over the whole head, then per layer a
//! routed MoE (softmax over the experts, the top-k, renormalised where
//! `norm_topk_prob`; no shared expert) or, by `mlp_only_layers` / `decoder_sparse_step`,
//! a dense SwiGLU. Reference: transformers `models/qwen3_moe/modeling_qwen3_moe.py`.
//!
//! The model is the shared [`crate::decoder`]; this folder holds the config
//! (`config.rs`) and how it fills a [`crate::decoder::DecoderSpec`].

mod config;

pub use config::Qwen3MoeConfig;

use crate::decoder::DecoderConfig;
use crate::registry::{Arch, ChatFormat, Family};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;

pub static FAMILY: Family =
    Family { name: "qwen3_moe", model_types: &["qwen3_moe"], chat: ChatFormat::Qwen, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(Qwen3MoeConfig::from_json(json)?))
}

impl DecoderConfig for Qwen3MoeConfig {
    const MODEL_TYPE: &'static str = "qwen3_moe";

    fn family() -> &'static Family {
        &FAMILY
    }

    fn decoder(&self) -> crate::decoder::DecoderSpec {
        Qwen3MoeConfig::decoder(self)
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
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "routed_experts": self.num_experts,
            "experts_per_token": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "shared_experts": 0,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "fp8_block": self.fp8_block,
        })
    }
}

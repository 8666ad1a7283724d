//! MiniMax-M2 (`minimax_m2`): grouped-query attention with q/k RMSNorm over the whole
//! projections (not per head) and RoPE over the leading `rotary_dim` dims of each head;
//! every layer a routed MoE scored by sigmoid plus a correction bias (top-k, the chosen
//! scores renormalised; no groups, no shared expert), experts named as Mixtral's
//! (`block_sparse_moe.experts.E.w1/w3/w2`). Reference: transformers
//! `models/minimax_m2/modeling_minimax_m2.py`.
//!
//! The model is the shared [`crate::decoder`]; this folder holds the config
//! (`config.rs`) and how it fills a [`crate::decoder::DecoderSpec`].

mod config;

pub use config::MiniMaxM2Config;

use crate::decoder::{DecoderConfig, DecoderSpec};
use crate::registry::{Arch, ChatFormat, Family};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;

pub static FAMILY: Family =
    Family { name: "minimax_m2", model_types: &["minimax_m2"], chat: ChatFormat::MiniMax, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(MiniMaxM2Config::from_json(json)?))
}

impl DecoderConfig for MiniMaxM2Config {
    const MODEL_TYPE: &'static str = "minimax_m2";

    fn family() -> &'static Family {
        &FAMILY
    }

    fn decoder(&self) -> DecoderSpec {
        MiniMaxM2Config::decoder(self)
    }

    fn special_ids(&self) -> (Vec<u32>, Option<u32>) {
        (self.eos_token_ids.clone(), self.bos_token_id)
    }

    fn describe(&self) -> Value {
        json!({
            "model_type": Self::MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "layers": self.num_hidden_layers,
            "moe_layers": self.num_hidden_layers,
            "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "rope_theta": self.rope_theta,
            "qk_norm": "whole projection",
            "routed_experts": self.num_local_experts,
            "experts_per_token": self.num_experts_per_tok,
            "shared_experts": 0,
            "moe_intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "fp8_block": self.fp8_block,
        })
    }
}

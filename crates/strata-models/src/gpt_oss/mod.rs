//! gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): grouped-query attention with biases
//! on every projection, a learned sink logit per head in the softmax, YaRN RoPE over the
//! whole head, sliding-window and full layers alternating (`layer_types`); every layer a
//! routed MoE whose router has a bias and weighs the top-k by a softmax over their logits,
//! experts with biases and a clamped SwiGLU (`swiglu_limit`, alpha 1.702), gate and up
//! interleaved in the fused tensors. The released checkpoints store the experts as MXFP4
//! (`*_blocks` nibbles, `*_scales` e8m0), which strata holds and streams as they are.
//! Reference: transformers `models/gpt_oss/modeling_gpt_oss.py`.
//!
//! The model is the shared [`crate::decoder`]; this folder holds the config
//! (`config.rs`) and how it fills a [`crate::decoder::DecoderSpec`].

mod config;

pub use config::{GptOssConfig, SWIGLU_ALPHA};

use crate::decoder::{DecoderConfig, DecoderSpec};
use crate::registry::{Arch, ChatFormat, Family};
use anyhow::Result;
use serde_json::{json, Value};
use std::sync::Arc;

pub static FAMILY: Family =
    Family { name: "gpt_oss", model_types: &["gpt_oss"], chat: ChatFormat::Harmony, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(GptOssConfig::from_json(json)?))
}

impl DecoderConfig for GptOssConfig {
    const MODEL_TYPE: &'static str = "gpt_oss";

    fn family() -> &'static Family {
        &FAMILY
    }

    fn decoder(&self) -> DecoderSpec {
        GptOssConfig::decoder(self)
    }

    fn special_ids(&self) -> (Vec<u32>, Option<u32>) {
        (self.eos_token_ids.clone(), self.bos_token_id)
    }

    fn describe(&self) -> Value {
        let sliding = self.sliding.iter().filter(|&&s| s).count();
        json!({
            "model_type": Self::MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "layers": self.num_hidden_layers,
            "moe_layers": self.num_hidden_layers,
            "sliding_layers": sliding,
            "full_attention_layers": self.num_hidden_layers - sliding,
            "sliding_window": self.sliding_window,
            "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attention_sinks": true,
            "attention_bias": self.attention_bias,
            "rope_theta": self.rope.theta,
            "rope_yarn_factor": self.rope.yarn.as_ref().map(|y| y.factor),
            "routed_experts": self.num_local_experts,
            "experts_per_token": self.num_experts_per_tok,
            "shared_experts": 0,
            "moe_intermediate_size": self.intermediate_size,
            "swiglu_limit": self.swiglu_limit,
            "experts_stored_as": if self.mxfp4 { "mxfp4" } else { "checkpoint dtype" },
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        })
    }
}

//! DeepSeek-V3 / R1 (`deepseek_v3`) and Kimi K2 (`kimi_k2`): Multi-head Latent Attention
//! (queries and keys through low-rank latents; the cache keeps one compressed latent and
//! one shared rotary key a position), YaRN RoPE whose magnitude correction scales the
//! softmax, and a MoE of sigmoid-scored routed experts chosen by `noaux_tc` (a bias steers
//! the choice, groups of experts are kept by their two best) beside a shared expert, with
//! the first `first_k_dense_replace` layers dense, and a multi-token-prediction layer.
//! Reference: transformers `models/deepseek_v3/modeling_deepseek_v3.py`.
//!
//! GLM-5 is this network plus DeepSeek Sparse Attention, so the model itself is
//! [`crate::glm_moe_dsa`]'s, run with no indexer: this folder holds what differs, the
//! config's defaults and the chat formats.

use crate::glm_moe_dsa::GlmMoeDsaConfig;
use crate::registry::{Arch, ChatFormat, Family};
use anyhow::Result;
use serde_json::Value;
use std::sync::Arc;

/// DeepSeek-V3, R1, V3.1: DeepSeek's chat format.
pub static FAMILY: Family =
    Family { name: "deepseek_v3", model_types: &["deepseek_v3"], chat: ChatFormat::DeepSeek, parse: parse_arch };

/// Kimi K2: the same network (384 experts in one group), Moonshot's chat format.
pub static KIMI_FAMILY: Family =
    Family { name: "kimi_k2", model_types: &["kimi_k2"], chat: ChatFormat::Kimi, parse: parse_arch };

fn parse_arch(json: &Value) -> Result<Arc<dyn Arch>> {
    Ok(Arc::new(GlmMoeDsaConfig::from_deepseek_json(json)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::glm_moe_dsa::{IndexerKind, MlpKind};
    use serde_json::json;

    /// DeepSeek-V3's own config.json, less the fields that only size the real model.
    fn v3() -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
            "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": true,
            "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-06, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false,
            "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "num_nextn_predict_layers": 1,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128]}
        })
    }

    #[test]
    fn deepseek_v3_and_kimi_k2_configs_parse() {
        let a = crate::registry::parse_config(&v3()).unwrap();
        assert_eq!((a.family().name, a.model_type()), ("deepseek_v3", "deepseek_v3"));
        let c = GlmMoeDsaConfig::from_deepseek_json(&v3()).unwrap();
        assert_eq!(c.indexer_types, vec![IndexerKind::Absent; 61]);
        assert_eq!(c.mlp_layer_types[..4], [MlpKind::Dense, MlpKind::Dense, MlpKind::Dense, MlpKind::Sparse]);
        assert_eq!((c.n_group, c.topk_group, c.fp8_block), (8, 4, Some((128, 128))));
        assert_eq!(c.rope.yarn.as_ref().unwrap().factor, 40.0);
        let mut k2 = v3();
        k2["model_type"] = json!("kimi_k2");
        k2["n_routed_experts"] = json!(384);
        k2["n_group"] = json!(1);
        k2["topk_group"] = json!(1);
        k2["routed_scaling_factor"] = json!(2.827);
        k2["first_k_dense_replace"] = json!(1);
        k2["rope_scaling"]["factor"] = json!(32.0);
        let a = crate::registry::parse_config(&k2).unwrap();
        assert_eq!((a.family().name, a.model_type()), ("kimi_k2", "kimi_k2"));
        assert_eq!(a.moe().unwrap().experts_per_layer, 384);
    }

    #[test]
    fn what_it_cannot_run_is_refused_by_name() {
        let err = |k: &str, v: Value| {
            let mut j = v3();
            j[k] = v;
            format!("{:#}", GlmMoeDsaConfig::from_deepseek_json(&j).unwrap_err())
        };
        assert!(err("q_lora_rank", Value::Null).contains("`q_lora_rank`"));
        assert!(err("rope_interleave", json!(false)).contains("`rope_interleave`"));
        assert!(err("scoring_func", json!("softmax")).contains("`scoring_func`"));
        assert!(err("topk_method", json!("greedy")).contains("`topk_method`"));
        assert!(err(
            "rope_scaling",
            json!({"type": "yarn", "factor": 40, "mscale": 0.5, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096})
        )
        .contains("attention_factor"));
        assert!(err("model_type", json!("glm_moe_dsa")).contains("model_type"));
    }
}

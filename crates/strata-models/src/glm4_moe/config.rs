//! `config.json` of a `glm4_moe` model (GLM-4.5, 4.6, 4.7), validated once at load. Field
//! names and defaults as transformers' `Glm4MoeConfig`; every error names the field.

use crate::fields::{check_eos, check_gqa_heads, check_noaux_routing, check_positive, Fields};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct Glm4MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub first_k_dense_replace: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub attention_bias: bool,
    pub use_qk_norm: bool,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub num_nextn_predict_layers: usize,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

impl Glm4MoeConfig {
    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        f.model_type(&["glm4_moe"])?;
        f.str_is("hidden_act", "silu")?;
        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        if num_attention_heads == 0 {
            bail!("field `num_attention_heads` must be positive");
        }
        let n_routed_experts = match f.get("n_routed_experts") {
            Some(_) => f.experts("n_routed_experts")?,
            None if f.get("num_local_experts").is_some() => f.experts("num_local_experts")?,
            None => bail!("missing field `n_routed_experts`"),
        };
        let (rope_theta, partial_rotary_factor) = f.rope(10000.0, 0.5)?;
        let cfg = Self {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            moe_intermediate_size: f.usize_req("moe_intermediate_size")?,
            num_hidden_layers: f.layers("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", num_attention_heads)?,
            head_dim: f.usize_or("head_dim", hidden_size / num_attention_heads)?,
            n_routed_experts,
            num_experts_per_tok: f.usize_req("num_experts_per_tok")?,
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            first_k_dense_replace: f.usize_or("first_k_dense_replace", 1)?,
            n_group: f.usize_or("n_group", 1)?,
            topk_group: f.usize_or("topk_group", 1)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)? as f32,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-5)?,
            rope_theta,
            partial_rotary_factor,
            attention_bias: f.bool_or("attention_bias", false)?,
            use_qk_norm: f.bool_or("use_qk_norm", false)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 131072)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            num_nextn_predict_layers: f.nextn_layers()?,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            fp8_block: f.fp8_block()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Leading dims of each head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    pub fn is_sparse(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    pub fn sparse_layers(&self) -> usize {
        self.num_hidden_layers.saturating_sub(self.first_k_dense_replace)
    }

    fn validate(&self) -> Result<()> {
        check_positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("n_group", self.n_group),
        ])?;
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)?;
        let rot = self.rotary_dim();
        if rot == 0 || !rot.is_multiple_of(2) || rot > self.head_dim {
            bail!(
                "fields `head_dim` ({}) and `partial_rotary_factor` ({}) give {rot} rotary dims; need an even number in 2..={}",
                self.head_dim,
                self.partial_rotary_factor,
                self.head_dim
            );
        }
        if self.sparse_layers() > 0 {
            check_noaux_routing(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)?;
        }
        check_eos(&self.eos_token_ids, self.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "eos_token_id": [1, 2],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        })
    }

    fn err(patch: Value) -> String {
        let mut j = base();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        format!("{:#}", Glm4MoeConfig::from_json(&j).unwrap_err())
    }

    #[test]
    fn parses_the_hub_fields() {
        let c = Glm4MoeConfig::from_json(&base()).unwrap();
        assert_eq!((c.rotary_dim(), c.sparse_layers(), c.n_routed_experts), (8, 2, 8));
        assert_eq!(c.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"num_key_value_heads": 3})).contains("num_key_value_heads"));
        assert!(err(json!({"n_group": 3})).contains("n_group"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("num_experts_per_tok"));
        assert!(err(json!({"eos_token_id": 600})).contains("eos_token_id"));
        assert!(err(json!({"eos_token_id": 5_000_000_000u64})).contains("eos_token_id"));
        assert!(err(json!({"num_hidden_layers": 1_000_000_000_000_000u64})).contains("num_hidden_layers"));
        assert!(err(json!({"n_routed_experts": 1u64 << 40})).contains("n_routed_experts"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
        assert!(err(json!({"hidden_act": 5})).contains("must be `silu`, got 5"));
        // A group scores by its two best: a group of one expert is refused, as in glm_moe_dsa.
        assert!(err(json!({"n_group": 8, "topk_group": 4})).contains("fewer than 2 experts per group"));
        assert!(err(json!({"model_type": "llama"})).contains("model_type `llama` is not `glm4_moe`"));
        assert!(err(json!({"model_type": "llama"})).contains("glm4_moe"));
        assert!(err(json!({"quantization_config": {"quant_method": "awq"}})).contains("quant_method"));
    }
}

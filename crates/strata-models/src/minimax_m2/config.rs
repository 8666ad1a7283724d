//! `config.json` of a `minimax_m2` model (MiniMax-M2, M2.1), validated once at load.
//! Field names and defaults as transformers' `MiniMaxM2Config`; the Hub's extra fields
//! that would change the model (`rotary_dim`, `use_qk_norm`, `qk_norm_type`,
//! `scoring_func`, `use_routing_bias`, `shared_intermediate_size`, `attn_type_list`) are
//! read and anything transformers does not run is refused by name.

use crate::decoder::{DecoderSpec, Naming, QkNorm, Routing};
use crate::fields::{check_eos, check_gqa_heads, check_positive, Fields};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct MiniMaxM2Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Each routed expert's width (there are no dense layers).
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

impl MiniMaxM2Config {
    pub const MODEL_TYPE: &'static str = "minimax_m2";

    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        f.model_type(&[Self::MODEL_TYPE])?;
        f.str_is("hidden_act", "silu")?;
        f.str_is("scoring_func", "sigmoid")?;
        f.str_is("qk_norm_type", "per_layer")?;
        for (k, want) in [("use_qk_norm", true), ("use_routing_bias", true)] {
            if f.bool_or(k, want)? != want {
                bail!("field `{k}` is {}: only {want} is supported (as transformers runs minimax_m2)", !want);
            }
        }
        if f.usize_or("shared_intermediate_size", 0)? > 0 {
            bail!("field `shared_intermediate_size` is positive: a shared expert is not supported for minimax_m2");
        }
        if let Some(list) = f.get("attn_type_list") {
            let full = list.as_array().is_some_and(|l| l.iter().all(|t| t.as_u64() == Some(1)));
            if !full {
                bail!(
                    "field `attn_type_list` must be all 1 (full attention); linear-attention layers are not supported"
                );
            }
        }
        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        if num_attention_heads == 0 {
            bail!("field `num_attention_heads` must be positive");
        }
        let head_dim = f.usize_or("head_dim", hidden_size / num_attention_heads)?;
        // `partial_rotary_factor` (rope_parameters or top level) as transformers reads it;
        // the Hub's original configs give `rotary_dim` instead.
        let has_factor = f.get("partial_rotary_factor").is_some()
            || f.get("rope_parameters").and_then(|p| p.get("partial_rotary_factor")).is_some_and(|v| !v.is_null());
        let (rope_theta, factor) = f.rope(5_000_000.0, 1.0)?;
        let rotary_dim = match (has_factor, f.get("rotary_dim")) {
            (false, Some(_)) => f.usize_req("rotary_dim")?,
            _ => (head_dim as f64 * factor) as usize,
        };
        let num_local_experts = match (f.get("num_local_experts"), f.get("num_experts")) {
            (Some(_), _) => f.experts("num_local_experts")?,
            (None, Some(_)) => f.experts("num_experts")?,
            (None, None) => 256,
        };
        let cfg = Self {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_hidden_layers: f.layers("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", 8)?,
            head_dim,
            rotary_dim,
            num_local_experts,
            num_experts_per_tok: f.usize_or("num_experts_per_tok", 8)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            max_position_embeddings: f.usize_or("max_position_embeddings", 196608)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            fp8_block: f.fp8_block()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        check_positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ])?;
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)?;
        let rot = self.rotary_dim;
        if rot == 0 || !rot.is_multiple_of(2) || rot > self.head_dim {
            bail!(
                "fields `rotary_dim` / `partial_rotary_factor` give {rot} rotary dims for `head_dim` {}; need an even number in 2..={}",
                self.head_dim,
                self.head_dim
            );
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_local_experts {
            bail!(
                "field `num_experts_per_tok` ({}) must be in 1..={} (`num_local_experts`)",
                self.num_experts_per_tok,
                self.num_local_experts
            );
        }
        check_eos(&self.eos_token_ids, self.vocab_size)
    }

    pub fn decoder(&self) -> DecoderSpec {
        DecoderSpec {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            rope: crate::rope::Rope::plain(self.rope_theta),
            rms_norm_eps: self.rms_norm_eps,
            max_position_embeddings: self.max_position_embeddings,
            windows: vec![None; self.num_hidden_layers],
            attention_bias: false,
            o_bias: false,
            sinks: false,
            qk_norm: QkNorm::Full,
            naming: Naming::Mixtral,
            tie_word_embeddings: self.tie_word_embeddings,
            intermediate_size: self.intermediate_size,
            sparse: vec![true; self.num_hidden_layers],
            experts: self.num_local_experts,
            top_k: self.num_experts_per_tok,
            moe_intermediate_size: self.intermediate_size,
            // Sigmoid scores plus the correction bias choose; the chosen scores,
            // renormalised, weigh: noaux_tc with one group and no scaling.
            routing: Routing::Noaux { n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 1.0 },
            router_bias: false,
            expert_act: strata_backend::GateAct::Silu,
            expert_biases: false,
            shared_intermediate_size: 0,
            mtp_layers: 0,
            fp8_block: self.fp8_block,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "minimax_m2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, "eos_token_id": [1],
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}
        })
    }

    fn with(patch: Value) -> Result<MiniMaxM2Config> {
        let mut j = base();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        MiniMaxM2Config::from_json(&j)
    }

    fn err(patch: Value) -> String {
        format!("{:#}", with(patch).unwrap_err())
    }

    #[test]
    fn parses_the_hub_fields() {
        let c = with(json!({})).unwrap();
        assert_eq!((c.rotary_dim, c.num_local_experts, c.rope_theta), (8, 8, 5e6));
        let d = c.decoder();
        assert_eq!((d.qk_norm, d.naming, d.sparse_layers()), (QkNorm::Full, Naming::Mixtral, 2));
        // The Hub's original form: `rotary_dim` beside no factor.
        let c = with(json!({"rope_parameters": null, "rope_theta": 10000.0, "rotary_dim": 4})).unwrap();
        assert_eq!(c.rotary_dim, 4);
        let c = with(json!({"num_local_experts": null, "num_experts": 16})).unwrap();
        assert_eq!(c.num_local_experts, 16);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"num_key_value_heads": 3})).contains("num_key_value_heads"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("num_experts_per_tok"));
        assert!(err(json!({"scoring_func": "softmax"})).contains("scoring_func"));
        assert!(err(json!({"use_qk_norm": false})).contains("use_qk_norm"));
        assert!(err(json!({"use_routing_bias": false})).contains("use_routing_bias"));
        assert!(err(json!({"qk_norm_type": "per_head"})).contains("qk_norm_type"));
        assert!(err(json!({"shared_intermediate_size": 64})).contains("shared_intermediate_size"));
        assert!(err(json!({"attn_type_list": [0, 1]})).contains("attn_type_list"));
        assert!(
            err(json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.01}})).contains("rotary")
        );
        assert!(err(json!({"eos_token_id": 600})).contains("eos_token_id"));
        assert!(err(json!({"model_type": "minimax"})).contains("minimax_m2"));
        assert!(err(json!({"quantization_config": {"quant_method": "awq"}})).contains("quant_method"));
    }
}

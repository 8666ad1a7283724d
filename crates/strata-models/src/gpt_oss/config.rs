//! `config.json` of a `gpt_oss` model (gpt-oss-20b, gpt-oss-120b), validated once at load.
//! Field names and defaults as transformers' `GptOssConfig`; every error names the field.

use crate::decoder::{DecoderSpec, Naming, QkNorm, Routing};
use crate::fields::{check_eos, check_gqa_heads, check_positive, Fields};
use crate::rope::Rope;
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};
use strata_backend::GateAct;
use strata_kernels::MXFP4_GROUP;

/// The clamped SwiGLU's `alpha`: fixed in transformers' `GptOssExperts` (no config field).
pub const SWIGLU_ALPHA: f32 = 1.702;

#[derive(Clone, Debug)]
pub struct GptOssConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Each expert's width.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub sliding_window: usize,
    /// Per layer: whether it attends through the sliding window.
    pub sliding: Vec<bool>,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    /// Biases on every attention projection (q, k, v and o).
    pub attention_bias: bool,
    pub swiglu_limit: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// `quantization_config.quant_method == "mxfp4"`: the experts ship as MXFP4 blocks.
    pub mxfp4: bool,
}

impl GptOssConfig {
    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        f.model_type(&["gpt_oss"])?;
        f.str_is("hidden_act", "silu")?;
        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        let num_hidden_layers = f.layers("num_hidden_layers")?;
        let num_local_experts = match (f.get("num_local_experts"), f.get("num_experts")) {
            (Some(_), _) => f.experts("num_local_experts")?,
            (None, Some(_)) => f.experts("num_experts")?,
            (None, None) => 128,
        };
        let num_experts_per_tok = f.usize_or("num_experts_per_tok", 4)?;
        // OpenAI's configs repeat the top-k as `experts_per_token`; transformers reads
        // `num_experts_per_tok`, so the two must agree.
        if let Some(v) = f.get("experts_per_token") {
            if v.as_u64() != Some(num_experts_per_tok as u64) {
                bail!("field `experts_per_token` ({v}) disagrees with `num_experts_per_tok` ({num_experts_per_tok})");
            }
        }
        let sliding = match f.layer_types("gpt_oss", num_hidden_layers, &["sliding_attention", "full_attention"])? {
            Some(kinds) => kinds.iter().map(|&k| k == 0).collect(),
            None => (0..num_hidden_layers).map(|i| i % 2 == 0).collect(),
        };
        // transformers' default when the config names no rotary embedding: YaRN as the
        // released checkpoints use it.
        let rope = match f.get("rope_parameters").or_else(|| f.get("rope_scaling")) {
            Some(_) => f.rope_kind(150000.0)?,
            None => {
                let mut with = obj.clone();
                with.insert(
                    "rope_parameters".into(),
                    json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": false, "original_max_position_embeddings": 4096,
                           "rope_theta": f.f64_or("rope_theta", 150000.0)?}),
                );
                Fields(&with).rope_kind(150000.0)?
            }
        };
        let mxfp4 = match f.get("quantization_config") {
            None => false,
            Some(q) => match q.get("quant_method").and_then(Value::as_str) {
                Some("mxfp4") => true,
                other => bail!(
                    "field `quantization_config.quant_method` is `{}`; gpt_oss checkpoints are bf16 or `mxfp4`",
                    other.unwrap_or("")
                ),
            },
        };
        let swiglu_limit = f.f64_or("swiglu_limit", 7.0)?;
        if !(swiglu_limit > 0.0 && swiglu_limit.is_finite()) {
            bail!("field `swiglu_limit` must be a positive number, got {swiglu_limit}");
        }
        let cfg = Self {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", num_attention_heads)?,
            head_dim: f.usize_or("head_dim", 64)?,
            num_local_experts,
            num_experts_per_tok,
            sliding_window: f.usize_or("sliding_window", 128)?,
            sliding,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-5)?,
            rope,
            attention_bias: f.bool_or("attention_bias", true)?,
            swiglu_limit: swiglu_limit as f32,
            max_position_embeddings: f.usize_or("max_position_embeddings", 131072)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            mxfp4,
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
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_local_experts", self.num_local_experts),
        ])?;
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)?;
        if !self.head_dim.is_multiple_of(2) {
            bail!("field `head_dim` ({}) must be even (RoPE rotates pairs)", self.head_dim);
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_local_experts {
            bail!(
                "field `num_experts_per_tok` ({}) must be in 1..={} (`num_local_experts`)",
                self.num_experts_per_tok,
                self.num_local_experts
            );
        }
        if self.sliding.iter().any(|&s| s) && self.sliding_window == 0 {
            bail!("field `sliding_window` must be positive where `layer_types` has sliding layers");
        }
        if self.mxfp4 {
            for (k, v) in [("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)] {
                if !v.is_multiple_of(MXFP4_GROUP) {
                    bail!("field `{k}` ({v}) must be a multiple of {MXFP4_GROUP} for MXFP4 experts");
                }
            }
        }
        check_eos(&self.eos_token_ids, self.vocab_size)
    }

    pub fn decoder(&self) -> DecoderSpec {
        let n = self.num_hidden_layers;
        DecoderSpec {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: n,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rotary_dim: self.head_dim,
            rope: self.rope.clone(),
            rms_norm_eps: self.rms_norm_eps,
            max_position_embeddings: self.max_position_embeddings,
            windows: self.sliding.iter().map(|&s| s.then_some(self.sliding_window)).collect(),
            attention_bias: self.attention_bias,
            o_bias: self.attention_bias,
            sinks: true,
            qk_norm: QkNorm::None,
            naming: Naming::GptOss,
            tie_word_embeddings: self.tie_word_embeddings,
            intermediate_size: 0,
            sparse: vec![true; n],
            experts: self.num_local_experts,
            top_k: self.num_experts_per_tok,
            moe_intermediate_size: self.intermediate_size,
            // A softmax over the top-k logits is the full softmax renormalised over them.
            routing: Routing::Softmax { renormalize: true },
            router_bias: true,
            expert_act: GateAct::SwigluClamped { alpha: SWIGLU_ALPHA, limit: self.swiglu_limit },
            expert_biases: true,
            shared_intermediate_size: 0,
            mtp_layers: 0,
            fp8_block: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        json!({
            "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8, "eos_token_id": [1, 2],
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
        })
    }

    fn with(patch: Value) -> Result<GptOssConfig> {
        let mut j = base();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        GptOssConfig::from_json(&j)
    }

    fn err(patch: Value) -> String {
        format!("{:#}", with(patch).unwrap_err())
    }

    #[test]
    fn defaults_as_transformers() {
        let c = with(json!({})).unwrap();
        assert_eq!(c.sliding, [true, false, true, false], "sliding on even layers");
        let y = c.rope.yarn.as_ref().expect("YaRN by default");
        assert_eq!(
            (c.rope.theta, y.factor, y.truncate, y.original_max_position_embeddings),
            (150000.0, 32.0, false, 4096.0)
        );
        assert!(c.mxfp4 && c.attention_bias && c.swiglu_limit == 7.0);
        let d = c.decoder();
        assert_eq!(d.windows, [Some(8), None, Some(8), None]);
        assert!(d.o_bias && d.sinks && d.router_bias && d.expert_biases);
        // YaRN's attention factor, squared, in the softmax scale.
        let af = 0.1 * 32f64.ln() + 1.0;
        assert!((d.gqa_dims(0).scale as f64 - 0.25 * af * af).abs() < 1e-6);
        let plain = with(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})).unwrap();
        assert_eq!(plain.rope, Rope::plain(1e4));
        let types =
            with(json!({"layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]}));
        assert_eq!(types.unwrap().sliding, [false, false, true, false]);
    }

    /// gpt-oss-120b's `config.json` as released (legacy `rope_scaling`, OpenAI's
    /// `experts_per_token`, `initial_context_length`).
    #[test]
    fn the_released_config_parses() {
        let types: Vec<&str> =
            (0..36).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
        let j = json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "layer_types": types, "max_position_embeddings": 131072,
            "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
            "output_router_logits": false, "pad_token_id": 199999,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
            "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true,
            "vocab_size": 201088
        });
        let c = GptOssConfig::from_json(&j).unwrap();
        assert_eq!((c.num_local_experts, c.num_experts_per_tok, c.head_dim, c.sliding_window), (128, 4, 64, 128));
        assert_eq!((c.sliding.iter().filter(|&&s| s).count(), c.eos_token_ids.clone()), (18, vec![200002]));
        let y = c.rope.yarn.as_ref().unwrap();
        assert_eq!((c.rope.theta, y.factor, y.truncate), (150000.0, 32.0, false));
        let moe = c.decoder().moe_layout().unwrap();
        assert_eq!((moe.layers.len(), moe.hidden, moe.inter), (36, 2880, 2880));
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"num_key_value_heads": 3})).contains("num_key_value_heads"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("num_experts_per_tok"));
        assert!(err(json!({"experts_per_token": 3})).contains("experts_per_token"));
        assert!(err(json!({"layer_types": ["full_attention"]})).contains("layer_types"));
        assert!(err(json!({"layer_types": ["a", "b", "c", "d"]})).contains("layer_types"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
        assert!(err(json!({"quantization_config": {"quant_method": "fp8"}})).contains("quant_method"));
        assert!(err(json!({"hidden_size": 48})).contains("hidden_size"));
        assert!(err(json!({"swiglu_limit": -1.0})).contains("swiglu_limit"));
        assert!(err(json!({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})).contains("rope_type"));
        assert!(err(json!({"model_type": "gpt2"})).contains("gpt_oss"));
        assert!(err(json!({"eos_token_id": 600})).contains("eos_token_id"));
    }
}

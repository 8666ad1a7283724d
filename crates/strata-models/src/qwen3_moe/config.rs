//! `config.json` of a `qwen3_moe` model (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder),
//! validated once at load. Field names and defaults as transformers' `Qwen3MoeConfig`;
//! every error names the field.

use crate::decoder::{DecoderSpec, Naming, QkNorm, Routing};
use crate::fields::{check_eos, check_gqa_heads, check_positive, Fields};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct Qwen3MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `sliding_window` where `use_sliding_window` is on (every layer then slides).
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

impl Qwen3MoeConfig {
    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        f.model_type(&["qwen3_moe"])?;
        f.str_is("hidden_act", "silu")?;
        // transformers gives `o_proj` a bias too where this is on; no Qwen3-MoE checkpoint has it.
        if f.bool_or("attention_bias", false)? {
            bail!("field `attention_bias` is true: projection biases are not supported for qwen3_moe");
        }
        let hidden_size = f.usize_req("hidden_size")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        if num_attention_heads == 0 {
            bail!("field `num_attention_heads` must be positive");
        }
        // `num_experts` is the Hub's name; transformers also maps `num_local_experts` to it.
        let num_experts = match (f.get("num_experts"), f.get("num_local_experts")) {
            (Some(_), _) => f.experts("num_experts")?,
            (None, Some(_)) => f.experts("num_local_experts")?,
            (None, None) => 128,
        };
        let num_hidden_layers = f.layers("num_hidden_layers")?;
        let mlp_only_layers = f.layer_indices("mlp_only_layers", num_hidden_layers)?;
        let sliding_window = match f.bool_or("use_sliding_window", false)? {
            true => Some(f.usize_or("sliding_window", 4096)?).filter(|&w| w > 0),
            false => None,
        };
        let cfg = Self {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize_req("intermediate_size")?,
            moe_intermediate_size: f.usize_req("moe_intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", 4)?,
            head_dim: f.usize_or("head_dim", hidden_size / num_attention_heads)?,
            num_experts,
            num_experts_per_tok: f.usize_or("num_experts_per_tok", 8)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
            decoder_sparse_step: f.usize_or("decoder_sparse_step", 1)?,
            mlp_only_layers,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta: f.rope_theta(10000.0)?,
            sliding_window,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32768)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            fp8_block: f.fp8_block()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether `layer`'s MLP is the routed MoE ([`crate::fields::qwen_sparse`]).
    pub fn is_sparse(&self, layer: usize) -> bool {
        crate::fields::qwen_sparse(layer, &self.mlp_only_layers, self.num_experts, self.decoder_sparse_step)
    }

    pub fn sparse_layers(&self) -> usize {
        (0..self.num_hidden_layers).filter(|&l| self.is_sparse(l)).count()
    }

    fn validate(&self) -> Result<()> {
        check_positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ])?;
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)?;
        if !self.head_dim.is_multiple_of(2) {
            bail!("field `head_dim` ({}) must be even (RoPE rotates pairs)", self.head_dim);
        }
        if self.sparse_layers() > 0 {
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                bail!(
                    "field `num_experts_per_tok` ({}) must be in 1..={} (`num_experts`)",
                    self.num_experts_per_tok,
                    self.num_experts
                );
            }
            if self.moe_intermediate_size == 0 {
                bail!("field `moe_intermediate_size` must be positive");
            }
        }
        if self.sparse_layers() < self.num_hidden_layers && self.intermediate_size == 0 {
            bail!("field `intermediate_size` must be positive (the dense layers' width)");
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
            rotary_dim: self.head_dim,
            rope: crate::rope::Rope::plain(self.rope_theta),
            rms_norm_eps: self.rms_norm_eps,
            max_position_embeddings: self.max_position_embeddings,
            windows: vec![self.sliding_window; self.num_hidden_layers],
            attention_bias: false,
            o_bias: false,
            sinks: false,
            qk_norm: QkNorm::PerHead,
            naming: Naming::Llama,
            tie_word_embeddings: self.tie_word_embeddings,
            intermediate_size: self.intermediate_size,
            sparse: (0..self.num_hidden_layers).map(|l| self.is_sparse(l)).collect(),
            experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            moe_intermediate_size: self.moe_intermediate_size,
            routing: Routing::Softmax { renormalize: self.norm_topk_prob },
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
            "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": true, "eos_token_id": [1, 2], "rope_theta": 1000000.0
        })
    }

    fn with(patch: Value) -> Result<Qwen3MoeConfig> {
        let mut j = base();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        Qwen3MoeConfig::from_json(&j)
    }

    fn err(patch: Value) -> String {
        format!("{:#}", with(patch).unwrap_err())
    }

    #[test]
    fn parses_the_hub_fields() {
        let c = with(json!({})).unwrap();
        assert_eq!((c.sparse_layers(), c.num_experts, c.rope_theta), (4, 8, 1e6));
        let d = c.decoder();
        assert_eq!((d.rotary_dim, d.windows[0], d.qk_norm, d.has_shared_expert()), (16, None, QkNorm::PerHead, false));
        assert_eq!(d.routing, Routing::Softmax { renormalize: true });
        // Defaults as transformers': no renormalisation, every layer sparse.
        let mut j = base();
        j.as_object_mut().unwrap().remove("norm_topk_prob");
        assert!(!Qwen3MoeConfig::from_json(&j).unwrap().norm_topk_prob);
    }

    #[test]
    fn dense_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let c = with(json!({"mlp_only_layers": [0], "decoder_sparse_step": 2})).unwrap();
        assert_eq!((0..4).map(|l| c.is_sparse(l)).collect::<Vec<_>>(), [false, true, false, true]);
        let c = with(json!({"num_experts": 0})).unwrap();
        assert_eq!(c.sparse_layers(), 0);
        assert!(c.decoder().moe_layout().is_none());
        let c = with(json!({"num_local_experts": 16, "num_experts": null})).unwrap();
        assert_eq!(c.num_experts, 16);
    }

    #[test]
    fn sliding_window_only_where_turned_on() {
        assert_eq!(with(json!({"sliding_window": 64})).unwrap().sliding_window, None);
        assert_eq!(with(json!({"sliding_window": 64, "use_sliding_window": true})).unwrap().sliding_window, Some(64));
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"num_key_value_heads": 3})).contains("num_key_value_heads"));
        assert!(err(json!({"num_experts_per_tok": 9})).contains("num_experts_per_tok"));
        assert!(err(json!({"decoder_sparse_step": 0})).contains("decoder_sparse_step"));
        assert!(err(json!({"mlp_only_layers": [7]})).contains("mlp_only_layers"));
        assert!(err(json!({"mlp_only_layers": "0"})).contains("mlp_only_layers"));
        assert!(err(json!({"attention_bias": true})).contains("attention_bias"));
        assert!(err(json!({"eos_token_id": 600})).contains("eos_token_id"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
        assert!(err(json!({"head_dim": 15})).contains("head_dim"));
        assert!(err(json!({"model_type": "qwen2_moe"})).contains("qwen3_moe"));
        assert!(err(json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})).contains("rope_type"));
        assert!(err(json!({"quantization_config": {"quant_method": "awq"}})).contains("quant_method"));
        assert!(err(json!({"num_experts": 1u64 << 40})).contains("num_experts"));
    }
}

//! `config.json` of a `qwen3_next` model (Qwen3-Next-80B-A3B), validated once at load.
//! Field names and defaults as transformers' `Qwen3NextConfig`; every error names the field.

use crate::fields::{check_eos, check_gqa_heads, check_positive, Fields};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use strata_kernels::deltanet::DeltaNetDims;

#[derive(Clone, Debug)]
pub struct Qwen3NextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense layers' MLP width.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head RoPE rotates (`partial_rotary_factor * head_dim`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// Per layer: linear attention (gated DeltaNet) where true, else gated full attention.
    pub linear: Vec<bool>,
    pub delta: DeltaNetDims,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl Qwen3NextConfig {
    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        f.model_type(&["qwen3_next"])?;
        f.str_is("hidden_act", "silu")?;
        if f.bool_or("attention_bias", false)? {
            bail!("field `attention_bias` is true: projection biases are not supported for qwen3_next");
        }
        if f.bool_or("use_sliding_window", false)? {
            bail!("field `use_sliding_window` is true: qwen3_next attends over the whole context");
        }
        if f.get("quantization_config").is_some() {
            bail!("field `quantization_config`: quantized qwen3_next checkpoints are not supported (bf16 or f32)");
        }
        let num_hidden_layers = f.layers("num_hidden_layers")?;
        let linear = match f.layer_types("qwen3_next", num_hidden_layers, &["linear_attention", "full_attention"])? {
            Some(kinds) => kinds.iter().map(|&k| k == 0).collect(),
            None => {
                let every = f.usize_or("full_attention_interval", 4)?;
                if every == 0 {
                    bail!("field `full_attention_interval` must be positive");
                }
                (0..num_hidden_layers).map(|i| !(i + 1).is_multiple_of(every)).collect()
            }
        };
        let mlp_only_layers = f.layer_indices("mlp_only_layers", num_hidden_layers)?;
        let head_dim = f.usize_or("head_dim", 256)?;
        let (rope_theta, partial) = f.rope(10000.0, 0.25)?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let cfg = Self {
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size: f.usize_req("hidden_size")?,
            intermediate_size: f.usize_or("intermediate_size", 5632)?,
            num_hidden_layers,
            num_attention_heads: f.usize_or("num_attention_heads", 16)?,
            num_key_value_heads: f.usize_or("num_key_value_heads", 2)?,
            head_dim,
            rotary_dim,
            rope_theta,
            linear,
            delta: DeltaNetDims {
                k_heads: f.usize_or("linear_num_key_heads", 16)?,
                v_heads: f.usize_or("linear_num_value_heads", 32)?,
                k_dim: f.usize_or("linear_key_head_dim", 128)?,
                v_dim: f.usize_or("linear_value_head_dim", 128)?,
                kernel: f.usize_or("linear_conv_kernel_dim", 4)?,
            },
            num_experts: match f.get("num_experts") {
                Some(_) => f.experts("num_experts")?,
                None => 512,
            },
            num_experts_per_tok: f.usize_or("num_experts_per_tok", 10)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            moe_intermediate_size: f.usize_or("moe_intermediate_size", 512)?,
            shared_expert_intermediate_size: f.usize_or("shared_expert_intermediate_size", 512)?,
            decoder_sparse_step: f.usize_or("decoder_sparse_step", 1)?,
            mlp_only_layers,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32768)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
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
        let d = &self.delta;
        check_positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("linear_num_key_heads", d.k_heads),
            ("linear_num_value_heads", d.v_heads),
            ("linear_key_head_dim", d.k_dim),
            ("linear_value_head_dim", d.v_dim),
            ("linear_conv_kernel_dim", d.kernel),
        ])?;
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)?;
        if !d.v_heads.is_multiple_of(d.k_heads) {
            bail!(
                "field `linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
                d.v_heads,
                d.k_heads
            );
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            bail!(
                "field `partial_rotary_factor` gives {} rotated dims of a {}-dim head: must be even, positive and at most the head",
                self.rotary_dim,
                self.head_dim
            );
        }
        if self.sparse_layers() > 0 {
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
                bail!(
                    "field `num_experts_per_tok` ({}) must be in 1..={} (`num_experts`)",
                    self.num_experts_per_tok,
                    self.num_experts
                );
            }
            check_positive(&[
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("shared_expert_intermediate_size", self.shared_expert_intermediate_size),
            ])?;
        }
        if self.sparse_layers() < self.num_hidden_layers && self.intermediate_size == 0 {
            bail!("field `intermediate_size` must be positive (the dense layers' width)");
        }
        check_eos(&self.eos_token_ids, self.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen3-Next-80B-A3B-Instruct's `config.json` as released.
    fn released() -> Value {
        json!({
            "architectures": ["Qwen3NextForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
            "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
            "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
            "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
            "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16, "num_experts": 512,
            "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
            "output_router_logits": false, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_scaling": null, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.57.0.dev0", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936
        })
    }

    fn err(patch: Value) -> String {
        let mut j = released();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        format!("{:#}", Qwen3NextConfig::from_json(&j).unwrap_err())
    }

    #[test]
    fn the_released_config_parses() {
        let c = Qwen3NextConfig::from_json(&released()).unwrap();
        assert_eq!((c.rotary_dim, c.rope_theta, c.sparse_layers()), (64, 1e7, 48));
        assert_eq!(c.linear.iter().filter(|&&l| !l).count(), 12, "every fourth layer attends fully");
        assert!(c.linear[0] && !c.linear[3]);
        assert_eq!((c.delta.qkvz_width(), c.delta.conv_dim()), (2 * 2048 + 2 * 4096, 2 * 2048 + 4096));
        assert_eq!(c.delta.state_len(), 32 * 128 * 128);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"linear_num_value_heads": 24})).contains("linear_num_value_heads"));
        assert!(err(json!({"layer_types": ["full_attention"]})).contains("layer_types"));
        assert!(err(json!({"use_sliding_window": true})).contains("use_sliding_window"));
        assert!(err(json!({"attention_bias": true})).contains("attention_bias"));
        assert!(err(json!({"num_experts_per_tok": 600})).contains("num_experts_per_tok"));
        assert!(err(json!({"partial_rotary_factor": 0.0})).contains("partial_rotary_factor"));
        assert!(err(json!({"full_attention_interval": 0})).contains("full_attention_interval"));
        assert!(err(json!({"linear_conv_kernel_dim": 0})).contains("linear_conv_kernel_dim"));
        assert!(err(json!({"quantization_config": {"quant_method": "fp8"}})).contains("quantization_config"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
        assert!(err(json!({"model_type": "qwen3_moe"})).contains("qwen3_next"));
    }
}

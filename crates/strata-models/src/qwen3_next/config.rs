//! `config.json` of a `qwen3_next` model (Qwen3-Next-80B-A3B) or a Qwen3.5-MoE one
//! (`qwen3_5_moe`, its text fields under `text_config`; `qwen3_5_moe_text`), validated once
//! at load. Field names and defaults as transformers' `Qwen3NextConfig` and
//! `Qwen3_5MoeTextConfig`; every error names the field.

use crate::fields::{check_eos, check_gqa_heads, check_positive, Fields};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use strata_kernels::deltanet::DeltaNetDims;

/// Which of the two networks: they differ only where this says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// Qwen3-Next: the DeltaNet's input projections fused and grouped by key head
    /// (`in_proj_qkvz`, `in_proj_ba`); dense layers by `mlp_only_layers` /
    /// `decoder_sparse_step`; renormalisation by `norm_topk_prob`.
    Next,
    /// Qwen3.5-MoE: the projections apart and in order (`in_proj_qkv`, `in_proj_z`,
    /// `in_proj_b`, `in_proj_a`), every layer routed and renormalised; `wrapped`: the
    /// vision-language checkpoint (`Qwen3_5MoeForConditionalGeneration`), text weights under
    /// `model.language_model.` beside a vision tower (`model.visual.`) that strata does not
    /// run.
    Qwen35 { wrapped: bool },
}

#[derive(Clone, Debug)]
pub struct Qwen3NextConfig {
    pub variant: Variant,
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
        let top = Fields(obj);
        let mt = top.model_type(&["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])?;
        match mt.as_str() {
            "qwen3_5_moe" => {
                let text = match top.get("text_config") {
                    Some(Value::Object(t)) => t,
                    Some(v) => bail!("field `text_config` must be an object, got {v}"),
                    None => bail!("missing field `text_config`"),
                };
                let f = Fields(text);
                if let Some(t) = f.get("model_type").and_then(Value::as_str) {
                    if t != "qwen3_5_moe_text" {
                        bail!("field `text_config.model_type` is `{t}`, expected `qwen3_5_moe_text`");
                    }
                }
                Self::from_fields(&f, Some(&top), Variant::Qwen35 { wrapped: true }).context("text_config")
            }
            "qwen3_5_moe_text" => Self::from_fields(&top, None, Variant::Qwen35 { wrapped: false }),
            _ => Self::from_fields(&top, None, Variant::Next),
        }
    }

    /// The text model's fields `f`; `outer`: the wrapper's, for the fields a
    /// vision-language config keeps at its top level (`tie_word_embeddings`,
    /// `quantization_config`).
    fn from_fields(f: &Fields, outer: Option<&Fields>, variant: Variant) -> Result<Self> {
        // Where field `k` is read: the text fields, else the wrapper's.
        let home = |k: &str| match (f.get(k), outer) {
            (None, Some(o)) => o,
            _ => f,
        };
        f.str_is("hidden_act", "silu")?;
        if f.bool_or("attention_bias", false)? {
            bail!("field `attention_bias` is true: projection biases are not supported for qwen3_next");
        }
        if f.bool_or("use_sliding_window", false)? {
            bail!("field `use_sliding_window` is true: qwen3_next attends over the whole context");
        }
        if home("quantization_config").get("quantization_config").is_some() {
            bail!("field `quantization_config`: quantized qwen3_next checkpoints are not supported (bf16 or f32)");
        }
        let qwen35 = matches!(variant, Variant::Qwen35 { .. });
        if qwen35 {
            // transformers' Qwen3.5-MoE has none of these (every layer routed, top-k always
            // renormalised): a config that says otherwise is refused rather than ignored.
            if f.get("mlp_only_layers").is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
                bail!(
                    "field `mlp_only_layers`: Qwen3.5-MoE routes every layer (transformers has no dense layers here)"
                );
            }
            if f.usize_or("decoder_sparse_step", 1)? != 1 {
                bail!("field `decoder_sparse_step`: Qwen3.5-MoE routes every layer");
            }
            if !f.bool_or("norm_topk_prob", true)? {
                bail!("field `norm_topk_prob` is false: Qwen3.5-MoE always renormalises its top-k weights");
            }
        }
        let tie_word_embeddings = home("tie_word_embeddings").bool_or("tie_word_embeddings", false)?;
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
        let mlp_only_layers = match qwen35 {
            true => Vec::new(),
            false => f.layer_indices("mlp_only_layers", num_hidden_layers)?,
        };
        let head_dim = f.usize_or("head_dim", 256)?;
        let (rope_theta, partial) = f.rope(10000.0, 0.25)?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        let cfg = Self {
            variant,
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
                None if qwen35 => 256,
                None => 512,
            },
            num_experts_per_tok: f.usize_or("num_experts_per_tok", if qwen35 { 8 } else { 10 })?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            moe_intermediate_size: f.usize_or("moe_intermediate_size", 512)?,
            shared_expert_intermediate_size: f.usize_or("shared_expert_intermediate_size", 512)?,
            decoder_sparse_step: f.usize_or("decoder_sparse_step", 1)?,
            mlp_only_layers,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32768)?,
            tie_word_embeddings,
            eos_token_ids: home("eos_token_id").eos_ids()?,
            bos_token_id: home("bos_token_id").token_ids("bos_token_id")?.first().copied(),
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

    /// A Qwen3.5-MoE vision-language config shaped as Qwen3.5-35B-A3B's: text fields under
    /// `text_config`, the multimodal rotary sections, a vision tower's config beside.
    fn qwen35() -> Value {
        let types: Vec<&str> =
            (0..40).map(|i| if i % 4 == 3 { "full_attention" } else { "linear_attention" }).collect();
        json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": false,
            "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe"},
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "layer_types": types,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-06,
                "hidden_act": "silu", "eos_token_id": 248044,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": true}
            }
        })
    }

    #[test]
    fn qwen35_configs_parse_as_the_same_network() {
        let c = Qwen3NextConfig::from_json(&qwen35()).unwrap();
        assert_eq!(c.variant, Variant::Qwen35 { wrapped: true });
        assert_eq!((c.rotary_dim, c.sparse_layers(), c.num_experts_per_tok), (64, 40, 8));
        assert!(c.norm_topk_prob && c.linear[0] && !c.linear[3]);
        assert_eq!(c.eos_token_ids, vec![248044]);
        let text = qwen35()["text_config"].clone();
        let c = Qwen3NextConfig::from_json(&text).unwrap();
        assert_eq!(c.variant, Variant::Qwen35 { wrapped: false });
        let patch = |k: &str, v: Value| {
            let mut j = qwen35();
            j["text_config"][k] = v;
            format!("{:#}", Qwen3NextConfig::from_json(&j).unwrap_err())
        };
        assert!(patch("norm_topk_prob", json!(false)).contains("norm_topk_prob"));
        assert!(patch("mlp_only_layers", json!([0])).contains("mlp_only_layers"));
        assert!(patch("model_type", json!("qwen3_next")).contains("text_config.model_type"));
        let mut j = qwen35();
        j["quantization_config"] = json!({"quant_method": "fp8"});
        assert!(format!("{:#}", Qwen3NextConfig::from_json(&j).unwrap_err()).contains("quantization_config"));
    }
}

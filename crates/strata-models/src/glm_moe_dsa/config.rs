//! `config.json` of an MLA MoE model, validated once at load: `glm_moe_dsa` (GLM-5, 5.1,
//! 5.2) and `deepseek_v3` / `kimi_k2` (the same network without the DSA indexer, with YaRN).
//!
//! Fields that fix tensor shapes are required; the rest take transformers' defaults (which
//! differ between the two). Every error names the field.

use crate::fields::{check_noaux_routing, Fields};
use crate::rope::Rope;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    Dense,
    Sparse,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexerKind {
    /// The layer runs its own lightning indexer.
    Full,
    /// The layer reuses the top-k selection of the previous full layer.
    Shared,
    /// No DeepSeek Sparse Attention at all (DeepSeek-V3, Kimi K2): dense MLA.
    Absent,
}

/// Which of the models sharing this network a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// GLM-5.x: MLA with the DSA indexer, plain RoPE.
    Glm5,
    /// DeepSeek-V3 / R1 and Kimi K2: dense MLA, YaRN RoPE.
    DeepseekV3,
}

#[derive(Clone, Debug)]
pub struct GlmMoeDsaConfig {
    pub variant: Variant,
    /// The checkpoint's own `model_type`.
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub n_shared_experts: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub index_topk: usize,
    pub index_head_dim: usize,
    pub index_n_heads: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub num_nextn_predict_layers: usize,
    pub mlp_layer_types: Vec<MlpKind>,
    pub indexer_types: Vec<IndexerKind>,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

impl GlmMoeDsaConfig {
    pub const MODEL_TYPE: &'static str = "glm_moe_dsa";
    pub const DEEPSEEK_MODEL_TYPES: &'static [&'static str] = &["deepseek_v3", "kimi_k2"];

    /// Parses and validates a GLM-5 config; errors name the offending field (the caller
    /// adds the file).
    pub fn from_json(json: &Value) -> Result<Self> {
        Self::parse(json, Variant::Glm5)
    }

    /// Parses and validates a DeepSeek-V3 or Kimi K2 config.
    pub fn from_deepseek_json(json: &Value) -> Result<Self> {
        Self::parse(json, Variant::DeepseekV3)
    }

    fn parse(json: &Value, variant: Variant) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        let deepseek = variant == Variant::DeepseekV3;
        let model_type =
            f.model_type(if deepseek { Self::DEEPSEEK_MODEL_TYPES } else { &[Self::MODEL_TYPE] })?.to_string();
        let num_hidden_layers = f.layers("num_hidden_layers")?;
        let num_attention_heads = f.usize_req("num_attention_heads")?;
        let n_routed_experts = match f.get("n_routed_experts") {
            Some(_) => f.experts("n_routed_experts")?,
            None => f.experts("num_experts").map_err(|_| anyhow!("missing field `n_routed_experts`"))?,
        };
        if f.get("q_lora_rank").is_none_or(Value::is_null) {
            bail!("field `q_lora_rank` is missing or null; strata runs MLA with the low-rank query path only");
        }
        let rope = f.rope_kind(10000.0)?;
        if let (Variant::Glm5, Some(_)) = (variant, &rope.yarn) {
            bail!("field `rope_parameters.rope_type` is `yarn`; glm_moe_dsa runs only `default` RoPE");
        }
        if rope.attention_factor() != 1.0 {
            bail!(
                "field `rope_parameters`: YaRN with attention_factor {} (`mscale` differs from `mscale_all_dim`) \
                 is not supported on MLA",
                rope.attention_factor()
            );
        }
        if !f.bool_or("rope_interleave", true)? {
            bail!("field `rope_interleave` is false; strata runs MLA with interleaved rotary pairs only");
        }
        for (k, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
            if f.get(k).is_some_and(|v| !v.is_null()) {
                f.str_is(k, want)?;
            }
        }
        f.str_is("hidden_act", "silu")?;
        if f.bool_or("attention_bias", false)? {
            bail!("field `attention_bias` is true; biased attention projections are not supported");
        }
        let first_k_dense = f.usize_or("first_k_dense_replace", 3)?;
        let mlp_layer_types = match f.str_list("mlp_layer_types")? {
            Some(kinds) => kinds
                .iter()
                .map(|k| match k.as_str() {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" => Ok(MlpKind::Sparse),
                    other => bail!("field `mlp_layer_types` has unknown kind `{other}`"),
                })
                .collect::<Result<Vec<_>>>()?,
            None => (0..num_hidden_layers)
                .map(|i| if i < first_k_dense { MlpKind::Dense } else { MlpKind::Sparse })
                .collect(),
        };
        let indexer_types = if deepseek {
            vec![IndexerKind::Absent; num_hidden_layers]
        } else {
            glm_indexer_types(&f, num_hidden_layers)?
        };
        let (groups, max_positions) = if deepseek { (8, 4096) } else { (1, 202752) };
        let fp8_block = f.fp8_block()?;
        let index = |k: &str| if deepseek { Ok(0) } else { f.usize_req(k) };
        let cfg = Self {
            variant,
            model_type,
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size: f.usize_req("hidden_size")?,
            intermediate_size: f.usize_req("intermediate_size")?,
            moe_intermediate_size: f.usize_req("moe_intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            n_routed_experts,
            num_experts_per_tok: f.usize_req("num_experts_per_tok")?,
            n_group: f.usize_or("n_group", groups)?,
            topk_group: f.usize_or("topk_group", if deepseek { 4 } else { 1 })?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 2.5)? as f32,
            q_lora_rank: f.usize_req("q_lora_rank")?,
            kv_lora_rank: f.usize_req("kv_lora_rank")?,
            qk_nope_head_dim: f.usize_req("qk_nope_head_dim")?,
            qk_rope_head_dim: f.usize_req("qk_rope_head_dim")?,
            v_head_dim: f.usize_req("v_head_dim")?,
            index_topk: index("index_topk")?,
            index_head_dim: index("index_head_dim")?,
            index_n_heads: index("index_n_heads")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", if deepseek { 1e-6 } else { 1e-5 })?,
            rope,
            max_position_embeddings: f.usize_or("max_position_embeddings", max_positions)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            num_nextn_predict_layers: f.nextn_layers()?,
            mlp_layer_types,
            indexer_types,
            eos_token_ids: f.eos_ids()?,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            fp8_block,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_group", self.n_group),
        ];
        let dsa = [("index_topk", self.index_topk), ("index_n_heads", self.index_n_heads)];
        let dsa = if self.variant == Variant::Glm5 { &dsa[..] } else { &[] };
        for &(name, v) in positive.iter().chain(dsa) {
            if v == 0 {
                bail!("field `{name}` must be positive");
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            bail!("field `qk_rope_head_dim` must be even, got {}", self.qk_rope_head_dim);
        }
        if self.variant == Variant::Glm5 && self.index_head_dim < self.qk_rope_head_dim {
            bail!(
                "field `index_head_dim` ({}) is smaller than `qk_rope_head_dim` ({})",
                self.index_head_dim,
                self.qk_rope_head_dim
            );
        }
        if self.mlp_layer_types.len() != self.num_hidden_layers {
            bail!(
                "field `mlp_layer_types` has {} entries for {} layers",
                self.mlp_layer_types.len(),
                self.num_hidden_layers
            );
        }
        if self.indexer_types.len() != self.num_hidden_layers {
            bail!(
                "field `indexer_types` has {} entries for {} layers",
                self.indexer_types.len(),
                self.num_hidden_layers
            );
        }
        if self.indexer_types[0] == IndexerKind::Shared {
            bail!("field `indexer_types`: layer 0 is `shared` but no earlier layer runs the indexer");
        }
        let has_moe = self.mlp_layer_types.contains(&MlpKind::Sparse);
        if has_moe {
            if self.n_routed_experts == 0 || self.moe_intermediate_size == 0 {
                bail!("fields `n_routed_experts` and `moe_intermediate_size` must be positive when layers are sparse");
            }
            check_noaux_routing(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group)?;
        }
        if self.mlp_layer_types.contains(&MlpKind::Dense) && self.intermediate_size == 0 {
            bail!("field `intermediate_size` must be positive when layers are dense");
        }
        for &id in &self.eos_token_ids {
            if id as usize >= self.vocab_size {
                bail!("field `eos_token_id` ({id}) is outside the vocabulary ({})", self.vocab_size);
            }
        }
        Ok(())
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    pub fn sparse_layers(&self) -> usize {
        self.mlp_layer_types.iter().filter(|k| **k == MlpKind::Sparse).count()
    }
}

/// GLM-5's indexer schedule: `indexer_types`, else `index_topk_pattern`, else the
/// frequency and offset transformers derives it from.
fn glm_indexer_types(f: &Fields, num_hidden_layers: usize) -> Result<Vec<IndexerKind>> {
    Ok(match f.str_list("indexer_types")? {
        Some(kinds) => kinds
            .iter()
            .map(|k| match k.as_str() {
                "full" => Ok(IndexerKind::Full),
                "shared" => Ok(IndexerKind::Shared),
                other => bail!("field `indexer_types` has unknown kind `{other}`"),
            })
            .collect::<Result<Vec<_>>>()?,
        None => match f.get("index_topk_pattern").and_then(Value::as_str) {
            Some(p) => p
                .chars()
                .map(|c| match c {
                    'F' => Ok(IndexerKind::Full),
                    'S' => Ok(IndexerKind::Shared),
                    other => bail!("field `index_topk_pattern` has unknown letter `{other}`"),
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                // transformers: layer i is full iff max(i - offset + 1, 0) % freq == 0.
                let freq = f.usize_or("index_topk_freq", 1)?.max(1);
                let offset = f.usize_or("index_skip_topk_offset", 2)?;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1).saturating_sub(offset) % freq == 0 {
                            IndexerKind::Full
                        } else {
                            IndexerKind::Shared
                        }
                    })
                    .collect()
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn tiny() -> Value {
        json!({
            "model_type": "glm_moe_dsa", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "moe_intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "index_topk": 4,
            "index_head_dim": 8, "index_n_heads": 2, "first_k_dense_replace": 1, "eos_token_id": [1, 2]
        })
    }

    fn with(k: &str, v: Value) -> Value {
        let mut j = tiny();
        j[k] = v;
        j
    }

    #[test]
    fn parses_defaults_and_schedules() {
        let c = GlmMoeDsaConfig::from_json(&tiny()).unwrap();
        assert_eq!(c.mlp_layer_types, vec![MlpKind::Dense, MlpKind::Sparse, MlpKind::Sparse, MlpKind::Sparse]);
        assert_eq!(c.indexer_types, vec![IndexerKind::Full; 4]);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        // GLM-5.2 sharing: freq 4, offset 3 -> full at 0,1,2,6,10,...
        let mut j = tiny();
        j["num_hidden_layers"] = json!(12);
        j["index_topk_freq"] = json!(4);
        j["index_skip_topk_offset"] = json!(3);
        let c = GlmMoeDsaConfig::from_json(&j).unwrap();
        let full: Vec<usize> = (0..12).filter(|&i| c.indexer_types[i] == IndexerKind::Full).collect();
        assert_eq!(full, vec![0, 1, 2, 6, 10]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (with("hidden_size", Value::Null), "missing field `hidden_size`"),
            (with("hidden_size", json!("x")), "field `hidden_size` must be a non-negative integer"),
            (with("num_experts_per_tok", json!(9)), "field `num_experts_per_tok` (9) must be in 1..=4"),
            (with("model_type", json!("llama")), "model_type `llama`"),
            (with("qk_rope_head_dim", json!(3)), "`qk_rope_head_dim` must be even"),
            (with("indexer_types", json!(["shared", "full", "full", "full"])), "layer 0 is `shared`"),
            (with("indexer_types", json!(["full"])), "`indexer_types` has 1 entries for 4 layers"),
            (with("n_group", json!(3)), "`n_group` (3) must divide"),
            (with("eos_token_id", json!(99)), "`eos_token_id` (99) is outside"),
            (
                with(
                    "rope_parameters",
                    json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4, "original_max_position_embeddings": 64}),
                ),
                "only `default` RoPE",
            ),
            (with("rope_parameters", json!({"rope_theta": "1e6"})), "`rope_parameters.rope_theta` must be a number"),
            (with("rope_parameters", json!(5)), "field `rope_parameters` must be an object"),
            (with("hidden_act", json!(5)), "field `hidden_act` must be `silu`, got 5"),
        ];
        for (json, want) in cases {
            let err = GlmMoeDsaConfig::from_json(&json).unwrap_err().to_string();
            assert!(err.contains(want), "want `{want}` in `{err}`");
        }
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    /// A corrupt layer count is refused before it sizes per-layer lists (fuzz finding).
    #[test]
    fn absurd_layer_counts_are_refused() {
        let j = serde_json::json!({
            "model_type": "glm_moe_dsa", "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1_000_000_000_000_000u64,
        });
        let e = format!("{:#}", GlmMoeDsaConfig::from_json(&j).unwrap_err());
        assert!(e.contains("num_hidden_layers"), "{e}");
    }
}

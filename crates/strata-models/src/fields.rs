//! Reading `config.json` fields with errors that name the field (shared by families).

use anyhow::{anyhow, bail, Result};
use serde_json::Value;

pub(crate) struct Fields<'a>(pub &'a serde_json::Map<String, Value>);

/// More layers than any published model by far: a bound that keeps a corrupt count from
/// sizing per-layer lists before anything else is checked.
pub(crate) const MAX_LAYERS: usize = 4096;
/// Routed experts per layer, bounded likewise (the weight map names every one).
pub(crate) const MAX_EXPERTS: usize = 1 << 16;

impl Fields<'_> {
    pub(crate) fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    pub(crate) fn usize_req(&self, k: &str) -> Result<usize> {
        let v = self.get(k).ok_or_else(|| anyhow!("missing field `{k}`"))?;
        v.as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("field `{k}` must be a non-negative integer, got {v}"))
    }
    pub(crate) fn usize_or(&self, k: &str, default: usize) -> Result<usize> {
        if self.get(k).is_some() {
            self.usize_req(k)
        } else {
            Ok(default)
        }
    }
    pub(crate) fn f64_or(&self, k: &str, default: f64) -> Result<f64> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("field `{k}` must be a number, got {v}")),
        }
    }
    pub(crate) fn bool_or(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("field `{k}` must be true or false, got {v}")),
        }
    }
    pub(crate) fn str_list(&self, k: &str) -> Result<Option<Vec<String>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_str().map(str::to_owned).ok_or_else(|| anyhow!("field `{k}` must be a list of strings")))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => bail!("field `{k}` must be a list of strings, got {v}"),
        }
    }
    pub(crate) fn token_ids(&self, k: &str) -> Result<Vec<u32>> {
        match self.get(k) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| token_id(i).ok_or_else(|| anyhow!("field `{k}` must hold token ids, got {i}")))
                .collect(),
            Some(v) => token_id(v)
                .map(|x| vec![x])
                .ok_or_else(|| anyhow!("field `{k}` must be a token id or a list of them, got {v}")),
        }
    }
}

impl Fields<'_> {
    /// `model_type`, which must be one of `accepted`.
    pub(crate) fn model_type(&self, accepted: &[&str]) -> Result<String> {
        match self.get("model_type").and_then(Value::as_str) {
            Some(t) if accepted.contains(&t) => Ok(t.to_owned()),
            Some(other) if accepted.len() == 1 => bail!("model_type `{other}` is not `{}`", accepted[0]),
            Some(other) => bail!("model_type `{other}` is not one of {}", accepted.join(", ")),
            None => bail!("missing field `model_type`"),
        }
    }
    /// A field that, where given, must be the string `expected` (an activation the family
    /// implements, say).
    pub(crate) fn str_is(&self, k: &str, expected: &str) -> Result<()> {
        match self.get(k) {
            Some(v) if v.as_str() != Some(expected) => bail!("field `{k}` must be `{expected}`, got {v}"),
            _ => Ok(()),
        }
    }
    /// `eos_token_id` as a list, a repeat next to itself dropped.
    pub(crate) fn eos_ids(&self) -> Result<Vec<u32>> {
        let mut ids = self.token_ids("eos_token_id")?;
        ids.dedup();
        Ok(ids)
    }
    /// `num_nextn_predict_layers` (MTP layers), 0 where absent.
    pub(crate) fn nextn_layers(&self) -> Result<usize> {
        match self.get("num_nextn_predict_layers") {
            Some(_) => self.layers("num_nextn_predict_layers"),
            None => Ok(0),
        }
    }
    /// `rope_theta` and `partial_rotary_factor` from `rope_parameters` (or the legacy
    /// `rope_scaling` / top-level fields); only default RoPE is supported.
    pub(crate) fn rope(&self, theta_default: f64, partial_default: f64) -> Result<(f64, f64)> {
        Ok((self.rope_theta(theta_default)?, self.rope_param("partial_rotary_factor", partial_default)?))
    }
    /// `rope_theta` alone, as [`Self::rope`] reads it (for families whose rotary width is
    /// a field of its own).
    pub(crate) fn rope_theta(&self, default: f64) -> Result<f64> {
        let kind = self.rope_type()?;
        if kind != "default" {
            bail!("field `rope_parameters.rope_type` is `{kind}`; only `default` RoPE is supported");
        }
        self.rope_param("rope_theta", default)
    }
    /// `rope_parameters.rope_type` (or the legacy `type`), `default` where not given.
    pub(crate) fn rope_type(&self) -> Result<&str> {
        Ok(self
            .rope_params()?
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default"))
    }
    /// `rope_parameters` (or the legacy `rope_scaling`), where given.
    pub(crate) fn rope_params(&self) -> Result<Option<&serde_json::Map<String, Value>>> {
        match self.get("rope_parameters").or_else(|| self.get("rope_scaling")) {
            Some(Value::Object(p)) => Ok(Some(p)),
            Some(v) => bail!("field `rope_parameters` must be an object, got {v}"),
            None => Ok(None),
        }
    }
    /// A number from `rope_parameters`, where given there.
    pub(crate) fn rope_number(&self, k: &str) -> Result<Option<f64>> {
        match self.rope_params()?.and_then(|p| p.get(k)).filter(|v| !v.is_null()) {
            Some(v) => {
                Ok(Some(v.as_f64().ok_or_else(|| anyhow!("field `rope_parameters.{k}` must be a number, got {v}"))?))
            }
            None => Ok(None),
        }
    }
    /// A number from `rope_parameters`, else the top-level field, else `default`.
    pub(crate) fn rope_param(&self, k: &str, default: f64) -> Result<f64> {
        match self.rope_number(k)? {
            Some(v) => Ok(v),
            None => self.f64_or(k, default),
        }
    }
    /// A layer count, bounded by [`MAX_LAYERS`].
    pub(crate) fn layers(&self, k: &str) -> Result<usize> {
        let n = self.usize_req(k)?;
        if n > MAX_LAYERS {
            bail!("field `{k}` ({n}) exceeds {MAX_LAYERS} layers");
        }
        Ok(n)
    }
    /// A routed-expert count, bounded by [`MAX_EXPERTS`].
    pub(crate) fn experts(&self, k: &str) -> Result<usize> {
        let n = self.usize_req(k)?;
        if n > MAX_EXPERTS {
            bail!("field `{k}` ({n}) exceeds {MAX_EXPERTS} experts");
        }
        Ok(n)
    }
    /// A list of layer indices below `layers` (`mlp_only_layers`); empty where absent.
    pub(crate) fn layer_indices(&self, k: &str, layers: usize) -> Result<Vec<usize>> {
        match self.get(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as usize)
                        .filter(|&x| x < layers)
                        .ok_or_else(|| anyhow!("field `{k}` holds {v}: not a layer index below {layers}"))
                })
                .collect(),
            Some(v) => bail!("field `{k}` must be a list of layer indices, got {v}"),
        }
    }
    /// `layer_types`, one entry a layer, each one of `kinds`: per layer, its kind's index;
    /// None where absent.
    pub(crate) fn layer_types(&self, family: &str, layers: usize, kinds: &[&str]) -> Result<Option<Vec<usize>>> {
        let Some(types) = self.str_list("layer_types")? else { return Ok(None) };
        if types.len() != layers {
            bail!("field `layer_types` lists {} layers; `num_hidden_layers` is {layers}", types.len());
        }
        let names = kinds.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(" or ");
        types
            .iter()
            .map(|t| {
                kinds
                    .iter()
                    .position(|k| k == t)
                    .ok_or_else(|| anyhow!("field `layer_types` holds `{t}`; {family} layers are {names}"))
            })
            .collect::<Result<_>>()
            .map(Some)
    }
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub(crate) fn fp8_block(&self) -> Result<Option<(usize, usize)>> {
        let Some(q) = self.get("quantization_config") else { return Ok(None) };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method != "fp8" {
            bail!("field `quantization_config.quant_method` is `{method}`; only `fp8` is supported");
        }
        let bad = || anyhow!("field `quantization_config.weight_block_size` must hold two positive integers");
        match q.get("weight_block_size").and_then(Value::as_array) {
            Some(b) if b.len() == 2 => {
                let dim = |v: &Value| v.as_u64().filter(|&x| x > 0 && x <= u32::MAX as u64).map(|x| x as usize);
                Ok(Some((dim(&b[0]).ok_or_else(bad)?, dim(&b[1]).ok_or_else(bad)?)))
            }
            _ => bail!("field `quantization_config.weight_block_size` must be [rows, cols]"),
        }
    }
}

/// noaux_tc routing's fields checked together (the GLM families): `num_experts_per_tok` in
/// 1..=`n_routed_experts`; `n_group` dividing the experts, with at least two a group when
/// there are several (a group scores by the sum of its two best); `topk_group` in
/// 1..=`n_group`; and enough experts in the kept groups for `num_experts_per_tok`.
pub(crate) fn check_noaux_routing(n_routed: usize, per_tok: usize, n_group: usize, topk_group: usize) -> Result<()> {
    if per_tok == 0 || per_tok > n_routed {
        bail!("field `num_experts_per_tok` ({per_tok}) must be in 1..={n_routed} (`n_routed_experts`)");
    }
    if n_group == 0 || !n_routed.is_multiple_of(n_group) {
        bail!("field `n_group` ({n_group}) must divide `n_routed_experts` ({n_routed})");
    }
    if topk_group == 0 || topk_group > n_group {
        bail!("field `topk_group` ({topk_group}) must be in 1..={n_group} (`n_group`)");
    }
    let per_group = n_routed / n_group;
    if n_group > 1 && per_group < 2 {
        bail!("field `n_group` leaves fewer than 2 experts per group");
    }
    if per_tok > topk_group * per_group {
        bail!(
            "field `num_experts_per_tok` ({per_tok}) exceeds the experts in `topk_group` groups ({})",
            topk_group * per_group
        );
    }
    Ok(())
}

fn token_id(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|x| u32::try_from(x).ok())
}

/// Each `(field, value)` must be positive.
pub(crate) fn check_positive(fields: &[(&str, usize)]) -> Result<()> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => bail!("field `{name}` must be positive"),
        None => Ok(()),
    }
}

/// Grouped-query attention's head counts: query heads a multiple of the KV heads.
pub(crate) fn check_gqa_heads(heads: usize, kv_heads: usize) -> Result<()> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        bail!("field `num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` ({kv_heads})");
    }
    Ok(())
}

/// End-of-sequence ids inside the vocabulary.
pub(crate) fn check_eos(ids: &[u32], vocab_size: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab_size) {
        Some(id) => bail!("field `eos_token_id` ({id}) is outside the vocabulary ({vocab_size})"),
        None => Ok(()),
    }
}

/// The Qwen MoE families' rule (transformers): a layer is sparse unless listed in
/// `mlp_only_layers`, when there are experts and `(layer + 1)` is a multiple of
/// `decoder_sparse_step`.
pub(crate) fn qwen_sparse(layer: usize, mlp_only_layers: &[usize], experts: usize, step: usize) -> bool {
    !mlp_only_layers.contains(&layer) && experts > 0 && (layer + 1).is_multiple_of(step)
}

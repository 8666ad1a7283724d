//! `config.json` of a Gemma 4 model, validated once at load: `gemma4` (the multimodal
//! wrapper, text fields under `text_config`, weights under `model.language_model.`) or
//! `gemma4_text` (text fields at the top, weights under `model.`). Field names and
//! defaults as transformers' `Gemma4TextConfig` / `Gemma4Config`; every error names the
//! field, and every feature strata does not run is refused by name.
//!
//! Per-layer attention shapes come in two spellings: the Hub's (`global_head_dim`,
//! `num_global_key_value_heads` for the full-attention layers) or the one transformers
//! writes back (`per_layer_config`, overrides by layer index). Both resolve to one
//! [`LayerSpec`] per layer.

use super::vision::VisionConfig;
use crate::fields::Fields;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

/// Attention kind of a layer (`layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Sees its last `sliding_window` positions; default RoPE.
    Sliding,
    /// Sees every earlier position; proportional RoPE.
    Full,
}

impl LayerKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Sliding => "sliding_attention",
            Self::Full => "full_attention",
        }
    }
}

/// One decoder layer's attention and MLP shape, resolved from the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub kind: LayerKind,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Keys are also the values (`attention_k_eq_v` on full layers): no `v_proj`.
    pub k_eq_v: bool,
    /// KV sharing: the earlier layer whose K/V cache this layer reads (it has no K/V
    /// projections of its own), or None.
    pub kv_from: Option<usize>,
    /// Width of the dense MLP (doubled on KV-shared layers with `use_double_wide_mlp`).
    pub mlp_width: usize,
}

/// RoPE of one layer kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// Fraction of each head's frequency pairs that rotate (proportional RoPE; the rest
    /// have frequency zero, i.e. pass through).
    pub partial: f64,
    /// Frequencies are divided by this (proportional RoPE's `factor`).
    pub factor: f64,
}

impl Rope {
    /// The inverse frequencies over a head of `head_dim` (`head_dim / 2` values; zeros
    /// past the rotated fraction), rotated half-split over the whole head.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let angles = (self.partial * head_dim as f64 / 2.0) as usize;
        (0..head_dim / 2)
            .map(|i| match i < angles {
                true => (1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64) / self.factor) as f32,
                false => 0.0,
            })
            .collect()
    }
}

/// Per-Layer Embeddings (E2B/E4B).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PleSpec {
    /// `hidden_size_per_layer_input`: each layer's slice.
    pub dim: usize,
    /// `vocab_size_per_layer_input`: rows of the packed table.
    pub vocab: usize,
}

/// The MoE block (26B-A4B): routed experts beside the dense MLP on every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
}

/// The text model's fields.
#[derive(Clone, Debug)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub layers: Vec<LayerSpec>,
    pub sliding_window: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub rope_sliding: Rope,
    pub rope_full: Rope,
    pub final_logit_softcapping: Option<f32>,
    pub ple: Option<PleSpec>,
    pub moe: Option<MoeSpec>,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: u32,
    /// `use_bidirectional_attention == "vision"`: image tokens attend bidirectionally
    /// within their image on sliding layers.
    pub bidirectional_vision: bool,
    pub num_kv_shared_layers: usize,
}

/// A Gemma 4 checkpoint's configuration.
#[derive(Clone, Debug)]
pub struct Gemma4Config {
    /// `gemma4` or `gemma4_text`.
    pub model_type: String,
    pub text: TextConfig,
    /// The vision tower (`gemma4` with a `vision_config`).
    pub vision: Option<VisionConfig>,
    /// Whether the checkpoint declares an audio tower (not run: audio input is refused).
    pub audio: bool,
    pub image_token_id: u32,
    pub boi_token_id: u32,
    pub eoi_token_id: u32,
    /// FP8 checkpoints: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<(usize, usize)>,
}

pub const MODEL_TYPES: [&str; 2] = ["gemma4", "gemma4_text"];

/// `per_layer_config` keys strata applies; any other is refused.
const PER_LAYER_KEYS: [&str; 2] = ["head_dim", "num_key_value_heads"];

impl Gemma4Config {
    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| anyhow!("config is not a JSON object"))?;
        let f = Fields(obj);
        let model_type = f.model_type(&MODEL_TYPES)?;
        let wrapper = model_type == "gemma4";
        let (text, vision, audio) = if wrapper {
            let t = match f.get("text_config") {
                Some(Value::Object(t)) => t,
                Some(v) => bail!("field `text_config` must be an object, got {v}"),
                None => bail!("missing field `text_config`"),
            };
            if let Some(mt) = t.get("model_type").and_then(Value::as_str) {
                if mt != "gemma4_text" {
                    bail!("field `text_config.model_type` is `{mt}`, expected `gemma4_text`");
                }
            }
            let text = TextConfig::from_fields(&Fields(t), Some(&f)).context("text_config")?;
            let vision = match f.get("vision_config") {
                None => None,
                Some(Value::Object(v)) => Some(VisionConfig::from_fields(&Fields(v)).context("vision_config")?),
                Some(v) => bail!("field `vision_config` must be an object, got {v}"),
            };
            (text, vision, f.get("audio_config").is_some())
        } else {
            (TextConfig::from_fields(&f, None)?, None, false)
        };
        let id = |k: &str, default: u32| -> Result<u32> {
            match f.token_ids(k)?.as_slice() {
                [] => Ok(default),
                [x] => Ok(*x),
                _ => bail!("field `{k}` must be one token id"),
            }
        };
        let cfg = Self {
            model_type,
            image_token_id: id("image_token_id", 258_880)?,
            boi_token_id: id("boi_token_id", 255_999)?,
            eoi_token_id: id("eoi_token_id", 258_882)?,
            fp8_block: f.fp8_block()?,
            text,
            vision,
            audio,
        };
        Ok(cfg)
    }

    /// Where the text model's tensors live in the checkpoint.
    pub fn prefix(&self) -> &'static str {
        match self.model_type.as_str() {
            "gemma4" => "model.language_model.",
            _ => "model.",
        }
    }
}

fn rope_of(params: Option<&Map<String, Value>>, kind: LayerKind) -> Result<Rope> {
    let (default_type, theta, partial) = match kind {
        LayerKind::Sliding => ("default", 10_000.0, 1.0),
        LayerKind::Full => ("proportional", 1_000_000.0, 0.25),
    };
    let Some(params) = params else { return Ok(Rope { theta, partial, factor: 1.0 }) };
    let key = kind.name();
    let p = match params.get(key) {
        Some(Value::Object(p)) => p,
        Some(Value::Null) | None => {
            // An absent layer kind's entry takes transformers' defaults.
            let _ = default_type;
            return Ok(Rope { theta, partial, factor: 1.0 });
        }
        Some(v) => bail!("field `rope_parameters.{key}` must be an object, got {v}"),
    };
    let num = |k: &str, default: f64| -> Result<f64> {
        match p.get(k).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("field `rope_parameters.{key}.{k}` must be a number, got {v}")),
        }
    };
    for k in p.keys() {
        if !["rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"].contains(&k.as_str()) {
            bail!("field `rope_parameters.{key}.{k}` is not supported");
        }
    }
    let rope_type = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let rope = match rope_type {
        "default" => {
            // transformers' default RoPE rotates the whole head whatever these say.
            if num("partial_rotary_factor", 1.0)? != 1.0 || num("factor", 1.0)? != 1.0 {
                bail!("field `rope_parameters.{key}`: `default` RoPE takes no `partial_rotary_factor` or `factor`");
            }
            Rope { theta: num("rope_theta", theta)?, partial: 1.0, factor: 1.0 }
        }
        "proportional" => Rope {
            theta: num("rope_theta", theta)?,
            partial: num("partial_rotary_factor", 1.0)?,
            factor: num("factor", 1.0)?,
        },
        other => {
            bail!("field `rope_parameters.{key}.rope_type` is `{other}`; Gemma 4 runs `default` and `proportional`")
        }
    };
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if !positive(rope.theta) || !(0.0..=1.0).contains(&rope.partial) || !positive(rope.factor) {
        bail!("field `rope_parameters.{key}` has an invalid theta, partial_rotary_factor or factor");
    }
    Ok(rope)
}

impl TextConfig {
    /// From the text fields `f`; `outer` is the `gemma4` wrapper (its
    /// `tie_word_embeddings` wins, as transformers ties the wrapper's head).
    fn from_fields(f: &Fields, outer: Option<&Fields>) -> Result<Self> {
        if let Some(a) = f.get("hidden_activation").or_else(|| f.get("hidden_act")) {
            if a.as_str() != Some("gelu_pytorch_tanh") {
                bail!("field `hidden_activation` must be `gelu_pytorch_tanh`, got {a}");
            }
        }
        if f.bool_or("attention_bias", false)? {
            bail!("field `attention_bias`: biased attention projections are not supported for Gemma 4");
        }
        let bidirectional_vision = match f.get("use_bidirectional_attention") {
            None => false,
            Some(Value::String(s)) if s == "vision" => true,
            Some(v) => bail!("field `use_bidirectional_attention` is {v}; strata runs it unset or `vision`"),
        };
        for k in ["attn_logit_softcapping", "query_pre_attn_scalar", "altup_num_inputs", "laurel_rank"] {
            if f.get(k).is_some() {
                bail!("field `{k}` is not a Gemma 4 feature strata runs");
            }
        }
        let hidden_size = f.usize_req("hidden_size")?;
        let num_hidden_layers = f.layers("num_hidden_layers")?;
        let num_attention_heads = f.usize_or("num_attention_heads", 8)?;
        let head_dim = f.usize_or("head_dim", 256)?;
        let kv_heads = f.usize_or("num_key_value_heads", 4)?;
        let k_eq_v = f.bool_or("attention_k_eq_v", false)?;
        let kinds = layer_kinds(f, num_hidden_layers)?;
        let shapes = layer_shapes(f, &kinds, head_dim, kv_heads, k_eq_v)?;
        let shared = f.usize_or("num_kv_shared_layers", 0)?;
        let sources = kv_sources(&kinds, shared)?;
        let intermediate_size = f.usize_or("intermediate_size", 9216)?;
        let double_wide = f.bool_or("use_double_wide_mlp", false)?;
        let layers = (0..num_hidden_layers)
            .map(|i| LayerSpec {
                kind: kinds[i],
                head_dim: shapes[i].0,
                kv_heads: shapes[i].1,
                k_eq_v: k_eq_v && kinds[i] == LayerKind::Full,
                kv_from: sources[i],
                mlp_width: intermediate_size * if double_wide && sources[i].is_some() { 2 } else { 1 },
            })
            .collect::<Vec<_>>();
        let rope = match f.get("rope_parameters").or_else(|| f.get("rope_scaling")) {
            None => None,
            Some(Value::Object(p)) => Some(p),
            Some(v) => bail!("field `rope_parameters` must be an object keyed by layer type, got {v}"),
        };
        if let Some(p) = rope {
            if p.contains_key("rope_type") || p.contains_key("rope_theta") {
                bail!("field `rope_parameters` must be keyed by layer type (`sliding_attention`, `full_attention`)");
            }
        }
        let ple = match f.usize_or("hidden_size_per_layer_input", 256)? {
            0 => None,
            dim => Some(PleSpec { dim, vocab: f.usize_or("vocab_size_per_layer_input", 262_144)? }),
        };
        let moe = match f.bool_or("enable_moe_block", false)? {
            false => None,
            true => Some(MoeSpec {
                experts: f.experts("num_experts")?,
                top_k: f.usize_req("top_k_experts")?,
                inter: f.usize_req("moe_intermediate_size")?,
            }),
        };
        let final_logit_softcapping = match f.get("final_logit_softcapping") {
            None => None,
            Some(v) => Some(
                v.as_f64()
                    .filter(|c| *c > 0.0)
                    .ok_or_else(|| anyhow!("field `final_logit_softcapping` must be a positive number, got {v}"))?
                    as f32,
            ),
        };
        let tie = match outer.and_then(|o| o.get("tie_word_embeddings")) {
            Some(_) => outer.unwrap().bool_or("tie_word_embeddings", true)?,
            None => f.bool_or("tie_word_embeddings", true)?,
        };
        let mut eos_token_ids = f.token_ids("eos_token_id")?;
        if f.get("eos_token_id").is_none() {
            eos_token_ids = vec![1];
        }
        eos_token_ids.dedup();
        let pad = f.token_ids("pad_token_id")?.first().copied().unwrap_or(0);
        let cfg = Self {
            vocab_size: f.usize_or("vocab_size", 262_144)?,
            hidden_size,
            intermediate_size,
            num_attention_heads,
            sliding_window: f.usize_or("sliding_window", 512)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 131_072)?,
            rope_sliding: rope_of(rope, LayerKind::Sliding)?,
            rope_full: rope_of(rope, LayerKind::Full)?,
            final_logit_softcapping,
            ple,
            moe,
            tie_word_embeddings: tie,
            eos_token_ids,
            bos_token_id: match f.get("bos_token_id") {
                None => Some(2),
                Some(_) => f.token_ids("bos_token_id")?.first().copied(),
            },
            pad_token_id: pad,
            bidirectional_vision,
            num_kv_shared_layers: shared,
            layers,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The shape shared by every layer of `kind` (validated), if the model has one.
    pub fn kind_shape(&self, kind: LayerKind) -> Option<(usize, usize)> {
        self.layers.iter().find(|l| l.kind == kind).map(|l| (l.head_dim, l.kv_heads))
    }

    pub fn rope(&self, kind: LayerKind) -> Rope {
        match kind {
            LayerKind::Sliding => self.rope_sliding,
            LayerKind::Full => self.rope_full,
        }
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.layers.len()),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("sliding_window", self.sliding_window),
        ] {
            if v == 0 {
                bail!("field `{name}` must be positive");
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.head_dim == 0 || l.head_dim % 2 != 0 || l.head_dim > 1024 {
                bail!("layer {i}: head_dim {} must be even and in 2..=1024", l.head_dim);
            }
            if l.kv_heads == 0 || !self.num_attention_heads.is_multiple_of(l.kv_heads) {
                bail!(
                    "layer {i}: `num_attention_heads` ({}) must be a multiple of its `num_key_value_heads` ({})",
                    self.num_attention_heads,
                    l.kv_heads
                );
            }
        }
        for kind in [LayerKind::Sliding, LayerKind::Full] {
            let shape = self.kind_shape(kind);
            if let Some((i, l)) =
                self.layers.iter().enumerate().find(|(_, l)| l.kind == kind && Some((l.head_dim, l.kv_heads)) != shape)
            {
                bail!(
                    "layer {i}: every {} layer must have the same head_dim and num_key_value_heads ({:?} vs {:?})",
                    kind.name(),
                    (l.head_dim, l.kv_heads),
                    shape
                );
            }
        }
        if let Some(ple) = self.ple {
            if ple.vocab == 0 {
                bail!("field `vocab_size_per_layer_input` must be positive");
            }
        }
        if let Some(m) = self.moe {
            if m.experts == 0 || m.inter == 0 {
                bail!("fields `num_experts` and `moe_intermediate_size` must be positive with `enable_moe_block`");
            }
            if m.top_k == 0 || m.top_k > m.experts || m.top_k > 64 {
                bail!("field `top_k_experts` ({}) must be in 1..={} (`num_experts`, at most 64)", m.top_k, m.experts);
            }
        }
        for &id in self.eos_token_ids.iter().chain(self.bos_token_id.iter()) {
            if id as usize >= self.vocab_size {
                bail!("field `eos_token_id`/`bos_token_id` ({id}) is outside the vocabulary ({})", self.vocab_size);
            }
        }
        if self.pad_token_id as usize >= self.vocab_size {
            bail!("field `pad_token_id` ({}) is outside the vocabulary ({})", self.pad_token_id, self.vocab_size);
        }
        if let Some(ple) = self.ple {
            if self.pad_token_id as usize >= ple.vocab {
                bail!(
                    "field `pad_token_id` ({}) is outside `vocab_size_per_layer_input` ({})",
                    self.pad_token_id,
                    ple.vocab
                );
            }
        }
        Ok(())
    }
}

/// `layer_types`, or transformers' default (five sliding layers, then a full one); the
/// last layer must be full.
fn layer_kinds(f: &Fields, n: usize) -> Result<Vec<LayerKind>> {
    let kinds: Vec<LayerKind> = match f.str_list("layer_types")? {
        Some(list) => {
            if list.len() != n {
                bail!("field `layer_types` has {} entries for {n} layers", list.len());
            }
            list.iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(LayerKind::Sliding),
                    "full_attention" => Ok(LayerKind::Full),
                    other => bail!("field `layer_types`: `{other}` is not `sliding_attention` or `full_attention`"),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let mut k: Vec<LayerKind> =
                (0..n).map(|i| if (i + 1) % 6 != 0 { LayerKind::Sliding } else { LayerKind::Full }).collect();
            // (transformers forces the last layer to full attention.)
            if let Some(last) = k.last_mut() {
                *last = LayerKind::Full;
            }
            k
        }
    };
    if kinds.last() == Some(&LayerKind::Sliding) {
        bail!("field `layer_types`: the last layer must be `full_attention`");
    }
    Ok(kinds)
}

/// Each layer's (head_dim, kv_heads): `per_layer_config` overrides when present, else
/// the Hub's `global_head_dim` / `num_global_key_value_heads` on full layers.
fn layer_shapes(
    f: &Fields,
    kinds: &[LayerKind],
    head_dim: usize,
    kv_heads: usize,
    k_eq_v: bool,
) -> Result<Vec<(usize, usize)>> {
    let mut shapes = vec![(head_dim, kv_heads); kinds.len()];
    match f.get("per_layer_config") {
        Some(Value::Object(per)) => {
            for (key, v) in per {
                let i: usize = key.parse().ok().filter(|&i| i < kinds.len()).ok_or_else(|| {
                    anyhow!("field `per_layer_config`: key `{key}` is not a layer index below {}", kinds.len())
                })?;
                let o = v.as_object().ok_or_else(|| anyhow!("field `per_layer_config.{key}` must be an object"))?;
                for (k, val) in o {
                    let n = val
                        .as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| anyhow!("field `per_layer_config.{key}.{k}` must be a non-negative integer"));
                    match k.as_str() {
                        "head_dim" => shapes[i].0 = n?,
                        "num_key_value_heads" => shapes[i].1 = n?,
                        other => bail!(
                            "field `per_layer_config.{key}.{other}` is not supported (strata applies {})",
                            PER_LAYER_KEYS.join(", ")
                        ),
                    }
                }
            }
        }
        Some(v) => bail!("field `per_layer_config` must be an object, got {v}"),
        None => {
            let global_head_dim = f.usize_or("global_head_dim", 512)?;
            let global_kv = match (k_eq_v, f.get("num_global_key_value_heads")) {
                (true, Some(_)) => f.usize_req("num_global_key_value_heads")?,
                _ => kv_heads,
            };
            for (s, k) in shapes.iter_mut().zip(kinds) {
                if *k == LayerKind::Full {
                    *s = (global_head_dim, global_kv);
                }
            }
        }
    }
    Ok(shapes)
}

/// KV sharing: the last `shared` layers read the cache of the last earlier layer of their
/// kind (transformers' `kv_sharing_modes`).
fn kv_sources(kinds: &[LayerKind], shared: usize) -> Result<Vec<Option<usize>>> {
    let n = kinds.len();
    if shared >= n && n > 0 && shared > 0 {
        bail!("field `num_kv_shared_layers` ({shared}) must leave at least one layer that computes its own K/V");
    }
    let first = n - shared;
    (0..n)
        .map(|i| {
            if i < first {
                return Ok(None);
            }
            let producer = (0..first).rev().find(|&j| kinds[j] == kinds[i]).ok_or_else(|| {
                anyhow!(
                    "field `num_kv_shared_layers` ({shared}): layer {i} ({}) has no earlier {} layer to share K/V with",
                    kinds[i].name(),
                    kinds[i].name()
                )
            })?;
            Ok(Some(producer))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text() -> Value {
        json!({
            "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "global_head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2, "use_double_wide_mlp": true,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                            "sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0, "eos_token_id": [1, 106]
        })
    }

    fn err(patch: Value) -> String {
        let mut j = text();
        for (k, v) in patch.as_object().unwrap() {
            j[k] = v.clone();
        }
        format!("{:#}", Gemma4Config::from_json(&j).unwrap_err())
    }

    #[test]
    fn resolves_layers_sharing_and_rope() {
        let c = Gemma4Config::from_json(&text()).unwrap();
        let t = &c.text;
        assert_eq!(c.prefix(), "model.");
        assert_eq!(
            t.layers[2],
            LayerSpec {
                kind: LayerKind::Full,
                head_dim: 32,
                kv_heads: 2,
                k_eq_v: false,
                kv_from: None,
                mlp_width: 128
            }
        );
        // The last two layers read the last sliding (3) and full (2) layers' caches.
        assert_eq!((t.layers[4].kv_from, t.layers[5].kv_from), (Some(3), Some(2)));
        assert_eq!((t.layers[4].mlp_width, t.layers[3].mlp_width), (256, 128));
        assert_eq!(t.ple, Some(PleSpec { dim: 8, vocab: 512 }));
        assert_eq!(t.final_logit_softcapping, Some(30.0));
        // Proportional RoPE: 1/4 of the 16 frequency pairs rotate, the rest are zero.
        let f = t.rope_full.inv_freq(32);
        assert_eq!(f.len(), 16);
        assert!(f[..4].iter().all(|v| *v > 0.0) && f[4..].iter().all(|v| *v == 0.0));
        assert_eq!(f[1], (1.0 / 1e6f64.powf(2.0 / 32.0)) as f32);
        assert_eq!(t.rope_sliding.inv_freq(16), strata_kernels::ops::rope_inv_freq(16, 10000.0));
    }

    #[test]
    fn per_layer_config_and_the_wrapper() {
        let mut t = text();
        t["per_layer_config"] =
            json!({"2": {"head_dim": 32, "num_key_value_heads": 1}, "5": {"head_dim": 32, "num_key_value_heads": 1}});
        t["attention_k_eq_v"] = json!(true);
        let c =
            Gemma4Config::from_json(&json!({"model_type": "gemma4", "text_config": t, "image_token_id": 500})).unwrap();
        assert_eq!(c.prefix(), "model.language_model.");
        assert_eq!((c.text.layers[2].head_dim, c.text.layers[2].kv_heads, c.text.layers[2].k_eq_v), (32, 1, true));
        assert!(!c.text.layers[0].k_eq_v);
        assert_eq!(c.image_token_id, 500);
    }

    #[test]
    fn errors_name_the_field() {
        assert!(err(json!({"use_bidirectional_attention": "all"})).contains("use_bidirectional_attention"));
        assert!(err(json!({"attention_bias": true})).contains("attention_bias"));
        assert!(err(json!({"hidden_activation": "silu"})).contains("hidden_activation"));
        assert!(err(json!({"num_kv_shared_layers": 6})).contains("num_kv_shared_layers"));
        assert!(err(json!({"num_kv_shared_layers": 5})).contains("num_kv_shared_layers"));
        assert!(err(json!({"layer_types": ["sliding_attention"]})).contains("layer_types"));
        assert!(err(json!({"per_layer_config": {"2": {"intermediate_size": 3}}})).contains("intermediate_size"));
        assert!(err(json!({"per_layer_config": {"9": {"head_dim": 3}}})).contains("per_layer_config"));
        assert!(err(json!({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}})).contains("rope_type"));
        assert!(err(json!({"enable_moe_block": true, "num_experts": 4})).contains("top_k_experts"));
        assert!(err(
            json!({"enable_moe_block": true, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8})
        )
        .contains("top_k_experts"));
        assert!(err(json!({"num_hidden_layers": 1_000_000_000_000u64})).contains("num_hidden_layers"));
        assert!(err(json!({"eos_token_id": 600})).contains("eos_token_id"));
        assert!(err(json!({"model_type": "gemma3"})).contains("gemma4"));
        assert!(err(json!({"num_key_value_heads": 3})).contains("num_key_value_heads"));
    }
}

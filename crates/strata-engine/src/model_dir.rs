//! A Hugging Face model directory opened as a whole: config dispatch by `model_type`,
//! weights, tokenizer, chat template and generation defaults.

use crate::chat::ChatTemplate;
use crate::sampling::SamplingParams;
use crate::tokenizer::TextTokenizer;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use serde_json::Value;
use std::path::{Path, PathBuf};
use strata_models::glm_moe_dsa::{GlmMoeDsa, GlmMoeDsaConfig};
use strata_models::CausalLm;

pub const SUPPORTED_MODEL_TYPES: &[&str] = &[GlmMoeDsaConfig::MODEL_TYPE];

/// Sampling defaults and stop ids from `generation_config.json`.
#[derive(Clone, Debug, Default)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
}

pub struct LoadedModel {
    pub dir: PathBuf,
    pub model_type: String,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Option<TextTokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    /// The union of config.json's and generation_config.json's EOS ids.
    pub eos_token_ids: Vec<u32>,
}

/// Reads `config.json` and returns it with its `model_type`, refusing unknown types.
pub fn read_config(dir: &Path) -> Result<(Value, String)> {
    if !dir.is_dir() {
        bail!("{}: model directory not found", dir.display());
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow!("{}: cannot read: {e}", path.display()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
    let model_type = json
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("{}: missing field `model_type`", path.display()))?
        .to_string();
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        bail!(
            "{}: unsupported model_type `{model_type}` (strata supports: {})",
            path.display(),
            SUPPORTED_MODEL_TYPES.join(", ")
        );
    }
    Ok((json, model_type))
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => vec![],
    }
}

pub fn read_generation_defaults(dir: &Path) -> Result<GenerationDefaults> {
    let path = dir.join("generation_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(GenerationDefaults::default());
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{}: invalid JSON: {e}", path.display()))?;
    let mut sampling = SamplingParams::default();
    let do_sample = json.get("do_sample").and_then(Value::as_bool).unwrap_or(false);
    if do_sample {
        sampling.temperature = json.get("temperature").and_then(Value::as_f64).unwrap_or(1.0) as f32;
        sampling.top_p = json.get("top_p").and_then(Value::as_f64).unwrap_or(1.0) as f32;
        sampling.top_k = json.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize;
        sampling.min_p = json.get("min_p").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    }
    sampling.repetition_penalty = json.get("repetition_penalty").and_then(Value::as_f64).unwrap_or(1.0) as f32;
    sampling.validate().map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(GenerationDefaults { eos_token_ids: token_ids(json.get("eos_token_id")), sampling })
}

impl LoadedModel {
    /// Opens everything in `dir`. The tokenizer is optional here (id-level commands work
    /// without it); [`LoadedModel::tokenizer`] reports its absence when text is needed.
    pub fn open(dir: &Path, device: &Device) -> Result<Self> {
        let (json, model_type) = read_config(dir)?;
        let cfg_path = dir.join("config.json");
        let model: Box<dyn CausalLm> = match model_type.as_str() {
            GlmMoeDsaConfig::MODEL_TYPE => {
                let cfg = GlmMoeDsaConfig::from_json(&json).map_err(|e| anyhow!("{}: {e}", cfg_path.display()))?;
                let store = strata_storage::WeightStore::open_dir(dir)?;
                Box::new(GlmMoeDsa::load(cfg, &store, device)?)
            }
            other => unreachable!("read_config refused `{other}`"),
        };
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() { Some(TextTokenizer::from_file(&tok_path)?) } else { None };
        let chat_template = ChatTemplate::from_model_dir(dir)?;
        let generation = read_generation_defaults(dir)?;
        let mut eos_token_ids = model.eos_token_ids();
        for id in &generation.eos_token_ids {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        for &id in &eos_token_ids {
            if id as usize >= model.vocab_size() {
                bail!("{}: eos_token_id {id} is outside the vocabulary ({})", dir.display(), model.vocab_size());
            }
        }
        Ok(Self { dir: dir.to_path_buf(), model_type, model, tokenizer, chat_template, generation, eos_token_ids })
    }

    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| anyhow!("{}: tokenizer not found", self.dir.join("tokenizer.json").display()))
    }

    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat_template.as_ref().ok_or_else(|| {
            anyhow!(
                "{}: no chat template (chat_template.jinja or `chat_template` in tokenizer_config.json)",
                self.dir.display()
            )
        })
    }
}

/// The directory's name, for display.
pub fn display_name(dir: &Path) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string())
}

/// Context for errors that concern a model directory as a whole.
pub trait DirContext<T> {
    fn in_dir(self, dir: &Path) -> Result<T>;
}

impl<T> DirContext<T> for Result<T> {
    fn in_dir(self, dir: &Path) -> Result<T> {
        self.with_context(|| format!("model directory {}", dir.display()))
    }
}

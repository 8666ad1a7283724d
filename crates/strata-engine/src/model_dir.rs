//! A Hugging Face model directory opened as a whole: config dispatch by `model_type`,
//! weights, tokenizer, chat template and generation defaults.

use crate::chat::ChatTemplate;
use crate::experts::{open_source, RuntimeOptions, StreamedExperts, UsageSetting};
use crate::fit::{fit_dir, Fit, FitOptions};
use crate::sampling::SamplingParams;
use crate::tokenizer::TextTokenizer;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use strata_models::glm_moe_dsa::{GlmMoeDsa, GlmMoeDsaConfig};
use strata_models::CausalLm;
use strata_residency::UsageLedger;
use strata_storage::WeightStore;

/// How to load: the memory budget and the expert runtime's options.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Process memory budget; experts stream when the container's experts exceed it.
    pub budget: Option<u64>,
    /// Context reserved for the KV cache in the plan.
    pub context: usize,
    pub runtime: RuntimeOptions,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { budget: None, context: 4096, runtime: RuntimeOptions::default() }
    }
}

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
    /// The expert runtime, for expert-container directories.
    pub experts: Option<Arc<StreamedExperts>>,
    /// The memory plan (expert containers).
    pub fit: Option<Fit>,
    /// Where the expert container is (the model dir, or its `.strata/` conversion).
    pub experts_dir: Option<PathBuf>,
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
        Self::open_with(dir, device, &LoadOptions::default())
    }

    /// Opens `dir` under `opts`. An expert container (see `strata convert`) streams its
    /// experts through a slab sized by the budget (all resident without one); an HF
    /// checkpoint loads whole and refuses a budget.
    pub fn open_with(dir: &Path, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let (json, model_type) = read_config(dir)?;
        let cfg_path = dir.join("config.json");
        let mut experts = None;
        let mut fit = None;
        let mut experts_dir = None;
        let model: Box<dyn CausalLm> = match model_type.as_str() {
            GlmMoeDsaConfig::MODEL_TYPE => {
                let cfg = GlmMoeDsaConfig::from_json(&json).map_err(|e| anyhow!("{}: {e}", cfg_path.display()))?;
                let weights_dir = match (opts.budget, open_source(dir)?.is_some()) {
                    (Some(_), false) => crate::autoconvert::container_for(dir)?,
                    _ => dir.to_path_buf(),
                };
                let store = WeightStore::open_dir(&weights_dir)?;
                match open_source(&weights_dir)? {
                    Some(source) => {
                        let (backend, f) = open_experts(&weights_dir, source, &cfg, &store, opts)?;
                        fit = Some(f);
                        let model = GlmMoeDsa::load_with_experts(cfg, &store, device, Some(backend.clone()))?;
                        experts = Some(backend);
                        experts_dir = Some(weights_dir.clone());
                        Box::new(model)
                    }
                    None => Box::new(GlmMoeDsa::load(cfg, &store, device)?),
                }
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
        Ok(Self {
            dir: dir.to_path_buf(),
            model_type,
            model,
            tokenizer,
            chat_template,
            generation,
            eos_token_ids,
            experts,
            fit,
            experts_dir,
        })
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

/// Plans the slab, opens the usage ledger, chooses pins and starts the expert runtime.
fn open_experts(
    dir: &Path,
    source: Box<dyn crate::experts::ExpertSource>,
    cfg: &GlmMoeDsaConfig,
    store: &WeightStore,
    opts: &LoadOptions,
) -> Result<(Arc<StreamedExperts>, Fit)> {
    let rt = &opts.runtime;
    let layers = source.layers().to_vec();
    for &(l, e) in &rt.pins {
        if !layers.contains(&l) || e >= source.experts_per_layer() {
            bail!(
                "--pin {l}:{e}: no such routed expert (sparse layers {layers:?}, {} experts each)",
                source.experts_per_layer()
            );
        }
    }
    let ledger = match &rt.usage {
        UsageSetting::Off => None,
        setting => {
            let (path, explicit) = match setting {
                UsageSetting::Path(p) => (p.clone(), true),
                _ => (dir.join(".coli_usage"), false),
            };
            // Rows 0..=num_hidden_layers: the last is the MTP layer, kept so its counts
            // survive our flushes even while strata does not run MTP.
            let mut rows = layers.clone();
            if cfg.num_nextn_predict_layers > 0 {
                rows.push(cfg.num_hidden_layers);
            }
            let (ledger, warnings) =
                UsageLedger::open(&path, cfg.num_hidden_layers, cfg.n_routed_experts, &rows, explicit)
                    .map_err(|e| anyhow!("{e}"))?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Some(ledger)
        }
    };
    let mut fit_opts = FitOptions {
        budget: opts.budget,
        context: opts.context,
        working_slots: rt.working_slots,
        pinned: rt.pins.len(),
        max_slots_per_layer: rt.max_slots_per_layer,
    };
    let mut pins = rt.pins.clone();
    if rt.auto_pin && pins.is_empty() {
        if let (Some(ledger), Some(budget)) = (&ledger, opts.budget) {
            pins = auto_pins(dir, cfg, store, &fit_opts, ledger, budget, &layers)?;
            fit_opts.pinned = pins.len();
        }
    }
    let fit = fit_dir(dir, cfg, store, &fit_opts)?;
    let Some(plan) = fit.plan else {
        bail!("{}: {} (see `strata fit`)", dir.display(), fit.error.clone().unwrap_or_default());
    };
    let resident_all = opts.budget.is_none();
    let backend = StreamedExperts::new(cfg.hidden_size, source, plan, &pins, ledger, rt, opts.budget)?;
    if resident_all {
        backend.preload_all()?;
    }
    Ok((Arc::new(backend), fit))
}

/// Auto-pin: the most used experts the budget left after the working bank and one slot
/// per layer affords (none until the ledger has enough history).
fn auto_pins(
    dir: &Path,
    cfg: &GlmMoeDsaConfig,
    store: &WeightStore,
    fit_opts: &FitOptions,
    ledger: &UsageLedger,
    budget: u64,
    layers: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let probe = fit_dir(dir, cfg, store, fit_opts)?;
    let Some(p) = probe.plan else { return Ok(Vec::new()) };
    let tier_budget = budget.saturating_sub(p.input.fixed_bytes + p.input.working_slots as u64 * p.input.slot_bytes);
    let mandatory = layers.len() as u64 * p.input.slot_bytes;
    let plan = strata_residency::plan_auto_pins(ledger, tier_budget, mandatory, layers, |_| p.input.slot_bytes);
    if let Some(why) = &plan.skipped {
        eprintln!("auto-pin: no pins ({why})");
    }
    Ok(plan.keys())
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

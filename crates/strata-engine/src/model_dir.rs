//! A Hugging Face model directory opened as a whole: the family (through the registry),
//! weights, tokenizer, chat template and generation defaults; with a budget, the expert
//! runtime and its memory plan.

use crate::chat::ChatTemplate;
use crate::experts::{is_container, open_source, ExpertSource, RuntimeOptions, StreamedExperts, UsageSetting};
use crate::fit::{fit_dir, Fit, FitOptions};
use crate::sampling::SamplingParams;
use crate::tokenizer::TextTokenizer;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use strata_models::{read_arch, Arch, Device, ExpertsChoice, LoadSpec, Model};
use strata_residency::{LedgerOpen, UsageLedger};
use strata_storage::WeightStore;

/// How to load: the device, the memory budget and the expert runtime's options.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub device: Device,
    /// Process memory budget; experts stream when the container's experts exceed it. On
    /// CUDA: the host tier of expert slots (page-locked), the rest of the model being
    /// in GPU memory.
    pub budget: Option<u64>,
    /// CUDA: GPU memory for the model, its KV cache and a slab of expert slots fed from
    /// the host tier (`--gpu-budget`); None with streamed experts: a slot for every one.
    pub gpu_budget: Option<u64>,
    /// Context reserved for the KV cache in the plan (and the sessions' capacity).
    pub context: usize,
    pub runtime: RuntimeOptions,
    /// Load the draft (MTP) layer where the checkpoint has one (speculative decoding).
    pub mtp: bool,
    /// Fail to open a model without a draft layer strata runs (`--mtp on`, as opposed to
    /// the default of using one where present).
    pub require_mtp: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            budget: None,
            gpu_budget: None,
            context: 4096,
            runtime: RuntimeOptions::default(),
            mtp: true,
            require_mtp: false,
        }
    }
}

/// Sampling defaults and stop ids from `generation_config.json`.
#[derive(Clone, Debug, Default)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
}

pub struct LoadedModel {
    pub dir: PathBuf,
    pub model_type: String,
    pub arch: Arc<dyn Arch>,
    pub model: Box<dyn Model>,
    /// The context sessions are made for (`--context`, capped by the model's).
    pub context: usize,
    /// Rows a prompt's forward takes at most: the backend's chunk, or more where one image
    /// must fit a forward ([`crate::media::image_rows`]).
    pub prefill_rows: usize,
    /// The most soft tokens one image becomes (0 without a vision tower).
    pub image_rows: usize,
    pub tokenizer: Option<TextTokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    /// The union of config.json's and generation_config.json's EOS ids.
    pub eos_token_ids: Vec<u32>,
    /// The expert runtime, for expert-container directories.
    pub experts: Option<Arc<StreamedExperts>>,
    /// Whether the draft (MTP) layer is loaded (speculative decoding can run).
    pub draft: bool,
    /// The draft (MTP) layer's expert runtime (its own int8 tier), when one is loaded.
    pub draft_experts: Option<Arc<StreamedExperts>>,
    /// On CUDA with streamed experts: the GPU tier in front of `experts` (and of
    /// `draft_experts`, second), and its memory plan.
    #[cfg(feature = "cuda")]
    pub gpu_tiers: Vec<Arc<crate::experts::gpu::GpuExperts>>,
    pub gpu_fit: Option<Fit>,
    /// The memory plan (expert containers).
    pub fit: Option<Fit>,
    /// Where the expert container is (the model dir, or its `.strata/` conversion).
    pub experts_dir: Option<PathBuf>,
}

/// Reads `config.json` and returns it with its `model_type`, refusing unknown types.
pub fn read_config(dir: &Path) -> Result<(Value, String)> {
    let arch = read_arch(dir)?;
    let path = dir.join("config.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    Ok((json, arch.model_type().to_string()))
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
    /// Opens everything in `dir` on the CPU, all weights resident.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with(dir, &LoadOptions::default())
    }

    /// Opens `dir` under `opts`. An expert container (see `strata convert`), or an HF
    /// checkpoint given a budget (converted once, losslessly), streams its experts through
    /// a slab sized by the budget; without a budget everything is resident.
    pub fn open_with(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let arch = read_arch(dir)?;
        opts.device.check()?;
        let on_gpu = matches!(opts.device, Device::Cuda(_));
        if opts.gpu_budget.is_some() && !on_gpu {
            bail!(
                "--gpu-budget sizes the GPU's expert tier; it needs --device cuda (on the CPU, --budget is the budget)"
            );
        }
        let moe = arch.moe();
        if opts.gpu_budget.is_some() && moe.is_none() {
            bail!("--gpu-budget: {} has no routed experts to stream (the whole model is resident)", dir.display());
        }
        if opts.budget.is_none() && (!opts.runtime.pins.is_empty() || opts.runtime.auto_pin) {
            bail!("--pin and --auto-pin choose experts to keep in the slab; they need --budget (without one every expert is resident)");
        }
        // Experts stream through a container when a budget asks for it (either on CUDA).
        let streams = opts.budget.is_some() || opts.gpu_budget.is_some();
        let weights_dir = match (streams, &moe) {
            (true, Some(_)) if !is_container(dir) => crate::autoconvert::container_for(dir, arch.as_ref())?,
            _ => dir.to_path_buf(),
        };
        let store = WeightStore::open_dir(&weights_dir)?;
        if opts.require_mtp && !arch.has_draft(&store) {
            bail!(
                "--mtp on: {} has no draft (MTP) layer that strata runs for {} (use --mtp auto or off)",
                dir.display(),
                arch.model_type()
            );
        }
        let image_rows = crate::media::image_rows(dir, arch.as_ref())?;
        let draft = draft_decision(&weights_dir, arch.as_ref(), &store, opts, image_rows)?;
        if let Some(note) = draft.note() {
            eprintln!("strata: {note}");
        }
        let draft = draft.load;
        let mut experts = None;
        let mut draft_experts = None;
        let mut fit = None;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut gpu_fit = None;
        #[cfg(feature = "cuda")]
        let mut gpu_tiers = Vec::new();
        let mut experts_dir = None;
        let model = match open_source(&weights_dir, moe.as_ref())? {
            Some(source) => {
                let (backend, f) = open_experts(dir, &weights_dir, source, arch.as_ref(), &store, opts, image_rows)?;
                let headroom = f.plan.as_ref().map_or(0, |p| p.headroom_bytes);
                fit = Some(f);
                experts_dir = Some(weights_dir.clone());
                // The draft layer's experts: the container's int8 MTP tier, streamed
                // through its own small slab.
                draft_experts = match draft {
                    true => crate::experts::draft_experts(&weights_dir, arch.as_ref(), opts, &backend, headroom)?,
                    false => None,
                };
                let spec = match on_gpu {
                    false => LoadSpec {
                        device: opts.device,
                        experts: ExpertsChoice::Cpu(backend.clone()),
                        draft: draft_experts.clone().map(|d| ExpertsChoice::Cpu(d as _)),
                    },
                    #[cfg(feature = "cuda")]
                    true => {
                        let (spec, f, tiers) = gpu_spec(
                            &weights_dir,
                            arch.as_ref(),
                            &store,
                            opts,
                            &backend,
                            draft_experts.as_ref(),
                            image_rows,
                        )?;
                        gpu_fit = Some(f);
                        gpu_tiers = tiers;
                        spec
                    }
                    #[cfg(not(feature = "cuda"))]
                    true => unreachable!("Device::check refuses CUDA in a build without it"),
                };
                let model = arch.load(&store, spec)?;
                experts = Some(backend);
                model
            }
            None => {
                if let Some(budget) = opts.budget {
                    let f = fit_dir(dir, arch.as_ref(), &store, &fit_options(opts, Some(budget), image_rows))?;
                    if !f.report.fits {
                        bail!("{}: {} (see `strata fit`)", dir.display(), f.error.clone().unwrap_or_default());
                    }
                    fit = Some(f);
                }
                let draft_choice = draft.then_some(ExpertsChoice::Resident);
                arch.load(
                    &store,
                    LoadSpec { device: opts.device, experts: ExpertsChoice::Resident, draft: draft_choice },
                )?
            }
        };
        let tokenizer = TextTokenizer::from_model_dir(dir)?;
        let chat_template = ChatTemplate::from_model_dir(dir)?;
        let generation = read_generation_defaults(dir)?;
        let info = model.info().clone();
        let mut eos_token_ids = info.eos_token_ids.clone();
        for id in &generation.eos_token_ids {
            if !eos_token_ids.contains(id) {
                eos_token_ids.push(*id);
            }
        }
        for &id in &eos_token_ids {
            if id as usize >= info.vocab_size {
                bail!("{}: eos_token_id {id} is outside the vocabulary ({})", dir.display(), info.vocab_size);
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            model_type: arch.model_type().to_string(),
            context: opts.context.min(info.max_context).max(1),
            prefill_rows: model.prefill_chunk().max(image_rows),
            image_rows,
            arch,
            model,
            tokenizer,
            chat_template,
            generation,
            eos_token_ids,
            experts,
            draft,
            draft_experts,
            #[cfg(feature = "cuda")]
            gpu_tiers,
            gpu_fit,
            fit,
            experts_dir,
        })
    }

    /// A generator over a fresh session of this model's context.
    pub fn scorer(&self) -> Result<crate::Scorer<'_>> {
        crate::Scorer::with_rows(self.model.as_ref(), self.context, self.prefill_rows)
    }

    /// The serving engine's options for one request at a time (the CLI's generation):
    /// this model's context, prompts in forwards of [`LoadedModel::prefill_rows`], a
    /// prompt cache over the whole KV pool (a chat's next turn reuses the last), and
    /// `draft_tokens` drafts a step where the draft layer is loaded (default
    /// [`crate::generate::DEFAULT_DRAFT_TOKENS`]; refused without one).
    pub fn engine_options(&self, draft_tokens: Option<usize>) -> Result<crate::serving::EngineOptions> {
        let draft_tokens = match draft_tokens {
            Some(n) if n > 0 && !self.draft => {
                bail!("{n} draft tokens: the model's draft (MTP) layer is not loaded (--mtp off, or no MTP layer)")
            }
            Some(n) => n,
            None if self.draft => crate::generate::DEFAULT_DRAFT_TOKENS,
            None => 0,
        };
        Ok(crate::serving::EngineOptions {
            max_batch: 1,
            kv_tokens: self.context,
            context: self.context,
            step_tokens: self.prefill_rows.max(1 + draft_tokens),
            prompt_cache_bytes: u64::MAX,
            kv_bytes_per_token: self.arch.kv_bytes_per_token(),
            draft_tokens,
        })
    }

    /// The serving engine for one request at a time ([`LoadedModel::engine_options`]):
    /// `strata generate` and `chat` decode through it as the server does.
    pub fn engine(&self, draft_tokens: Option<usize>) -> Result<crate::serving::BatchEngine<'_>> {
        crate::serving::BatchEngine::new(
            self.model.as_ref(),
            self.tokenizer.as_ref(),
            self.engine_options(draft_tokens)?,
        )
    }

    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| anyhow!("{}: tokenizer not found (tokenizer.json or tiktoken.model)", self.dir.display()))
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

/// The plan's options for a model loaded under `opts` with `budget`, whose images need
/// `image_rows` rows a forward.
pub fn fit_options(opts: &LoadOptions, budget: Option<u64>, image_rows: usize) -> FitOptions {
    let mut f = FitOptions::new(budget, opts.context, &opts.runtime);
    f.image_rows = image_rows;
    f
}

/// Whether the draft (MTP) layer of the model in `dir` (its weights, as loaded) is loaded
/// under `opts` ([`crate::fit::draft_loaded`]): the plan that decides is the GPU's on
/// CUDA, the host's otherwise, as `strata fit` makes them.
pub fn draft_decision(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    opts: &LoadOptions,
    image_rows: usize,
) -> Result<crate::fit::DraftDecision> {
    let on_gpu = matches!(opts.device, Device::Cuda(_));
    let budgeted = if on_gpu { opts.gpu_budget.is_some() } else { opts.budget.is_some() };
    let has_draft = arch.has_draft(store);
    crate::fit::draft_loaded(opts.mtp, opts.require_mtp, has_draft, budgeted && arch.moe().is_some(), |draft| {
        let mut f = fit_options(opts, opts.budget, image_rows);
        f.draft = draft;
        match on_gpu {
            true => crate::fit::fit_gpu(dir, arch, store, &f, opts.gpu_budget),
            false => fit_dir(dir, arch, store, &f),
        }
    })
}

/// Plans the slab, opens the usage ledger (at `<model dir>/.coli_usage`, whatever
/// container serves the experts), chooses pins and starts the expert runtime.
fn open_experts(
    model_dir: &Path,
    dir: &Path,
    source: Box<dyn ExpertSource>,
    arch: &dyn Arch,
    store: &WeightStore,
    opts: &LoadOptions,
    image_rows: usize,
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
    let info = arch.info();
    let ledger = match &rt.usage {
        UsageSetting::Off => None,
        setting => {
            let (path, explicit) = match setting {
                UsageSetting::Path(p) => (p.clone(), true),
                _ => (model_dir.join(".coli_usage"), false),
            };
            // Rows 0..=num_layers: the last is the MTP layer, kept so its counts survive
            // our flushes.
            let mut rows = layers.clone();
            let moe = arch.moe().expect("an expert source implies routed experts");
            rows.extend(moe.mtp_layers.iter().take(1));
            // The family names the engine that wrote the counts.
            let how = LedgerOpen { explicit, allow_foreign: rt.usage_import };
            let (ledger, warnings) = UsageLedger::open_with(
                arch.family().name,
                &path,
                info.num_layers,
                source.experts_per_layer(),
                &rows,
                how,
            )
            .map_err(|e| anyhow!("{e}"))?;
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Some(ledger)
        }
    };
    if let Some(r) = rt.skip_misses_from_rank {
        let top_k = arch.moe().map_or(0, |m| m.top_k);
        if !(2..=top_k).contains(&r) {
            bail!("--skip-misses-from-rank {r}: this model routes {top_k} experts a token; give 2 to {top_k}");
        }
    }
    let on_gpu = matches!(opts.device, Device::Cuda(_));
    let mut fit_opts = fit_options(opts, opts.budget, image_rows);
    fit_opts.draft = draft_decision(dir, arch, store, opts, image_rows)?.load;
    fit_opts.host_tier_only = on_gpu;
    let mut pins = rt.pins.clone();
    if rt.auto_pin && pins.is_empty() {
        if let (Some(ledger), Some(budget)) = (&ledger, opts.budget) {
            pins = auto_pins(dir, arch, store, &fit_opts, ledger, budget, &layers)?;
            fit_opts.pinned = pins.len();
        }
    }
    let fit = fit_dir(dir, arch, store, &fit_opts)?;
    let Some(plan) = fit.plan else {
        bail!("{}: {} (see `strata fit`)", dir.display(), fit.error.clone().unwrap_or_default());
    };
    let resident_all = opts.budget.is_none();
    let ledger = ledger.map(|l| Arc::new(std::sync::Mutex::new(l)));
    // On CUDA the plan counts the CUDA runtime's host memory and the weights in transit
    // beside the page-locked tier (host_tier_items); page-locked slots cannot be given
    // back, so there is no footprint correction against the RSS.
    let pressure_budget = if on_gpu { None } else { opts.budget };
    let backend = StreamedExperts::new(source, plan, &pins, ledger, rt, pressure_budget)?;
    if resident_all {
        backend.preload_all()?;
    }
    Ok((Arc::new(backend), fit))
}

/// The load spec of a model on CUDA whose experts stream: a GPU tier (planned by
/// [`crate::fit::fit_gpu`] in `--gpu-budget`) in front of the host tier `host`, and one
/// with the draft tier's slots in front of `draft`.
#[cfg(feature = "cuda")]
fn gpu_spec(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    opts: &LoadOptions,
    host: &Arc<StreamedExperts>,
    draft: Option<&Arc<StreamedExperts>>,
    image_rows: usize,
) -> Result<(LoadSpec, Fit, Vec<Arc<crate::experts::gpu::GpuExperts>>)> {
    use crate::experts::gpu::GpuExperts;
    let mut fit_opts = fit_options(opts, opts.gpu_budget, image_rows);
    fit_opts.draft = draft.is_some();
    let f = crate::fit::fit_gpu(dir, arch, store, &fit_opts, opts.gpu_budget)?;
    let Some(plan) = f.plan else {
        bail!(
            "{}: --gpu-budget: {} (see `strata fit --device cuda`)",
            dir.display(),
            f.error.clone().unwrap_or_default()
        );
    };
    let main = GpuExperts::new(host.clone(), plan, opts.gpu_budget.is_none())?.attach();
    let mut tiers = vec![main.clone()];
    let draft_choice = match draft {
        Some(d) => {
            // The draft tier's slab is small (counted among the GPU plan's items): the
            // same slots on the GPU as on the host.
            let t = GpuExperts::new(d.clone(), *d.plan(), false)?.attach();
            tiers.push(t.clone());
            Some(ExpertsChoice::Cuda(t as _))
        }
        None => None,
    };
    let spec = LoadSpec { device: opts.device, experts: ExpertsChoice::Cuda(main as _), draft: draft_choice };
    Ok((spec, f, tiers))
}

/// Auto-pin: the most used experts the budget left after the working bank and one slot
/// per layer affords (none until the ledger has enough history).
fn auto_pins(
    dir: &Path,
    arch: &dyn Arch,
    store: &WeightStore,
    fit_opts: &FitOptions,
    ledger: &UsageLedger,
    budget: u64,
    layers: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let probe = fit_dir(dir, arch, store, fit_opts)?;
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

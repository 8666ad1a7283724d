//! convert, fit, replay: the expert-container and residency commands.

use anyhow::{anyhow, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use strata_kernels::{QuantKind, ScaleType};
use strata_models::convert::{convert as convert_model, ConvertOptions};
use strata_residency::EvictionScope;

#[derive(Args)]
pub struct ConvertArgs {
    /// Source model directory (HF layout).
    #[arg(long)]
    model: PathBuf,
    /// Output directory (a model directory with an expert container).
    #[arg(long)]
    out: PathBuf,
    /// Routed-expert encoding: int4, int8, bf16, f32 or mxfp4 (OCP MXFP4: FP4 values, a
    /// power-of-two scale a 32 inputs; CPU only).
    #[arg(long, default_value = "int4")]
    experts: String,
    /// int4 scale group (inputs per scale; even, >= 2).
    #[arg(long, default_value_t = 64)]
    group: usize,
    /// How int4 scales are stored: e4m3 (the default: one byte a scale and a power of two
    /// a matrix, each scale searched for the least error; at g64 the size of g128-bf16 and
    /// closer to the source than g64 with f32 scales), bf16 (two bytes; the default where
    /// the source's experts are int4 at this group already, as the public container's:
    /// their nibbles are kept, and e4m3 would round each of their scales by up to 3%) or
    /// f32 (the public container's format). Applies to every int4 encoding given by
    /// `--experts int4` / `--mtp-experts int4`; given explicitly, it needs one of them.
    #[arg(long, value_parser = ScaleType::parse)]
    scales: Option<ScaleType>,
    /// MTP-layer expert encoding (int8: int4 drafts are known to be rejected).
    #[arg(long, default_value = "int8")]
    mtp_experts: String,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    quality: crate::quality::ReportArgs,
}

/// `--skip-misses-from-rank` (generate and replay alike): a token's first expert is never
/// left out. (Its upper bound, the model's top-k, is checked where the model is opened.)
fn check_skip_rank(rank: Option<usize>) -> Result<()> {
    match rank {
        Some(r) if r < 2 => {
            Err(anyhow!("--skip-misses-from-rank must be at least 2: a token's first expert is always read"))
        }
        _ => Ok(()),
    }
}

fn encoding(flag: &str, name: &str, group: usize, scales: ScaleType) -> Result<QuantKind> {
    match name {
        "int4" => {
            if group < 2 || !group.is_multiple_of(2) {
                return Err(anyhow!("--group must be an even number >= 2, got {group}"));
            }
            Ok(QuantKind::Int4Group { group, scales })
        }
        other => QuantKind::parse(other).map_err(|e| anyhow!("{flag}: {e}")),
    }
}

/// `--scales` when not given: e4m3, but bf16 where the source's experts are int4 at the
/// asked group already (their nibbles are kept, and bf16 rounds their scales by at most
/// 2^-8 where e4m3 would by up to 2^-4).
fn default_scales(a: &ConvertArgs) -> Result<ScaleType> {
    let int4 = a.experts == "int4" || a.mtp_experts == "int4";
    match strata_models::convert::stored_expert_kind(&a.model)? {
        Some(QuantKind::Int4Group { group, .. }) if int4 && group == a.group => {
            eprintln!(
                "note: the source's experts are int4-g{group} already: their nibbles are kept with bf16 scales \
                 (--scales e4m3 makes them 3% smaller, rounding each scale by up to 3%)"
            );
            Ok(ScaleType::Bf16)
        }
        Some(QuantKind::Mxfp4) if a.experts != "mxfp4" => {
            eprintln!("note: the source's experts are MXFP4: --experts mxfp4 keeps them as they are");
            Ok(ScaleType::E4m3)
        }
        _ => Ok(ScaleType::E4m3),
    }
}

pub fn convert(a: ConvertArgs) -> Result<()> {
    if let Some(given) = a.scales {
        if a.experts != "int4" && a.mtp_experts != "int4" {
            return Err(anyhow!(
                "--scales {} applies to int4 experts, but --experts is {} and --mtp-experts {}",
                given.name(),
                a.experts,
                a.mtp_experts
            ));
        }
    }
    let scales = match a.scales {
        Some(s) => s,
        None => default_scales(&a)?,
    };
    let experts = encoding("--experts", &a.experts, a.group, scales)?;
    let mtp_experts = encoding("--mtp-experts", &a.mtp_experts, a.group, scales)?;
    a.quality.check()?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} experts, {elapsed} (eta {eta})")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message("converting");
    let report = convert_model(&a.model, &a.out, &ConvertOptions { experts, mtp_experts }, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    a.quality.write(&a.model, &a.out, &experts.name(), &report)?;
    if a.json {
        crate::commands::emit(&serde_json::to_string_pretty(&report)?)
    } else {
        println!(
            "{}: {} resident tensors ({}), {} main + {} MTP experts ({} each slot, {} in all), {:.1} s",
            a.out.display(),
            report.resident_tensors,
            crate::commands::human_bytes(report.resident_bytes),
            report.main_experts,
            report.mtp_experts,
            crate::commands::human_bytes(report.slot_bytes as u64),
            crate::commands::human_bytes(report.expert_bytes),
            report.seconds
        );
        Ok(())
    }
}

/// Where a model runs: shared by every command that runs one.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Compute device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU compute threads (default: the CPUs this process may run on, which honours
    /// `taskset`).
    #[arg(long)]
    threads: Option<usize>,
    /// CUDA: replay each decode step's kernels as one CUDA graph (on, the default) or
    /// launch every kernel on its own (off: the same results, more time per token).
    #[arg(long)]
    cuda_graphs: Option<String>,
}

impl DeviceArgs {
    /// The device named, not checked against this machine (plans are made from headers).
    pub fn named(&self) -> Result<strata_engine::Device> {
        strata_engine::Device::parse(&self.device)
    }

    /// The device, after sizing the CPU thread pool.
    pub fn device(&self) -> Result<strata_engine::Device> {
        if let Some(n) = self.threads {
            strata_kernels::pool::set_global_threads(n).map_err(|e| anyhow!("--threads: {e}"))?;
        }
        let d = strata_engine::Device::parse(&self.device)?;
        let graphs = match self.cuda_graphs.as_deref() {
            None => None,
            Some("on") => Some(true),
            Some("off") => Some(false),
            Some(other) => return Err(anyhow!("--cuda-graphs `{other}`: expected on or off")),
        };
        if graphs.is_some() && d == strata_engine::Device::Cpu {
            return Err(anyhow!("--cuda-graphs applies to --device cuda, not the CPU"));
        }
        d.check()?;
        #[cfg(feature = "cuda")]
        if let Some(on) = graphs {
            strata_backend::cuda::set_graphs_default(on);
        }
        Ok(d)
    }
}

/// Memory budget and expert-runtime options shared by generate, chat and serve.
#[derive(Args, Clone, Debug)]
pub struct BudgetArgs {
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Process memory budget (512MiB, 2GiB, 1.5GB or bytes); an HF checkpoint is
    /// converted to an expert container once. Without it everything is resident. On
    /// CUDA: the host tier of expert slots (page-locked), the model being on the GPU.
    #[arg(long)]
    budget: Option<String>,
    /// CUDA: GPU memory for the model, its KV cache and a slab of expert slots fed from
    /// the host tier (the rest of the experts stream through it). Without it, streamed
    /// experts each get a GPU slot.
    #[arg(long)]
    gpu_budget: Option<String>,
    /// Context (positions) to reserve KV cache for; prompts longer than it fail unless
    /// `--truncate left`.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Working slots (the miss bank; a forward's wave holds at most this many misses).
    #[arg(long, default_value_t = 64)]
    working_slots: usize,
    /// Pin experts: LAYER:EXPERT,... (overrides --auto-pin).
    #[arg(long, value_delimiter = ',')]
    pin: Vec<String>,
    /// Pin the most used experts from the usage ledger at start.
    #[arg(long)]
    auto_pin: bool,
    /// At turn boundaries, swap hot unpinned experts for cold pins (at most 4 a turn).
    #[arg(long)]
    live_repin: bool,
    /// Usage ledger: a path, or `off` (default: <model>/.coli_usage).
    #[arg(long)]
    usage: Option<String>,
    /// Use a usage ledger another engine wrote (its counts are kept and rewritten under
    /// strata's id) instead of refusing it.
    #[arg(long)]
    usage_import: bool,
    /// Use the page cache for expert reads instead of O_DIRECT.
    #[arg(long)]
    page_cache: bool,
    /// I/O worker threads.
    #[arg(long, default_value_t = 2)]
    io_workers: usize,
    /// Next-layer expert prediction: off, measure (score it), two-step (score the
    /// predictor that first adds the layer's shared expert), hint (also send advisory
    /// WILLNEED hints; useful with --page-cache), or prefetch (also read predicted experts
    /// into free working slots while the current layer computes).
    #[arg(long, default_value = "off")]
    pilot: String,
    /// With --pilot hint or prefetch: act on only the first N ranks of each row's
    /// prediction (the router's surest choices; default: all top-k). Fewer reads wasted
    /// on mispredictions where the disk is the bottleneck.
    #[arg(long, value_name = "N")]
    pilot_ranks: Option<usize>,
    /// Which expert a layer evicts: lfru (default; the coldest: uses decayed by half every
    /// 32 forwards, ties by recency), lfru:HALF_LIFE (forwards) or lru (used longest ago).
    /// Under a GPU tier it applies there; the host tier, holding what the GPU evicts, is LRU.
    #[arg(long, value_name = "POLICY")]
    eviction: Option<String>,
    /// Where an incoming expert finds its slot: layer (default; its own layer's share of
    /// the plan) or global (the coldest slot of any layer, so layers that reuse more hold
    /// more; a layer keeps at least 3/4 of its share). Both tiers follow it.
    #[arg(long, value_name = "SCOPE")]
    eviction_scope: Option<String>,
    /// Approximate decode (changes the output): in a one-row forward, routed experts of
    /// rank R or lower (1-based, R >= 2) that would have to be read from disk are left out
    /// of the token's mix (weight 0) instead of read. For a disk too slow for the model;
    /// `--stats` counts them (skipped).
    #[arg(long, value_name = "R")]
    skip_misses_from_rank: Option<usize>,
    /// Warm start without ledger history: pin the experts an Expert Atlas (`strata atlas
    /// build`) expects the topic mix to use most, as much as auto-pin would (half the
    /// resident tier).
    #[arg(long, conflicts_with_all = ["pin", "auto_pin"])]
    pin_from_atlas: Option<PathBuf>,
    /// The expected mix for --pin-from-atlas: atlas topics, comma-separated (default: all).
    #[arg(long, value_delimiter = ',', requires = "pin_from_atlas")]
    topics: Vec<String>,
    /// Speculative decoding with the checkpoint's MTP (draft) layer: auto (use it where the
    /// checkpoint has one), on (fail without one) or off (not loaded).
    #[arg(long, default_value = "auto")]
    mtp: String,
}

impl BudgetArgs {
    pub fn page_cache(&self) -> bool {
        self.page_cache
    }

    /// `load_options`, plus the pins --pin-from-atlas chooses for the model in `dir`.
    pub fn load_options_for(&self, dir: &std::path::Path) -> Result<strata_engine::LoadOptions> {
        let Some(path) = &self.pin_from_atlas else { return self.load_options() };
        let mut opts = self.load_options_unpinned()?;
        let atlas = strata_engine::atlas::read_atlas(path)?;
        let plan = strata_engine::atlas::atlas_pins(dir, &opts, &atlas, &self.topics)?;
        eprintln!(
            "pin-from-atlas: {} pins ({}) for {} ({:.1}% of the mix's selections)",
            plan.pins.len(),
            crate::commands::human_bytes(plan.planned_bytes),
            plan.topics.join(", "),
            plan.covered_share * 100.0
        );
        opts.runtime.pins = plan.keys();
        Ok(opts)
    }

    pub fn load_options(&self) -> Result<strata_engine::LoadOptions> {
        if self.pin_from_atlas.is_some() {
            return Err(anyhow!("--pin-from-atlas is not supported by this command"));
        }
        self.load_options_unpinned()
    }

    fn load_options_unpinned(&self) -> Result<strata_engine::LoadOptions> {
        use strata_engine::experts::{PilotMode, RuntimeOptions, UsageSetting};
        let budget = match &self.budget {
            Some(b) => Some(strata_residency::parse_size(b).map_err(|e| anyhow!("--budget: {e}"))?),
            None => None,
        };
        let gpu_budget = match &self.gpu_budget {
            Some(b) => Some(strata_residency::parse_size(b).map_err(|e| anyhow!("--gpu-budget: {e}"))?),
            None => None,
        };
        let pins = self
            .pin
            .iter()
            .map(|p| {
                let (l, e) = p.split_once(':').ok_or_else(|| anyhow!("--pin `{p}`: expected LAYER:EXPERT"))?;
                Ok((
                    l.trim().parse().map_err(|_| anyhow!("--pin `{p}`: `{l}` is not a layer number"))?,
                    e.trim().parse().map_err(|_| anyhow!("--pin `{p}`: `{e}` is not an expert number"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        if budget.is_none() {
            let flags: Vec<&str> = [
                (!self.pin.is_empty(), "--pin"),
                (self.auto_pin, "--auto-pin"),
                (self.live_repin, "--live-repin"),
                // (A GPU slab of its own evicts too.)
                (self.eviction.is_some() && gpu_budget.is_none(), "--eviction"),
                (self.eviction_scope.is_some() && gpu_budget.is_none(), "--eviction-scope"),
                // (Without one nothing is read from disk.)
                (self.skip_misses_from_rank.is_some(), "--skip-misses-from-rank"),
            ]
            .into_iter()
            .filter_map(|(set, flag)| set.then_some(flag))
            .collect();
            if !flags.is_empty() {
                return Err(anyhow!(
                    "{} {} --budget: without a budget every expert is resident, so there is nothing to pin or evict",
                    flags.join(" and "),
                    if flags.len() == 1 { "needs" } else { "need" }
                ));
            }
        }
        if self.working_slots == 0 {
            return Err(anyhow!("--working-slots must be at least 1"));
        }
        if self.io_workers == 0 || self.io_workers > 64 {
            return Err(anyhow!("--io-workers must be in 1..=64, got {}", self.io_workers));
        }
        let usage = match self.usage.as_deref() {
            None => UsageSetting::Default,
            Some("off") => UsageSetting::Off,
            Some(p) => UsageSetting::Path(PathBuf::from(p)),
        };
        if self.usage_import && usage == UsageSetting::Off {
            return Err(anyhow!("--usage-import imports a usage ledger; drop --usage off"));
        }
        if (self.auto_pin || self.live_repin) && usage == UsageSetting::Off {
            return Err(anyhow!("--auto-pin and --live-repin learn from the usage ledger; drop --usage off"));
        }
        let pilot = match self.pilot.as_str() {
            "off" => PilotMode::Off,
            "measure" => PilotMode::Measure,
            "hint" => PilotMode::Hint,
            "prefetch" => PilotMode::Prefetch,
            "two-step" => PilotMode::TwoStep,
            other => return Err(anyhow!("--pilot `{other}`: expected off, measure, two-step, hint or prefetch")),
        };
        if let Some(n) = self.pilot_ranks {
            if !matches!(pilot, PilotMode::Hint | PilotMode::Prefetch) {
                return Err(anyhow!("--pilot-ranks limits what --pilot hint or prefetch reads; it needs one of them"));
            }
            if n == 0 {
                return Err(anyhow!("--pilot-ranks must be at least 1"));
            }
        }
        let eviction = match &self.eviction {
            Some(text) => strata_residency::Eviction::parse(text).map_err(|e| anyhow!("--eviction: {e}"))?,
            None => RuntimeOptions::default().eviction,
        };
        let eviction_scope = match &self.eviction_scope {
            Some(text) => EvictionScope::parse(text).map_err(|e| anyhow!("--eviction-scope: {e}"))?,
            None => RuntimeOptions::default().eviction_scope,
        };
        check_skip_rank(self.skip_misses_from_rank)?;
        if self.context == 0 {
            return Err(anyhow!("--context must be at least 1"));
        }
        let (mtp, require_mtp) = match self.mtp.as_str() {
            "auto" => (true, false),
            "on" => (true, true),
            "off" => (false, false),
            other => return Err(anyhow!("--mtp `{other}`: expected auto, on or off")),
        };
        Ok(strata_engine::LoadOptions {
            mtp,
            require_mtp,
            device: self.device.device()?,
            budget,
            gpu_budget,
            context: self.context,
            runtime: RuntimeOptions {
                working_slots: self.working_slots,
                max_slots_per_layer: None,
                pins,
                auto_pin: self.auto_pin,
                live_repin: self.live_repin,
                usage,
                usage_import: self.usage_import,
                direct_io: !self.page_cache,
                io_workers: self.io_workers,
                pilot,
                pilot_ranks: self.pilot_ranks,
                eviction,
                eviction_scope,
                skip_misses_from_rank: self.skip_misses_from_rank,
            },
        })
    }
}

#[derive(Args)]
pub struct FitArgs {
    #[arg(long)]
    model: PathBuf,
    #[command(flatten)]
    budget: BudgetArgs,
    #[arg(long)]
    json: bool,
}

/// `strata fit`: the plan from headers alone; refuses (exit 1) when it cannot fit.
pub fn fit(a: FitArgs) -> Result<()> {
    // A plan is made from headers: the device is named, not opened.
    let device = a.budget.device.named()?;
    let mut args = a.budget.clone();
    args.device.device = "cpu".into();
    let opts = args.load_options_for(&a.model)?;
    let arch = strata_models::read_arch(&a.model)?;
    let store = strata_storage::WeightStore::open_dir(&a.model)?;
    let image_rows = strata_engine::media::image_rows(&a.model, arch.as_ref())?;
    let mut fit_opts = strata_engine::model_dir::fit_options(&opts, opts.budget, image_rows);
    let on_gpu = matches!(device, strata_engine::Device::Cuda(_));
    // Whether the draft layer is loaded, as generate, chat and serve decide it.
    let draft = strata_engine::model_dir::draft_decision(
        &a.model,
        arch.as_ref(),
        &store,
        &strata_engine::LoadOptions { device, ..opts.clone() },
        image_rows,
    )?;
    if opts.require_mtp && !arch.has_draft(&store) {
        return Err(anyhow!("--mtp on: {} has no draft (MTP) layer that strata runs", a.model.display()));
    }
    fit_opts.draft = draft.load;
    if opts.gpu_budget.is_some() && !on_gpu {
        return Err(anyhow!("--gpu-budget sizes the GPU's expert tier; it needs --device cuda"));
    }
    // On CUDA: the GPU's plan, and with streamed experts the host tier's.
    let streams = opts.budget.is_some() || opts.gpu_budget.is_some() || strata_engine::experts::is_container(&a.model);
    let mut plans: Vec<(&str, strata_engine::fit::Fit)> = Vec::new();
    if on_gpu && arch.moe().is_some() {
        let gpu = strata_engine::fit::fit_gpu(&a.model, arch.as_ref(), &store, &fit_opts, opts.gpu_budget)?;
        plans.push(("gpu", gpu));
        if streams {
            fit_opts.host_tier_only = true;
            plans.push(("host", strata_engine::fit::fit_dir(&a.model, arch.as_ref(), &store, &fit_opts)?));
        }
    } else {
        plans.push(("host", strata_engine::fit::fit_dir(&a.model, arch.as_ref(), &store, &fit_opts)?));
    }
    if a.json {
        let mut all = serde_json::Map::new();
        for (name, fit) in &plans {
            let mut v = serde_json::to_value(fit)?;
            v["error"] = fit.error.clone().into();
            all.insert(name.to_string(), v);
        }
        // One plan: the plan itself (as before the GPU tier); several: by tier.
        let mut v = match plans.len() {
            1 if !on_gpu => all.remove("host").unwrap_or_default(),
            _ => serde_json::Value::Object(all),
        };
        v["draft_layer"] = serde_json::json!({ "loaded": draft.load, "slots_it_would_take": draft.slots_taken });
        crate::commands::emit(&serde_json::to_string_pretty(&v)?)?;
    } else {
        if let Some(note) = draft.note() {
            println!("{note}");
        }
        for (name, fit) in &plans {
            if on_gpu {
                println!("{} tier ({}):", name, if *name == "gpu" { "--gpu-budget" } else { "--budget" });
            }
            println!("{}", fit.report);
            if let Some(p) = &fit.plan {
                println!(
                    "plan: {} slots ({} working, {} pinned, {} per layer x {} layers), slot {} bytes; experts {} in all ({:.1}x the slab)",
                    p.total_slots,
                    p.input.working_slots,
                    p.input.pinned_experts,
                    p.slots_per_layer,
                    p.input.sparse_layers,
                    p.input.slot_bytes,
                    crate::commands::human_bytes(fit.expert_bytes_total),
                    fit.expert_bytes_total as f64 / p.slab_bytes.max(1) as f64
                );
            }
        }
    }
    for (name, fit) in &plans {
        let tier = if on_gpu { format!(" ({name} tier)") } else { String::new() };
        match (&fit.error, fit.report.fits) {
            (Some(e), _) => return Err(anyhow!("{}{tier}: {e}", a.model.display())),
            (None, false) => {
                return Err(anyhow!("{}{tier}: does not fit in the budget (see the table above)", a.model.display()))
            }
            _ => {}
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct ReplayArgs {
    /// A route trace written by `--trace`.
    #[arg(long)]
    trace: PathBuf,
    #[arg(long)]
    slots_per_layer: usize,
    #[arg(long, default_value_t = 64)]
    working: usize,
    /// Pinned slots for the pinned+LRU policy (the trace's most used experts).
    #[arg(long, default_value_t = 0)]
    pinned: usize,
    /// Also replay two tiers: the slots above as a GPU slab in front of a host slab with
    /// this many slots per layer (as `--device cuda` with `--gpu-budget` and `--budget`).
    #[arg(long)]
    host_slots_per_layer: Option<usize>,
    /// The host tier's working bank (with --host-slots-per-layer).
    #[arg(long, default_value_t = 64, requires = "host_slots_per_layer")]
    host_working: usize,
    /// Host slots pinned to the next most used experts after the GPU's pins (with
    /// --host-slots-per-layer).
    #[arg(long, default_value_t = 0, requires = "host_slots_per_layer")]
    host_pinned: usize,
    /// Half-life of the LFRU rows' heat, in forwards (as `--eviction lfru:H`).
    #[arg(long, default_value_t = strata_residency::Eviction::DEFAULT_HALF_LIFE)]
    lfru_half_life: f64,
    /// Replay approximate decode (`--skip-misses-from-rank R`): the runtime rows leave out
    /// a one-row forward's misses of rank R or lower (two tiers: the host's misses).
    #[arg(long, value_name = "R")]
    skip_misses_from_rank: Option<usize>,
    /// The runtime rows' eviction scope, both tiers (as `--eviction-scope`): global or layer.
    #[arg(long, value_name = "SCOPE", default_value = "layer")]
    eviction_scope: String,
    #[arg(long)]
    json: bool,
}

/// `strata replay`: hit rates of LRU, LFRU, pinned+LRU and the Belady optimum.
pub fn replay(a: ReplayArgs) -> Result<()> {
    if a.slots_per_layer == 0 {
        return Err(anyhow!("--slots-per-layer must be at least 1"));
    }
    strata_residency::Eviction::lfru(a.lfru_half_life).map_err(|e| anyhow!("--lfru-half-life: {e}"))?;
    let file = std::fs::File::open(&a.trace).map_err(|e| anyhow!("{}: cannot open trace: {e}", a.trace.display()))?;
    let records = strata_residency::read_trace(std::io::BufReader::new(file))
        .map_err(|e| anyhow!("{}: {e}", a.trace.display()))?;
    check_skip_rank(a.skip_misses_from_rank)?;
    let scope = EvictionScope::parse(&a.eviction_scope).map_err(|e| anyhow!("--eviction-scope: {e}"))?;
    let gpu = strata_residency::ReplayConfig {
        lfru_half_life: a.lfru_half_life,
        skip_misses_from_rank: a.skip_misses_from_rank,
        scope,
        ..strata_residency::ReplayConfig::new(a.slots_per_layer, a.working, a.pinned)
    };
    let mut report = strata_residency::replay(&records, &gpu);
    if let Some(slots_per_layer) = a.host_slots_per_layer {
        if slots_per_layer == 0 {
            return Err(anyhow!("--host-slots-per-layer must be at least 1"));
        }
        let host = strata_residency::ReplayConfig {
            scope,
            ..strata_residency::ReplayConfig::new(slots_per_layer, a.host_working, a.host_pinned)
        };
        report.tiers = Some(strata_residency::replay_tiers(&records, &gpu, &host));
    }
    if a.json {
        crate::commands::emit(&serde_json::to_string_pretty(&report)?)
    } else {
        println!("{report}");
        Ok(())
    }
}

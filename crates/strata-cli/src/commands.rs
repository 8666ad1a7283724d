//! generate, chat, logits, inspect.

use crate::residency::{BudgetArgs, DeviceArgs};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use strata_engine::generate::RouteTrace;
use strata_engine::media;
use strata_engine::serving::{BatchEngine, MediaInput, ServeRequest};
use strata_engine::{DraftPolicy, GenerateRequest, LoadOptions, LoadedModel, Message, SamplingParams};
use strata_models::TensorGroup;
use strata_server::output::OutputParser;
use strata_server::syntax::Syntax;
use strata_server::tools::Piece;
use strata_storage::WeightStore;

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy. Default: generation_config.json, else greedy.
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    min_p: Option<f32>,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Stop when the output contains this string (repeatable).
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// What to do with a prompt longer than the context: `error` (default) or `left`
    /// (drop its oldest tokens).
    #[arg(long, default_value = "error")]
    truncate: String,
    /// Tokens the MTP layer drafts per target forward (0: no speculation). Default: 3
    /// where the draft layer is loaded.
    #[arg(long)]
    draft_tokens: Option<usize>,
    /// How many to draft each round: `adaptive` (the default: 0 up to --draft-tokens, from
    /// measured acceptance and speed, and none at all where drafting does not pay) or
    /// `fixed` (always --draft-tokens). The tokens are the same either way.
    #[arg(long)]
    draft_policy: Option<String>,
}

impl SamplingArgs {
    /// `--draft-policy` checked before the model loads.
    fn draft_policy(&self) -> Result<DraftPolicy> {
        draft_policy(
            self.draft_policy.as_deref(),
            self.draft_tokens.unwrap_or(strata_engine::generate::DEFAULT_DRAFT_TOKENS),
        )
    }

    /// The engine a generation runs on (a batch of one), tracing where asked.
    fn engine<'m>(&self, m: &'m LoadedModel, report: &ReportArgs) -> Result<BatchEngine<'m>> {
        if let Some(n) = self.draft_tokens.filter(|&n| n > 0 && !m.draft) {
            bail!("--draft-tokens {n}: the model's draft (MTP) layer is not loaded (--mtp off, or the model has none)");
        }
        let mut engine = m.engine(self.draft_tokens)?;
        // Whether speculating pays here was measured by earlier runs: start from it.
        engine.remember_speculation(&m.dir);
        if let (Some(p), 0) = (&self.draft_policy, engine.options().draft_tokens) {
            match self.draft_tokens {
                Some(0) => bail!("--draft-policy {p}: --draft-tokens 0 drafts nothing"),
                _ => bail!("--draft-policy {p}: the model's draft (MTP) layer is not loaded, so nothing is drafted"),
            }
        }
        if let Some(path) = &report.trace {
            engine.set_trace(RouteTrace::create(path)?);
        }
        Ok(engine)
    }

    /// The request for `prompt_ids` under these settings and the model's defaults.
    fn request(
        &self,
        m: &LoadedModel,
        engine: &BatchEngine,
        prompt_ids: Vec<u32>,
        media: Option<MediaInput>,
    ) -> Result<ServeRequest> {
        let draft_tokens = engine.options().draft_tokens;
        let gen = GenerateRequest {
            stop_strings: self.stop.clone(),
            eos_token_ids: m.eos_token_ids.clone(),
            truncate_left: self.truncate_left()?,
            draft_tokens,
            draft_policy: draft_policy(self.draft_policy.as_deref(), draft_tokens)?,
            ..GenerateRequest::new(prompt_ids, self.max_tokens, self.params(&m.generation.sampling)?)
        };
        Ok(ServeRequest { media, ..ServeRequest::new(gen) })
    }

    fn truncate_left(&self) -> Result<bool> {
        match self.truncate.as_str() {
            "error" => Ok(false),
            "left" => Ok(true),
            other => bail!("--truncate `{other}`: expected error or left"),
        }
    }

    fn params(&self, defaults: &SamplingParams) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(defaults.repetition_penalty),
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (HF layout: config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message through the chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    /// An image for the prompt (repeatable; models with a vision tower).
    #[arg(long)]
    image: Vec<PathBuf>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    budget: BudgetArgs,
    #[command(flatten)]
    report: ReportArgs,
}

/// Telemetry outputs of generate and chat.
#[derive(Args, Clone, Default)]
pub struct ReportArgs {
    /// Write generation statistics (and expert telemetry) as JSON to this path.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Print expert telemetry after each generation (stderr).
    #[arg(long)]
    stats: bool,
    /// Record every routing decision (segment forward row layer experts) to this file.
    #[arg(long)]
    trace: Option<PathBuf>,
}

#[derive(Args)]
pub struct ChatArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    system: Option<String>,
    /// An image for the prompt (repeatable; models with a vision tower).
    #[arg(long)]
    image: Vec<PathBuf>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    budget: BudgetArgs,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args)]
pub struct LogitsArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    ids: String,
    /// Logits at every position (default: the last only).
    #[arg(long)]
    all_positions: bool,
    /// An image whose placeholder run (`<boi>`, one image token per soft token, `<eoi>`)
    /// the ids hold (repeatable, in order).
    #[arg(long)]
    image: Vec<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
pub struct InspectArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    json: bool,
}

/// After a generation: the turn boundary of the expert runtime, then the reports.
fn finish_turn(m: &LoadedModel, report: &ReportArgs, stats: &strata_engine::GenerationStats) -> Result<()> {
    let mut doc = serde_json::to_value(stats)?;
    if let (true, Some(s)) = (report.stats, &stats.mtp) {
        eprintln!(
            "mtp ({}, up to {} drafts): {} drafted, {} accepted ({:.1}%), {:.2} accepted a drafting round, {} plain rounds, {:.2} tokens per target forward, {} forwards saved",
            s.policy,
            s.draft_tokens,
            s.drafted,
            s.accepted,
            s.acceptance_rate * 100.0,
            s.mean_accepted_length,
            s.plain_rounds,
            s.tokens_per_target_forward,
            s.forwards_saved
        );
    }
    if let Some(experts) = &m.experts {
        let r = experts.end_turn()?;
        if report.stats {
            let d = &r.turn.demand;
            eprintln!(
                "experts: {} hits, {} misses ({:.1}% hit){}, {} loads, {} read ops, {} read; wait p50 {:.2} ms p99 {:.2} ms; disk p50 {:.2} ms; layer p50 {:.2} ms",
                d.hits,
                d.misses,
                d.hit_rate * 100.0,
                if d.skipped > 0 { format!(", {} skipped (approximate: --skip-misses-from-rank)", d.skipped) } else { String::new() },
                d.loads,
                d.read_ops,
                human_bytes(d.read_bytes),
                d.foreground_wait.p50_s * 1e3,
                d.foreground_wait.p99_s * 1e3,
                d.disk_service.p50_s * 1e3,
                r.turn.layer_forward.p50_s * 1e3,
            );
            let s = &r.slots;
            eprintln!(
                "slots: {} ({} working, {} layer, {} pinned, {} disabled); {} evictions ({}, {} scope), {} pressure evictions, {} repin swaps; footprint {} of budget {}",
                s.total,
                s.working,
                s.layer,
                s.pinned,
                s.disabled,
                s.evictions,
                r.eviction,
                r.eviction_scope,
                s.pressure_evictions,
                s.repin_swaps,
                human_bytes(r.footprint_bytes),
                r.budget_bytes.map_or("none".to_string(), human_bytes),
            );
            if let Some(t) = &r.device_tier {
                eprintln!(
                    "gpu tier ({}): {} hits ({} dispatched by id on the device), {} misses ({:.1}% hit), {} copies host -> GPU ({}), {:.2} ms waiting on copies; evicted experts kept by the host tier: {} still there, {} copied back ({}); {} slots ({}), {} eviction, {} scope",
                    t.device,
                    t.traffic.hits,
                    t.traffic.by_id,
                    t.traffic.misses,
                    t.hit_rate.unwrap_or(0.0) * 100.0,
                    t.traffic.copies,
                    human_bytes(t.traffic.copy_bytes),
                    t.traffic.copy_wait_seconds * 1e3,
                    t.traffic.demotions_kept,
                    t.traffic.demotions_copied,
                    human_bytes(t.traffic.demotion_bytes),
                    t.slots.total,
                    human_bytes(t.plan.slab_bytes),
                    t.eviction,
                    t.eviction_scope,
                );
            }
        }
        if let (true, Some(p)) = (report.stats, &r.pilot) {
            eprintln!(
                "pilot: {} rows, recall {:.1}%, precision {:.1}%, exact rows {}, rank hit rates {:?}, {} hints ({}), {} prefetches, {} prefetch hits",
                p.rows,
                p.recall * 100.0,
                p.precision * 100.0,
                p.exact_rows,
                p.rank_hit_rates.iter().map(|x| format!("{:.0}%", x * 100.0)).collect::<Vec<_>>(),
                p.hints,
                human_bytes(p.hint_bytes),
                p.prefetches,
                p.prefetch_hits,
            );
        }
        doc["experts"] = serde_json::to_value(&r)?;
    }
    if let Some(draft) = &m.draft_experts {
        let r = draft.end_turn()?;
        if report.stats {
            let d = &r.turn.demand;
            eprintln!(
                "draft experts (MTP tier): {} hits, {} misses ({:.1}% hit), {} read; {} slots",
                d.hits,
                d.misses,
                d.hit_rate * 100.0,
                human_bytes(d.read_bytes),
                r.slots.total,
            );
        }
        doc["draft_experts"] = serde_json::to_value(&r)?;
    }
    if let Some(path) = &report.stats_json {
        write_stats(path, &doc)?;
    }
    Ok(())
}

/// Before a benchmark loads its model: `--draft-tokens 0` loads no draft layer (refused
/// with `--mtp on`), and drafts need `--mtp` not off.
pub fn draft_load(load: &mut LoadOptions, draft_tokens: Option<usize>) -> Result<()> {
    match draft_tokens {
        Some(0) if load.require_mtp => bail!("--mtp on with --draft-tokens 0: nothing would use the draft layer"),
        Some(0) => load.mtp = false,
        Some(n) if !load.mtp => bail!("--draft-tokens {n}: --mtp off loads no draft layer"),
        Some(_) => load.require_mtp = true,
        None => {}
    }
    Ok(())
}

/// A benchmark's drafts a round and policy once its model is loaded, with the product's
/// defaults (as `strata generate` and `strata serve`): 3 where a draft layer is loaded.
pub fn draft_settings(
    has_draft: bool,
    draft_tokens: Option<usize>,
    policy: Option<&str>,
) -> Result<(usize, DraftPolicy)> {
    let n = draft_tokens.unwrap_or(if has_draft { strata_engine::generate::DEFAULT_DRAFT_TOKENS } else { 0 });
    Ok((n, draft_policy(policy, n)?))
}

/// `--draft-policy` as given (default adaptive), refused where it would do nothing (no
/// drafts).
pub fn draft_policy(policy: Option<&str>, draft_tokens: usize) -> Result<DraftPolicy> {
    let Some(policy) = policy else { return Ok(DraftPolicy::default()) };
    let p = DraftPolicy::parse(policy).context("--draft-policy")?;
    if draft_tokens == 0 {
        bail!("--draft-policy {policy}: --draft-tokens 0 drafts nothing (give --draft-tokens N)");
    }
    Ok(p)
}

fn write_stats(path: &Path, value: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("{}: cannot write stats", path.display()))
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    a.sampling.draft_policy()?;
    let m = LoadedModel::open_with(&a.model, &a.budget.load_options_for(&a.model)?)?;
    let tok = m.tokenizer()?;
    let media = open_images(&m, &a.image)?;
    let mut prompt_ids = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(Message::new("system", s));
        }
        msgs.push(user_message(&a.prompt, a.image.len()));
        let text = m.chat_template()?.render(&msgs, true, None)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&a.prompt, true)?
    };
    if let Some((_, counts)) = &media {
        prompt_ids = with_images(&m, &prompt_ids, counts)?;
    }
    let mut engine = a.sampling.engine(&m, &a.report)?;
    let req = a.sampling.request(&m, &engine, prompt_ids, media.map(|(input, _)| input))?;
    let stdout = std::io::stdout();
    let out = engine.generate(req, &mut |t| {
        let mut lock = stdout.lock();
        // A closed pipe (`| head`) ends generation quietly.
        lock.write_all(t.as_bytes()).and_then(|_| lock.flush()).is_ok()
    })?;
    println!();
    finish_turn(&m, &a.report, &out.output.stats)
}

/// A user message of `text` after `images` image parts (the chat template places them).
fn user_message(text: &str, images: usize) -> Message {
    let mut user = Message::new("user", text);
    if images > 0 {
        let mut parts: Vec<serde_json::Value> = (0..images).map(|_| serde_json::json!({"type": "image"})).collect();
        parts.push(serde_json::json!({"type": "text", "text": text}));
        user.content = serde_json::Value::Array(parts);
    }
    user
}

/// `--image` files as a request's media and their soft tokens (None without any).
fn open_images(m: &LoadedModel, paths: &[PathBuf]) -> Result<Option<(MediaInput, Vec<usize>)>> {
    match paths.is_empty() {
        true => Ok(None),
        false => media::open_files(m, paths).map(Some).map_err(|e| anyhow!("--image: {e:#}")),
    }
}

/// `ids` with each image's run of placeholders.
fn with_images(m: &LoadedModel, ids: &[u32], counts: &[usize]) -> Result<Vec<u32>> {
    let spec = media::vision_spec(m)?;
    media::expand_runs(&spec, ids, counts, m.model.info().bos_token_id).map_err(|e| anyhow!("--image: {e:#}"))
}

pub fn chat(a: ChatArgs) -> Result<()> {
    a.sampling.draft_policy()?;
    let m = LoadedModel::open_with(&a.model, &a.budget.load_options_for(&a.model)?)?;
    let tok = m.tokenizer()?;
    // Images go with the first message; every turn's prompt then holds their runs.
    let media = open_images(&m, &a.image)?;
    let template = m.chat_template()?;
    let mut engine = a.sampling.engine(&m, &a.report)?;
    let mut msgs: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    eprintln!("strata chat: {} ({}). Empty line or Ctrl-D to quit.", a.model.display(), m.model_type);
    let syntax = Syntax::of(m.arch.family().chat);
    loop {
        write!(stdout, "> ")?;
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        let first = !msgs.iter().any(|m| m.role == "user");
        msgs.push(user_message(line, if first { a.image.len() } else { 0 }));
        let text = template.render(&msgs, true, None)?;
        let mut ids = tok.encode(&text, false)?;
        if let Some((_, counts)) = &media {
            ids = with_images(&m, &ids, counts)?;
        }
        // (A prompt with images is computed whole each turn: the prompt cache keeps text.)
        let mut req = a.sampling.request(&m, &engine, ids, media.as_ref().map(|(input, _)| input.clone()))?;
        // Harmony's channels are special tokens: kept, and parsed into the reasoning (to
        // stderr) and the answer (to stdout, and into the history).
        let mut harmony = (syntax == Syntax::Harmony).then(|| OutputParser::with_syntax(syntax, Some(false), None));
        req.gen.skip_special_tokens &= harmony.is_none();
        let mut answer = String::new();
        let show = |pieces: Vec<Piece>, answer: &mut String| {
            for p in pieces {
                match p {
                    Piece::Reasoning(r) => eprint!("{r}"),
                    Piece::Text(t) => {
                        print!("{t}");
                        answer.push_str(&t);
                    }
                    Piece::Call(c) => println!("[tool call] {} {}", c.name, c.arguments_json()),
                }
            }
            std::io::stdout().flush().is_ok()
        };
        let out = engine.generate(req, &mut |t| match harmony.as_mut() {
            Some(p) => show(p.push(t), &mut answer),
            None => {
                let mut lock = std::io::stdout().lock();
                lock.write_all(t.as_bytes()).and_then(|_| lock.flush()).is_ok()
            }
        })?;
        if let Some(p) = harmony.as_mut() {
            show(p.finish(), &mut answer);
        }
        println!();
        finish_turn(&m, &a.report, &out.output.stats)?;
        let text = if harmony.is_some() { answer.trim().to_string() } else { out.output.text };
        msgs.push(Message::new("assistant", &text));
    }
    Ok(())
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let ids: Vec<u32> = a
        .ids
        .split(',')
        .map(|s| s.trim().parse::<u32>().map_err(|_| anyhow!("--ids: `{s}` is not a token id")))
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--ids: no token ids");
    }
    let opts = LoadOptions { device: a.device.device()?, context: ids.len(), ..Default::default() };
    let m = LoadedModel::open_with(&a.model, &opts)?;
    let mut gen = m.scorer()?;
    let logits = match a.image.is_empty() {
        true => gen.logits(&ids, a.all_positions)?,
        false => {
            let media = media::encode_files(&m, &a.image).map_err(|e| anyhow!("--image: {e:#}"))?;
            gen.logits_with_media(&ids, &media, a.all_positions)?
        }
    };
    emit(&serde_json::json!({ "logits": logits }).to_string())
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let arch = strata_models::read_arch(&a.model)?;
    let store = WeightStore::open_dir(&a.model)?;
    let container = strata_engine::experts::is_container(&a.model);
    // Headers against the config, as loading checks them.
    let map = arch.weight_map();
    map.check(&store, container)?;
    let moe = arch.moe();
    let (per_token, count) = moe
        .as_ref()
        .map_or((0, 1), |m| ((m.layers.len() * m.top_k) as u64, (m.layers.len() * m.experts_per_layer) as u64));
    let mut summary = map.summarize(&store, per_token, count);
    if strata_storage::ExpertManifest::exists(&a.model) {
        let manifest = strata_storage::ExpertManifest::read(&a.model)?;
        let per_expert = moe.as_ref().map_or(0, |m| 3 * (m.hidden * m.inter) as u64);
        for tier in &manifest.tiers {
            let group = if tier.name == "mtp" { TensorGroup::Mtp } else { TensorGroup::RoutedExperts };
            let g = summary.groups.entry(group).or_default();
            let n = tier.expert_count() as u64;
            g.tensors += 3 * n as usize;
            g.parameters += n * per_expert;
            g.bytes += n * tier.slot_bytes() as u64;
        }
        summary = strata_models::weights::summarize_groups(summary.groups, per_token, count);
    }
    let experts = expert_tiers(&a.model)?;
    let architecture = arch.describe();
    if a.json {
        let out = serde_json::json!({ "architecture": architecture, "weights": summary, "expert_tiers": experts });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{}  ({})", a.model.display(), arch.model_type());
    for (k, v) in architecture.as_object().unwrap() {
        println!("  {k:<38} {v}");
    }
    println!("\n  {:<16} {:>8} {:>16} {:>14}", "group", "tensors", "parameters", "bytes");
    for (g, s) in &summary.groups {
        let name = serde_json::to_value(g)?.as_str().unwrap_or("?").to_string();
        println!("  {name:<16} {:>8} {:>16} {:>14}", s.tensors, s.parameters, human_bytes(s.bytes));
    }
    println!("  {:<16} {:>8} {:>16} {:>14}", "total", "", summary.total_parameters, human_bytes(summary.total_bytes));
    println!("  active parameters per token: {}", summary.active_parameters);
    println!("  bytes per routed expert:     {}", human_bytes(summary.bytes_per_expert));
    for t in &experts {
        let [g, u, d] = &t.encodings;
        let enc = if g == u && u == d { g.clone() } else { format!("gate {g}, up {u}, down {d}") };
        println!(
            "  expert tier `{}` ({}): {} experts, {enc}, {} a slot",
            t.tier,
            t.format,
            t.experts,
            human_bytes(t.slot_bytes as u64)
        );
    }
    Ok(())
}

/// One expert tier of a container, as `inspect` reports it.
#[derive(serde::Serialize)]
struct ExpertTier {
    /// `strata` (strata's container) or `colibri` (the public container, read in place).
    format: &'static str,
    tier: String,
    experts: usize,
    /// gate, up, down (`mixed` where the tier's experts differ).
    encodings: [String; 3],
    slot_bytes: usize,
}

/// The expert tiers of the container in `dir`, if it is one (headers only).
fn expert_tiers(dir: &std::path::Path) -> Result<Vec<ExpertTier>> {
    if strata_storage::ExpertManifest::exists(dir) {
        let manifest = strata_storage::ExpertManifest::read(dir)?;
        return Ok(manifest
            .tiers
            .iter()
            .map(|t| ExpertTier {
                format: "strata",
                tier: t.name.clone(),
                experts: t.expert_count(),
                encodings: t.layout.matrices().map(|m| m.kind.name()),
                slot_bytes: t.slot_bytes(),
            })
            .collect());
    }
    if !strata_storage::ColibriContainer::detect(dir) {
        return Ok(Vec::new());
    }
    let c = strata_storage::ColibriContainer::open(dir, &strata_storage::GlmDims::from_dir(dir)?)?;
    Ok(c.tiers()
        .iter()
        .map(|t| ExpertTier {
            format: "colibri",
            tier: t.name.clone(),
            experts: t.experts.len(),
            encodings: t
                .uniform_kinds()
                .map_or_else(|| std::array::from_fn(|_| "mixed".into()), |k| k.map(|k| k.name())),
            slot_bytes: t.slot_bytes,
        })
        .collect())
}

/// Prints a line to stdout; a reader that went away (`| head`) is not an error.
pub fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}") {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

//! `strata-bench`: synthetic GLM-5-shaped checkpoints, decode throughput against the
//! memory-bandwidth floor, and the memory bandwidth itself.

use anyhow::{bail, ensure, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::time::Instant;
use strata_engine::serving::{BatchEngine, EngineOptions, ServeRequest, Update};
use strata_engine::{GenerateRequest, LoadedModel, SamplingParams};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Write a random-weight bf16 checkpoint with GLM-5's real shapes (2 layers: one
    /// dense, one MoE with `--experts` routed experts of width 6144 x 2048).
    Synth(SynthArgs),
    /// Prefill and decode throughput on a model directory (no tokenizer needed).
    Decode(Box<DecodeArgs>),
    /// Main-memory read bandwidth (the decode floor's denominator).
    Mem(MemArgs),
    /// Throughput of the serving engine for many concurrent requests (continuous
    /// batching in process), with or without MTP speculative decoding.
    Serve(Box<crate::bench_serve::ServeBenchArgs>),
    /// Random whole-expert reads from a container (O_DIRECT by default): the disk's
    /// bandwidth for this access pattern.
    Io(IoArgs),
}

#[derive(Args)]
pub struct IoArgs {
    /// A model directory with an expert container.
    #[arg(long)]
    model: PathBuf,
    /// Experts to read.
    #[arg(long, default_value_t = 256)]
    reads: usize,
    /// Reads in flight at once.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    #[arg(long, default_value_t = 2)]
    io_workers: usize,
    #[arg(long)]
    page_cache: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct SynthArgs {
    #[arg(long)]
    out: PathBuf,
    /// Widths: glm5 (hidden 6144, experts 6144 x 2048), deepseek-v3 (hidden 7168, experts
    /// 7168 x 2048, no indexer, YaRN) or small (hidden 1024).
    #[arg(long, default_value = "glm5")]
    preset: String,
    /// Decoder layers in all.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Leading dense layers.
    #[arg(long, default_value_t = 1)]
    dense_layers: usize,
    /// Routed experts per MoE layer.
    #[arg(long, default_value_t = 32)]
    experts: usize,
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Vocabulary size (GLM-5 has 154880; smaller keeps the slice about experts).
    #[arg(long, default_value_t = 16384)]
    vocab: usize,
    /// Write an expert container with this encoding (int4-gN, int4-gN-bf16, int4-gN-e4m3,
    /// int8, bf16, f32) instead of an HF bf16 checkpoint.
    #[arg(long)]
    container: Option<String>,
    /// Add an MTP (draft) layer (`num_nextn_predict_layers` 1), int8 experts in a container.
    #[arg(long)]
    mtp: bool,
    /// Store the decoder layers' projections (attention, indexer, MLP and experts) in FP8
    /// e4m3 with 128 x 128 block scales, as GLM-5's FP8 checkpoints do; norms, router,
    /// embedding and head stay bf16.
    #[arg(long)]
    fp8: bool,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args)]
pub struct DecodeArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
    /// Also measure memory (and, for containers, disk) bandwidth and report measured / floor.
    #[arg(long)]
    floor: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    budget: strata_cli::residency::BudgetArgs,
    /// Record every routing decision to this file (for `strata replay`).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Time each op of the prompt's forward and of the decode steps (per-stage breakdown;
    /// a device backend then waits for each op).
    #[arg(long)]
    profile: bool,
    /// Run the prompt and two decode steps once, untimed, before the timed run (on CUDA
    /// the first forward loads kernels, initialises cuBLAS and grows scratch buffers).
    #[arg(long)]
    warmup: bool,
    /// Speculative decoding: tokens the MTP layer drafts a round (default 3 where the model
    /// has the layer and --mtp is not off, as `strata generate`; 0: off).
    #[arg(long)]
    draft_tokens: Option<usize>,
    /// adaptive (the default) or fixed; see generate.
    #[arg(long)]
    draft_policy: Option<String>,
    /// Greedy picks made on the device and fed to the next forward there, so the host
    /// never holds the device up between tokens: auto (where the logits live off the
    /// host: a GPU), on, off. Tokens are the same.
    #[arg(long, value_enum, default_value_t = AutoOnOff::Auto)]
    fed_decoding: AutoOnOff,
    /// Sample the decode at this temperature (0: greedy), with the cuts below; on a GPU
    /// the draws are made on the device.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// A flag's auto / on / off: `None` leaves the choice to the engine.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum AutoOnOff {
    Auto,
    On,
    Off,
}

impl AutoOnOff {
    pub(crate) fn forced(self) -> Option<bool> {
        match self {
            Self::Auto => None,
            Self::On => Some(true),
            Self::Off => Some(false),
        }
    }
}

#[derive(Args)]
pub struct MemArgs {
    /// Buffer size in MiB (well above the caches).
    #[arg(long, default_value_t = 1024)]
    mib: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(c: BenchCommand) -> Result<()> {
    match c {
        BenchCommand::Synth(a) => synth(a),
        BenchCommand::Decode(a) => decode(*a),
        BenchCommand::Io(a) => io(a),
        BenchCommand::Serve(a) => crate::bench_serve::serve(*a),
        BenchCommand::Mem(a) => {
            let gbs = memory_bandwidth(a.mib)?;
            if a.json {
                println!("{}", serde_json::json!({ "read_gb_per_s": gbs, "buffer_mib": a.mib }));
            } else {
                println!("memory read bandwidth: {gbs:.2} GB/s ({} MiB buffer, all cores)", a.mib);
            }
            Ok(())
        }
    }
}

use strata_models::glm_moe_dsa::SynthRng as Rng;

fn synth(a: SynthArgs) -> Result<()> {
    use strata_models::glm_moe_dsa::{synthesize, Preset, SynthFormat, SynthSpec};
    let preset = match a.preset.as_str() {
        "glm5" => Preset::Glm5,
        "small" => Preset::Small,
        "deepseek-v3" => Preset::DeepseekV3,
        other => bail!("--preset `{other}`: expected glm5, deepseek-v3 or small"),
    };
    let format = match &a.container {
        None => SynthFormat::HfBf16,
        Some(k) => SynthFormat::Container(
            strata_kernels::QuantKind::parse(k).map_err(|e| anyhow::anyhow!("--container: {e}"))?,
        ),
    };
    let spec = SynthSpec {
        preset,
        layers: a.layers,
        dense_layers: a.dense_layers,
        experts: a.experts,
        top_k: a.top_k,
        vocab: a.vocab,
        mtp: a.mtp,
        fp8: a.fp8,
        format,
        seed: a.seed,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template("synth [{bar:40}] {pos}/{len} tensors {elapsed}").unwrap());
    synthesize(&a.out, &spec, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// The ops that ran (`{op: {ms, calls}}`) and the time none accounts for, of `elapsed`
/// seconds, each divided by `per` (decode steps, or 1).
fn profile_json(
    profile: &[(strata_backend::profile::Op, f64, u64)],
    elapsed: f64,
    per: f64,
) -> (serde_json::Value, serde_json::Value) {
    let total: f64 = profile.iter().map(|p| p.1).sum();
    let ops = profile
        .iter()
        .filter(|p| p.2 > 0)
        .map(|(op, secs, calls)| {
            (op.name().to_string(), serde_json::json!({"ms": secs / per * 1e3, "calls": *calls as f64 / per}))
        })
        .collect::<serde_json::Map<_, _>>();
    (ops.into(), ((elapsed - total) / per * 1e3).into())
}

/// Reads a buffer of `mib` MiB with every core, best of 5; returns GB/s.
pub fn memory_bandwidth(mib: usize) -> Result<f64> {
    let n = mib * (1 << 20) / 8;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let buf: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let chunk = n.div_ceil(threads);
            let handles: Vec<_> =
                buf.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::hint::black_box(sums);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

fn decode(a: DecodeArgs) -> Result<()> {
    if a.prompt_tokens == 0 || a.decode_tokens < 2 {
        bail!("--prompt-tokens must be >= 1 and --decode-tokens >= 2");
    }
    let mut opts = a.budget.load_options_for(&a.model)?;
    strata_cli::commands::draft_load(&mut opts, a.draft_tokens)?;
    let t_load = Instant::now();
    let m = LoadedModel::open_with(&a.model, &opts)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let (draft_tokens, draft_policy) =
        strata_cli::commands::draft_settings(m.draft, a.draft_tokens, a.draft_policy.as_deref())?;
    let info = m.model.info().clone();
    let vocab = info.vocab_size as u32;
    let mut rng = Rng(42);
    let prompt: Vec<u32> =
        (0..a.prompt_tokens).map(|_| ((rng.next_f32() + 1.0) * 0.5 * (vocab - 1) as f32) as u32).collect();
    let fed = a.fed_decoding.forced();
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        ..Default::default()
    };
    sampling.validate()?;
    // The product's decode loop (a batch of one), computing its prompt each time.
    let engine = || -> Result<BatchEngine<'_>> {
        let o = EngineOptions { prompt_cache_bytes: 0, ..m.engine_options(Some(draft_tokens))? };
        let mut e = BatchEngine::new(m.model.as_ref(), None, o)?;
        e.set_device_picks(fed);
        // As `strata generate`: it starts from the speculation rates earlier runs kept.
        e.remember_speculation(&m.dir);
        Ok(e)
    };
    let request = |n: usize| {
        ServeRequest::new(GenerateRequest {
            draft_tokens,
            draft_policy,
            ..GenerateRequest::new(prompt.clone(), n, sampling.clone())
        })
    };
    if a.warmup {
        // The timed loop's path, three tokens long.
        engine()?.generate(request(3), &mut |_| true)?;
    }
    // Prefill (to the first token), then decode steps (greedy unless --temperature; no
    // EOS: the full length), timed separately; allocations counted over the decode steps.
    let mut engine = engine()?;
    if let Some(path) = &a.trace {
        engine.set_trace(strata_engine::generate::RouteTrace::create(path)?);
    }
    let mut updates = Vec::with_capacity(4);
    strata_backend::profile::enable(a.profile);
    let t0 = Instant::now();
    let id = engine.submit(request(a.decode_tokens))?;
    while engine.generated(id) == Some(0) {
        engine.step(&mut updates)?;
        if let Some((_, Update::Done(r))) = updates.pop() {
            bail!("the request ended in its prefill: {}", r.err().unwrap_or_default());
        }
        updates.clear();
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let prefill_profile = strata_backend::profile::report();
    // Expert traffic of the prefill, so the decode's can be told apart.
    let prefill_experts = m.experts.as_ref().map(|e| e.end_turn()).transpose()?;
    let prefill_draft = m.draft_experts.as_ref().map(|e| e.end_turn()).transpose()?;
    strata_backend::profile::enable(a.profile);
    let (allocs0, bytes0) = crate::alloc_count::snapshot();
    #[cfg(feature = "cuda")]
    let launches0 = strata_backend::cuda::launch_totals();
    let t1 = Instant::now();
    let out = loop {
        engine.step(&mut updates)?;
        if let Some((_, Update::Done(r))) = updates.pop() {
            break r.map_err(|e| anyhow::anyhow!(e))?.output;
        }
        updates.clear();
    };
    let mtp = out.stats.mtp;
    let decode_fed = out.stats.decode_fed;
    ensure!(
        out.tokens.len() == a.decode_tokens,
        "the decode stopped after {} of {} tokens ({})",
        out.tokens.len(),
        a.decode_tokens,
        out.finish_reason.as_str()
    );
    let decode_s = t1.elapsed().as_secs_f64();
    let (allocs1, bytes1) = crate::alloc_count::snapshot();
    #[cfg(feature = "cuda")]
    let launches1 = strata_backend::cuda::launch_totals();
    let profile = strata_backend::profile::report();
    strata_backend::profile::enable(false);
    let steps = (a.decode_tokens - 1) as f64;
    let s = strata_engine::GenerationStats {
        prompt_tokens: prompt.len(),
        prefill_tokens: prompt.len(),
        generated_tokens: a.decode_tokens,
        prefill_seconds: prefill_s,
        decode_seconds: decode_s,
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s,
        decode_tokens_per_s: steps / decode_s,
        peak_rss_bytes: strata_engine::stats::peak_rss_bytes(),
        ..Default::default()
    };
    let s = &s;
    let experts = m.experts.as_ref().map(|e| e.end_turn()).transpose()?;
    let draft = m.draft_experts.as_ref().map(|e| e.end_turn()).transpose()?;

    // Bytes a decode token must read: the resident part as held (one row of the
    // embedding table), and the top-k routed experts of each sparse layer as held.
    let store = strata_storage::WeightStore::open_dir(m.experts_dir.as_deref().unwrap_or(&a.model))?;
    let map = m.arch.weight_map();
    let held = map.resident_held_bytes(&store, false);
    let embed = map
        .specs
        .iter()
        .find(|s| s.role == strata_models::Role::Embedding)
        .and_then(|s| store.get(&s.name).map(|(_, t)| t.byte_len() as u64))
        .unwrap_or(0);
    let tied_head = !map.specs.iter().any(|s| s.name == "lm_head.weight");
    let resident_bytes = if tied_head { held } else { held - embed + info.hidden_size as u64 * 4 };
    let moe = m.arch.moe();
    let active_experts = moe.as_ref().map_or(0, |m| (m.layers.len() * m.top_k) as u64);
    let expert_bytes_per_token = match &m.fit {
        Some(f) if f.slot_bytes > 0 => active_experts * f.slot_bytes,
        _ => active_experts * moe.as_ref().map_or(0, |m| map.stored_expert_bytes(&store, m.layers[0])),
    };
    let token_bytes = resident_bytes + expert_bytes_per_token;
    let mut report = serde_json::json!({
        "model": a.model.display().to_string(),
        "load_seconds": load_s,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "peak_rss_bytes": s.peak_rss_bytes,
        "budget_bytes": opts.budget,
        "device": m.model.device(),
        "allocations_per_decode_token": (allocs1 - allocs0) as f64 / steps,
        "mtp": mtp,
        "decode_fed": decode_fed,
        "sampling": sampling,
        "allocated_bytes_per_decode_token": (bytes1 - bytes0) as f64 / steps,
        "resident_bytes_read_per_token": resident_bytes,
        "expert_bytes_used_per_token": expert_bytes_per_token,
        "decode_bytes_read_per_token": token_bytes,
    });
    #[cfg(feature = "cuda")]
    if matches!(opts.device, strata_engine::Device::Cuda(_)) {
        // How the decode's kernels reached the GPU: graph replays, or one by one.
        let (a0, a1) = (launches0, launches1);
        let per = |v: u64| v as f64 / steps;
        report["cuda_graph_launches_per_decode_token"] = per(a1.graphs - a0.graphs).into();
        report["cuda_kernels_in_graphs_per_decode_token"] = per(a1.graph_kernels - a0.graph_kernels).into();
        report["cuda_kernels_alone_per_decode_token"] = per(a1.kernels - a0.kernels).into();
        report["cuda_graphs_built_in_decode"] = (a1.built - a0.built).into();
    }
    if let (Some(r), Some(p)) = (&experts, &prefill_experts) {
        let d = &r.turn.demand;
        let all_bytes = d.read_bytes + p.turn.demand.read_bytes;
        let tokens = (s.prompt_tokens + s.generated_tokens).max(1) as f64;
        report["expert_hit_rate"] = d.hit_rate.into();
        report["expert_read_bytes"] = all_bytes.into();
        report["expert_read_bytes_per_token_all_forwards"] = (all_bytes as f64 / tokens).into();
        // The decode's own reads per generated token, draft (MTP) tier included.
        let draft_bytes = draft.as_ref().map_or(0, |r| r.turn.demand.read_bytes);
        report["decode_expert_read_bytes_per_token"] =
            ((d.read_bytes + draft_bytes) as f64 / s.generated_tokens.max(1) as f64).into();
        report["expert_read_gb_per_s_in_service"] =
            (d.read_bytes as f64 / d.disk_service.total_s.max(1e-9) / 1e9).into();
        report["expert_foreground_wait_s"] = d.foreground_wait.total_s.into();
        report["expert_slab_bytes"] = r.plan.slab_bytes.into();
        report["expert_total_bytes"] = m.fit.as_ref().map_or(0, |f| f.expert_bytes_total).into();
        report["experts"] = serde_json::to_value(&r.turn)?;
        if let Some(p) = &r.pilot {
            // The decode's next-layer prediction (--pilot): recall, prefetches and their use.
            report["pilot"] = serde_json::to_value(p)?;
        }
        if let Some(t) = &r.device_tier {
            // The decode's GPU tier (CUDA): hits, copies host -> GPU per token.
            let per_token = |v: u64| v as f64 / s.generated_tokens.max(1) as f64;
            report["gpu_budget_bytes"] = opts.gpu_budget.into();
            report["gpu_tier"] = serde_json::to_value(t)?;
            report["gpu_tier_copy_bytes_per_token"] = per_token(t.traffic.copy_bytes).into();
            report["gpu_tier_demotion_bytes_per_token"] = per_token(t.traffic.demotion_bytes).into();
            report["gpu_tier_hit_rate"] = t.hit_rate.into();
            report["gpu_slab_bytes"] = t.plan.slab_bytes.into();
        }
    }
    if let (Some(r), Some(p)) = (&draft, &prefill_draft) {
        report["draft_experts"] = serde_json::json!({
            "decode": r.turn, "prefill": p.turn, "slots": r.slots.total, "slab_bytes": r.plan.slab_bytes,
        });
    }
    if a.floor {
        let gbs = memory_bandwidth(1024)?;
        let floor_tps = gbs * 1e9 / token_bytes as f64;
        report["memory_read_gb_per_s"] = gbs.into();
        report["decode_floor_tokens_per_s_memory"] = floor_tps.into();
        report["decode_fraction_of_memory_floor"] = (s.decode_tokens_per_s / floor_tps).into();
        if let Some(f) = m.fit.as_ref().filter(|f| f.streamed) {
            let dir = m.experts_dir.clone().unwrap_or_else(|| a.model.clone());
            let io = io_bandwidth(&dir, 128, 8, 2, !a.budget.page_cache())?;
            report["disk_random_read_gb_per_s"] = io.0.into();
            report["disk_read_bytes_each"] = f.slot_bytes.into();
            // Decode floor when the decode's reads (its host tier's misses, which under a
            // GPU tier are misses of both tiers) come at the disk's rate, overlapped with
            // the resident work at memory speed (the larger of the two bounds).
            if let Some(r) = &experts {
                let read_per_token = r.turn.demand.read_bytes as f64 / s.generated_tokens.max(1) as f64;
                let disk_s = read_per_token / (io.0 * 1e9);
                // (The memory bound as reported above, not recomputed: equal to the bit.)
                let floor = (1.0 / disk_s.max(1e-300)).min(floor_tps);
                report["decode_floor_tokens_per_s_disk_at_this_hit_rate"] = (1.0 / disk_s.max(1e-12)).into();
                report["decode_floor_tokens_per_s"] = floor.into();
                report["decode_fraction_of_floor"] = (s.decode_tokens_per_s / floor).into();
                report["expert_read_gb_per_s_achieved"] =
                    (r.turn.demand.read_bytes as f64 / s.decode_seconds.max(1e-9) / 1e9).into();
            }
        }
    }
    if a.profile {
        // Per decode token; the prompt's forward as a whole.
        let (ops, unaccounted) = profile_json(&profile, decode_s, steps);
        report["profile_ms_per_token"] = ops;
        report["profile_unaccounted_ms_per_token"] = unaccounted;
        let (ops, unaccounted) = profile_json(&prefill_profile, prefill_s, 1.0);
        report["profile_prefill_ms"] = ops;
        report["profile_prefill_unaccounted_ms"] = unaccounted;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for (k, v) in report.as_object().unwrap() {
            if k == "profile_ms_per_token" || k == "profile_prefill_ms" {
                let what = if k == "profile_ms_per_token" { "a decode token" } else { "the prompt" };
                println!("per-stage time of {what}:");
                for (op, x) in v.as_object().unwrap() {
                    println!(
                        "  {op:<52} {:>8.4} ms  {:>6.1} calls",
                        x["ms"].as_f64().unwrap(),
                        x["calls"].as_f64().unwrap()
                    );
                }
            } else if k != "experts" {
                println!("{k:<42} {v}");
            }
        }
    }
    Ok(())
}

/// Random whole-expert reads from a container: (GB/s, p50 ms, p99 ms).
fn io_bandwidth(
    dir: &std::path::Path,
    reads: usize,
    depth: usize,
    workers: usize,
    direct: bool,
) -> Result<(f64, f64, f64)> {
    let arch = strata_models::read_arch(dir)?;
    let source = strata_engine::experts::open_source(dir, arch.moe().as_ref())?
        .ok_or_else(|| anyhow::anyhow!("{}: no expert container (see `strata convert`)", dir.display()))?;
    let pool = strata_storage::IoPool::open(source.files(), workers, direct)?;
    let slot = source.slot_bytes();
    let mut bufs: Vec<strata_storage::AlignedBuf> =
        (0..depth).map(|_| strata_storage::AlignedBuf::new(slot)).collect::<Result<_>>()?;
    let (layers, per) = (source.layers().to_vec(), source.experts_per_layer());
    let mut rng = Rng(7);
    let mut pick = || {
        let l = layers[((rng.next_f32() + 1.0) * 0.5 * layers.len() as f32) as usize % layers.len()];
        (l, ((rng.next_f32() + 1.0) * 0.5 * per as f32) as usize % per)
    };
    let mut latencies = Vec::with_capacity(reads);
    let mut bytes = 0u64;
    let t0 = Instant::now();
    let mut done = 0;
    while done < reads {
        let n = depth.min(reads - done);
        let mut tickets = Vec::with_capacity(n);
        for buf in bufs.iter_mut().take(n) {
            let (l, e) = pick();
            let (segments, _) = source.locate(l, e)?;
            // SAFETY: each buffer is used by one read at a time and outlives its ticket.
            tickets.push(unsafe { pool.submit(segments, buf.as_mut_ptr(), buf.len()) });
        }
        for t in tickets {
            let s = t.wait()?;
            bytes += s.bytes;
            latencies.push(s.service.as_secs_f64());
        }
        done += n;
    }
    let secs = t0.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let q = |p: f64| latencies[((latencies.len() - 1) as f64 * p).round() as usize] * 1e3;
    Ok((bytes as f64 / secs / 1e9, q(0.5), q(0.99)))
}

fn io(a: IoArgs) -> Result<()> {
    if a.reads == 0 || a.depth == 0 {
        bail!("--reads and --depth must be at least 1");
    }
    let arch = strata_models::read_arch(&a.model)?;
    let slot = strata_engine::experts::open_source(&a.model, arch.moe().as_ref())?
        .ok_or_else(|| anyhow::anyhow!("{}: no expert container (see `strata convert`)", a.model.display()))?
        .slot_bytes();
    let (gbs, p50, p99) = io_bandwidth(&a.model, a.reads, a.depth, a.io_workers, !a.page_cache)?;
    let report = serde_json::json!({
        "model": a.model.display().to_string(),
        "direct_io": !a.page_cache,
        "read_bytes_each": slot,
        "reads": a.reads,
        "depth": a.depth,
        "workers": a.io_workers,
        "gb_per_s": gbs,
        "latency_ms_p50": p50,
        "latency_ms_p99": p99,
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for (k, v) in report.as_object().unwrap() {
            println!("{k:<20} {v}");
        }
    }
    Ok(())
}

//! `strata-bench serve`: the serving engine's throughput for many concurrent requests
//! (continuous batching, in process, no HTTP), with or without speculative decoding.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;
use strata_engine::serving::{BatchEngine, EngineOptions, ServeRequest, Update};
use strata_engine::{GenerateRequest, LoadedModel, SamplingParams};

#[derive(Args)]
pub struct ServeBenchArgs {
    #[arg(long)]
    model: PathBuf,
    /// Requests, all submitted at once.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Requests running at once (default: all of them).
    #[arg(long)]
    max_batch: Option<usize>,
    /// Prompt tokens each: windows of --text, or random ids without it.
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    /// Tokens each request generates (end-of-sequence ids do not stop it).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// A text file the prompts are cut from (evenly spaced windows of its tokens).
    #[arg(long)]
    text: Option<PathBuf>,
    /// Rows one forward may carry (default: --max-batch x (1 + --draft-tokens), at
    /// least 64).
    #[arg(long)]
    step_tokens: Option<usize>,
    /// Speculative decoding: tokens the MTP layer drafts per step of each request (default
    /// 3 where the model has the layer and --mtp is not off, as `strata serve`; 0: off).
    #[arg(long)]
    draft_tokens: Option<usize>,
    /// adaptive (the default) or fixed (see `strata generate`).
    #[arg(long)]
    draft_policy: Option<String>,
    /// 0 is greedy; otherwise requests sample with seeds 1..=N.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Greedy samples picked on the device (one id read back instead of the logits):
    /// auto (where the logits live off the host, as `strata serve`), on or off.
    #[arg(long, value_enum, default_value_t = crate::bench::AutoOnOff::Auto)]
    device_picks: crate::bench::AutoOnOff,
    /// Run the batch once, untimed, first.
    #[arg(long)]
    warmup: bool,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    budget: strata_cli::residency::BudgetArgs,
}

pub fn serve(a: ServeBenchArgs) -> Result<()> {
    if a.requests == 0 || a.prompt_tokens == 0 || a.decode_tokens == 0 {
        bail!("--requests, --prompt-tokens and --decode-tokens must be at least 1");
    }
    let max_batch = a.max_batch.unwrap_or(a.requests);
    if max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let mut load = a.budget.load_options_for(&a.model)?;
    strata_cli::commands::draft_load(&mut load, a.draft_tokens)?;
    let context = a.prompt_tokens + a.decode_tokens + 1;
    // Room for every running request's whole sequence (and block rounding); under a
    // budget the plan reserves it.
    let kv_tokens = max_batch * (context + 16);
    load.context = load.context.max(kv_tokens);
    let m = LoadedModel::open_with(&a.model, &load)?;
    let (draft_tokens, draft_policy) =
        strata_cli::commands::draft_settings(m.draft, a.draft_tokens, a.draft_policy.as_deref())?;
    let vocab = m.model.info().vocab_size;
    let prompts = prompts(&m, &a, vocab)?;
    let step_tokens = a.step_tokens.unwrap_or((max_batch * (1 + draft_tokens)).max(64));
    let opts = EngineOptions {
        max_batch,
        kv_tokens,
        context,
        step_tokens,
        // No prompt cache: a warm run would otherwise skip its prefill.
        prompt_cache_bytes: 0,
        kv_bytes_per_token: m.arch.kv_bytes_per_token(),
        draft_tokens,
    };
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), opts)?;
    engine.set_device_picks(a.device_picks.forced());
    // As `strata serve`: it starts from the speculation rates earlier runs kept.
    engine.remember_speculation(&m.dir);
    let requests = || -> Vec<ServeRequest> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let sampling = SamplingParams { temperature: a.temperature, seed: i as u64 + 1, ..Default::default() };
                let gen = GenerateRequest {
                    draft_tokens,
                    draft_policy,
                    ..GenerateRequest::new(p.clone(), a.decode_tokens, sampling)
                };
                let mut r = ServeRequest::new(gen);
                r.ignore_eos = true;
                r
            })
            .collect()
    };
    if a.warmup {
        run(&mut engine, requests())?;
    }
    let before = engine.counters();
    let (wall_s, outs) = run(&mut engine, requests())?;
    let c = engine.counters();
    let generated: usize = outs.iter().map(|s| s.generated_tokens).sum();
    let (steps, rows) = (c.steps - before.steps, c.rows - before.rows);
    let (drafted, accepted) = (c.mtp_drafted - before.mtp_drafted, c.mtp_accepted - before.mtp_accepted);
    let decode_rate: f64 = outs.iter().map(|s| s.decode_tokens_per_s).sum::<f64>() / outs.len() as f64;
    let ttft: f64 = outs.iter().map(|s| s.time_to_first_token_s).sum::<f64>() / outs.len() as f64;
    let report = serde_json::json!({
        "model": a.model.display().to_string(),
        "device": m.model.device(),
        "requests": a.requests,
        "max_batch": max_batch,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "step_tokens": step_tokens,
        "draft_tokens": draft_tokens,
        "draft_policy": draft_policy.as_str(),
        "temperature": a.temperature,
        "wall_s": wall_s,
        "generated_tokens": generated,
        "tokens_per_s": generated as f64 / wall_s,
        "mean_request_decode_tokens_per_s": decode_rate,
        "mean_time_to_first_token_s": ttft,
        "steps": steps,
        "picked_steps": c.picked_steps - before.picked_steps,
        "picked_samples": c.picked_samples - before.picked_samples,
        "rows_per_step": rows as f64 / steps.max(1) as f64,
        "mtp": (draft_tokens > 0).then(|| serde_json::json!({
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted as f64 / drafted.max(1) as f64,
            "rounds": c.mtp_rounds - before.mtp_rounds,
            "tokens_per_target_forward": (c.mtp_tokens - before.mtp_tokens) as f64
                / (c.mtp_rounds - before.mtp_rounds).max(1) as f64,
            "draft_forwards": c.draft.forwards - before.draft.forwards,
        })),
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "{} requests x {} tokens (batch {max_batch}, {} drafts): {generated} tokens in {wall_s:.3} s = {:.1} tok/s; {steps} steps ({} picked on the device), {:.1} rows a step; per request {decode_rate:.1} tok/s decode, {:.3} s to the first token",
            a.requests,
            a.decode_tokens,
            draft_tokens,
            generated as f64 / wall_s,
            c.picked_steps - before.picked_steps,
            rows as f64 / steps.max(1) as f64,
            ttft
        );
        if draft_tokens > 0 {
            println!(
                "mtp: {accepted} of {drafted} drafts accepted ({:.1}%)",
                100.0 * accepted as f64 / drafted.max(1) as f64
            );
        }
    }
    Ok(())
}

/// `requests` prompts of `prompt_tokens`: evenly spaced windows of the text's tokens, or
/// seeded random ids.
fn prompts(m: &LoadedModel, a: &ServeBenchArgs, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let n = a.prompt_tokens;
    let Some(path) = &a.text else {
        let mut rng = strata_models::glm_moe_dsa::SynthRng(42);
        let mut id = || ((rng.next_f32() + 1.0) * 0.5 * (vocab - 1) as f32) as u32;
        return Ok((0..a.requests).map(|_| (0..n).map(|_| id()).collect()).collect());
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("--text {}", path.display()))?;
    let ids = m.tokenizer()?.encode(&text, false)?;
    if ids.len() < n {
        bail!("--text {}: {} tokens, fewer than --prompt-tokens {n}", path.display(), ids.len());
    }
    let span = ids.len() - n;
    Ok((0..a.requests).map(|i| ids[span * i / a.requests..][..n].to_vec()).collect())
}

/// Runs the requests to their ends; returns the wall time and each one's statistics.
fn run(engine: &mut BatchEngine, reqs: Vec<ServeRequest>) -> Result<(f64, Vec<strata_engine::GenerationStats>)> {
    let n = reqs.len();
    let t = Instant::now();
    for r in reqs {
        engine.submit(r)?;
    }
    let mut out = Vec::new();
    let mut stats = Vec::with_capacity(n);
    while !engine.is_idle() {
        engine.step(&mut out)?;
        for (_, u) in out.drain(..) {
            if let Update::Done(r) = u {
                stats.push(r.map_err(anyhow::Error::msg)?.output.stats);
            }
        }
    }
    Ok((t.elapsed().as_secs_f64(), stats))
}

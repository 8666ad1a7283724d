//! `strata serve`: the OpenAI/Anthropic-compatible HTTP server (crates/strata-server).

use anyhow::{anyhow, bail, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct ServeArgs {
    /// Model directory (HF layout: config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Address to bind; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this key on every route but /health, as `Authorization: Bearer KEY` or
    /// `x-api-key: KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests that may wait beyond the running batch; beyond them, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body accepted (4MiB, 512KiB or bytes); larger ones get 413.
    #[arg(long, default_value = "4MiB")]
    max_body: String,
    /// Requests generating at once (continuous batching: they share every forward).
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// KV cache positions shared by the running requests and the prompt cache (default:
    /// --context). Under --budget the plan reserves them.
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Rows one forward may carry: a decode row per running request, then prompt chunks
    /// (default: the model's prefill chunk, 256 on the CPU and 512 on CUDA, or more where
    /// one image of the model's processor needs more).
    #[arg(long)]
    step_tokens: Option<usize>,
    /// KV the prompt cache may keep (e.g. 64MiB; default: all of the KV pool that running
    /// requests leave; 0 turns it off).
    #[arg(long)]
    prompt_cache: Option<String>,
    /// Answer browsers from these origins (CORS); `*` allows any.
    #[arg(long, num_args = 1..)]
    cors: Vec<String>,
    /// Fetch image URLs that resolve to private, loopback or link-local addresses (refused
    /// by default: a client could otherwise make the server reach internal hosts).
    #[arg(long)]
    allow_private_media: bool,
    /// Speculative decoding: tokens the MTP layer drafts per step of each decoding
    /// request (default 3 where the model has the layer and --mtp is not off; 0: off).
    #[arg(long)]
    draft_tokens: Option<usize>,
    /// How many to draft each step: adaptive (the default; none where drafting does not
    /// pay) or fixed. The tokens are the same either way.
    #[arg(long)]
    draft_policy: Option<String>,
    /// Memory budget and expert streaming; under a budget, prompt plus answer are held to
    /// --context tokens.
    #[command(flatten)]
    budget: crate::residency::BudgetArgs,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.api_key.as_deref() == Some("") {
        bail!("--api-key: the key is empty");
    }
    if a.max_batch == 0 || a.max_batch > 1024 {
        bail!("--max-batch must be in 1..=1024, got {}", a.max_batch);
    }
    if let Some(s) = a.step_tokens.filter(|&s| s < a.max_batch) {
        bail!("--step-tokens ({s}) must be at least --max-batch ({})", a.max_batch);
    }
    let max_body = strata_residency::parse_size(&a.max_body).map_err(|e| anyhow!("--max-body: {e}"))?;
    if max_body == 0 || max_body > usize::MAX as u64 {
        bail!("--max-body must be at least 1 byte, got {}", a.max_body);
    }
    let mut load = a.budget.load_options_for(&a.model)?;
    let draft_policy = crate::commands::draft_policy(a.draft_policy.as_deref(), a.draft_tokens.unwrap_or(3))?;
    match a.draft_tokens {
        Some(n @ 1..) if !load.mtp => bail!("--draft-tokens {n}: --mtp off loads no draft layer"),
        // No drafts: the draft layer would only take memory from the plan.
        Some(0) if load.require_mtp => bail!("--mtp on with --draft-tokens 0: nothing would use the draft layer"),
        Some(0) => load.mtp = false,
        Some(n) if a.step_tokens.is_some_and(|s| s < a.max_batch * (1 + n)) => bail!(
            "--step-tokens ({}) must hold every decoding request's token and drafts: at least --max-batch x (1 + --draft-tokens) = {}",
            a.step_tokens.unwrap_or_default(),
            a.max_batch * (1 + n)
        ),
        _ => {}
    }
    let context = load.context;
    let kv_tokens = a.kv_tokens.unwrap_or(context);
    if kv_tokens < context {
        bail!("--kv-tokens ({kv_tokens}) must hold one whole context (--context {context})");
    }
    // The plan reserves KV for the whole pool.
    load.context = kv_tokens;
    let prompt_cache_bytes = match &a.prompt_cache {
        Some(s) => Some(strata_residency::parse_size(s).map_err(|e| anyhow!("--prompt-cache: {e}"))?),
        None => None,
    };
    for o in &a.cors {
        if o != "*" && !(o.starts_with("http://") || o.starts_with("https://")) {
            bail!("--cors `{o}`: expected an origin such as https://example.com, or *");
        }
    }
    strata_server::serve(strata_server::ServerConfig {
        model_dir: a.model,
        host: a.host,
        port: a.port,
        load,
        serve: strata_server::ServeOptions {
            api_key: a.api_key,
            queue: a.queue,
            max_batch: a.max_batch,
            kv_tokens: Some(kv_tokens),
            step_tokens: a.step_tokens,
            prompt_cache_bytes,
            context_limit: Some(context),
            cors: a.cors,
            allow_private_media: a.allow_private_media,
            max_body: max_body as usize,
            draft_tokens: a.draft_tokens,
            draft_policy,
            // Whether speculating pays here was measured by earlier runs: start from it.
            remember_speculation: true,
        },
    })
}

//! `strata serve`: the OpenAI/Anthropic-compatible HTTP server (crates/strata-server).

use anyhow::{bail, Result};
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
    /// Requests that may wait while one generates; beyond them, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Largest request body accepted (4MiB, 512KiB or bytes); larger ones get 413.
    #[arg(long, default_value = "4MiB")]
    max_body: String,
    /// Memory budget and expert streaming; under a budget, prompt plus answer are held to
    /// --context tokens.
    #[command(flatten)]
    budget: crate::residency::BudgetArgs,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    if a.api_key.as_deref() == Some("") {
        bail!("--api-key: the key is empty");
    }
    let max_body = strata_residency::parse_size(&a.max_body).map_err(|e| anyhow::anyhow!("--max-body: {e}"))?;
    if max_body == 0 || max_body > usize::MAX as u64 {
        bail!("--max-body must be at least 1 byte, got {}", a.max_body);
    }
    let load = a.budget.load_options_for(&a.model)?;
    strata_server::serve(strata_server::ServerConfig {
        model_dir: a.model,
        host: a.host,
        port: a.port,
        api_key: a.api_key,
        queue: a.queue,
        load,
        max_body: max_body as usize,
    })
}

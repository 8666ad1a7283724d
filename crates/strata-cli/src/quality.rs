//! perplexity, and `convert --report`: a model (or a conversion against its source)
//! scored on text.

use crate::residency::BudgetArgs;
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use strata_engine::perplexity::{compare, perplexity_in_forwards_of, PerplexityReport};
use strata_engine::{LoadOptions, LoadedModel};

#[derive(Args)]
pub struct PerplexityArgs {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text to score (encoded as `generate` encodes a prompt).
    #[arg(long)]
    text: PathBuf,
    /// Window step in tokens (default: half of --context, the window).
    #[arg(long)]
    stride: Option<usize>,
    /// Score only the first N tokens of the text (0: all).
    #[arg(long, default_value_t = 0)]
    limit_tokens: usize,
    /// Score in forwards of at most N tokens (default: the backend's prefill chunk; 1 runs
    /// a token a forward, as decode does, which is what --skip-misses-from-rank acts on).
    #[arg(long, value_name = "N")]
    forward_rows: Option<usize>,
    /// Memory budget and device; --context is the window in tokens.
    #[command(flatten)]
    budget: BudgetArgs,
    #[arg(long)]
    json: bool,
}

/// Reads and encodes `path` with the model's tokenizer, keeping `limit` tokens (0: all).
fn text_ids(m: &LoadedModel, path: &Path, limit: usize) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read text: {e}", path.display()))?;
    let mut ids = m.tokenizer()?.encode(&text, true)?;
    if limit > 0 {
        ids.truncate(limit);
    }
    if ids.len() < 2 {
        bail!("{}: {} token(s): at least 2 are needed to score one", path.display(), ids.len());
    }
    Ok(ids)
}

fn progress_bar() -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("scoring [{bar:40}] {pos}/{len} tokens, {elapsed} (eta {eta})")
            .unwrap()
            .progress_chars("=> "),
    );
    bar
}

fn describe(r: &PerplexityReport) -> String {
    format!(
        "perplexity {:.3} (mean NLL {:.4} nats over {} tokens; {} windows of {}, stride {}; {:.1} s)",
        r.perplexity, r.mean_nll, r.scored, r.windows, r.context, r.stride, r.seconds
    )
}

/// `strata perplexity`.
pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.forward_rows == Some(0) {
        bail!("--forward-rows must be at least 1");
    }
    let opts = a.budget.load_options_for(&a.model)?;
    let m = LoadedModel::open_with(&a.model, &opts)?;
    let context = m.context;
    let ids = text_ids(&m, &a.text, a.limit_tokens)?;
    let stride = a.stride.unwrap_or((context / 2).max(1));
    let bar = progress_bar();
    let r = perplexity_in_forwards_of(m.model.as_ref(), &ids, context, stride, a.forward_rows, &mut |d, t| {
        bar.set_length(t as u64);
        bar.set_position(d as u64);
    })?;
    bar.finish_and_clear();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["model"] = a.model.display().to_string().into();
        v["text"] = a.text.display().to_string().into();
        crate::commands::emit(&serde_json::to_string_pretty(&v)?)
    } else {
        println!("{}: {}", a.text.display(), describe(&r));
        Ok(())
    }
}

/// `strata convert --report`: the converted model against its source on held-out text.
#[derive(Args, Clone, Default)]
pub struct ReportArgs {
    /// After converting, score the converted model against the source on --eval-text
    /// (perplexity of both, KL divergence, largest logit difference) and write the JSON
    /// report here. Both models are loaded resident.
    #[arg(long, requires = "eval_text")]
    report: Option<PathBuf>,
    /// Held-out text for --report.
    #[arg(long, requires = "report")]
    eval_text: Option<PathBuf>,
    /// Window of the --report scoring, in tokens.
    #[arg(long, default_value_t = 256)]
    eval_context: usize,
    /// Window step (default: half the window).
    #[arg(long)]
    eval_stride: Option<usize>,
    /// Score only the first N tokens of --eval-text (0: all).
    #[arg(long, default_value_t = 0)]
    eval_tokens: usize,
}

impl ReportArgs {
    /// Fails early (before a long conversion) when the text cannot be read.
    pub fn check(&self) -> Result<()> {
        if let Some(text) = &self.eval_text {
            std::fs::metadata(text).map_err(|e| anyhow!("{}: cannot read --eval-text: {e}", text.display()))?;
        }
        Ok(())
    }

    /// Writes the report when one was asked for.
    pub fn write(
        &self,
        source: &Path,
        converted: &Path,
        encoding: &str,
        convert: &strata_models::convert::ConvertReport,
    ) -> Result<()> {
        let (Some(out), Some(text)) = (&self.report, &self.eval_text) else { return Ok(()) };
        let opts = LoadOptions { context: self.eval_context, ..Default::default() };
        let src = LoadedModel::open_with(source, &opts).context("the source model")?;
        let dst = LoadedModel::open_with(converted, &opts).context("the converted model")?;
        let ids = text_ids(&src, text, self.eval_tokens)?;
        let context = src.context;
        let stride = self.eval_stride.unwrap_or((context / 2).max(1));
        let bar = progress_bar();
        let c = compare(src.model.as_ref(), dst.model.as_ref(), &ids, context, stride, &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        })?;
        bar.finish_and_clear();
        let increase = (c.candidate.perplexity / c.reference.perplexity - 1.0) * 100.0;
        let doc = serde_json::json!({
            "source": source.display().to_string(),
            "converted": converted.display().to_string(),
            "experts": encoding,
            "convert": convert,
            "eval_text": text.display().to_string(),
            "tokens": c.reference.tokens,
            "scored": c.reference.scored,
            "context": c.reference.context,
            "stride": c.reference.stride,
            "source_perplexity": c.reference.perplexity,
            "converted_perplexity": c.candidate.perplexity,
            "perplexity_increase_pct": increase,
            "source_mean_nll": c.reference.mean_nll,
            "converted_mean_nll": c.candidate.mean_nll,
            "mean_kl": c.mean_kl,
            "max_kl": c.max_kl,
            "max_abs_logit_diff": c.max_abs_logit_diff,
            "top1_agreement": c.top1_agreement,
        });
        std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("{}: cannot write the report", out.display()))?;
        eprintln!(
            "report: {encoding} experts: perplexity {:.3} -> {:.3} ({increase:+.2}%), mean KL {:.5} nats, max |logit diff| {:.3}, top-1 agreement {:.1}% over {} tokens -> {}",
            c.reference.perplexity,
            c.candidate.perplexity,
            c.mean_kl,
            c.max_abs_logit_diff,
            c.top1_agreement * 100.0,
            c.reference.scored,
            out.display()
        );
        Ok(())
    }
}

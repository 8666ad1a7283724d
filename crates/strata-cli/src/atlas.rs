//! `strata atlas build | validate | render`: the Expert Atlas (see
//! strata_residency::atlas for the method, strata_engine::atlas for the runner).

use crate::residency::BudgetArgs;
use anyhow::{anyhow, Context, Result};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use strata_engine::atlas::{build_atlas, read_atlas, ProbeOptions};
use strata_engine::LoadedModel;
use strata_residency::atlas::{validate, AtlasFile, AtlasOptions, ProbeSet, Validation};

#[derive(Subcommand)]
pub enum AtlasCommand {
    /// Run a probe set (one fresh KV per prompt) and write the atlas: which experts
    /// specialise in which category, with the runs it came from.
    Build(Box<BuildArgs>),
    /// Leave-one-prompt-out validation of an atlas file: does each prompt's routing point
    /// to its own category?
    Validate(ValidateArgs),
    /// One self-contained HTML page: a layer x expert grid coloured by top topic.
    Render(RenderArgs),
}

#[derive(Args)]
pub struct BuildArgs {
    #[arg(long)]
    model: PathBuf,
    /// Probe set (JSON, schema version 1: provenance and categories of prompts).
    #[arg(long)]
    probes: PathBuf,
    /// Where to write the atlas (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Greedy tokens generated after each prompt (their routes count too).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Wrap each prompt as a user message through the chat template.
    #[arg(long)]
    chat: bool,
    /// Keep an expert only with at least this many selections over all prompts.
    #[arg(long, default_value_t = strata_residency::atlas::DEFAULT_MIN_COUNT)]
    min_count: u64,
    /// ... and only when its top topic fired in at least this many of that topic's prompts.
    #[arg(long, default_value_t = strata_residency::atlas::DEFAULT_MIN_RUNS)]
    min_runs: usize,
    /// Specialisation (1 - entropy / ln(categories)) of a strong specialist.
    #[arg(long, default_value_t = strata_residency::atlas::DEFAULT_STRONG_THRESHOLD)]
    strong_threshold: f64,
    /// Specialist-set size of the validation stored in the file (default: 200, capped at
    /// the experts seen / categories).
    #[arg(long)]
    top_k: Option<usize>,
    #[command(flatten)]
    budget: BudgetArgs,
}

#[derive(Args)]
pub struct ValidateArgs {
    /// An atlas written by `strata atlas build`.
    atlas: PathBuf,
    /// Specialist-set size per category (default: 200, capped at the experts seen /
    /// categories).
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RenderArgs {
    /// An atlas written by `strata atlas build`.
    atlas: PathBuf,
    /// The HTML page to write.
    #[arg(long)]
    out: PathBuf,
    /// Validate with this set size for the page (default: the validation in the file).
    #[arg(long)]
    top_k: Option<usize>,
}

pub fn run(c: AtlasCommand) -> Result<()> {
    match c {
        AtlasCommand::Build(a) => build(*a),
        AtlasCommand::Validate(a) => validate_cmd(a),
        AtlasCommand::Render(a) => render(a),
    }
}

fn read_probes(path: &Path) -> Result<ProbeSet> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read probe set: {e}", path.display()))?;
    ProbeSet::parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    std::fs::write(path, compact_number_arrays(&serde_json::to_string_pretty(value)?) + "\n")
        .with_context(|| format!("{}: cannot write", path.display()))
}

/// Pretty JSON with every array of plain numbers on one line (the runs' `[layer,
/// expert, count]` triples would otherwise take four lines each).
fn compact_number_arrays(pretty: &str) -> String {
    let lines: Vec<&str> = pretty.lines().collect();
    let mut out = String::with_capacity(pretty.len());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.ends_with('[') {
            let mut j = i + 1;
            let mut items = Vec::new();
            while j < lines.len() {
                let t = lines[j].trim();
                let item = t.trim_end_matches(',');
                if item.parse::<f64>().is_ok() {
                    items.push(item);
                    j += 1;
                } else {
                    break;
                }
            }
            if j < lines.len() && !items.is_empty() && lines[j].trim_start().starts_with(']') {
                out.push_str(line);
                out.push_str(&items.join(", "));
                out.push_str(lines[j].trim_start());
                out.push('\n');
                i = j + 1;
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
        i += 1;
    }
    out.truncate(out.trim_end().len());
    out
}

fn build(a: BuildArgs) -> Result<()> {
    let probes = read_probes(&a.probes)?;
    let analysis = AtlasOptions { min_count: a.min_count, min_runs: a.min_runs, strong_threshold: a.strong_threshold };
    if a.top_k == Some(0) {
        return Err(anyhow!("--top-k must be at least 1"));
    }
    let m = LoadedModel::open_with(&a.model, &a.budget.load_options_for(&a.model)?)?;
    let bar = indicatif::ProgressBar::new(probes.prompt_count() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("probing {msg} [{bar:40}] {pos}/{len} prompts, {elapsed}")
            .unwrap()
            .progress_chars("=> "),
    );
    let opts = ProbeOptions { max_tokens: a.max_tokens, chat: a.chat };
    let atlas = build_atlas(&m, probes, &opts, &analysis, a.top_k, &mut |done, _, id| {
        bar.set_position(done as u64);
        bar.set_message(id.to_string());
    })?;
    bar.finish_and_clear();
    write_json(&a.out, &atlas)?;
    let s = &atlas.analysis.summary;
    println!(
        "{}: {} prompts in {} categories; {} experts seen, {} kept ({} too sparse, {} unreplicated), {} strong specialists ({:.1}% of kept)",
        a.out.display(),
        atlas.analysis.run_count,
        atlas.analysis.categories.len(),
        s.experts_seen,
        s.experts_kept,
        s.dropped_sparse,
        s.dropped_unreplicated,
        s.strong_specialists,
        s.strong_specialist_rate * 100.0
    );
    if let Some(v) = &atlas.validation {
        println!("{}", headline(v));
    }
    Ok(())
}

fn headline(v: &Validation) -> String {
    format!(
        "validation ({}, top-{} specialists per category): {}/{} correct, accuracy {:.1}% (chance {:.1}%)",
        v.protocol,
        v.top_k,
        v.hits,
        v.trials,
        v.accuracy * 100.0,
        v.chance * 100.0
    )
}

/// The validation at `top_k`, or the default size.
fn validation(atlas: &AtlasFile, top_k: Option<usize>) -> Result<Validation> {
    let k = top_k.unwrap_or_else(|| {
        strata_residency::atlas::default_top_k(atlas.analysis.summary.experts_seen, atlas.analysis.categories.len())
    });
    validate(&atlas.prompt_counts(), &atlas.runs, k).map_err(|e| anyhow!("{e}"))
}

fn validate_cmd(a: ValidateArgs) -> Result<()> {
    let atlas = read_atlas(&a.atlas)?;
    let v = validation(&atlas, a.top_k)?;
    if a.json {
        return crate::commands::emit(&serde_json::to_string_pretty(&v)?);
    }
    use std::fmt::Write;
    let mut out = headline(&v);
    write!(out, "\n{:<16} {:>6}  {:<16} {:>9} {:>10}", "category", "prompt", "predicted", "own share", "best other")?;
    for t in &v.trials_by_prompt {
        write!(
            out,
            "\n{:<16} {:>6}  {:<16} {:>9.3} {:>10.3}{}",
            t.category,
            t.prompt,
            t.predicted,
            t.own_share,
            t.best_other_share,
            if t.correct { "" } else { "  (wrong)" }
        )?;
    }
    crate::commands::emit(&out)
}

fn render(a: RenderArgs) -> Result<()> {
    let mut atlas = read_atlas(&a.atlas)?;
    if a.top_k.is_some() || atlas.validation.is_none() {
        atlas.validation = Some(validation(&atlas, a.top_k)?);
    }
    let html = crate::atlas_html::render(&atlas)?;
    std::fs::write(&a.out, html).with_context(|| format!("{}: cannot write", a.out.display()))?;
    println!(
        "{}: {} experts on a {} x {} grid",
        a.out.display(),
        atlas.analysis.experts.len(),
        atlas.model.layers.len(),
        atlas.model.experts_per_layer
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn number_arrays_go_on_one_line() {
        let v = serde_json::json!({"a": [[1, 2, 3], [4, 5, 6]], "b": ["x", 1], "c": [], "d": {"e": [1.5]}});
        let text = super::compact_number_arrays(&serde_json::to_string_pretty(&v).unwrap());
        assert!(text.contains("[1, 2, 3],\n"), "{text}");
        assert!(text.contains("\"e\": [1.5]"), "{text}");
        assert!(text.contains("\"x\",\n"), "{text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
    }
}

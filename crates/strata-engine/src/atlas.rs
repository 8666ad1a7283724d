//! The Expert Atlas runner: every probe prompt through the model with a fresh KV cache,
//! every routing decision of every forward counted (prefill rows included), then the
//! analysis of `strata_residency::atlas`. Also the warm start: a pin set sized like
//! auto-pin's, chosen from an atlas for a topic mix.

use crate::fit::fit_dir;
use crate::model_dir::{display_name, LoadOptions, LoadedModel};
use crate::sampling::{Sampler, SamplingParams};
use crate::Message;
use anyhow::{anyhow, bail, Result};
use std::path::Path;
use strata_models::{read_arch, Routes};
use strata_residency::atlas::pins::{plan_atlas_pins, AtlasPinPlan};
use strata_residency::atlas::{AtlasFile, AtlasModel, AtlasOptions, AtlasRun, ProbeSet, RunCounter, RunSettings};
use strata_storage::WeightStore;

/// How each prompt runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProbeOptions {
    /// Greedy tokens generated after the prompt (their forwards are counted too).
    pub max_tokens: usize,
    /// Wrap each prompt as a user message through the chat template.
    pub chat: bool,
}

/// The routed-layer geometry of a loaded model.
pub fn atlas_model(m: &LoadedModel) -> Result<AtlasModel> {
    let moe = m.arch.moe().ok_or_else(|| anyhow!("{}: the model has no routed experts to map", m.dir.display()))?;
    Ok(AtlasModel {
        name: display_name(&m.dir),
        model_type: m.model_type.clone(),
        layers: moe.layers.clone(),
        experts_per_layer: moe.experts_per_layer,
        top_k: moe.top_k,
    })
}

fn count_routes(counter: &mut RunCounter, routes: &Routes, buf: &mut Vec<usize>) -> Result<()> {
    let k = routes.top_k.max(1);
    for i in 0..routes.len() {
        let (layer, ids) = routes.layer(i);
        for row in ids.chunks(k) {
            buf.clear();
            buf.extend(row.iter().map(|&e| e as usize));
            counter.record(layer, buf).map_err(|e| anyhow!("{e}"))?;
        }
    }
    Ok(())
}

/// Runs one prompt from a fresh cache: the prompt in forwards of at most one prefill
/// chunk, then up to `max_tokens` greedy steps; returns the run.
pub fn run_prompt(m: &LoadedModel, category: &str, index: usize, text: &str, opts: &ProbeOptions) -> Result<AtlasRun> {
    let tok = m.tokenizer()?;
    let ids = if opts.chat {
        let rendered = m.chat_template()?.render(&[Message::new("user", text)], true, None)?;
        tok.encode(&rendered, false)?
    } else {
        tok.encode(text, true)?
    };
    let mut gen = m.scorer()?;
    // The main model's routing, one token a forward: no draft (MTP) forwards, whose
    // routes would replace the target's after each prefill chunk.
    gen.record_routes(true);
    let context = gen.context();
    if ids.is_empty() {
        bail!("prompt {category}:{index} encodes to no tokens");
    }
    if ids.len() > context {
        bail!("prompt {category}:{index} has {} tokens but the context is {context} (--context)", ids.len());
    }
    let mut counter = RunCounter::new();
    let mut buf = Vec::new();
    let chunk = m.model.prefill_chunk().min(context);
    let mut done = 0;
    while done < ids.len() {
        let end = (done + chunk).min(ids.len());
        gen.prefill(&ids[..end])?;
        count_routes(&mut counter, gen.routes(), &mut buf)?;
        done = end;
    }
    let mut tokens = ids.len();
    let mut sampler = Sampler::new(SamplingParams::default())?;
    for _ in 0..opts.max_tokens {
        let next = gen.sample(&mut sampler);
        if m.eos_token_ids.contains(&next) || tokens >= context {
            break;
        }
        gen.step(next)?;
        count_routes(&mut counter, gen.routes(), &mut buf)?;
        tokens += 1;
    }
    if let Some(experts) = &m.experts {
        experts.end_turn()?;
    }
    Ok(counter.finish(category, index, tokens))
}

/// Runs every prompt of `probes` (in category order); `progress(done, total, id)`.
pub fn run_probes(
    m: &LoadedModel,
    probes: &ProbeSet,
    opts: &ProbeOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<AtlasRun>> {
    let total = probes.prompt_count();
    let mut runs = Vec::with_capacity(total);
    for (category, prompts) in &probes.categories {
        for (i, text) in prompts.iter().enumerate() {
            progress(runs.len(), total, &format!("{category}:{i}"));
            runs.push(run_prompt(m, category, i, text, opts)?);
        }
    }
    progress(total, total, "");
    Ok(runs)
}

/// Runs the probes and analyses them (validation with `top_k`, None: the default).
pub fn build_atlas(
    m: &LoadedModel,
    probes: ProbeSet,
    opts: &ProbeOptions,
    analysis: &AtlasOptions,
    top_k: Option<usize>,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<AtlasFile> {
    let model = atlas_model(m)?;
    // Checked before the (long) runs, so bad method parameters fail at once.
    if let Some((c, n)) = probes.prompt_counts().into_iter().find(|(_, n)| *n < analysis.min_runs) {
        bail!("--min-runs {} exceeds the {n} prompts of category {c}", analysis.min_runs);
    }
    let runs = run_probes(m, &probes, opts, progress)?;
    let settings = RunSettings { max_tokens: opts.max_tokens, chat: opts.chat };
    AtlasFile::build(model, settings, probes, runs, analysis, top_k).map_err(|e| anyhow!("{e}"))
}

/// Reads an atlas file, naming it in errors.
pub fn read_atlas(path: &Path) -> Result<AtlasFile> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("{}: cannot read atlas: {e}", path.display()))?;
    AtlasFile::parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// The warm-start pins for model `dir` under `opts`: auto-pin's budget (half the resident
/// tier, less one mandatory slot per layer) filled from the atlas's ranking for `topics`
/// (empty: every topic). `opts.runtime.pins` is ignored.
pub fn atlas_pins(dir: &Path, opts: &LoadOptions, atlas: &AtlasFile, topics: &[String]) -> Result<AtlasPinPlan> {
    let budget = opts
        .budget
        .ok_or_else(|| anyhow!("--pin-from-atlas chooses experts to keep in the slab; it needs --budget"))?;
    let arch = read_arch(dir)?;
    let moe = arch.moe().ok_or_else(|| anyhow!("{}: the model has no routed experts to pin", dir.display()))?;
    if atlas.model.layers != moe.layers || atlas.model.experts_per_layer != moe.experts_per_layer {
        bail!(
            "the atlas was built on {} (routed layers {:?}, {} experts each) but {} has routed layers {:?}, {} experts each",
            atlas.model.name,
            atlas.model.layers,
            atlas.model.experts_per_layer,
            dir.display(),
            moe.layers,
            moe.experts_per_layer
        );
    }
    let store = WeightStore::open_dir(dir)?;
    let mut runtime = opts.runtime.clone();
    runtime.pins.clear();
    // The same plan as loading makes (model_dir's auto-pin): the draft layer counts too.
    let image_rows = crate::media::image_rows(dir, arch.as_ref())?;
    let mut fit_opts =
        crate::model_dir::fit_options(&LoadOptions { runtime, ..opts.clone() }, Some(budget), image_rows);
    fit_opts.draft = crate::model_dir::draft_decision(dir, arch.as_ref(), &store, opts, image_rows)?.load;
    let probe = fit_dir(dir, arch.as_ref(), &store, &fit_opts)?;
    let Some(p) = probe.plan else {
        bail!("{}: {} (see `strata fit`)", dir.display(), probe.error.unwrap_or_default());
    };
    let slot = p.input.slot_bytes;
    let tier = budget.saturating_sub(p.input.fixed_bytes + p.input.working_slots as u64 * slot);
    let mandatory = moe.layers.len() as u64 * slot;
    plan_atlas_pins(atlas, topics, tier, mandatory, &moe.layers, slot).map_err(|e| anyhow!("--topics: {e}"))
}

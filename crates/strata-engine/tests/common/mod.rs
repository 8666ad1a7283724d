//! What the engine's tests share: a generation through the product's decode loop, and a
//! plain loop to check it against.
#![allow(dead_code)]

use anyhow::Result;
use strata_engine::serving::{BatchEngine, ServeRequest};
use strata_engine::stats::GenerationStats;
use strata_engine::{FinishReason, GenerateRequest, GenerationOutput, LoadedModel, Sampler, Scorer};

/// `req` on a fresh engine of `m` (a batch of one, as `strata generate` runs it; drafting
/// `req.draft_tokens` where the draft layer is loaded).
pub fn try_generate(m: &LoadedModel, req: &GenerateRequest) -> Result<GenerationOutput> {
    let mut engine = m.engine(Some(if m.draft { req.draft_tokens } else { 0 }))?;
    generate_on(&mut engine, req)
}

pub fn generate(m: &LoadedModel, req: &GenerateRequest) -> GenerationOutput {
    try_generate(m, req).unwrap()
}

/// `req` on `engine` (whose prompt cache holds what earlier requests left).
pub fn generate_on(engine: &mut BatchEngine, req: &GenerateRequest) -> Result<GenerationOutput> {
    Ok(engine.generate(ServeRequest::new(req.clone()), &mut |_| true)?.output)
}

/// The reference the engine must equal: one sequence, one token a forward, the sampler
/// on the host, no speculation, no batching, no prompt cache. Ends as a request does: an
/// end-of-sequence id (not output), a stop string (the text cut before it), the token
/// limit or a full `context`. (No prompt truncation: the prompt must fit.)
pub fn reference(m: &LoadedModel, req: &GenerateRequest, context: usize) -> GenerationOutput {
    let mut g = Scorer::new(m.model.as_ref(), context).unwrap();
    let context = context.min(g.context());
    let mut sampler = Sampler::new(req.sampling.clone()).unwrap();
    g.prefill(&req.prompt_ids).unwrap();
    let tok = m.tokenizer.as_ref();
    let (mut tokens, mut text) = (Vec::new(), String::new());
    let finish = loop {
        let next = g.sample(&mut sampler);
        if req.eos_token_ids.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        if let Some(tok) = tok {
            text = tok.decode(&tokens, req.skip_special_tokens).unwrap();
            let cut = req.stop_strings.iter().filter_map(|s| text.find(s.as_str())).min();
            if let Some(cut) = cut {
                text.truncate(cut);
                break FinishReason::Stop;
            }
        }
        if tokens.len() >= req.max_tokens || req.prompt_ids.len() + tokens.len() > context {
            break FinishReason::Length;
        }
        g.step(next).unwrap();
    };
    GenerationOutput { tokens, text, finish_reason: finish, stats: GenerationStats::default() }
}

//! Serving many requests on one model: continuous batching with a prompt cache.
//!
//! Three pieces with small interfaces, as in vLLM:
//! - scheduling ([`schedule`]): each step, which running request feeds how many rows
//!   (decode rows first, then prompt chunks in a token budget) and whether a waiting
//!   request may start (a KV headroom rule);
//! - memory: the session's KV block pool ([`strata_models::kv::KvBlocks`], reference
//!   counted) and the prompt cache over it ([`prefix::PrefixCache`]);
//! - execution ([`BatchEngine`]): one forward over every scheduled row (so the experts
//!   of all rows are read once per layer), then a sample for each request whose pending
//!   tokens are all in, with its own sampler, grammar mask, bias and stops
//!   ([`request`]).
//!
//! Requests start at any step; a request whose KV cannot grow is preempted (its blocks
//! offered to the prompt cache, its tokens computed again later), so requests wait and
//! never fail for memory. Sampling is per request and the kernels are deterministic per
//! row, so a request's output does not depend on what runs beside it.

mod batch_drafts;
mod draft_epochs;
mod engine;
pub mod prefix;
mod request;
pub mod schedule;
mod speculate;
pub mod speculation_memory;

pub use engine::{BatchEngine, EngineCounters, EngineOptions};
pub use speculate::DraftCounters;

use crate::generate::{GenerateRequest, GenerationOutput};
use crate::sampling::{TokenConstraint, TokenLogprobs};

/// A generation request with the options only the serving engine honours.
pub struct ServeRequest {
    pub gen: GenerateRequest,
    /// End-of-sequence ids and `stop_token_ids` are banned until this many tokens exist
    /// (and stop strings are not matched before).
    pub min_tokens: usize,
    /// End-of-sequence ids do not end the generation (they are generated as any token).
    pub ignore_eos: bool,
    /// More ids that end the generation (not part of the output).
    pub stop_token_ids: Vec<u32>,
    /// Added to the logits of these tokens before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// OpenAI's penalties over the generated tokens: each token that occurred loses
    /// `presence_penalty`, and `frequency_penalty` per occurrence.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report each generated token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// A grammar the output must follow.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Images whose soft tokens replace the prompt's image placeholders (encoded by the
    /// engine when the request starts).
    pub media: Option<MediaInput>,
}

/// The images of a request and the processor that cuts them into patches.
#[derive(Clone, Debug)]
pub struct MediaInput {
    pub images: Vec<crate::image::Rgb8>,
    pub processor: crate::image::ImageProcessor,
}

impl ServeRequest {
    pub fn new(gen: GenerateRequest) -> Self {
        Self {
            gen,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            constraint: None,
            media: None,
        }
    }
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Finished {
    pub output: GenerationOutput,
    /// The stop string that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Every generated token's log-probabilities (when asked for; not those of an
    /// end-of-sequence or stop id that ended it).
    pub logprobs: Vec<TokenLogprobs>,
    /// Seconds from submission to the start of its computation.
    pub queue_wait_s: f64,
    pub preemptions: usize,
}

/// What a request hears after a step.
#[derive(Debug)]
pub enum Update {
    /// Printable text since the last delta, and the log-probabilities of the tokens
    /// sampled since (when asked for).
    Delta {
        text: String,
        logprobs: Vec<TokenLogprobs>,
    },
    Done(Result<Box<Finished>, String>),
}

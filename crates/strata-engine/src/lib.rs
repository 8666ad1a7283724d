//! The generation engine: a model directory opened as a whole (model, tokenizer, chat
//! template, generation defaults), sampling, and the prefill/decode loop with telemetry.

pub mod atlas;
pub mod autoconvert;
pub mod chat;
pub mod draft_policy;
pub mod experts;
pub mod fit;
pub mod generate;
pub mod image;
pub mod media;
pub mod model_dir;
pub mod perplexity;
pub mod residency_view;
pub mod sampling;
pub mod scorer;
pub mod serving;
pub mod speculative;
pub mod stats;
pub mod tiktoken;
pub mod tokenizer;

pub use chat::{ChatTemplate, Message};
pub use draft_policy::DraftPolicy;
pub use generate::{FinishReason, GenerateRequest, GenerationOutput};
pub use model_dir::{GenerationDefaults, LoadOptions, LoadedModel};
pub use sampling::{Sampler, SamplingParams};
pub use scorer::Scorer;
pub use stats::GenerationStats;
pub use strata_models::Device;
pub use tokenizer::{StreamDecoder, TextTokenizer};

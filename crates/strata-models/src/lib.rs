//! Model families on candle tensors, one folder each.
//!
//! A family turns a model directory's `config.json` and weights into a [`CausalLm`];
//! the engine drives it through [`Session`]s (a model plus its KV cache).

pub mod experts;
pub mod glm_moe_dsa;
pub mod nn;

use anyhow::Result;
use candle_core::Tensor;
pub use experts::{ExpertBackend, Routing};

/// A causal language model the engine can drive.
pub trait CausalLm: Send + Sync {
    fn vocab_size(&self) -> usize;
    /// Longest context the model supports (positions).
    fn max_context(&self) -> usize;
    /// End-of-sequence ids declared by the model's config.
    fn eos_token_ids(&self) -> Vec<u32>;
    fn new_session(&self) -> Result<Box<dyn Session + '_>>;
}

/// A model with its KV cache: feed tokens, get logits.
pub trait Session: Send {
    /// Runs `ids` at positions `len()..len()+ids.len()` in one forward and appends them to
    /// the cache. Returns logits `[ids.len(), vocab]` if `all_logits`, else `[1, vocab]`
    /// for the last position.
    fn forward(&mut self, ids: &[u32], all_logits: bool) -> Result<Tensor>;
    /// Tokens in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Drops cached positions `len..` (rollback).
    fn truncate(&mut self, len: usize);
    /// The routing of the last forward: `(layer, one Routing per row)` per MoE layer.
    fn last_routes(&self) -> &[(usize, Vec<Routing>)];
}

//! Model families behind a registry, written against the device seam (strata-backend).
//!
//! A family parses `config.json` into an [`Arch`] ([`registry`]), which describes the
//! checkpoint ([`weights::WeightMap`]) and builds a [`Model`] on a device. The engine
//! drives a model through batch-first [`Session`]s: each forward takes rows from one or
//! more sequences ([`Batch`]), keeps each sequence's KV cache in fixed-size blocks
//! ([`kv`]), and returns logits and hidden states for the rows that ask for them.
//! Shared building blocks (MLA attention, the noaux_tc MoE, SwiGLU) live in [`blocks`];
//! one folder per family composes them.

pub mod batch;
pub mod blocks;
pub mod convert;
pub mod decoder;
pub mod deepseek_v3;
mod fields;
pub mod gemma4;
pub mod glm4_moe;
pub mod glm_moe_dsa;
pub mod gpt_oss;
pub mod kv;
pub mod media;
pub mod minimax_m2;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod registry;
pub mod rope;
mod session;
pub mod weights;

use anyhow::Result;
pub use batch::{fed, Batch, Logits, SeqId};
pub use registry::{
    families, family_of, parse_config, read_arch, supported_model_types, Arch, ChatFormat, Device, ExpertsChoice,
    Family, LoadSpec, MoeLayout,
};
pub use strata_experts::{ExpertProvider, ReadyExperts, Routes, Union};
pub use weights::{ExpertMatrix, Role, TensorGroup, WeightMap, WeightSpec, WeightSummary};

/// What the engine needs to know about a loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub family: &'static str,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Longest context the model supports (positions).
    pub max_context: usize,
    /// End-of-sequence ids declared by the config.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub num_layers: usize,
}

/// How big a session is: everything it allocates is sized from these once.
#[derive(Clone, Copy, Debug)]
pub struct SessionOptions {
    /// Sequences held at once.
    pub max_seqs: usize,
    /// KV positions in all (over every sequence).
    pub kv_tokens: usize,
    /// Positions one sequence may hold (capped by the model's context).
    pub max_len: usize,
    /// Rows one forward may carry (a prefill chunk, or one row per sequence in decode).
    pub max_rows: usize,
}

impl SessionOptions {
    /// One sequence of up to `context` positions, forwards of up to `chunk` rows.
    pub fn single(context: usize, chunk: usize) -> Self {
        Self { max_seqs: 1, kv_tokens: context, max_len: context, max_rows: chunk }
    }
}

/// A causal language model on a device.
pub trait Model: Send + Sync {
    fn info(&self) -> &ModelInfo;
    /// The device it runs on, for reports ("cpu (16 threads, avx512f)").
    fn device(&self) -> String;
    /// Prompt rows a forward takes at most on its device (`Backend::prefill_chunk`).
    fn prefill_chunk(&self) -> usize;
    fn new_session(&self, opts: SessionOptions) -> Result<Box<dyn Session + '_>>;
    /// The vision tower, for a model that runs one.
    fn vision(&self) -> Option<&dyn media::Vision> {
        None
    }
}

/// A model with KV caches for a set of sequences.
pub trait Session: Send {
    fn add_sequence(&mut self) -> Result<SeqId>;
    fn remove_sequence(&mut self, seq: SeqId);
    /// Positions `seq`'s cache holds.
    fn len(&self, seq: SeqId) -> usize;
    /// Drops positions `len..` of `seq` (rollback). A session may drop more (a sliding
    /// window's ring cannot restore positions it has overwritten): [`Session::len`] tells
    /// what it kept.
    fn truncate(&mut self, seq: SeqId, len: usize);
    /// Positions one sequence may hold.
    fn max_len(&self) -> usize;
    /// Rows one forward may carry.
    fn max_rows(&self) -> usize;
    /// Runs `batch`: every row at the next position of its sequence, appended to the
    /// caches. On error, no sequence's length changes.
    fn forward(&mut self, batch: &Batch) -> Result<()>;
    /// Logits of the last forward's rows that asked for them, in batch order, `vocab`
    /// values each. After a forward whose batch picked greedily on the device: none, or
    /// with rows read beside the picks ([`Batch::read_logits_rows`]) every logits row's
    /// place, only those rows valid.
    fn logits(&self) -> &[f32];
    /// Waits for the greedy picks of the oldest forward whose batch asked for them
    /// ([`Batch::pick_greedy`]) and that were not yet taken: one a logits row, in batch
    /// order; `strata_backend::NON_FINITE | j` where logit `j` was not finite. Forwards
    /// may be queued ahead of the take (a decode step fed the pick it has not read yet).
    fn take_picks(&mut self, _dst: &mut Vec<u32>) -> Result<()> {
        anyhow::bail!("this session does not pick tokens on its device")
    }
    /// Whether greedy picks on the device save a read back (the logits live off the host):
    /// the generation loop then feeds each pick to the next forward on the device.
    fn picks_on_device(&self) -> bool {
        false
    }
    /// Final hidden states (before the last norm) of the rows that asked for them
    /// (every logits row, and every row of a [`Logits::HiddenAll`] or [`Logits::Hidden`] push), in batch
    /// order, `hidden` each.
    fn hidden(&self) -> &[f32];
    /// The last forward's routing, per MoE layer (every layer while recording, the
    /// default; see [`Session::record_routes`]).
    fn routes(&self) -> &Routes;
    /// Whether later forwards record every MoE layer's routing. Off, a layer whose experts
    /// the device dispatches by id keeps its ids on the device (no sync a layer).
    fn record_routes(&mut self, _on: bool) {}
    /// The session's KV block pool (for prefix sharing: [`kv::KvBlocks::attach`],
    /// `retain`, `release`); `None` where a session keeps its cache otherwise.
    fn kv(&self) -> Option<&kv::KvBlocks> {
        None
    }
    fn kv_mut(&mut self) -> Option<&mut kv::KvBlocks> {
        None
    }
    /// Whether a sequence may start from blocks another sequence wrote ([`Session::kv`]
    /// holds every layer's cache). A session with per-sequence caches beside the blocks
    /// (Gemma 4's sliding-window rings) answers false: the serving engine then keeps no
    /// prompt cache.
    fn shares_prefixes(&self) -> bool {
        self.kv().is_some()
    }

    /// Whether the model has a draft (MTP) layer for speculative decoding.
    fn has_draft(&self) -> bool {
        false
    }
    /// Runs the draft layer over `batch`: row `r` combines its token with `hidden[r]`
    /// (the final hidden state of the previous position: the target's, or the draft's own
    /// when drafting ahead) and appends to its sequence's draft cache. Logits and the
    /// draft's hidden states come back through [`Session::logits`] and
    /// [`Session::hidden`] for the rows that ask.
    fn draft_forward(&mut self, _batch: &Batch, _hidden: &[f32]) -> Result<()> {
        anyhow::bail!("this model has no draft (MTP) layer")
    }
    /// Positions `seq`'s draft cache holds.
    fn draft_len(&self, _seq: SeqId) -> usize {
        0
    }
    /// Drops positions `len..` of `seq`'s draft cache.
    fn draft_truncate(&mut self, _seq: SeqId, _len: usize) {}
    /// The draft cache's block pool (it shares no prefixes: a sequence's draft rows are
    /// its own), to check room before a draft forward.
    fn draft_kv(&self) -> Option<&kv::KvBlocks> {
        None
    }
}

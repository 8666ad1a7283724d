//! [`Scorer`]: one sequence on a session, forward by forward, for the work that is not
//! a decode loop: logits of given ids (`strata logits`), perplexity windows, the Expert
//! Atlas's probes, and tests that step a model by hand. Generating text is the serving
//! engine's ([`crate::serving::BatchEngine::generate`]).

use crate::sampling::Sampler;
use anyhow::{bail, Result};
use strata_models::{Batch, Logits, Model, Routes, SeqId, Session, SessionOptions};

/// One sequence on a session plus the tokens its cache holds: forwards of given ids, and
/// a prompt's prefix reused from the last (see the module's doc for what it is for).
pub struct Scorer<'m> {
    pub(crate) model: &'m dyn Model,
    pub(crate) session: Box<dyn Session + 'm>,
    pub(crate) seq: SeqId,
    /// What the cache holds.
    pub(crate) tokens: Vec<u32>,
    pub(crate) batch: Batch,
    /// The last forward's logits (a copy the sampler may modify).
    pub(crate) logits: Vec<f32>,
}

impl<'m> Scorer<'m> {
    /// A scorer with room for `context` positions (capped by the model's context).
    pub fn new(model: &'m dyn Model, context: usize) -> Result<Self> {
        Self::with_rows(model, context, model.prefill_chunk())
    }

    /// [`Scorer::new`] whose forwards take up to `rows` rows (a prompt is prefilled in
    /// chunks of that many; [`crate::LoadedModel::prefill_rows`]).
    pub fn with_rows(model: &'m dyn Model, context: usize, rows: usize) -> Result<Self> {
        let context = context.min(model.info().max_context).max(1);
        let chunk = rows.max(1).min(context);
        let mut session = model.new_session(SessionOptions::single(context, chunk))?;
        session.record_routes(false);
        let seq = session.add_sequence()?;
        Ok(Self {
            model,
            session,
            seq,
            tokens: Vec::with_capacity(context),
            batch: Batch::new(),
            logits: Vec::with_capacity(model.info().vocab_size),
        })
    }

    /// Positions the cache can hold.
    pub fn context(&self) -> usize {
        self.session.max_len()
    }

    /// Positions the cache holds for this scorer's sequence.
    pub fn cache_len(&self) -> usize {
        self.session.len(self.seq)
    }

    /// Whether later forwards record their routing for [`Scorer::routes`] (off by
    /// default: recording costs a device sync per MoE layer on a GPU).
    pub fn record_routes(&mut self, on: bool) {
        self.session.record_routes(on);
    }

    /// One forward over `ids` appended to the sequence.
    pub(crate) fn forward(&mut self, ids: &[u32], want: Logits) -> Result<()> {
        self.batch.clear();
        self.batch.push(self.seq, ids, want);
        self.session.forward(&self.batch)?;
        self.tokens.extend_from_slice(ids);
        Ok(())
    }

    /// Copies the last position's logits for sampling, refusing non-finite values.
    pub(crate) fn take_logits(&mut self) -> Result<()> {
        let l = self.session.logits();
        let vocab = self.model.info().vocab_size;
        let last = &l[l.len() - vocab..];
        crate::sampling::check_finite(last, self.tokens.len())?;
        self.logits.clear();
        self.logits.extend_from_slice(last);
        Ok(())
    }

    /// Makes the cache hold `prompt` (reusing the common prefix with what it holds) and
    /// leaves the last position's logits ready; returns the tokens computed.
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<usize> {
        if prompt.is_empty() {
            bail!("the prompt is empty (no tokens to condition on)");
        }
        // Reuse the cached prefix; at least one prompt token must be computed for logits.
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let keep = common.min(prompt.len() - 1);
        self.session.truncate(self.seq, keep);
        // (A session whose sliding-window cache no longer holds what `keep` needs starts
        // the sequence over: its length says what it kept.)
        let keep = self.session.len(self.seq).min(keep);
        self.tokens.truncate(keep);
        let fresh = &prompt[keep..];
        let chunk = self.session.max_rows();
        let n = fresh.len().div_ceil(chunk);
        for (i, part) in fresh.chunks(chunk).enumerate() {
            self.forward(part, if i + 1 == n { Logits::Last } else { Logits::None })?;
        }
        self.take_logits()?;
        Ok(fresh.len())
    }

    /// Samples the next token from the ready logits.
    pub fn sample(&mut self, sampler: &mut Sampler) -> u32 {
        sampler.sample(&mut self.logits, &self.tokens)
    }

    /// Feeds one generated token and leaves its logits ready.
    pub fn step(&mut self, token: u32) -> Result<()> {
        self.forward(&[token], Logits::Last)?;
        self.take_logits()
    }

    /// Logits for `ids` from a fresh cache: every position, or the last.
    pub fn logits(&mut self, ids: &[u32], all_positions: bool) -> Result<Vec<Vec<f32>>> {
        if ids.is_empty() {
            bail!("no token ids to score");
        }
        if ids.len() > self.context() {
            bail!("{} ids do not fit the context of {} positions", ids.len(), self.context());
        }
        self.session.truncate(self.seq, 0);
        self.tokens.clear();
        let vocab = self.model.info().vocab_size;
        let chunk = self.session.max_rows();
        let n = ids.len().div_ceil(chunk);
        let mut out = Vec::new();
        for (i, part) in ids.chunks(chunk).enumerate() {
            let want = if all_positions {
                Logits::All
            } else if i + 1 == n {
                Logits::Last
            } else {
                Logits::None
            };
            self.forward(part, want)?;
            out.extend(self.session.logits().chunks(vocab).map(|r| r.to_vec()));
        }
        Ok(out)
    }

    /// The logits ready for sampling (the last position's).
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    /// The last forward's routing (complete while recording: [`Scorer::record_routes`]).
    pub fn routes(&self) -> &Routes {
        self.session.routes()
    }

    /// Starts the sequence over.
    pub fn reset(&mut self) {
        self.session.truncate(self.seq, 0);
        self.tokens.clear();
    }

    /// Logits per row.
    pub fn vocab(&self) -> usize {
        self.model.info().vocab_size
    }

    /// Forwards of at most this many rows.
    pub fn rows(&self) -> usize {
        self.session.max_rows()
    }

    /// Appends `ids` in one forward (at most [`Scorer::rows`]); with `logits`, returns
    /// every row's logits, refusing non-finite values.
    pub fn chunk(&mut self, ids: &[u32], logits: bool) -> Result<&[f32]> {
        self.forward(ids, if logits { Logits::All } else { Logits::None })?;
        let l = self.session.logits();
        if logits {
            if let Some(i) = l.iter().position(|v| !v.is_finite()) {
                let vocab = self.model.info().vocab_size;
                bail!("non-finite logit {} at vocabulary entry {}", l[i], i % vocab);
            }
        }
        Ok(l)
    }
}

//! The execution piece: one session holding every running sequence, one forward per
//! step over the rows the scheduler picked, a sample per request whose tokens are in.

use super::batch_drafts::BatchDrafts;
use super::draft_epochs::DraftEpochs;
pub(super) use super::draft_epochs::Step;
use super::prefix::PrefixCache;
use super::request::Active;
use super::schedule::{admits, plan_rows, shared_blocks};
use super::speculate::{draft_phase, Dims, DraftCounters, DraftScratch, Spec, VerifyScratch};
use super::speculation_memory::SpeculationMemory;
use super::{Finished, ServeRequest, Update};

mod fed;
use crate::generate::FinishReason;
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Result};
use std::collections::VecDeque;
use std::time::Instant;
use strata_backend::Draw;
use strata_models::kv::{KvBlocks, BLOCK_SIZE};
use strata_models::{Batch, Logits, Model, Session, SessionOptions};

#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Sequences running at once (`--max-batch`).
    pub max_batch: usize,
    /// KV positions shared by every running sequence and the prompt cache.
    pub kv_tokens: usize,
    /// Positions one sequence may hold (prompt and answer).
    pub context: usize,
    /// Rows one forward may carry: decode rows plus prompt chunks.
    pub step_tokens: usize,
    /// Bytes of KV the prompt cache may keep (within `kv_tokens`).
    pub prompt_cache_bytes: u64,
    /// KV bytes per position (the model family's), to size the cache in blocks.
    pub kv_bytes_per_token: u64,
    /// The most tokens the draft (MTP) layer proposes per step of a decoding request
    /// (0: no speculative decoding; needs a model with its draft layer loaded). Each
    /// request drafts up to its own `gen.draft_tokens` under its `gen.draft_policy`.
    pub draft_tokens: usize,
}

/// Counters over the engine's life, for `/stats` and `/metrics`.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct EngineCounters {
    pub steps: u64,
    pub rows: u64,
    pub decode_rows: u64,
    pub prefill_rows: u64,
    pub preemptions: u64,
    pub cache_hit_tokens: u64,
    pub cache_blocks: usize,
    pub cache_capacity_blocks: usize,
    pub cache_evicted_blocks: u64,
    pub kv_free_blocks: usize,
    pub kv_total_blocks: usize,
    pub running: usize,
    pub waiting: usize,
    /// Drafts a decoding request's step may verify (0: no speculative decoding).
    pub draft_tokens: usize,
    /// Speculative decoding (MTP) over the engine's life: verify rounds, drafts
    /// proposed and accepted, tokens those rounds emitted, and the draft layer's work.
    pub mtp_rounds: u64,
    pub mtp_drafted: u64,
    pub mtp_accepted: u64,
    pub mtp_tokens: u64,
    pub draft: DraftCounters,
    /// Steps with samples picked on the device, and those samples (one id came back for
    /// each, not its logits; the step's other samples read their logits; see
    /// [`BatchEngine::set_device_picks`]).
    pub picked_steps: u64,
    pub picked_samples: u64,
    /// Steps queued before the picks of the step before were read (fed steps: the device
    /// never waited for the host between them).
    pub fed_steps: u64,
}

pub struct BatchEngine<'m> {
    model: &'m dyn Model,
    tok: Option<&'m TextTokenizer>,
    session: Box<dyn Session + 'm>,
    opts: EngineOptions,
    cache: PrefixCache,
    waiting: VecDeque<Active>,
    /// In admission order.
    running: Vec<Active>,
    batch: Batch,
    /// Rows of each running request in the step being run.
    rows: Vec<usize>,
    logits: Vec<f32>,
    /// Greedy picks made on the device: when (`None`: where the logits live off the host)
    /// and the last step's.
    device_picks: Option<bool>,
    picks: Vec<u32>,
    next_id: u64,
    counters: EngineCounters,
    /// Drafts a round may verify (0: no speculation).
    gamma: usize,
    /// Whether requests keep their positions' hidden states (speculation with a prompt
    /// cache: a cached prefix hands them on to the draft layer).
    log_hidden: bool,
    dims: Dims,
    verify: VerifyScratch,
    /// The draft count of the adaptive requests, chosen for the batch each step.
    batch_drafts: BatchDrafts,
    draft_epochs: DraftEpochs,
    /// Where the measured rates with and without speculation are kept across runs, and
    /// rates measured but not yet written (written when the engine goes idle or is
    /// dropped: never from inside a step).
    speculation_memory: Option<SpeculationMemory>,
    unsaved_rates: Option<(f64, f64)>,
    /// Steps in a row whose adaptive requests drafted nothing.
    undrafted: u32,
    /// The requests whose samples the last fed step's forward picks (in its rows' order;
    /// None where the request ended since), not read yet ([`fed`]).
    inflight: Option<Vec<Option<u64>>>,
    /// Scratch of the fed steps: the next step's rows' requests, and their draws.
    fed_order: Vec<Option<u64>>,
    fed_draws: Vec<Draw>,
    scratch: StepScratch,
    /// Every forward's routing, written where asked (`--trace`).
    trace: Option<crate::generate::RouteTrace>,
}

/// What a step fills, kept from step to step so that a decode step allocates nothing.
#[derive(Default)]
struct StepScratch {
    /// Per running request (in order): tokens to feed, drafts to verify.
    pending: Vec<usize>,
    drafts: Vec<usize>,
    /// The adaptive requests (index, most drafts) and their bids.
    adaptive: Vec<(usize, usize)>,
    bids: Vec<(f64, usize)>,
    /// Per running request: what its rows want back, and whether the device picks its
    /// sample.
    kinds: Vec<Logits>,
    takes: Vec<bool>,
    /// Logits rows read beside the picks; one draw a logits row.
    read: Vec<u32>,
    draws: Vec<Draw>,
    /// Requests that ended (by index, in order), whose prompts' blocks go to the cache,
    /// and sequences to roll back after verification (seq, length, draft length).
    done: Vec<(usize, std::result::Result<FinishReason, String>)>,
    publish_at: Vec<usize>,
    truncate: Vec<(strata_models::SeqId, usize, usize)>,
    draft: DraftScratch,
}

/// Steps in a row that speculate but draft nothing before a speculating try ends.
const UNDRAFTED_MAX: u32 = 3;

fn kv<'a, 'm>(session: &'a mut Box<dyn Session + 'm>) -> &'a mut KvBlocks {
    session.kv_mut().expect("the serving engine needs a session with block KV")
}

impl Drop for BatchEngine<'_> {
    fn drop(&mut self) {
        self.save_rates();
    }
}

impl<'m> BatchEngine<'m> {
    pub fn new(model: &'m dyn Model, tok: Option<&'m TextTokenizer>, opts: EngineOptions) -> Result<Self> {
        if opts.max_batch == 0 || opts.step_tokens == 0 {
            bail!("max_batch and step_tokens must be at least 1");
        }
        let context = opts.context.min(model.info().max_context).max(1);
        if context > opts.kv_tokens {
            bail!(
                "the KV pool ({} positions) cannot hold one sequence of the context ({context} positions)",
                opts.kv_tokens
            );
        }
        let gamma = opts.draft_tokens;
        // Every decoding request's token and drafts fit one forward.
        if gamma > 0 && opts.step_tokens < opts.max_batch * (1 + gamma) {
            bail!(
                "a step of {} rows cannot verify {gamma} drafts for each of {} requests",
                opts.step_tokens,
                opts.max_batch
            );
        }
        let opts = EngineOptions { context, step_tokens: opts.step_tokens.max(opts.max_batch), ..opts };
        let mut session = model.new_session(SessionOptions {
            max_seqs: opts.max_batch,
            kv_tokens: opts.kv_tokens,
            max_len: context,
            max_rows: opts.step_tokens,
        })?;
        // Nothing here reads the routing back: leave it on the device.
        session.record_routes(false);
        let Some(pool) = session.kv() else { bail!("this model's sessions do not keep block KV") };
        if gamma > 0 && !session.has_draft() {
            bail!("speculative decoding ({gamma} draft tokens) needs the model's draft (MTP) layer loaded");
        }
        let h = model.info().hidden_size;
        // With speculation, a cached block also keeps its positions' hidden states.
        let hidden_bytes = if gamma > 0 { (BLOCK_SIZE * h * 4) as u64 } else { 0 };
        let block_bytes = (opts.kv_bytes_per_token * BLOCK_SIZE as u64 + hidden_bytes).max(1);
        let cache_blocks = match session.shares_prefixes() {
            true => ((opts.prompt_cache_bytes / block_bytes) as usize).min(pool.total_blocks()),
            false => 0,
        };
        Ok(Self {
            model,
            tok,
            session,
            opts,
            cache: PrefixCache::new(cache_blocks),
            waiting: VecDeque::new(),
            running: Vec::with_capacity(opts.max_batch),
            batch: Batch::new(),
            rows: Vec::new(),
            logits: Vec::new(),
            device_picks: None,
            picks: Vec::new(),
            next_id: 0,
            counters: EngineCounters::default(),
            gamma,
            log_hidden: gamma > 0 && cache_blocks > 0,
            dims: Dims { vocab: model.info().vocab_size, hidden: h },
            verify: VerifyScratch::default(),
            batch_drafts: BatchDrafts::new(),
            draft_epochs: DraftEpochs::new(),
            speculation_memory: None,
            unsaved_rates: None,
            undrafted: 0,
            inflight: None,
            fed_order: Vec::with_capacity(opts.max_batch),
            fed_draws: Vec::with_capacity(opts.max_batch),
            scratch: StepScratch::default(),
            trace: None,
        })
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    /// Keeps what the engine measures about speculating in `model_dir` (see
    /// [`super::speculation_memory`]), and starts from what an earlier engine kept there
    /// for this device and batch size. Without a draft layer it does nothing.
    pub fn remember_speculation(&mut self, model_dir: &std::path::Path) {
        if self.gamma == 0 {
            return;
        }
        let memory = SpeculationMemory::new(model_dir, &self.model.device(), self.opts.max_batch);
        if let Some(r) = memory.start() {
            self.draft_epochs = DraftEpochs::from_rates(r.plain_tokens_per_s, r.speculating_tokens_per_s);
        }
        self.speculation_memory = Some(memory);
    }

    /// Queues a request; its updates come out of [`BatchEngine::step`] under the id.
    pub fn submit(&mut self, req: ServeRequest) -> Result<u64> {
        let id = self.next_id;
        let mut a = Active::new(id, req, self.opts.context)?;
        if self.gamma > 0 && a.req.media.is_none() {
            // (A grammar's forced tokens and masks follow one token at a time: constrained
            // requests decode without drafts.)
            let g = &a.req.gen;
            let gamma = g.draft_tokens.min(self.gamma);
            // An adaptive request speculates when admitted in an epoch that does.
            let pays = !g.draft_policy.adapts() || self.draft_epochs.on();
            if a.req.constraint.is_none() && gamma > 0 {
                let spec = Spec::new(gamma, g.draft_policy.adapts());
                match pays {
                    true => a.spec = Some(spec),
                    // Not speculating now: its stats say so (dormant from the first token).
                    false => {
                        let mut stats = spec.finished_stats();
                        stats.dormant_after_tokens = Some(0);
                        a.dropped_spec = Some(stats);
                    }
                }
            }
            if self.log_hidden {
                a.hidden_log = Some(Vec::new());
            }
        }
        self.next_id += 1;
        self.waiting.push_back(a);
        Ok(id)
    }

    /// Drops a request wherever it is; its sequence's blocks go back (its full blocks
    /// to the prompt cache). Returns the request's output so far, if it was known.
    pub fn cancel(&mut self, id: u64) -> Option<Finished> {
        if let Some(i) = self.waiting.iter().position(|a| a.id == id) {
            let mut a = self.waiting.remove(i).expect("found above");
            return Some(self.finish(&mut a, FinishReason::Cancelled));
        }
        let i = self.running.iter().position(|a| a.id == id)?;
        let mut a = self.running.remove(i);
        if let Some(slot) = self.inflight.as_mut().and_then(|f| f.iter_mut().find(|s| **s == Some(id))) {
            // Its pick in flight is dropped when read.
            *slot = None;
        }
        self.release(&mut a);
        Some(self.finish(&mut a, FinishReason::Cancelled))
    }

    /// Ends every request now (server shutdown): running ones finish with `Stop` and
    /// their output so far; waiting ones are refused with `why`.
    pub fn shut_down(&mut self, why: &str, out: &mut Vec<(u64, Update)>) {
        self.drop_inflight();
        while let Some(mut a) = self.running.pop() {
            self.release(&mut a);
            let f = self.finish(&mut a, FinishReason::Stop);
            out.push((a.id, Update::Done(Ok(Box::new(f)))));
        }
        while let Some(a) = self.waiting.pop_front() {
            out.push((a.id, Update::Done(Err(why.to_string()))));
        }
    }

    /// Records every forward's routing to `trace` from now on (strata-residency's trace
    /// format, which `strata replay` reads; a [`BatchEngine::generate`] is a segment).
    /// Steps are then never fed (a forward queued past a request's end would be traced).
    pub fn set_trace(&mut self, trace: crate::generate::RouteTrace) {
        self.trace = Some(trace);
        self.session.record_routes(true);
    }

    /// Runs `req` to its end on an idle engine (the CLI's generation: a batch of one),
    /// calling `on_text` with each piece of text as it is decided; `on_text` returning
    /// false cancels the request (its output so far is returned). A failure of the
    /// request is this call's error.
    pub fn generate(&mut self, req: ServeRequest, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Finished> {
        if !self.is_idle() {
            bail!(
                "generate runs one request on an idle engine ({} running, {} waiting)",
                self.running.len(),
                self.waiting.len()
            );
        }
        let id = self.submit(req)?;
        let mut out = Vec::new();
        let finished = 'steps: loop {
            self.step(&mut out)?;
            for (_, u) in out.drain(..) {
                match u {
                    Update::Delta { text, .. } => {
                        if !text.is_empty() && !on_text(&text) {
                            let f = self.cancel(id).expect("the request is in the engine");
                            break 'steps Ok(f);
                        }
                    }
                    Update::Done(r) => break 'steps r.map(|f| *f).map_err(|e| anyhow::anyhow!(e)),
                }
            }
        };
        if let Some(t) = self.trace.as_mut() {
            t.flush()?;
            t.segment += 1;
        }
        finished
    }

    /// Tokens a running request has generated so far (None once it is not running).
    pub fn generated(&self, id: u64) -> Option<usize> {
        self.running.iter().chain(&self.waiting).find(|a| a.id == id).map(|a| a.out.len())
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Ids of the requests the engine holds (running and waiting).
    pub fn ids(&self) -> Vec<u64> {
        self.running.iter().chain(&self.waiting).map(|a| a.id).collect()
    }

    pub fn counters(&self) -> EngineCounters {
        let pool = self.session.kv();
        EngineCounters {
            cache_hit_tokens: self.cache.hit_tokens,
            cache_blocks: self.cache.len(),
            cache_capacity_blocks: self.cache.capacity(),
            cache_evicted_blocks: self.cache.evicted_blocks,
            kv_free_blocks: pool.map_or(0, KvBlocks::free_blocks),
            kv_total_blocks: pool.map_or(0, KvBlocks::total_blocks),
            running: self.running.len(),
            waiting: self.waiting.len(),
            draft_tokens: self.gamma,
            ..self.counters
        }
    }

    /// Offers `a`'s full blocks to the prompt cache and frees its sequence.
    fn release(&mut self, a: &mut Active) {
        if let Some(seq) = a.seq.take() {
            let pool = kv(&mut self.session);
            let full = if a.media.is_some() { 0 } else { a.computed.min(a.tokens.len()) / BLOCK_SIZE };
            let blocks = pool.blocks_of(seq)[..full.min(pool.blocks_of(seq).len())].to_vec();
            publish(&mut self.cache, pool, a, &blocks, self.dims.hidden);
            self.session.remove_sequence(seq);
        }
    }

    fn finish(&mut self, a: &mut Active, reason: FinishReason) -> Finished {
        let (output, stop_sequence, logprobs) = a.output(reason);
        Finished { output, stop_sequence, logprobs, queue_wait_s: a.queue_wait_s(), preemptions: a.preemptions }
    }

    /// Starts waiting requests while the batch and the KV pool have room: each takes a
    /// sequence that starts from its longest cached prefix.
    fn admit(&mut self, out: &mut Vec<(u64, Update)>) -> Result<()> {
        let mut i = 0;
        while self.running.len() < self.opts.max_batch && i < self.waiting.len() {
            if let Err(e) = self.encode_media(i) {
                let a = self.waiting.remove(i).expect("in range");
                out.push((a.id, Update::Done(Err(format!("{e:#}")))));
                continue;
            }
            let a = &self.waiting[i];
            // (Image placeholders say nothing of the image: such prompts share no cache.)
            let media = a.media.is_some();
            let mut hidden = Vec::new();
            // Only a speculating request needs the cached positions' hidden states (for
            // its draft layer); a plain one takes every cached block.
            let want_hidden = a.spec.is_some().then_some(&mut hidden);
            let cached = if media { Vec::new() } else { self.cache.lookup_with(&a.tokens, want_hidden) };
            // A prompt that shares more whole blocks with one still being computed waits
            // for it (then finds them in the cache) instead of computing them twice: the
            // choices of one request, a burst with a common system prompt.
            let usable = (a.tokens.len() - 1) / BLOCK_SIZE;
            let pending = self
                .running
                .iter()
                .filter(|r| r.computed < r.prompt_len)
                .map(|r| shared_blocks(&a.tokens, &r.tokens[..r.prompt_len]).min(usable))
                .max()
                .unwrap_or(0);
            if pending > cached.len() && !media {
                i += 1;
                continue;
            }
            let pool = self.session.kv().expect("block KV");
            let need = (a.tokens.len() + 1).div_ceil(BLOCK_SIZE) - cached.len();
            // The cached prefix is in use from now on: only the rest can be evicted.
            let available = pool.free_blocks() + self.cache.evictable(pool).saturating_sub(cached.len());
            if !admits(need, available, self.running.len()) {
                break;
            }
            let mut a = self.waiting.remove(i).expect("checked above");
            let seq = self.session.add_sequence()?;
            kv(&mut self.session).attach(seq, &cached)?;
            self.cache.hit_tokens += (cached.len() * BLOCK_SIZE) as u64;
            a.seq = Some(seq);
            a.admitted(cached.len() * BLOCK_SIZE);
            // The cached positions' draft rows are owed: the draft cache starts complete.
            if let Some(s) = a.spec.as_mut() {
                s.record_hidden(&a.tokens, 0, &hidden, self.dims.hidden);
            }
            if a.spec.is_none() && !cached.is_empty() {
                // Its log could not start at position 0: it keeps none.
                a.hidden_log = None;
            }
            if let Some(log) = a.hidden_log.as_mut() {
                *log = hidden;
                // Room for every position the request may reach.
                log.reserve((a.tokens.capacity() * self.dims.hidden).saturating_sub(log.len()));
            }
            self.running.push(a);
        }
        Ok(())
    }

    /// Encodes the images of waiting request `i` (once): the tower runs on this thread,
    /// beside no forward.
    fn encode_media(&mut self, i: usize) -> Result<()> {
        let a = &mut self.waiting[i];
        let Some(input) = a.req.media.as_ref().filter(|_| a.media.is_none()) else { return Ok(()) };
        let media = crate::media::encode_with(self.model, &input.processor, &input.images)?;
        let spec = self.model.vision().expect("encoded by the tower").spec();
        crate::media::check_placeholders(&a.tokens, &media)?;
        let run = crate::media::longest_run(&a.tokens, media.placeholder);
        if spec.bidirectional && run > self.opts.step_tokens {
            bail!(
                "an image of {run} soft tokens attends to itself in one forward, which holds {} rows (raise --step-tokens)",
                self.opts.step_tokens
            );
        }
        a.media = Some((media, spec.bidirectional));
        Ok(())
    }

    /// Plans the step's rows and makes room for their KV: evicting cached prefixes, then
    /// preempting the newest requests. Returns false when nothing runs.
    fn plan(&mut self, out: &mut Vec<(u64, Update)>) -> bool {
        // Drafts each decoding request would verify: within its context and token limit.
        let context = self.opts.context;
        let sc = &mut self.scratch;
        sc.adaptive.clear();
        sc.bids.clear();
        for (i, a) in self.running.iter_mut().enumerate().filter(|(_, a)| a.decoding()) {
            let room = context.saturating_sub(a.tokens.len()).min(a.req.gen.max_tokens.saturating_sub(a.out.len() + 1));
            match a.spec.as_mut() {
                Some(s) if s.adaptive => {
                    let bid = s.batch_bid(room);
                    sc.adaptive.push((i, bid.1));
                    sc.bids.push(bid);
                }
                Some(s) => s.want = s.choose(room),
                None => {}
            }
        }
        if !sc.adaptive.is_empty() {
            let g = self.batch_drafts.choose(&sc.bids);
            for &(i, most) in &sc.adaptive {
                self.running[i].spec.as_mut().expect("adaptive").want = g.min(most);
            }
            // Steps in a row that speculate but draft nothing end the epoch's try.
            self.undrafted = if g == 0 { self.undrafted + 1 } else { 0 };
            if self.undrafted >= UNDRAFTED_MAX {
                self.draft_epochs.cut_short();
            }
        }
        loop {
            let sc = &mut self.scratch;
            sc.pending.clear();
            sc.pending.extend(self.running.iter().map(Active::to_feed));
            sc.drafts.clear();
            sc.drafts
                .extend(self.running.iter().map(|a| a.spec.as_ref().filter(|_| a.decoding()).map_or(0, |s| s.want)));
            plan_rows(&sc.pending, &sc.drafts, self.opts.step_tokens, &mut self.rows);
            // A bidirectional image's run stays in one forward.
            for (a, n) in self.running.iter().zip(self.rows.iter_mut()) {
                if let Some((m, true)) = &a.media {
                    *n = crate::media::whole_runs(&a.tokens, a.computed, *n, m.placeholder);
                }
            }
            let pool = self.session.kv().expect("block KV");
            let need: usize =
                self.running.iter().zip(&self.rows).map(|(a, &n)| a.seq.map_or(0, |s| pool.blocks_needed(s, n))).sum();
            let free = pool.free_blocks();
            if need <= free {
                return self.rows.iter().any(|&n| n > 0);
            }
            let pool = kv(&mut self.session);
            if self.cache.evict(pool, need - free) > 0 {
                continue;
            }
            let Some(mut victim) = self.running.pop() else { return false };
            if self.running.is_empty() {
                // Alone and still without room: the pool cannot hold it.
                self.release(&mut victim);
                let msg = format!(
                    "the KV cache ({} positions) cannot hold this sequence of {} positions",
                    self.opts.kv_tokens,
                    victim.tokens.len()
                );
                out.push((victim.id, Update::Done(Err(msg))));
                return false;
            }
            self.release(&mut victim);
            victim.restart();
            self.counters.preemptions += 1;
            self.waiting.push_front(victim);
        }
    }

    /// Whether each sample of a step the device can make ([`Active::picks_on_device`]) is
    /// picked on the device, one id read back instead of its logits (the step's other
    /// samples read their own logits rows), and whether steps where every request decodes
    /// such a sample are fed (the picks feed the next forward on the device: [`fed`]):
    /// `None` (the default) where the logits live off the host (a GPU), `Some(on)` either
    /// way. Outputs are the same.
    pub fn set_device_picks(&mut self, on: Option<bool>) {
        self.device_picks = on;
    }

    /// Runs one step: admits what fits, drafts for the decoding requests that
    /// speculate, one forward over the planned rows, a sample (or a verification of
    /// drafts) for every request whose pending tokens are all in. Updates go to `out`. An
    /// error fails the requests of this forward (and only them); the engine goes on.
    pub fn step(&mut self, out: &mut Vec<(u64, Update)>) -> Result<()> {
        let r = self.step_once(out);
        if self.is_idle() {
            self.save_rates();
        }
        r
    }

    /// Writes measured rates not yet kept.
    fn save_rates(&mut self) {
        if let (Some(memory), Some((plain, spec))) = (&self.speculation_memory, self.unsaved_rates.take()) {
            memory.keep(plain, spec);
        }
    }

    fn step_once(&mut self, out: &mut Vec<(u64, Update)>) -> Result<()> {
        if self.fed_ready() {
            return self.step_fed(out);
        }
        self.settle_inflight(out)?;
        self.admit(out)?;
        if !self.plan(out) {
            return Ok(());
        }
        let (t_step, forwards0) = (Instant::now(), self.counters.draft.forwards);
        if self.gamma > 0 {
            let (session, running, rows, batch) =
                (&mut self.session, &mut self.running, &mut self.rows, &mut self.batch);
            let (scratch, counters) = (&mut self.scratch.draft, &mut self.counters.draft);
            if let Err(e) = draft_phase(session.as_mut(), self.dims, running, rows, batch, scratch, counters) {
                let ids = self.running.iter().filter(|a| a.spec.is_some()).map(|a| a.id).collect();
                self.fail(ids, &format!("generation failed: draft layer: {e:#}"), out);
                return Ok(());
            }
        }
        self.batch.clear();
        let kinds = &mut self.scratch.kinds;
        kinds.clear();
        for (a, &n) in self.running.iter().zip(&self.rows) {
            let seq = a.seq.expect("running");
            if n > 1 && a.decoding() {
                // The last sample and the drafts after it, each with its logits.
                let drafts = &a.spec.as_ref().expect("only speculating requests verify").drafts;
                debug_assert_eq!(drafts.len(), n - 1);
                self.batch.push(seq, &a.tokens[a.computed..], Logits::All);
                self.batch.push(seq, &drafts[..n - 1], Logits::All);
                kinds.push(Logits::All);
                continue;
            }
            let last = a.computed + n == a.tokens.len();
            let logged = a.hidden_log.is_some() || a.spec.is_some();
            let want = match (last, logged) {
                (true, true) => Logits::HiddenAll,
                (true, false) => Logits::Last,
                (false, true) => Logits::Hidden,
                (false, false) => Logits::None,
            };
            kinds.push(want);
            if n == 0 {
                continue;
            }
            let ids = &a.tokens[a.computed..a.computed + n];
            match &a.media {
                Some((m, _)) => {
                    let mut used = a.tokens[..a.computed].iter().filter(|&&t| t == m.placeholder).count();
                    crate::media::push_rows(&mut self.batch, seq, ids, m, &mut used, want);
                }
                None => self.batch.push(seq, ids, want),
            }
        }
        // The device picks this step's plain greedy samples; the other samples' (and
        // verifications') logits rows come back beside the picks.
        let on = self.device_picks.unwrap_or_else(|| self.session.picks_on_device());
        let StepScratch { kinds, takes, read, draws, .. } = &mut self.scratch;
        takes.clear();
        read.clear();
        draws.clear();
        let mut k = 0u32;
        // One draw a logits row: a taken sample's (greedy or keyed), greedy for the rest.
        for ((a, &n), &kind) in self.running.iter_mut().zip(&self.rows).zip(kinds.iter()) {
            let lrows = if n == 0 { 0 } else { outputs(kind, n).0 as u32 };
            let take = on && lrows > 0 && kind != Logits::All && a.picks_on_device();
            if take {
                // A taken row is the request's last (Logits::Last or HiddenAll).
                draws.extend((1..lrows).map(|_| Draw::GREEDY));
                draws.push(a.next_draw());
            } else {
                read.extend(k..k + lrows);
                draws.extend((0..lrows).map(|_| Draw::GREEDY));
            }
            takes.push(take);
            k += lrows;
        }
        let pick = takes.iter().any(|&t| t);
        if pick {
            self.batch.pick_greedy();
            self.batch.read_logits_rows(read.iter().copied());
            if draws.iter().any(|d| !d.is_greedy()) {
                self.batch.draw_rows(draws.iter().copied());
            }
        }
        // Grammar masks for this step's samples, computed while the forward runs.
        let vocab = self.model.info().vocab_size;
        let (session, running, rows, batch) = (&mut self.session, &mut self.running, &self.rows, &self.batch);
        let wants_mask = |(a, n): &(&mut Active, &usize)| **n > 0 && a.computed + **n == a.tokens.len();
        let t_forward = Instant::now();
        let (forward, masks) = match running.iter().any(Active::constrained) {
            false => (session.forward(batch), Vec::new()),
            true => std::thread::scope(|s| {
                let masked: Vec<&mut Active> =
                    running.iter_mut().zip(rows).filter(|x| wants_mask(x) && x.0.constrained()).map(|x| x.0).collect();
                let h = (!masked.is_empty()).then(|| {
                    s.spawn(move || masked.into_iter().map(|a| (a.id, a.fill_mask(vocab))).collect::<Vec<_>>())
                });
                let forward = session.forward(batch);
                (forward, h.map(|h| h.join().unwrap_or_default()).unwrap_or_default())
            }),
        };
        let forward = match (forward, self.trace.as_mut()) {
            (Ok(()), Some(trace)) => trace.record(self.session.routes()),
            (r, _) => r,
        };
        if self.gamma > 0 {
            let drafts: usize =
                self.running.iter().zip(&self.rows).filter(|(a, &n)| n > 1 && a.decoding()).map(|(_, &n)| n - 1).sum();
            let decoding: usize =
                self.running.iter().zip(&self.rows).filter(|(a, _)| a.decoding()).map(|(_, &n)| n).sum();
            let forwards = (self.counters.draft.forwards - forwards0) as usize;
            let prompt = self.batch.len() - decoding;
            self.batch_drafts.observe(decoding, prompt, drafts, forwards, t_step.elapsed().as_secs_f64());
        }
        self.counters.steps += 1;
        self.counters.rows += self.batch.len() as u64;
        let decode: usize =
            self.rows.iter().zip(&self.running).filter(|(_, a)| a.pending() == 1).map(|(&n, _)| n).sum();
        self.counters.decode_rows += decode as u64;
        self.counters.prefill_rows += (self.batch.len() - decode) as u64;
        let forward = match pick {
            true => forward.and_then(|()| self.session.take_picks(&mut self.picks)),
            false => forward,
        };
        let forward_s = t_forward.elapsed().as_secs_f64();
        self.counters.picked_steps += u64::from(pick);
        self.counters.picked_samples += self.scratch.takes.iter().filter(|&&t| t).count() as u64;
        if let Err(e) = forward {
            let planned = self.running.iter().zip(&self.rows).filter(|(_, &n)| n > 0).map(|(a, _)| a.id).collect();
            self.fail(planned, &format!("generation failed: {e:#}"), out);
            return Ok(());
        }
        let failed_masks: Vec<(u64, String)> =
            masks.into_iter().filter_map(|(id, r)| r.err().map(|e| (id, format!("grammar: {e:#}")))).collect();
        // Samples and verifications, in batch order (the order of the output rows).
        let (mut k, mut hr) = (0, 0);
        let mut emitted = 0u64;
        let decoding_requests = self.running.iter().zip(&self.rows).filter(|(a, &n)| n > 0 && a.decoding()).count();
        let decoding_step = decoding_requests > 0;
        let StepScratch { kinds, takes, done, publish_at, truncate, .. } = &mut self.scratch;
        done.clear();
        publish_at.clear();
        truncate.clear();
        let (logits_all, hidden_all, context) = (self.session.logits(), self.session.hidden(), self.opts.context);
        let (h, c) = (self.dims.hidden, &mut self.counters);
        for (i, a) in self.running.iter_mut().enumerate() {
            let n = self.rows[i];
            if n == 0 {
                continue;
            }
            let (lrows, hrows) = outputs(kinds[i], n);
            // (A sample the device picked has no logits on the host: row k's pick stands in.
            // In a picking step only the rows read beside the picks are on the host.)
            let take = takes[i];
            let logits = if take || lrows == 0 { &[][..] } else { &logits_all[k * vocab..(k + lrows) * vocab] };
            let hidden = &hidden_all[hr * h..(hr + hrows) * h];
            let picked = self.picks.get(k).copied();
            (k, hr) = (k + lrows, hr + hrows);
            if kinds[i] == Logits::All {
                // A speculative round: keep the agreed drafts, roll back the rest.
                let mut s = a.spec.take().expect("verifying");
                let (p0, g) = (a.computed, n - 1);
                let r = a.verify(logits, vocab, &s.drafts[..g], &mut self.verify, self.tok, context);
                let (update, finish, accepted) = match r {
                    Ok(x) => x,
                    Err(e) => {
                        a.spec = Some(s);
                        done.push((i, Err(format!("generation failed: {e:#}"))));
                        continue;
                    }
                };
                let kept = accepted + 1;
                emitted += kept as u64;
                a.computed = (p0 + kept).min(a.tokens.len());
                truncate.push((a.seq.expect("running"), a.computed, p0));
                if let Some(log) = a.hidden_log.as_mut() {
                    log.extend_from_slice(&hidden[..kept * h]);
                }
                s.record_hidden(&a.tokens, p0, &hidden[..kept * h], h);
                s.record_round(g, accepted, kept);
                a.spec = Some(s);
                (c.mtp_rounds, c.mtp_drafted) = (c.mtp_rounds + 1, c.mtp_drafted + g as u64);
                (c.mtp_accepted, c.mtp_tokens) = (c.mtp_accepted + accepted as u64, c.mtp_tokens + kept as u64);
                if let Some(u) = update {
                    out.push((a.id, u));
                }
                if let Some(f) = finish {
                    done.push((i, Ok(f)));
                }
                continue;
            }
            let (from, was_decoding) = (a.computed, a.decoding());
            a.computed += n;
            if hrows == n && (a.hidden_log.is_some() || a.spec.is_some()) {
                if let Some(log) = a.hidden_log.as_mut() {
                    log.extend_from_slice(hidden);
                }
                if let Some(s) = a.spec.as_mut() {
                    s.record_hidden(&a.tokens, from, hidden, h);
                }
            }
            if a.computed < a.tokens.len() {
                continue;
            }
            if let Some((_, e)) = failed_masks.iter().find(|(id, _)| *id == a.id) {
                done.push((i, Err(e.clone())));
                continue;
            }
            if a.out.is_empty() && a.computed == a.prompt_len {
                publish_at.push(i);
            }
            let sampled = match (take, picked) {
                (true, Some(p)) => a.take_pick(p, self.tok, context),
                (true, None) => Err(anyhow::anyhow!("the device returned no pick for this request")),
                (false, _) => {
                    self.logits.clear();
                    self.logits.extend_from_slice(&logits[..vocab]);
                    a.sample(&mut self.logits, self.tok, context)
                }
            };
            match sampled {
                Ok((update, finish)) => {
                    emitted += 1;
                    if let Some(s) = a.spec.as_mut() {
                        s.settle(&a.tokens, a.computed);
                        match was_decoding {
                            true => {
                                s.record_round(0, 0, 1);
                                (c.mtp_rounds, c.mtp_tokens) = (c.mtp_rounds + 1, c.mtp_tokens + 1);
                            }
                            false => s.stats.tokens += 1,
                        }
                    }
                    if let Some(u) = update {
                        out.push((a.id, u));
                    }
                    if let Some(f) = finish {
                        done.push((i, Ok(f)));
                    }
                }
                Err(e) => done.push((i, Err(format!("generation failed: {e:#}")))),
            }
        }
        for &(seq, len, draft_len) in truncate.iter() {
            self.session.truncate(seq, len);
            self.session.draft_truncate(seq, draft_len);
        }
        if decoding_step {
            let speculating = self.running.iter().any(|a| a.spec.is_some() && a.decoding());
            self.record_epoch_step(Step {
                tokens: emitted,
                seconds: t_step.elapsed().as_secs_f64(),
                requests: decoding_requests as u64,
                forward_seconds: forward_s,
                speculating,
            });
        }
        // Prompts that are in: their full blocks join the prompt cache now, so that
        // requests arriving meanwhile can share them.
        for j in 0..self.scratch.publish_at.len() {
            let a = &self.running[self.scratch.publish_at[j]];
            if a.media.is_some() {
                continue;
            }
            let pool = kv(&mut self.session);
            let blocks = pool.blocks_of(a.seq.expect("running"))[..a.prompt_len / BLOCK_SIZE].to_vec();
            publish(&mut self.cache, pool, a, &blocks, self.dims.hidden);
            // A request that does not speculate has no use for its decode rows' hidden
            // states: its prompt's went to the cache with its blocks; logging on would
            // read a hidden row back every step and keep it from fed steps' logs.
            let a = &mut self.running[self.scratch.publish_at[j]];
            if a.spec.is_none() {
                a.hidden_log = None;
            }
        }
        while let Some((i, result)) = self.scratch.done.pop() {
            let mut a = self.running.remove(i);
            self.release(&mut a);
            let update = match result {
                Ok(reason) => Update::Done(Ok(Box::new(self.finish(&mut a, reason)))),
                Err(e) => Update::Done(Err(e)),
            };
            out.push((a.id, update));
        }
        Ok(())
    }

    /// A decoding step (ordinary or fed) for the draft epochs: the switch it brings, and
    /// newly measured rates noted for the memory (see `unsaved_rates`).
    pub(super) fn record_epoch_step(&mut self, step: Step) {
        if self.gamma == 0 {
            return;
        }
        let measured = self.draft_epochs.measured();
        if self.draft_epochs.record(step) == Some(false) {
            self.stop_speculating();
        }
        let now = self.draft_epochs.measured();
        if self.speculation_memory.is_some() && now.is_some() && now != measured {
            self.unsaved_rates = now;
        }
    }

    /// An epoch without speculation begins: the adaptive requests running decode on
    /// without the draft layer (their draft caches are dropped).
    fn stop_speculating(&mut self) {
        for a in self.running.iter_mut() {
            if a.spec.as_ref().is_none_or(|s| !s.adaptive) {
                continue;
            }
            let mut s = a.spec.take().expect("checked");
            let mut stats = s.finished_stats();
            stats.dormant_after_tokens = Some(stats.tokens);
            s.reset();
            a.dropped_spec = Some(stats);
            // Its hidden states stop here (see the prompt publication in `step`).
            if a.computed >= a.prompt_len {
                a.hidden_log = None;
            }
            if let Some(seq) = a.seq {
                self.session.draft_truncate(seq, 0);
            }
            self.counters.draft.given_up += 1;
        }
    }

    /// Fails the running requests `ids` with `msg` (their sequences are dropped).
    fn fail(&mut self, ids: Vec<u64>, msg: &str, out: &mut Vec<(u64, Update)>) {
        for id in ids {
            let i = self.running.iter().position(|a| a.id == id).expect("running");
            let mut a = self.running.remove(i);
            if let Some(seq) = a.seq.take() {
                self.session.remove_sequence(seq);
            }
            out.push((id, Update::Done(Err(msg.to_string()))));
        }
    }

    /// Fails every request (after a panic left the session in an unknown state) and
    /// starts from a fresh session.
    pub fn reset(&mut self, why: &str, out: &mut Vec<(u64, Update)>) -> Result<()> {
        // (The session is replaced: its picks in flight go with it.)
        self.inflight = None;
        for a in self.running.drain(..).chain(self.waiting.drain(..)) {
            out.push((a.id, Update::Done(Err(why.to_string()))));
        }
        self.cache.clear(None);
        self.session = self.model.new_session(SessionOptions {
            max_seqs: self.opts.max_batch,
            kv_tokens: self.opts.kv_tokens,
            max_len: self.opts.context,
            max_rows: self.opts.step_tokens,
        })?;
        self.session.record_routes(false);
        Ok(())
    }
}

/// (logits rows, hidden rows) a push of `n` rows asks for.
fn outputs(kind: Logits, n: usize) -> (usize, usize) {
    match kind {
        Logits::None => (0, 0),
        Logits::Last => (1, 1),
        Logits::All => (n, n),
        Logits::HiddenAll => (1, n),
        Logits::Hidden => (0, n),
    }
}

/// Offers `blocks` (the first of `a`'s sequence) to the prompt cache, with their
/// positions' hidden states where the request keeps them.
fn publish(cache: &mut PrefixCache, pool: &mut KvBlocks, a: &Active, blocks: &[u32], h: usize) {
    if let Some(log) = a.hidden_log.as_deref() {
        let n = blocks.len().min(log.len() / (h * BLOCK_SIZE).max(1));
        let t = n * BLOCK_SIZE;
        cache.insert_with(pool, &a.tokens[..t], &blocks[..n], Some(&log[..t * h]));
    }
    // The blocks past the log (all of them without one) go in without hidden states.
    cache.insert(pool, &a.tokens[..blocks.len() * BLOCK_SIZE], blocks);
}

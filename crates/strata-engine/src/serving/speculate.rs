//! Speculative decoding in the serving engine, with the model's draft (MTP) layer.
//!
//! The same round as [`crate::speculative`], for every decoding request of a step at
//! once: one draft forward writes each request's owed draft-cache rows and drafts its
//! first token, `gamma - 1` more draft forwards of one row a request chain the rest, and
//! the step's target forward verifies each request's token and drafts beside the other
//! requests' rows. Acceptance is per request ([`super::request::Active::verify`]) and
//! coupled ([`crate::speculative`]), so a request's tokens are those it would sample
//! without drafts.
//!
//! The draft cache follows the target's: its row for position `p` pairs the target's
//! final hidden state at `p` with the token at `p + 1`. A row becomes writable once the
//! token after a position is known ("owed" until the next draft forward). A request that
//! starts from the prompt cache gets the cached positions' hidden states with the blocks
//! (the cache keeps them while speculation is on), so its draft cache is complete and
//! its drafts do not depend on what the cache held.

use super::request::Active;
use crate::draft_policy::Acceptance;
use crate::speculative::MtpStats;
use anyhow::Result;
use strata_models::{Batch, Logits, Session};

/// Owed draft rows a request that is not drafting may hold before they are written.
const OWED_MAX: usize = 64;

/// Scratch for [`Active::verify`].
#[derive(Default)]
pub(crate) struct VerifyScratch {
    pub context: Vec<u32>,
    pub logits: Vec<f32>,
}

/// What the draft phase fills, kept from step to step so that it allocates nothing.
#[derive(Default)]
pub(crate) struct DraftScratch {
    /// Requests (by index) drafting this step, and those whose owed rows a forward writes.
    drafters: Vec<usize>,
    written: Vec<usize>,
    /// The draft forward's input hidden states.
    hidden: Vec<f32>,
    /// Drafting requests still chaining drafts.
    live: Vec<usize>,
    /// Owed rows a bulk forward writes: (request, rows of its owed list).
    parts: Vec<(usize, usize)>,
    draw: VerifyScratch,
}

/// A request's speculation state.
pub(crate) struct Spec {
    acceptance: Acceptance,
    /// Most drafts a step (the request's own count, within the engine's).
    gamma: usize,
    /// Whether the engine chooses the drafts for this request with the batch's other
    /// adaptive requests (`super::batch_drafts`) instead of a fixed count.
    pub adaptive: bool,
    pub stats: MtpStats,
    /// Draft-cache rows ready to write: a token and the target's hidden state at the
    /// position before it.
    owed_tokens: Vec<u32>,
    owed_hidden: Vec<f32>,
    /// The target's hidden state at the last computed position, until the token after
    /// it is known (`has_last`); the buffer stays to be reused.
    h_last: Vec<f32>,
    has_last: bool,
    /// This round's drafts.
    pub drafts: Vec<u32>,
    /// Drafts the round plans (set before the step's rows are planned).
    pub want: usize,
    /// The draft layer's hidden state after the last draft (input of the next).
    h_draft: Vec<f32>,
    /// Draft forwards this round ran for the request.
    forwards: usize,
}

impl Spec {
    pub fn new(gamma: usize, adaptive: bool) -> Self {
        let policy = if adaptive { "adaptive" } else { "fixed" };
        Self {
            acceptance: Acceptance::default(),
            gamma,
            adaptive,
            stats: MtpStats { draft_tokens: gamma, policy, ..Default::default() },
            owed_tokens: Vec::new(),
            owed_hidden: Vec::new(),
            h_last: Vec::new(),
            has_last: false,
            drafts: Vec::new(),
            want: 0,
            h_draft: Vec::new(),
            forwards: 0,
        }
    }

    /// Forgets everything tied to the request's sequence (preemption: it is computed
    /// again from the start or the prompt cache).
    pub fn reset(&mut self) {
        self.owed_tokens.clear();
        self.owed_hidden.clear();
        self.has_last = false;
        self.drafts.clear();
        self.want = 0;
    }

    /// The target's hidden states `hidden` (`h` each) of positions `from..` of `tokens`:
    /// each position whose next token is known owes a draft row; the last one waits.
    pub fn record_hidden(&mut self, tokens: &[u32], from: usize, hidden: &[f32], h: usize) {
        for (i, row) in hidden.chunks_exact(h).enumerate() {
            match tokens.get(from + i + 1) {
                Some(&t) => {
                    self.owed_tokens.push(t);
                    self.owed_hidden.extend_from_slice(row);
                }
                None => {
                    self.h_last.clear();
                    self.h_last.extend_from_slice(row);
                    self.has_last = true;
                }
            }
        }
    }

    /// The token after the last computed position is known now (`tokens` ends with it
    /// or goes past it): its draft row is owed.
    pub fn settle(&mut self, tokens: &[u32], computed: usize) {
        if let (true, Some(&t)) = (self.has_last, tokens.get(computed)) {
            self.owed_tokens.push(t);
            self.owed_hidden.extend_from_slice(&self.h_last);
            self.has_last = false;
        }
    }

    /// Drafts for the next round of a fixed-count request: up to `room` (context and
    /// token limit).
    pub fn choose(&self, room: usize) -> usize {
        self.gamma.min(room)
    }

    /// The most an adaptive request may draft this step (room, its own count), and its
    /// acceptance estimate, for the batch's decision.
    pub fn batch_bid(&self, room: usize) -> (f64, usize) {
        (self.acceptance.estimate(), self.gamma.min(room))
    }

    /// Books a round: `g` drafts, `accepted` of them kept, `emitted` tokens out.
    pub fn record_round(&mut self, g: usize, accepted: usize, emitted: usize) {
        let s = &mut self.stats;
        s.rounds += 1;
        s.plain_rounds += u64::from(g == 0);
        s.drafted += g as u64;
        s.accepted += accepted as u64;
        s.tokens += emitted as u64;
        s.draft_forwards += if g > 0 { self.forwards as u64 } else { 0 };
        self.acceptance.record(g, accepted);
        self.forwards = 0;
    }

    /// The statistics with their rates filled in.
    pub fn finished_stats(&self) -> MtpStats {
        let mut s = self.stats.clone();
        s.estimated_acceptance = self.acceptance.estimate();
        s.close();
        s
    }

    fn owed(&self) -> usize {
        self.owed_tokens.len()
    }
}

/// Draft-layer totals over the engine's life.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DraftCounters {
    /// Draft-layer forwards.
    pub forwards: u64,
    /// Draft-cache rows written (owed rows and chained drafts).
    pub rows: u64,
    /// Requests whose draft cache found no room in its pool (they decode on without).
    pub dropped: u64,
    /// Requests that stopped speculating because drafting did not pay.
    pub given_up: u64,
}

/// The model's widths: logits per row, hidden state per row.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub vocab: usize,
    pub hidden: usize,
}

/// The step's draft phase over the running requests `running` with their planned
/// target rows `rows` (a decoding request with `want` drafts has `1 + want` rows): owed
/// rows are written, and each drafting request draws its drafts into `spec.drafts`.
/// A request whose draft rows do not fit the draft pool loses speculation (its row count
/// drops to 1). Returns an error naming the draft forward that failed.
pub(crate) fn draft_phase(
    session: &mut dyn Session,
    dims: Dims,
    running: &mut [Active],
    rows: &mut [usize],
    batch: &mut Batch,
    scratch: &mut DraftScratch,
    counters: &mut DraftCounters,
) -> Result<()> {
    let max_rows = session.max_rows();
    let drafting = |a: &Active, n: usize| a.spec.is_some() && a.pending() == 1 && n > 1;
    // Room in the draft pool: the newest requests give up their drafts first.
    loop {
        let Some(pool) = session.draft_kv() else { return Ok(()) };
        let need: usize = running
            .iter()
            .zip(rows.iter())
            .filter_map(|(a, &n)| {
                let s = a.spec.as_ref()?;
                let chained = if drafting(a, n) { n - 2 } else { 0 };
                Some(pool.blocks_needed(a.seq?, s.owed() + chained))
            })
            .sum();
        if need <= pool.free_blocks() {
            break;
        }
        let Some(i) = running.iter().rposition(|a| a.spec.is_some()) else { break };
        let a = &mut running[i];
        let mut spec = a.spec.take().expect("found above");
        spec.reset();
        a.dropped_spec = Some(spec.finished_stats());
        if let Some(seq) = a.seq {
            session.draft_truncate(seq, 0);
        }
        if rows[i] > 1 && a.pending() == 1 {
            rows[i] = 1;
        }
        counters.dropped += 1;
    }
    // Owed rows beyond what one forward holds go first, in forwards of their own.
    let total: usize = running.iter().filter_map(|a| a.spec.as_ref()).map(Spec::owed).sum();
    if total > max_rows {
        write_bulk(session, dims.hidden, running, rows, batch, scratch, counters)?;
    }
    // One forward: the remaining owed rows, logits for each drafting request's last.
    batch.clear();
    let DraftScratch { drafters, written, hidden, .. } = scratch;
    drafters.clear();
    written.clear();
    hidden.clear();
    for (i, (a, &n)) in running.iter().zip(rows.iter()).enumerate() {
        let (Some(s), Some(seq)) = (a.spec.as_ref(), a.seq) else { continue };
        let m = s.owed();
        if m == 0 || (!drafting(a, n) && m < OWED_MAX) {
            continue;
        }
        if drafting(a, n) {
            batch.push(seq, &s.owed_tokens[..m - 1], Logits::None);
            batch.push(seq, &s.owed_tokens[m - 1..], Logits::Last);
            drafters.push(i);
        } else {
            batch.push(seq, &s.owed_tokens, Logits::None);
        }
        hidden.extend_from_slice(&s.owed_hidden);
        written.push(i);
    }
    if batch.is_empty() {
        return Ok(());
    }
    session.draft_forward(batch, hidden)?;
    counters.forwards += 1;
    counters.rows += batch.len() as u64;
    for &i in written.iter() {
        let s = running[i].spec.as_mut().expect("written above");
        s.owed_tokens.clear();
        s.owed_hidden.clear();
    }
    draw_drafts(session, dims, running, rows, batch, scratch, counters)
}

/// Writes owed rows in forwards of at most `max_rows`, leaving each drafting request's
/// last owed row (its round's first token) for the drafting forward.
fn write_bulk(
    session: &mut dyn Session,
    h: usize,
    running: &mut [Active],
    rows: &[usize],
    batch: &mut Batch,
    scratch: &mut DraftScratch,
    counters: &mut DraftCounters,
) -> Result<()> {
    let max_rows = session.max_rows();
    let DraftScratch { hidden, parts, .. } = scratch;
    hidden.clear();
    parts.clear();
    let mut flush = |session: &mut dyn Session,
                     running: &mut [Active],
                     batch: &mut Batch,
                     hidden: &mut Vec<f32>,
                     parts: &mut Vec<(usize, usize)>|
     -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        session.draft_forward(batch, hidden)?;
        counters.forwards += 1;
        counters.rows += batch.len() as u64;
        for &(i, n) in parts.iter() {
            let s = running[i].spec.as_mut().expect("has owed rows");
            s.owed_tokens.drain(..n);
            s.owed_hidden.drain(..n * h);
        }
        batch.clear();
        hidden.clear();
        parts.clear();
        Ok(())
    };
    batch.clear();
    for i in 0..running.len() {
        let a = &running[i];
        let (Some(s), Some(seq)) = (a.spec.as_ref(), a.seq) else { continue };
        let keep = usize::from(a.pending() == 1 && rows[i] > 1);
        let mut todo = s.owed().saturating_sub(keep);
        let mut at = 0;
        while todo > 0 {
            if batch.len() == max_rows {
                flush(session, running, batch, hidden, parts)?;
                at = 0;
                continue;
            }
            let s = running[i].spec.as_ref().expect("checked");
            let n = todo.min(max_rows - batch.len());
            batch.push(seq, &s.owed_tokens[at..at + n], Logits::None);
            hidden.extend_from_slice(&s.owed_hidden[at * h..(at + n) * h]);
            parts.push((i, n));
            at += n;
            todo -= n;
        }
    }
    flush(session, running, batch, hidden, parts)
}

/// Draws each drafting request's drafts: the first from the drafting forward's logits
/// (row `j` for `scratch.drafters[j]`), the rest chained through one-row draft forwards fed
/// the draft layer's own hidden state.
fn draw_drafts(
    session: &mut dyn Session,
    dims: Dims,
    running: &mut [Active],
    rows: &[usize],
    batch: &mut Batch,
    scratch: &mut DraftScratch,
    counters: &mut DraftCounters,
) -> Result<()> {
    let (vocab, h) = (dims.vocab, dims.hidden);
    let DraftScratch { drafters, hidden, live, draw: scratch, .. } = scratch;
    live.clear();
    live.extend_from_slice(drafters);
    for &i in drafters.iter() {
        let s = running[i].spec.as_mut().expect("drafting");
        s.drafts.clear();
        s.forwards = 1;
    }
    let mut k = 0;
    loop {
        // Sample draft k of every live request from the last draft forward's rows.
        for (j, &i) in live.iter().enumerate() {
            let logits = &session.logits()[j * vocab..(j + 1) * vocab];
            let hidden = &session.hidden()[j * h..(j + 1) * h];
            let a = &mut running[i];
            scratch.logits.clear();
            scratch.logits.extend_from_slice(logits);
            let mut spec = a.spec.take().expect("drafting");
            let drawn = draw_one(a, &mut spec, k, scratch);
            spec.h_draft.clear();
            spec.h_draft.extend_from_slice(hidden);
            a.spec = Some(spec);
            drawn?;
        }
        k += 1;
        live.retain(|&i| rows[i] - 1 > k);
        if live.is_empty() {
            return Ok(());
        }
        batch.clear();
        hidden.clear();
        for &i in live.iter() {
            let a = &running[i];
            let s = a.spec.as_ref().expect("drafting");
            batch.push(a.seq.expect("running"), &s.drafts[k - 1..k], Logits::Last);
            hidden.extend_from_slice(&s.h_draft);
        }
        session.draft_forward(batch, hidden)?;
        counters.forwards += 1;
        counters.rows += batch.len() as u64;
        for &i in live.iter() {
            let s = running[i].spec.as_mut().expect("drafting");
            s.forwards += 1;
        }
    }
}

/// Draft `k` of request `a` from its draft logits in `scratch.logits`: narrowed as the
/// request asks (as if its earlier drafts were generated), sampled under the key of the
/// position it proposes.
fn draw_one(a: &mut Active, spec: &mut Spec, k: usize, scratch: &mut VerifyScratch) -> Result<()> {
    a.adjust(&mut scratch.logits, &spec.drafts[..k])?;
    scratch.context.clear();
    scratch.context.extend_from_slice(&a.tokens);
    scratch.context.extend_from_slice(&spec.drafts[..k]);
    let d = a.sampler.sample_ahead(&mut scratch.logits, &scratch.context, k);
    spec.drafts.push(d);
    Ok(())
}

//! The generation loop: prefill the prompt in chunks, then decode one token at a time
//! against the cache; stop on EOS ids, stop strings, the token limit or the context;
//! stream text.

use crate::draft_policy::DraftPolicy;
use crate::sampling::{Sampler, SamplingParams};
use crate::stats::{peak_rss_bytes, GenerationStats};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use anyhow::{bail, Result};
use std::time::Instant;
use strata_backend::Draw;
use strata_models::{fed, Batch, Logits, Model, Routes, SeqId, Session, SessionOptions};

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    /// Drop special tokens from the text (true for chat output; tool-call parsers that
    /// look for special markers want false).
    pub skip_special_tokens: bool,
    /// A prompt that does not fit the context loses its oldest tokens instead of failing.
    pub truncate_left: bool,
    /// Tokens the draft (MTP) layer proposes per target forward; 0 decodes one token a
    /// forward. Used when the model has a draft layer loaded.
    pub draft_tokens: usize,
    /// Whether each round drafts `draft_tokens` or adapts (see [`DraftPolicy`]).
    pub draft_policy: DraftPolicy,
}

/// Tokens the draft (MTP) layer proposes per round unless asked otherwise.
pub const DEFAULT_DRAFT_TOKENS: usize = 3;

impl GenerateRequest {
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Self {
            prompt_ids,
            max_tokens,
            sampling,
            stop_strings: Vec::new(),
            eos_token_ids: Vec::new(),
            skip_special_tokens: true,
            truncate_left: false,
            draft_tokens: DEFAULT_DRAFT_TOKENS,
            draft_policy: DraftPolicy::Adaptive,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// The caller's callback asked to stop (e.g. a client went away).
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenerationOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Prompts are prefilled in forwards of at most this many tokens on the CPU (a bound on
/// activation memory that the residency plan counts); a model's own is
/// `Model::prefill_chunk` (twice as many on CUDA).
pub const PREFILL_CHUNK: usize = strata_backend::PREFILL_CHUNK;

/// One sequence on a session plus the tokens its cache holds, so a later prompt that
/// extends an earlier conversation reuses the cached prefix (multi-turn chat).
pub struct Generator<'m> {
    pub(crate) model: &'m dyn Model,
    pub(crate) session: Box<dyn Session + 'm>,
    pub(crate) seq: SeqId,
    /// What the cache holds.
    pub(crate) tokens: Vec<u32>,
    pub(crate) batch: Batch,
    /// The last forward's logits (a copy the sampler may modify).
    pub(crate) logits: Vec<f32>,
    trace: Option<RouteTrace>,
    /// Feed the draft layer (when the model has one): its cache follows the target's.
    pub(crate) draft: bool,
    /// The target's final hidden state at the last cached position (draft input).
    pub(crate) h_last: Vec<f32>,
    /// Scratch: hidden rows copied out of the session.
    pub(crate) hbuf: Vec<f32>,
    /// Greedy decoding picks on the device and feeds each pick to the next forward there
    /// (`None`: where the session says it pays, see [`Generator::set_fed_decoding`]).
    fed_decoding: Option<bool>,
    /// Scratch: picks read back.
    picks: Vec<u32>,
}

/// Writes every routing decision in strata-residency's trace format (`segment forward
/// row layer experts...`), which `strata replay` reads.
pub struct RouteTrace {
    out: std::io::BufWriter<std::fs::File>,
    path: std::path::PathBuf,
    /// A segment is one generate call (a turn).
    pub segment: u32,
    pub forward: u64,
}

impl RouteTrace {
    pub fn create(path: &std::path::Path) -> Result<Self> {
        use std::io::Write;
        let f =
            std::fs::File::create(path).map_err(|e| anyhow::anyhow!("{}: cannot create trace: {e}", path.display()))?;
        let mut out = std::io::BufWriter::new(f);
        writeln!(out, "{}", strata_residency::TRACE_HEADER)?;
        Ok(Self { out, path: path.to_path_buf(), segment: 0, forward: 0 })
    }

    fn record(&mut self, routes: &Routes) -> Result<()> {
        use std::io::Write;
        for i in 0..routes.len() {
            let (layer, ids) = routes.layer(i);
            for (row, r) in ids.chunks(routes.top_k.max(1)).enumerate() {
                let rec = strata_residency::TraceRecord {
                    segment: self.segment,
                    forward: self.forward,
                    row: row as u32,
                    layer,
                    experts: r.iter().map(|&e| e as usize).collect(),
                };
                writeln!(self.out, "{}", rec.to_line())
                    .map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))?;
            }
        }
        self.forward += 1;
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        use std::io::Write;
        self.out.flush().map_err(|e| anyhow::anyhow!("{}: trace write failed: {e}", self.path.display()))
    }
}

/// Turns generated tokens into output: EOS ids and stop strings end it, printable text
/// streams to the callback (held back where a stop string could still begin), the token
/// limit ends it.
pub(crate) struct Emitter<'a> {
    tok: Option<&'a TextTokenizer>,
    req: &'a GenerateRequest,
    on_text: &'a mut dyn FnMut(&str) -> bool,
    pub(crate) out: Vec<u32>,
    decoder: StreamDecoder,
    /// Bytes of the text handed to `on_text`.
    streamed: usize,
    pub(crate) text: String,
    pub(crate) context: usize,
}

impl<'a> Emitter<'a> {
    fn new(
        tok: Option<&'a TextTokenizer>,
        req: &'a GenerateRequest,
        on_text: &'a mut dyn FnMut(&str) -> bool,
        context: usize,
    ) -> Self {
        Self {
            tok,
            req,
            on_text,
            out: Vec::with_capacity(req.max_tokens.min(context)),
            decoder: StreamDecoder::default(),
            streamed: 0,
            text: String::new(),
            context,
        }
    }

    /// Emits `token`; `Some(reason)` when generation ends here (an EOS id is not kept).
    pub(crate) fn push(&mut self, token: u32) -> Result<Option<FinishReason>> {
        let req = self.req;
        if req.eos_token_ids.contains(&token) {
            return Ok(Some(FinishReason::Stop));
        }
        self.out.push(token);
        if let Some(tok) = self.tok {
            let (full, _) = self.decoder.push(tok, token, req.skip_special_tokens)?;
            self.text = full;
            if let Some(cut) = req.stop_strings.iter().filter_map(|s| self.text.find(s.as_str())).min() {
                self.text.truncate(cut);
                if cut > self.streamed {
                    (self.on_text)(&self.text[self.streamed..]);
                }
                return Ok(Some(FinishReason::Stop));
            }
            let emitted = self.decoder.emitted();
            let printable = emitted.len() - held_back(emitted, &req.stop_strings);
            if printable > self.streamed {
                let go_on = (self.on_text)(&emitted[self.streamed..printable]);
                self.streamed = printable;
                if !go_on {
                    return Ok(Some(FinishReason::Cancelled));
                }
            }
        }
        Ok((self.out.len() >= req.max_tokens).then_some(FinishReason::Length))
    }

    /// Tokens the request may still emit.
    pub(crate) fn remaining(&self) -> usize {
        self.req.max_tokens.saturating_sub(self.out.len())
    }

    /// Flushes text held back for stop strings that never came.
    fn finish(&mut self, reason: FinishReason) {
        if reason == FinishReason::Length && self.tok.is_some() && self.text.len() > self.streamed {
            (self.on_text)(&self.text[self.streamed..]);
        }
    }
}

/// Where stop strings could still begin: the longest suffix of `text` that is a proper
/// prefix of some stop string is held back from streaming.
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && s.is_char_boundary(k)
                && text.is_char_boundary(text.len() - k)
                && text.ends_with(&s[..k])
            {
                hold = hold.max(k);
                break;
            }
        }
    }
    hold
}

impl<'m> Generator<'m> {
    /// A generator with room for `context` positions (capped by the model's context).
    pub fn new(model: &'m dyn Model, context: usize) -> Result<Self> {
        Self::with_rows(model, context, model.prefill_chunk())
    }

    /// [`Generator::new`] whose forwards take up to `rows` rows (a prompt is prefilled in
    /// chunks of that many; [`crate::LoadedModel::prefill_rows`]).
    pub fn with_rows(model: &'m dyn Model, context: usize, rows: usize) -> Result<Self> {
        let context = context.min(model.info().max_context).max(1);
        let chunk = rows.max(1).min(context);
        let mut session = model.new_session(SessionOptions::single(context, chunk))?;
        session.record_routes(false);
        let seq = session.add_sequence()?;
        let h = model.info().hidden_size;
        Ok(Self {
            model,
            draft: session.has_draft(),
            session,
            seq,
            tokens: Vec::with_capacity(context),
            batch: Batch::new(),
            logits: Vec::with_capacity(model.info().vocab_size),
            trace: None,
            h_last: vec![0.0; h],
            hbuf: Vec::with_capacity(chunk * h),
            fed_decoding: None,
            picks: Vec::with_capacity(1),
        })
    }

    /// Positions the cache can hold.
    pub fn context(&self) -> usize {
        self.session.max_len()
    }

    /// Positions the cache holds for this generator's sequence.
    pub fn cache_len(&self) -> usize {
        self.session.len(self.seq)
    }

    /// Whether a draft (MTP) layer is fed and used for speculative decoding.
    pub fn has_draft(&self) -> bool {
        self.draft
    }

    /// Stops feeding the draft layer (decoding then runs one token a forward).
    pub fn disable_draft(&mut self) {
        self.draft = false;
    }

    /// Records every routing decision of later forwards to `trace`.
    pub fn set_trace(&mut self, trace: RouteTrace) {
        self.trace = Some(trace);
        self.session.record_routes(true);
    }

    /// Whether later forwards record their routing for [`Generator::routes`] (off by
    /// default: recording costs a device sync per MoE layer on a GPU).
    pub fn record_routes(&mut self, on: bool) {
        self.session.record_routes(on);
    }

    /// Whether plain greedy decoding picks each token on the device and feeds it to the
    /// next forward there, queueing that forward before the host has read the token (the
    /// device then never waits for the host between tokens; one forward past an EOS or a
    /// stop string is computed and dropped). `None` (the default) does so where the
    /// session's logits live off the host (a GPU); `Some(on)` forces it either way.
    /// Output is the same.
    pub fn set_fed_decoding(&mut self, on: Option<bool>) {
        self.fed_decoding = on;
    }

    /// One forward over `ids` appended to the sequence.
    pub(crate) fn forward(&mut self, ids: &[u32], want: Logits) -> Result<()> {
        self.forward_with(ids, want, None)
    }

    /// [`Generator::forward`], the logits rows picked greedily on the device when `pick`.
    fn forward_with(&mut self, ids: &[u32], want: Logits, pick: Option<Draw>) -> Result<()> {
        self.batch.clear();
        self.batch.push(self.seq, ids, want);
        if let Some(d) = pick {
            self.batch.pick_greedy();
            if !d.is_greedy() {
                self.batch.draw_rows([d]);
            }
        }
        self.session.forward(&self.batch)?;
        self.tokens.extend_from_slice(ids);
        if let Some(trace) = self.trace.as_mut() {
            trace.record(self.session.routes())?;
        }
        Ok(())
    }

    /// Copies the last position's logits for sampling, refusing non-finite values.
    pub(crate) fn take_logits(&mut self) -> Result<()> {
        let vocab = self.model.info().vocab_size;
        let l = self.session.logits();
        self.take_logits_row(l.len() / vocab - 1)
    }

    /// Copies row `row` of the last forward's logits for sampling (refusing non-finite
    /// values).
    pub(crate) fn take_logits_row(&mut self, row: usize) -> Result<()> {
        let l = self.session.logits();
        let vocab = self.model.info().vocab_size;
        let last = &l[row * vocab..(row + 1) * vocab];
        crate::sampling::check_finite(last, self.tokens.len())?;
        self.logits.clear();
        self.logits.extend_from_slice(last);
        Ok(())
    }

    /// Makes the cache hold `prompt` (reusing the common prefix with what it holds) and
    /// leaves the last position's logits ready; returns the tokens computed. With a draft
    /// layer, every prompt position also feeds the draft cache (its row pairs a position's
    /// target hidden state with the next token).
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<usize> {
        if prompt.is_empty() {
            bail!("the prompt is empty (no tokens to condition on)");
        }
        // Reuse the cached prefix; at least one prompt token must be computed for logits
        // (and, feeding a draft layer, the hidden state before the first fresh token).
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let mut keep = common.min(prompt.len() - 1);
        if self.draft {
            keep = keep.saturating_sub(1);
            self.session.draft_truncate(self.seq, keep);
        }
        self.session.truncate(self.seq, keep);
        // (A session whose sliding-window cache no longer holds what `keep` needs starts
        // the sequence over: its length says what it kept.)
        let keep = self.session.len(self.seq).min(keep);
        if self.draft {
            self.session.draft_truncate(self.seq, keep);
        }
        self.tokens.truncate(keep);
        let fresh = &prompt[keep..];
        let chunk = self.session.max_rows();
        let n = fresh.len().div_ceil(chunk);
        let h = self.model.info().hidden_size;
        for (i, part) in fresh.chunks(chunk).enumerate() {
            let last = i + 1 == n;
            if !self.draft {
                self.forward(part, if last { Logits::Last } else { Logits::None })?;
                continue;
            }
            let start = self.tokens.len();
            self.forward(part, Logits::HiddenAll)?;
            if last {
                self.take_logits()?;
            }
            // Draft rows for positions start.. that have a next token in the prompt.
            let rows = part.len().min(prompt.len() - 1 - start);
            self.hbuf.clear();
            self.hbuf.extend_from_slice(&self.session.hidden()[..part.len() * h]);
            self.h_last.copy_from_slice(&self.hbuf[(part.len() - 1) * h..part.len() * h]);
            if rows > 0 {
                self.batch.clear();
                self.batch.push(self.seq, &prompt[start + 1..start + 1 + rows], Logits::None);
                self.session.draft_forward(&self.batch, &self.hbuf[..rows * h])?;
            }
        }
        if !self.draft {
            self.take_logits()?;
        }
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

    /// Generates for `req`, calling `on_text` with each printable delta; `on_text`
    /// returns false to cancel.
    pub fn generate(
        &mut self,
        tok: Option<&TextTokenizer>,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<GenerationOutput> {
        if req.prompt_ids.is_empty() {
            bail!("the prompt is empty (no tokens to condition on)");
        }
        let context = self.context();
        let mut prompt: &[u32] = &req.prompt_ids;
        if prompt.len() >= context {
            if !req.truncate_left {
                bail!(
                    "the prompt has {} tokens but the context is {context} (--context); shorten it or truncate it (--truncate left)",
                    prompt.len()
                );
            }
            // Keep the newest tokens: room for max_tokens, at least half the context.
            let keep = context.saturating_sub(req.max_tokens).max(context / 2).max(1).min(context - 1);
            prompt = &prompt[prompt.len() - keep..];
        }
        if !req.stop_strings.is_empty() && tok.is_none() {
            bail!("stop strings need a tokenizer");
        }
        let mut sampler = Sampler::new(req.sampling.clone())?;
        let t0 = Instant::now();
        let fresh = self.prefill(prompt)?;
        let prefill_s = t0.elapsed().as_secs_f64();

        let stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prefill_tokens: fresh,
            prefill_seconds: prefill_s,
            prefill_tokens_per_s: fresh as f64 / prefill_s.max(1e-9),
            time_to_first_token_s: prefill_s,
            truncated_prompt_tokens: req.prompt_ids.len() - prompt.len(),
            ..Default::default()
        };
        let mut out = self.decode_after(tok, req, &mut sampler, on_text, stats)?;
        out.stats.peak_rss_bytes = peak_rss_bytes();
        Ok(out)
    }

    /// The decoding half of [`Generator::generate`] for a prompt already in the cache
    /// ([`Generator::prefill`]): `req`'s prompt is not read; its limits, stops, sampling
    /// and draft settings are. `stats` says only how the decoding went (no peak RSS: reading
    /// it allocates, and the bench counts the decode's allocations).
    pub fn decode_prefilled(&mut self, req: &GenerateRequest) -> Result<GenerationOutput> {
        let mut sampler = Sampler::new(req.sampling.clone())?;
        self.decode_after(None, req, &mut sampler, &mut |_| true, GenerationStats::default())
    }

    fn decode_after(
        &mut self,
        tok: Option<&TextTokenizer>,
        req: &GenerateRequest,
        sampler: &mut Sampler,
        on_text: &mut dyn FnMut(&str) -> bool,
        mut stats: GenerationStats,
    ) -> Result<GenerationOutput> {
        let mut em = Emitter::new(tok, req, on_text, self.context());
        let t_decode = Instant::now();
        let gamma = if self.draft { req.draft_tokens } else { 0 };
        let finish = if gamma > 0 && req.max_tokens > 0 {
            let (finish, mtp) = self.decode_speculative(sampler, &mut em, gamma, req.draft_policy.adapts())?;
            stats.decode_fed = mtp.dormant_after_tokens.is_some() && self.feeds_picks(sampler);
            stats.mtp = Some(mtp);
            finish
        } else {
            stats.decode_fed = self.feeds_picks(sampler);
            self.decode_plain(sampler, &mut em, None)?
        };
        em.finish(finish);
        let out = em.out;
        let text = em.text;
        let decode_s = t_decode.elapsed().as_secs_f64();
        stats.generated_tokens = out.len();
        stats.decode_seconds = decode_s;
        stats.decode_tokens_per_s = if out.len() > 1 { (out.len() - 1) as f64 / decode_s.max(1e-9) } else { 0.0 };
        stats.finish_reason = finish.as_str().to_string();
        if let Some(trace) = self.trace.as_mut() {
            trace.flush()?;
            trace.segment += 1;
        }
        Ok(GenerationOutput { tokens: out, text, finish_reason: finish, stats })
    }

    /// One token a forward until the emitter says stop (or the context is full), from the
    /// ready logits or from `first` (emitted already, not yet in the cache).
    pub(crate) fn decode_plain(
        &mut self,
        sampler: &mut Sampler,
        em: &mut Emitter,
        mut first: Option<u32>,
    ) -> Result<FinishReason> {
        let fed = self.feeds_picks(sampler);
        // `self.tokens` is what the cache holds: the prompt and every generated token but
        // the last (which needs no forward).
        loop {
            let next = match first.take() {
                Some(x) => x,
                None => {
                    let next = self.sample(sampler);
                    if let Some(f) = em.push(next)? {
                        return Ok(f);
                    }
                    next
                }
            };
            if self.tokens.len() >= em.context {
                return Ok(FinishReason::Length);
            }
            if fed {
                return self.decode_fed(next, sampler, em);
            }
            self.step(next)?;
            if self.draft {
                // Keep the draft cache in step (one row: the previous position's hidden
                // state with this token).
                let h = self.model.info().hidden_size;
                self.hbuf.clear();
                self.hbuf.extend_from_slice(&self.session.hidden()[..h]);
                self.batch.clear();
                self.batch.push(self.seq, &[next], Logits::None);
                std::mem::swap(&mut self.h_last, &mut self.hbuf);
                self.session.draft_forward(&self.batch, &self.hbuf)?;
            }
        }
    }

    /// Whether plain decoding with `sampler` feeds device picks (see
    /// [`Generator::set_fed_decoding`]): greedy or sampled with no repetition penalty (the
    /// device draws as the host would, [`Sampler::next_draw`]), no draft layer fed, no
    /// routing trace (a forward past the end would be traced).
    fn feeds_picks(&self, sampler: &Sampler) -> bool {
        sampler.device_pickable()
            && !self.draft
            && self.trace.is_none()
            && self.fed_decoding.unwrap_or_else(|| self.session.picks_on_device())
    }

    /// Decoding from `first` (emitted, not yet in the cache) with each pick (greedy or a
    /// draw) made on the device: the forward fed pick t is queued before pick t is read. Stops as the
    /// plain loop does, with the cache holding the same tokens (a forward queued past the
    /// end is dropped).
    fn decode_fed(&mut self, first: u32, sampler: &mut Sampler, em: &mut Emitter) -> Result<FinishReason> {
        self.forward_with(&[first], Logits::Last, Some(sampler.next_draw()))?;
        loop {
            // The pick in flight is followed by a forward unless it is the last token
            // the request may emit or the cache is full (the plain loop's tests).
            let ahead = em.remaining() > 1 && self.tokens.len() < em.context;
            if ahead {
                if let Err(e) = self.forward_with(&[fed(0)], Logits::Last, Some(sampler.next_draw())) {
                    // Leave no pick unread behind (a later take would get it).
                    let _ = self.session.take_picks(&mut self.picks);
                    return Err(e);
                }
            }
            let r = self.take_pick(ahead).and_then(|pick| {
                if ahead {
                    // The queued forward's row: what the cache now holds.
                    *self.tokens.last_mut().expect("a queued row") = pick;
                }
                em.push(pick)
            });
            match r {
                Ok(None) if ahead => continue,
                Ok(None) => return Ok(FinishReason::Length),
                _ if ahead => {
                    // Drop the forward queued past the end, and its pick.
                    let _ = self.session.take_picks(&mut self.picks);
                    let keep = self.tokens.len() - 1;
                    self.session.truncate(self.seq, keep);
                    self.tokens.truncate(keep);
                }
                _ => {}
            }
            return r.map(|f| f.expect("a finish"));
        }
    }

    /// The oldest pick not yet read (the token at the cache's end, less the queued row).
    fn take_pick(&mut self, queued: bool) -> Result<u32> {
        self.session.take_picks(&mut self.picks)?;
        match self.picks.first() {
            Some(&p) => crate::sampling::device_pick(p, self.tokens.len() - queued as usize),
            None => bail!("the session returned no greedy pick"),
        }
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

    /// The last forward's routing (complete while recording: [`Generator::record_routes`]).
    pub fn routes(&self) -> &Routes {
        self.session.routes()
    }
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</s>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </", &stops), 2);
        assert_eq!(held_back("hello ST", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
    }
}

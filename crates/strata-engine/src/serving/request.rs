//! One request in the serving engine: its tokens (prompt and generated), its sampler, and
//! what happens to each token it samples (end-of-sequence and stop ids, stop strings,
//! the token limit, the context, a grammar), with the text streamed as it settles (held
//! back while a stop string could still begin), so a request's output does not depend on
//! what else runs beside it.

use super::speculate::{Spec, VerifyScratch};
use super::{ServeRequest, Update};
use crate::generate::{held_back, FinishReason, GenerationOutput};
use crate::sampling::{
    apply_logit_bias, apply_mask, ban, check_finite, device_pick, logprobs, Sampler, TokenLogprobs, TokenMask,
};
use crate::speculative::MtpStats;
use crate::stats::{peak_rss_bytes, GenerationStats};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use anyhow::{bail, Result};
use std::time::Instant;
use strata_models::SeqId;

/// What a running request's next forward needs.
pub(crate) struct Active {
    pub id: u64,
    pub req: ServeRequest,
    pub seq: Option<SeqId>,
    /// Prompt (after any left truncation) then generated tokens. The cache holds
    /// `tokens[..computed]`; the rest is fed next (the prompt, or the last sample).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub computed: usize,
    pub sampler: Sampler,
    pub out: Vec<u32>,
    decoder: StreamDecoder,
    streamed: usize,
    text: String,
    stop_sequence: Option<String>,
    /// Log-probabilities not yet sent, and all of them (for the final answer).
    pending_logprobs: Vec<TokenLogprobs>,
    all_logprobs: Vec<TokenLogprobs>,
    pub mask: Option<TokenMask>,
    /// Prompt tokens found in the prompt cache at the first admission.
    pub cached: Option<usize>,
    pub truncated: usize,
    pub submitted: Instant,
    admitted: Option<Instant>,
    first: Option<Instant>,
    /// Times the request lost its cache to others and was computed again.
    pub preemptions: usize,
    /// The request's image soft tokens (encoded at the first admission), and whether its
    /// image runs must stay whole in a forward (bidirectional image attention).
    pub media: Option<(crate::media::Media, bool)>,
    /// Speculative decoding state (a request the engine drafts for).
    pub spec: Option<Spec>,
    /// The statistics of speculation the request gave up (its draft cache found no room).
    pub dropped_spec: Option<MtpStats>,
    /// The target's final hidden states of `tokens[..computed]` (`hidden_size` each),
    /// kept while speculation is on so the prompt cache can hand them on with its blocks
    /// (a request that does not speculate keeps them only for its prompt).
    pub hidden_log: Option<Vec<f32>>,
    /// Samples picked on the device and fed to the next forward there before the host
    /// read them (the engine's fed steps).
    pub fed: usize,
}

impl Active {
    pub fn new(id: u64, req: ServeRequest, context: usize) -> Result<Self> {
        let g = &req.gen;
        if g.prompt_ids.is_empty() {
            bail!("the prompt is empty (no tokens to condition on)");
        }
        let mut prompt: &[u32] = &g.prompt_ids;
        if prompt.len() >= context {
            if !g.truncate_left || req.media.is_some() {
                bail!("the prompt has {} tokens but the context is {context}; shorten it", prompt.len());
            }
            let keep = context.saturating_sub(g.max_tokens).max(context / 2).max(1).min(context - 1);
            prompt = &prompt[prompt.len() - keep..];
        }
        let sampler = Sampler::new(g.sampling.clone())?;
        // Room for every token the request may generate, so that decoding never grows it.
        let most = g.max_tokens.min(context);
        let mut tokens = Vec::with_capacity(prompt.len() + most + 1);
        tokens.extend_from_slice(prompt);
        Ok(Self {
            id,
            prompt_len: tokens.len(),
            truncated: g.prompt_ids.len() - tokens.len(),
            tokens,
            seq: None,
            computed: 0,
            sampler,
            out: Vec::with_capacity(most),
            decoder: StreamDecoder::default(),
            streamed: 0,
            text: String::new(),
            stop_sequence: None,
            pending_logprobs: Vec::new(),
            all_logprobs: Vec::new(),
            mask: None,
            cached: None,
            submitted: Instant::now(),
            admitted: None,
            first: None,
            preemptions: 0,
            media: None,
            spec: None,
            dropped_spec: None,
            hidden_log: None,
            fed: 0,
            req,
        })
    }

    /// Tokens to feed before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn admitted(&mut self, cached: usize) {
        self.computed = cached;
        if self.cached.is_none() {
            self.cached = Some(cached);
            self.admitted = Some(Instant::now());
        }
    }

    /// Tokens the next forwards should compute before the request samples or verifies
    /// again. A speculating request computed again after preemption stops short of its
    /// last sample, which then starts a drafting round as it would have: its drafts,
    /// and so its sampled text, do not depend on the preemption.
    pub fn to_feed(&self) -> usize {
        match self.spec.is_some() && !self.out.is_empty() && self.computed + 1 < self.tokens.len() {
            true => self.tokens.len() - 1 - self.computed,
            false => self.pending(),
        }
    }

    /// Whether the request has generated and feeds its last sample next (a decode step,
    /// where speculation drafts).
    /// Whether the next token taken ends the request by its length (its token limit, or
    /// a full `context`), whatever it is.
    pub fn ends_after_next(&self, context: usize) -> bool {
        self.out.len() + 1 >= self.req.gen.max_tokens || self.tokens.len() + 1 > context
    }

    pub fn decoding(&self) -> bool {
        self.pending() == 1 && !self.out.is_empty()
    }

    /// Forgets the computed positions (preemption: computed again later).
    pub fn restart(&mut self) {
        self.computed = 0;
        self.preemptions += 1;
        if let Some(s) = self.spec.as_mut() {
            s.reset();
        }
        if let Some(h) = self.hidden_log.as_mut() {
            h.clear();
        }
    }

    /// Whether the next sample needs a grammar mask.
    pub fn constrained(&self) -> bool {
        self.req.constraint.is_some()
    }

    /// Fills the mask of the tokens the grammar allows next.
    pub fn fill_mask(&mut self, vocab: usize) -> Result<()> {
        if let Some(c) = self.req.constraint.as_mut() {
            let mask = self.mask.get_or_insert_with(|| TokenMask::new(vocab));
            mask.reset(vocab);
            c.fill_mask(mask)?;
            if mask.count() == 0 {
                bail!("the grammar allows no token here");
            }
        }
        Ok(())
    }

    /// Narrows `logits` as this request asks before a sample: the grammar mask, the
    /// bias, the penalties and the `min_tokens` bans, as if `ahead` (drafts under
    /// verification) had already been generated.
    pub fn adjust(&self, logits: &mut [f32], ahead: &[u32]) -> Result<()> {
        let r = &self.req;
        if let Some(mask) = self.mask.as_ref().filter(|_| r.constraint.is_some()) {
            apply_mask(logits, mask);
        }
        apply_logit_bias(logits, &r.logit_bias);
        if r.presence_penalty != 0.0 || r.frequency_penalty != 0.0 {
            let mut seen: Vec<u32> = self.out.iter().chain(ahead).copied().collect();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(l) = logits.get_mut(run[0] as usize) {
                    *l -= r.presence_penalty + r.frequency_penalty * run.len() as f32;
                }
            }
        }
        if self.out.len() + ahead.len() < r.min_tokens {
            ban(logits, &r.gen.eos_token_ids);
            ban(logits, &r.stop_token_ids);
        }
        if logits.iter().all(|l| *l == f32::NEG_INFINITY) {
            bail!("no token is allowed here (the grammar, logit_bias and min_tokens exclude every one)");
        }
        Ok(())
    }

    /// Samples from `logits` (this request's row, a copy it may change) and follows the
    /// token; returns the update to send, if any, and whether the request is finished.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(Option<Update>, Option<FinishReason>)> {
        check_finite(logits, self.tokens.len())?;
        let raw = self.req.logprobs.map(|_| logits.to_vec());
        self.adjust(logits, &[])?;
        let next = self.sampler.sample(logits, &self.tokens);
        self.take(next, raw.as_deref(), tok, context)
    }

    /// Whether the device can make this request's next sample from the raw logits
    /// ([`Active::next_draw`], [`Active::take_pick`]): greedy or sampled, no repetition
    /// penalty, no grammar, bias, presence or frequency penalty, no `min_tokens` ban in
    /// force, no log-probabilities, no draft layer.
    pub fn picks_on_device(&self) -> bool {
        let r = &self.req;
        self.sampler.device_pickable()
            && r.constraint.is_none()
            && r.logit_bias.is_empty()
            && r.presence_penalty == 0.0
            && r.frequency_penalty == 0.0
            && self.out.len() >= r.min_tokens
            && r.logprobs.is_none()
            && self.spec.is_none()
    }

    /// How the device makes this request's next sample (once a sample it takes).
    pub fn next_draw(&mut self) -> strata_backend::Draw {
        self.sampler.next_draw()
    }

    /// Follows the token the device picked for this request ([`Active::picks_on_device`]);
    /// a pick that met a non-finite logit fails the request, as [`Active::sample`] does.
    pub fn take_pick(
        &mut self,
        pick: u32,
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(Option<Update>, Option<FinishReason>)> {
        let next = device_pick(pick, self.tokens.len())?;
        self.take(next, None, tok, context)
    }

    /// Follows the sampled `next` (`raw`: the unnarrowed logits, when log-probabilities
    /// are wanted) and the tokens the grammar forces after it.
    fn take(
        &mut self,
        next: u32,
        raw: Option<&[f32]>,
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(Option<Update>, Option<FinishReason>)> {
        if self.first.is_none() {
            self.first = Some(Instant::now());
        }
        let want_logprobs = self.req.logprobs;
        let (mut delta, mut finish) = self.follow(next, raw, tok, context)?;
        // Tokens the grammar forces next join without a sample each: they are fed
        // together in the next forward (not when log-probabilities are wanted, which
        // forced tokens have none of).
        while finish.is_none() && want_logprobs.is_none() {
            let Some(c) = self.req.constraint.as_mut() else { break };
            if c.is_done() {
                break;
            }
            let forced = c.forced()?;
            if forced.is_empty() {
                break;
            }
            for t in forced {
                if self.req.gen.eos_token_ids.contains(&t) && !self.req.ignore_eos {
                    finish = Some(FinishReason::Stop);
                    break;
                }
                let (d, f) = self.accept(t, tok, context)?;
                delta.push_str(&d);
                finish = f;
                if finish.is_some() {
                    break;
                }
            }
        }
        Ok(self.close_step(delta, finish, tok))
    }

    /// Verifies the drafts of a speculative round against the target's logits `rows`
    /// (one per verified position: the round's first token, then each draft; `vocab`
    /// wide): a draft is kept while the target's own sample at its position is the same
    /// token ([`crate::speculative`]). Follows the accepted drafts and the target's token
    /// after them; returns the update, the finish, and how many drafts were accepted.
    pub fn verify(
        &mut self,
        rows: &[f32],
        vocab: usize,
        drafts: &[u32],
        scratch: &mut VerifyScratch,
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(Option<Update>, Option<FinishReason>, usize)> {
        let g = drafts.len();
        let row = |k: usize| &rows[k * vocab..(k + 1) * vocab];
        for k in 0..=g {
            check_finite(row(k), self.tokens.len() + k)?;
        }
        let s = scratch;
        s.context.clear();
        s.context.extend_from_slice(&self.tokens);
        let mut accepted = 0;
        let y = loop {
            s.logits.clear();
            s.logits.extend_from_slice(row(accepted));
            self.adjust(&mut s.logits, &drafts[..accepted])?;
            let t = self.sampler.sample_ahead(&mut s.logits, &s.context, accepted);
            if accepted == g || t != drafts[accepted] {
                break t;
            }
            s.context.push(t);
            accepted += 1;
        };
        self.sampler.skip(accepted + 1);
        let mut delta = String::new();
        let mut finish = None;
        for (k, &t) in drafts[..accepted].iter().chain([&y]).enumerate() {
            let raw = self.req.logprobs.map(|_| row(k));
            let (d, f) = self.follow(t, raw, tok, context)?;
            delta.push_str(&d);
            finish = f;
            if finish.is_some() {
                break;
            }
        }
        let (update, finish) = self.close_step(delta, finish, tok);
        Ok((update, finish, accepted))
    }

    /// Follows a chosen token: an end-of-sequence or stop id ends the request (and is
    /// not output), otherwise its log-probabilities (under `raw`, the unnarrowed logits)
    /// and the grammar, then [`Active::accept`].
    fn follow(
        &mut self,
        next: u32,
        raw: Option<&[f32]>,
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(String, Option<FinishReason>)> {
        let r = &self.req;
        let eos = !r.ignore_eos && r.gen.eos_token_ids.contains(&next);
        if eos || r.stop_token_ids.contains(&next) {
            return Ok((String::new(), Some(FinishReason::Stop)));
        }
        if let (Some(top), Some(raw)) = (r.logprobs, raw) {
            let lp = logprobs(raw, next, top);
            self.pending_logprobs.push(lp.clone());
            self.all_logprobs.push(lp);
        }
        if let Some(c) = self.req.constraint.as_mut() {
            c.commit(next)?;
        }
        self.accept(next, tok, context)
    }

    /// The end of a step's tokens: a finished grammar ends the request; a finish
    /// flushes the text held back for stop strings; the update carries the new text
    /// and log-probabilities.
    fn close_step(
        &mut self,
        mut delta: String,
        mut finish: Option<FinishReason>,
        tok: Option<&TextTokenizer>,
    ) -> (Option<Update>, Option<FinishReason>) {
        if finish.is_none() && self.req.constraint.as_ref().is_some_and(|c| c.is_done()) {
            finish = Some(FinishReason::Stop);
        }
        if finish.is_some() && self.stop_sequence.is_none() && tok.is_some() && self.text.len() > self.streamed {
            delta.push_str(&self.text[self.streamed..]);
            self.streamed = self.text.len();
        }
        let update = if !delta.is_empty() || (!self.pending_logprobs.is_empty() && tok.is_none()) {
            self.delta(delta)
        } else if finish.is_some() {
            self.flush()
        } else {
            None
        };
        (update, finish)
    }

    /// Appends a generated token: its text (up to a stop string), the token limit and
    /// the context. Returns the printable text it adds and the finish it causes.
    fn accept(
        &mut self,
        next: u32,
        tok: Option<&TextTokenizer>,
        context: usize,
    ) -> Result<(String, Option<FinishReason>)> {
        self.out.push(next);
        self.tokens.push(next);
        let mut delta = String::new();
        let stops_armed = self.out.len() >= self.req.min_tokens;
        if let Some(tok) = tok {
            let (full, _) = self.decoder.push(tok, next, self.req.gen.skip_special_tokens)?;
            self.text = full;
            let stops = &self.req.gen.stop_strings;
            let found = stops
                .iter()
                .filter(|_| stops_armed)
                .filter_map(|s| self.text.find(s.as_str()).map(|at| (at, s)))
                .min_by_key(|(at, _)| *at);
            if let Some((cut, s)) = found {
                self.stop_sequence = Some(s.clone());
                self.text.truncate(cut);
                if cut > self.streamed {
                    delta = self.text[self.streamed..].to_string();
                }
                self.streamed = self.streamed.max(cut);
                return Ok((delta, Some(FinishReason::Stop)));
            }
            let emitted = self.decoder.emitted();
            let printable = emitted.len() - held_back(emitted, stops);
            if printable > self.streamed {
                delta = emitted[self.streamed..printable].to_string();
                self.streamed = printable;
            }
        }
        let finish =
            (self.out.len() >= self.req.gen.max_tokens || self.tokens.len() > context).then_some(FinishReason::Length);
        Ok((delta, finish))
    }

    fn delta(&mut self, text: String) -> Option<Update> {
        if text.is_empty() && self.pending_logprobs.is_empty() {
            return None;
        }
        Some(Update::Delta { text, logprobs: std::mem::take(&mut self.pending_logprobs) })
    }

    /// Log-probabilities not sent yet, as an update.
    fn flush(&mut self) -> Option<Update> {
        self.delta(String::new())
    }

    /// The finished output and its statistics.
    pub fn output(&mut self, finish: FinishReason) -> (GenerationOutput, Option<String>, Vec<TokenLogprobs>) {
        let now = Instant::now();
        let admitted = self.admitted.unwrap_or(now);
        let first = self.first.unwrap_or(now);
        let cached = self.cached.unwrap_or(0);
        let prefill_s = first.duration_since(admitted).as_secs_f64();
        let decode_s = now.duration_since(first).as_secs_f64();
        let n = self.out.len();
        let stats = GenerationStats {
            prompt_tokens: self.prompt_len,
            prefill_tokens: self.prompt_len - cached,
            generated_tokens: n,
            prefill_seconds: prefill_s,
            decode_seconds: decode_s,
            prefill_tokens_per_s: (self.prompt_len - cached) as f64 / prefill_s.max(1e-9),
            decode_tokens_per_s: if n > 1 { (n - 1) as f64 / decode_s.max(1e-9) } else { 0.0 },
            time_to_first_token_s: first.duration_since(self.submitted).as_secs_f64(),
            peak_rss_bytes: peak_rss_bytes(),
            finish_reason: finish.as_str().to_string(),
            truncated_prompt_tokens: self.truncated,
            decode_fed: self.fed > 0,
            mtp: self.spec.as_ref().map(Spec::finished_stats).or_else(|| self.dropped_spec.clone()),
        };
        let out = GenerationOutput { tokens: self.out.clone(), text: self.text.clone(), finish_reason: finish, stats };
        (out, self.stop_sequence.clone(), std::mem::take(&mut self.all_logprobs))
    }

    /// Time from submission to admission, for the queue-wait metric.
    pub fn queue_wait_s(&self) -> f64 {
        self.admitted.map_or(0.0, |a| a.duration_since(self.submitted).as_secs_f64())
    }
}

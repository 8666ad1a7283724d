//! Speculative decoding with the model's draft (MTP) layer.
//!
//! A round starts with a token `x` already chosen (and emitted) whose predecessor's
//! target hidden state is known. The draft layer proposes `gamma` tokens, each from its
//! own hidden state and the token before (chained); the target verifies `x` and the
//! drafts in one forward of `gamma + 1` rows; the longest prefix the target agrees with
//! is kept, the target's own token at the first disagreement (or after the last draft)
//! starts the next round, and both caches roll back past what was kept.
//!
//! Agreement is coupled sampling: draft `k` is the draft layer's sample under the key
//! the `k`-th next token takes ([`Sampler::sample_ahead`]), and it is kept iff the
//! target's sample under that key, from the verify row's logits, is the same token. Every
//! emitted token is therefore the target's own keyed sample at its position: the output
//! is the target's distribution, and the very tokens decoding without drafts gives for the
//! same seed (greedy: the argmax, as before). The standard rejection rule accepts somewhat
//! more often when sampling (0.56 against 0.47 on strata-tiny at T=0.8: docs/performance.md,
//! issue 41) but draws the token after a rejection from a residual, so its text depends on
//! the drafts; coupled, a seed names one text, whatever the draft policy, the batch or the
//! device.

use crate::draft_policy::DraftController;
use crate::generate::{Emitter, FinishReason, Generator};
use crate::sampling::Sampler;
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;
use strata_models::Logits;

/// Draft-cache rows a run of rounds without drafts may owe before they are written.
const OWED_MAX: usize = 64;

/// What speculation did over a generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MtpStats {
    /// Draft tokens proposed per round (at most).
    pub draft_tokens: usize,
    /// `fixed` or `adaptive` (rounds choose 0..=draft_tokens drafts).
    pub policy: &'static str,
    /// Rounds: target forwards of the speculative loop.
    pub rounds: u64,
    /// Rounds in which the adaptive policy drafted nothing (plain one-token forwards).
    pub plain_rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Drafts accepted per drafting round.
    pub mean_accepted_length: f64,
    /// Tokens emitted per target forward (1 without speculation).
    pub tokens_per_target_forward: f64,
    /// Target forwards a one-token-a-forward decode would have made, less those made.
    pub forwards_saved: u64,
    /// Forwards of the draft layer.
    pub draft_forwards: u64,
    /// Tokens emitted by the rounds.
    pub tokens: u64,
    /// The adaptive policy's final acceptance estimate (per draft).
    pub estimated_acceptance: f64,
    /// Tokens emitted when the adaptive policy stopped drafting for good (drafting did not
    /// pay: [`crate::draft_policy`]); the rest were decoded one a forward without the draft
    /// layer and are not counted above.
    pub dormant_after_tokens: Option<u64>,
}

impl MtpStats {
    /// Fills the rates in from the counts.
    pub fn close(&mut self) {
        self.acceptance_rate = self.accepted as f64 / self.drafted.max(1) as f64;
        self.mean_accepted_length = self.accepted as f64 / (self.rounds - self.plain_rounds).max(1) as f64;
        self.tokens_per_target_forward = self.tokens as f64 / self.rounds.max(1) as f64;
        self.forwards_saved = self.tokens.saturating_sub(self.rounds);
    }
}

/// Scratch a speculative generation reuses round to round.
#[derive(Default)]
struct Round {
    drafts: Vec<u32>,
    /// Draft-cache rows owed from the last round: tokens and their target hidden states.
    owed_tokens: Vec<u32>,
    owed_hidden: Vec<f32>,
    verify: Vec<u32>,
    context: Vec<u32>,
    logits: Vec<f32>,
}

impl<'m> Generator<'m> {
    /// Decodes with speculation until the emitter says stop; `gamma` drafts a round.
    pub(crate) fn decode_speculative(
        &mut self,
        sampler: &mut Sampler,
        em: &mut Emitter,
        gamma: usize,
        adaptive: bool,
    ) -> Result<(FinishReason, MtpStats)> {
        let h = self.model.info().hidden_size;
        let vocab = self.model.info().vocab_size;
        let policy = if adaptive { "adaptive" } else { "fixed" };
        let mut stats = MtpStats { draft_tokens: gamma, policy, ..Default::default() };
        let mut ctl = DraftController::new(gamma, adaptive);
        let mut r = Round::default();
        // The first token comes from the prefill's logits.
        let mut x = self.sample(sampler);
        if let Some(f) = em.push(x)? {
            stats.close();
            return Ok((f, stats));
        }
        stats.tokens += 1;
        let close = |mut stats: MtpStats, ctl: &DraftController| {
            stats.estimated_acceptance = ctl.acceptance();
            stats.close();
            stats
        };
        loop {
            let t_round = Instant::now();
            let p0 = self.tokens.len();
            if p0 >= em.context {
                return Ok((FinishReason::Length, close(stats, &ctl)));
            }
            // Room for x and the drafts; near the end of the context (or of the tokens
            // the request may emit: x is out already) fewer drafts, or none.
            let g = ctl.choose(em.context.saturating_sub(p0 + 1).min(em.remaining().saturating_sub(1)));
            if ctl.dormant() {
                // Drafting does not pay here: plain decoding from x on, the draft layer no
                // longer fed (its cache is left behind; this generator drafts no more).
                stats.dormant_after_tokens = Some(stats.tokens);
                self.draft = false;
                let stats = close(stats, &ctl);
                return Ok((self.decode_plain(sampler, em, Some(x))?, stats));
            }
            r.drafts.clear();
            r.context.clear();
            r.context.extend_from_slice(&self.tokens);
            r.context.push(x);
            // The draft layer's row for x: its input is the hidden state before x.
            r.owed_tokens.push(x);
            r.owed_hidden.extend_from_slice(&self.h_last);
            if g == 0 && r.owed_tokens.len() >= OWED_MAX {
                // No drafts for a while: write the owed rows in one forward.
                self.write_owed(&mut r, 0)?;
            }
            if g > 0 {
                if r.owed_tokens.len() > gamma + 1 {
                    // Catch up on rows owed from rounds without drafts first, so the
                    // draft below is timed as what it is.
                    self.write_owed(&mut r, 1)?;
                }
                // Draft: the owed rows (x last), then chained on the draft's own state.
                let n = r.owed_tokens.len();
                self.batch.clear();
                self.batch.push(self.seq, &r.owed_tokens[..n - 1], Logits::None);
                self.batch.push(self.seq, &r.owed_tokens[n - 1..], Logits::Last);
                self.session.draft_forward(&self.batch, &r.owed_hidden)?;
                stats.draft_forwards += 1;
                r.owed_tokens.clear();
                r.owed_hidden.clear();
            }
            for k in 0..g {
                r.logits.clear();
                r.logits.extend_from_slice(&self.session.logits()[..vocab]);
                let d = sampler.sample_ahead(&mut r.logits, &r.context, k);
                r.drafts.push(d);
                r.context.push(d);
                if k + 1 < g {
                    self.hbuf.clear();
                    self.hbuf.extend_from_slice(&self.session.hidden()[..h]);
                    self.batch.clear();
                    self.batch.push(self.seq, &[d], Logits::Last);
                    self.session.draft_forward(&self.batch, &self.hbuf)?;
                    stats.draft_forwards += 1;
                }
            }
            // Verify x and the drafts in one target forward.
            r.verify.clear();
            r.verify.push(x);
            r.verify.extend_from_slice(&r.drafts);
            self.forward_verify(&r.verify)?;
            stats.rounds += 1;
            stats.plain_rounds += u64::from(g == 0);
            stats.drafted += g as u64;
            // Keep each draft while the target's own sample at its position agrees.
            let mut accepted = 0usize;
            let y = loop {
                self.take_logits_row(accepted)?;
                let t = sampler.sample_ahead(&mut self.logits, &r.context[..p0 + 1 + accepted], accepted);
                if accepted == g || t != r.drafts[accepted] {
                    break t;
                }
                accepted += 1;
            };
            sampler.skip(accepted + 1);
            stats.accepted += accepted as u64;
            ctl.record(g, accepted, t_round.elapsed().as_secs_f64());
            // Keep x and the accepted drafts; the target hidden states of those rows feed
            // the draft cache next round.
            let kept = p0 + 1 + accepted;
            self.hbuf.clear();
            self.hbuf.extend_from_slice(&self.session.hidden()[..(accepted + 1) * h]);
            self.session.truncate(self.seq, kept);
            self.tokens.truncate(kept);
            self.session.draft_truncate(self.seq, p0);
            r.owed_tokens.extend_from_slice(&r.drafts[..accepted]);
            r.owed_hidden.extend_from_slice(&self.hbuf[..accepted * h]);
            self.h_last.copy_from_slice(&self.hbuf[accepted * h..(accepted + 1) * h]);
            // Emit the accepted drafts, then y.
            for k in 0..accepted {
                stats.tokens += 1;
                if let Some(f) = em.push(r.drafts[k])? {
                    return Ok((f, close(stats, &ctl)));
                }
            }
            stats.tokens += 1;
            if let Some(f) = em.push(y)? {
                return Ok((f, close(stats, &ctl)));
            }
            if self.tokens.len() >= em.context {
                return Ok((FinishReason::Length, close(stats, &ctl)));
            }
            x = y;
        }
    }

    /// Writes the owed draft-cache rows but the last `keep` (no logits).
    fn write_owed(&mut self, r: &mut Round, keep: usize) -> Result<()> {
        let h = self.model.info().hidden_size;
        let n = r.owed_tokens.len() - keep;
        self.batch.clear();
        self.batch.push(self.seq, &r.owed_tokens[..n], Logits::None);
        self.session.draft_forward(&self.batch, &r.owed_hidden[..n * h])?;
        r.owed_tokens.drain(..n);
        r.owed_hidden.drain(..n * h);
        Ok(())
    }

    /// The target forward over `rows` (logits and hidden states of every row).
    fn forward_verify(&mut self, rows: &[u32]) -> Result<()> {
        self.forward(rows, Logits::All)
    }
}

#[cfg(test)]
mod tests {
    use crate::sampling::{Sampler, SamplingParams};

    /// Keyed sampling: a token drawn "ahead" is the token drawn later at that index, so a
    /// verified draft is exactly what decoding without drafts emits.
    #[test]
    fn a_sample_ahead_is_the_sample_taken_at_its_index() {
        let params = SamplingParams { temperature: 0.9, top_p: 0.95, seed: 11, ..Default::default() };
        let logits: Vec<Vec<f32>> =
            (0..6).map(|r| (0..500).map(|i| ((i * 37 + r * 101) % 97) as f32 / 9.0).collect()).collect();
        let mut plain = Sampler::new(params.clone()).unwrap();
        let taken: Vec<u32> = logits.iter().map(|l| plain.sample(&mut l.clone(), &[])).collect();
        let mut ahead = Sampler::new(params).unwrap();
        let first = ahead.sample(&mut logits[0].clone(), &[]);
        let seen: Vec<u32> = (1..6).map(|i| ahead.sample_ahead(&mut logits[i].clone(), &[], i - 1)).collect();
        assert_eq!(first, taken[0]);
        assert_eq!(seen, taken[1..]);
        ahead.skip(2);
        assert_eq!(ahead.sample(&mut logits[3].clone(), &[]), taken[3]);
    }
}

//! Speculative decoding with the model's draft (MTP) layer.
//!
//! A round starts with a token `x` already chosen (and emitted) whose predecessor's
//! target hidden state is known. The draft layer proposes `gamma` tokens, each from its
//! own hidden state and the token before (chained); the target verifies `x` and the
//! drafts in one forward of `gamma + 1` rows; the longest prefix the target agrees with
//! is kept, the target's own token at the first disagreement (or after the last draft)
//! starts the next round, and both caches roll back past what was kept.
//!
//! Agreement is the standard speculative-sampling rule: a draft `d` drawn from the draft
//! distribution `q` is accepted with probability `min(1, p(d) / q(d))` under the target
//! distribution `p`, else the token is drawn from `max(0, p - q)` renormalised. The
//! output is then distributed exactly as the target's (greedy: `d` is kept iff it is the
//! target's argmax, so greedy output equals decoding without a draft).

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

/// Probability of `token` in a distribution.
fn prob(dist: &[(u32, f64)], token: u32) -> f64 {
    dist.iter().find(|d| d.0 == token).map_or(0.0, |d| d.1)
}

/// The speculative-sampling decision for a draft `d ~ q` against the target `p`: `Ok(d)`
/// when accepted, `Err(t)` with the replacement `t ~ max(0, p - q)` when not. `u` is a
/// uniform draw; `residual` is scratch.
pub fn accept_draft(
    p: &[(u32, f64)],
    q: &[(u32, f64)],
    d: u32,
    u: f64,
    residual: &mut Vec<(u32, f64)>,
    sampler: &mut Sampler,
) -> std::result::Result<u32, u32> {
    let (pd, qd) = (prob(p, d), prob(q, d));
    if qd > 0.0 && u < pd / qd {
        return Ok(d);
    }
    residual.clear();
    residual.extend(p.iter().map(|&(t, pt)| (t, (pt - prob(q, t)).max(0.0))).filter(|r| r.1 > 0.0));
    if residual.is_empty() {
        // p == q where it matters: any draw from p is exact.
        return Err(sampler.draw(p));
    }
    Err(sampler.draw(residual))
}

/// Scratch a speculative generation reuses round to round.
#[derive(Default)]
struct Round {
    drafts: Vec<u32>,
    /// Draft distributions, one per draft.
    q: Vec<Vec<(u32, f64)>>,
    p: Vec<(u32, f64)>,
    residual: Vec<(u32, f64)>,
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
        let mut r = Round { q: (0..gamma).map(|_| Vec::new()).collect(), ..Default::default() };
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
            let p0 = self.tokens.len();
            if p0 >= em.context {
                return Ok((FinishReason::Length, close(stats, &ctl)));
            }
            // Room for x and the drafts; near the end of the context (or of the tokens
            // the request may emit: x is out already) fewer drafts, or none.
            let g = ctl.choose(em.context.saturating_sub(p0 + 1).min(em.remaining().saturating_sub(1)));
            r.drafts.clear();
            r.context.clear();
            r.context.extend_from_slice(&self.tokens);
            r.context.push(x);
            let (mut draft_s, mut timed) = (0.0, 0);
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
                let t = Instant::now();
                self.session.draft_forward(&self.batch, &r.owed_hidden)?;
                (draft_s, timed) = (t.elapsed().as_secs_f64(), 1);
                stats.draft_forwards += 1;
                r.owed_tokens.clear();
                r.owed_hidden.clear();
            }
            for k in 0..g {
                r.logits.clear();
                r.logits.extend_from_slice(&self.session.logits()[..vocab]);
                sampler.distribution(&mut r.logits, &r.context, &mut r.q[k]);
                let d = sampler.draw(&r.q[k]);
                r.drafts.push(d);
                r.context.push(d);
                if k + 1 < g {
                    self.hbuf.clear();
                    self.hbuf.extend_from_slice(&self.session.hidden()[..h]);
                    self.batch.clear();
                    self.batch.push(self.seq, &[d], Logits::Last);
                    let t = Instant::now();
                    self.session.draft_forward(&self.batch, &self.hbuf)?;
                    draft_s += t.elapsed().as_secs_f64();
                    timed += 1;
                    stats.draft_forwards += 1;
                }
            }
            // Verify x and the drafts in one target forward.
            r.verify.clear();
            r.verify.push(x);
            r.verify.extend_from_slice(&r.drafts);
            let t = Instant::now();
            self.forward_verify(&r.verify)?;
            let verify_s = t.elapsed().as_secs_f64();
            stats.rounds += 1;
            stats.plain_rounds += u64::from(g == 0);
            stats.drafted += g as u64;
            let mut accepted = 0usize;
            let mut next = None;
            for k in 0..g {
                self.take_logits_row(k)?;
                sampler.distribution(&mut self.logits, &r.context[..p0 + 1 + k], &mut r.p);
                let u = sampler.uniform();
                match accept_draft(&r.p, &r.q[k], r.drafts[k], u, &mut r.residual, sampler) {
                    Ok(_) => accepted += 1,
                    Err(t) => {
                        next = Some(t);
                        break;
                    }
                }
            }
            let y = match next {
                Some(t) => t,
                None => {
                    self.take_logits_row(g)?;
                    let ctx = &r.context[..p0 + 1 + g];
                    sampler.sample(&mut self.logits, ctx)
                }
            };
            stats.accepted += accepted as u64;
            ctl.record(g, accepted, verify_s, draft_s, timed);
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
    use super::*;
    use crate::sampling::SamplingParams;

    /// The speculative rule reproduces the target distribution exactly: over many trials
    /// with a draft distribution unlike the target, the emitted token's frequencies match
    /// the target's (chi-square well under the 0.999 quantile).
    #[test]
    fn speculative_sampling_keeps_the_target_distribution() {
        let p = vec![(0u32, 0.5), (1, 0.25), (2, 0.15), (3, 0.1)];
        let q = vec![(0u32, 0.1), (1, 0.2), (2, 0.3), (3, 0.3), (4, 0.1)];
        let mut sampler = Sampler::new(SamplingParams { temperature: 1.0, seed: 9, ..Default::default() }).unwrap();
        let mut residual = Vec::new();
        let n = 200_000;
        let mut counts = [0u64; 5];
        let mut accepted = 0;
        for _ in 0..n {
            let d = sampler.draw(&q);
            let u = sampler.uniform();
            let t = match accept_draft(&p, &q, d, u, &mut residual, &mut sampler) {
                Ok(t) => {
                    accepted += 1;
                    t
                }
                Err(t) => t,
            };
            counts[t as usize] += 1;
        }
        assert_eq!(counts[4], 0, "a token the target never emits");
        let chi2: f64 =
            p.iter().map(|&(t, pt)| (counts[t as usize] as f64 - pt * n as f64).powi(2) / (pt * n as f64)).sum();
        // 3 degrees of freedom: the 0.999 quantile is 16.27.
        assert!(chi2 < 16.27, "chi-square {chi2}: {counts:?}");
        // Acceptance = sum min(p, q) = 0.1 + 0.2 + 0.15 + 0.1.
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.55).abs() < 0.01, "acceptance {rate}");
    }

    #[test]
    fn greedy_acceptance_is_agreement_with_the_argmax() {
        let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
        let mut residual = Vec::new();
        let p = vec![(7u32, 1.0)];
        assert_eq!(accept_draft(&p, &[(7, 1.0)], 7, 0.99, &mut residual, &mut sampler), Ok(7));
        assert_eq!(accept_draft(&p, &[(3, 1.0)], 3, 0.0, &mut residual, &mut sampler), Err(7));
    }
}

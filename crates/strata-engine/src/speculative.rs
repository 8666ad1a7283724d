//! Speculative decoding with the model's draft (MTP) layer: the rule, and what it did
//! ([`MtpStats`]). The rounds themselves run in the serving engine, for every decoding
//! request of a step at once (`serving/speculate.rs`, verified per request in
//! `serving/request.rs`).
//!
//! A round starts with a token `x` already chosen (and emitted) whose predecessor's
//! target hidden state is known. The draft layer proposes `gamma` tokens, each from its
//! own hidden state and the token before (chained); the target verifies `x` and the
//! drafts in one forward of `gamma + 1` rows; the longest prefix the target agrees with
//! is kept, the target's own token at the first disagreement (or after the last draft)
//! starts the next round, and both caches roll back past what was kept.
//!
//! Agreement is coupled sampling: draft `k` is the draft layer's sample under the key
//! the `k`-th next token takes ([`crate::sampling::Sampler::sample_ahead`]), and it is kept iff the
//! target's sample under that key, from the verify row's logits, is the same token. Every
//! emitted token is therefore the target's own keyed sample at its position: the output
//! is the target's distribution, and the very tokens decoding without drafts gives for the
//! same seed (greedy: the argmax, as before). The standard rejection rule accepts somewhat
//! more often when sampling (0.56 against 0.47 on strata-tiny at T=0.8: docs/performance.md,
//! issue 41) but draws the token after a rejection from a residual, so its text depends on
//! the drafts; coupled, a seed names one text, whatever the draft policy, the batch or the
//! device.

use serde::Serialize;

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

//! Token sampling: repetition penalty, then temperature, top-k, top-p, min-p (the order
//! of transformers' logits processors and warpers), then a keyed draw
//! ([`strata_backend::draw`]: the definition a device runs too, so a seed picks the same
//! tokens on the host and where the logits are).
//!
//! Before a sample the serving engine may narrow the logits: a grammar's token mask
//! ([`TokenMask`], from a [`TokenConstraint`]), a per-token bias ([`apply_logit_bias`]),
//! and banned ids ([`ban`]: EOS under `min_tokens`). [`logprobs`] reports the model's own
//! distribution (the raw logits' log-softmax) for the chosen token and the top ones.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use strata_backend::draw::{self, draw_key, DrawScratch};
use strata_backend::Draw;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1 disables; >1 discourages tokens already in the context.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// The plain argmax of the logits: greedy with no repetition penalty (what a device
    /// can pick without the logits coming back).
    pub fn plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0
    }

    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            bail!("temperature must be a finite number >= 0, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            bail!("repetition_penalty must be > 0, got {}", self.repetition_penalty);
        }
        Ok(())
    }
}

/// Samples are keyed by their index: the `n`-th token a sampler emits is the draw of key
/// `draw_key(seed, n)` from its logits, however it was computed (one a forward, picked on a
/// device, or verified in a speculative round, [`Sampler::sample_ahead`]). A seed thus gives
/// the same tokens with drafts or without, batched or alone.
pub struct Sampler {
    params: SamplingParams,
    /// Samples taken so far: the next one's key is `draw_key(seed, draws)`.
    draws: u64,
    // Reused buffers: sampling a token allocates nothing once they have grown.
    seen: Vec<bool>,
    scratch: DrawScratch,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self { params, draws: 0, seen: Vec::new(), scratch: DrawScratch::default() })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether a device can make this sampler's picks where the logits are
    /// ([`Sampler::next_draw`]): anything but a repetition penalty, which needs the context.
    pub fn device_pickable(&self) -> bool {
        self.params.repetition_penalty == 1.0
    }

    /// The next sample as a device draws it ([`strata_backend::Backend::pick_rows`]): the
    /// same token [`Sampler::sample`] would pick from the same logits (greedy: no draw is
    /// consumed). Only where [`Sampler::device_pickable`].
    pub fn next_draw(&mut self) -> Draw {
        let d = self.draw_ahead(0);
        self.skip(1);
        d
    }

    /// The draw of the sample `ahead` places after the next one (no key consumed).
    pub fn draw_ahead(&self, ahead: usize) -> Draw {
        let p = &self.params;
        if p.temperature == 0.0 {
            return Draw::GREEDY;
        }
        Draw {
            temperature: p.temperature,
            top_k: p.top_k.min(u32::MAX as usize) as u32,
            top_p: p.top_p,
            min_p: p.min_p,
            key: draw_key(p.seed, self.draws + ahead as u64),
        }
    }

    /// Consumes the keys of `n` samples taken (greedy: nothing to consume).
    pub fn skip(&mut self, n: usize) {
        if self.params.temperature != 0.0 {
            self.draws += n as u64;
        }
    }

    /// Picks the next token from `logits`; `context` is every token so far (prompt and
    /// generated), for the repetition penalty. The logits hold no NaN or +inf (-inf: a
    /// token masked out).
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let t = self.sample_ahead(logits, context, 0);
        self.skip(1);
        t
    }

    /// The token the sample `ahead` places after the next one would be, were `logits` its
    /// logits and `context` everything before it; consumes nothing. A speculative round
    /// draws its drafts so from the draft layer's logits and checks them against the
    /// target's, then [`Sampler::skip`]s the tokens it emits.
    pub fn sample_ahead(&mut self, logits: &mut [f32], context: &[u32], ahead: usize) -> u32 {
        self.penalize(logits, context);
        let d = self.draw_ahead(ahead);
        draw::sample(logits, &d, &mut self.scratch)
    }

    /// Applies the repetition penalty to the context's tokens (each once).
    fn penalize(&mut self, logits: &mut [f32], context: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty == 1.0 {
            return;
        }
        self.seen.clear();
        self.seen.resize(logits.len(), false);
        for &t in context {
            if let Some(s) = self.seen.get_mut(t as usize) {
                if !*s {
                    *s = true;
                    let l = &mut logits[t as usize];
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
    }
}

/// A set of token ids (one bit each), e.g. the tokens a grammar allows next.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// An empty mask for `vocab` tokens.
    pub fn new(vocab: usize) -> Self {
        Self { words: vec![0; vocab.div_ceil(32)] }
    }

    /// Empties the mask for `vocab` tokens, keeping its storage.
    pub fn reset(&mut self, vocab: usize) {
        self.words.clear();
        self.words.resize(vocab.div_ceil(32), 0);
    }

    /// The bit words (bit `i % 32` of word `i / 32` is token `i`).
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    pub fn allow(&mut self, id: u32) {
        if let Some(w) = self.words.get_mut(id as usize / 32) {
            *w |= 1 << (id % 32);
        }
    }

    pub fn allows(&self, id: u32) -> bool {
        self.words.get(id as usize / 32).is_some_and(|w| w & (1 << (id % 32)) != 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }
}

/// A constraint on what may be generated (a grammar): it says which tokens may come
/// next and follows the tokens chosen. The engine masks the logits with it before each
/// sample.
pub trait TokenConstraint: Send {
    /// Sets the bits of the tokens allowed next (`mask` comes empty, sized for the
    /// vocabulary). End-of-sequence ids are allowed when the text may end here.
    fn fill_mask(&mut self, mask: &mut TokenMask) -> Result<()>;
    /// Follows a chosen token (never an end-of-sequence id).
    fn commit(&mut self, token: u32) -> Result<()>;
    /// Whether the text is complete and nothing may follow: generation stops.
    fn is_done(&self) -> bool;
    /// Tokens that must come next whatever is sampled (fixed text in a grammar),
    /// already followed: the engine appends them without sampling.
    fn forced(&mut self) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }
}

/// Masks out every token `mask` does not allow (their logits become -inf).
pub fn apply_mask(logits: &mut [f32], mask: &TokenMask) {
    for (i, l) in logits.iter_mut().enumerate() {
        if !mask.allows(i as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Adds `bias` to the logits of the given tokens (OpenAI's `logit_bias`: -100 bans a
/// token in practice, 100 all but forces it).
pub fn apply_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(id, b) in bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
}

/// Bans `ids` (their logits become -inf).
pub fn ban(logits: &mut [f32], ids: &[u32]) {
    for &id in ids {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// A chosen token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities under `logits` (log-softmax) of `chosen` and the `top` most likely.
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let norm = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - norm) as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() < top || l > best[best.len() - 1].1 {
                let at = best.partition_point(|b| b.1 >= l);
                best.insert(at, (i as u32, l));
                best.truncate(top);
            }
        }
    }
    TokenLogprobs {
        token: chosen,
        logprob: logits.get(chosen as usize).map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

/// Refuses logits with a non-finite value (damaged weights or expert bytes), naming the
/// first one and the position being sampled.
pub(crate) fn check_finite(logits: &[f32], position: usize) -> Result<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(non_finite(&format!(" ({})", logits[i]), i, position)),
        None => Ok(()),
    }
}

/// The token of a greedy pick made on the device (`Backend::argmax_rows`), refusing one
/// flagged `NON_FINITE | j` as [`check_finite`] refuses the logits.
pub(crate) fn device_pick(pick: u32, position: usize) -> Result<u32> {
    match pick & strata_backend::NON_FINITE {
        0 => Ok(pick),
        _ => Err(non_finite("", (pick & !strata_backend::NON_FINITE) as usize, position)),
    }
}

fn non_finite(value: &str, token: usize, position: usize) -> anyhow::Error {
    anyhow::anyhow!(
        "the model produced a non-finite logit{value} for token {token} at position {position}: the weights or expert bytes are damaged"
    )
}

/// Index of the largest logit; ties go to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: 42, ..Default::default() }
    }

    #[test]
    fn greedy_and_ties() {
        let mut s = Sampler::new(params(0.0)).unwrap();
        assert_eq!(s.sample(&mut [0.1, 2.0, 2.0, -1.0], &[]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0) }).unwrap();
            (0..4000).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1));
        assert_ne!(a, draw(2));
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert!(!a.contains(&2));
    }

    #[test]
    fn top_k_top_p_min_p_cut_the_tail() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        for p in [
            SamplingParams { top_k: 1, ..params(1.0) },
            SamplingParams { top_p: 0.5, ..params(1.0) },
            SamplingParams { min_p: 0.9, ..params(1.0) },
        ] {
            let mut s = Sampler::new(p.clone()).unwrap();
            for _ in 0..200 {
                assert_eq!(s.sample(&mut logits.clone(), &[]), 0, "{p:?}");
            }
        }
        // top_p 0.9 keeps tokens 0..=1 (0.644 + 0.237 < 0.9 -> also 2), never 3.
        let mut s = Sampler::new(SamplingParams { top_p: 0.9, ..params(1.0) }).unwrap();
        let seen: std::collections::BTreeSet<u32> = (0..2000).map(|_| s.sample(&mut logits.clone(), &[])).collect();
        assert_eq!(seen, [0, 1, 2].into());
    }

    #[test]
    fn repetition_penalty_matches_hf_rule() {
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 4.0, ..params(0.0) }).unwrap();
        // 2.0/4 = 0.5 < 1.0; so token 1 wins once token 0 was seen.
        assert_eq!(s.sample(&mut [2.0, 1.0, -1.0], &[0, 0]), 1);
        let mut l = [2.0f32, 1.0, -1.0];
        Sampler::new(SamplingParams { repetition_penalty: 2.0, ..params(0.0) }).unwrap().sample(&mut l, &[2]);
        assert_eq!(l[2], -2.0);
    }

    #[test]
    fn masks_bias_and_bans_narrow_the_choice() {
        let mut mask = TokenMask::new(40);
        mask.allow(3);
        mask.allow(33);
        assert!(mask.allows(33) && !mask.allows(2) && mask.count() == 2);
        let mut l: Vec<f32> = (0..40).map(|i| i as f32).collect();
        apply_mask(&mut l, &mask);
        assert_eq!(argmax(&l), 33);
        ban(&mut l, &[33]);
        assert_eq!(argmax(&l), 3);
        let mut l = vec![0.0f32, 1.0, 2.0];
        apply_logit_bias(&mut l, &[(0, 5.0), (9, 1.0)]);
        assert_eq!(argmax(&l), 0);
        mask.reset(8);
        assert_eq!(mask.count(), 0);
    }

    #[test]
    fn logprobs_are_a_log_softmax() {
        let l = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY, 0.0];
        let p = logprobs(&l, 0, 2);
        assert!((p.logprob - (0.2f32).ln()).abs() < 1e-6, "{p:?}");
        assert_eq!(p.top[0].0, 1);
        assert!((p.top[0].1 - (0.6f32).ln()).abs() < 1e-6);
        // Ties keep the lower id first.
        assert_eq!(p.top[1].0, 0);
        assert_eq!(logprobs(&l, 2, 0).logprob, f32::NEG_INFINITY);
        assert!(logprobs(&l, 2, 0).top.is_empty());
    }

    #[test]
    fn invalid_params_are_named() {
        for (p, want) in [
            (SamplingParams { temperature: -1.0, ..params(1.0) }, "temperature"),
            (SamplingParams { top_p: 0.0, ..params(1.0) }, "top_p"),
            (SamplingParams { min_p: 2.0, ..params(1.0) }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..params(1.0) }, "repetition_penalty"),
        ] {
            let err = Sampler::new(p).err().unwrap().to_string();
            assert!(err.contains(want), "{err}");
        }
    }
}

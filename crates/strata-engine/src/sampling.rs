//! Token sampling: repetition penalty, then temperature, top-k, top-p, min-p (the order
//! of transformers' logits processors and warpers), with a seeded RNG.

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

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

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    // Reused buffers: sampling a token allocates nothing once they have grown.
    seen: Vec<bool>,
    cand: Vec<(u32, f32)>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Self { params, rng, seen: Vec::new(), cand: Vec::new(), probs: Vec::new() })
    }

    /// Picks the next token from `logits`; `context` is every token so far (prompt and
    /// generated), for the repetition penalty.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
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
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates sorted by descending logit, ties to the lower id (an unstable sort
        // with the id as tie-break: the same order, and no allocation).
        let cand = &mut self.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / p.temperature)));
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let probs = &mut self.probs;
        probs.clear();
        probs.extend(cand.iter().map(|c| ((c.1 - max) as f64).exp()));
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (at least one token).
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, q) in probs.iter().enumerate() {
            r -= q;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
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

//! How many tokens to draft each speculative round.
//!
//! Drafting pays when the tokens a round is expected to emit grow faster than its cost.
//! With a per-draft acceptance `a`, `k` drafts emit `1 + a + ... + a^k` tokens on
//! average (the target's own token plus the accepted prefix) and cost one target forward
//! of `k + 1` rows plus `k` draft forwards. Where the draft layer is cheap next to the
//! target and agrees often (GLM-5: one layer against 78) every round drafts the maximum;
//! where it is as dear as the target (a tiny model on the CPU) or rarely agrees (random
//! weights), drafting is a loss and the adaptive policy stops, probing now and then in
//! case the text becomes predictable.
//!
//! Samples are keyed by position and drafts verified by coupling
//! ([`crate::speculative`]), so what the policy decides changes the speed only, never the
//! tokens: adaptive is the default for greedy and sampled decoding alike.
//!
//! Where even a perfect draft could not pay (a draft forward and a verify row cost as
//! much as a target forward: a small model on a CPU), or where drafting stays a loss
//! through its probes, the controller goes *dormant*: the loop stops feeding the draft
//! layer and decodes one token a forward, as `--mtp off` would (on a GPU with its picks
//! fed on the device), for the rest of the generation.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Choose 0..=count each round from measured acceptance and costs; dormant where
    /// drafting does not pay.
    #[default]
    Adaptive,
    /// Always draft the requested count.
    Fixed,
}

impl DraftPolicy {
    /// `adaptive` (or `auto`, its older name) or `fixed`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "adaptive" | "auto" => Self::Adaptive,
            "fixed" => Self::Fixed,
            other => bail!("draft policy `{other}`: expected adaptive or fixed"),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Adaptive => "adaptive",
            Self::Fixed => "fixed",
        }
    }

    pub fn adapts(self) -> bool {
        self == Self::Adaptive
    }
}

/// Acceptance evidence decays by this much per drafting round (recent text matters).
const DECAY: f64 = 0.97;
/// Rounds of each kind measured, alternating, before the first judgement.
const MEASURE: usize = 3;
/// Rounds without drafts between probes, at first and at most (doubling in between).
const PROBE_FIRST: usize = 8;
const PROBE_MAX: usize = 256;
/// Idle rounds between probes once this many probes in a row found drafting a loss: the
/// controller goes dormant instead of probing again.
const DORMANT_AFTER: usize = 64;
/// While drafting, one plain round in this many refreshes the plain round's time.
const REFRESH: usize = 32;
/// Recent round times kept (their median is the estimate: one round slowed by something
/// else on the machine moves nothing).
const RECENT: usize = 15;

/// The last [`RECENT`] values of a measurement.
#[derive(Debug, Default)]
struct Recent {
    values: std::collections::VecDeque<f64>,
}

impl Recent {
    fn push(&mut self, v: f64) {
        if self.values.len() == RECENT {
            self.values.pop_front();
        }
        self.values.push_back(v);
    }

    fn median(&self) -> Option<f64> {
        let mut v: Vec<f64> = self.values.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }
}

/// The per-round decision and what it learns from: the acceptance, and the wall time of
/// whole rounds (forwards, draft forwards, sampling and verification on the host), so
/// that everything a draft costs is counted.
#[derive(Debug)]
pub struct DraftController {
    gamma: usize,
    adaptive: bool,
    /// Decayed counts of accepted drafts and of drafts the target judged.
    accepted: f64,
    judged: f64,
    /// Seconds of plain rounds; of drafting rounds, with their draft counts.
    plain: Recent,
    drafting: std::collections::VecDeque<(usize, f64)>,
    plain_rounds: usize,
    drafting_rounds: usize,
    /// Drafting rounds since the last plain one.
    since_plain: usize,
    idle: usize,
    probe_every: usize,
    dormant: bool,
}

impl DraftController {
    pub fn new(gamma: usize, adaptive: bool) -> Self {
        Self {
            gamma,
            adaptive,
            accepted: 0.0,
            judged: 0.0,
            plain: Recent::default(),
            drafting: Default::default(),
            plain_rounds: 0,
            drafting_rounds: 0,
            since_plain: 0,
            idle: 0,
            probe_every: PROBE_FIRST,
            dormant: false,
        }
    }

    /// Acceptance estimate, with a weak prior of one half.
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 1.0) / (self.judged + 2.0)
    }

    /// Whether drafting has been judged not to pay for the rest of the generation (see the
    /// module's doc); the loop then decodes without the draft layer.
    pub fn dormant(&self) -> bool {
        self.dormant
    }

    /// Seconds of a plain round and what each draft adds to a round, by the medians of the
    /// recent rounds.
    fn costs(&self) -> Option<(f64, f64)> {
        let t0 = self.plain.median()?;
        let mut per: Vec<f64> = self.drafting.iter().map(|&(k, s)| ((s - t0) / k as f64).max(0.0)).collect();
        per.sort_by(f64::total_cmp);
        Some((t0, *per.get(per.len() / 2)?))
    }

    /// Tokens a round of `k` drafts emits per second at acceptance `a`.
    fn rate(a: f64, k: usize, t0: f64, per_draft: f64) -> f64 {
        let tokens: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
        tokens / (t0 + k as f64 * per_draft)
    }

    /// Drafts for the next round (at most `room`).
    pub fn choose(&mut self, room: usize) -> usize {
        let g = self.gamma.min(room);
        if !self.adaptive {
            return g;
        }
        if self.dormant || g == 0 {
            return 0;
        }
        // Measure both kinds of round first, alternating.
        if self.plain_rounds < MEASURE || self.drafting_rounds < MEASURE {
            return if self.drafting_rounds <= self.plain_rounds { g } else { 0 };
        }
        let Some((t0, per_draft)) = self.costs() else { return g };
        // A draft that is always right emits k + 1 tokens in t0 + k per_draft: ahead of one
        // a t0 only while a draft costs less than a plain round.
        if per_draft >= t0 {
            self.dormant = true;
            return 0;
        }
        if self.since_plain >= REFRESH {
            return 0;
        }
        let a = self.acceptance();
        let best = (0..=g).max_by(|&x, &y| Self::rate(a, x, t0, per_draft).total_cmp(&Self::rate(a, y, t0, per_draft)));
        let best = best.unwrap_or(0);
        if best > 0 {
            self.idle = 0;
            self.probe_every = PROBE_FIRST;
            return best;
        }
        self.idle += 1;
        if self.probe_every >= DORMANT_AFTER {
            self.dormant = true;
            return 0;
        }
        if self.idle >= self.probe_every {
            // Probe: one draft, to keep the acceptance estimate current.
            self.idle = 0;
            self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
            return 1;
        }
        0
    }

    /// What a round of `k` drafts did: `accepted` of them kept, the whole round taking
    /// `round_s` seconds.
    pub fn record(&mut self, k: usize, accepted: usize, round_s: f64) {
        if k == 0 {
            self.plain.push(round_s);
            self.plain_rounds += 1;
            self.since_plain = 0;
            return;
        }
        self.drafting_rounds += 1;
        self.since_plain += 1;
        if self.drafting.len() == RECENT {
            self.drafting.pop_front();
        }
        self.drafting.push_back((k, round_s));
        self.accepted = self.accepted * DECAY + accepted as f64;
        // The target judged every accepted draft and the first rejected one.
        self.judged = self.judged * DECAY + (accepted + usize::from(accepted < k)) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `rounds` rounds against a synthetic draft that agrees with probability-like
    /// frequency `agree` (deterministic pattern) at the given costs; returns drafts chosen.
    fn simulate(agree: f64, t_target: f64, t_row: f64, t_draft: f64, rounds: usize) -> Vec<usize> {
        simulate_with(&mut DraftController::new(3, true), agree, t_target, t_row, t_draft, rounds)
    }

    fn simulate_with(
        c: &mut DraftController,
        agree: f64,
        t_target: f64,
        t_row: f64,
        t_draft: f64,
        rounds: usize,
    ) -> Vec<usize> {
        let mut seen = 0.0f64;
        let mut out = Vec::new();
        for _ in 0..rounds {
            let k = c.choose(100);
            let mut accepted = 0;
            for _ in 0..k {
                seen += agree;
                if seen >= 1.0 {
                    seen -= 1.0;
                    accepted += 1;
                } else {
                    break;
                }
            }
            c.record(k, accepted, t_target + k as f64 * (t_row + t_draft));
            out.push(k);
        }
        out
    }

    #[test]
    fn cheap_agreeing_draft_drafts_the_maximum() {
        // GLM-5-like: the draft costs 1/40 of the target and agrees 70% of the time.
        let ks = simulate(0.7, 1.0, 0.02, 0.025, 400);
        // Every round drafts 3 but the one plain round per REFRESH that re-times a plain one.
        let plain = ks[100..].iter().filter(|&&k| k == 0).count();
        assert!(ks[100..].iter().all(|&k| k == 3 || k == 0), "{:?}", &ks[100..]);
        assert!((8..=10).contains(&plain), "{plain} plain rounds of 300");
    }

    #[test]
    fn useless_draft_probes_then_goes_dormant() {
        // Never agrees: after the first rounds, plain rounds with a few one-draft probes,
        // then none at all.
        let mut c = DraftController::new(3, true);
        let ks = simulate_with(&mut c, 0.0, 1.0, 0.02, 0.1, 400);
        let drafting = ks[20..].iter().filter(|&&k| k > 0).count();
        assert!(drafting > 0 && drafting < 6, "{drafting} drafting rounds of 380: {ks:?}");
        assert!(ks[20..].iter().all(|&k| k <= 1), "probes draft one token");
        assert!(c.dormant(), "three failed probes: dormant");
        assert!(ks[200..].iter().all(|&k| k == 0));
    }

    #[test]
    fn a_draft_dearer_than_it_can_save_goes_dormant_at_once() {
        // A draft forward and a verify row cost as much as a target forward (strata-tiny on
        // a 2-core CPU: 0.46 + 0.67 ms against 1.05): even a perfect draft loses.
        let mut c = DraftController::new(3, true);
        let ks = simulate_with(&mut c, 1.0, 1.05, 0.67, 0.46, 200);
        assert!(c.dormant());
        assert!(ks[2 * MEASURE..].iter().all(|&k| k == 0), "{ks:?}");
    }

    #[test]
    fn dear_draft_stops_even_when_it_agrees() {
        // As dear as the target: 1 + a + ... over (1 + k (1 + r)) < 1 for any k.
        let ks = simulate(0.65, 1.0, 0.1, 1.0, 200);
        assert!(ks[50..].iter().filter(|&&k| k > 0).count() < 10, "{:?}", &ks[50..]);
    }

    #[test]
    fn fixed_always_drafts_the_count_within_room() {
        let mut c = DraftController::new(3, false);
        assert_eq!(c.choose(10), 3);
        c.record(3, 0, 1.0);
        assert_eq!(c.choose(10), 3);
        assert_eq!(c.choose(2), 2);
        assert_eq!(c.choose(0), 0);
    }

    #[test]
    fn policies_parse() {
        assert_eq!(DraftPolicy::parse("adaptive").unwrap(), DraftPolicy::Adaptive);
        assert_eq!(DraftPolicy::parse("auto").unwrap(), DraftPolicy::Adaptive);
        assert_eq!(DraftPolicy::parse("fixed").unwrap(), DraftPolicy::Fixed);
        assert!(DraftPolicy::parse("sometimes").unwrap_err().to_string().contains("sometimes"));
        assert!(DraftPolicy::default().adapts() && !DraftPolicy::Fixed.adapts());
    }
}

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
//! The adaptive policy decides from measured times, so a seeded *sampled* run may take
//! different rounds from one run to the next; the output's distribution is the target's
//! either way, and greedy output is identical to plain decoding whatever it decides.
//! `auto` is therefore adaptive under greedy decoding and fixed under sampling, where a
//! seed must give the same text every time.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Adaptive for greedy decoding, fixed for sampling.
    #[default]
    Auto,
    /// Always draft the requested count (reproducible).
    Fixed,
    /// Choose 0..=count each round from measured acceptance and costs.
    Adaptive,
}

impl DraftPolicy {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Self::Auto,
            "fixed" => Self::Fixed,
            "adaptive" => Self::Adaptive,
            other => bail!("draft policy `{other}`: expected auto, fixed or adaptive"),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fixed => "fixed",
            Self::Adaptive => "adaptive",
        }
    }

    /// Whether rounds adapt under these sampling settings.
    pub fn adapts(self, greedy: bool) -> bool {
        match self {
            Self::Auto => greedy,
            Self::Fixed => false,
            Self::Adaptive => true,
        }
    }
}

/// Weight of the newest measurement in the running averages.
const EMA: f64 = 0.2;
/// Acceptance evidence decays by this much per drafting round (recent text matters).
const DECAY: f64 = 0.97;
/// Rounds without drafts between probes, at first and at most (doubling in between).
const PROBE_FIRST: usize = 8;
const PROBE_MAX: usize = 256;
/// While drafting, one plain round in this many refreshes the one-row target time.
const REFRESH: usize = 64;

/// The per-round decision and what it learns from.
#[derive(Debug)]
pub struct DraftController {
    gamma: usize,
    adaptive: bool,
    /// Decayed counts of accepted drafts and of drafts the target judged.
    accepted: f64,
    judged: f64,
    /// Seconds: a target forward of one row; each further verify row; a draft forward.
    t_target: Option<f64>,
    t_row: f64,
    t_draft: Option<f64>,
    drafting_rounds: usize,
    /// The plain round for this multiple of [`REFRESH`] drafting rounds was taken.
    refreshed: bool,
    idle: usize,
    probe_every: usize,
}

fn ema(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + EMA * (new - o))
}

impl DraftController {
    pub fn new(gamma: usize, adaptive: bool) -> Self {
        Self {
            gamma,
            adaptive,
            accepted: 0.0,
            judged: 0.0,
            t_target: None,
            t_row: 0.0,
            t_draft: None,
            drafting_rounds: 0,
            refreshed: false,
            idle: 0,
            probe_every: PROBE_FIRST,
        }
    }

    /// Acceptance estimate, with a weak prior of one half.
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 1.0) / (self.judged + 2.0)
    }

    /// Tokens a round of `k` drafts emits per second, by the current estimates.
    fn rate(&self, k: usize, t_target: f64, t_draft: f64) -> f64 {
        let a = self.acceptance();
        let tokens: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
        tokens / (t_target + k as f64 * (self.t_row + t_draft))
    }

    /// Drafts for the next round (at most `room`).
    pub fn choose(&mut self, room: usize) -> usize {
        let g = self.gamma.min(room);
        if !self.adaptive {
            return g;
        }
        // Measure both kinds of round before judging: two drafting rounds, then one plain.
        let (Some(t_draft), true) = (self.t_draft, self.drafting_rounds >= 2) else { return g };
        let Some(t_target) = self.t_target else { return 0 };
        if self.drafting_rounds.is_multiple_of(REFRESH) && self.idle == 0 && !self.refreshed {
            self.refreshed = true;
            return 0;
        }
        let best = (0..=g)
            .max_by(|&a, &b| self.rate(a, t_target, t_draft).total_cmp(&self.rate(b, t_target, t_draft)))
            .unwrap_or(0);
        if best > 0 {
            self.idle = 0;
            self.probe_every = PROBE_FIRST;
            return best;
        }
        self.idle += 1;
        if self.idle >= self.probe_every {
            // Probe: one draft, to keep the acceptance estimate current.
            self.idle = 0;
            self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
            return g.min(1);
        }
        0
    }

    /// What a round of `k` drafts did: `accepted` of them kept, the verify forward took
    /// `verify_s`, the draft forwards `draft_s` for `timed_drafts` of them (a forward
    /// that also caught up on many owed rows is not timed).
    pub fn record(&mut self, k: usize, accepted: usize, verify_s: f64, draft_s: f64, timed_drafts: usize) {
        if k == 0 {
            self.t_target = Some(ema(self.t_target, verify_s));
            return;
        }
        self.drafting_rounds += 1;
        self.refreshed = false;
        self.accepted = self.accepted * DECAY + accepted as f64;
        // The target judged every accepted draft and the first rejected one.
        self.judged = self.judged * DECAY + (accepted + usize::from(accepted < k)) as f64;
        if timed_drafts > 0 {
            self.t_draft = Some(ema(self.t_draft, draft_s / timed_drafts as f64));
        }
        if let Some(t1) = self.t_target {
            self.t_row = ema(Some(self.t_row), ((verify_s - t1) / k as f64).max(0.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `rounds` rounds against a synthetic draft that agrees with probability-like
    /// frequency `agree` (deterministic pattern) at the given costs; returns drafts chosen.
    fn simulate(agree: f64, t_target: f64, t_row: f64, t_draft: f64, rounds: usize) -> Vec<usize> {
        let mut c = DraftController::new(3, true);
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
            c.record(k, accepted, t_target + k as f64 * t_row, k as f64 * t_draft, k);
            out.push(k);
        }
        out
    }

    #[test]
    fn cheap_agreeing_draft_drafts_the_maximum() {
        // GLM-5-like: the draft costs 1/40 of the target and agrees 70% of the time.
        let ks = simulate(0.7, 1.0, 0.02, 0.025, 400);
        // Every round drafts 3 but the one plain round per REFRESH that re-times the target.
        let plain = ks[100..].iter().filter(|&&k| k == 0).count();
        assert!(ks[100..].iter().all(|&k| k == 3 || k == 0), "{:?}", &ks[100..]);
        assert!((3..=6).contains(&plain), "{plain} plain rounds of 300");
    }

    #[test]
    fn useless_draft_stops_drafting_but_probes() {
        // Never agrees: after the first rounds, almost all rounds are plain.
        let ks = simulate(0.0, 1.0, 0.02, 0.1, 400);
        let drafting = ks[20..].iter().filter(|&&k| k > 0).count();
        assert!(drafting > 0 && drafting < 15, "{drafting} drafting rounds of 380");
        assert!(ks[20..].iter().all(|&k| k <= 1), "probes draft one token");
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
        c.record(3, 0, 1.0, 1.0, 3);
        assert_eq!(c.choose(10), 3);
        assert_eq!(c.choose(2), 2);
        assert_eq!(c.choose(0), 0);
    }

    #[test]
    fn policies_parse_and_resolve() {
        assert_eq!(DraftPolicy::parse("adaptive").unwrap(), DraftPolicy::Adaptive);
        assert!(DraftPolicy::parse("sometimes").unwrap_err().to_string().contains("sometimes"));
        assert!(DraftPolicy::Auto.adapts(true) && !DraftPolicy::Auto.adapts(false));
        assert!(DraftPolicy::Adaptive.adapts(false) && !DraftPolicy::Fixed.adapts(true));
    }
}

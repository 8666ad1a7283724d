//! How many tokens a request drafts each speculative round.
//!
//! A `fixed` request drafts its count every round. An `adaptive` one (the default) drafts
//! what pays: the serving engine decides whether to speculate at all by measured
//! throughput ([`crate::serving`]'s draft epochs) and how many drafts the batch's
//! adaptive requests make each step from a fitted cost model and each request's
//! acceptance estimate ([`Acceptance`]). Samples are keyed by position and drafts
//! verified by coupling ([`crate::speculative`]), so the policy changes the speed only,
//! never the tokens.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Draft what pays, measured as the engine runs.
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

/// A request's draft acceptance: decayed counts of the drafts the target kept and of
/// those it judged.
#[derive(Debug, Default)]
pub struct Acceptance {
    accepted: f64,
    judged: f64,
}

impl Acceptance {
    /// The estimate, with a weak prior of one half.
    pub fn estimate(&self) -> f64 {
        (self.accepted + 1.0) / (self.judged + 2.0)
    }

    /// A round of `k` drafts kept `accepted` of them.
    pub fn record(&mut self, k: usize, accepted: usize) {
        if k == 0 {
            return;
        }
        self.accepted = self.accepted * DECAY + accepted as f64;
        // The target judged every accepted draft and the first rejected one.
        self.judged = self.judged * DECAY + (accepted + usize::from(accepted < k)) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_follows_recent_rounds() {
        let mut a = Acceptance::default();
        assert_eq!(a.estimate(), 0.5);
        (0..50).for_each(|_| a.record(3, 3));
        assert!(a.estimate() > 0.95, "{}", a.estimate());
        (0..200).for_each(|_| a.record(3, 0));
        assert!(a.estimate() < 0.1, "{}", a.estimate());
        let before = a.estimate();
        a.record(0, 0);
        assert_eq!(a.estimate(), before, "a plain round judges nothing");
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

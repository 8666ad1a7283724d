//! Eviction by decayed use counts (LFRU): which expert of a layer goes when a slot is
//! needed.
//!
//! LRU evicts the expert used longest ago; on trained routing that throws out experts a
//! layer uses every few tokens for one it used once (a topic word, a rare token). LFRU
//! keeps a heat per expert, its uses with each weighed down by half every `half_life`
//! forwards, and evicts the coldest (recency breaks ties). With a short half-life (tens
//! of tokens) it follows a change of topic within a paragraph; a long one turns it into
//! LFU, which loses to LRU when the prompt moves on (`strata replay` shows both:
//! docs/performance.md, "LFRU eviction").

use std::collections::HashMap;

use serde::Serialize;

use crate::ExpertKey;

/// How each layer picks the expert it evicts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum Eviction {
    /// The least recently used.
    Lru,
    /// The coldest: uses decayed by half every `half_life` forwards; ties, and slots a
    /// tier below a device has cooled, by recency.
    Lfru { half_life: f64 },
}

impl Eviction {
    /// The half-life a plain `lfru` gets, in forwards (tokens in decode): the best of
    /// 8..128 on the committed 256-expert trace at full GLM-5.2's tier sizes.
    pub const DEFAULT_HALF_LIFE: f64 = 32.0;

    /// Half-lives LFRU accepts, in forwards: beyond them the heat's arithmetic leaves f64.
    pub const HALF_LIFE_RANGE: std::ops::RangeInclusive<f64> = 0.001..=1e9;

    /// LFRU at `half_life` forwards, refused outside [`Self::HALF_LIFE_RANGE`].
    pub fn lfru(half_life: f64) -> Result<Self, String> {
        match Self::HALF_LIFE_RANGE.contains(&half_life) {
            true => Ok(Eviction::Lfru { half_life }),
            false => Err(format!("an LFRU half-life must be 0.001 to 1e9 forwards, got {half_life}")),
        }
    }

    /// `lru`, `lfru` or `lfru:HALF_LIFE` (forwards, 0.001 to 1e9).
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad =
            || format!("invalid eviction {text:?}: expected lru, lfru or lfru:HALF_LIFE (forwards, 0.001 to 1e9)");
        match text.split_once(':') {
            None if text == "lru" => Ok(Eviction::Lru),
            None if text == "lfru" => Ok(Eviction::Lfru { half_life: Self::DEFAULT_HALF_LIFE }),
            Some(("lfru", h)) => h.parse::<f64>().ok().and_then(|h| Self::lfru(h).ok()).ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Eviction::Lru => write!(f, "lru"),
            Eviction::Lfru { half_life } => write!(f, "lfru:{half_life}"),
        }
    }
}

/// Past this scale the stored heats are brought back down (f64 keeps 2^±1000).
const RESCALE_AT: f64 = (1u64 << 40) as f64;

/// Decayed use counts per expert. A use at clock `t` adds `2^((t - base) / half_life)`
/// rather than decaying every count every tick: the order is the same, the cost one add.
#[derive(Debug, Clone, Default)]
pub(crate) struct Heat {
    /// ln 2 per clock tick; 0 when off (LRU).
    rate: f64,
    base: u64,
    scaled: HashMap<ExpertKey, f64>,
}

impl Heat {
    /// For `eviction` on a table whose clock ticks `ticks_per_forward` times a forward
    /// (once per sparse layer).
    pub fn new(eviction: Eviction, ticks_per_forward: usize) -> Self {
        let rate = match eviction {
            Eviction::Lru => 0.0,
            Eviction::Lfru { half_life } => std::f64::consts::LN_2 / (half_life * ticks_per_forward.max(1) as f64),
        };
        Heat { rate, base: 0, scaled: HashMap::new() }
    }

    pub fn enabled(&self) -> bool {
        self.rate > 0.0
    }

    /// One use of `key` at `clock` (not before the last rescale's clock). True when it
    /// rescaled every heat (the order of the rest may change: some are forgotten).
    pub fn add(&mut self, key: ExpertKey, clock: u64) -> bool {
        if !self.enabled() {
            return false;
        }
        let mut weight = (clock.saturating_sub(self.base) as f64 * self.rate).exp();
        let rescale = weight > RESCALE_AT;
        if rescale {
            self.scaled.values_mut().for_each(|h| *h /= weight);
            // What has cooled to nothing against this use is forgotten (bounds the map).
            self.scaled.retain(|_, h| *h > 1e-12);
            self.base = clock;
            weight = 1.0;
        }
        *self.scaled.entry(key).or_default() += weight;
        rescale
    }

    /// Comparable within one table at one time; 0 for an expert never used.
    pub fn get(&self, key: ExpertKey) -> f64 {
        self.scaled.get(&key).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_policies_and_refuses_bad_half_lives_by_name() {
        assert_eq!(Eviction::parse("lru"), Ok(Eviction::Lru));
        assert_eq!(Eviction::parse("lfru"), Ok(Eviction::Lfru { half_life: Eviction::DEFAULT_HALF_LIFE }));
        assert_eq!(Eviction::parse("lfru:8.5"), Ok(Eviction::Lfru { half_life: 8.5 }));
        for bad in ["", "lfu", "lru:3", "lfru:", "lfru:0", "lfru:-2", "lfru:nan", "lfru:inf", "lfru:1e-300", "lfru:2e9"]
        {
            let err = Eviction::parse(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")) && err.contains("lfru:HALF_LIFE"), "{bad}: {err}");
        }
        for e in [Eviction::Lru, Eviction::Lfru { half_life: 12.5 }, Eviction::Lfru { half_life: 0.001 }] {
            assert_eq!(Eviction::parse(&e.to_string()), Ok(e));
        }
        assert!(Eviction::lfru(1e9).is_ok() && Eviction::lfru(1e10).unwrap_err().contains("got 10000000000"));
    }

    #[test]
    fn heat_matches_decayed_counts_across_rescales() {
        // Half-life 3 forwards of 2 ticks: each use weighs 2^(-age / 6 ticks) now.
        let mut heat = Heat::new(Eviction::Lfru { half_life: 3.0 }, 2);
        let mut rng = crate::TestRng::new(5);
        let mut uses: Vec<(ExpertKey, u64)> = Vec::new();
        let mut clock = 0;
        for _ in 0..3000 {
            clock += rng.below(4) as u64;
            let key = (1, rng.below(6));
            heat.add(key, clock);
            uses.push((key, clock));
        }
        assert!(heat.base > 0, "the clock ran far enough to rescale");
        let decayed =
            |key| uses.iter().filter(|u| u.0 == key).map(|u| (-((clock - u.1) as f64) / 6.0).exp2()).sum::<f64>();
        let now = (((clock - heat.base) as f64) * heat.rate).exp();
        for e in 0..6 {
            let (got, want) = (heat.get((1, e)) / now, decayed((1, e)));
            assert!((got - want).abs() <= 1e-9 * want.max(1.0), "expert {e}: {got} vs {want}");
        }
        assert_eq!(heat.get((2, 0)), 0.0);
        let mut off = Heat::new(Eviction::Lru, 2);
        off.add((1, 1), 5);
        assert_eq!(off.get((1, 1)), 0.0, "LRU keeps no heat");
    }
}

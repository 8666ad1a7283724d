//! Learning policies over the usage ledger: the start-up auto-pin plan and the
//! turn-boundary live-repin selection ("Auto-pin" and "Live repin" in residency.md).
//!
//! Explicit pins (`--pin L:E,...`) override auto-pin entirely: the caller plans auto
//! pins only when the user gave none, and never mixes the two lists.

use serde::Serialize;

use crate::ledger::UsageLedger;
use crate::ExpertKey;

/// Auto-pin needs at least this much history (selections).
pub const AUTO_PIN_MIN_HISTORY: u64 = 5_000;
/// History at which auto-pin trusts the ranking fully.
pub const AUTO_PIN_FULL_CONFIDENCE: u64 = 200_000;
/// Share of the resident tier pins may take at full confidence.
pub const AUTO_PIN_SHARE: f64 = 0.5;
/// Below this pin budget (bytes, decimal 500 MB) auto-pin does not bother.
pub const AUTO_PIN_MIN_BUDGET: u64 = 500_000_000;
/// Live repin swaps at most this many pins per turn, across all tiers.
pub const REPIN_MAX_SWAPS: usize = 4;

/// One chosen pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AutoPin {
    pub layer: usize,
    pub expert: usize,
    pub count: u32,
}

/// The auto-pin decision with its inputs, for telemetry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AutoPinPlan {
    /// Total selections in the ledger.
    pub history_selections: u64,
    /// `min(history / 200_000, 1)`.
    pub confidence: f64,
    /// `0.5 * confidence * resident_tier_budget`.
    pub requested_budget_bytes: u64,
    /// The requested budget, limited to what is left after the mandatory slots.
    pub usable_budget_bytes: u64,
    /// Bytes the chosen pins occupy.
    pub planned_bytes: u64,
    /// By descending count (ties: layer, then expert).
    pub pins: Vec<AutoPin>,
    /// Why there are no pins, when there are none.
    pub skipped: Option<String>,
}

impl AutoPinPlan {
    pub fn keys(&self) -> Vec<ExpertKey> {
        self.pins.iter().map(|p| (p.layer, p.expert)).collect()
    }
}

/// Plans auto pins from the ledger's history.
///
/// - `resident_tier_budget`: bytes for the persistent LRU + pin tiers (the budget less
///   fixed bytes and working banks).
/// - `mandatory_bytes`: the one slot per managed layer that must stay available.
/// - `layers`: the layers this tier manages (others in the ledger are ignored).
/// - `slot_bytes(layer)`: one expert's slot size in that layer (MTP may differ).
///
/// Needs >= 5,000 selections; confidence reaches 1 at 200,000; the pin budget is
/// `0.5 * confidence * resident_tier_budget` and must be >= 500 MB; pins are taken
/// greedily by descending count while they fit in what is left after the mandatory
/// bytes. The caller sizes the plan's pinned bank from `pins.len()`.
pub fn plan_auto_pins(
    ledger: &UsageLedger,
    resident_tier_budget: u64,
    mandatory_bytes: u64,
    layers: &[usize],
    slot_bytes: impl Fn(usize) -> u64,
) -> AutoPinPlan {
    let history = ledger.total_selections();
    let confidence = (history as f64 / AUTO_PIN_FULL_CONFIDENCE as f64).min(1.0);
    let requested = (resident_tier_budget as f64 * AUTO_PIN_SHARE * confidence).floor() as u64;
    let usable = requested.min(resident_tier_budget.saturating_sub(mandatory_bytes));
    let mut plan = AutoPinPlan {
        history_selections: history,
        confidence,
        requested_budget_bytes: requested,
        usable_budget_bytes: usable,
        planned_bytes: 0,
        pins: Vec::new(),
        skipped: None,
    };
    if history < AUTO_PIN_MIN_HISTORY {
        plan.skipped = Some(format!("{history} selections of history; auto-pin needs {AUTO_PIN_MIN_HISTORY}"));
        return plan;
    }
    if requested < AUTO_PIN_MIN_BUDGET {
        plan.skipped = Some(format!("pin budget {requested} bytes is below {AUTO_PIN_MIN_BUDGET} bytes"));
        return plan;
    }
    for ((layer, expert), count) in ledger.ranked_counts() {
        if !layers.contains(&layer) {
            continue;
        }
        let bytes = slot_bytes(layer);
        // Skip rather than stop: a smaller slot (another tier) may still fit.
        if plan.planned_bytes + bytes > usable {
            continue;
        }
        plan.planned_bytes += bytes;
        plan.pins.push(AutoPin { layer, expert, count });
    }
    if plan.pins.is_empty() {
        plan.skipped = Some(format!("no expert slot fits in {usable} usable bytes"));
    }
    plan
}

/// A proposed live-repin swap in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RepinCandidate {
    pub layer: usize,
    /// The coldest pin (lowest LFRU score).
    pub cold_expert: usize,
    /// The hottest unpinned expert (highest LFRU score).
    pub hot_expert: usize,
    pub cold_score: u64,
    pub hot_score: u64,
    /// `hot_score - cold_score`.
    pub gain: u64,
}

/// The layer's swap candidate, if its hottest unpinned expert beats its coldest pin by
/// the hysteresis `hot > cold + cold/4 + 4*256` (25% plus four selections' heat).
/// Ties go to the lowest expert id on both sides.
pub fn repin_candidate(ledger: &UsageLedger, layer: usize, pinned_experts: &[usize]) -> Option<RepinCandidate> {
    let score = |e: usize| ledger.lfru_score((layer, e));
    let (cold_score, cold_expert) = pinned_experts.iter().map(|&e| (score(e), e)).min()?;
    let (hot_score, hot_expert) = (0..ledger.n_experts())
        .filter(|e| !pinned_experts.contains(e))
        .map(|e| (score(e), std::cmp::Reverse(e)))
        .max()
        .map(|(s, std::cmp::Reverse(e))| (s, e))?;
    if hot_score <= cold_score + cold_score / 4 + 4 * 256 {
        return None;
    }
    Some(RepinCandidate { layer, cold_expert, hot_expert, cold_score, hot_score, gain: hot_score - cold_score })
}

/// Chooses at most `max_swaps` swaps (the caller passes [`REPIN_MAX_SWAPS`]) from the
/// candidates of all tiers, highest gain first (ties: layer, then hot expert), never
/// touching the same pin or hot expert twice.
pub fn select_repins(candidates: &[RepinCandidate], max_swaps: usize) -> Vec<RepinCandidate> {
    let mut sorted = candidates.to_vec();
    sorted.sort_by(|a, b| b.gain.cmp(&a.gain).then(a.layer.cmp(&b.layer)).then(a.hot_expert.cmp(&b.hot_expert)));
    let mut chosen: Vec<RepinCandidate> = Vec::new();
    for c in sorted {
        if chosen.len() == max_swaps {
            break;
        }
        let clashes = chosen
            .iter()
            .any(|p| p.layer == c.layer && (p.cold_expert == c.cold_expert || p.hot_expert == c.hot_expert));
        if !clashes {
            chosen.push(c);
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::GLM_ENGINE;

    fn ledger(layers: &[usize], n_experts: usize) -> UsageLedger {
        UsageLedger::new(GLM_ENGINE, "/nonexistent/.coli_usage", 10, n_experts, layers).unwrap()
    }

    /// Records `n` selections of each (layer, expert, n).
    fn fill(l: &mut UsageLedger, counts: &[(usize, usize, usize)]) {
        for &(layer, expert, n) in counts {
            for _ in 0..n {
                l.record(layer, &[expert]);
            }
        }
    }

    const GB: u64 = 1_000_000_000;

    #[test]
    fn auto_pin_needs_history() {
        let mut l = ledger(&[1], 4);
        fill(&mut l, &[(1, 0, 4_999)]);
        let plan = plan_auto_pins(&l, 100 * GB, 0, &[1], |_| 1);
        assert!(plan.pins.is_empty());
        assert!(plan.skipped.as_deref().unwrap().contains("4999 selections"), "{plan:?}");
    }

    #[test]
    fn auto_pin_budget_scales_with_confidence_and_must_reach_500mb() {
        let mut l = ledger(&[1, 2], 8);
        fill(&mut l, &[(1, 0, 3_000), (1, 1, 2_000), (2, 5, 5_000)]); // 10,000 = 5% confidence
                                                                      // 5% * 0.5 * 100 GB = 2.5 GB requested.
        let plan = plan_auto_pins(&l, 100 * GB, 0, &[1, 2], |_| GB);
        assert!((plan.confidence - 0.05).abs() < 1e-12);
        assert_eq!(plan.requested_budget_bytes, 2_500_000_000);
        assert_eq!(plan.usable_budget_bytes, 2_500_000_000);
        // Greedy by count: 2:5 (5000), 1:0 (3000); 1:1 would exceed 2.5 GB.
        assert_eq!(plan.keys(), vec![(2, 5), (1, 0)]);
        assert_eq!(plan.planned_bytes, 2 * GB);
        assert_eq!(plan.pins[0].count, 5_000);
        // 10 GB tier: 5% * 0.5 * 10 GB = 250 MB < 500 MB: no pins.
        let small = plan_auto_pins(&l, 10 * GB, 0, &[1, 2], |_| 1);
        assert!(small.pins.is_empty());
        assert!(small.skipped.unwrap().contains("below 500000000"));
    }

    #[test]
    fn auto_pin_leaves_the_mandatory_slots_and_respects_layers_and_slot_sizes() {
        let mut l = ledger(&[1, 2, 10], 8);
        fill(&mut l, &[(1, 0, 100_000), (2, 1, 90_000), (10, 3, 80_000), (1, 2, 70_000)]);
        // Full confidence (340k): requested 0.5 * 10 GB = 5 GB; usable = 10 - 7 = 3 GB.
        let plan = plan_auto_pins(&l, 10 * GB, 7 * GB, &[1, 2, 10], |layer| if layer == 10 { GB / 2 } else { GB });
        assert_eq!(plan.confidence, 1.0);
        assert_eq!(plan.usable_budget_bytes, 3 * GB);
        // 1:0 (1 GB) + 2:1 (1 GB) + 10:3 (0.5 GB) = 2.5 GB; 1:2 (1 GB) does not fit.
        assert_eq!(plan.keys(), vec![(1, 0), (2, 1), (10, 3)]);
        assert_eq!(plan.planned_bytes, 2 * GB + GB / 2);
        // A tier that manages only layer 2 ignores the rest of the ledger.
        let only2 = plan_auto_pins(&l, 10 * GB, 7 * GB, &[2], |_| GB);
        assert_eq!(only2.keys(), vec![(2, 1)]);
        // Mandatory bytes above the tier budget: nothing usable.
        let none = plan_auto_pins(&l, 10 * GB, 11 * GB, &[1], |_| GB);
        assert_eq!(none.usable_budget_bytes, 0);
        assert!(none.pins.is_empty());
    }

    #[test]
    fn repin_requires_the_hysteresis_margin() {
        let mut l = ledger(&[1], 8);
        // Pins 0 (cold) and 1 (hot); unpinned 2 warms up. Clock: 0 ends at 4, 1 at 44,
        // 2 at 53.
        fill(&mut l, &[(1, 0, 4), (1, 1, 40), (1, 2, 9)]);
        let pinned = [0, 1];
        assert_eq!(l.lfru_score((1, 0)), 4 * 256 + (255 - 49));
        assert_eq!(l.lfru_score((1, 2)), 9 * 256 + 255);
        // 2559 <= 1230 + 307 + 1024 = 2561: not enough.
        assert_eq!(repin_candidate(&l, 1, &pinned), None);
        fill(&mut l, &[(1, 2, 1)]);
        // hot 2815 > cold 1229 + 307 + 1024 = 2560.
        let c = repin_candidate(&l, 1, &pinned).unwrap();
        assert_eq!(
            c,
            RepinCandidate { layer: 1, cold_expert: 0, hot_expert: 2, cold_score: 1229, hot_score: 2815, gain: 1586 }
        );
        assert_eq!(repin_candidate(&l, 1, &[]), None, "no pins, nothing to swap");
        assert_eq!(repin_candidate(&l, 1, &[0, 1, 2, 3, 4, 5, 6, 7]), None, "everything pinned");
    }

    #[test]
    fn repin_ties_go_to_the_lowest_expert_ids() {
        let mut l = ledger(&[1], 8);
        fill(&mut l, &[(1, 6, 10), (1, 4, 10)]);
        // Cold pins 0 and 1 both score 255 - 20; hot 4 and 6: 4 is more recent, wins.
        let c = repin_candidate(&l, 1, &[1, 0]).unwrap();
        assert_eq!((c.cold_expert, c.hot_expert), (0, 4));
        l.decay_heat();
        l.decay_heat();
        l.decay_heat();
        l.decay_heat();
        // Heat 10 -> 0 after four turns: no candidate.
        assert_eq!(repin_candidate(&l, 1, &[1, 0]), None);
    }

    fn cand(layer: usize, cold: usize, hot: usize, gain: u64) -> RepinCandidate {
        RepinCandidate { layer, cold_expert: cold, hot_expert: hot, cold_score: 0, hot_score: gain, gain }
    }

    #[test]
    fn select_repins_takes_the_highest_gains_up_to_the_limit() {
        let cs = [
            cand(3, 0, 1, 500),
            cand(1, 0, 1, 900),
            cand(78, 2, 5, 700), // MTP tier competes in the same pool
            cand(2, 0, 9, 500),
            cand(4, 0, 1, 100),
            cand(5, 0, 1, 50),
        ];
        let chosen = select_repins(&cs, REPIN_MAX_SWAPS);
        let layers: Vec<_> = chosen.iter().map(|c| c.layer).collect();
        assert_eq!(layers, vec![1, 78, 2, 3], "gain, then layer");
        assert!(select_repins(&cs, 0).is_empty());
        assert_eq!(select_repins(&[], 4), vec![]);
    }

    #[test]
    fn select_repins_never_swaps_one_pin_twice() {
        let cs = [cand(1, 0, 5, 900), cand(1, 0, 6, 800), cand(1, 2, 5, 700), cand(1, 3, 7, 600)];
        let chosen = select_repins(&cs, 4);
        assert_eq!(chosen, vec![cs[0], cs[3]]);
    }
}

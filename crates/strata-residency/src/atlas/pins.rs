//! Warm start: a pin set chosen from an atlas for an expected topic mix, for a first
//! turn with no usage-ledger history.
//!
//! An expert's score is its expected share of a turn's selections under the mix: the
//! mean over the chosen topics of its mean per-run selection share in that topic (the
//! same normalisation as the atlas). Pins are taken greedily by descending score
//! (ties: lower layer, then expert) within `AUTO_PIN_SHARE` of the resident tier, less
//! the mandatory slot per layer: auto-pin's budget at full confidence, since the atlas is
//! a deliberate measurement. Auto-pin's 500 MB floor is not applied: it exists to skip
//! small ledger-driven gains on GLM-5-sized tiers, while a warm start is asked for.

use serde::Serialize;

use super::{category_shares, err, AtlasError, AtlasFile};
use crate::policy::AUTO_PIN_SHARE;
use crate::ExpertKey;

/// One ranked expert.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MixScore {
    pub layer: usize,
    pub expert: usize,
    /// Expected share of the mix's selections.
    pub share: f64,
}

/// The topics of `topics` (deduplicated), or every category when empty; an unknown
/// topic is refused with the atlas's topics listed.
pub fn resolve_topics(atlas: &AtlasFile, topics: &[String]) -> Result<Vec<String>, AtlasError> {
    let known = &atlas.analysis.categories;
    if topics.is_empty() {
        return Ok(known.clone());
    }
    let mut out: Vec<String> = Vec::new();
    for t in topics {
        let t = t.trim();
        if !known.iter().any(|k| k == t) {
            return err(format!("unknown topic {t:?} (this atlas has: {})", known.join(", ")));
        }
        if !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    }
    Ok(out)
}

/// Every expert the runs selected, ranked for the mix of `topics` (equal weights).
pub fn mix_ranking(atlas: &AtlasFile, topics: &[String]) -> Result<Vec<MixScore>, AtlasError> {
    let topics = resolve_topics(atlas, topics)?;
    let categories = &atlas.analysis.categories;
    let runs: Vec<_> = atlas.runs.iter().collect();
    let shares = category_shares(categories, &runs);
    let idx: Vec<usize> =
        topics.iter().map(|t| categories.iter().position(|c| c == t).expect("resolved topics are known")).collect();
    let mut ranked: Vec<MixScore> = shares
        .iter()
        .map(|(&(layer, expert), v)| MixScore {
            layer,
            expert,
            share: idx.iter().map(|&i| v[i]).sum::<f64>() / idx.len() as f64,
        })
        .filter(|s| s.share > 0.0)
        .collect();
    ranked.sort_by(|a, b| b.share.total_cmp(&a.share).then((a.layer, a.expert).cmp(&(b.layer, b.expert))));
    Ok(ranked)
}

/// The warm-start pin decision with its inputs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AtlasPinPlan {
    pub topics: Vec<String>,
    /// `AUTO_PIN_SHARE * resident_tier_budget`.
    pub requested_budget_bytes: u64,
    /// The request, limited to what the mandatory slots leave.
    pub usable_budget_bytes: u64,
    pub planned_bytes: u64,
    /// Chosen pins, best first.
    pub pins: Vec<MixScore>,
    /// The mix's selection share the pins cover (an upper bound on the first turn's
    /// pinned hits, if the turn matches the mix).
    pub covered_share: f64,
}

impl AtlasPinPlan {
    pub fn keys(&self) -> Vec<ExpertKey> {
        self.pins.iter().map(|p| (p.layer, p.expert)).collect()
    }
}

/// Plans pins from the atlas for `topics` (empty: all), for the layers this tier manages.
/// `resident_tier_budget` and `mandatory_bytes` are as in [`crate::plan_auto_pins`].
pub fn plan_atlas_pins(
    atlas: &AtlasFile,
    topics: &[String],
    resident_tier_budget: u64,
    mandatory_bytes: u64,
    layers: &[usize],
    slot_bytes: u64,
) -> Result<AtlasPinPlan, AtlasError> {
    let topics = resolve_topics(atlas, topics)?;
    let requested = (resident_tier_budget as f64 * AUTO_PIN_SHARE).floor() as u64;
    let usable = requested.min(resident_tier_budget.saturating_sub(mandatory_bytes));
    let mut plan = AtlasPinPlan {
        topics: topics.clone(),
        requested_budget_bytes: requested,
        usable_budget_bytes: usable,
        planned_bytes: 0,
        pins: Vec::new(),
        covered_share: 0.0,
    };
    if slot_bytes == 0 {
        return Ok(plan);
    }
    for s in mix_ranking(atlas, &topics)? {
        if !layers.contains(&s.layer) {
            continue;
        }
        if plan.planned_bytes + slot_bytes > usable {
            break;
        }
        plan.planned_bytes += slot_bytes;
        plan.covered_share += s.share;
        plan.pins.push(s);
    }
    Ok(plan)
}

//! Global leave-one-prompt-out validation: does the map, built without a prompt,
//! recognise that prompt's category from its routes alone?
//!
//! For each held-out run, the other runs give every category's mean selection shares;
//! an expert's score for category `c` is `p(c | expert)` over those means, and the
//! category's specialist set is its `top_k` experts by score (ties to the lower layer,
//! then expert). The prediction is the category whose set covers the largest share of
//! the held-out run's selections (ties to the earlier category).

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use super::{arg_max, category_shares, checked_runs, err, round6, AtlasError, AtlasRun};
use crate::ExpertKey;

/// The reference's specialist-set size (of 19,200 experts on GLM-5.2).
pub const DEFAULT_TOP_K: usize = 200;

/// One held-out prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    pub category: String,
    pub prompt: usize,
    pub predicted: String,
    pub correct: bool,
    /// Share of the prompt's selections covered by its own category's set.
    pub own_share: f64,
    /// The largest share covered by another category's set.
    pub best_other_share: f64,
    pub scores: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    pub protocol: String,
    pub top_k: usize,
    pub hits: usize,
    pub trials: usize,
    pub accuracy: f64,
    /// `1 / categories`.
    pub chance: f64,
    pub trials_by_prompt: Vec<Trial>,
}

/// The default set size: the reference's 200, capped at the experts seen divided by
/// the categories, so that on a small model (strata-tiny: 160 experts) the sets are not
/// everything and can differ.
pub fn default_top_k(experts_seen: usize, categories: usize) -> usize {
    DEFAULT_TOP_K.min(experts_seen / categories.max(1)).max(1)
}

fn specialist_sets(categories: &[String], training: &[&AtlasRun], top_k: usize) -> Vec<HashSet<ExpertKey>> {
    let shares = category_shares(categories, training);
    (0..categories.len())
        .map(|c| {
            let mut scored: Vec<(f64, ExpertKey)> =
                shares.iter().filter(|(_, v)| v[c] > 0.0).map(|(&k, v)| (v[c] / v.iter().sum::<f64>(), k)).collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            scored.into_iter().take(top_k).map(|(_, k)| k).collect()
        })
        .collect()
}

/// Leave-one-prompt-out over every run (`prompts`: category -> prompt count).
pub fn validate(prompts: &BTreeMap<String, usize>, runs: &[AtlasRun], top_k: usize) -> Result<Validation, AtlasError> {
    if top_k == 0 {
        return err("--top-k must be at least 1");
    }
    let ordered = checked_runs(prompts, runs)?;
    let categories: Vec<String> = prompts.keys().cloned().collect();
    let mut trials = Vec::with_capacity(ordered.len());
    for (i, held) in ordered.iter().enumerate() {
        let training: Vec<&AtlasRun> = ordered.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, r)| *r).collect();
        let sets = specialist_sets(&categories, &training, top_k);
        let scores: Vec<f64> = sets
            .iter()
            .map(|set| {
                let covered: u64 =
                    held.counts.iter().filter(|&&(l, e, _)| set.contains(&(l, e))).map(|&(_, _, n)| n).sum();
                covered as f64 / held.total_selections as f64
            })
            .collect();
        let predicted = &categories[arg_max(&scores)];
        let own = categories.iter().position(|c| c == &held.category).expect("checked runs have known categories");
        let best_other = scores.iter().enumerate().filter(|&(c, _)| c != own).map(|(_, &s)| s).fold(0.0, f64::max);
        trials.push(Trial {
            category: held.category.clone(),
            prompt: held.prompt,
            predicted: predicted.clone(),
            correct: predicted == &held.category,
            own_share: round6(scores[own]),
            best_other_share: round6(best_other),
            scores: categories.iter().zip(&scores).map(|(c, &s)| (c.clone(), round6(s))).collect(),
        });
    }
    let hits = trials.iter().filter(|t| t.correct).count();
    Ok(Validation {
        protocol: "global leave-one-prompt-out".to_string(),
        top_k,
        hits,
        trials: trials.len(),
        accuracy: round6(hits as f64 / trials.len().max(1) as f64),
        chance: round6(1.0 / categories.len() as f64),
        trials_by_prompt: trials,
    })
}

//! Expert Atlas: an offline map of which routed experts specialise in which kind of
//! text ("Route traces, coupling, Expert Atlas" in residency.md).
//!
//! A probe set names categories of prompts. Each prompt is run with a fresh KV cache and
//! is one independent observation (an [`AtlasRun`]): its selection counts are normalised
//! by the run's total selections, the shares are averaged within a category, and the
//! category means are renormalised to `p(topic | expert)`. An expert is kept only when
//! it was selected at least `min_count` times in all and its top topic fired in at least
//! `min_runs` prompts of that topic; `specialization = 1 - entropy / ln(categories)`,
//! strong at `>= strong_threshold`.
//!
//! Nothing here feeds routing. [`validate`] checks that the map predicts held-out
//! prompts (global leave-one-prompt-out); [`pins`] turns it into a warm-start pin set.
//! Pure: no tensors, no I/O.

pub mod pins;
mod validate;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ExpertKey;

pub use validate::{default_top_k, validate, Trial, Validation};

/// The probe-set and atlas schema this build reads and writes.
pub const ATLAS_SCHEMA_VERSION: u32 = 1;
/// The `format` field of an atlas file.
pub const ATLAS_FORMAT: &str = "strata-atlas";
pub const DEFAULT_MIN_COUNT: u64 = 30;
pub const DEFAULT_MIN_RUNS: usize = 2;
pub const DEFAULT_STRONG_THRESHOLD: f64 = 0.5;
pub const MIN_CATEGORIES: usize = 2;
pub const MIN_PROMPTS: usize = 3;
/// How selection counts are normalised (recorded in the file).
pub const NORMALIZATION: &str = "mean per-run selection share";

/// A malformed probe set, run or atlas file: one line naming the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtlasError(pub String);

impl fmt::Display for AtlasError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AtlasError {}

fn err<T>(message: impl Into<String>) -> Result<T, AtlasError> {
    Err(AtlasError(message.into()))
}

/// Where the prompts come from (the reference's field names, so its probe sets load).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    pub source: String,
    #[serde(rename = "sourceCommit")]
    pub source_commit: String,
    pub method: String,
}

/// A probe set, schema version 1: provenance and at least two categories of at least
/// three non-empty prompts, category names `[a-z0-9_]+`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeSet {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    pub provenance: Provenance,
    /// Category -> prompts, in category-name order.
    pub categories: BTreeMap<String, Vec<String>>,
}

/// True for `[a-z0-9_]+`.
pub fn valid_category(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

impl ProbeSet {
    /// Parses and validates probe-set JSON.
    pub fn parse(text: &str) -> Result<ProbeSet, AtlasError> {
        let value: Value = serde_json::from_str(text).map_err(|e| AtlasError(format!("invalid JSON: {e}")))?;
        Self::from_value(&value)
    }

    /// Validates a parsed JSON document field by field, naming the first problem.
    pub fn from_value(value: &Value) -> Result<ProbeSet, AtlasError> {
        let Some(obj) = value.as_object() else { return err("a probe set must be a JSON object") };
        match obj.get("schemaVersion") {
            Some(v) if v.as_u64() == Some(ATLAS_SCHEMA_VERSION as u64) => {}
            Some(v) => return err(format!("unsupported schemaVersion {v} (this build reads {ATLAS_SCHEMA_VERSION})")),
            None => return err(format!("missing schemaVersion (expected {ATLAS_SCHEMA_VERSION})")),
        }
        let Some(prov) = obj.get("provenance").and_then(Value::as_object) else {
            return err("missing provenance: an object with source, sourceCommit and method");
        };
        let field = |key: &str| -> Result<String, AtlasError> {
            match prov.get(key).and_then(Value::as_str) {
                Some(s) if !s.trim().is_empty() => Ok(s.to_string()),
                _ => err(format!("provenance.{key} must be a non-empty string")),
            }
        };
        let provenance =
            Provenance { source: field("source")?, source_commit: field("sourceCommit")?, method: field("method")? };
        let Some(raw) = obj.get("categories").and_then(Value::as_object) else {
            return err("missing categories: an object mapping category names to arrays of prompts");
        };
        let mut categories = BTreeMap::new();
        for (name, prompts) in raw {
            if !valid_category(name) {
                return err(format!("category {name:?}: names are [a-z0-9_]+"));
            }
            let Some(list) = prompts.as_array() else {
                return err(format!("category {name}: prompts must be an array of strings"));
            };
            let mut out = Vec::with_capacity(list.len());
            for (i, p) in list.iter().enumerate() {
                match p.as_str() {
                    Some(s) if !s.trim().is_empty() => out.push(s.to_string()),
                    _ => return err(format!("category {name}: prompt {i} must be a non-empty string")),
                }
            }
            categories.insert(name.clone(), out);
        }
        let set = ProbeSet { schema_version: ATLAS_SCHEMA_VERSION, provenance, categories };
        set.check()?;
        Ok(set)
    }

    /// The counting rules (also applied to a probe set read back from an atlas file).
    pub fn check(&self) -> Result<(), AtlasError> {
        if self.schema_version != ATLAS_SCHEMA_VERSION {
            return err(format!(
                "unsupported schemaVersion {} (this build reads {ATLAS_SCHEMA_VERSION})",
                self.schema_version
            ));
        }
        if self.categories.len() < MIN_CATEGORIES {
            return err(format!(
                "{} categor{}: an atlas needs at least {MIN_CATEGORIES}",
                self.categories.len(),
                if self.categories.len() == 1 { "y" } else { "ies" }
            ));
        }
        for (name, prompts) in &self.categories {
            if !valid_category(name) {
                return err(format!("category {name:?}: names are [a-z0-9_]+"));
            }
            if prompts.len() < MIN_PROMPTS {
                return err(format!(
                    "category {name} has {} prompts: at least {MIN_PROMPTS} are needed",
                    prompts.len()
                ));
            }
        }
        Ok(())
    }

    /// Category -> number of prompts.
    pub fn prompt_counts(&self) -> BTreeMap<String, usize> {
        self.categories.iter().map(|(k, v)| (k.clone(), v.len())).collect()
    }

    pub fn prompt_count(&self) -> usize {
        self.categories.values().map(Vec::len).sum()
    }
}

/// One prompt's routing: every selection of every row of every forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AtlasRun {
    pub category: String,
    /// Index of the prompt within its category.
    pub prompt: usize,
    /// Positions routed (prompt and generated tokens).
    pub tokens: usize,
    pub total_selections: u64,
    /// `[layer, expert, count]`, ascending (layer, expert); the run's normalised share
    /// of an expert is `count / total_selections`.
    pub counts: Vec<(usize, usize, u64)>,
}

impl AtlasRun {
    /// The run's id, `category:prompt`.
    pub fn id(&self) -> String {
        format!("{}:{}", self.category, self.prompt)
    }

    /// Selections of `key`, 0 when absent.
    pub fn count(&self, key: ExpertKey) -> u64 {
        self.counts.binary_search_by(|&(l, e, _)| (l, e).cmp(&key)).map_or(0, |i| self.counts[i].2)
    }
}

/// Accumulates one run's selections, one router row at a time.
#[derive(Debug, Default, Clone)]
pub struct RunCounter {
    counts: BTreeMap<ExpertKey, u64>,
    total: u64,
}

impl RunCounter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one row's top-k at `layer`; an empty row or a repeated expert is refused.
    pub fn record(&mut self, layer: usize, experts: &[usize]) -> Result<(), AtlasError> {
        if experts.is_empty() {
            return err(format!("layer {layer}: a route row with no experts"));
        }
        for (i, e) in experts.iter().enumerate() {
            if experts[..i].contains(e) {
                return err(format!("layer {layer}: expert {e} appears twice in one route row"));
            }
        }
        for &e in experts {
            *self.counts.entry((layer, e)).or_insert(0) += 1;
        }
        self.total += experts.len() as u64;
        Ok(())
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn finish(self, category: &str, prompt: usize, tokens: usize) -> AtlasRun {
        AtlasRun {
            category: category.to_string(),
            prompt,
            tokens,
            total_selections: self.total,
            counts: self.counts.into_iter().map(|((l, e), c)| (l, e, c)).collect(),
        }
    }
}

/// Checks that `runs` are exactly one per prompt of `prompts` (category -> prompt
/// count), internally consistent; returns them ordered by (category, prompt).
pub fn checked_runs<'a>(
    prompts: &BTreeMap<String, usize>,
    runs: &'a [AtlasRun],
) -> Result<Vec<&'a AtlasRun>, AtlasError> {
    let mut seen: BTreeMap<(&str, usize), &AtlasRun> = BTreeMap::new();
    for run in runs {
        let id = run.id();
        match prompts.get(&run.category) {
            Some(&n) if run.prompt < n => {}
            _ => return err(format!("run {id} matches no prompt of the probe set")),
        }
        if run.total_selections == 0 {
            return err(format!("run {id} has no selections"));
        }
        let mut sum = 0u64;
        for (i, &(l, e, c)) in run.counts.iter().enumerate() {
            if c == 0 {
                return err(format!("run {id}: expert {l}:{e} has a zero count"));
            }
            if i > 0 && (run.counts[i - 1].0, run.counts[i - 1].1) >= (l, e) {
                return err(format!("run {id}: counts are not in ascending (layer, expert) order at {l}:{e}"));
            }
            sum += c;
        }
        if sum != run.total_selections {
            return err(format!("run {id}: counts sum to {sum}, not total_selections {}", run.total_selections));
        }
        if seen.insert((run.category.as_str(), run.prompt), run).is_some() {
            return err(format!("duplicate run {id}"));
        }
    }
    let missing: Vec<String> = prompts
        .iter()
        .flat_map(|(c, &n)| (0..n).map(move |i| (c, i)))
        .filter(|(c, i)| !seen.contains_key(&(c.as_str(), *i)))
        .map(|(c, i)| format!("{c}:{i}"))
        .collect();
    if !missing.is_empty() {
        return err(format!("missing runs: {}", missing.join(", ")));
    }
    Ok(seen.into_values().collect())
}

/// Per expert, the mean per-run selection share in each category (index = position in
/// `categories`); a category with no runs contributes zeros.
pub(crate) fn category_shares(categories: &[String], runs: &[&AtlasRun]) -> BTreeMap<ExpertKey, Vec<f64>> {
    let mut shares: BTreeMap<ExpertKey, Vec<f64>> = BTreeMap::new();
    for (c, category) in categories.iter().enumerate() {
        let of: Vec<&&AtlasRun> = runs.iter().filter(|r| &r.category == category).collect();
        for run in &of {
            let scale = 1.0 / (run.total_selections as f64 * of.len() as f64);
            for &(l, e, n) in &run.counts {
                shares.entry((l, e)).or_insert_with(|| vec![0.0; categories.len()])[c] += n as f64 * scale;
            }
        }
    }
    shares
}

/// The first index holding the largest value (ties to the earlier category).
pub(crate) fn arg_max(values: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best
}

pub(crate) fn round6(v: f64) -> f64 {
    (v * 1e6).round() / 1e6
}

/// Method parameters of the analysis.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AtlasOptions {
    /// Minimum selections of an expert over all runs.
    pub min_count: u64,
    /// Minimum prompts of its top topic in which the expert fired.
    pub min_runs: usize,
    /// Specialisation at which an expert counts as a strong specialist.
    pub strong_threshold: f64,
}

impl Default for AtlasOptions {
    fn default() -> Self {
        Self { min_count: DEFAULT_MIN_COUNT, min_runs: DEFAULT_MIN_RUNS, strong_threshold: DEFAULT_STRONG_THRESHOLD }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Method {
    pub min_count: u64,
    pub min_runs: usize,
    pub strong_threshold: f64,
    pub normalization: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reliability {
    /// Prompts of the top topic in which the expert was selected at least once.
    pub fired_runs: usize,
    pub total_runs: usize,
}

/// One kept expert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AtlasExpert {
    pub layer: usize,
    pub expert: usize,
    /// Selections over all runs.
    pub total: u64,
    /// `1 - entropy(p(topic | expert)) / ln(categories)`, in [0, 1].
    pub specialization: f64,
    pub top_topic: String,
    /// `p(top topic | expert) * categories` (1 = no preference).
    pub top_lift: f64,
    pub reliability: Reliability,
    /// `p(topic | expert)` per category.
    pub affinity: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub experts_seen: usize,
    pub experts_kept: usize,
    /// Fewer than `min_count` selections.
    pub dropped_sparse: usize,
    /// Top topic fired in fewer than `min_runs` prompts.
    pub dropped_unreplicated: usize,
    pub strong_specialists: usize,
    /// Strong specialists / kept experts.
    pub strong_specialist_rate: f64,
}

/// The analysis of a complete set of runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    pub categories: Vec<String>,
    pub run_count: usize,
    pub method: Method,
    pub summary: Summary,
    /// By descending specialisation, then total, then (layer, expert).
    pub experts: Vec<AtlasExpert>,
}

/// Builds the atlas from one run per prompt (`prompts`: category -> prompt count).
pub fn analyse(
    prompts: &BTreeMap<String, usize>,
    runs: &[AtlasRun],
    opts: &AtlasOptions,
) -> Result<Analysis, AtlasError> {
    if opts.min_count == 0 {
        return err("--min-count must be at least 1");
    }
    if opts.min_runs == 0 {
        return err("--min-runs must be at least 1");
    }
    if !(0.0..=1.0).contains(&opts.strong_threshold) {
        return err(format!("--strong-threshold must be in [0, 1], got {}", opts.strong_threshold));
    }
    if let Some((c, &n)) = prompts.iter().find(|(_, &n)| n < opts.min_runs) {
        return err(format!("--min-runs {} exceeds the {n} prompts of category {c}", opts.min_runs));
    }
    let ordered = checked_runs(prompts, runs)?;
    let categories: Vec<String> = prompts.keys().cloned().collect();
    let shares = category_shares(&categories, &ordered);
    let ln_c = (categories.len() as f64).ln();
    let (mut dropped_sparse, mut dropped_unreplicated) = (0, 0);
    let mut experts = Vec::new();
    for (&key, means) in &shares {
        let total: u64 = ordered.iter().map(|r| r.count(key)).sum();
        if total < opts.min_count {
            dropped_sparse += 1;
            continue;
        }
        let sum: f64 = means.iter().sum();
        if sum <= 0.0 {
            continue;
        }
        let p: Vec<f64> = means.iter().map(|m| m / sum).collect();
        let top = arg_max(&p);
        let top_runs: Vec<&&AtlasRun> = ordered.iter().filter(|r| r.category == categories[top]).collect();
        let fired = top_runs.iter().filter(|r| r.count(key) > 0).count();
        if fired < opts.min_runs {
            dropped_unreplicated += 1;
            continue;
        }
        let entropy: f64 = -p.iter().filter(|&&x| x > 0.0).map(|&x| x * x.ln()).sum::<f64>();
        let specialization = (1.0 - entropy / ln_c).clamp(0.0, 1.0);
        experts.push(AtlasExpert {
            layer: key.0,
            expert: key.1,
            total,
            specialization: round6(specialization),
            top_topic: categories[top].clone(),
            top_lift: round6(p[top] * categories.len() as f64),
            reliability: Reliability { fired_runs: fired, total_runs: top_runs.len() },
            affinity: categories.iter().zip(&p).map(|(c, &x)| (c.clone(), round6(x))).collect(),
        });
    }
    experts.sort_by(|a, b| {
        b.specialization
            .total_cmp(&a.specialization)
            .then(b.total.cmp(&a.total))
            .then((a.layer, a.expert).cmp(&(b.layer, b.expert)))
    });
    let strong = experts.iter().filter(|e| e.specialization >= opts.strong_threshold).count();
    Ok(Analysis {
        run_count: ordered.len(),
        method: Method {
            min_count: opts.min_count,
            min_runs: opts.min_runs,
            strong_threshold: opts.strong_threshold,
            normalization: NORMALIZATION.to_string(),
        },
        summary: Summary {
            experts_seen: shares.len(),
            experts_kept: experts.len(),
            dropped_sparse,
            dropped_unreplicated,
            strong_specialists: strong,
            strong_specialist_rate: round6(strong as f64 / experts.len().max(1) as f64),
        },
        categories,
        experts,
    })
}

/// The model an atlas was built on (the grid's shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AtlasModel {
    pub name: String,
    pub model_type: String,
    /// Model layer ids of the routed layers.
    pub layers: Vec<usize>,
    pub experts_per_layer: usize,
    pub top_k: usize,
}

/// How the prompts were run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSettings {
    /// Greedy tokens generated after each prompt (their forwards are recorded too).
    pub max_tokens: usize,
    /// Prompts were wrapped as a user message through the chat template.
    pub chat: bool,
}

/// An atlas file: the analysis, the validation, and the runs it came from (so the file
/// alone can be re-analysed and validated).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AtlasFile {
    pub format: String,
    pub schema_version: u32,
    pub model: AtlasModel,
    pub settings: RunSettings,
    pub probes: ProbeSet,
    #[serde(flatten)]
    pub analysis: Analysis,
    pub validation: Option<Validation>,
    pub runs: Vec<AtlasRun>,
}

impl AtlasFile {
    /// Analyses `runs` and validates with `top_k` (None: [`default_top_k`]).
    pub fn build(
        model: AtlasModel,
        settings: RunSettings,
        probes: ProbeSet,
        mut runs: Vec<AtlasRun>,
        opts: &AtlasOptions,
        top_k: Option<usize>,
    ) -> Result<Self, AtlasError> {
        probes.check()?;
        runs.sort_by(|a, b| (&a.category, a.prompt).cmp(&(&b.category, b.prompt)));
        let prompts = probes.prompt_counts();
        let analysis = analyse(&prompts, &runs, opts)?;
        let k = top_k.unwrap_or_else(|| default_top_k(analysis.summary.experts_seen, prompts.len()));
        let validation = validate(&prompts, &runs, k)?;
        Ok(Self {
            format: ATLAS_FORMAT.to_string(),
            schema_version: ATLAS_SCHEMA_VERSION,
            model,
            settings,
            probes,
            analysis,
            validation: Some(validation),
            runs,
        })
    }

    /// Reads an atlas file, checking its format, version and runs.
    pub fn parse(text: &str) -> Result<Self, AtlasError> {
        let value: Value = serde_json::from_str(text).map_err(|e| AtlasError(format!("invalid JSON: {e}")))?;
        match value.get("format").and_then(Value::as_str) {
            Some(ATLAS_FORMAT) => {}
            Some(other) => return err(format!("format {other:?} is not an atlas ({ATLAS_FORMAT:?})")),
            None => return err(format!("not an atlas file (no \"format\": {ATLAS_FORMAT:?})")),
        }
        match value.get("schema_version").and_then(Value::as_u64) {
            Some(v) if v == ATLAS_SCHEMA_VERSION as u64 => {}
            _ => {
                let v = value.get("schema_version").map_or("(missing)".to_string(), Value::to_string);
                return err(format!("unsupported atlas schema_version {v} (this build reads {ATLAS_SCHEMA_VERSION})"));
            }
        }
        let file: AtlasFile = serde_json::from_value(value).map_err(|e| AtlasError(format!("malformed atlas: {e}")))?;
        file.probes.check()?;
        checked_runs(&file.probes.prompt_counts(), &file.runs)?;
        Ok(file)
    }

    pub fn prompt_counts(&self) -> BTreeMap<String, usize> {
        self.probes.prompt_counts()
    }

    /// The kept expert at `key`, if any.
    pub fn expert(&self, key: ExpertKey) -> Option<&AtlasExpert> {
        self.analysis.experts.iter().find(|e| (e.layer, e.expert) == key)
    }
}

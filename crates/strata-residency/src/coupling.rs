//! Cross-layer expert coupling from route traces (the offline side of PILOT): how well
//! the experts a token chose at layer `L` predict the ones it will choose at `L + delta`.
//!
//! Rows are the trace's (segment, forward, row) triples in trace order. The first
//! `train_fraction` of them fit, for each (source layer, delta), co-activation counts
//! `C[s][t]` (row chose `s` at `L` and `t` at `L + delta`) and `N[s]`. A held-out row is
//! predicted from its own experts at `L`: target `t` scores `sum_s C[s][t] / N[s]` over
//! the row's source experts, and the `k` best (k = the row's selections at the target
//! layer; ties to the more frequent target, then the lower id) are the prediction.
//! Reported: recall of the actual targets on the held-out rows, next to a baseline that
//! always predicts the target layer's `k` most frequent training experts.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::trace::TraceRecord;

/// The deltas of `strata trace coupling`.
pub const DEFAULT_DELTAS: [usize; 2] = [1, 2];
pub const DEFAULT_TRAIN_FRACTION: f64 = 0.5;

#[derive(Debug, Clone, PartialEq)]
pub struct CouplingOptions {
    /// Leading share of the rows used to fit, in (0, 1).
    pub train_fraction: f64,
    pub deltas: Vec<usize>,
    /// Score only rows of forwards with at most this many rows.
    pub score_max_rows: Option<usize>,
}

impl Default for CouplingOptions {
    fn default() -> Self {
        Self { train_fraction: DEFAULT_TRAIN_FRACTION, deltas: DEFAULT_DELTAS.to_vec(), score_max_rows: None }
    }
}

/// One strong source -> target pair.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Coupling {
    pub source: usize,
    pub target: usize,
    pub count: u64,
    /// `C[s][t] / N[s]`.
    pub probability: f64,
}

/// One (source layer, delta).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PairReport {
    pub source_layer: usize,
    pub delta: usize,
    pub target_layer: usize,
    pub train_rows: usize,
    pub test_rows: usize,
    /// Actual target selections in the test rows.
    pub test_selections: u64,
    pub matched: u64,
    pub recall: f64,
    pub baseline_matched: u64,
    pub baseline_recall: f64,
    /// The fitted pairs with the highest probability (at least 10 co-activations).
    pub strongest: Vec<Coupling>,
}

/// All pairs of one delta together.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeltaSummary {
    pub delta: usize,
    pub test_selections: u64,
    pub recall: f64,
    pub baseline_recall: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CouplingReport {
    pub rows: usize,
    pub train_rows: usize,
    pub test_rows: usize,
    pub train_fraction: f64,
    /// Rows scored: test rows of forwards no wider than `score_max_rows`.
    pub scored_rows: usize,
    pub score_max_rows: Option<usize>,
    pub layers: Vec<usize>,
    pub by_delta: Vec<DeltaSummary>,
    pub pairs: Vec<PairReport>,
}

/// One (segment, forward, row): layer -> experts, and the width of its forward.
#[derive(Default)]
struct Row {
    layers: BTreeMap<usize, Vec<usize>>,
    width: usize,
}

impl Row {
    fn get(&self, layer: &usize) -> Option<&Vec<usize>> {
        self.layers.get(layer)
    }
}

/// Groups records into rows, in order of first appearance.
fn rows(records: &[TraceRecord]) -> Vec<Row> {
    use std::collections::HashMap;
    let mut index: HashMap<(u32, u64, u32), usize> = HashMap::new();
    let mut widths: HashMap<(u32, u64), usize> = HashMap::new();
    let mut out: Vec<(Row, (u32, u64))> = Vec::new();
    for r in records {
        let i = *index.entry((r.segment, r.forward, r.row)).or_insert_with(|| {
            *widths.entry((r.segment, r.forward)).or_insert(0) += 1;
            out.push((Row::default(), (r.segment, r.forward)));
            out.len() - 1
        });
        out[i].0.layers.entry(r.layer).or_default().extend(&r.experts);
    }
    out.into_iter()
        .map(|(mut row, fwd)| {
            row.width = widths[&fwd];
            row
        })
        .collect()
}

struct Table {
    experts: usize,
    /// `C[s * experts + t]`.
    co: Vec<u64>,
    source: Vec<u64>,
    target: Vec<u64>,
    rows: usize,
}

impl Table {
    fn new(experts: usize) -> Self {
        Self { experts, co: vec![0; experts * experts], source: vec![0; experts], target: vec![0; experts], rows: 0 }
    }

    fn fit(&mut self, src: &[usize], tgt: &[usize]) {
        self.rows += 1;
        for &s in src {
            self.source[s] += 1;
            for &t in tgt {
                self.co[s * self.experts + t] += 1;
            }
        }
        for &t in tgt {
            self.target[t] += 1;
        }
    }

    /// Targets ranked for the row's sources (best first).
    fn predict(&self, src: &[usize], k: usize) -> Vec<usize> {
        let mut score = vec![0f64; self.experts];
        for &s in src.iter().filter(|&&s| self.source[s] > 0) {
            let n = self.source[s] as f64;
            for (t, c) in self.co[s * self.experts..(s + 1) * self.experts].iter().enumerate() {
                score[t] += *c as f64 / n;
            }
        }
        let mut order: Vec<usize> = (0..self.experts).collect();
        order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(self.target[b].cmp(&self.target[a])).then(a.cmp(&b)));
        order.truncate(k);
        order
    }

    /// The `k` most frequent training targets.
    fn baseline(&self, k: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.experts).collect();
        order.sort_by(|&a, &b| self.target[b].cmp(&self.target[a]).then(a.cmp(&b)));
        order.truncate(k);
        order
    }

    fn strongest(&self, n: usize) -> Vec<Coupling> {
        let mut all: Vec<Coupling> = (0..self.experts * self.experts)
            .filter(|&i| self.co[i] >= 10)
            .map(|i| {
                let (s, t) = (i / self.experts, i % self.experts);
                Coupling {
                    source: s,
                    target: t,
                    count: self.co[i],
                    probability: self.co[i] as f64 / self.source[s] as f64,
                }
            })
            .collect();
        all.sort_by(|a, b| b.probability.total_cmp(&a.probability).then(b.count.cmp(&a.count)));
        all.truncate(n);
        for c in &mut all {
            c.probability = crate::atlas::round6(c.probability);
        }
        all
    }
}

fn matched(pred: &[usize], actual: &[usize]) -> u64 {
    actual.iter().filter(|a| pred.contains(a)).count() as u64
}

/// Fits on the leading rows and scores the rest; refused when the trace cannot be split.
pub fn coupling(records: &[TraceRecord], opts: &CouplingOptions) -> Result<CouplingReport, String> {
    if !(opts.train_fraction > 0.0 && opts.train_fraction < 1.0) {
        return Err(format!("--train-fraction must be in (0, 1), got {}", opts.train_fraction));
    }
    if opts.deltas.is_empty() || opts.deltas.contains(&0) {
        return Err("deltas must be positive".to_string());
    }
    let rows = rows(records);
    let train = ((rows.len() as f64) * opts.train_fraction).floor() as usize;
    if train == 0 || train == rows.len() {
        return Err(format!("the trace has {} rows: too few to split into fit and test rows", rows.len()));
    }
    let experts = records.iter().flat_map(|r| r.experts.iter().copied()).max().map_or(0, |m| m + 1);
    let layers: Vec<usize> = {
        let mut l: Vec<usize> = records.iter().map(|r| r.layer).collect();
        l.sort_unstable();
        l.dedup();
        l
    };
    let scored = |row: &Row| opts.score_max_rows.is_none_or(|m| row.width <= m);
    let scored_rows = rows[train..].iter().filter(|r| scored(r)).count();
    let mut pairs = Vec::new();
    for &delta in &opts.deltas {
        for &src in &layers {
            let tgt = src + delta;
            if !layers.contains(&tgt) {
                continue;
            }
            let mut table = Table::new(experts);
            for row in &rows[..train] {
                if let (Some(s), Some(t)) = (row.get(&src), row.get(&tgt)) {
                    table.fit(s, t);
                }
            }
            let (mut test_rows, mut total, mut hit, mut base) = (0, 0u64, 0u64, 0u64);
            for row in rows[train..].iter().filter(|r| scored(r)) {
                let (Some(s), Some(t)) = (row.get(&src), row.get(&tgt)) else { continue };
                test_rows += 1;
                total += t.len() as u64;
                hit += matched(&table.predict(s, t.len()), t);
                base += matched(&table.baseline(t.len()), t);
            }
            let ratio = |n: u64| crate::atlas::round6(n as f64 / total.max(1) as f64);
            pairs.push(PairReport {
                source_layer: src,
                delta,
                target_layer: tgt,
                train_rows: table.rows,
                test_rows,
                test_selections: total,
                matched: hit,
                recall: ratio(hit),
                baseline_matched: base,
                baseline_recall: ratio(base),
                strongest: table.strongest(5),
            });
        }
    }
    let by_delta = opts
        .deltas
        .iter()
        .map(|&d| {
            let of: Vec<&PairReport> = pairs.iter().filter(|p| p.delta == d).collect();
            let total: u64 = of.iter().map(|p| p.test_selections).sum();
            let ratio = |n: u64| crate::atlas::round6(n as f64 / total.max(1) as f64);
            DeltaSummary {
                delta: d,
                test_selections: total,
                recall: ratio(of.iter().map(|p| p.matched).sum()),
                baseline_recall: ratio(of.iter().map(|p| p.baseline_matched).sum()),
            }
        })
        .collect();
    Ok(CouplingReport {
        rows: rows.len(),
        train_rows: train,
        test_rows: rows.len() - train,
        train_fraction: opts.train_fraction,
        scored_rows,
        score_max_rows: opts.score_max_rows,
        layers,
        by_delta,
        pairs,
    })
}

impl fmt::Display for CouplingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "coupling: {} rows ({} fit, {} test; temporal split at {:.0}%), layers {:?}",
            self.rows,
            self.train_rows,
            self.test_rows,
            self.train_fraction * 100.0,
            self.layers
        )?;
        if let Some(m) = self.score_max_rows {
            writeln!(f, "scored: {} test rows of forwards of at most {m} rows", self.scored_rows)?;
        }
        for d in &self.by_delta {
            writeln!(
                f,
                "delta {}: recall {:.1}% of {} target selections (most-frequent baseline {:.1}%)",
                d.delta,
                d.recall * 100.0,
                d.test_selections,
                d.baseline_recall * 100.0
            )?;
        }
        writeln!(
            f,
            "{:>6} {:>5} {:>6} {:>9} {:>8} {:>9}  strongest (source->target p)",
            "source", "delta", "target", "test rows", "recall", "baseline"
        )?;
        for p in &self.pairs {
            let strongest: Vec<String> = p
                .strongest
                .iter()
                .take(3)
                .map(|c| format!("{}->{} {:.2}", c.source, c.target, c.probability))
                .collect();
            writeln!(
                f,
                "{:>6} {:>5} {:>6} {:>9} {:>7.1}% {:>8.1}%  {}",
                p.source_layer,
                p.delta,
                p.target_layer,
                p.test_rows,
                p.recall * 100.0,
                p.baseline_recall * 100.0,
                strongest.join(", ")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TestRng;

    fn rec(forward: u64, row: u32, layer: usize, experts: &[usize]) -> TraceRecord {
        TraceRecord { segment: 0, forward, row, layer, experts: experts.to_vec() }
    }

    /// Layer 2's experts are a function of layer 1's (e -> e + 1 mod 8); layer 3's are
    /// random. Coupling finds the first exactly and nothing in the second.
    fn synthetic(rows: usize) -> Vec<TraceRecord> {
        let mut rng = TestRng::new(7);
        let mut out = Vec::new();
        for i in 0..rows {
            let (f, r) = ((i / 3) as u64, (i % 3) as u32);
            let a = rng.below(8);
            let b = (a + 1 + rng.below(7)) % 8;
            out.push(rec(f, r, 1, &[a, b]));
            out.push(rec(f, r, 2, &[(a + 1) % 8, (b + 1) % 8]));
            let c = rng.below(8);
            out.push(rec(f, r, 3, &[c, (c + 3) % 8]));
        }
        out
    }

    #[test]
    fn deterministic_coupling_is_recalled_and_noise_is_not() {
        let report = coupling(&synthetic(600), &CouplingOptions::default()).unwrap();
        assert_eq!((report.rows, report.train_rows, report.test_rows), (600, 300, 300));
        assert_eq!(report.layers, vec![1, 2, 3]);
        let pair = |s: usize, d: usize| report.pairs.iter().find(|p| p.source_layer == s && p.delta == d).unwrap();
        let p12 = pair(1, 1);
        assert_eq!((p12.target_layer, p12.test_rows, p12.test_selections), (2, 300, 600));
        assert_eq!(p12.recall, 1.0);
        assert!(p12.baseline_recall < 0.5, "{p12:?}");
        assert_eq!(p12.strongest[0].probability, 1.0);
        assert_eq!(p12.strongest[0].target, (p12.strongest[0].source + 1) % 8);
        // Layer 3 is independent: recall near chance (2 of 8).
        let p23 = pair(2, 1);
        assert!(p23.recall < 0.4, "{p23:?}");
        // Delta 2 (1 -> 3) exists; 2 -> 4 does not.
        assert!(report.pairs.iter().any(|p| p.source_layer == 1 && p.delta == 2));
        assert!(!report.pairs.iter().any(|p| p.source_layer == 2 && p.delta == 2));
        let d1 = &report.by_delta[0];
        assert_eq!(d1.test_selections, 1200);
        assert!(d1.recall > 0.55 && d1.recall < 0.75, "{d1:?}");
        let text = report.to_string();
        assert!(text.contains("delta 1: recall"), "{text}");
    }

    #[test]
    fn the_split_is_temporal() {
        // The mapping changes halfway: fitted on the first half, it fails on the second.
        let mut recs = Vec::new();
        for i in 0..100u64 {
            let shift = if i < 50 { 1 } else { 2 };
            let a = (i % 8) as usize;
            recs.push(rec(i, 0, 1, &[a]));
            recs.push(rec(i, 0, 2, &[(a + shift) % 8]));
        }
        let opts = |f: f64| CouplingOptions { train_fraction: f, deltas: vec![1], score_max_rows: None };
        let r = coupling(&recs, &opts(0.5)).unwrap();
        assert_eq!(r.pairs[0].recall, 0.0);
        let r = coupling(&recs, &opts(0.4)).unwrap();
        assert!(r.pairs[0].recall > 0.0 && r.pairs[0].recall < 0.2, "{:?}", r.pairs[0]);
    }

    #[test]
    fn wide_forwards_can_be_left_unscored() {
        // synthetic(): 3 rows per forward. Forwards 100.. get one row each.
        let mut recs = synthetic(300);
        for i in 0..60u64 {
            let a = (i % 8) as usize;
            recs.push(rec(100 + i, 0, 1, &[a, (a + 3) % 8]));
            recs.push(rec(100 + i, 0, 2, &[(a + 1) % 8, (a + 4) % 8]));
        }
        let all = coupling(&recs, &CouplingOptions::default()).unwrap();
        let narrow = coupling(&recs, &CouplingOptions { score_max_rows: Some(1), ..Default::default() }).unwrap();
        assert_eq!((all.rows, all.test_rows, all.scored_rows), (360, 180, 180));
        assert_eq!((narrow.scored_rows, narrow.score_max_rows), (60, Some(1)));
        assert_eq!(narrow.pairs[0].test_rows, 60);
        assert_eq!(narrow.pairs[0].recall, 1.0);
        assert!(narrow.to_string().contains("scored: 60 test rows of forwards of at most 1 rows"));
    }

    #[test]
    fn bad_options_and_tiny_traces_are_refused() {
        let recs = synthetic(10);
        let e = |o: CouplingOptions| coupling(&recs, &o).unwrap_err();
        assert!(e(CouplingOptions { train_fraction: 1.0, ..Default::default() }).contains("--train-fraction"));
        assert!(e(CouplingOptions { deltas: vec![0], ..Default::default() }).contains("positive"));
        assert!(coupling(&recs[..3], &CouplingOptions::default()).unwrap_err().contains("1 rows: too few"));
    }
}

//! Expert-runtime telemetry: demand and policy counters per turn, latency summaries.

use serde::Serialize;
use std::time::Duration;

/// Latency summary: {count, total, p50, p95, p99, max}, in seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LatencySummary {
    pub count: usize,
    pub total_s: f64,
    pub p50_s: f64,
    pub p95_s: f64,
    pub p99_s: f64,
    pub max_s: f64,
}

#[derive(Clone, Debug, Default)]
pub struct Latencies(Vec<f64>);

impl Latencies {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64());
    }

    pub fn summary(&self) -> LatencySummary {
        if self.0.is_empty() {
            return LatencySummary::default();
        }
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
        LatencySummary {
            count: v.len(),
            total_s: v.iter().sum(),
            p50_s: q(0.50),
            p95_s: q(0.95),
            p99_s: q(0.99),
            max_s: *v.last().unwrap(),
        }
    }
}

/// Demand (routing-driven) or policy (pins, repins) traffic.
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub hits: u64,
    pub misses: u64,
    /// Misses left out instead of read (`--skip-misses-from-rank`); not in `misses`.
    pub skipped: u64,
    pub loads: u64,
    pub read_ops: u64,
    pub read_bytes: u64,
    pub disk_service: Latencies,
    pub foreground_wait: Latencies,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct TrafficReport {
    pub hits: u64,
    pub misses: u64,
    /// Misses left out of their token's mix instead of read (`--skip-misses-from-rank`).
    pub skipped: u64,
    pub hit_rate: f64,
    pub loads: u64,
    pub read_ops: u64,
    pub read_bytes: u64,
    pub disk_service: LatencySummary,
    pub foreground_wait: LatencySummary,
}

impl Traffic {
    /// Counts one completed expert read and how long the caller waited for it.
    pub fn record_load(&mut self, stats: &strata_storage::ReadStats, waited: Duration) {
        self.loads += 1;
        self.read_ops += stats.ops;
        self.read_bytes += stats.bytes;
        self.disk_service.push(stats.service);
        self.foreground_wait.push(waited);
    }

    pub fn report(&self) -> TrafficReport {
        let total = self.hits + self.misses;
        TrafficReport {
            hits: self.hits,
            misses: self.misses,
            skipped: self.skipped,
            hit_rate: if total > 0 { self.hits as f64 / total as f64 } else { 0.0 },
            loads: self.loads,
            read_ops: self.read_ops,
            read_bytes: self.read_bytes,
            disk_service: self.disk_service.summary(),
            foreground_wait: self.foreground_wait.summary(),
        }
    }
}

/// One turn's telemetry of a tier.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TurnTelemetry {
    pub demand: TrafficReport,
    pub policy: TrafficReport,
    pub layer_forward: LatencySummary,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut l = Latencies::default();
        for ms in 1..=100 {
            l.push(Duration::from_millis(ms));
        }
        let s = l.summary();
        assert_eq!(s.count, 100);
        assert!((s.p50_s - 0.050).abs() < 0.0015);
        assert!((s.p99_s - 0.099).abs() < 0.0015);
        assert!((s.max_s - 0.100).abs() < 1e-9);
        assert!((s.total_s - 5.05).abs() < 1e-9);
    }
}

/// PILOT: next-layer routing predicted from the previous layer's residual, scored when
/// the layer routes for real.
#[derive(Clone, Debug, Default)]
pub struct PilotStats {
    pub calls: u64,
    pub rows: u64,
    pub predicted: u64,
    pub actual: u64,
    pub matched: u64,
    pub exact_rows: u64,
    /// Hits by the prediction's rank (0 = the router's first choice).
    pub rank_hits: Vec<u64>,
    pub rank_total: Vec<u64>,
    /// From prediction to the real routing.
    pub lead_time: Latencies,
    pub hint_latency: Latencies,
    /// Advisory WILLNEED hints issued (hint mode), and their bytes.
    pub hints: u64,
    pub hint_bytes: u64,
    /// Prefetch reads started (prefetch mode), and lookups they turned into hits.
    pub prefetches: u64,
    pub prefetch_hits: u64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PilotReport {
    pub calls: u64,
    pub rows: u64,
    pub predicted: u64,
    pub actual: u64,
    pub matched: u64,
    pub precision: f64,
    pub recall: f64,
    pub exact_rows: u64,
    pub rank_hit_rates: Vec<f64>,
    pub lead_time: LatencySummary,
    pub hint_latency: LatencySummary,
    pub hints: u64,
    pub hint_bytes: u64,
    pub prefetches: u64,
    pub prefetch_hits: u64,
}

impl PilotStats {
    /// Scores one layer: `predicted[r]` against `actual[r]` for each row.
    pub fn score(&mut self, predicted: &[Vec<usize>], actual: &[Vec<usize>]) {
        self.calls += 1;
        for (p, a) in predicted.iter().zip(actual) {
            self.rows += 1;
            self.predicted += p.len() as u64;
            self.actual += a.len() as u64;
            let mut hits = 0;
            for (rank, e) in p.iter().enumerate() {
                if self.rank_total.len() <= rank {
                    self.rank_total.resize(rank + 1, 0);
                    self.rank_hits.resize(rank + 1, 0);
                }
                self.rank_total[rank] += 1;
                if a.contains(e) {
                    self.rank_hits[rank] += 1;
                    hits += 1;
                }
            }
            self.matched += hits;
            if hits as usize == a.len() && p.len() == a.len() {
                self.exact_rows += 1;
            }
        }
    }

    pub fn report(&self) -> PilotReport {
        let ratio = |n: u64, d: u64| if d > 0 { n as f64 / d as f64 } else { 0.0 };
        PilotReport {
            calls: self.calls,
            rows: self.rows,
            predicted: self.predicted,
            actual: self.actual,
            matched: self.matched,
            precision: ratio(self.matched, self.predicted),
            recall: ratio(self.matched, self.actual),
            exact_rows: self.exact_rows,
            rank_hit_rates: self.rank_hits.iter().zip(&self.rank_total).map(|(h, t)| ratio(*h, *t)).collect(),
            lead_time: self.lead_time.summary(),
            hint_latency: self.hint_latency.summary(),
            hints: self.hints,
            hint_bytes: self.hint_bytes,
            prefetches: self.prefetches,
            prefetch_hits: self.prefetch_hits,
        }
    }
}

#[cfg(test)]
mod pilot_tests {
    use super::*;

    #[test]
    fn scores_precision_recall_ranks_and_exact_rows() {
        let mut p = PilotStats::default();
        p.score(&[vec![1, 2, 3, 4], vec![5, 6, 7, 8]], &[vec![4, 3, 2, 1], vec![5, 9, 10, 11]]);
        let r = p.report();
        assert_eq!((r.rows, r.predicted, r.actual, r.matched, r.exact_rows), (2, 8, 8, 5, 1));
        assert!((r.precision - 5.0 / 8.0).abs() < 1e-12 && (r.recall - 5.0 / 8.0).abs() < 1e-12);
        assert_eq!(r.rank_hit_rates, vec![1.0, 0.5, 0.5, 0.5]);
    }
}

/// A device tier's traffic since its last report (the GPU tier on CUDA).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceTierTraffic {
    /// Expert lookups found in device slots.
    pub hits: u64,
    /// Of the hits, selections dispatched on the device by id: the tier holds every
    /// expert in place and their ids never came to the host.
    pub by_id: u64,
    /// Lookups that went to the host tier (each copied host -> device).
    pub misses: u64,
    /// Host -> device copies and their bytes (misses and the preload).
    pub copies: u64,
    pub copy_bytes: u64,
    /// Time the host waited for copies to finish reading host slots (the part of the
    /// transfers not hidden behind queued device work).
    pub copy_wait_seconds: f64,
    /// Experts this tier evicted that the host tier kept (exclusive tiers): still held
    /// there (touched), or copied device -> host, with those copies' bytes.
    pub demotions_kept: u64,
    pub demotions_copied: u64,
    pub demotion_bytes: u64,
}

/// A device tier of expert slots in front of the host slab, for `--stats` and `/stats`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceTierReport {
    pub device: String,
    pub plan: strata_residency::ResidencyPlan,
    /// Whether every expert has a device slot (no `--gpu-budget`).
    pub resident_all: bool,
    pub traffic: DeviceTierTraffic,
    pub slots: strata_residency::SlotSnapshot,
    /// How its layers pick their victims.
    pub eviction: strata_residency::Eviction,
    /// Whether a victim comes from the incoming expert's layer or from any layer.
    pub eviction_scope: strata_residency::EvictionScope,
    /// hits / (hits + misses) over this report's window.
    pub hit_rate: Option<f64>,
}

/// A tier in front of a host runtime, reported with it at each turn's end.
pub trait DeviceTier: Send + Sync {
    fn take_report(&self) -> DeviceTierReport;
}

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

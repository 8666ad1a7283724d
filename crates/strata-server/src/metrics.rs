//! Counters, gauges and histograms for `/metrics` (Prometheus text format) and `/stats`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use strata_engine::experts::RuntimeReport;
use strata_engine::serving::EngineCounters;
use strata_engine::GenerationStats;

const BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

#[derive(Default)]
pub struct Histogram {
    inner: Mutex<(Vec<u64>, f64, u64)>, // per-bucket counts, sum, count
}

impl Histogram {
    pub fn observe(&self, v: f64) {
        let mut h = self.inner.lock().unwrap();
        if h.0.is_empty() {
            h.0 = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                h.0[i] += 1;
            }
        }
        h.1 += v;
        h.2 += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let c = h.0.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.2);
        let _ = writeln!(out, "{name}_sum {}", h.1);
        let _ = writeln!(out, "{name}_count {}", h.2);
    }
}

#[derive(Default)]
pub struct Metrics {
    /// (route, status) -> count.
    pub http: Mutex<BTreeMap<(String, u16), u64>>,
    pub generations: AtomicU64,
    pub generation_errors: AtomicU64,
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queue_depth: AtomicUsize,
    pub active: AtomicUsize,
    /// Requests accepted and not finished (running or waiting).
    pub inflight: AtomicUsize,
    /// The serving engine's counters after its last step.
    pub engine: Mutex<EngineCounters>,
    pub queue_wait: Histogram,
    pub ttft: Histogram,
    pub generation_time: Histogram,
    pub last: Mutex<Option<GenerationStats>>,
    /// Expert-runtime totals; None unless experts stream.
    pub experts: Mutex<Option<ExpertTotals>>,
    /// The expert runtime's last turn report, for `/stats`.
    pub last_experts: Mutex<Option<RuntimeReport>>,
    /// The same for the draft (MTP) layer's expert tier, where it streams.
    pub draft_experts: Mutex<Option<ExpertTotals>>,
    pub last_draft_experts: Mutex<Option<RuntimeReport>>,
}

/// Sums of the expert runtime's per-turn counters (demand: routing; policy: pins and
/// repins).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ExpertTotals {
    pub turns: u64,
    pub hits: u64,
    pub misses: u64,
    /// Misses left out instead of read (approximate decode, `--skip-misses-from-rank`).
    pub skipped: u64,
    /// [demand, policy]
    pub loads: [u64; 2],
    pub read_ops: [u64; 2],
    pub read_bytes: [u64; 2],
    /// The GPU tier (CUDA): hits (and those dispatched by id), misses, host -> GPU copy
    /// bytes, seconds waiting on copies.
    pub gpu_hits: u64,
    pub gpu_by_id: u64,
    pub gpu_misses: u64,
    pub gpu_copy_bytes: u64,
    pub gpu_copy_wait_s: f64,
    /// Evicted experts the host tier kept: still held there, or copied GPU -> host (bytes).
    pub gpu_demotions_kept: u64,
    pub gpu_demotion_bytes: u64,
}

/// Routes known to the server; anything else is counted as `other`, so that random paths
/// cannot grow the label set.
pub const ROUTES: &[&str] = &[
    "/health",
    "/stats",
    "/metrics",
    "/tokenize",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
];

impl Metrics {
    pub fn record_http(&self, path: &str, status: u16) {
        let route = if path.starts_with("/v1/models/") {
            "/v1/models"
        } else {
            ROUTES.iter().copied().find(|r| *r == path).unwrap_or("other")
        };
        *self.http.lock().unwrap().entry((route.to_string(), status)).or_default() += 1;
    }

    pub fn record_generation(&self, s: &GenerationStats, queue_wait_s: f64, total_s: f64) {
        self.generations.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.prefill_tokens.fetch_add(s.prefill_tokens as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        if s.finish_reason == "cancelled" {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        self.queue_wait.observe(queue_wait_s);
        self.ttft.observe(queue_wait_s + s.time_to_first_token_s);
        self.generation_time.observe(total_s);
        *self.last.lock().unwrap() = Some(s.clone());
    }

    /// Adds one turn of the expert runtime.
    pub fn record_experts(&self, r: &RuntimeReport) {
        add_turn(&self.experts, r);
        *self.last_experts.lock().unwrap() = Some(r.clone());
    }

    /// Adds one turn of the draft layer's expert tier.
    pub fn record_draft_experts(&self, r: &RuntimeReport) {
        add_turn(&self.draft_experts, r);
        *self.last_draft_experts.lock().unwrap() = Some(r.clone());
    }

    /// Speculative decoding (MTP) counters, where the engine drafts.
    fn render_mtp(&self, out: &mut String) {
        let e = *self.engine.lock().unwrap();
        if e.draft_tokens == 0 {
            return;
        }
        let counters: [(&str, &str, u64); 6] = [
            ("strata_mtp_rounds_total", "Decode steps of speculating requests (target forwards).", e.mtp_rounds),
            ("strata_mtp_drafted_total", "Draft tokens proposed by the MTP layer.", e.mtp_drafted),
            ("strata_mtp_accepted_total", "Draft tokens the target accepted.", e.mtp_accepted),
            ("strata_mtp_tokens_total", "Tokens emitted by speculating decode steps.", e.mtp_tokens),
            ("strata_mtp_draft_forwards_total", "Forwards of the draft layer.", e.draft.forwards),
            (
                "strata_mtp_dropped_total",
                "Requests that gave up drafting (no room in the draft cache).",
                e.draft.dropped,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let Some(t) = self.draft_experts.lock().unwrap().clone() else { return };
        let tier: [(&str, &str, u64); 3] = [
            ("strata_draft_expert_hits_total", "Draft-layer experts found resident.", t.hits),
            ("strata_draft_expert_misses_total", "Draft-layer experts that had to be read.", t.misses),
            ("strata_draft_expert_read_bytes_total", "Draft-layer expert bytes read (demand).", t.read_bytes[0]),
        ];
        for (name, help, v) in tier {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
    }

    fn render_experts(&self, out: &mut String) {
        let Some(t) = self.experts.lock().unwrap().clone() else { return };
        let counters: [(&str, &str, u64); 4] = [
            ("strata_expert_turns_total", "Generations the expert runtime has ended.", t.turns),
            ("strata_expert_hits_total", "Routed experts found resident.", t.hits),
            ("strata_expert_misses_total", "Routed experts that had to be read.", t.misses),
            (
                "strata_expert_skipped_total",
                "Routed experts left out instead of read (--skip-misses-from-rank).",
                t.skipped,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let by_cause: [(&str, &str, [u64; 2]); 3] = [
            ("strata_expert_loads_total", "Expert loads, by cause (demand: routing; policy: pins, repins).", t.loads),
            ("strata_expert_read_ops_total", "Expert read operations, by cause.", t.read_ops),
            ("strata_expert_read_bytes_total", "Expert bytes read, by cause.", t.read_bytes),
        ];
        for (name, help, v) in by_cause {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{cause=\"demand\"}} {}\n{name}{{cause=\"policy\"}} {}", v[0], v[1]);
        }
        if self.last_experts.lock().unwrap().as_ref().is_some_and(|r| r.device_tier.is_some()) {
            let gpu: [(&str, &str, String); 7] = [
                ("strata_gpu_tier_hits_total", "Routed experts found in GPU slots.", t.gpu_hits.to_string()),
                (
                    "strata_gpu_tier_by_id_total",
                    "Of the GPU hits, routed experts dispatched by id on the device (ids never read back).",
                    t.gpu_by_id.to_string(),
                ),
                (
                    "strata_gpu_tier_misses_total",
                    "Routed experts copied to the GPU from the host tier.",
                    t.gpu_misses.to_string(),
                ),
                ("strata_gpu_tier_copy_bytes_total", "Expert bytes copied host -> GPU.", t.gpu_copy_bytes.to_string()),
                (
                    "strata_gpu_tier_copy_wait_seconds_total",
                    "Host time spent waiting for expert copies.",
                    t.gpu_copy_wait_s.to_string(),
                ),
                (
                    "strata_gpu_tier_demotions_kept_total",
                    "Experts the GPU tier evicted that the host tier still held (exclusive tiers).",
                    t.gpu_demotions_kept.to_string(),
                ),
                (
                    "strata_gpu_tier_demotion_bytes_total",
                    "Expert bytes copied GPU -> host: evicted experts the host tier no longer held.",
                    t.gpu_demotion_bytes.to_string(),
                ),
            ];
            for (name, help, v) in gpu {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            }
        }
        if let Some(r) = self.last_experts.lock().unwrap().as_ref() {
            let s = &r.slots;
            let _ = writeln!(out, "# HELP strata_expert_slots Slab slots by role.\n# TYPE strata_expert_slots gauge");
            for (role, n) in
                [("working", s.working), ("layer", s.layer), ("pinned", s.pinned), ("disabled", s.disabled)]
            {
                let _ = writeln!(out, "strata_expert_slots{{role=\"{role}\"}} {n}");
            }
            let _ = writeln!(out, "# HELP strata_expert_evictions_total Experts evicted from the slab.\n# TYPE strata_expert_evictions_total counter\nstrata_expert_evictions_total {}", s.evictions);
            let _ = writeln!(out, "# HELP strata_footprint_bytes Process resident memory after the last turn.\n# TYPE strata_footprint_bytes gauge\nstrata_footprint_bytes {}", r.footprint_bytes);
            if let Some(b) = r.budget_bytes {
                let _ = writeln!(out, "# HELP strata_budget_bytes The memory budget.\n# TYPE strata_budget_bytes gauge\nstrata_budget_bytes {b}");
            }
        }
    }

    pub fn render(&self, queue_capacity: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP strata_http_requests_total HTTP requests by route and status.\n# TYPE strata_http_requests_total counter"
        );
        for ((route, status), n) in self.http.lock().unwrap().iter() {
            let _ = writeln!(out, "strata_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        let counters: [(&str, &str, u64); 7] = [
            (
                "strata_generations_total",
                "Generations run to an end (any finish reason).",
                self.generations.load(Ordering::Relaxed),
            ),
            (
                "strata_generation_errors_total",
                "Generations that failed with an error.",
                self.generation_errors.load(Ordering::Relaxed),
            ),
            (
                "strata_generations_cancelled_total",
                "Generations cancelled because the client went away (running or queued).",
                self.cancelled.load(Ordering::Relaxed),
            ),
            (
                "strata_requests_rejected_total",
                "Requests answered 429 because the queue was full.",
                self.rejected.load(Ordering::Relaxed),
            ),
            (
                "strata_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                self.prompt_tokens.load(Ordering::Relaxed),
            ),
            (
                "strata_prefill_tokens_total",
                "Prompt tokens computed (the rest came from the prefix cache).",
                self.prefill_tokens.load(Ordering::Relaxed),
            ),
            ("strata_generated_tokens_total", "Tokens generated.", self.generated_tokens.load(Ordering::Relaxed)),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let gauges: [(&str, &str, f64); 3] = [
            (
                "strata_queue_depth",
                "Requests waiting for a place in the batch.",
                self.queue_depth.load(Ordering::Relaxed) as f64,
            ),
            ("strata_queue_capacity", "Requests that may wait before new ones get 429.", queue_capacity as f64),
            (
                "strata_generation_active",
                "Requests in the running batch now.",
                self.active.load(Ordering::Relaxed) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let e = *self.engine.lock().unwrap();
        let engine: [(&str, &str, &str, f64); 10] = [
            ("strata_batch_steps_total", "counter", "Forwards run by the serving engine.", e.steps as f64),
            (
                "strata_batch_picked_steps_total",
                "counter",
                "Forwards with greedy samples picked on the device.",
                e.picked_steps as f64,
            ),
            (
                "strata_batch_picked_samples_total",
                "counter",
                "Samples picked on the device (one id read back, not the logits).",
                e.picked_samples as f64,
            ),
            (
                "strata_batch_decode_rows_total",
                "counter",
                "Decode rows (one sampled token each).",
                e.decode_rows as f64,
            ),
            (
                "strata_batch_prefill_rows_total",
                "counter",
                "Prompt rows (chunked prefill, recomputation).",
                e.prefill_rows as f64,
            ),
            (
                "strata_preemptions_total",
                "counter",
                "Requests preempted for KV room (computed again later).",
                e.preemptions as f64,
            ),
            (
                "strata_prompt_cache_hit_tokens_total",
                "counter",
                "Prompt tokens served from the prompt cache.",
                e.cache_hit_tokens as f64,
            ),
            ("strata_prompt_cache_blocks", "gauge", "KV blocks the prompt cache holds.", e.cache_blocks as f64),
            ("strata_kv_free_blocks", "gauge", "Free KV blocks in the pool.", e.kv_free_blocks as f64),
            ("strata_kv_blocks", "gauge", "KV blocks in the pool (16 positions each).", e.kv_total_blocks as f64),
        ];
        for (name, kind, help, v) in engine {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        if let Some(s) = self.last.lock().unwrap().as_ref() {
            let _ = writeln!(out, "# HELP strata_last_decode_tokens_per_second Decode speed of the last generation.\n# TYPE strata_last_decode_tokens_per_second gauge\nstrata_last_decode_tokens_per_second {}", s.decode_tokens_per_s);
            let _ = writeln!(out, "# HELP strata_last_prefill_tokens_per_second Prefill speed of the last generation.\n# TYPE strata_last_prefill_tokens_per_second gauge\nstrata_last_prefill_tokens_per_second {}", s.prefill_tokens_per_s);
            let _ = writeln!(out, "# HELP strata_peak_rss_bytes Peak resident memory of the process.\n# TYPE strata_peak_rss_bytes gauge\nstrata_peak_rss_bytes {}", s.peak_rss_bytes);
        }
        self.render_experts(&mut out);
        self.render_mtp(&mut out);
        self.queue_wait.render(
            &mut out,
            "strata_queue_wait_seconds",
            "Time from accepting a request to starting its generation.",
        );
        self.ttft.render(
            &mut out,
            "strata_time_to_first_token_seconds",
            "Time from accepting a request to its first token (queue wait plus prefill).",
        );
        self.generation_time.render(
            &mut out,
            "strata_generation_seconds",
            "Time from accepting a request to the end of its generation.",
        );
        out
    }
}

/// Adds one turn of an expert runtime to its totals.
fn add_turn(totals: &Mutex<Option<ExpertTotals>>, r: &RuntimeReport) {
    let mut t = totals.lock().unwrap();
    let t = t.get_or_insert_with(ExpertTotals::default);
    let (d, p) = (&r.turn.demand, &r.turn.policy);
    t.turns += 1;
    t.hits += d.hits;
    t.misses += d.misses;
    t.skipped += d.skipped;
    for (i, x) in [d, p].into_iter().enumerate() {
        t.loads[i] += x.loads;
        t.read_ops[i] += x.read_ops;
        t.read_bytes[i] += x.read_bytes;
    }
    if let Some(g) = &r.device_tier {
        t.gpu_hits += g.traffic.hits;
        t.gpu_by_id += g.traffic.by_id;
        t.gpu_misses += g.traffic.misses;
        t.gpu_copy_bytes += g.traffic.copy_bytes;
        t.gpu_copy_wait_s += g.traffic.copy_wait_seconds;
        t.gpu_demotions_kept += g.traffic.demotions_kept;
        t.gpu_demotion_bytes += g.traffic.demotion_bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.record_http("/v1/chat/completions", 200);
        m.record_http("/v1/chat/completions", 200);
        m.record_http("/nope/../x", 404);
        m.record_generation(
            &GenerationStats {
                prompt_tokens: 10,
                generated_tokens: 4,
                time_to_first_token_s: 0.02,
                ..Default::default()
            },
            0.5,
            1.0,
        );
        let text = m.render(64);
        assert!(text.contains("strata_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2"));
        assert!(text.contains("strata_http_requests_total{route=\"other\",status=\"404\"} 1"));
        assert!(text.contains("strata_prompt_tokens_total 10"));
        assert!(text.contains("strata_queue_capacity 64"));
        assert!(text.contains("strata_time_to_first_token_seconds_bucket{le=\"0.5\"} 0"));
        assert!(text.contains("strata_time_to_first_token_seconds_bucket{le=\"1\"} 1"));
        assert!(text.contains("strata_generation_seconds_count 1"));
        // Every sample line is `name{labels} value` with a numeric value.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "{line}");
        }
        assert!(!text.contains("strata_gpu_tier"), "no GPU tier, no GPU tier series");
    }

    /// A GPU tier's turns add up in `/metrics`, evictions the host tier kept included.
    #[test]
    fn renders_the_gpu_tier_totals() {
        use strata_engine::experts::telemetry::{DeviceTierReport, DeviceTierTraffic};
        let input = strata_residency::PlanInput {
            budget_bytes: 1 << 30,
            fixed_bytes: 0,
            slot_bytes: 1 << 20,
            sparse_layers: 2,
            working_slots: 2,
            pinned_experts: 0,
            max_slots_per_layer: Some(4),
        };
        let plan = strata_residency::plan(input).unwrap();
        let traffic = DeviceTierTraffic {
            hits: 30,
            misses: 10,
            copies: 10,
            copy_bytes: 10 << 20,
            demotions_kept: 3,
            demotions_copied: 5,
            demotion_bytes: 5 << 20,
            ..Default::default()
        };
        let tier = DeviceTierReport {
            device: "test".into(),
            plan,
            resident_all: false,
            traffic,
            slots: Default::default(),
            eviction: strata_residency::Eviction::Lfru { half_life: 32.0 },
            eviction_scope: strata_residency::EvictionScope::Layer,
            hit_rate: Some(0.75),
        };
        let report = RuntimeReport {
            plan,
            turn: Default::default(),
            slots: Default::default(),
            eviction: strata_residency::Eviction::Lru,
            eviction_scope: strata_residency::EvictionScope::Global,
            residency_map: Vec::new(),
            repins: Vec::new(),
            pilot: None,
            footprint_bytes: 0,
            budget_bytes: None,
            device_tier: Some(tier),
        };
        let m = Metrics::default();
        m.record_experts(&report);
        m.record_experts(&report);
        let text = m.render(8);
        for (name, v) in [
            ("strata_gpu_tier_hits_total", 60u64),
            ("strata_gpu_tier_misses_total", 20),
            ("strata_gpu_tier_copy_bytes_total", 20 << 20),
            ("strata_gpu_tier_demotions_kept_total", 6),
            ("strata_gpu_tier_demotion_bytes_total", 10 << 20),
        ] {
            assert!(text.contains(&format!("\n{name} {v}\n")), "{name} {v}:\n{text}");
        }
    }
}

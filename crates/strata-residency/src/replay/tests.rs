use super::*;
use crate::plan::{plan, PlanInput};
use crate::slots::SlotTable;
use crate::TestRng;

/// One row per forward, in order, all at `layer`, segment 0.
pub(super) fn single_rows(layer: usize, forwards: &[&[usize]]) -> Vec<TraceRecord> {
    forwards
        .iter()
        .enumerate()
        .map(|(f, experts)| TraceRecord { segment: 0, forward: f as u64, row: 0, layer, experts: experts.to_vec() })
        .collect()
}

pub(super) fn cfg(slots_per_layer: usize, working: usize, pinned: usize) -> ReplayConfig {
    ReplayConfig::new(slots_per_layer, working, pinned)
}

fn hits(report: &ReplayReport) -> [u64; 5] {
    ["LRU", "LFRU/turn", "pinned+LRU", "Belady", "Belady-nobypass"].map(|n| report.policy(n).unwrap().hits)
}

#[test]
fn cyclic_trace_defeats_lru_but_not_belady() {
    let trace = single_rows(3, &[&[10], &[11], &[12], &[10], &[11], &[12]]);
    let r = replay(&trace, &cfg(2, 8, 1));
    // LRU and LFRU/turn always evict the expert about to return. pinned+LRU pins 3:10 (all
    // tie at two selections; lowest key) and the rest fits. Belady keeps the two
    // soonest: 10 and 11 hit on their second use.
    // Belady without bypass must admit each miss: 12 evicts 11 (used later than 10),
    // 10 hits, then 11 evicts 10 (never used again) and 12 hits: also 2 here.
    assert_eq!(hits(&r), [0, 0, 4, 2, 2]);
    assert_eq!(r.policy("Belady").unwrap().misses, 4);
    assert_eq!(r.policy("pinned+LRU").unwrap().slots, 3);
    assert_eq!((r.accesses, r.selections, r.forwards, r.layers, r.segments), (6, 6, 6, 1, 1));
    // A case where bypass matters: 1 slot, 1 2 1: without bypass 2 must evict 1.
    let r = replay(&single_rows(3, &[&[1], &[2], &[1]]), &cfg(1, 8, 0));
    assert_eq!(hits(&r)[3..], [1, 0]);
}

#[test]
fn batch_union_dedups_rows_and_protects_the_forwards_experts() {
    // Forward 0: two rows share expert 2 -> 3 unique accesses, 4 selections.
    let mut trace = vec![
        TraceRecord { segment: 0, forward: 0, row: 0, layer: 3, experts: vec![1, 2] },
        TraceRecord { segment: 0, forward: 0, row: 1, layer: 3, experts: vec![2, 3] },
    ];
    trace.extend(single_rows(3, &[&[], &[3]]).into_iter().skip(1).map(|mut r| {
        r.forward = 1;
        r
    }));
    let r = replay(&trace, &cfg(2, 8, 0));
    assert_eq!((r.selections, r.accesses, r.forwards), (5, 4, 2));
    // The runtime (LRU): misses are not leased once computed, so 3's promotion evicts
    // the older of 1 and 2 and forward 1 hits 3. The offline LFRU protects the whole
    // forward and drops 3. Belady keeps 3, the only one used again.
    assert_eq!(hits(&r), [1, 0, 1, 1, 1]);
}

#[test]
fn lfru_keeps_heavy_hitters_until_heat_decays() {
    let seq: &[&[usize]] = &[&[1], &[1], &[1], &[2], &[3], &[1]];
    let r = replay(&single_rows(3, seq), &cfg(2, 8, 0));
    // LRU evicts 1 (oldest) for 3; LFRU/turn evicts 2 (heat 1 < heat 3), and so does
    // the runtime's LFRU (decayed by half in 32 forwards: 1's three uses still weigh more).
    assert_eq!(hits(&r)[..4], [2, 3, 2, 3]);
    assert_eq!(r.policy("LFRU").unwrap().hits, 3, "{r}");
    // With a half-life of a tenth of a forward, the runtime's LFRU is LRU again.
    let short = ReplayConfig { lfru_half_life: 0.1, ..cfg(2, 8, 0) };
    assert_eq!(replay(&single_rows(3, seq), &short).policy("LFRU").unwrap().hits, 2);
    // Same routes, but two turn boundaries before 2: heat 3 -> 1 -> 0, so LFRU now
    // prefers the recent 2 and evicts 1 like LRU.
    let mut trace = single_rows(3, seq);
    for (i, rec) in trace.iter_mut().enumerate() {
        rec.segment = match i {
            0..=2 => 0,
            3 => 1,
            _ => 2,
        };
    }
    trace.insert(3, TraceRecord { segment: 1, forward: 99, row: 0, layer: 4, experts: vec![7] });
    let r = replay(&trace, &cfg(2, 8, 0));
    assert_eq!(r.segments, 3);
    assert_eq!(r.policy("LFRU/turn").unwrap().hits, 2);
}

#[test]
fn skipping_leaves_out_low_ranked_misses_of_one_row_forwards_only() {
    // One row a forward, best first: 1 then 2; then a two-row forward of 5 and 6.
    let mut trace = single_rows(3, &[&[1, 2], &[1, 2], &[4, 1]]);
    let two_rows = |row| TraceRecord { segment: 0, forward: 9, row, layer: 3, experts: vec![5 + row as usize, 1] };
    trace.extend([two_rows(0), two_rows(1)]);
    let exact = replay(&trace, &cfg(4, 8, 0));
    let skip = replay(&trace, &ReplayConfig { skip_misses_from_rank: Some(2), ..cfg(4, 8, 0) });
    let lru = |r: &ReplayReport| {
        let p = r.policy("LRU").unwrap();
        (p.hits, p.misses, p.skipped)
    };
    assert_eq!(lru(&exact), (4, 5, 0));
    // 2 (rank 2) is left out twice and never cached; 1 hits; 4 (rank 1) is read; the
    // two-row forward reads 5 and 6 whatever their ranks.
    assert_eq!(lru(&skip), (3, 4, 2));
    assert_eq!(skip.policy("LFRU").unwrap().skipped, 2);
    assert_eq!(skip.policy("Belady").unwrap().skipped, 0, "the offline rows are exact");
    let p = skip.policy("LRU").unwrap();
    assert!((p.hit_rate - 3.0 / 9.0).abs() < 1e-12);
    // Two tiers: a low rank the host holds is a host hit, not skipped.
    let t = replay_tiers(&trace, &ReplayConfig { skip_misses_from_rank: Some(2), ..cfg(1, 1, 0) }, &cfg(4, 2, 0));
    for r in [&t.lru, &t.lfru] {
        assert_eq!(r.gpu_hits + r.host_hits + r.disk_reads + r.skipped, r.accesses);
        assert!(r.skipped >= 1, "{r:?}");
    }
    let exact = replay_tiers(&trace, &cfg(1, 1, 0), &cfg(4, 2, 0));
    assert_eq!(exact.lru.skipped, 0);
    assert!(t.lru.disk_reads < exact.lru.disk_reads);
}

#[test]
fn records_of_one_forward_and_layer_group_even_when_interleaved() {
    let rec = |forward, row, layer, experts: &[usize]| TraceRecord {
        segment: 0,
        forward,
        row,
        layer,
        experts: experts.to_vec(),
    };
    let trace = vec![rec(0, 0, 3, &[1]), rec(0, 0, 4, &[1]), rec(0, 1, 3, &[1, 2]), rec(0, 1, 4, &[5])];
    let r = replay(&trace, &cfg(4, 1, 0));
    assert_eq!((r.accesses, r.selections, r.layers), (4, 5, 2));
    // working 1: layer 3 needs two waves, layer 4 two waves.
    assert_eq!(r.policy("LRU").unwrap().waves, 4);
}

#[test]
fn waves_split_misses_by_the_working_bank() {
    let trace = single_rows(3, &[&[1, 2, 3, 4, 5]]);
    let r = replay(&trace, &cfg(8, 2, 0));
    assert_eq!(r.policy("LRU").unwrap().waves, 3);
    assert_eq!(replay(&trace, &cfg(8, 0, 0)).policy("LRU").unwrap().waves, 5, "0 is treated as 1");
}

#[test]
fn empty_trace_reports_zeroes() {
    let r = replay(&[], &cfg(4, 64, 2));
    assert_eq!(r.accesses, 0);
    assert!(r.policies.iter().all(|p| p.hits == 0 && p.hit_rate == 0.0));
}

#[test]
fn report_renders_a_table_and_json() {
    let trace = single_rows(3, &[&[10], &[11], &[10]]);
    let r = replay(&trace, &cfg(2, 64, 0));
    let table = r.to_string();
    for needle in ["policy", "LRU", "LFRU", "pinned+LRU", "Belady", "33.33%", "2 slots per layer, 64 working, 0 pinned"]
    {
        assert!(table.contains(needle), "{needle:?} missing:\n{table}");
    }
    let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(json["policies"][4]["name"], "Belady");
    assert_eq!(json["policies"][0]["hits"], 1);
    assert_eq!(json["config"]["slots_per_layer"], 2);
}

fn random_trace(rng: &mut TestRng) -> Vec<TraceRecord> {
    let layers = 1 + rng.below(3);
    let experts = 3 + rng.below(10);
    let mut trace = Vec::new();
    let mut segment = 0;
    for forward in 0..(20 + rng.below(80)) as u64 {
        if rng.below(10) == 0 {
            segment += 1;
        }
        let rows = 1 + rng.below(3);
        for layer in 0..layers {
            for row in 0..rows as u32 {
                let k = 1 + rng.below(3.min(experts));
                // Skewed: low ids are hot.
                let picks = (0..k).map(|_| rng.skewed(experts)).collect();
                trace.push(TraceRecord { segment, forward, row, layer: layer * 2 + 1, experts: picks });
            }
        }
    }
    trace
}

#[test]
fn belady_bounds_every_online_policy_on_random_traces() {
    for seed in 0..300 {
        let mut rng = TestRng::new(seed);
        let trace = random_trace(&mut rng);
        let slots = 1 + rng.below(5);
        let r0 = replay(&trace, &cfg(slots, 4, 0));
        let [lru, lfru, pinned_lru, opt, admit] = hits(&r0);
        assert!(opt >= lfru && opt >= admit, "seed {seed}: {r0}");
        assert_eq!(pinned_lru, lru, "seed {seed}: no pins = LRU");
        let r = replay(&trace, &cfg(slots, 4, 1 + rng.below(6)));
        let [lru_p, lfru_p, _, opt_p, _] = hits(&r);
        assert_eq!((lru_p, lfru_p, opt_p), (lru, lfru, opt), "pins only affect pinned+LRU");
        for p in &r.policies {
            assert_eq!(p.hits + p.misses, r.accesses, "seed {seed}: {}", p.name);
        }
    }
}

/// LRU replay equals driving the runtime's SlotTable with the same accesses (one
/// expert per forward and layer, so there are no same-time LRU ties whose order would
/// depend on slot numbering), in either scope.
#[test]
fn lru_replay_matches_the_slot_table() {
    for seed in 0..100 {
        let mut rng = TestRng::new(1000 + seed);
        let layers = [1usize, 3, 5];
        let slots_per_layer = 1 + rng.below(4);
        let mut trace = Vec::new();
        for forward in 0..200u64 {
            for &layer in &layers {
                let e = rng.skewed(12);
                trace.push(TraceRecord { segment: 0, forward, row: 0, layer, experts: vec![e] });
            }
        }
        let scope = [EvictionScope::Layer, EvictionScope::Global][seed as usize % 2];
        let report = replay(&trace, &ReplayConfig { scope, ..cfg(slots_per_layer, 2, 0) });
        let p = plan(PlanInput {
            budget_bytes: u64::MAX,
            fixed_bytes: 0,
            slot_bytes: 1,
            sparse_layers: layers.len(),
            working_slots: 2,
            pinned_experts: 0,
            max_slots_per_layer: Some(slots_per_layer),
        })
        .unwrap();
        let mut table = SlotTable::new(&p, &layers);
        table.set_scope(scope);
        let mut table_hits = 0;
        for r in &trace {
            table.tick(); // once per MoE layer call, as the runtime
            let key = (r.layer, r.experts[0]);
            if table.lookup(key).is_some() {
                table_hits += 1;
            } else {
                let (slot, generation) = table.begin_load(key).unwrap();
                assert!(table.finish_load(slot, generation));
                table.promote(slot);
            }
        }
        assert_eq!(report.policy("LRU").unwrap().hits, table_hits, "seed {seed}, {scope} scope");
    }
}

/// The global scope's Belady keeps all layers' slots together: never fewer hits than the
/// per-layer optimum, which is one of the ways to fill them.
#[test]
fn a_global_belady_bounds_the_per_layer_one() {
    let mut wins = 0;
    for seed in 0..40 {
        let mut rng = TestRng::new(7000 + seed);
        let trace = random_trace(&mut rng);
        let c = cfg(1 + rng.below(4), 2, 0);
        let per_layer = replay(&trace, &c);
        let global = replay(&trace, &ReplayConfig { scope: EvictionScope::Global, ..c });
        for name in ["Belady", "Belady-nobypass"] {
            let (l, g) = (per_layer.policy(name).unwrap(), global.policy(name).unwrap());
            assert_eq!(l.hits + l.misses, g.hits + g.misses, "seed {seed}");
            if name == "Belady" {
                assert!(g.hits >= l.hits, "seed {seed}: global {} < per layer {}", g.hits, l.hits);
                wins += (g.hits > l.hits) as usize;
            }
        }
    }
    assert!(wins > 0, "the global optimum never found more hits");
}

/// A miss that finds every layer slot leased stays in the working bank (still a hit)
/// until a later miss reuses that working slot: the runtime's behaviour that a plain
/// per-layer LRU misses.
#[test]
fn unpromoted_misses_stay_hits_in_the_working_bank() {
    // 1 slot per layer, 4 working. Forward 0 loads 5 (fills the layer slot). Forward 1
    // hits 5 (leased) and misses 6: no victim, so 6 stays in the working bank. Forward 2
    // hits 6 there.
    let trace = single_rows(3, &[&[5], &[5, 6], &[6]]);
    let r = replay(&trace, &cfg(1, 4, 0));
    assert_eq!(hits(&r)[0], 2, "{r}");
    // With one working slot the next miss (7) reuses it and 6 is gone.
    let trace = single_rows(3, &[&[5], &[5, 6], &[5, 7], &[6]]);
    let r = replay(&trace, &cfg(1, 1, 0));
    assert_eq!(r.policy("LRU").unwrap().hits, 2, "{r}");
}

#[test]
fn pins_are_resident_from_the_start_in_the_runtime_rows() {
    let trace = single_rows(3, &[&[1], &[2], &[1], &[3], &[1]]);
    let r = replay(&trace, &cfg(1, 2, 1));
    // 3:1 is the most selected: pinned, it hits every time; 2 and 3 miss.
    assert_eq!(r.policy("pinned+LRU").unwrap().hits, 3, "{r}");
    assert_eq!(r.policy("pinned+LRU").unwrap().misses, 2);
}

/// The runtime rows are exactly the slot table driven through `slab::forward_layer` with
/// many experts per forward, waves and leases (random traces, every capacity).
#[test]
fn runtime_rows_match_a_direct_slot_table_drive() {
    for seed in 0..100 {
        let mut rng = TestRng::new(5000 + seed);
        let trace = random_trace(&mut rng);
        let slots = 1 + rng.below(4);
        let working = 1 + rng.below(4);
        let scope = [EvictionScope::Layer, EvictionScope::Global][seed as usize % 2];
        let r = replay(&trace, &ReplayConfig { scope, ..cfg(slots, working, 0) });
        let mut layers: Vec<usize> = trace.iter().map(|t| t.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut table = slab::table(&layers, slots, working, &[], Eviction::Lru, scope);
        let mut tally = slab::SlabTally::default();
        let mut i = 0;
        while i < trace.len() {
            let (f, l) = (trace[i].forward, trace[i].layer);
            let mut experts = Vec::new();
            while i < trace.len() && trace[i].forward == f && trace[i].layer == l {
                experts.extend(&trace[i].experts);
                i += 1;
            }
            slab::forward_layer(&mut table, l, &experts, &[], &mut tally, None, false);
            table.check_invariants().unwrap();
        }
        let lru = r.policy("LRU").unwrap();
        assert_eq!((lru.hits, lru.misses, lru.waves), (tally.hits, tally.misses, tally.waves), "seed {seed}, {scope}");
    }
}

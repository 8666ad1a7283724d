//! `strata replay` reproduces the runtime: strata-tiny streamed from a container at
//! several capacities, its route trace replayed at the same capacity; the replay's LRU
//! row (the runtime's slot table) must give the runtime's demand hit rate within one
//! point (it drives the same `SlotTable` in the same order, so it is in fact exact), and
//! its LFRU row the runtime's under `--eviction lfru`, in either `--eviction-scope`.

mod common;

use std::path::Path;
use strata_engine::experts::{RuntimeOptions, UsageSetting};
use strata_engine::generate::RouteTrace;
use strata_engine::{GenerateRequest, LoadOptions, LoadedModel, SamplingParams};
use strata_kernels::QuantKind;
use strata_models::convert::{convert, ConvertOptions};
use strata_residency::{read_trace, replay, Eviction, EvictionScope, ReplayConfig};

#[test]
fn replay_reproduces_the_runtime_hit_rate_at_every_capacity() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let opts = ConvertOptions { experts: QuantKind::Int8Row, mtp_experts: QuantKind::Int8Row };
    convert(&root.join("models/strata-tiny"), dir.path(), &opts, &mut |_, _| {}).unwrap();
    let working = 8;
    let lfru = Eviction::Lfru { half_life: 6.0 };
    // (Approximate decode too: a one-row forward's misses of rank 3 or 4 left out.)
    // (And each layer in its own slots, the plan's share: `--eviction-scope layer`.)
    let (global, layer) = (EvictionScope::Global, EvictionScope::Layer);
    let cases =
        [1usize, 2, 4, 8, 16].into_iter().flat_map(|n| [(n, Eviction::Lru, None, global), (n, lfru, None, global)]);
    let more = [
        (4, lfru, Some(3), global),
        (8, Eviction::Lru, Some(3), global),
        (2, Eviction::Lru, None, layer),
        (4, lfru, None, layer),
        (4, lfru, Some(3), layer),
        (1, Eviction::Lru, None, layer),
        (2, lfru, None, layer),
        (8, lfru, None, layer),
        (16, Eviction::Lru, None, layer),
    ];
    for (slots_per_layer, eviction, skip, scope) in cases.chain(more) {
        let load = LoadOptions {
            device: strata_engine::Device::Cpu,
            budget: Some(u64::MAX / 4),
            gpu_budget: None,
            context: 256,
            runtime: RuntimeOptions {
                working_slots: working,
                max_slots_per_layer: Some(slots_per_layer),
                usage: UsageSetting::Off,
                eviction,
                eviction_scope: scope,
                skip_misses_from_rank: skip,
                ..Default::default()
            },
            mtp: false,
            ..Default::default()
        };
        let m = LoadedModel::open_with(dir.path(), &load).unwrap();
        let experts = m.experts.clone().expect("streamed experts");
        let trace_path = dir.path().join(format!("trace-{slots_per_layer}.txt"));
        let mut g = m.engine(None).unwrap();
        g.set_trace(RouteTrace::create(&trace_path).unwrap());
        let mut demand = (0u64, 0u64);
        let mut skipped = 0u64;
        for turn in 0..2u32 {
            let prompt: Vec<u32> = (0..5).map(|i| (i * 97 + turn * 31) % 8000 + 10).collect();
            let req = GenerateRequest::new(prompt, 24, SamplingParams::default());
            common::generate_on(&mut g, &req).unwrap();
            let report = experts.end_turn().unwrap();
            demand.0 += report.turn.demand.hits;
            demand.1 += report.turn.demand.misses;
            skipped += report.turn.demand.skipped;
        }
        drop(g);
        let records = read_trace(std::io::BufReader::new(std::fs::File::open(&trace_path).unwrap())).unwrap();
        let cfg = ReplayConfig {
            lfru_half_life: 6.0,
            skip_misses_from_rank: skip,
            scope,
            ..ReplayConfig::new(slots_per_layer, working, 0)
        };
        let r = replay(&records, &cfg);
        let lru = r.policy(if eviction == Eviction::Lru { "LRU" } else { "LFRU" }).unwrap();
        let runtime_rate = demand.0 as f64 / (demand.0 + demand.1) as f64;
        eprintln!(
            "{slots_per_layer} slots/layer, {eviction}, {scope} scope, skip {skip:?}: runtime {}/{} hits ({:.2}%), replay {}/{} ({:.2}%), Belady {:.2}%",
            demand.0,
            demand.0 + demand.1,
            runtime_rate * 100.0,
            lru.hits,
            lru.hits + lru.misses,
            lru.hit_rate * 100.0,
            r.policy("Belady").unwrap().hit_rate * 100.0
        );
        assert_eq!(lru.hits + lru.misses + lru.skipped, demand.0 + demand.1 + skipped, "same accesses");
        assert_eq!((lru.hits, lru.misses), demand, "{slots_per_layer} slots/layer: the same slot table");
        assert_eq!(lru.skipped, skipped, "{slots_per_layer} slots/layer, skip {skip:?}");
        assert_eq!(skip.is_some(), skipped > 0, "skipping acts only when asked, and then does");
        if skip.is_none() {
            assert!((lru.hit_rate - runtime_rate).abs() <= 0.01, "{slots_per_layer} slots/layer:\n{r}");
        }
    }
}

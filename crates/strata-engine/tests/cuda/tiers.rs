//! Streamed experts on CUDA: a GPU slab of expert slots (`--gpu-budget`) in front of the
//! host tier (`--budget`) and the container.

use super::*;
use strata_engine::experts::{RuntimeOptions, UsageSetting};
use strata_engine::fit::{fit_dir, fit_gpu, FitOptions};
use strata_models::convert::{convert, ConvertOptions};
use strata_residency::{Eviction, EvictionScope};
use strata_storage::WeightStore;

fn fixture(name: &str) -> PathBuf {
    models::repo_root().join("fixtures").join(name)
}

fn container(name: &str, kind: QuantKind) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let opts = ConvertOptions { experts: kind, mtp_experts: QuantKind::Int8Row };
    convert(&fixture(name), dir.path(), &opts, &mut |_, _| {}).unwrap();
    dir
}

fn options(gpu_budget: Option<u64>, budget: Option<u64>, working: usize) -> LoadOptions {
    LoadOptions {
        device: Device::Cuda(0),
        mtp: false,
        require_mtp: false,
        budget,
        gpu_budget,
        context: 256,
        runtime: RuntimeOptions { working_slots: working, usage: UsageSetting::Off, ..Default::default() },
    }
}

/// Prompt logits (every position) and 24 greedy tokens.
fn run(m: &LoadedModel) -> (Vec<Vec<f32>>, Vec<u32>) {
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let logits = m.scorer().unwrap().logits(&prompt, true).unwrap();
    let req = GenerateRequest::new(prompt, 24, SamplingParams::default());
    let out = crate::common::generate(m, &req);
    (logits, out.tokens)
}

fn open(dir: &Path, opts: &LoadOptions) -> LoadedModel {
    LoadedModel::open_with(dir, opts).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()))
}

/// The smallest GPU budget (the model, KV, transients and reserve beside `working` +
/// one slot per layer) and the slot size.
fn gpu_min(dir: &Path, working: usize) -> (u64, u64) {
    let arch = strata_models::read_arch(dir).unwrap();
    let store = WeightStore::open_dir(dir).unwrap();
    let rt = RuntimeOptions { working_slots: working, ..Default::default() };
    let f = fit_gpu(dir, arch.as_ref(), &store, &FitOptions::new(None, 256, &rt), None).unwrap();
    let p = f.plan.unwrap();
    (
        p.input.fixed_bytes + (p.input.working_slots + p.input.sparse_layers) as u64 * p.input.slot_bytes,
        p.input.slot_bytes,
    )
}

/// The smallest host budget: the host plan's fixed items (process baseline, the CUDA
/// runtime's host memory, the largest weight in transit) beside `working` + one slot per
/// layer.
fn host_min(dir: &Path, working: usize, slot: u64) -> u64 {
    let arch = strata_models::read_arch(dir).unwrap();
    let store = WeightStore::open_dir(dir).unwrap();
    let rt = RuntimeOptions { working_slots: working, ..Default::default() };
    let mut o = FitOptions::new(None, 256, &rt);
    o.host_tier_only = true;
    let p = fit_dir(dir, arch.as_ref(), &store, &o).unwrap().plan.unwrap();
    assert_eq!(p.input.slot_bytes, slot);
    p.input.fixed_bytes + (p.input.working_slots + p.input.sparse_layers) as u64 * slot
}

pub(crate) fn cuda_streamed_experts_equal_resident_on(_g: &CudaBackend) {
    // (bf16: the encoding whose many-row and one-row expert products add in different
    // orders, so a prompt's expert batches, which differ between budgets, must not pick
    // the kernel.)
    for (name, kind) in [
        ("glm5/dsa-sparse", QuantKind::int4(16)),
        ("glm5/dsa-sparse", QuantKind::Bf16),
        ("glm4_moe/gqa-bias", QuantKind::Int8Row),
        ("gemma4/moe", QuantKind::int4(16)),
        ("qwen3_moe/sparse-step", QuantKind::int4(16)),
        // gpt-oss's MXFP4 experts, streamed into the GPU slab as stored.
        ("gpt_oss/mxfp4-yarn", QuantKind::Mxfp4),
        // bf16 and e4m3 scales, read by the kernels from the slots as stored.
        ("glm5/dsa-sparse", QuantKind::int4_bf16(16)),
        ("glm4_moe/gqa-bias", QuantKind::int4_e4m3(32)),
    ] {
        let dir = container(name, kind);
        // Every expert in a GPU slot (no budgets): the reference. With no usage ledger and
        // no PILOT, its decode rows dispatch their experts by id on the device.
        let all = open(dir.path(), &options(None, None, 64));
        let resident = run(&all);
        let tier = all.experts.as_ref().unwrap().end_turn().unwrap().device_tier.expect("a GPU tier");
        // (Gemma 4's GELU experts and gpt-oss's biased, clamped ones have no by-id path.)
        let by_id_expected = name != "gemma4/moe" && !name.starts_with("gpt_oss/");
        assert_eq!(tier.traffic.misses, 0, "{name}: every expert on the GPU, yet misses: {tier:?}");
        assert_eq!(tier.traffic.by_id > 0, by_id_expected, "{name}: dispatch by id: {tier:?}");
        assert!(tier.traffic.by_id <= tier.traffic.hits, "{tier:?}");
        drop(all);
        let (gmin, slot) = gpu_min(dir.path(), 2);
        let hmin = host_min(dir.path(), 2, slot);
        // (The last with victims from any layer, `--eviction-scope global`: slots move
        // between layers in both tiers.)
        let (layer, global) = (EvictionScope::Layer, EvictionScope::Global);
        let pairs = [
            (Some(gmin), None, 2, layer),
            (Some(gmin), Some(hmin), 2, layer),
            (Some(gmin + 3 * slot), Some(hmin + 2 * slot), 2, layer),
            (Some(gmin + 20 * slot), Some(hmin + 40 * slot), 4, layer),
            (None, Some(hmin), 2, layer),
            (Some(gmin + 12 * slot), Some(hmin + 12 * slot), 2, global),
        ];
        for (gpu, host, working, scope) in pairs {
            let mut opts = options(gpu, host, working);
            opts.runtime.eviction_scope = scope;
            let m = open(dir.path(), &opts);
            let streamed = run(&m);
            let what = format!("{name}: --gpu-budget {gpu:?} --budget {host:?} (working {working}, {scope} scope)");
            assert_eq!(streamed.1, resident.1, "{what}: greedy tokens differ from every expert on the GPU");
            assert!(streamed.0 == resident.0, "{what}: logits differ from every expert on the GPU");
            let report = m.experts.as_ref().unwrap().end_turn().unwrap();
            let tier = report.device_tier.expect("the host tier reports its GPU tier");
            if gpu == Some(gmin) {
                assert!(tier.traffic.misses > 0 && tier.traffic.copies > 0, "{what}: nothing streamed ({tier:?})");
                // One GPU slot a layer evicts at every miss; the host tier keeps each
                // evicted expert (exclusive tiers: touched there, or copied back down).
                let t = &tier.traffic;
                assert!(t.demotions_kept + t.demotions_copied > 0, "{what}: no eviction came down ({tier:?})");
                assert_eq!(t.demotion_bytes, t.demotions_copied * slot, "{what}: {tier:?}");
            }
            eprintln!(
                "{what}: equal; GPU tier {} hits, {} misses, {} copied, evictions kept by the host {} (+{} copied \
                 down); host tier {} misses",
                tier.traffic.hits,
                tier.traffic.misses,
                tier.traffic.copy_bytes,
                tier.traffic.demotions_kept,
                tier.traffic.demotions_copied,
                report.turn.demand.misses
            );
        }
        let err = LoadedModel::open_with(dir.path(), &options(Some(gmin - 1), None, 2)).err().expect("too small");
        let msg = format!("{err:#}");
        assert!(msg.contains("--gpu-budget") && msg.contains("short by 1 bytes"), "{msg}");
    }
}

#[test]
fn cuda_streamed_experts_equal_resident_bit_for_bit() {
    if let Some(g) = gpu() {
        cuda_streamed_experts_equal_resident_on(g)
    }
}

/// GPU memory the model takes (the driver's count of memory in use, before loading and
/// after generating) stays within `--gpu-budget`.
#[test]
fn cuda_gpu_memory_stays_within_the_gpu_budget() {
    let Some(g) = gpu() else { return };
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    let (gmin, slot) = gpu_min(dir.path(), 2);
    for budget in [gmin, gmin + 10 * slot] {
        g.synchronize();
        let (free0, total) = g.memory_info().unwrap();
        let m = open(dir.path(), &options(Some(budget), None, 2));
        run(&m);
        g.synchronize();
        let (free1, _) = g.memory_info().unwrap();
        let used = free0.saturating_sub(free1);
        eprintln!("--gpu-budget {budget}: {used} bytes of GPU memory in use by the model (of {total})");
        assert!(used <= budget, "the model uses {used} bytes of GPU memory, over --gpu-budget {budget}");
        drop(m);
    }
}

/// A read that fails (a truncated container) fails that request; once the file is back,
/// the same model serves the next request with the reference's output.
#[test]
fn cuda_failed_expert_read_fails_the_request_and_the_next_succeeds() {
    if gpu().is_none() {
        return;
    }
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    let reference = run(&open(dir.path(), &options(None, None, 64)));
    let (gmin, slot) = gpu_min(dir.path(), 2);
    let m = open(dir.path(), &options(Some(gmin), Some(host_min(dir.path(), 2, slot)), 2));
    let file = dir.path().join("experts/experts-00000.bin");
    let saved = std::fs::read(&file).unwrap();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(4096).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let err = m.scorer().unwrap().logits(&prompt, true).expect_err("a short read must fail the request");
    let msg = format!("{err:#}");
    assert!(msg.contains("experts-00000.bin"), "the error names the file: {msg}");
    std::fs::write(&file, saved).unwrap();
    let again = run(&m);
    assert!(again == reference, "after the fault the tiers must serve the reference output");
}

/// `strata replay --host-slots-per-layer` replays the tiers as the engine serves them: a
/// traced generation through a small GPU slab and host tier, replayed at the plans' sizes,
/// gives the engine's GPU hits, host hits and disk reads (exclusive tiers, the default),
/// under LFRU eviction on the GPU (the default) and LRU, with each layer in its own slots
/// (the default) or victims from any layer (`--eviction-scope global`).
#[test]
fn cuda_two_tier_replay_matches_the_engine() {
    let Some(_g) = gpu() else { return };
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    // (Slots beyond the minimum of one a layer, GPU and host: with 2 more GPU slots a layer
    // keeps 1 and has no choice of victim. Under the global scope a layer keeps 3/4 of its
    // share: at 4 slots a layer of 16 experts, one can move.)
    let (layer, global) = (EvictionScope::Layer, EvictionScope::Global);
    let lfru = Eviction::Lfru { half_life: 4.0 };
    for (eviction, more_gpu, more_host, scope) in [
        (lfru, 8, 4, layer),
        (Eviction::Lru, 8, 4, layer),
        (Eviction::Lru, 2, 4, layer),
        (lfru, 12, 12, layer),
        (lfru, 12, 12, global),
        (Eviction::Lru, 12, 12, global),
    ] {
        two_tier_replay_matches(dir.path(), eviction, (more_gpu, more_host), scope);
    }
}

/// `more`: slots beyond the minimum, GPU and host.
fn two_tier_replay_matches(dir: &Path, eviction: Eviction, more: (u64, u64), scope: EvictionScope) {
    let (gmin, slot) = gpu_min(dir, 2);
    let hmin = host_min(dir, 2, slot);
    let mut opts = options(Some(gmin + more.0 * slot), Some(hmin + more.1 * slot), 2);
    opts.runtime.eviction = eviction;
    opts.runtime.eviction_scope = scope;
    let m = open(dir, &opts);
    let trace_path = dir.join(format!("tiers-{eviction}-{}-{}-{scope}.trace", more.0, more.1));
    let mut g = m.engine(None).unwrap();
    g.set_trace(strata_engine::generate::RouteTrace::create(&trace_path).unwrap());
    let prompt: Vec<u32> = (0..12).map(|i| (i * 71 % 440) as u32).collect();
    let req = GenerateRequest::new(prompt, 60, SamplingParams { temperature: 0.9, seed: 5, ..Default::default() });
    crate::common::generate_on(&mut g, &req).unwrap();
    drop(g);
    let report = m.experts.as_ref().unwrap().end_turn().unwrap();
    let tier = report.device_tier.expect("a GPU tier");
    let (gp, hp) = (tier.plan, report.plan);
    // Host slots by layer now (global: the plan's share moves with demand).
    let mut by_layer = std::collections::BTreeMap::new();
    for e in report.residency_map.iter().filter(|e| matches!(e.role, strata_residency::SlotRole::Layer(_))) {
        *by_layer.entry(e.layer).or_insert(0usize) += 1;
    }
    eprintln!("host tier, experts held by layer: {by_layer:?} (plan: {} a layer)", hp.slots_per_layer);
    if scope == EvictionScope::Global && more.1 >= 12 {
        // (H200, 2026-12-04: {1: 5, 2: 3, 3: 3, 4: 5} under LFRU on the GPU.)
        assert!(by_layer.values().any(|&n| n != hp.slots_per_layer), "no host slot changed layers: {by_layer:?}");
    }
    let records =
        strata_residency::read_trace(std::io::BufReader::new(std::fs::File::open(&trace_path).unwrap())).unwrap();
    let cfg = |p: &strata_residency::ResidencyPlan| strata_residency::ReplayConfig {
        lfru_half_life: 4.0,
        scope,
        ..strata_residency::ReplayConfig::new(p.slots_per_layer, p.input.working_slots, 0)
    };
    let r = strata_residency::replay_tiers(&records, &cfg(&gp), &cfg(&hp));
    let r = if eviction == Eviction::Lru { r.lru } else { r.lfru };
    let engine = (tier.traffic.hits, report.turn.demand.hits, report.turn.demand.misses);
    let replayed = (r.gpu_hits, r.host_hits, r.disk_reads);
    eprintln!(
        "{eviction}, {scope} scope: GPU {} + {} working slots, host {} + {}: engine (GPU hits, host hits, disk) {engine:?}, replay {replayed:?}; \
         demotions: engine {} kept + {} copied, replay {} + {}",
        gp.slots_per_layer * gp.input.sparse_layers,
        gp.input.working_slots,
        hp.slots_per_layer * hp.input.sparse_layers,
        hp.input.working_slots,
        tier.traffic.demotions_kept,
        tier.traffic.demotions_copied,
        r.demotions_kept,
        r.demotions_copied
    );
    assert_eq!(tier.traffic.hits + tier.traffic.misses, r.accesses, "the same expert uses");
    // The same slot tables in the same order; the engine settles its device -> host
    // copies a layer later than the replay, so a few evictions land differently (H200,
    // 2026-12-03: GPU hits 101 vs 100, host 223 vs 232, disk 660 vs 652 of 984 uses).
    let close = |a: u64, b: u64, within: f64| a.abs_diff(b) as f64 <= within * r.accesses as f64;
    assert!(close(engine.0, replayed.0, 0.01), "GPU hits: engine {engine:?} vs replay {replayed:?}");
    assert!(
        close(engine.1, replayed.1, 0.03) && close(engine.2, replayed.2, 0.03),
        "engine {engine:?} vs replay {replayed:?}"
    );
}

//! Streamed experts: the slab path equals the resident path bit for bit at every budget
//! down to the smallest plan that fits; I/O faults fail one request cleanly; the fit
//! refuses budgets that cannot hold one slot per layer.

mod common;

use std::path::{Path, PathBuf};
use strata_engine::experts::{RuntimeOptions, UsageSetting};
use strata_engine::fit::{fit_dir, FitOptions};
use strata_engine::{GenerateRequest, LoadOptions, LoadedModel, SamplingParams};
use strata_kernels::{QuantKind, ScaleType};
use strata_models::convert::{convert, ConvertOptions};
use strata_residency::EvictionScope;
use strata_storage::WeightStore;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn container(name: &str, kind: QuantKind) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    convert(
        &fixture(name),
        dir.path(),
        &ConvertOptions { experts: kind, mtp_experts: QuantKind::Int8Row },
        &mut |_, _| {},
    )
    .unwrap();
    dir
}

fn options(budget: Option<u64>, working: usize) -> LoadOptions {
    LoadOptions {
        device: strata_engine::Device::Cpu,
        mtp: false,
        require_mtp: false,
        budget,
        gpu_budget: None,
        context: 256,
        runtime: RuntimeOptions { working_slots: working, usage: UsageSetting::Off, ..Default::default() },
    }
}

/// Prompt logits (every position) and 24 greedy tokens with their logits.
fn run(dir: &Path, opts: &LoadOptions) -> (Vec<Vec<f32>>, Vec<u32>) {
    let m = LoadedModel::open_with(dir, opts).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let mut g = m.scorer().unwrap();
    let logits = g.logits(&prompt, true).unwrap();
    let out = common::generate(&m, &GenerateRequest::new(prompt, 24, SamplingParams::default()));
    (logits, out.tokens)
}

fn min_budget(dir: &Path, working: usize) -> u64 {
    let arch = strata_models::read_arch(dir).unwrap();
    let store = WeightStore::open_dir(dir).unwrap();
    let fit = fit_dir(
        dir,
        arch.as_ref(),
        &store,
        &FitOptions {
            budget: Some(u64::MAX / 4),
            context: 256,
            working_slots: working,
            pinned: 0,
            max_slots_per_layer: None,
            draft: false,
            host_tier_only: false,
            image_rows: 0,
        },
    )
    .unwrap();
    let p = fit.plan.unwrap();
    p.input.fixed_bytes + (p.input.working_slots + p.input.sparse_layers) as u64 * p.input.slot_bytes
}

#[test]
fn streamed_equals_resident_bit_for_bit() {
    for (name, kind) in [
        ("glm5/dsa-sparse", QuantKind::int4(16)),
        ("glm5/dsa-shared", QuantKind::Int8Row),
        // bf16 and e4m3 scales: read in place from the slot as the f32 ones are.
        ("glm4_moe/gqa-bias", QuantKind::int4_bf16(16)),
        ("glm5/dsa-sparse", QuantKind::int4_e4m3(32)),
        ("glm4_moe/bf16-mha", QuantKind::Int8Row),
        ("qwen3_moe/gqa-renorm", QuantKind::int4(16)),
        ("qwen3_moe/sparse-step", QuantKind::Int8Row),
        ("minimax_m2/gqa-full", QuantKind::int4(16)),
        ("minimax_m2/bf16-rot", QuantKind::Int8Row),
        ("deepseek_v3/yarn-groups", QuantKind::int4(16)),
        ("qwen3_moe/gqa-renorm", QuantKind::Mxfp4),
        // FP8 block-scaled experts (Kimi K2's form), converted to int8 rows.
        ("deepseek_v3/kimi-fp8", QuantKind::Int8Row),
        // gpt-oss: MXFP4 nibbles kept as they are; bf16 interleaved experts re-encoded.
        ("gpt_oss/mxfp4-yarn", QuantKind::Mxfp4),
        ("gpt_oss/bf16-plain", QuantKind::int4(16)),
        // Qwen3-Next: the shared expert beside the streamed routed ones.
        ("qwen3_next/hybrid-f32", QuantKind::int4(16)),
        ("qwen3_next/bf16-dense", QuantKind::Int8Row),
        // Qwen3.5-MoE's vision-language checkpoint: experts under `model.language_model.`.
        ("qwen3_5_moe/vl-bf16", QuantKind::Int8Row),
    ] {
        let dir = container(name, kind);
        let resident = run(dir.path(), &options(None, 64));
        let min = min_budget(dir.path(), 2);
        let slot = strata_engine::experts::ContainerSource::open(dir.path(), "main").unwrap();
        let slot = strata_engine::experts::ExpertSource::slot_bytes(&slot) as u64;
        // The smallest plan (1 slot per layer, 2 working), a few in between, and roomy; the
        // middle ones also with victims from any layer (`--eviction-scope global`).
        let (layer, global) = (EvictionScope::Layer, EvictionScope::Global);
        for (budget, working, scope) in [
            (min, 2, layer),
            (min + 3 * slot, 2, layer),
            (min + 20 * slot, 4, layer),
            (min + 400 * slot, 16, layer),
            (min + 3 * slot, 2, global),
            (min + 20 * slot, 4, global),
        ] {
            let mut opts = options(Some(budget), working);
            opts.runtime.eviction_scope = scope;
            let streamed = run(dir.path(), &opts);
            assert_eq!(streamed.1, resident.1, "{name}: tokens differ at budget {budget} ({scope} scope)");
            assert!(streamed.0 == resident.0, "{name}: logits differ at budget {budget} ({scope} scope)");
        }
        let err = LoadedModel::open_with(dir.path(), &options(Some(min - 1), 2)).err().unwrap();
        let msg = format!("{err:#}");
        assert!(msg.contains("budget") || msg.contains("does not fit"), "{msg}");
    }
}

/// Gemma 4's MoE (GELU experts beside a dense MLP, softmax router) through the same
/// streamed path: every budget gives the resident output bit for bit, PILOT's prediction
/// leaves it unchanged, and an f32 container gives the HF checkpoint's fused experts
/// exactly.
#[test]
fn gemma4_moe_streamed_equals_resident_bit_for_bit() {
    use strata_engine::experts::PilotMode;
    let name = "gemma4/moe";
    for kind in [QuantKind::int4(16), QuantKind::Int8Row] {
        let dir = container(name, kind);
        let resident = run(dir.path(), &options(None, 64));
        let min = min_budget(dir.path(), 2);
        let slot = strata_engine::experts::ContainerSource::open(dir.path(), "main").unwrap();
        let slot = strata_engine::experts::ExpertSource::slot_bytes(&slot) as u64;
        for (budget, working) in [(min, 2), (min + 3 * slot, 2), (min + 20 * slot, 4)] {
            for pilot in [PilotMode::Off, PilotMode::Prefetch] {
                let mut opts = options(Some(budget), working);
                opts.runtime.pilot = pilot;
                let streamed = run(dir.path(), &opts);
                assert_eq!(streamed.1, resident.1, "{name}: tokens differ at budget {budget} ({pilot:?})");
                assert!(streamed.0 == resident.0, "{name}: logits differ at budget {budget} ({pilot:?})");
            }
        }
        let err = LoadedModel::open_with(dir.path(), &options(Some(min - 1), 2)).err().unwrap();
        let msg = format!("{err:#}");
        assert!(msg.contains("budget") || msg.contains("does not fit"), "{msg}");
    }
    let dir = container(name, QuantKind::F32);
    let (a, ta) = run(dir.path(), &options(Some(min_budget(dir.path(), 2)), 2));
    let (b, tb) = run(&fixture(name), &options(None, 64));
    assert!(a == b && ta == tb, "an f32 container streams the HF checkpoint's fused experts exactly");
}

/// Approximate decode through Gemma 4's MoE block (its own combine, no shared expert): the
/// rank-2 experts a decode step would read are left out, the prompt is exact.
#[test]
fn gemma4_moe_skips_low_ranked_misses_in_decode_only() {
    let dir = container("gemma4/moe", QuantKind::Int8Row);
    let resident = run(dir.path(), &options(None, 64));
    let mut opts = options(Some(min_budget(dir.path(), 2)), 2);
    opts.runtime.skip_misses_from_rank = Some(2);
    let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    assert!(m.scorer().unwrap().logits(&prompt, true).unwrap() == resident.0, "prompt forwards are exact");
    let req = GenerateRequest::new(prompt, 24, SamplingParams::default());
    let out = common::generate(&m, &req);
    assert!(!out.tokens.is_empty());
    let demand = m.experts.as_ref().unwrap().end_turn().unwrap().turn.demand;
    assert!(demand.skipped > 0, "{demand:?}");
}

#[test]
fn container_matches_hf_model_when_experts_are_f32() {
    // f32 experts from the container's slab vs f32 experts held by the model: same function.
    let dir = container("glm5/dsa-sparse", QuantKind::F32);
    let (a, _) = run(dir.path(), &options(None, 64));
    let m = LoadedModel::open(&fixture("glm5/dsa-sparse")).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let b = m.scorer().unwrap().logits(&prompt, true).unwrap();
    let worst = a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "container f32 experts differ from the HF model by {worst}");
}

/// `--gpu-budget` sizes the GPU tier: refused by name on the CPU.
#[test]
fn gpu_budget_is_refused_on_the_cpu() {
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    let mut opts = options(None, 2);
    opts.gpu_budget = Some(1 << 30);
    let err = LoadedModel::open_with(dir.path(), &opts).err().expect("--gpu-budget on the CPU must be refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("--gpu-budget") && msg.contains("--device cuda"), "{msg}");
}

/// A short read fails its request, also when PILOT prefetches (a failed prefetch is read
/// again on demand, which reports the error); the next request succeeds.
#[test]
fn io_fault_fails_one_request_and_the_next_succeeds() {
    for pilot in [strata_engine::experts::PilotMode::Off, strata_engine::experts::PilotMode::Prefetch] {
        io_fault_with(pilot);
    }
}

fn io_fault_with(pilot: strata_engine::experts::PilotMode) {
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    let mut opts = options(Some(min_budget(dir.path(), 4)), 4);
    opts.runtime.pilot = pilot;
    let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
    // Truncate the expert file under the open reader: misses now hit a short read.
    let file = dir.path().join("experts/experts-00000.bin");
    let saved = std::fs::read(&file).unwrap();
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(4096).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let mut g = m.scorer().unwrap();
    let err = g.logits(&prompt, true).expect_err("a short read must fail the request");
    let msg = format!("{err:#}");
    assert!(msg.contains("experts-00000.bin"), "the error names the file: {msg}");
    // Restore the file: the same runtime serves the next request.
    std::fs::write(&file, saved).unwrap();
    let mut g = m.scorer().unwrap();
    let ok = g.logits(&prompt, true).unwrap();
    let (reference, _) = run(dir.path(), &options(None, 64));
    assert!(ok == reference, "after the fault the runtime must be consistent");
}

/// The public GLM-5.2 container layout (`out-*.safetensors`, U8 + `.qs`), opened in place:
/// resident and streamed runs agree bit for bit, and stay close to the f32 original.
#[test]
fn colibri_container_streams_in_place() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/colibri/dsa-sparse-int4");
    let resident = run(&dir, &options(None, 64));
    let min = min_budget(&dir, 2);
    for budget in [min, min + (64 << 10)] {
        let streamed = run(&dir, &options(Some(budget), 2));
        assert!(streamed.0 == resident.0 && streamed.1 == resident.1, "Colibri streamed differs at budget {budget}");
    }
    // The same weights, dequantized to f32 and run through the HF path: equal up to
    // accumulation order. This checks every tensor's Colibri decoding.
    let arch = strata_models::read_arch(&dir).unwrap();
    let store = WeightStore::open_dir(&dir).unwrap();
    let hf = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir.join(f), hf.path().join(f)).unwrap();
    }
    let map = arch.weight_map();
    let tensors: Vec<_> = map.specs.iter().filter(|s| !s.optional).collect();
    let specs = tensors
        .iter()
        .map(|s| strata_storage::TensorSpec {
            name: s.name.clone(),
            dtype: strata_storage::ElementType::F32,
            shape: s.shape.clone(),
        })
        .collect();
    let mut w = strata_storage::SafetensorsWriter::create(&hf.path().join("model.safetensors"), specs).unwrap();
    for s in &tensors {
        let v = store.load_f32(&s.name, &s.shape, None).unwrap();
        w.write_next(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    }
    w.finish().unwrap();
    let m = LoadedModel::open(hf.path()).unwrap();
    let prompt: Vec<u32> = (0..30).map(|i| (i * 53 % 440) as u32).collect();
    let dequant = m.scorer().unwrap().logits(&prompt, true).unwrap();
    let worst =
        resident.0.iter().flatten().zip(dequant.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-4, "Colibri path differs from its dequantized weights by {worst}");
}

/// The public container's int4 experts converted at their own group
/// (`strata convert --experts int4 --group 16 [--scales bf16|e4m3]`) keep every nibble: with
/// f32 scales the container is the same model (logits equal up to accumulation order); with
/// bf16 or e4m3 scales each scale is rounded, so a weight moves by at most 2^-8 or 2^-4 of
/// itself (half a unit in the last place of 8 or 4 significant bits).
#[test]
fn colibri_int4_converts_keeping_every_nibble() {
    use strata_storage::{AlignedBuf, ExpertManifest, IoPool};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/colibri/dsa-sparse-int4");
    let store = WeightStore::open_dir(&dir).unwrap();
    let was = run(&dir, &options(None, 64)).0;
    let spread = was.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    for (kind, bound) in
        [(QuantKind::int4(16), 0.0f32), (QuantKind::int4_bf16(16), 1.0 / 256.0), (QuantKind::int4_e4m3(16), 1.0 / 16.0)]
    {
        let out = tempfile::tempdir().unwrap();
        let opts = ConvertOptions { experts: kind, mtp_experts: QuantKind::Int8Row };
        convert(&dir, out.path(), &opts, &mut |_, _| {}).unwrap();
        let manifest = ExpertManifest::read(out.path()).unwrap();
        let pool = IoPool::open(&manifest.file_paths(out.path()), 1, false).unwrap();
        let tier = manifest.tier("main").unwrap();
        let mut checked = 0;
        for &layer in &tier.layers {
            for e in 0..tier.experts_per_layer {
                let read = manifest.expert_read("main", layer, e).unwrap();
                let mut slot = AlignedBuf::new(read.layout.slot_bytes).unwrap();
                pool.read(read.segments.clone(), slot.as_mut_slice()).unwrap();
                for (m, name) in read.layout.matrices().into_iter().zip(["gate_proj", "up_proj", "down_proj"]) {
                    assert_eq!(m.kind, kind);
                    let name = format!("model.layers.{layer}.mlp.experts.{e}.{name}.weight");
                    let before = store.load_f32(&name, &[m.rows, m.cols], None).unwrap();
                    let after = m.dequantize(slot.as_slice()).unwrap();
                    for (a, b) in before.iter().zip(&after) {
                        assert!((a - b).abs() <= a.abs() * bound, "{}: {name}: {a} became {b}", kind.name());
                    }
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 3 * tier.layers.len() * tier.experts_per_layer);
        // The prompt's logits.
        let now = run(out.path(), &options(None, 64)).0;
        let worst = was.iter().flatten().zip(now.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("Colibri int4 -> {}: {checked} matrices, logits within {worst:.2e} of {spread:.2}", kind.name());
        // This random fixture amplifies weight changes; e4m3's bound only catches gross
        // errors (a wrong factor or code moves logits by more than their spread).
        let limit = match kind.scale_type() {
            ScaleType::F32 => 1e-4,
            ScaleType::Bf16 => 0.05 * spread,
            ScaleType::E4m3 | ScaleType::E8m0 => 0.5 * spread,
        };
        assert!(worst < limit, "{}: logits moved by {worst} (largest {spread})", kind.name());
    }
}

/// Pins, the usage ledger and live repin through the runtime: after a turn, the ledger
/// file holds the routing counts, and a hot unpinned expert replaces a cold pin.
#[test]
fn ledger_and_live_repin_across_turns() {
    let dir = container("glm5/dsa-sparse", QuantKind::Int8Row);
    let ledger = dir.path().join("usage.txt");
    let cold = (1, 15); // pinned whatever the routing
    let mut opts = options(Some(min_budget(dir.path(), 2) + (64 << 10)), 2);
    opts.runtime.usage = UsageSetting::Path(ledger.clone());
    opts.runtime.pins = vec![cold];
    opts.runtime.live_repin = true;
    let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
    let experts = m.experts.as_ref().unwrap();
    let mut engine = m.engine(None).unwrap();
    let mut swaps = Vec::new();
    for turn in 0..4u32 {
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 31 + turn * 7) % 440).collect();
        common::generate_on(&mut engine, &GenerateRequest::new(prompt, 16, SamplingParams::default())).unwrap();
        let report = experts.end_turn().unwrap();
        assert!(report.turn.demand.hits + report.turn.demand.misses > 0);
        swaps.extend(report.repins);
    }
    let text = std::fs::read_to_string(&ledger).unwrap();
    assert!(text.starts_with("-1 5 16\n-2 1 "), "C-engine header records: {text}");
    let counted: u64 = text
        .lines()
        .filter_map(|l| {
            let f: Vec<i64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (f[0] >= 0).then_some(f[2] as u64)
        })
        .sum();
    // 4 turns x (40 prompt + 15 decoded forwards' rows) x 4 sparse layers x top-4.
    assert_eq!(counted, 4 * (40 + 15) * 4 * 4);
    assert!(
        swaps.iter().any(|&(layer, c, _)| (layer, c) == cold),
        "the cold pin {cold:?} should have been swapped for a hot expert: {swaps:?}"
    );
}

/// PILOT on trained routing (strata-tiny): the next layer's router on the current
/// residual predicts most experts, and neither measuring nor hinting changes the output.
#[test]
fn pilot_predicts_trained_routing_without_changing_output() {
    use strata_engine::experts::PilotMode;
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let dir = tempfile::tempdir().unwrap();
    convert(
        &tiny,
        dir.path(),
        &ConvertOptions { experts: QuantKind::Bf16, mtp_experts: QuantKind::Int8Row },
        &mut |_, _| {},
    )
    .unwrap();
    let m = LoadedModel::open(&tiny).unwrap();
    let prompt = m.tokenizer().unwrap().encode("In the beginning God created the heaven and the earth.", true).unwrap();
    let budget = min_budget(dir.path(), 8) + 40 * (96 << 10);
    let mut outputs = Vec::new();
    let mut hit_rates = Vec::new();
    let mut precision = Vec::new();
    let modes = [
        (PilotMode::Off, None),
        (PilotMode::Measure, None),
        (PilotMode::Hint, None),
        (PilotMode::Prefetch, None),
        (PilotMode::Prefetch, Some(2)),
    ];
    for (pilot, ranks) in modes {
        let mut opts = options(Some(budget), 8);
        opts.runtime.pilot = pilot;
        opts.runtime.pilot_ranks = ranks;
        let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
        let out = common::generate(&m, &GenerateRequest::new(prompt.clone(), 48, SamplingParams::default()));
        let report = m.experts.as_ref().unwrap().end_turn().unwrap();
        if pilot != PilotMode::Off {
            let p = report.pilot.expect("pilot telemetry");
            // Top-4 of 32: chance would be 12.5%.
            assert!(p.recall > 0.5, "PILOT recall {} on trained routing", p.recall);
            assert_eq!(p.rows, 47 * 5, "every decode row of the 5 MoE layers is scored (prefill is wider than 8 rows)");
            assert_eq!(pilot == PilotMode::Hint, p.hints > 0);
            if pilot == PilotMode::Prefetch {
                // Most prefetched experts are used, and they turn misses into hits.
                assert!(p.prefetches > 0 && p.prefetch_hits * 2 > p.prefetches, "{p:?}");
                hit_rates.push(report.turn.demand.hit_rate);
                precision.push((p.prefetches, p.prefetch_hits as f64 / p.prefetches as f64));
            }
        } else {
            hit_rates.push(report.turn.demand.hit_rate);
        }
        outputs.push(out.tokens);
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]), "PILOT must not change the output");
    assert!(hit_rates[1] > hit_rates[0], "prefetch should raise the hit rate: {hit_rates:?}");
    // The first two ranks only: fewer reads, more of them used.
    let ((all, all_used), (two, two_used)) = (precision[0], precision[1]);
    assert!(two < all && two_used > all_used, "--pilot-ranks 2 against all ranks: {precision:?}");
}

/// `--skip-misses-from-rank`: on a slab too small for the model, a decode step leaves out
/// low-ranked experts it would have read from disk (fewer reads, counted as skipped); the
/// prompt is never approximated; and once every expert is resident nothing is skipped, so
/// the output is the exact model's again.
#[test]
fn skipping_low_ranked_misses_reads_less_and_is_exact_when_nothing_misses() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let dir = tempfile::tempdir().unwrap();
    let opts = ConvertOptions { experts: QuantKind::Bf16, mtp_experts: QuantKind::Int8Row };
    convert(&tiny, dir.path(), &opts, &mut |_, _| {}).unwrap();
    let m = LoadedModel::open(&tiny).unwrap();
    let prompt = m.tokenizer().unwrap().encode("The history of the river town begins with", true).unwrap();
    let req = GenerateRequest::new(prompt.clone(), 32, SamplingParams::default());
    let small_budget = min_budget(dir.path(), 8) + 20 * (96 << 10);
    let turn = |budget: u64, skip: Option<usize>| {
        let mut o = options(Some(budget), 8);
        o.runtime.skip_misses_from_rank = skip;
        if budget > small_budget {
            // Every expert pinned (resident from the start): nothing ever misses.
            o.runtime.pins = (1..=5).flat_map(|l| (0..32).map(move |e| (l, e))).collect();
        }
        let m = LoadedModel::open_with(dir.path(), &o).unwrap();
        let mut g = m.scorer().unwrap();
        let logits = g.logits(&prompt, false).unwrap();
        let out = common::generate(&m, &req);
        (logits, out.tokens, m.experts.as_ref().unwrap().end_turn().unwrap().turn.demand)
    };
    let exact = turn(small_budget, None);
    let skip = turn(small_budget, Some(4));
    assert_eq!(exact.2.skipped, 0);
    assert!(skip.2.skipped > 0, "{:?}", skip.2);
    assert!(skip.2.loads < exact.2.loads, "skipped misses are not read: {} vs {}", skip.2.loads, exact.2.loads);
    assert_eq!(skip.0, exact.0, "prompt forwards (many rows) are never approximated");
    assert_eq!(skip.1[0], exact.1[0], "the first token comes from the prompt's logits");
    // Every expert resident: nothing misses, nothing is skipped, the exact model's output.
    let big = min_budget(dir.path(), 8) + 6 * 32 * (96 << 10);
    let resident = turn(big, Some(2));
    assert_eq!((resident.2.misses, resident.2.skipped), (0, 0), "{:?}", resident.2);
    assert_eq!(resident.1, turn(big, None).1, "nothing skipped: the exact model's tokens");
}

/// The draft (MTP) layer's experts stream from the container's int8 tier through their
/// own slab, count into the MTP row of the ledger, and speculation leaves greedy output
/// unchanged.
#[test]
fn mtp_tier_streams_and_speculation_keeps_greedy_output() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let dir = tempfile::tempdir().unwrap();
    convert(
        &tiny,
        dir.path(),
        &ConvertOptions { experts: QuantKind::Bf16, mtp_experts: QuantKind::Int8Row },
        &mut |_, _| {},
    )
    .unwrap();
    let ledger = dir.path().join("usage.txt");
    // Room for the draft layer's weights, KV and slab on top of the smallest main plan.
    let mut opts = options(Some(min_budget(dir.path(), 8) + (8 << 20)), 8);
    (opts.mtp, opts.require_mtp) = (true, true);
    opts.runtime.usage = UsageSetting::Path(ledger.clone());
    let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
    let prompt = m.tokenizer().unwrap().encode("And God said, Let there be light", true).unwrap();
    let run = |draft| {
        assert!(m.draft, "the container's MTP tier loads the draft layer");
        let req = GenerateRequest {
            draft_tokens: draft,
            draft_policy: strata_engine::DraftPolicy::Fixed,
            ..GenerateRequest::new(prompt.clone(), 40, SamplingParams::default())
        };
        common::generate_on(&mut m.engine(Some(3)).unwrap(), &req).unwrap()
    };
    let plain = run(0);
    let spec = run(3);
    assert_eq!(spec.tokens, plain.tokens);
    assert!(spec.stats.mtp.unwrap().accepted > 0);
    m.experts.as_ref().unwrap().end_turn().unwrap();
    let text = std::fs::read_to_string(&ledger).unwrap();
    let mtp_row: u64 = text
        .lines()
        .filter_map(|l| {
            let f: Vec<i64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (f[0] == 6).then_some(f[2] as u64)
        })
        .sum();
    assert!(mtp_row > 0, "the MTP layer's selections count in its ledger row: {text}");
}

/// Many requests drafting at once through the draft tier's small slab (a budget with
/// little to spare): every one is answered, with the tokens decoding without drafts
/// gives. A draft forward then carries many sequences' rows, whose experts outnumber the
/// tier's working bank.
#[test]
fn concurrent_drafting_requests_fit_a_small_draft_tier() {
    use strata_engine::serving::{BatchEngine, EngineOptions, ServeRequest, Update};
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/strata-tiny");
    let dir = tempfile::tempdir().unwrap();
    convert(
        &tiny,
        dir.path(),
        &ConvertOptions { experts: QuantKind::Bf16, mtp_experts: QuantKind::Int8Row },
        &mut |_, _| {},
    )
    .unwrap();
    let mut opts = options(Some(min_budget(dir.path(), 8) + (8 << 20)), 8);
    (opts.mtp, opts.require_mtp) = (true, true);
    opts.runtime.usage = UsageSetting::Off;
    let m = LoadedModel::open_with(dir.path(), &opts).unwrap();
    let tok = m.tokenizer().unwrap();
    let texts = ["And God said", "The quick brown fox", "def main():", "Once upon a time", "In the beginning"];
    let reqs: Vec<GenerateRequest> = (0..12)
        .map(|i| {
            let sampling = match i % 2 {
                0 => SamplingParams::default(),
                _ => SamplingParams { temperature: 0.9, top_p: 0.95, seed: i, ..Default::default() },
            };
            GenerateRequest {
                eos_token_ids: m.eos_token_ids.clone(),
                draft_tokens: 3,
                draft_policy: strata_engine::DraftPolicy::Fixed,
                ..GenerateRequest::new(tok.encode(texts[i as usize % 5], true).unwrap(), 24, sampling)
            }
        })
        .collect();
    let eopts = EngineOptions {
        max_batch: 12,
        kv_tokens: 12 * 64,
        context: 64,
        step_tokens: 48,
        prompt_cache_bytes: 0,
        kv_bytes_per_token: m.arch.kv_bytes_per_token(),
        draft_tokens: 3,
    };
    let mut engine = BatchEngine::new(m.model.as_ref(), m.tokenizer.as_ref(), eopts).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.submit(ServeRequest::new(r.clone())).unwrap()).collect();
    let mut done = std::collections::HashMap::new();
    let mut out = Vec::new();
    while !engine.is_idle() {
        engine.step(&mut out).unwrap();
        for (id, u) in out.drain(..) {
            if let Update::Done(r) = u {
                done.insert(id, r.unwrap_or_else(|e| panic!("request {id} failed: {e}")));
            }
        }
    }
    assert!(engine.counters().mtp_drafted > 0, "{:?}", engine.counters());
    for (id, r) in ids.iter().zip(&reqs) {
        let plain = common::reference(&m, r, m.context);
        assert_eq!(done[id].output.tokens, plain.tokens, "request {id}");
    }
}

/// gpt-oss's MXFP4 experts move into the container as they are: the container holds the
/// checkpoint's nibble and scale bytes (no widening), its output equals the checkpoint's
/// bit for bit, and `--budget` on the HF directory converts to MXFP4 on its own.
#[test]
fn gpt_oss_mxfp4_experts_stream_as_stored() {
    let src = fixture("gpt_oss/mxfp4-yarn");
    let dir = container("gpt_oss/mxfp4-yarn", QuantKind::Mxfp4);
    let store = WeightStore::open_dir(&src).unwrap();
    let stored: usize = store
        .names()
        .filter(|n| n.ends_with("_blocks") || n.ends_with("_scales"))
        .map(|n| store.get(n).unwrap().1.byte_len())
        .sum();
    let manifest = strata_storage::ExpertManifest::read(dir.path()).unwrap();
    let l = &manifest.tier("main").unwrap().layout;
    let held: usize = [&l.gate, &l.up, &l.down].iter().map(|m| m.payload_len + m.scales_len).sum();
    assert!([&l.gate, &l.up, &l.down].iter().all(|m| m.kind == QuantKind::Mxfp4));
    assert_eq!(held * 32, stored, "an expert's slot holds its stored bytes (4 layers of 8 experts)");
    let hf = run(&src, &options(None, 64));
    assert!(run(dir.path(), &options(None, 64)) == hf, "the MXFP4 container equals the checkpoint");
    assert_eq!(strata_engine::autoconvert::lossless_kind(&store), QuantKind::Mxfp4);
    // Re-encoded (int8 rows), the output moves but stays close.
    let int8 = run(container("gpt_oss/mxfp4-yarn", QuantKind::Int8Row).path(), &options(None, 64));
    assert!(int8 != hf);
}

//! A decode step in steady state allocates nothing: the session, the backend's scratch,
//! the samplers and the engine's buffers are all sized before the first steps.
//! (A global counting allocator; this file is its own test binary.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use strata_engine::serving::{BatchEngine, ServeRequest};
use strata_engine::{DraftPolicy, GenerateRequest, LoadedModel, SamplingParams};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The count is process-wide: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Decode steps of the product's loop (the serving engine, here a batch of one without a
/// tokenizer: text is the front end's) past the DSA top-k (the indexer scores and
/// selects) and across KV blocks, greedy and sampled (repetition penalty, top-p), one
/// step at a time and fed (picks fed to the next forward on the device), with and
/// without drafts (MTP).
#[test]
fn decode_steps_allocate_nothing() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    assert!(m.draft, "strata-tiny loads its draft layer");
    let prompt: Vec<u32> = (0..70).map(|i| (i * 97 % 8000) as u32 + 10).collect();
    let sampled =
        SamplingParams { temperature: 0.8, top_p: 0.9, repetition_penalty: 1.1, seed: 3, ..Default::default() };
    let drawn = SamplingParams { temperature: 0.8, top_p: 0.9, seed: 3, ..Default::default() };
    let cases = [
        ("greedy", SamplingParams::default(), false, 0),
        ("sampled", sampled.clone(), false, 0),
        ("greedy, fed", SamplingParams::default(), true, 0),
        ("sampled, fed", drawn, true, 0),
        ("greedy, drafts", SamplingParams::default(), false, 3),
        ("sampled, drafts", sampled, false, 3),
    ];
    for (what, params, fed, drafts) in cases {
        let mut engine = BatchEngine::new(m.model.as_ref(), None, m.engine_options(Some(drafts)).unwrap()).unwrap();
        engine.set_device_picks(Some(fed));
        let req = GenerateRequest {
            draft_tokens: drafts,
            draft_policy: DraftPolicy::Fixed,
            ..GenerateRequest::new(prompt.clone(), 60, params)
        };
        let mut req = ServeRequest::new(req);
        req.ignore_eos = true;
        let id = engine.submit(req).unwrap();
        let mut out = Vec::with_capacity(8);
        // Warm-up: the prompt, and the first steps, which may size scratch the prompt's
        // forwards did not use.
        while engine.generated(id).unwrap() < 8 {
            engine.step(&mut out).unwrap();
            out.clear();
        }
        let before = ALLOCS.load(Ordering::SeqCst);
        let mut steps = 0;
        while engine.generated(id).unwrap() < 40 {
            engine.step(&mut out).unwrap();
            assert!(out.is_empty(), "{what}: no text, no end: nothing to report");
            steps += 1;
        }
        let after = ALLOCS.load(Ordering::SeqCst);
        assert_eq!(after - before, 0, "{what}: {} allocations in {steps} decode steps", after - before);
        assert_eq!(engine.counters().fed_steps > 0, fed, "{what}: fed steps");
        assert_eq!(engine.counters().mtp_drafted > 0, drafts > 0, "{what}: drafts");
    }
}

/// The same of the other families' decoders (greedy, one step at a time): GQA with sinks,
/// biases and windows, experts with biases (gpt-oss, MXFP4), the DeltaNet's recurrent
/// state (Qwen3-Next), MLA without an indexer (DeepSeek-V3).
#[test]
fn other_families_decode_steps_allocate_nothing() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    for name in [
        "qwen3_moe/gqa-renorm",
        "minimax_m2/gqa-full",
        "deepseek_v3/yarn-groups",
        "gpt_oss/mxfp4-yarn",
        "qwen3_next/hybrid-f32",
    ] {
        let m = LoadedModel::open(&root.join(name)).unwrap();
        let mut engine = BatchEngine::new(m.model.as_ref(), None, m.engine_options(Some(0)).unwrap()).unwrap();
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 400) as u32 + 5).collect();
        let mut req = ServeRequest::new(GenerateRequest::new(prompt, 60, SamplingParams::default()));
        req.ignore_eos = true;
        let id = engine.submit(req).unwrap();
        let mut out = Vec::with_capacity(8);
        while engine.generated(id).unwrap() < 8 {
            engine.step(&mut out).unwrap();
            out.clear();
        }
        let before = ALLOCS.load(Ordering::SeqCst);
        while engine.generated(id).unwrap() < 40 {
            engine.step(&mut out).unwrap();
            assert!(out.is_empty(), "{name}: no text, no end: nothing to report");
        }
        let n = ALLOCS.load(Ordering::SeqCst) - before;
        assert_eq!(n, 0, "{name}: {n} allocations in 32 decode steps");
    }
}

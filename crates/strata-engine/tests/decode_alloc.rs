//! A decode step in steady state allocates nothing: the session, the backend's scratch,
//! the sampler and the generator's buffers are all sized before the first step.
//! (A global counting allocator; this file is its own test binary.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use strata_engine::{LoadedModel, Sampler, SamplingParams};

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

/// Decode steps past the DSA top-k (the indexer scores and selects) and across KV blocks,
/// greedy and sampled (repetition penalty, top-p), on one and on several threads.
#[test]
fn decode_steps_allocate_nothing() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let m = LoadedModel::open(&root.join("models/strata-tiny")).unwrap();
    let prompt: Vec<u32> = (0..70).map(|i| (i * 97 % 8000) as u32 + 10).collect();
    let sampled =
        SamplingParams { temperature: 0.8, top_p: 0.9, repetition_penalty: 1.1, seed: 3, ..Default::default() };
    for params in [SamplingParams::default(), sampled] {
        let mut gen = m.generator().unwrap();
        let mut sampler = Sampler::new(params.clone()).unwrap();
        gen.prefill(&prompt).unwrap();
        let mut next = gen.sample(&mut sampler);
        // Warm-up: the first steps may size scratch that prefill did not use.
        for _ in 0..4 {
            gen.step(next).unwrap();
            next = gen.sample(&mut sampler);
        }
        let before = ALLOCS.load(Ordering::SeqCst);
        for _ in 0..40 {
            gen.step(next).unwrap();
            next = gen.sample(&mut sampler);
        }
        let after = ALLOCS.load(Ordering::SeqCst);
        assert_eq!(after - before, 0, "{params:?}: {} allocations in 40 decode steps", after - before);
    }
}

//! A persistent pool of compute threads, sized once, that runs one parallel region at a
//! time: the caller becomes thread 0 and the workers 1..n run the same closure with
//! their own id (SPMD), meeting at [`Ctx::barrier`] between the stages of a fused op.
//!
//! Why not rayon: a decode step of a small model is ~100 short stages; a rayon fork-join
//! costs ~16 us (wake-ups through the OS), a spinning epoch dispatch and a counter barrier
//! cost well under 1 us, and in steady state they make no system call. Workers spin
//! between regions and park (futex) only after [`IDLE_PARK`] without work, so an idle
//! process costs nothing.
//!
//! The pool is sized from the CPU affinity mask (so `taskset` is honoured), or
//! `STRATA_THREADS`, or [`set_global_threads`] before first use. Regions from different
//! caller threads are serialised by a lock (a region is a whole fused op, so sessions on
//! several threads interleave op by op).

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next region before it parks.
pub const IDLE_PARK: Duration = Duration::from_millis(2);
/// Spins before a waiter starts yielding its core (a waiter that yields makes a system
/// call; in steady state stages are short enough that nobody gets there).
const SPINS_BEFORE_YIELD: u32 = 1 << 14;

type Job = dyn Fn(&Ctx) + Sync;

struct Shared {
    n: usize,
    /// Incremented once per region; workers run the job of each new epoch once.
    epoch: AtomicU64,
    /// The current region's closure (valid while `pending > 0` for that epoch).
    job: UnsafeCell<Option<*const Job>>,
    /// Workers that have not finished the current region.
    pending: AtomicUsize,
    bar_count: AtomicUsize,
    bar_gen: AtomicUsize,
    /// Set when a thread panicked inside a region: the others leave their barriers.
    poisoned: AtomicBool,
    sleeping: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

// SAFETY: `job` is written only by the region owner before publishing a new epoch
// (Release) and read by workers after observing it (Acquire); the pointee outlives the
// region because `run` waits for every worker before returning.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// One thread's view of a parallel region.
pub struct Ctx<'a> {
    /// This thread's index, `0..n` (0 is the caller of [`ThreadPool::run`]).
    pub id: usize,
    /// Threads in the region.
    pub n: usize,
    shared: &'a Shared,
}

impl Ctx<'_> {
    /// Waits until every thread of the region has reached this barrier.
    pub fn barrier(&self) {
        let s = self.shared;
        if self.n == 1 {
            return;
        }
        let gen = s.bar_gen.load(Ordering::Acquire);
        if s.bar_count.fetch_add(1, Ordering::AcqRel) == self.n - 1 {
            s.bar_count.store(0, Ordering::Relaxed);
            s.bar_gen.fetch_add(1, Ordering::Release);
            return;
        }
        spin_until(|| s.bar_gen.load(Ordering::Acquire) != gen || s.poisoned.load(Ordering::Relaxed));
        if s.poisoned.load(Ordering::Relaxed) {
            panic!("a pool thread panicked in this region");
        }
    }

    /// This thread's share of `0..len`, contiguous and balanced (may be empty).
    pub fn split(&self, len: usize) -> Range<usize> {
        split_range(len, self.n, self.id, 1)
    }

    /// Like [`Ctx::split`] with boundaries on multiples of `align` (except `len`).
    pub fn split_aligned(&self, len: usize, align: usize) -> Range<usize> {
        split_range(len, self.n, self.id, align)
    }
}

/// Part `id` of `n` of `0..len`, boundaries rounded to `align`.
pub fn split_range(len: usize, n: usize, id: usize, align: usize) -> Range<usize> {
    let units = len.div_ceil(align.max(1));
    let (base, extra) = (units / n, units % n);
    let start = id * base + id.min(extra);
    let end = start + base + usize::from(id < extra);
    (start * align).min(len)..(end * align).min(len)
}

fn spin_until(mut done: impl FnMut() -> bool) {
    let mut spins = 0u32;
    while !done() {
        if spins < SPINS_BEFORE_YIELD {
            std::hint::spin_loop();
            spins += 1;
        } else {
            std::thread::yield_now();
        }
    }
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    run_lock: Mutex<()>,
    handles: Vec<JoinHandle<()>>,
}

impl ThreadPool {
    /// A pool of `threads` threads in all (the caller counts as one; `threads - 1`
    /// workers are started).
    pub fn new(threads: usize) -> Self {
        let n = threads.max(1);
        let shared = Arc::new(Shared {
            n,
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            bar_count: AtomicUsize::new(0),
            bar_gen: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        let handles = (1..n)
            .map(|id| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("strata-pool-{id}"))
                    .spawn(move || worker(s, id))
                    .expect("spawn a pool thread")
            })
            .collect();
        Self { shared, run_lock: Mutex::new(()), handles }
    }

    pub fn threads(&self) -> usize {
        self.shared.n
    }

    /// Runs `f` on every thread of the pool (the caller as thread 0) and returns when all
    /// have finished. A panic in any thread is re-raised here after all have stopped.
    pub fn run(&self, f: &(dyn Fn(&Ctx) + Sync)) {
        let s = &*self.shared;
        if s.n == 1 {
            f(&Ctx { id: 0, n: 1, shared: s });
            return;
        }
        let _region = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: no worker reads `job` until the epoch below is published, and the
        // previous region's workers are all done (pending was 0 when it returned).
        unsafe {
            let erased: *const Job = std::mem::transmute::<*const (dyn Fn(&Ctx) + Sync + '_), *const Job>(f);
            *s.job.get() = Some(erased);
        }
        s.poisoned.store(false, Ordering::Relaxed);
        s.pending.store(s.n - 1, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _g = s.park.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&Ctx { id: 0, n: s.n, shared: s })));
        if mine.is_err() {
            s.poisoned.store(true, Ordering::Relaxed);
        }
        spin_until(|| s.pending.load(Ordering::Acquire) == 0);
        // SAFETY: every worker is done with this region.
        unsafe { *s.job.get() = None };
        s.bar_count.store(0, Ordering::Relaxed);
        let poisoned = s.poisoned.swap(false, Ordering::Relaxed);
        match mine {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) if poisoned => panic!("a pool thread panicked"),
            Ok(()) => {}
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = self.shared.park.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: Arc<Shared>, id: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin, then park.
        let idle = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 && idle.elapsed() > IDLE_PARK {
                let g = s.park.lock().unwrap_or_else(|e| e.into_inner());
                s.sleeping.fetch_add(1, Ordering::SeqCst);
                let mut g = g;
                while s.epoch.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                s.sleeping.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            std::hint::spin_loop();
        };
        seen = epoch;
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: published before the epoch (see `run`); valid until pending hits 0.
        let job = unsafe { (*s.job.get()).expect("a region's job") };
        let ctx = Ctx { id, n: s.n, shared: &s };
        // SAFETY: the closure lives on the stack of `run`, which waits for us.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(&ctx) }));
        if r.is_err() {
            s.poisoned.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A one-thread region context (barriers are no-ops), for ops too small to wake a pool.
pub fn single_ctx() -> Ctx<'static> {
    static ALONE: OnceLock<Shared> = OnceLock::new();
    let shared = ALONE.get_or_init(|| Shared {
        n: 1,
        epoch: AtomicU64::new(0),
        job: UnsafeCell::new(None),
        pending: AtomicUsize::new(0),
        bar_count: AtomicUsize::new(0),
        bar_gen: AtomicUsize::new(0),
        poisoned: AtomicBool::new(false),
        sleeping: AtomicUsize::new(0),
        park: Mutex::new(()),
        wake: Condvar::new(),
        shutdown: AtomicBool::new(false),
    });
    Ctx { id: 0, n: 1, shared }
}

static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();
static REQUESTED: AtomicUsize = AtomicUsize::new(0);

/// Threads the global pool will have: [`set_global_threads`], else `STRATA_THREADS`,
/// else the CPUs this process may run on (its affinity mask).
pub fn default_threads() -> usize {
    let requested = REQUESTED.load(Ordering::Relaxed);
    if requested > 0 {
        return requested;
    }
    if let Some(n) = std::env::var("STRATA_THREADS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Sets the global pool's size; an error once the pool exists with another size.
pub fn set_global_threads(threads: usize) -> Result<(), String> {
    if threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    REQUESTED.store(threads, Ordering::Relaxed);
    match GLOBAL.get() {
        Some(p) if p.threads() != threads => {
            Err(format!("the compute pool already runs {} threads; cannot resize to {threads}", p.threads()))
        }
        _ => Ok(()),
    }
}

/// The process-wide compute pool (created on first use).
pub fn global() -> &'static ThreadPool {
    GLOBAL.get_or_init(|| ThreadPool::new(default_threads()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_once_and_barriers_order_stages() {
        for n in [1, 2, 3, 5] {
            let pool = ThreadPool::new(n);
            let hits = AtomicUsize::new(0);
            let stage = AtomicUsize::new(0);
            for _ in 0..200 {
                hits.store(0, Ordering::SeqCst);
                stage.store(0, Ordering::SeqCst);
                pool.run(&|c| {
                    assert_eq!(c.n, n);
                    hits.fetch_add(1, Ordering::SeqCst);
                    c.barrier();
                    // Everyone incremented before anyone passes the barrier.
                    assert_eq!(hits.load(Ordering::SeqCst), n);
                    c.barrier();
                    stage.fetch_add(1, Ordering::SeqCst);
                });
                assert_eq!(stage.load(Ordering::SeqCst), n);
            }
        }
    }

    #[test]
    fn split_covers_the_range_in_order() {
        for len in [0usize, 1, 7, 64, 1000] {
            for n in 1..6 {
                for align in [1usize, 8, 16] {
                    let parts: Vec<_> = (0..n).map(|id| split_range(len, n, id, align)).collect();
                    let mut next = 0;
                    for p in &parts {
                        assert_eq!(p.start, next.min(len));
                        assert!(p.start % align == 0 || p.start == len);
                        next = p.end;
                    }
                    assert_eq!(next, len);
                }
            }
        }
    }

    #[test]
    fn a_panicking_thread_is_reported_and_the_pool_survives() {
        let pool = ThreadPool::new(3);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|c| {
                if c.id == 2 {
                    panic!("boom");
                }
                c.barrier();
            })
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(count.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn idle_workers_park_and_wake() {
        let pool = ThreadPool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::SeqCst);
        });
        std::thread::sleep(IDLE_PARK * 3);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(count.load(Ordering::SeqCst), 4);
    }
}

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
//! The pool is sized from the CPU affinity mask (so `taskset` is honoured), or by
//! [`set_global_threads`] before first use. Regions from different
//! caller threads are serialised by a lock (a region is a whole fused op, so sessions on
//! several threads interleave op by op).

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins for the next region before it sleeps.
pub const IDLE_PARK: Duration = Duration::from_millis(1);
/// How long a thread spins at a barrier or for a region's end before it sleeps. Stages
/// in steady state end well within it, so a step makes no system call; when another
/// process holds a core, sleeping (instead of yielding, which hands that process the
/// core for a whole time slice) bounds the cost of a late thread to its wake-up.
const SPIN: Duration = Duration::from_micros(250);

/// Sleeping on a 32-bit word until it changes (Linux futex; elsewhere, yielding).
mod futex {
    use std::sync::atomic::AtomicU32;

    #[cfg(target_os = "linux")]
    pub fn wait(word: &AtomicU32, expected: u32) {
        // SAFETY: a private futex wait on a live word; returns on change, wake or signal.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                expected,
                std::ptr::null::<libc::timespec>(),
            );
        }
    }

    #[cfg(target_os = "linux")]
    pub fn wake_all(word: &AtomicU32) {
        // SAFETY: a private futex wake on a live word.
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX);
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub fn wait(_word: &AtomicU32, _expected: u32) {
        std::thread::yield_now();
    }

    #[cfg(not(target_os = "linux"))]
    pub fn wake_all(_word: &AtomicU32) {}
}

/// Waits until `word` differs from `seen` (or `stop()`): spins for `spin`, then sleeps,
/// counted in `sleepers` so wakers make the system call only when someone sleeps.
fn wait_change(word: &AtomicU32, seen: u32, sleepers: &AtomicU32, spin: Duration, stop: impl Fn() -> bool) -> u32 {
    let t0 = Instant::now();
    let mut i = 0u32;
    loop {
        let v = word.load(Ordering::Acquire);
        if v != seen || stop() {
            return v;
        }
        i = i.wrapping_add(1);
        if i.is_multiple_of(64) && t0.elapsed() > spin {
            break;
        }
        std::hint::spin_loop();
    }
    sleepers.fetch_add(1, Ordering::SeqCst);
    let v = loop {
        let v = word.load(Ordering::SeqCst);
        if v != seen || stop() {
            break v;
        }
        futex::wait(word, seen);
    };
    sleepers.fetch_sub(1, Ordering::SeqCst);
    v
}

/// Wakes the sleepers of `word` (after changing it), if there are any.
fn wake(word: &AtomicU32, sleepers: &AtomicU32) {
    if sleepers.load(Ordering::SeqCst) > 0 {
        futex::wake_all(word);
    }
}

type Job = dyn Fn(&Ctx) + Sync;

struct Shared {
    n: usize,
    /// Incremented once per region; workers run the job of each new epoch once.
    epoch: AtomicU32,
    epoch_sleepers: AtomicU32,
    /// The epoch a region is published under (high 32 bits) and the threads taking part
    /// in it (low 32; workers with a higher id sit it out). Written before that epoch is,
    /// so a worker that saw an epoch can tell whether the region it reads is that one: a
    /// worker waking late must not take a later region's thread count for the one it saw.
    region: AtomicU64,
    /// The current region's closure (valid while `pending > 0` for that epoch).
    job: UnsafeCell<Option<*const Job>>,
    /// Workers that have not finished the current region.
    pending: AtomicU32,
    pending_sleepers: AtomicU32,
    bar_count: AtomicU32,
    bar_gen: AtomicU32,
    bar_sleepers: AtomicU32,
    /// Set when a thread panicked inside a region: the others leave their barriers.
    poisoned: AtomicBool,
    shutdown: AtomicBool,
}

impl Shared {
    fn new(n: usize, active: usize) -> Self {
        Self {
            n,
            epoch: AtomicU32::new(0),
            epoch_sleepers: AtomicU32::new(0),
            region: AtomicU64::new(active as u64),
            job: UnsafeCell::new(None),
            pending: AtomicU32::new(0),
            pending_sleepers: AtomicU32::new(0),
            bar_count: AtomicU32::new(0),
            bar_gen: AtomicU32::new(0),
            bar_sleepers: AtomicU32::new(0),
            poisoned: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        }
    }

    /// Marks the region failed and releases everyone waiting in it.
    fn poison(&self) {
        self.poisoned.store(true, Ordering::SeqCst);
        self.bar_gen.fetch_add(1, Ordering::SeqCst);
        futex::wake_all(&self.bar_gen);
    }
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
        if s.bar_count.fetch_add(1, Ordering::AcqRel) as usize == self.n - 1 {
            s.bar_count.store(0, Ordering::Relaxed);
            s.bar_gen.fetch_add(1, Ordering::SeqCst);
            wake(&s.bar_gen, &s.bar_sleepers);
            return;
        }
        wait_change(&s.bar_gen, gen, &s.bar_sleepers, SPIN, || s.poisoned.load(Ordering::Relaxed));
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
        let shared = Arc::new(Shared::new(n, n));
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
        self.run_on(self.shared.n, f)
    }

    /// Runs `f` on the first `threads` threads of the pool only (at least 1, at most the
    /// pool's size): small ops are not worth a barrier across every core.
    pub fn run_on(&self, threads: usize, f: &(dyn Fn(&Ctx) + Sync)) {
        let s = &*self.shared;
        let n = threads.clamp(1, s.n);
        if n == 1 {
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
        s.pending.store((n - 1) as u32, Ordering::Relaxed);
        // Only the region owner (holding `run_lock`) moves the epoch while workers run.
        let next = s.epoch.load(Ordering::SeqCst).wrapping_add(1);
        s.region.store(((next as u64) << 32) | n as u64, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        wake(&s.epoch, &s.epoch_sleepers);
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&Ctx { id: 0, n, shared: s })));
        if mine.is_err() {
            s.poison();
        }
        loop {
            let left = s.pending.load(Ordering::Acquire);
            if left == 0 {
                break;
            }
            wait_change(&s.pending, left, &s.pending_sleepers, SPIN, || false);
        }
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
        futex::wake_all(&self.shared.epoch);
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: Arc<Shared>, id: usize) {
    // The epoch the pool was made with (a region may be published before this thread
    // first looks).
    let mut seen = 0;
    loop {
        seen = wait_change(&s.epoch, seen, &s.epoch_sleepers, IDLE_PARK, || false);
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let region = s.region.load(Ordering::SeqCst);
        if (region >> 32) as u32 != seen {
            // The region of the epoch we saw has ended and the next is being published:
            // wait for its epoch (it cannot have needed us, or it would not have ended).
            continue;
        }
        let n = (region & u32::MAX as u64) as usize;
        if id >= n {
            continue; // not in this region
        }
        // SAFETY: published before the epoch (see `run`); valid until pending hits 0.
        let job = unsafe { (*s.job.get()).expect("a region's job") };
        let ctx = Ctx { id, n, shared: &s };
        // SAFETY: the closure lives on the stack of `run`, which waits for us.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(&ctx) }));
        if r.is_err() {
            s.poison();
        }
        if s.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            wake(&s.pending, &s.pending_sleepers);
        }
    }
}

/// A one-thread region context (barriers are no-ops), for ops too small to wake a pool.
pub fn single_ctx() -> Ctx<'static> {
    static ALONE: OnceLock<Shared> = OnceLock::new();
    Ctx { id: 0, n: 1, shared: ALONE.get_or_init(|| Shared::new(1, 1)) }
}

static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();
static REQUESTED: AtomicUsize = AtomicUsize::new(0);

/// Threads the global pool will have: [`set_global_threads`] (`--threads`), else the CPUs
/// this process may run on (its affinity mask).
pub fn default_threads() -> usize {
    let requested = REQUESTED.load(Ordering::Relaxed);
    if requested > 0 {
        return requested;
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

    /// Regions of alternating sizes, back to back, on more threads than cores: each runs
    /// its job on exactly its threads, once each. (A worker that woke late once took the
    /// next region's thread count for the region it saw, ran a job twice and found none.)
    #[test]
    fn alternating_region_sizes_run_each_job_exactly_on_its_threads() {
        let pool = ThreadPool::new(12);
        let ran = AtomicUsize::new(0);
        let mut want = 0;
        for i in 0..3_000usize {
            let n = [12, 2, 7, 1, 12, 3][i % 6];
            let region = i;
            let seen = [(); 12].map(|_| AtomicUsize::new(usize::MAX));
            pool.run_on(n, &|c| {
                assert_eq!(c.n, n);
                let prev = seen[c.id].swap(region, Ordering::SeqCst);
                assert_ne!(prev, region, "thread {} ran region {region} twice", c.id);
                ran.fetch_add(1, Ordering::SeqCst);
            });
            want += n;
            assert_eq!(ran.load(Ordering::SeqCst), want, "region {region} of {n} threads");
        }
    }

    #[test]
    fn regions_on_fewer_threads_leave_the_others_out() {
        let pool = ThreadPool::new(4);
        for n in [1usize, 2, 3, 4, 9] {
            let hits = AtomicUsize::new(0);
            pool.run_on(n, &|c| {
                assert_eq!(c.n, n.min(4));
                assert!(c.id < c.n);
                hits.fetch_add(1, Ordering::SeqCst);
                c.barrier();
                assert_eq!(hits.load(Ordering::SeqCst), n.min(4));
            });
            assert_eq!(hits.load(Ordering::SeqCst), n.min(4));
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

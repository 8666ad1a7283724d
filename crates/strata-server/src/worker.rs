//! The generation worker: one thread that owns the model's session through the serving
//! engine (strata_engine::serving) and runs every admitted request in one batch, a step
//! at a time. Requests come over a channel and start at the next step; text deltas go
//! back over each request's own channel; a closed channel (the client went away)
//! cancels the request at the next step.

use crate::error::ApiError;
use crate::metrics::Metrics;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata_engine::serving::{BatchEngine, EngineOptions, ServeRequest};
use strata_engine::LoadedModel;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

pub use strata_engine::serving::{Finished, Update as Event};

struct Job {
    req: ServeRequest,
    events: UnboundedSender<Event>,
    accepted: Instant,
}

pub struct Worker {
    tx: Sender<Job>,
    capacity: usize,
    max_batch: usize,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
}

const SHUTTING_DOWN: &str = "the server is shutting down";

/// The longest the expert runtime goes without a turn boundary while requests keep
/// the batch busy.
const TURN_EVERY: Duration = Duration::from_secs(2);

impl Worker {
    /// Starts the worker thread: up to `opts.max_batch` requests run at once and
    /// `capacity` more may wait.
    /// `remember`: the engine keeps what it measures about speculating in the model
    /// directory and starts from what was kept there (`strata serve`; tests leave it off).
    pub fn start(
        model: Arc<LoadedModel>,
        capacity: usize,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
        remember: bool,
    ) -> Self {
        let (tx, rx) = channel::<Job>();
        let m = metrics.clone();
        let shutdown = Arc::new(AtomicBool::new(false));
        let stop = shutdown.clone();
        std::thread::Builder::new()
            .name("strata-generate".into())
            .spawn(move || run(model, rx, opts, m, stop, remember))
            .expect("spawn the generation thread");
        Self { tx, capacity, max_batch: opts.max_batch, metrics, shutdown }
    }

    /// Server shutdown: running generations stop at the next step (finishing normally:
    /// their answers and final events go out); queued ones are refused.
    pub fn shut_down(&self) {
        // (An idle worker has nothing to stop; it refuses what arrives next.)
        self.shutdown.store(true, Ordering::SeqCst);
    }

    /// Requests that may wait beyond the running batch.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Queues a generation; its events arrive on the returned channel. Beyond the batch
    /// and the queue the answer is a 429 with `Retry-After`.
    pub fn submit(&self, req: ServeRequest) -> Result<UnboundedReceiver<Event>, ApiError> {
        self.submit_many(vec![req]).map(|mut v| v.remove(0))
    }

    /// Queues several generations (the choices of one request) as a whole, or none.
    pub fn submit_many(&self, reqs: Vec<ServeRequest>) -> Result<Vec<UnboundedReceiver<Event>>, ApiError> {
        let n = reqs.len();
        let limit = self.capacity + self.max_batch;
        let m = &self.metrics;
        // Count before sending, so the worker never sees a count below zero.
        let before = m.inflight.fetch_add(n, Ordering::SeqCst);
        if before + n > limit {
            m.inflight.fetch_sub(n, Ordering::SeqCst);
            m.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::queue_full(self.capacity));
        }
        let mut out = Vec::with_capacity(n);
        for req in reqs {
            let (events, rx) = unbounded_channel();
            if self.tx.send(Job { req, events, accepted: Instant::now() }).is_err() {
                m.inflight.fetch_sub(n - out.len(), Ordering::SeqCst);
                return Err(ApiError::internal("the generation worker has stopped"));
            }
            out.push(rx);
        }
        // The gauge at once (the worker refreshes it after each step).
        let depth = m.inflight.load(Ordering::SeqCst).saturating_sub(m.active.load(Ordering::SeqCst));
        m.queue_depth.store(depth, Ordering::SeqCst);
        Ok(out)
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

struct Live {
    events: UnboundedSender<Event>,
    accepted: Instant,
}

fn run(
    model: Arc<LoadedModel>,
    rx: Receiver<Job>,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
    remember: bool,
) {
    let mut engine = match BatchEngine::new(model.model.as_ref(), model.tokenizer.as_ref(), opts) {
        Ok(mut e) => {
            if remember {
                e.remember_speculation(&model.dir);
            }
            e
        }
        Err(e) => {
            let msg = format!("the serving engine could not start: {e:#}");
            eprintln!("error: {msg}");
            while let Ok(job) = rx.recv() {
                let _ = job.events.send(Event::Done(Err(msg.clone())));
                metrics.inflight.fetch_sub(1, Ordering::SeqCst);
            }
            return;
        }
    };
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut updates = Vec::new();
    let mut last_turn = Instant::now();
    let mut turn_pending = false;
    loop {
        // New requests join at the next step; with nothing to do, wait for one.
        let mut next = if engine.is_idle() {
            match rx.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        } else {
            None
        };
        let stopping = shutdown.load(Ordering::SeqCst);
        while let Some(job) = next.take().or_else(|| rx.try_recv().ok()) {
            let Job { req, events, accepted } = job;
            if stopping {
                metrics.inflight.fetch_sub(1, Ordering::SeqCst);
                let _ = events.send(Event::Done(Err(SHUTTING_DOWN.into())));
                continue;
            }
            match engine.submit(req) {
                Ok(id) => {
                    live.insert(id, Live { events, accepted });
                }
                Err(e) => {
                    metrics.generation_errors.fetch_add(1, Ordering::Relaxed);
                    metrics.inflight.fetch_sub(1, Ordering::SeqCst);
                    let _ = events.send(Event::Done(Err(format!("{e:#}"))));
                }
            }
        }
        // Clients that went away.
        let gone: Vec<u64> = live.iter().filter(|(_, l)| l.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            let l = live.remove(&id).expect("listed above");
            metrics.inflight.fetch_sub(1, Ordering::SeqCst);
            match engine.cancel(id) {
                Some(f) => {
                    metrics.record_generation(&f.output.stats, f.queue_wait_s, l.accepted.elapsed().as_secs_f64())
                }
                None => {
                    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let result = match stopping {
            true => {
                engine.shut_down(SHUTTING_DOWN, &mut updates);
                Ok(Ok(()))
            }
            false => std::panic::catch_unwind(AssertUnwindSafe(|| engine.step(&mut updates))),
        };
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = engine.reset(&format!("generation failed: {e:#}"), &mut updates);
            }
            Err(panic) => {
                // The session may be half-updated: fail what runs and start afresh.
                let msg = format!("generation failed: {}", panic_message(panic.as_ref()));
                if let Err(e) = engine.reset(&msg, &mut updates) {
                    eprintln!("error: the serving engine could not restart: {e:#}");
                }
            }
        }
        // The running count before any client hears of this step: a client that has seen
        // its first token and then reads the gauges must see itself running, not queued.
        let c = engine.counters();
        metrics.active.store(c.running, Ordering::SeqCst);
        for (id, u) in updates.drain(..) {
            let Event::Done(r) = &u else {
                if let Some(l) = live.get(&id) {
                    let _ = l.events.send(u);
                }
                continue;
            };
            let Some(l) = live.remove(&id) else { continue };
            metrics.inflight.fetch_sub(1, Ordering::SeqCst);
            turn_pending = true;
            match r {
                Ok(f) => metrics.record_generation(&f.output.stats, f.queue_wait_s, l.accepted.elapsed().as_secs_f64()),
                Err(_) => {
                    metrics.generation_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            let _ = l.events.send(u);
        }
        metrics.queue_depth.store(metrics.inflight.load(Ordering::SeqCst).saturating_sub(c.running), Ordering::SeqCst);
        *metrics.engine.lock().unwrap() = c;
        // The expert runtime's turn boundary (repins, ledger flush, pressure correction):
        // when the batch empties after finished requests, or every TURN_EVERY while busy.
        if turn_pending && (engine.is_idle() || last_turn.elapsed() >= TURN_EVERY) {
            turn_pending = false;
            last_turn = Instant::now();
            let tiers = [(&model.experts, false), (&model.draft_experts, true)];
            for (experts, draft) in tiers.into_iter().filter_map(|(e, d)| e.as_ref().map(|e| (e, d))) {
                match std::panic::catch_unwind(AssertUnwindSafe(|| experts.end_turn())) {
                    Ok(Ok(report)) if draft => metrics.record_draft_experts(&report),
                    Ok(Ok(report)) => metrics.record_experts(&report),
                    Ok(Err(e)) => eprintln!("warning: expert runtime: end of turn: {e:#}"),
                    Err(_) => eprintln!("warning: expert runtime: end of turn panicked"),
                }
            }
        }
    }
}

//! The generation worker: one thread that owns the model's session and runs one
//! generation at a time, fed by a bounded queue. Text deltas go back to the request over
//! a channel; a closed channel (the client went away) cancels the generation.

use crate::error::ApiError;
use crate::metrics::Metrics;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;
use strata_engine::{FinishReason, GenerateRequest, GenerationOutput, LoadedModel};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// A finished generation, with the stop string that ended it (if one did).
#[derive(Clone, Debug)]
pub struct Finished {
    pub output: GenerationOutput,
    pub stop_sequence: Option<String>,
}

#[derive(Debug)]
// One `Done` per request, moved once through a channel: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Event {
    Delta(String),
    Done(Result<Finished, String>),
}

struct Job {
    req: GenerateRequest,
    events: UnboundedSender<Event>,
    accepted: Instant,
}

pub struct Worker {
    tx: SyncSender<Job>,
    capacity: usize,
    metrics: Arc<Metrics>,
    shutdown: Arc<AtomicBool>,
}

impl Worker {
    /// Starts the worker thread; `capacity` requests may wait while one runs.
    pub fn start(model: Arc<LoadedModel>, capacity: usize, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = sync_channel::<Job>(capacity);
        let m = metrics.clone();
        let shutdown = Arc::new(AtomicBool::new(false));
        let stop = shutdown.clone();
        std::thread::Builder::new()
            .name("strata-generate".into())
            .spawn(move || run(model, rx, m, stop))
            .expect("spawn the generation thread");
        Self { tx, capacity, metrics, shutdown }
    }

    /// Server shutdown: the running generation stops at its next token (finishing
    /// normally: its answer and final events go out); queued ones are refused.
    pub fn shut_down(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Queues a generation; its events arrive on the returned channel. A full queue is
    /// a 429 with `Retry-After`.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, ApiError> {
        let (events, rx) = unbounded_channel();
        let job = Job { req, events, accepted: Instant::now() };
        // Count before sending, so the worker never sees a depth below zero.
        self.metrics.queue_depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                match e {
                    TrySendError::Full(_) => {
                        self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
                        Err(ApiError::queue_full(self.capacity))
                    }
                    TrySendError::Disconnected(_) => Err(ApiError::internal("the generation worker has stopped")),
                }
            }
        }
    }
}

/// The stop string that ended `out`, found by decoding the generated tokens in full.
fn matched_stop(model: &LoadedModel, req: &GenerateRequest, out: &GenerationOutput) -> Option<String> {
    if out.finish_reason != FinishReason::Stop || req.stop_strings.is_empty() {
        return None;
    }
    let full = model.tokenizer.as_ref()?.decode(&out.tokens, req.skip_special_tokens).ok()?;
    let tail = full.get(out.text.len()..)?;
    req.stop_strings.iter().find(|s| tail.starts_with(s.as_str())).cloned()
}

fn run(model: Arc<LoadedModel>, rx: Receiver<Job>, metrics: Arc<Metrics>, shutdown: Arc<AtomicBool>) {
    let tok = model.tokenizer.as_ref();
    let mut gen = None;
    while let Ok(job) = rx.recv() {
        metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
        if job.events.is_closed() {
            // The client left while waiting.
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if shutdown.load(Ordering::SeqCst) {
            let _ = job.events.send(Event::Done(Err("the server is shutting down".into())));
            continue;
        }
        let started = Instant::now();
        let wait = started.duration_since(job.accepted).as_secs_f64();
        metrics.active.store(1, Ordering::SeqCst);
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if gen.is_none() {
                gen = Some(model.generator()?);
            }
            let events = &job.events;
            gen.as_mut().unwrap().generate(tok, &job.req, &mut |delta: &str| {
                events.send(Event::Delta(delta.to_string())).is_ok() && !shutdown.load(Ordering::SeqCst)
            })
        }));
        metrics.active.store(0, Ordering::SeqCst);
        let done = match result {
            Ok(Ok(output)) => {
                let total = job.accepted.elapsed().as_secs_f64();
                metrics.record_generation(&output.stats, wait, total);
                let stop_sequence = matched_stop(&model, &job.req, &output);
                Ok(Finished { output, stop_sequence })
            }
            Ok(Err(e)) => {
                metrics.generation_errors.fetch_add(1, Ordering::Relaxed);
                Err(format!("generation failed: {e:#}"))
            }
            Err(panic) => {
                // The session may be half-updated: start a fresh one next time.
                gen = None;
                metrics.generation_errors.fetch_add(1, Ordering::Relaxed);
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(format!("generation failed: {msg}"))
            }
        };
        let _ = job.events.send(Event::Done(done));
        // The expert runtime's turn boundary (repins, ledger flush, pressure correction),
        // after the answer is on its way and before the next generation.
        if let Some(experts) = &model.experts {
            match std::panic::catch_unwind(AssertUnwindSafe(|| experts.end_turn())) {
                Ok(Ok(report)) => metrics.record_experts(&report),
                Ok(Err(e)) => eprintln!("warning: expert runtime: end of turn: {e:#}"),
                Err(_) => eprintln!("warning: expert runtime: end of turn panicked"),
            }
        }
    }
}

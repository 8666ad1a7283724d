//! Per-op time of a backend, for `strata-bench decode --profile`: off by default (one
//! relaxed load per op), process-wide counters when on.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The ops a forward is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Embed,
    Norm,
    Projections,
    Rope,
    MlaPrepare,
    MlaAbsorb,
    DsaSelect,
    MlaAttend,
    Route,
    Experts,
    Combine,
    Other,
}

pub const OPS: [Op; 12] = [
    Op::Embed,
    Op::Norm,
    Op::Projections,
    Op::Rope,
    Op::MlaPrepare,
    Op::MlaAbsorb,
    Op::DsaSelect,
    Op::MlaAttend,
    Op::Route,
    Op::Experts,
    Op::Combine,
    Op::Other,
];

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::Norm => "rms_norm",
            Op::Projections => "projections (norm-fed linears, o_proj, lm_head)",
            Op::Rope => "rope tables",
            Op::MlaPrepare => "mla prepare (norms, rope, cache write)",
            Op::MlaAbsorb => "mla absorb (q over the latent)",
            Op::DsaSelect => "dsa indexer (keys, scores, top-k)",
            Op::MlaAttend => "mla attend (scores, softmax, values, W_uv)",
            Op::Route => "router (logits, noaux_tc top-k)",
            Op::Experts => "experts (routed + shared, dense mlp)",
            Op::Combine => "moe combine, residual adds",
            Op::Other => "other",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 12] = [const { AtomicU64::new(0) }; 12];
static CALLS: [AtomicU64; 12] = [const { AtomicU64::new(0) }; 12];

/// Turns per-op timing on or off (and clears the counters).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
    for i in 0..OPS.len() {
        NANOS[i].store(0, Ordering::Relaxed);
        CALLS[i].store(0, Ordering::Relaxed);
    }
}

/// Whether per-op timing is on (a device backend then waits for each op, so the timers
/// hold device time).
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// (op, seconds, calls) since `enable`.
pub fn report() -> Vec<(Op, f64, u64)> {
    OPS.iter()
        .enumerate()
        .map(|(i, &op)| (op, NANOS[i].load(Ordering::Relaxed) as f64 * 1e-9, CALLS[i].load(Ordering::Relaxed)))
        .collect()
}

/// Times the scope it lives in when profiling is on.
pub struct Timer(Option<(usize, Instant)>);

impl Timer {
    #[inline]
    pub fn start(op: Op) -> Self {
        if ON.load(Ordering::Relaxed) {
            Self(Some((OPS.iter().position(|&o| o == op).unwrap(), Instant::now())))
        } else {
            Self(None)
        }
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((i, t)) = self.0 {
            NANOS[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

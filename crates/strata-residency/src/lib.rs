//! Expert residency policy for streamed Mixture-of-Experts weights.
//!
//! Pure policy, no tensors and no I/O except the usage-ledger file. The runtime
//! (strata-engine) composes these pieces with the I/O pool and the slab:
//!
//! - [`plan()`]: how many slots a byte budget affords, refusing impossible budgets with
//!   every number, plus the `fit` report and the `--budget` size parser.
//! - [`SlotTable`]: which expert lives in which slab slot; roles, phases, generation
//!   tags, LRU victims, role-swap promotion, pins, pressure decommit.
//! - [`UsageLedger`]: the persistent `.coli_usage` selection counts (C-engine text
//!   format v1), session heat and the LFRU score.
//! - [`policy`]: auto-pin planning and live-repin selection.
//! - [`batch_union`]: one forward's routes deduplicated in stable order.
//! - [`trace`] and [`replay()`]: route traces and offline replay of LRU, LFRU,
//!   pinned+LRU and the Belady optimum.
//! - [`coupling()`]: cross-layer expert co-activation from traces (offline PILOT).
//! - [`atlas`]: the Expert Atlas (which experts specialise in which topics), its
//!   leave-one-prompt-out validation and the warm-start pin set it implies.
//!
//! Spec: `shared/reference/residency.md`; how it is composed: `ARCHITECTURE.md`.
//!
//! # Wiring (what the runtime does with these pieces)
//!
//! - Start-up: `plan(input)?` (print `plan.fit_report(items)` for `strata fit`); an
//!   MTP tier gets its own `plan(PlanInput::mtp(..))` whose `slab_bytes` go into the
//!   main plan's `fixed_bytes`. Allocate `total_slots * slot_bytes`;
//!   `SlotTable::new(&plan, &sparse_layer_ids)`. Pins: explicit `--pin` list, else
//!   `plan_auto_pins(..).keys()` (size `pinned_experts` from it before planning); for
//!   each, `table.pin(key)` then load and `finish_load(slot, table.slot(slot).generation)`.
//! - Every forward: `table.tick()`. At each MoE layer: `ledger.record(layer, &ids)`
//!   and the trace first (every selection), then `batch_union(&ids, top_k)`; look up
//!   each unique expert and `lease` the hits; misses in chunks of `working_slots`:
//!   `begin_load` -> read -> `finish_load` (false: discard the bytes) -> `lease` ->
//!   compute -> `promote` each miss (hits still leased, so they cannot be victims) ->
//!   `release` everything.
//! - Safe points: while the footprint exceeds the budget, `decommit_one()` and release
//!   that slot's bytes (e.g. `madvise(DONTNEED)`).
//! - Turn boundary: `repin_candidate` per layer -> `select_repins(.., REPIN_MAX_SWAPS)`
//!   -> `table.repin(cold, hot)` when hot is resident, else `unpin(cold)` + `pin(hot)`
//!   + load; then `ledger.decay_heat()` and `ledger.flush()`.

pub mod atlas;
pub mod coupling;
pub mod ledger;
pub mod plan;
pub mod policy;
pub mod replay;
pub mod slots;
pub mod trace;
pub mod union;

pub use coupling::{coupling, CouplingOptions, CouplingReport};
pub use ledger::{fnv1a32, LedgerError, LedgerOpen, LedgerSnapshot, UsageLedger, FORMAT_VERSION, GLM_ENGINE};
pub use plan::{
    format_bytes, parse_size, plan, FitItem, FitReport, PlanError, PlanInput, ResidencyPlan, DEFAULT_WORKING_SLOTS,
};
pub use policy::{
    plan_auto_pins, repin_candidate, select_repins, AutoPin, AutoPinPlan, RepinCandidate, AUTO_PIN_FULL_CONFIDENCE,
    AUTO_PIN_MIN_BUDGET, AUTO_PIN_MIN_HISTORY, AUTO_PIN_SHARE, REPIN_MAX_SWAPS,
};
pub use replay::{replay, replay_tiers, PolicyResult, ReplayConfig, ReplayReport, TiersReport, TiersResult};
pub use slots::{
    Eviction, EvictionScope, Keep, Promotion, ResidencyEntry, SlotInfo, SlotPhase, SlotRole, SlotSnapshot, SlotTable,
};
pub use trace::{
    parse_trace, read_trace, write_trace, TraceError, TraceRecord, TraceWriter, GATED_TRACE_HEADER, TRACE_HEADER,
};
pub use union::{batch_union, UnionEntry};

/// One routed expert: (model layer id, expert id within the layer).
pub type ExpertKey = (usize, usize);

/// A tiny deterministic generator for randomized tests (no extra dependency).
#[cfg(test)]
pub(crate) struct TestRng(u64);

#[cfg(test)]
impl TestRng {
    pub(crate) fn new(seed: u64) -> Self {
        TestRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// SplitMix64.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Skewed towards 0 in `0..n`: uniform below a uniform bound.
    pub(crate) fn skewed(&mut self, n: usize) -> usize {
        let bound = 1 + self.below(n);
        self.below(bound)
    }
}

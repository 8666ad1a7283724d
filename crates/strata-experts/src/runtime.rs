//! `StreamedExperts`: the [`ExpertProvider`] that keeps routed experts in a slab.
//!
//! One forward of one MoE layer: the model counts the routes (before dedup) and takes
//! the union of experts over all rows; here, under the lock, hits are leased and the
//! first wave of misses (at most the free working slots) is submitted; the lock is
//! dropped while the model computes the hits, then each wave's experts as they land;
//! between waves the landed experts are promoted into the layer's slots by role swap.
//! The model accumulates outputs in ascending expert id, so the result does not depend
//! on what was resident: streamed output equals resident output bit for bit.
//!
//! With `--pilot prefetch` the next layer's predicted experts are read while this one
//! computes, queued behind this layer's own reads (runtime/pilot.rs). A prefetch its layer
//! needs and that is still reading forms that layer's first wave (its hits compute
//! meanwhile); a mispredicted one lands in the background and never holds a layer up.

use super::source::ExpertSource;
use super::telemetry::{DeviceTier, DeviceTierReport, Latencies, PilotReport, PilotStats, Traffic, TurnTelemetry};
use crate::provider::{ExpertProvider, ReadyExperts};
use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;
use strata_backend::cpu::{CpuBackend, CpuExpert};
use strata_kernels::QMatrix;
use strata_residency::{
    repin_candidate, select_repins, Eviction, EvictionScope, ExpertKey, ResidencyEntry, ResidencyPlan, SlotPhase,
    SlotRole, SlotSnapshot, SlotTable, UsageLedger, REPIN_MAX_SWAPS,
};
use strata_storage::{AlignedBuf, IoPool, MatrixLayout, ReadTicket};

mod demote;
mod pilot;
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use demote::Demotion;

/// Where the usage ledger lives.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum UsageSetting {
    /// `<model dir>/.coli_usage`.
    #[default]
    Default,
    Off,
    /// A file the user named (engine-id mismatches only warn).
    Path(PathBuf),
}

/// PILOT: one-layer-ahead expert prediction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PilotMode {
    #[default]
    Off,
    /// Predict and score; no I/O.
    Measure,
    /// Predict, score, and send advisory WILLNEED hints for predicted non-resident
    /// experts (they warm the page cache with `--page-cache`; never allocate slots).
    Hint,
    /// Predict, score, and read predicted non-resident experts into free working slots
    /// while the current layer computes; a correct prediction turns the next layer's
    /// miss into a hit whose read already happened.
    Prefetch,
    /// The reference's two-step predictor, measured: the current layer's shared expert is
    /// added to the residual before the next router runs (costs one extra shared-expert
    /// product a layer; no I/O).
    TwoStep,
}

#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    pub working_slots: usize,
    pub max_slots_per_layer: Option<usize>,
    pub pins: Vec<ExpertKey>,
    pub auto_pin: bool,
    pub live_repin: bool,
    pub usage: UsageSetting,
    /// Use a ledger another engine wrote (its counts, rewritten under ours at the next
    /// flush) instead of refusing it.
    pub usage_import: bool,
    /// O_DIRECT reads (default); false uses the page cache.
    pub direct_io: bool,
    pub io_workers: usize,
    pub pilot: PilotMode,
    /// With `pilot` hint or prefetch: act on only the first this many ranks of each row's
    /// prediction (the router's first choices are the surest); None acts on all of them.
    pub pilot_ranks: Option<usize>,
    /// How each layer picks the expert it evicts. Under a device tier it applies there
    /// (the device sees every use); this tier, holding what the device evicts, is LRU.
    pub eviction: Eviction,
    /// Where a tier finds the slot an incoming expert takes: its own layer's slots (the
    /// default), or any layer's (layers differ in how much they reuse). Both tiers follow it.
    pub eviction_scope: EvictionScope,
    /// Approximate decode (off by default): in a one-row forward, routed experts ranked
    /// this or lower (1-based) that would have to be read from disk are left out of the
    /// token's mix instead (their weight counts as 0). Trades output fidelity for disk
    /// reads where the disk is the bottleneck.
    pub skip_misses_from_rank: Option<usize>,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        Self {
            working_slots: 64,
            max_slots_per_layer: None,
            pins: Vec::new(),
            auto_pin: false,
            live_repin: false,
            usage: UsageSetting::Default,
            usage_import: false,
            direct_io: true,
            io_workers: 2,
            pilot: PilotMode::Off,
            pilot_ranks: None,
            // Beats LRU on every trained-routing trace replayed (docs/performance.md).
            eviction: Eviction::Lfru { half_life: Eviction::DEFAULT_HALF_LIFE },
            // Global reads fewer experts from disk at GLM-5.2's proportions but more on
            // strata-tiny's routing (docs/performance.md, "One slab for all layers").
            eviction_scope: EvictionScope::Layer,
            skip_misses_from_rank: None,
        }
    }
}

struct State {
    table: SlotTable,
    demand: Traffic,
    policy: Traffic,
    layer_forward: Latencies,
    pilot: PilotStats,
    /// Predictions waiting for their layer: layer -> (when, per-row experts).
    pending: std::collections::HashMap<usize, (Instant, Vec<Vec<usize>>)>,
    /// Prefetch reads in flight: expert -> (slot, generation, ticket).
    prefetch: std::collections::HashMap<ExpertKey, (usize, u64, ReadTicket)>,
    /// Prefetched experts that landed and were not looked up yet.
    landed: std::collections::HashSet<ExpertKey>,
    /// The next layer's predicted experts to prefetch, surest first: read once the current
    /// layer's own reads are under way, so that they never wait behind a guess.
    deferred: Vec<ExpertKey>,
    /// The current one-row forward's layer and its experts ranked `skip_misses_from_rank`
    /// or lower (set by `record`): misses among them are skipped, not read.
    skip_layer: Option<usize>,
    skip_ids: Vec<u32>,
}

/// The usage ledger, shared by the runtimes of one model (the main and the draft tier
/// count into the same `.coli_usage`).
pub type SharedLedger = std::sync::Arc<Mutex<UsageLedger>>;

/// Computes with a batch of (expert, host slot) pairs whose bytes are ready.
pub(crate) type SlotCompute<'a> = dyn FnMut(&[(u32, usize)]) -> Result<()> + 'a;

pub struct StreamedExperts {
    ledger: Option<SharedLedger>,
    /// Whether this runtime flushes the ledger at the end of a turn (the main tier does).
    owns_ledger: bool,
    /// The process budget pressure correction holds the footprint under.
    budget: Option<u64>,
    live_repin: bool,
    pilot: PilotMode,
    pilot_ranks: Option<usize>,
    eviction: Eviction,
    skip_from_rank: Option<usize>,
    source: Box<dyn ExpertSource>,
    io: IoPool,
    slab: AlignedBuf,
    slot_bytes: usize,
    plan: ResidencyPlan,
    state: Mutex<State>,
    /// A device tier in front of this one (the GPU tier), reported with it.
    device_tier: Mutex<Option<std::sync::Weak<dyn DeviceTier>>>,
    /// Kept exclusive of that device tier (runtime/demote.rs).
    below_device: std::sync::atomic::AtomicBool,
}

/// A snapshot for `--stats` / `/stats`.
#[derive(Clone, Debug, Serialize)]
pub struct RuntimeReport {
    pub plan: ResidencyPlan,
    pub turn: TurnTelemetry,
    /// Slots by role and phase, and the event counters (evictions, pressure evictions,
    /// repin swaps, stale completions).
    pub slots: SlotSnapshot,
    /// How this tier's layers pick their victims (LRU under a device tier).
    pub eviction: Eviction,
    /// Whether a victim comes from the incoming expert's layer or from any layer.
    pub eviction_scope: EvictionScope,
    /// Every occupied slot: layer, expert, role, phase, last use.
    pub residency_map: Vec<ResidencyEntry>,
    /// This turn's live-repin swaps: (layer, cold expert, hot expert).
    pub repins: Vec<(usize, usize, usize)>,
    /// Next-layer prediction, when enabled.
    pub pilot: Option<PilotReport>,
    /// Process footprint (VmRSS) after pressure correction.
    pub footprint_bytes: u64,
    pub budget_bytes: Option<u64>,
    /// The device tier in front of this host tier, when there is one (CUDA).
    pub device_tier: Option<DeviceTierReport>,
}

/// Views a slot's bytes as one matrix of an expert.
fn matrix<'a>(slot: &'a [u8], l: &MatrixLayout) -> Result<QMatrix<'a>> {
    Ok(QMatrix { kind: l.kind, rows: l.rows, cols: l.cols, payload: l.payload(slot)?, scales: l.scales(slot)? })
}

impl StreamedExperts {
    /// Allocates the slab for `plan`, opens the I/O pool and preloads `pins`.
    pub fn new(
        source: Box<dyn ExpertSource>,
        plan: ResidencyPlan,
        pins: &[ExpertKey],
        ledger: Option<SharedLedger>,
        options: &RuntimeOptions,
        budget: Option<u64>,
    ) -> Result<Self> {
        let owns_ledger = true;
        let slot_bytes = source.slot_bytes();
        let io = IoPool::open(source.files(), options.io_workers, options.direct_io)?;
        let mut slab = AlignedBuf::new(plan.total_slots * slot_bytes)
            .map_err(|e| anyhow!("cannot allocate the expert slab ({} bytes): {e}", plan.total_slots * slot_bytes))?;
        if let Err(e) = slab.mlock() {
            eprintln!("warning: expert slab not locked in memory ({e}); the OS may page it out");
        }
        let mut table = SlotTable::new(&plan, source.layers());
        table.set_eviction(options.eviction);
        table.set_scope(options.eviction_scope);
        let state = State {
            table,
            demand: Traffic::default(),
            policy: Traffic::default(),
            layer_forward: Latencies::default(),
            pilot: PilotStats::default(),
            pending: Default::default(),
            prefetch: Default::default(),
            landed: Default::default(),
            deferred: Vec::new(),
            skip_layer: None,
            skip_ids: Vec::new(),
        };
        let me = Self {
            ledger,
            owns_ledger,
            budget,
            live_repin: options.live_repin && budget.is_some(),
            pilot: options.pilot,
            pilot_ranks: options.pilot_ranks,
            eviction: options.eviction,
            skip_from_rank: options.skip_misses_from_rank,
            source,
            io,
            slab,
            slot_bytes,
            plan,
            state: Mutex::new(state),
            device_tier: Mutex::new(None),
            below_device: std::sync::atomic::AtomicBool::new(false),
        };
        me.preload(pins)?;
        Ok(me)
    }

    /// Reports `tier` (in front of this runtime) with this runtime's turns.
    pub fn set_device_tier(&self, tier: std::sync::Weak<dyn DeviceTier>) {
        *self.device_tier.lock().unwrap_or_else(|e| e.into_inner()) = Some(tier);
    }

    /// Another runtime (the main tier) flushes the shared ledger at turn ends.
    pub fn share_ledger(mut self) -> Self {
        self.owns_ledger = false;
        self
    }

    /// The shared usage ledger, if any.
    pub fn ledger(&self) -> Option<&SharedLedger> {
        self.ledger.as_ref()
    }

    pub fn plan(&self) -> &ResidencyPlan {
        &self.plan
    }

    /// Every slot holding an expert now (a live view, for dashboards).
    pub fn residency_map(&self) -> Vec<ResidencyEntry> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).table.residency_map()
    }

    fn slot(&self, slot: usize) -> &[u8] {
        // SAFETY: slots are disjoint ranges of the slab; a slot is only read once its
        // load completed (phase Ready/Leased), and no read targets it until it is freed.
        unsafe { std::slice::from_raw_parts(self.slab.as_ptr().add(slot * self.slot_bytes), self.slot_bytes) }
    }

    /// Submits the read that fills `slot` with `key`.
    fn submit(&self, slot: usize, key: ExpertKey) -> Result<ReadTicket> {
        let (segments, _) = self.source.locate(key.0, key.1)?;
        let check = self.source.read_check(key.0, key.1);
        // SAFETY: the slot is in phase Loading: nothing reads or writes it until the
        // ticket is waited on.
        Ok(unsafe {
            let dest = self.slab.as_ptr().add(slot * self.slot_bytes) as *mut u8;
            self.io.submit_checked(segments, dest, self.slot_bytes, check)
        })
    }

    /// Loads pinned experts (policy traffic) before the first forward.
    fn preload(&self, pins: &[ExpertKey]) -> Result<()> {
        let mut st = self.state.lock().unwrap();
        for &key in pins {
            let slot = st.table.pin(key).map_err(|e| anyhow!("--pin: {e}"))?;
            if st.table.slot(slot).phase != SlotPhase::Loading {
                continue; // already resident: the pin took its slot by role swap
            }
            let generation = st.table.slot(slot).generation;
            self.policy_load(&mut st, slot, generation, key)?;
        }
        Ok(())
    }

    /// Loads every expert (resident mode: the plan holds one slot per expert), in waves
    /// of the working bank, as policy traffic.
    pub fn preload_all(&self) -> Result<()> {
        let layers = self.source.layers().to_vec();
        let n = self.source.experts_per_layer();
        let mut st = self.state.lock().unwrap();
        for layer in layers {
            let mut e = 0;
            while e < n {
                let mut wave = Vec::new();
                while e < n {
                    if st.table.peek((layer, e)).is_some() {
                        e += 1;
                        continue;
                    }
                    let Some((slot, generation)) = st.table.begin_load((layer, e)) else { break };
                    wave.push((slot, generation, self.submit(slot, (layer, e))?));
                    e += 1;
                }
                if wave.is_empty() && e < n {
                    bail!("preload: no free working slot");
                }
                for (slot, generation, ticket) in wave {
                    let t = Instant::now();
                    let stats = match ticket.wait() {
                        Ok(s) => s,
                        Err(err) => {
                            st.table.fail_load(slot, generation);
                            return Err(err);
                        }
                    };
                    st.policy.record_load(&stats, t.elapsed());
                    st.table.finish_load(slot, generation);
                    st.table.promote(slot);
                }
            }
        }
        Ok(())
    }

    /// Reads `key` into `slot` (phase Loading, `generation`) as policy traffic.
    fn policy_load(&self, st: &mut State, slot: usize, generation: u64, key: ExpertKey) -> Result<()> {
        let t = Instant::now();
        match self.submit(slot, key).and_then(|t| t.wait()) {
            Ok(stats) => {
                st.policy.record_load(&stats, t.elapsed());
                st.table.finish_load(slot, generation);
                Ok(())
            }
            Err(e) => {
                st.table.fail_load(slot, generation);
                Err(e)
            }
        }
    }

    /// Live repin: per layer, the hottest unpinned expert replaces the coldest pin when
    /// it wins by the hysteresis; at most four swaps, highest gain first.
    fn live_repin(&self, st: &mut State) -> Result<Vec<(usize, usize, usize)>> {
        let Some(ledger) = self.ledger.as_ref() else { return Ok(Vec::new()) };
        let ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
        let pinned = st.table.pinned_keys();
        let mut candidates = Vec::new();
        for &layer in self.source.layers() {
            let experts: Vec<usize> = pinned.iter().filter(|k| k.0 == layer).map(|k| k.1).collect();
            if let Some(c) = repin_candidate(&ledger, layer, &experts) {
                candidates.push(c);
            }
        }
        let mut done = Vec::new();
        for c in select_repins(&candidates, REPIN_MAX_SWAPS) {
            let (cold, hot) = ((c.layer, c.cold_expert), (c.layer, c.hot_expert));
            if st.table.peek(hot).is_none() {
                let Some((slot, generation)) = st.table.begin_load(hot) else { continue };
                self.policy_load(st, slot, generation, hot)?;
            }
            if st.table.repin(cold, hot).is_ok() {
                done.push((c.layer, c.cold_expert, c.hot_expert));
            }
        }
        Ok(done)
    }

    /// Pressure correction: while the footprint exceeds the budget, decommit the oldest
    /// unpinned layer slots (never below one per layer) and return their pages.
    fn relieve_pressure(&self, st: &mut State) {
        let Some(budget) = self.budget else { return };
        while crate::rss::current_rss_bytes() > budget {
            let Some(slot) = st.table.decommit_one() else { break };
            // SAFETY: a decommitted slot is never read or written again.
            unsafe { discard(self.slab.as_ptr().add(slot * self.slot_bytes), self.slot_bytes) };
        }
    }

    /// End of a turn (a generation safe point): live repin, heat decay, ledger flush,
    /// pressure correction; returns and resets this turn's telemetry.
    pub fn end_turn(&self) -> Result<RuntimeReport> {
        let mut st = self.state.lock().unwrap();
        st.deferred.clear();
        self.settle_prefetches(&mut st, |_| true);
        let repins = if self.live_repin { self.live_repin(&mut st)? } else { Vec::new() };
        if let Some(ledger) = self.ledger.as_ref().filter(|_| self.owns_ledger) {
            let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
            ledger.decay_heat();
            if let Err(e) = ledger.flush() {
                eprintln!("warning: usage ledger {} not saved: {e}", ledger.path().display());
            }
            ledger.take_warnings().iter().for_each(|w| eprintln!("warning: {w}"));
        }
        self.relieve_pressure(&mut st);
        let mut report = RuntimeReport {
            plan: self.plan,
            turn: TurnTelemetry {
                demand: st.demand.report(),
                policy: st.policy.report(),
                layer_forward: st.layer_forward.summary(),
            },
            slots: st.table.snapshot(),
            eviction: st.table.eviction(),
            eviction_scope: st.table.scope(),
            residency_map: st.table.residency_map(),
            repins,
            pilot: (self.pilot != PilotMode::Off).then(|| st.pilot.report()),
            footprint_bytes: crate::rss::current_rss_bytes(),
            budget_bytes: self.budget,
            device_tier: None,
        };
        st.demand = Traffic::default();
        st.policy = Traffic::default();
        st.layer_forward = Latencies::default();
        st.pilot = PilotStats::default();
        st.pending.clear();
        st.landed.clear();
        // Without this tier's lock: the device tier settles its demotions into it.
        drop(st);
        let tier = self.device_tier.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|w| w.upgrade());
        report.device_tier = tier.map(|t| t.take_report());
        Ok(report)
    }
}

/// Returns a slot's pages to the OS (unlocked first; the next touch would read zeros).
///
/// # Safety
/// `ptr..ptr+len` lies in the slab, page aligned, and is never used again.
unsafe fn discard(ptr: *const u8, len: usize) {
    libc::munlock(ptr as *const libc::c_void, len);
    libc::madvise(ptr as *mut libc::c_void, len, libc::MADV_DONTNEED);
}

/// Ready experts in slots: (expert, slot) pairs, viewed through their layouts.
struct SlotsReady<'a> {
    rt: &'a StreamedExperts,
    layer: usize,
    items: &'a [(u32, usize)],
}

impl ReadyExperts<CpuBackend> for SlotsReady<'_> {
    fn len(&self) -> usize {
        self.items.len()
    }
    fn get(&self, i: usize) -> (u32, CpuExpert<'_>) {
        let (e, slot) = self.items[i];
        let layout = self.rt.source.layout(self.layer, e as usize).expect("a planned expert has a layout");
        let bytes = self.rt.slot(slot);
        let m = |l| matrix(bytes, l).expect("a slot holds its expert's matrices");
        (e, CpuExpert { gate: m(&layout.gate), up: m(&layout.up), down: m(&layout.down) })
    }
}

impl StreamedExperts {
    /// Submits reads for as many of `pending` (from `*next` on) as there are free working
    /// slots; `wave` receives (expert, slot, generation, ticket).
    fn submit_wave(
        &self,
        st: &mut State,
        layer: usize,
        pending: &[u32],
        next: &mut usize,
        wave: &mut Vec<(u32, usize, u64, ReadTicket)>,
    ) -> Result<()> {
        wave.clear();
        while let Some(&e) = pending.get(*next) {
            let Some((slot, generation)) = st.table.begin_load((layer, e as usize)) else { break };
            *next += 1;
            match self.submit(slot, (layer, e as usize)) {
                Ok(t) => wave.push((e, slot, generation, t)),
                Err(err) => {
                    st.table.fail_load(slot, generation);
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    /// Makes `experts` of `layer` ready in host slots and calls `compute` with batches of
    /// (expert, slot) as they are (hits first, then each wave of reads); a slot's bytes
    /// stay put until `compute` returns. The CPU provider views the slots as matrices; the
    /// GPU tier copies them to device slots.
    pub(crate) fn run_slots(&self, layer: usize, experts: &[u32], compute: &mut SlotCompute<'_>) -> Result<()> {
        let t_layer = Instant::now();
        let result = self.run_layer(layer, experts, compute);
        self.state.lock().unwrap().layer_forward.push(t_layer.elapsed());
        result
    }

    /// A slot's bytes (a slot handed to [`StreamedExperts::run_slots`]'s `compute`).
    #[cfg(feature = "cuda")]
    pub(crate) fn slot_bytes_of(&self, slot: usize) -> &[u8] {
        self.slot(slot)
    }

    /// Bytes of one slot.
    pub fn slot_size(&self) -> usize {
        self.slot_bytes
    }

    /// Where the matrices of `(layer, expert)` lie inside its slot.
    #[cfg(feature = "cuda")]
    pub(crate) fn layout(&self, layer: usize, expert: usize) -> Result<&strata_storage::ExpertLayout> {
        self.source.layout(layer, expert)
    }

    /// The slab's address and length (the GPU tier page-locks it for the copy engine).
    #[cfg(feature = "cuda")]
    pub(crate) fn slab_region(&self) -> (*mut u8, usize) {
        (self.slab.as_ptr() as *mut u8, self.plan.total_slots * self.slot_bytes)
    }

    /// Model layer ids with routed experts, and experts per layer.
    pub fn layers(&self) -> (&[usize], usize) {
        (self.source.layers(), self.source.experts_per_layer())
    }

    fn run_layer(&self, layer: usize, experts: &[u32], compute: &mut SlotCompute<'_>) -> Result<()> {
        let mut hits: Vec<(u32, usize)> = Vec::new();
        let mut misses: Vec<u32> = Vec::new();
        // Hits still in a working slot (prefetched, or a miss that found no victim) are
        // promoted into the layer's slots once released.
        let mut to_promote = Vec::new();
        // Reads this layer waits for, a wave at a time: first the prefetches it needs that
        // are still reading (started a layer ago), then the misses' reads.
        let mut wave = Vec::new();
        let mut later = Vec::new();
        // Experts whose prefetch joined the first wave: a failed one is read again.
        let mut joined: Vec<u32> = Vec::new();
        let mut next = 0usize;
        // Under a device tier, what goes up is cooled, not promoted (runtime/demote.rs).
        let below = self.below_device();
        {
            let mut st = self.state.lock().unwrap();
            st.table.tick();
            st.table.record_uses(layer, experts.iter().map(|&e| e as usize));
            // A prefetch that landed is a hit; one still reading that this layer needs
            // joins its first wave, so the hits compute meanwhile; a mispredicted one goes
            // on reading without holding the layer up.
            self.settle_landed_prefetches(&mut st);
            for &e in experts {
                match st.table.lookup((layer, e as usize)) {
                    Some(slot) => {
                        st.table.lease(slot);
                        hits.push((e, slot));
                        if below {
                            st.table.cool((layer, e as usize));
                        } else if st.table.slot(slot).role == SlotRole::Working {
                            to_promote.push(slot);
                        }
                        if st.landed.remove(&(layer, e as usize)) {
                            st.pilot.prefetch_hits += 1;
                        }
                    }
                    None => match st.prefetch.remove(&(layer, e as usize)) {
                        Some((slot, generation, ticket)) => {
                            st.pilot.prefetch_hits += 1;
                            joined.push(e);
                            wave.push((e, slot, generation, ticket));
                        }
                        None => misses.push(e),
                    },
                }
            }
            if st.skip_layer.take() == Some(layer) {
                let before = misses.len();
                misses.retain(|e| !st.skip_ids.contains(e));
                st.demand.skipped += (before - misses.len()) as u64;
            }
            st.demand.hits += (hits.len() + joined.len()) as u64;
            st.demand.misses += misses.len() as u64;
            if let Err(e) = self.submit_wave(&mut st, layer, &misses, &mut next, &mut later) {
                Self::abandon(&mut st, &mut wave);
                Self::release_all(&mut st, &hits, &to_promote);
                return Err(e);
            }
            // The next layer's prefetches queue behind these reads, in working slots this
            // layer has not needed; short of slots for its own misses, they are dropped.
            if next >= misses.len() {
                self.start_prefetches(&mut st);
            } else {
                st.deferred.clear();
            }
            if wave.is_empty() {
                std::mem::swap(&mut wave, &mut later);
            }
        }
        // Resident work overlaps the reads just submitted; no lock is held meanwhile
        // (leased slots are never reused).
        let mut result = if hits.is_empty() { Ok(()) } else { compute(&hits) };
        let mut landed: Vec<(u32, usize)> = Vec::new();
        while result.is_ok() && (!wave.is_empty() || !later.is_empty() || next < misses.len()) {
            if wave.is_empty() && !later.is_empty() {
                std::mem::swap(&mut wave, &mut later);
            }
            if wave.is_empty() {
                let mut st = self.state.lock().unwrap();
                if !hits.is_empty() || !to_promote.is_empty() {
                    // The hits are computed: their slots may take misses now (a forward of
                    // many rows can need more experts than the bank holds beside them).
                    Self::release_all(&mut st, &hits, &to_promote);
                    hits.clear();
                    to_promote.clear();
                    result = self.submit_wave(&mut st, layer, &misses, &mut next, &mut wave);
                    continue;
                }
                if !st.prefetch.is_empty() {
                    // Prefetches for later layers hold the working bank: land them.
                    self.settle_prefetches(&mut st, |_| true);
                    result = self.submit_wave(&mut st, layer, &misses, &mut next, &mut wave);
                    continue;
                }
                result =
                    Err(anyhow!("no free working slot for expert {layer}:{} (working bank exhausted)", misses[next]));
                break;
            }
            // Wait for this wave without the lock, then publish what landed.
            let mut outcomes = Vec::with_capacity(wave.len());
            for (e, slot, generation, ticket) in wave.drain(..) {
                let t_wait = Instant::now();
                outcomes.push((e, slot, generation, ticket.wait(), t_wait.elapsed()));
            }
            landed.clear();
            {
                let mut st = self.state.lock().unwrap();
                for (e, slot, generation, outcome, waited) in outcomes {
                    match outcome {
                        Ok(stats) => {
                            st.demand.record_load(&stats, waited);
                            if result.is_err() || !st.table.finish_load(slot, generation) {
                                st.table.fail_load(slot, generation);
                                continue;
                            }
                            st.table.lease(slot);
                            landed.push((e, slot));
                        }
                        Err(err) => {
                            st.table.fail_load(slot, generation);
                            if let Some(i) = joined.iter().position(|&j| j == e) {
                                // A failed prefetch: the demand path reads it again and
                                // reports any error of its own.
                                joined.swap_remove(i);
                                misses.push(e);
                                st.pilot.prefetch_hits -= 1;
                                st.demand.hits -= 1;
                                st.demand.misses += 1;
                            } else if result.is_ok() {
                                result = Err(err);
                            }
                        }
                    }
                }
            }
            if result.is_ok() && !landed.is_empty() {
                result = compute(&landed);
            }
            let mut st = self.state.lock().unwrap();
            for &(_, slot) in &landed {
                st.table.release(slot);
                if result.is_ok() && !below {
                    st.table.promote(slot);
                }
            }
            if result.is_ok() && next < misses.len() {
                result = self.submit_wave(&mut st, layer, &misses, &mut next, &mut wave);
            }
        }
        let mut st = self.state.lock().unwrap();
        Self::abandon(&mut st, &mut wave);
        Self::abandon(&mut st, &mut later);
        Self::release_all(&mut st, &hits, &to_promote);
        result.map_err(|e| anyhow!("expert layer {layer}: {e:#}"))
    }

    /// Reads still in flight after an error: waits for them and frees their slots.
    fn abandon(st: &mut State, wave: &mut Vec<(u32, usize, u64, ReadTicket)>) {
        for (_, slot, generation, ticket) in wave.drain(..) {
            let _ = ticket.wait();
            st.table.fail_load(slot, generation);
        }
    }

    fn release_all(st: &mut State, hits: &[(u32, usize)], to_promote: &[usize]) {
        for &(_, slot) in hits {
            st.table.release(slot);
        }
        for &slot in to_promote {
            st.table.promote(slot);
        }
    }
}

impl ExpertProvider<CpuBackend> for StreamedExperts {
    fn record(&self, layer: usize, ids: &[u32], top_k: usize) {
        let mut st = self.state.lock().unwrap();
        // (Ids come best first: a one-row forward's low ranks are the tail.)
        st.skip_layer = None;
        if let Some(r) = self.skip_from_rank.filter(|&r| ids.len() == top_k && (1..=top_k).contains(&r)) {
            st.skip_layer = Some(layer);
            st.skip_ids.clear();
            st.skip_ids.extend_from_slice(&ids[r - 1..]);
        }
        if let Some((when, predicted)) = st.pending.remove(&layer) {
            let rows = ids.len() / top_k.max(1);
            if predicted.len() == rows {
                let actual: Vec<Vec<usize>> =
                    ids.chunks(top_k).map(|r| r.iter().map(|&e| e as usize).collect()).collect();
                st.pilot.lead_time.push(when.elapsed());
                st.pilot.score(&predicted, &actual);
            }
        }
        drop(st);
        if let Some(ledger) = self.ledger.as_ref() {
            let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
            let mut row = [0usize; 64];
            for r in ids.chunks(top_k.max(1)) {
                let n = r.len().min(row.len());
                for (d, &e) in row.iter_mut().zip(r) {
                    *d = e as usize;
                }
                ledger.record(layer, &row[..n]);
            }
        }
    }

    fn run(
        &self,
        _b: &CpuBackend,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<CpuBackend>) -> Result<()>,
    ) -> Result<()> {
        self.run_slots(layer, experts, &mut |items| compute(&SlotsReady { rt: self, layer, items }))
    }

    fn wants_prediction(&self) -> bool {
        self.pilot != PilotMode::Off
    }

    fn drops_misses(&self) -> bool {
        self.skip_from_rank.is_some()
    }

    fn two_step_prediction(&self) -> bool {
        self.pilot == PilotMode::TwoStep
    }

    fn predicted(&self, layer: usize, ids: &[u32], top_k: usize) {
        self.predicted_skipping(layer, ids, top_k, &|_| false);
    }
}

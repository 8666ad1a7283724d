//! `StreamedExperts`: the [`ExpertBackend`] that keeps routed experts in a slab.
//!
//! One forward of one MoE layer: count the routes in the ledger (before dedup), take the
//! union of experts over all rows, lease hits, submit reads for misses (a wave holds at
//! most the free working slots), compute hits while those reads run, then compute each
//! miss as it lands and promote it into the layer's slots by role swap. Outputs are
//! accumulated in ascending expert id, so the result does not depend on what was
//! resident: streamed output equals resident output bit for bit.

use super::source::ExpertSource;
use super::telemetry::{Latencies, PilotReport, PilotStats, Traffic, TurnTelemetry};
use anyhow::{anyhow, bail, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;
use strata_kernels::{swiglu_expert, QMatrix};
use strata_models::experts::{accumulate_ascending, ExpertBackend, Routing};
use strata_residency::{
    repin_candidate, select_repins, ExpertKey, ResidencyEntry, ResidencyPlan, SlotPhase, SlotRole, SlotSnapshot,
    SlotTable, UsageLedger, REPIN_MAX_SWAPS,
};
use strata_storage::{AlignedBuf, ExpertLayout, IoPool, MatrixLayout, ReadTicket};

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
}

#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    pub working_slots: usize,
    pub max_slots_per_layer: Option<usize>,
    pub pins: Vec<ExpertKey>,
    pub auto_pin: bool,
    pub live_repin: bool,
    pub usage: UsageSetting,
    /// O_DIRECT reads (default); false uses the page cache.
    pub direct_io: bool,
    pub io_workers: usize,
    pub pilot: PilotMode,
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
            direct_io: true,
            io_workers: 2,
            pilot: PilotMode::Off,
        }
    }
}

struct State {
    table: SlotTable,
    ledger: Option<UsageLedger>,
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
}

pub struct StreamedExperts {
    hidden: usize,
    /// The process budget pressure correction holds the footprint under.
    budget: Option<u64>,
    live_repin: bool,
    pilot: PilotMode,
    source: Box<dyn ExpertSource>,
    io: IoPool,
    slab: AlignedBuf,
    slot_bytes: usize,
    plan: ResidencyPlan,
    state: Mutex<State>,
}

/// A snapshot for `--stats` / `/stats`.
#[derive(Clone, Debug, Serialize)]
pub struct RuntimeReport {
    pub plan: ResidencyPlan,
    pub turn: TurnTelemetry,
    /// Slots by role and phase, and the event counters (evictions, pressure evictions,
    /// repin swaps, stale completions).
    pub slots: SlotSnapshot,
    /// Every occupied slot: layer, expert, role, phase, last use.
    pub residency_map: Vec<ResidencyEntry>,
    /// This turn's live-repin swaps: (layer, cold expert, hot expert).
    pub repins: Vec<(usize, usize, usize)>,
    /// Next-layer prediction, when enabled.
    pub pilot: Option<PilotReport>,
    /// Process footprint (VmRSS) after pressure correction.
    pub footprint_bytes: u64,
    pub budget_bytes: Option<u64>,
}

/// Views a slot's bytes as one matrix of an expert.
fn matrix<'a>(slot: &'a [u8], l: &MatrixLayout) -> Result<QMatrix<'a>> {
    Ok(QMatrix { kind: l.kind, rows: l.rows, cols: l.cols, payload: l.payload(slot)?, scales: l.scales(slot)? })
}

impl StreamedExperts {
    /// Allocates the slab for `plan`, opens the I/O pool and preloads `pins`.
    pub fn new(
        hidden: usize,
        source: Box<dyn ExpertSource>,
        plan: ResidencyPlan,
        pins: &[ExpertKey],
        ledger: Option<UsageLedger>,
        options: &RuntimeOptions,
        budget: Option<u64>,
    ) -> Result<Self> {
        let slot_bytes = source.slot_bytes();
        let io = IoPool::open(source.files(), options.io_workers, options.direct_io)?;
        let mut slab = AlignedBuf::new(plan.total_slots * slot_bytes)
            .map_err(|e| anyhow!("cannot allocate the expert slab ({} bytes): {e}", plan.total_slots * slot_bytes))?;
        if let Err(e) = slab.mlock() {
            eprintln!("warning: expert slab not locked in memory ({e}); the OS may page it out");
        }
        let table = SlotTable::new(&plan, source.layers());
        let state = State {
            table,
            ledger,
            demand: Traffic::default(),
            policy: Traffic::default(),
            layer_forward: Latencies::default(),
            pilot: PilotStats::default(),
            pending: Default::default(),
            prefetch: Default::default(),
            landed: Default::default(),
        };
        let me = Self {
            hidden,
            budget,
            live_repin: options.live_repin && budget.is_some(),
            pilot: options.pilot,
            source,
            io,
            slab,
            slot_bytes,
            plan,
            state: Mutex::new(state),
        };
        me.preload(pins)?;
        Ok(me)
    }

    pub fn plan(&self) -> &ResidencyPlan {
        &self.plan
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

    fn run_expert(&self, slot: usize, layout: &ExpertLayout, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let bytes = self.slot(slot);
        let mut y = vec![0f32; rows * self.hidden];
        let (g, u, d) = (matrix(bytes, &layout.gate)?, matrix(bytes, &layout.up)?, matrix(bytes, &layout.down)?);
        swiglu_expert(x, rows, &g, &u, &d, &mut y);
        Ok(y)
    }

    /// Completes the prefetch reads whose expert satisfies `which`: each lands Ready in
    /// its working slot (a hit for the next lookup) or, on error, goes back to idle (the
    /// demand path then reads it again and reports any error).
    fn settle_prefetches(&self, st: &mut State, which: impl Fn(&ExpertKey) -> bool) {
        let keys: Vec<ExpertKey> = st.prefetch.keys().copied().filter(|k| which(k)).collect();
        for key in keys {
            let (slot, generation, ticket) = st.prefetch.remove(&key).unwrap();
            let t = Instant::now();
            match ticket.wait() {
                Ok(stats) => {
                    st.demand.record_load(&stats, t.elapsed());
                    if st.table.finish_load(slot, generation) {
                        st.landed.insert(key);
                    }
                }
                Err(_) => {
                    st.table.fail_load(slot, generation);
                }
            }
        }
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
        let Some(ledger) = st.ledger.as_ref() else { return Ok(Vec::new()) };
        let pinned = st.table.pinned_keys();
        let mut candidates = Vec::new();
        for &layer in self.source.layers() {
            let experts: Vec<usize> = pinned.iter().filter(|k| k.0 == layer).map(|k| k.1).collect();
            if let Some(c) = repin_candidate(ledger, layer, &experts) {
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
        while crate::stats::current_rss_bytes() > budget {
            let Some(slot) = st.table.decommit_one() else { break };
            // SAFETY: a decommitted slot is never read or written again.
            unsafe { discard(self.slab.as_ptr().add(slot * self.slot_bytes), self.slot_bytes) };
        }
    }

    /// End of a turn (a generation safe point): live repin, heat decay, ledger flush,
    /// pressure correction; returns and resets this turn's telemetry.
    pub fn end_turn(&self) -> Result<RuntimeReport> {
        let mut st = self.state.lock().unwrap();
        self.settle_prefetches(&mut st, |_| true);
        let repins = if self.live_repin { self.live_repin(&mut st)? } else { Vec::new() };
        if let Some(ledger) = st.ledger.as_mut() {
            ledger.decay_heat();
            if let Err(e) = ledger.flush() {
                eprintln!("warning: usage ledger {} not saved: {e}", ledger.path().display());
            }
            ledger.take_warnings().iter().for_each(|w| eprintln!("warning: {w}"));
        }
        self.relieve_pressure(&mut st);
        let report = RuntimeReport {
            plan: self.plan,
            turn: TurnTelemetry {
                demand: st.demand.report(),
                policy: st.policy.report(),
                layer_forward: st.layer_forward.summary(),
            },
            slots: st.table.snapshot(),
            residency_map: st.table.residency_map(),
            repins,
            pilot: (self.pilot != PilotMode::Off).then(|| st.pilot.report()),
            footprint_bytes: crate::stats::current_rss_bytes(),
            budget_bytes: self.budget,
        };
        st.demand = Traffic::default();
        st.policy = Traffic::default();
        st.layer_forward = Latencies::default();
        st.pilot = PilotStats::default();
        st.pending.clear();
        st.landed.clear();
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

/// The rows of `x` that chose each expert, in row order.
fn rows_by_expert(routes: &[Routing]) -> BTreeMap<usize, Vec<usize>> {
    let mut by: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (r, route) in routes.iter().enumerate() {
        for &e in &route.experts {
            let rows = by.entry(e).or_default();
            if rows.last() != Some(&r) {
                rows.push(r);
            }
        }
    }
    by
}

impl ExpertBackend for StreamedExperts {
    fn wants_prediction(&self) -> bool {
        self.pilot != PilotMode::Off
    }

    fn predicted(&self, layer: usize, routes: &[Routing]) {
        let t = Instant::now();
        let mut st = self.state.lock().unwrap();
        if self.pilot == PilotMode::Hint {
            let mut unique: Vec<usize> = routes.iter().flat_map(|r| r.experts.iter().copied()).collect();
            unique.sort_unstable();
            unique.dedup();
            for e in unique {
                if st.table.peek((layer, e)).is_some() {
                    continue;
                }
                if let Ok((segments, _)) = self.source.locate(layer, e) {
                    st.pilot.hints += 1;
                    st.pilot.hint_bytes += segments.iter().map(|s| s.len as u64).sum::<u64>();
                    self.io.hint_willneed(&segments);
                }
            }
        }
        if self.pilot == PilotMode::Prefetch {
            let mut unique: Vec<usize> = routes.iter().flat_map(|r| r.experts.iter().copied()).collect();
            unique.sort_unstable();
            unique.dedup();
            for e in unique {
                let key = (layer, e);
                if st.table.peek(key).is_some() || st.prefetch.contains_key(&key) {
                    continue;
                }
                let Some((slot, generation)) = st.table.begin_load(key) else { break };
                match self.submit(slot, key) {
                    Ok(ticket) => {
                        st.pilot.prefetches += 1;
                        st.prefetch.insert(key, (slot, generation, ticket));
                    }
                    Err(_) => {
                        st.table.fail_load(slot, generation);
                    }
                }
            }
        }
        st.pending.insert(layer, (Instant::now(), routes.iter().map(|r| r.experts.clone()).collect()));
        st.pilot.hint_latency.push(t.elapsed());
    }

    fn forward(&self, layer: usize, x: &[f32], rows: usize, routes: &[Routing]) -> Result<Vec<f32>> {
        let t_layer = Instant::now();
        let h = self.hidden;
        if x.len() != rows * h || routes.len() != rows {
            bail!("expert forward: {} values and {} routes for {rows} rows of {h}", x.len(), routes.len());
        }
        let mut st = self.state.lock().unwrap();
        st.table.tick();
        self.settle_prefetches(&mut st, |k| k.0 == layer);
        if let Some((when, predicted)) = st.pending.remove(&layer) {
            if predicted.len() == rows {
                let actual: Vec<Vec<usize>> = routes.iter().map(|r| r.experts.clone()).collect();
                st.pilot.lead_time.push(when.elapsed());
                st.pilot.score(&predicted, &actual);
            }
        }
        if let Some(ledger) = st.ledger.as_mut() {
            for r in routes {
                ledger.record(layer, &r.experts);
            }
        }
        let by_expert = rows_by_expert(routes);
        let gather =
            |rs: &[usize]| -> Vec<f32> { rs.iter().flat_map(|&r| x[r * h..(r + 1) * h].iter().copied()).collect() };

        // Hits are leased so no promotion in this forward can evict them.
        let mut hits = Vec::new();
        let mut misses = Vec::new();
        // Hits still in a working slot (prefetched, or a miss that found no victim) are
        // promoted into the layer's slots once released.
        let mut to_promote = Vec::new();
        for &e in by_expert.keys() {
            match st.table.lookup((layer, e)) {
                Some(slot) => {
                    st.table.lease(slot);
                    hits.push((e, slot));
                    if st.table.slot(slot).role == SlotRole::Working {
                        to_promote.push(slot);
                    }
                    if st.landed.remove(&(layer, e)) {
                        st.pilot.prefetch_hits += 1;
                    }
                }
                None => misses.push(e),
            }
        }
        st.demand.hits += hits.len() as u64;
        st.demand.misses += misses.len() as u64;

        let mut outputs: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        let mut computed_hits = false;
        let mut pending = misses.into_iter().peekable();
        let result = (|| -> Result<()> {
            while pending.peek().is_some() || !computed_hits {
                // A wave: as many misses as there are free working slots.
                let mut wave = Vec::new();
                while let Some(&e) = pending.peek() {
                    let Some((slot, generation)) = st.table.begin_load((layer, e)) else { break };
                    pending.next();
                    let ticket = match self.submit(slot, (layer, e)) {
                        Ok(t) => t,
                        Err(err) => {
                            st.table.fail_load(slot, generation);
                            return Err(err);
                        }
                    };
                    wave.push((e, slot, generation, ticket));
                }
                if wave.is_empty() && pending.peek().is_some() && !st.prefetch.is_empty() {
                    // Prefetches for later layers hold the working bank: land them.
                    self.settle_prefetches(&mut st, |_| true);
                    continue;
                }
                if wave.is_empty() && pending.peek().is_some() && computed_hits {
                    bail!(
                        "no free working slot for expert {layer}:{} (working bank exhausted)",
                        pending.peek().unwrap()
                    );
                }
                if !computed_hits {
                    // Resident work overlaps the reads just submitted.
                    for &(e, slot) in &hits {
                        let (_, layout) = self.source.locate(layer, e)?;
                        let rs = &by_expert[&e];
                        outputs.insert(e, self.run_expert(slot, layout, &gather(rs), rs.len())?);
                    }
                    computed_hits = true;
                }
                let mut failure = None;
                for (e, slot, generation, ticket) in wave {
                    let t_wait = Instant::now();
                    match ticket.wait() {
                        Ok(stats) => {
                            st.demand.record_load(&stats, t_wait.elapsed());
                            if failure.is_some() || !st.table.finish_load(slot, generation) {
                                st.table.fail_load(slot, generation);
                                continue;
                            }
                            let (_, layout) = self.source.locate(layer, e)?;
                            let rs = &by_expert[&e];
                            outputs.insert(e, self.run_expert(slot, layout, &gather(rs), rs.len())?);
                            st.table.promote(slot);
                        }
                        Err(err) => {
                            st.table.fail_load(slot, generation);
                            failure.get_or_insert(err);
                        }
                    }
                }
                if let Some(err) = failure {
                    return Err(err);
                }
            }
            Ok(())
        })();
        for &(_, slot) in &hits {
            st.table.release(slot);
        }
        for slot in to_promote {
            st.table.promote(slot);
        }
        result.map_err(|e| anyhow!("expert layer {layer}: {e:#}"))?;

        let mut out = vec![0f32; rows * h];
        let position: BTreeMap<(usize, usize), usize> =
            by_expert.iter().flat_map(|(&e, rs)| rs.iter().enumerate().map(move |(i, &r)| ((e, r), i))).collect();
        accumulate_ascending(&mut out, h, routes, |e, r| {
            let i = position[&(e, r)];
            outputs.get(&e).map(|y| &y[i * h..(i + 1) * h])
        });
        st.layer_forward.push(t_layer.elapsed());
        Ok(out)
    }
}

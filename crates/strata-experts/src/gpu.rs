//! The GPU tier of streamed experts: a slab of expert slots in GPU memory (sized by
//! `--gpu-budget`) in front of the host tier (the page-locked host slab of
//! [`StreamedExperts`], sized by `--budget`), which reads misses from the container.
//!
//! One MoE layer of a forward: GPU hits are computed at once from their device slots;
//! the misses go to the host tier, which hands them over in batches as they are ready in
//! host slots (host hits first, then each wave of SSD reads); each batch is copied into
//! GPU working slots on the compute stream and computed, and the slots are promoted into
//! the layer's GPU slots by role swap. Copies and kernels share one stream, so a copy
//! into a slot always follows the kernels queued on its previous expert: no slot needs a
//! wait of its own. The host slot is released only once a fence says its copy has read
//! it. Outputs are combined in ascending expert id by the model, so the result does not
//! depend on which tier held an expert: streamed equals resident bit for bit.
//!
//! The host tier is kept exclusive of this one (experts/runtime/demote.rs): an expert a
//! promotion evicts goes back down, touched there or copied device -> host on a stream of
//! its own; a later copy into the evicted slot is queued behind that copy.
//!
//! When the tier holds every expert (no `--gpu-budget`) and nothing needs the routed ids
//! on the host (no usage ledger, no PILOT), slots never change after the preload: the tier
//! then builds the backend's expert tables over its slots, and a decode row dispatches its
//! experts by id on the device as resident checkpoints do (no sync, no task upload).

use super::runtime::{Demotion, StreamedExperts};
use super::telemetry::{DeviceTier, DeviceTierReport, DeviceTierTraffic};
use crate::provider::{ExpertProvider, ReadyExperts};
use anyhow::{anyhow, bail, Result};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use strata_backend::cuda::{CopyFence, CudaBackend, CudaExpert, CudaExpertTable, CudaMat, DevBuf, HostRegistration};
use strata_backend::Backend;
use strata_residency::{ResidencyPlan, SlotRole, SlotTable};

struct Device {
    slab: DevBuf<u8>,
    /// Keeps the host slab page-locked while copies may read it.
    _pinned: Option<HostRegistration>,
}

struct State {
    table: SlotTable,
    device: Option<Device>,
    /// The backend's description, once known.
    name: String,
    traffic: DeviceTierTraffic,
    /// Device -> host copies of evicted experts in flight.
    demoting: Vec<Demoting>,
}

/// An evicted expert on its way down: GPU slot `from` is read until `fence` passes.
struct Demoting {
    /// None once a copy into `from` has been queued behind the fence.
    from: Option<usize>,
    host_slot: usize,
    generation: u64,
    fence: CopyFence,
}

pub struct GpuExperts {
    host: Arc<StreamedExperts>,
    plan: ResidencyPlan,
    slot_bytes: usize,
    resident_all: bool,
    /// The host tier keeps what this one evicts (see the module comment).
    exclusive: bool,
    state: Mutex<State>,
    /// Per model layer: the expert table over the layer's slots (see the module comment);
    /// built once, after the preload, where the tier may dispatch by id.
    tables: OnceLock<Vec<Option<CudaExpertTable>>>,
}

/// Experts ready in GPU slots.
struct GpuReady<'a> {
    items: &'a [(u32, usize)],
    views: Vec<[CudaMat; 3]>,
}

impl ReadyExperts<CudaBackend> for GpuReady<'_> {
    fn len(&self) -> usize {
        self.items.len()
    }
    fn get(&self, i: usize) -> (u32, CudaExpert<'_>) {
        let [g, u, d] = &self.views[i];
        (self.items[i].0, CudaExpert { gate: g, up: u, down: d })
    }
}

impl GpuExperts {
    /// The tier for `plan` (its slots are the host tier's slot size) over `host`. The
    /// device slab is allocated on the first forward (the backend exists then); with
    /// `resident_all` every expert is copied in then.
    pub fn new(host: Arc<StreamedExperts>, plan: ResidencyPlan, resident_all: bool) -> Result<Self> {
        let slot_bytes = host.slot_size();
        if plan.input.slot_bytes != slot_bytes as u64 {
            bail!("GPU tier: planned slots of {} bytes for host slots of {slot_bytes}", plan.input.slot_bytes);
        }
        let mut table = SlotTable::new(&plan, host.layers().0);
        table.set_eviction(host.eviction());
        table.set_scope(host.eviction_scope());
        let state = State {
            table,
            device: None,
            name: String::new(),
            traffic: DeviceTierTraffic::default(),
            demoting: Vec::new(),
        };
        // Every expert resident: nothing is ever evicted, the host tier stays as it is.
        let exclusive = !resident_all;
        host.set_below_device(exclusive);
        Ok(Self { host, plan, slot_bytes, resident_all, exclusive, state: Mutex::new(state), tables: OnceLock::new() })
    }

    /// The tier, reporting with its host runtime at each turn's end.
    pub fn attach(self) -> Arc<Self> {
        let me = Arc::new(self);
        let weak: std::sync::Weak<dyn DeviceTier> = Arc::downgrade(&(me.clone() as Arc<dyn DeviceTier>));
        me.host.set_device_tier(weak);
        me
    }

    /// Every device slot holding an expert now (a live view, for dashboards).
    pub fn residency_map(&self) -> Vec<strata_residency::ResidencyEntry> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).table.residency_map()
    }

    pub fn plan(&self) -> &ResidencyPlan {
        &self.plan
    }

    pub fn host(&self) -> &Arc<StreamedExperts> {
        &self.host
    }

    /// Device memory of the slab, the host slab page-locked; with `resident_all`, every
    /// expert copied in.
    fn ensure_device(&self, b: &CudaBackend, st: &mut State) -> Result<()> {
        if st.device.is_some() {
            return Ok(());
        }
        let slab = b.alloc_bytes(self.plan.total_slots * self.slot_bytes).map_err(|e| {
            anyhow!("GPU expert slab ({} slots of {} bytes): {e:#}", self.plan.total_slots, self.slot_bytes)
        })?;
        let (ptr, len) = self.host.slab_region();
        // SAFETY: the host slab lives as long as `self.host`, which outlives the device
        // state (both are owned by this tier).
        let pinned = match unsafe { b.register_host(ptr, len) } {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("warning: {e:#}; host -> GPU expert copies are staged by the driver");
                None
            }
        };
        st.device = Some(Device { slab, _pinned: pinned });
        st.name = b.describe();
        if self.resident_all {
            let (layers, n) = self.host.layers();
            let all: Vec<u32> = (0..n as u32).collect();
            for &layer in layers {
                self.bring_in(b, st, layer, &all, &mut |_| Ok(()))?;
            }
            let _ = b.fence()?.wait();
        }
        Ok(())
    }

    /// The device views of the experts in `items` ((expert, GPU slot)) of `layer`.
    fn views(&self, b: &CudaBackend, st: &State, layer: usize, items: &[(u32, usize)]) -> Result<Vec<[CudaMat; 3]>> {
        let base = st.device.as_ref().expect("the device slab exists").slab.ptr();
        items
            .iter()
            .map(|&(e, slot)| {
                let l = self.host.layout(layer, e as usize)?;
                let at = base + (slot * self.slot_bytes) as u64;
                let m = |m: &strata_storage::MatrixLayout| {
                    let (p, s) = (at + m.payload_offset as u64, at + m.scales_offset as u64);
                    b.view_matrix(m.kind, m.rows, m.cols, p, s)
                };
                Ok([m(&l.gate)?, m(&l.up)?, m(&l.down)?])
            })
            .collect()
    }

    /// Gets `experts` (not in GPU slots) of `layer` from the host tier, copies each batch
    /// into GPU working slots, calls `compute` on it and promotes the slots.
    fn bring_in(
        &self,
        b: &CudaBackend,
        st: &mut State,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<CudaBackend>) -> Result<()>,
    ) -> Result<()> {
        let base = st.device.as_ref().expect("the device slab exists").slab.ptr();
        // A demotion in flight holds its expert's host slot in phase Loading, where the
        // host tier can neither hit nor read it: land them all first.
        self.settle_demotions(st)?;
        let mut chunk: Vec<(u32, usize)> = Vec::new();
        let mut loads: Vec<(usize, u64)> = Vec::new();
        self.host.run_slots(layer, experts, &mut |items| {
            let mut i = 0;
            while i < items.len() {
                chunk.clear();
                loads.clear();
                while let Some(&(e, host_slot)) = items.get(i) {
                    let Some((slot, generation)) = st.table.begin_load((layer, e as usize)) else { break };
                    if let Err(e) = Self::after_demotions_from(b, st, slot) {
                        for &(s, g) in loads.iter().chain([&(slot, generation)]) {
                            st.table.fail_load(s, g);
                        }
                        return Err(e);
                    }
                    let bytes = self.host.slot_bytes_of(host_slot);
                    b.copy_to_device(base + (slot * self.slot_bytes) as u64, bytes);
                    st.traffic.copies += 1;
                    st.traffic.copy_bytes += bytes.len() as u64;
                    chunk.push((e, slot));
                    loads.push((slot, generation));
                    i += 1;
                }
                if chunk.is_empty() {
                    bail!("GPU tier: no free working slot for expert {layer}:{}", items[i].0);
                }
                let fence = b.fence()?;
                for &(slot, generation) in &loads {
                    st.table.finish_load(slot, generation);
                    st.table.lease(slot);
                }
                let result =
                    self.views(b, st, layer, &chunk).and_then(|views| compute(&GpuReady { items: &chunk, views }));
                let t = Instant::now();
                let waited = fence.wait();
                st.traffic.copy_wait_seconds += t.elapsed().as_secs_f64();
                // Every slot is released, whatever fails (a failed demotion copy included).
                let mut promoted = Ok(());
                for &(_, slot) in &chunk {
                    st.table.release(slot);
                    if result.is_ok() && waited.is_ok() && promoted.is_ok() {
                        promoted = self.promote(b, st, slot);
                    }
                }
                result?;
                waited?;
                promoted?;
            }
            Ok(())
        })
    }

    /// Whether a row may dispatch by id: every expert in place, and no ids wanted on the
    /// host (the usage ledger and PILOT read them).
    fn dispatches_by_id(&self) -> bool {
        self.resident_all
            && self.host.ledger().is_none()
            && !ExpertProvider::<strata_backend::cpu::CpuBackend>::wants_prediction(self.host.as_ref())
    }

    /// The expert tables over every layer's slots (after the preload). A layer whose
    /// experts the backend cannot index by id (mixed shapes) gets none and takes the host
    /// path.
    fn build_tables(&self, b: &CudaBackend) -> Result<Vec<Option<CudaExpertTable>>> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.ensure_device(b, &mut st)?;
        let (layers, n) = self.host.layers();
        let mut tables: Vec<Option<CudaExpertTable>> = Vec::new();
        for &layer in layers {
            let mut items = Vec::with_capacity(n);
            for e in 0..n {
                let slot = st.table.peek((layer, e)).ok_or_else(|| anyhow!("expert {layer}:{e} has no GPU slot"))?;
                items.push((e as u32, slot));
            }
            let views = self.views(b, &st, layer, &items)?;
            if tables.len() <= layer {
                tables.resize_with(layer + 1, || None);
            }
            tables[layer] = b.expert_table(&views).ok().flatten();
        }
        Ok(tables)
    }

    /// Promotes a loaded working slot; with an exclusive host tier, the expert it evicts
    /// goes down there (a touch, or a device -> host copy started now: its GPU slot still
    /// holds it, and no copy into that slot is queued before it).
    fn promote(&self, b: &CudaBackend, st: &mut State, slot: usize) -> Result<()> {
        let victim = st.table.promotion_victim(slot);
        let evicted = st.table.promote(slot).evicted();
        let (Some(key), Some(from), true) = (evicted, victim, self.exclusive) else { return Ok(()) };
        match self.host.demote_begin(key) {
            Demotion::Kept => st.traffic.demotions_kept += 1,
            Demotion::Dropped => {}
            Demotion::Copy { slot: host_slot, generation, dst } => {
                let base = st.device.as_ref().expect("the device slab exists").slab.ptr();
                // SAFETY: `dst` is the host slot's `slot_bytes` (phase Loading: untouched by
                // anyone else until `demote_finish`), inside the slab the host tier owns.
                let dst = unsafe { std::slice::from_raw_parts_mut(dst, self.slot_bytes) };
                match b.copy_to_host(dst, base + (from * self.slot_bytes) as u64) {
                    Ok(fence) => {
                        st.traffic.demotions_copied += 1;
                        st.traffic.demotion_bytes += self.slot_bytes as u64;
                        st.demoting.push(Demoting { from: Some(from), host_slot, generation, fence });
                    }
                    Err(e) => {
                        self.host.demote_finish(host_slot, generation, false);
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Queues what follows on the compute stream (a copy into GPU slot `slot`) behind the
    /// device -> host copies still reading that slot.
    fn after_demotions_from(b: &CudaBackend, st: &mut State, slot: usize) -> Result<()> {
        for d in st.demoting.iter_mut().filter(|d| d.from == Some(slot)) {
            b.queue_after(&d.fence)?;
            d.from = None;
        }
        Ok(())
    }

    /// Waits for the device -> host copies in flight and hands their slots to the host
    /// tier (a failed copy frees its slot and fails the caller).
    fn settle_demotions(&self, st: &mut State) -> Result<()> {
        let mut first_err = None;
        for d in st.demoting.drain(..) {
            let copied = d.fence.wait();
            self.host.demote_finish(d.host_slot, d.generation, copied.is_ok());
            if let (Err(e), None) = (copied, &first_err) {
                first_err = Some(e);
            }
        }
        first_err.map_or(Ok(()), |e| Err(anyhow!("device -> host copy of an evicted expert: {e:#}")))
    }

    fn run_layer(
        &self,
        b: &CudaBackend,
        st: &mut State,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<CudaBackend>) -> Result<()>,
    ) -> Result<()> {
        self.ensure_device(b, st)?;
        st.table.tick();
        st.table.record_uses(layer, experts.iter().map(|&e| e as usize));
        let mut hits: Vec<(u32, usize)> = Vec::new();
        let mut misses: Vec<u32> = Vec::new();
        for &e in experts {
            match st.table.lookup((layer, e as usize)) {
                Some(slot) => {
                    st.table.lease(slot);
                    hits.push((e, slot));
                }
                None => misses.push(e),
            }
        }
        st.traffic.hits += hits.len() as u64;
        st.traffic.misses += misses.len() as u64;
        let result = match hits.is_empty() {
            true => Ok(()),
            false => self.views(b, st, layer, &hits).and_then(|views| compute(&GpuReady { items: &hits, views })),
        };
        // Queued on the stream: a later copy into these slots waits for these kernels.
        let mut promoted = Ok(());
        for &(_, slot) in &hits {
            st.table.release(slot);
            if st.table.slot(slot).role == SlotRole::Working && promoted.is_ok() {
                promoted = self.promote(b, st, slot);
            }
        }
        result?;
        promoted?;
        if misses.is_empty() {
            // Nothing for the host tier to read here: the next layer's prefetches start.
            self.host.start_deferred_prefetches();
            return Ok(());
        }
        self.bring_in(b, st, layer, &misses, compute)
    }
}

impl Drop for GpuExperts {
    /// Device -> host copies still in flight write into the host slab and read the device
    /// slab, both freed after this: wait for them first.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for d in st.demoting.drain(..) {
            let _ = d.fence.wait();
        }
    }
}

impl DeviceTier for GpuExperts {
    /// This window's report; the traffic counters start over.
    fn take_report(&self) -> DeviceTierReport {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // A turn's demotions land in the host tier before its report (and its repins).
        if let Err(e) = self.settle_demotions(&mut st) {
            eprintln!("warning: GPU expert tier: {e:#}");
        }
        let traffic = std::mem::take(&mut st.traffic);
        let looked = traffic.hits + traffic.misses;
        DeviceTierReport {
            device: st.name.clone(),
            plan: self.plan,
            resident_all: self.resident_all,
            hit_rate: (looked > 0).then(|| traffic.hits as f64 / looked as f64),
            traffic,
            slots: st.table.snapshot(),
            eviction: st.table.eviction(),
            eviction_scope: st.table.scope(),
        }
    }
}

impl ExpertProvider<CudaBackend> for GpuExperts {
    fn record(&self, layer: usize, ids: &[u32], top_k: usize) {
        ExpertProvider::<strata_backend::cpu::CpuBackend>::record(self.host.as_ref(), layer, ids, top_k);
    }

    fn run(
        &self,
        b: &CudaBackend,
        layer: usize,
        experts: &[u32],
        compute: &mut dyn FnMut(&dyn ReadyExperts<CudaBackend>) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.run_layer(b, &mut st, layer, experts, compute).map_err(|e| anyhow!("GPU expert tier: {e:#}"))
    }

    fn drops_misses(&self) -> bool {
        ExpertProvider::<strata_backend::cpu::CpuBackend>::drops_misses(self.host.as_ref())
    }

    fn wants_prediction(&self) -> bool {
        ExpertProvider::<strata_backend::cpu::CpuBackend>::wants_prediction(self.host.as_ref())
    }

    fn device_table(&self, b: &CudaBackend, layer: usize, selections: usize) -> Result<Option<&CudaExpertTable>> {
        if !self.dispatches_by_id() {
            return Ok(None);
        }
        let tables = match self.tables.get() {
            Some(t) => t,
            None => {
                let built = self.build_tables(b).map_err(|e| anyhow!("GPU expert tier: {e:#}"))?;
                self.tables.get_or_init(|| built)
            }
        };
        let table = tables.get(layer).and_then(Option::as_ref);
        if table.is_some() {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            st.traffic.hits += selections as u64;
            st.traffic.by_id += selections as u64;
        }
        Ok(table)
    }

    fn two_step_prediction(&self) -> bool {
        ExpertProvider::<strata_backend::cpu::CpuBackend>::two_step_prediction(self.host.as_ref())
    }

    /// Advisory: the host tier prefetches (or hints) the predicted experts this tier does
    /// not hold (the ones it holds will not miss; reading them would only take disk time).
    fn predicted(&self, layer: usize, ids: &[u32], top_k: usize) {
        // (This tier's lock, then the host tier's: the order demotions take too.)
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.host.predicted_skipping(layer, ids, top_k, &|e| st.table.peek((layer, e)).is_some());
    }
}

//! The host tier under a device tier, kept exclusive: it holds what the device lost, not
//! a second copy of what the device holds. With LRU in both tiers an inclusive host tier
//! repeats the device's order and serves few of its misses (a 256-expert, top-8 routing
//! trace, tiers of 26.7% and 27% of the experts: 5.5% host hits and 34% disk reads, against
//! 23% and 17% exclusive; `strata replay --host-slots-per-layer`, docs/performance.md).
//!
//! - What this tier hands up, it cools: a hit becomes its layer's first victim, a read
//!   stays in its working slot (not promoted) until the slot is reused.
//! - What the device evicts comes back down ([`StreamedExperts::demote_begin`]): kept when
//!   this tier still holds it (touched, or promoted out of its working slot), else a
//!   device -> host copy into its layer's LRU victim slot (the working bank may be busy
//!   with the batch being handed up), ready once [`StreamedExperts::demote_finish`] says
//!   the copy is done.

use super::StreamedExperts;
use strata_residency::{Eviction, ExpertKey, Keep};

/// What became of an expert the device evicted.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum Demotion {
    /// This tier still held it: touched, or promoted out of its working slot.
    Kept,
    /// Copy the device's bytes into `dst` (`slot`'s bytes, page-locked when the device
    /// tier registered the slab), then call [`StreamedExperts::demote_finish`].
    Copy { slot: usize, generation: u64, dst: *mut u8 },
    /// Every slot of its layer loading or leased (or the expert already on its way in):
    /// dropped.
    Dropped,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl StreamedExperts {
    /// Whether this tier sits under a device tier that demotes into it (exclusive tiers).
    pub(crate) fn set_below_device(&self, on: bool) {
        self.below_device.store(on, std::sync::atomic::Ordering::Relaxed);
        // It sees only the device's misses: recency of those is all it can go by.
        self.state.lock().unwrap().table.set_eviction(if on { Eviction::Lru } else { self.eviction });
    }

    /// The eviction the runtime was asked for (a device tier in front of it applies it).
    pub fn eviction(&self) -> Eviction {
        self.eviction
    }

    /// The eviction scope, which both tiers follow.
    pub fn eviction_scope(&self) -> strata_residency::EvictionScope {
        self.state.lock().unwrap().table.scope()
    }

    pub(crate) fn below_device(&self) -> bool {
        self.below_device.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The device tier evicted `key`: keep it here (see [`Demotion`]).
    pub(crate) fn demote_begin(&self, key: ExpertKey) -> Demotion {
        let mut st = self.state.lock().unwrap();
        match st.table.keep(key) {
            Keep::Kept => return Demotion::Kept,
            Keep::Loading => return Demotion::Dropped,
            Keep::Absent => {}
        }
        match st.table.begin_demotion(key) {
            // SAFETY (for the caller's write): the slot is in phase Loading, so nothing
            // reads or writes it until `demote_finish`.
            Some((slot, generation)) => Demotion::Copy {
                slot,
                generation,
                dst: unsafe { self.slab.as_ptr().add(slot * self.slot_bytes) as *mut u8 },
            },
            None => Demotion::Dropped,
        }
    }

    /// The copy of a [`Demotion::Copy`] is done (`copied`: it succeeded): the expert is
    /// ready in its layer's slot; else the slot is freed.
    pub(crate) fn demote_finish(&self, slot: usize, generation: u64, copied: bool) {
        let mut st = self.state.lock().unwrap();
        if !(copied && st.table.finish_load(slot, generation)) {
            st.table.fail_load(slot, generation);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{ContainerSource, PilotMode, RuntimeOptions, StreamedExperts, UsageSetting};
    use strata_kernels::QuantKind;
    use strata_models::convert::{convert, ConvertOptions};
    use strata_residency::{plan, ExpertKey, PlanInput, SlotPhase, SlotRole};

    /// strata-tiny's experts in an int8 container, streamed through 2 slots a layer and 8
    /// working slots.
    fn tiny_streamed(pilot: PilotMode) -> (tempfile::TempDir, std::sync::Arc<StreamedExperts>) {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let dir = tempfile::tempdir().unwrap();
        let opts = ConvertOptions { experts: QuantKind::Int8Row, mtp_experts: QuantKind::Int8Row };
        convert(&root.join("models/strata-tiny"), dir.path(), &opts, &mut |_, _| {}).unwrap();
        let source = ContainerSource::open(dir.path(), "main").unwrap();
        let slot_bytes = crate::ExpertSource::slot_bytes(&source) as u64;
        let layers = crate::ExpertSource::layers(&source).len();
        let p = plan(PlanInput {
            budget_bytes: u64::MAX / 4,
            fixed_bytes: 0,
            slot_bytes,
            sparse_layers: layers,
            working_slots: 8,
            pinned_experts: 0,
            max_slots_per_layer: Some(2),
        })
        .unwrap();
        let rt = RuntimeOptions { working_slots: 8, usage: UsageSetting::Off, pilot, ..Default::default() };
        let streamed = StreamedExperts::new(Box::new(source), p, &[], None, &rt, None).unwrap();
        (dir, std::sync::Arc::new(streamed))
    }

    /// A prediction's experts that a tier in front holds are not prefetched here (they
    /// will not miss), but the whole prediction is kept for scoring. The rest are read
    /// surest rank first, once the current layer has started its own reads.
    #[test]
    fn predictions_held_above_are_not_prefetched() {
        let (_dir, rt) = tiny_streamed(PilotMode::Prefetch);
        let (current, next) = (rt.layers().0[0], rt.layers().0[1]);
        rt.predicted_skipping(next, &[1, 2, 3, 4, 5, 6, 7, 8], 4, &|e| e <= 2 || e == 7);
        {
            let st = rt.state.lock().unwrap();
            let deferred: Vec<usize> = st.deferred.iter().map(|k| k.1).collect();
            assert_eq!(deferred, [5, 6, 3, 4, 8], "rank by rank over the rows");
            assert!(st.prefetch.is_empty(), "nothing read before the current layer's own reads");
            assert_eq!(st.pending[&next].1, [vec![1, 2, 3, 4], vec![5, 6, 7, 8]], "scored on every row");
        }
        rt.run_slots(current, &[9, 10], &mut |_| Ok(())).unwrap();
        let st = rt.state.lock().unwrap();
        let mut fetched: Vec<ExpertKey> = st.prefetch.keys().copied().chain(st.landed.iter().copied()).collect();
        fetched.sort_unstable();
        assert_eq!(fetched, [3, 4, 5, 6, 8].map(|e| (next, e)), "started after the current layer's reads");
        assert!(st.deferred.is_empty());
    }

    /// strata-tiny's experts streamed (2 slots a layer, 8 working) with the host tier under
    /// a device tier: what it hands up is cooled or left unpromoted, what comes down is
    /// kept (touched, or copied into a slot and promoted).
    #[test]
    fn a_host_tier_under_a_device_keeps_what_comes_down_not_what_goes_up() {
        let (_dir, rt) = tiny_streamed(PilotMode::Off);
        let layer = rt.layers().0[0];
        let role = |e: usize| {
            let st = rt.state.lock().unwrap();
            st.table
                .peek((layer, e))
                .map(|s| (st.table.slot(s).role, st.table.slot(s).phase, st.table.slot(s).last_use))
        };
        let run = |experts: &[u32]| rt.run_slots(layer, experts, &mut |_| Ok(())).unwrap();

        // Not under a device: reads are promoted into the layer's slots.
        run(&[3, 4]);
        assert!(matches!(role(3), Some((SlotRole::Layer(_), SlotPhase::Ready, _))));
        rt.set_below_device(true);
        // Under it: a read stays in its working slot; a hit is cooled (last use 0).
        run(&[3, 5]);
        assert!(matches!(role(5), Some((SlotRole::Working, SlotPhase::Ready, _))), "{:?}", role(5));
        assert!(matches!(role(3), Some((SlotRole::Layer(_), SlotPhase::Ready, 0))), "{:?}", role(3));

        // An eviction the tier still holds is touched, or promoted out of its working slot.
        assert!(matches!(rt.demote_begin((layer, 3)), super::Demotion::Kept));
        assert!(matches!(role(3), Some((SlotRole::Layer(_), _, t)) if t > 0));
        assert!(matches!(rt.demote_begin((layer, 5)), super::Demotion::Kept));
        assert!(matches!(role(5), Some((SlotRole::Layer(_), SlotPhase::Ready, _))), "{:?}", role(5));
        // One it lost is copied straight into a slot of its layer.
        let super::Demotion::Copy { slot, generation, dst } = rt.demote_begin((layer, 9)) else {
            panic!("expert 9 is absent: it should be copied down");
        };
        assert!(!dst.is_null());
        assert!(matches!(role(9), Some((SlotRole::Layer(_), SlotPhase::Loading, _))));
        assert!(matches!(rt.demote_begin((layer, 9)), super::Demotion::Dropped), "already on its way");
        rt.demote_finish(slot, generation, true);
        assert!(matches!(role(9), Some((SlotRole::Layer(_), SlotPhase::Ready, _))), "{:?}", role(9));
        // A failed copy frees its slot.
        let super::Demotion::Copy { slot, generation, .. } = rt.demote_begin((layer, 11)) else { panic!() };
        rt.demote_finish(slot, generation, false);
        assert_eq!(role(11), None);
        rt.state.lock().unwrap().table.check_invariants().unwrap();
    }
}

//! The runtime's own policy, replayed: the same [`SlotTable`] the expert runtime drives,
//! in the runtime's order (`StreamedExperts::forward` in strata-engine), so a replay of
//! a trace reproduces the runtime's hits and misses on that trace.
//!
//! Per access group (one forward at one layer), as the runtime does:
//! 1. `tick` (the runtime ticks once per MoE layer call) and `record_uses` (LFRU heat);
//! 2. in ascending expert id: `lookup`; a hit is `lease`d (and, when it sits in a working
//!    slot, remembered for promotion); a miss is queued;
//! 3. waves: `begin_load` misses while a working slot is free, then for each in turn
//!    `finish_load` and `promote` (a miss is computed before its promotion, so a later
//!    miss of the same forward may evict it; with every layer slot leased it stays in
//!    the working bank, where later lookups still hit it);
//! 4. `release` the hits, then `promote` the hits found in working slots.
//!
//! Pins are `pin`ned and loaded before the first access, as at start-up.

use crate::plan::{PlanInput, ResidencyPlan};
use crate::slots::{Eviction, EvictionScope, SlotPhase, SlotRole, SlotTable};
use crate::ExpertKey;

/// Hits, misses and I/O waves of one replay.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlabTally {
    pub hits: u64,
    pub misses: u64,
    pub waves: u64,
    /// Misses that found no free working slot at all (every one leased): the runtime
    /// fails that forward; replay counts them as misses that cache nothing.
    pub stalled: u64,
    /// Misses left out instead of read (approximate decode); not in `misses`.
    pub skipped: u64,
}

/// A slot table laid out for `layers` at `slots_per_layer`, `working` and `pins.len()`
/// pinned slots, with the pins resident, evicting by `eviction` within `scope`.
pub(crate) fn table(
    layers: &[usize],
    slots_per_layer: usize,
    working: usize,
    pins: &[ExpertKey],
    eviction: Eviction,
    scope: EvictionScope,
) -> SlotTable {
    let working = working.max(1);
    let input = PlanInput {
        budget_bytes: u64::MAX,
        fixed_bytes: 0,
        slot_bytes: 1,
        sparse_layers: layers.len(),
        working_slots: working,
        pinned_experts: pins.len(),
        max_slots_per_layer: Some(slots_per_layer.max(1)),
    };
    let total = working + pins.len() + layers.len() * slots_per_layer.max(1);
    let plan = ResidencyPlan {
        input,
        slots_per_layer: slots_per_layer.max(1),
        total_slots: total,
        slab_bytes: total as u64,
        headroom_bytes: 0,
    };
    let mut table = SlotTable::new(&plan, layers);
    table.set_eviction(eviction);
    table.set_scope(scope);
    for &key in pins {
        if let Ok(slot) = table.pin(key) {
            if table.slot(slot).phase == SlotPhase::Loading {
                let generation = table.slot(slot).generation;
                table.finish_load(slot, generation);
            }
        }
    }
    table
}

/// Looks `experts` up in ascending order (after a `tick`), leasing the hits; counts both.
/// Returns the leased slots and the missed experts, ascending.
pub(crate) fn lease_hits(
    table: &mut SlotTable,
    layer: usize,
    experts: &[usize],
    tally: &mut SlabTally,
) -> (Vec<usize>, Vec<usize>) {
    let mut sorted = experts.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    table.tick();
    table.record_uses(layer, sorted.iter().copied());
    let mut hits = Vec::new();
    let mut misses = Vec::new();
    for e in sorted {
        match table.lookup((layer, e)) {
            Some(slot) => {
                table.lease(slot);
                hits.push(slot);
            }
            None => misses.push(e),
        }
    }
    tally.hits += hits.len() as u64;
    tally.misses += misses.len() as u64;
    (hits, misses)
}

/// The tier above a slab (the GPU tier of a two-tier replay): called with each batch of
/// experts the slab hands up, their slots leased, as the engine's `run_slots` computes
/// them (its hits, then each wave of reads).
pub(crate) type HandUp<'a> = dyn FnMut(&mut SlotTable, &[usize]) + 'a;

/// One forward of one layer over its unique `experts` (any order; the runtime visits
/// them ascending). With `up`, the slab is a host tier handing every expert up, in the
/// engine's order (the first wave of reads submitted, the hits handed up, then each wave
/// as it lands, leased meanwhile). `below_device`: that tier is kept exclusive of the
/// one above: its hits are cooled (the layer's first victims) and its reads are not
/// promoted (each stays in its working slot until the slot is reused, unless the tier
/// above demotes it meanwhile).
/// `skip`: experts a miss leaves out instead of reading (the runtime's
/// `--skip-misses-from-rank`: a one-row forward's low ranks).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_layer(
    table: &mut SlotTable,
    layer: usize,
    experts: &[usize],
    skip: &[usize],
    tally: &mut SlabTally,
    mut up: Option<&mut HandUp<'_>>,
    below_device: bool,
) {
    let (hits, mut misses) = lease_hits(table, layer, experts, tally);
    let before = misses.len();
    misses.retain(|e| !skip.contains(e));
    let skipped = (before - misses.len()) as u64;
    tally.skipped += skipped;
    tally.misses -= skipped;
    let hit_keys: Vec<usize> = hits.iter().map(|&slot| table.slot(slot).key.expect("a hit holds its key").1).collect();
    let mut to_promote = Vec::new();
    for (&slot, &e) in hits.iter().zip(&hit_keys) {
        if below_device {
            table.cool((layer, e));
        } else if table.slot(slot).role == SlotRole::Working {
            to_promote.push(slot);
        }
    }
    let mut pending = misses.into_iter().peekable();
    let mut submit = |table: &mut SlotTable, tally: &mut SlabTally| {
        let mut wave = Vec::new();
        while let Some(&e) = pending.peek() {
            let Some((slot, generation)) = table.begin_load((layer, e)) else { break };
            pending.next();
            wave.push((e, slot, generation));
        }
        if wave.is_empty() {
            tally.stalled += pending.by_ref().count() as u64;
        } else {
            tally.waves += 1;
        }
        wave
    };
    let mut wave = submit(table, tally);
    if let Some(up) = up.as_mut() {
        if !hit_keys.is_empty() {
            up(table, &hit_keys);
        }
    }
    while !wave.is_empty() {
        let mut landed = Vec::new();
        for (e, slot, generation) in wave {
            if !table.finish_load(slot, generation) {
                continue;
            }
            match up {
                Some(_) => {
                    table.lease(slot);
                    landed.push((e, slot));
                }
                None => {
                    table.promote(slot);
                }
            }
        }
        if let Some(up) = up.as_mut() {
            let experts: Vec<usize> = landed.iter().map(|&(e, _)| e).collect();
            up(table, &experts);
            for &(_, slot) in &landed {
                table.release(slot);
                // Demoted meanwhile, it may hold a layer slot already.
                if !below_device && table.slot(slot).role == SlotRole::Working {
                    table.promote(slot);
                }
            }
        }
        wave = submit(table, tally);
    }
    for &slot in &hits {
        table.release(slot);
    }
    for slot in to_promote {
        table.promote(slot);
    }
}

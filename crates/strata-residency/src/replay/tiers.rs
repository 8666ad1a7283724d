//! Two tiers replayed: a GPU slab of expert slots in front of the host slab, as the CUDA
//! backend runs them (`GpuExperts` in strata-engine). Per access group (one forward at
//! one layer):
//! 1. GPU: `tick`; each expert is looked up; hits are leased, then released (hits found
//!    in working slots are promoted);
//! 2. the GPU's misses, if any, go to the host slab exactly as the CPU runtime serves a
//!    layer (`slab::forward_layer`): a host hit costs a copy, a host miss a disk read;
//! 3. every GPU miss is loaded into a free GPU working slot (in chunks of the GPU's
//!    working bank), then promoted into the layer's GPU slots;
//! 4. exclusive tiers (the engine's default) keep in the host slab what the GPU lost, not
//!    a second copy of what it holds: in step 2 the host's hits are cooled (made their
//!    layer's first victims) and its disk reads are not promoted (each stays in its host
//!    working slot until that is reused); each expert a GPU promotion evicts is demoted:
//!    kept in the host slab when it still holds it (touched, or promoted out of a working
//!    slot), else copied down into its layer's LRU victim slot (dropped when every one is
//!    loading or leased). Inclusive tiers (`STRATA_HOST_TIER=inclusive`) do neither, and
//!    the host slab repeats the GPU's LRU.
//!
//! Steps 2-4 interleave as in the engine: the host hands its batches up (hits, then each
//! wave of reads) with their slots leased, and each batch goes into the GPU's slots then.
//!
//! Eviction: LRU in both tiers, or (the `lfru` row) LFRU on the GPU, which sees every
//! use, over an LRU host tier, as the engine runs `--eviction lfru` under a GPU.
//!
//! Pins: the GPU tier pins the trace's `gpu.pinned` most selected keys, the host tier the
//! next `host.pinned` (a key pinned on the GPU never reaches the host).

use serde::Serialize;

use super::slab::{self, SlabTally};
use super::{group, most_selected, ReplayConfig};
use crate::slots::{Eviction, Keep, SlotRole, SlotTable};
use crate::trace::TraceRecord;

/// Where the accesses of a two-tier replay were served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TiersResult {
    /// Unique (forward, layer, expert) accesses.
    pub accesses: u64,
    pub gpu_hits: u64,
    /// GPU misses found in the host slab (a host -> GPU copy each).
    pub host_hits: u64,
    /// GPU misses read from disk (a disk read and a copy each).
    pub disk_reads: u64,
    /// GPU misses the host would have read from disk, left out instead (approximate
    /// decode, `skip_misses_from_rank`).
    pub skipped: u64,
    /// Fractions of `accesses`.
    pub gpu_hit_rate: f64,
    pub host_hit_rate: f64,
    pub disk_rate: f64,
    pub skip_rate: f64,
    /// GPU slots (working + pinned + layer slots) and host slots.
    pub gpu_slots: usize,
    pub host_slots: usize,
    /// Exclusive tiers: GPU evictions the host still held (touched there, or promoted out
    /// of a working slot), and those copied down into it (a device -> host copy each).
    pub demotions_kept: u64,
    pub demotions_copied: u64,
    /// Access groups (one forward at one layer) by where their GPU misses came from:
    /// `[host hits, disk reads, groups]`, ascending. What a layer waits for depends on
    /// both counts together (the disk reads overlap the host hits' copies), so a timing
    /// model needs this mix, not only the totals (`scripts/replay_tiers.py` prices it).
    pub layer_mix: Vec<[u64; 3]>,
}

/// LRU in both tiers, and the same with pins; exclusive tiers (the engine's default) and
/// inclusive ones; LFRU on the GPU over an exclusive LRU host tier.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TiersReport {
    pub gpu: ReplayConfig,
    pub host: ReplayConfig,
    pub lru: TiersResult,
    pub lfru: TiersResult,
    pub pinned_lru: TiersResult,
    pub inclusive_lru: TiersResult,
    pub inclusive_pinned_lru: TiersResult,
}

/// Replays `records` through a GPU tier at `gpu`'s capacity in front of a host tier at
/// `host`'s.
pub fn replay_tiers(records: &[TraceRecord], gpu: &ReplayConfig, host: &ReplayConfig) -> TiersReport {
    let g = group(records);
    let run = |gpu_pins: usize, host_pins: usize, exclusive: bool, eviction: Eviction| {
        let ranked = most_selected(records, gpu_pins + host_pins);
        let (gp, hp) = ranked.split_at(gpu_pins.min(ranked.len()));
        let mut gpu_table = slab::table(&g.layers, gpu.slots_per_layer, gpu.working, gp, eviction, gpu.scope);
        let mut host_table = slab::table(&g.layers, host.slots_per_layer, host.working, hp, Eviction::Lru, host.scope);
        let mut gpu_tally = SlabTally::default();
        let mut host_tally = SlabTally::default();
        let mut demoted = Demoted::default();
        let mut mix = std::collections::BTreeMap::<(u64, u64), u64>::new();
        for a in &g.accesses {
            let layer = g.layers[a.layer_pos];
            let host = exclusive.then_some(&mut host_table);
            let misses = gpu_lookup(&mut gpu_table, layer, &a.experts, &mut gpu_tally, host, &mut demoted);
            let before = (host_tally.hits, host_tally.misses);
            if !misses.is_empty() {
                // Each batch the host hands up is copied into the GPU's slots (and what
                // that evicts demoted) while the batch is still leased, as in the engine.
                let mut up = |host: &mut SlotTable, batch: &[usize]| {
                    gpu_bring_in(&mut gpu_table, layer, batch, exclusive.then_some(host), &mut demoted);
                };
                let skip = a.skippable(gpu.skip_misses_from_rank);
                slab::forward_layer(&mut host_table, layer, &misses, skip, &mut host_tally, Some(&mut up), exclusive);
            }
            *mix.entry((host_tally.hits - before.0, host_tally.misses - before.1)).or_default() += 1;
        }
        let accesses = gpu_tally.hits + gpu_tally.misses;
        let rate = |n: u64| if accesses == 0 { 0.0 } else { n as f64 / accesses as f64 };
        let slots = |c: &ReplayConfig, pins: usize| c.working.max(1) + pins + g.layers.len() * c.slots_per_layer.max(1);
        TiersResult {
            accesses,
            gpu_hits: gpu_tally.hits,
            host_hits: host_tally.hits,
            disk_reads: host_tally.misses,
            gpu_hit_rate: rate(gpu_tally.hits),
            host_hit_rate: rate(host_tally.hits),
            disk_rate: rate(host_tally.misses),
            skipped: host_tally.skipped,
            skip_rate: rate(host_tally.skipped),
            gpu_slots: slots(gpu, gp.len()),
            host_slots: slots(host, hp.len()),
            demotions_kept: demoted.kept,
            demotions_copied: demoted.copied,
            layer_mix: mix.into_iter().map(|((h, d), n)| [h, d, n]).collect(),
        }
    };
    TiersReport {
        gpu: *gpu,
        host: *host,
        lru: run(0, 0, true, Eviction::Lru),
        lfru: run(0, 0, true, gpu.lfru()),
        pinned_lru: run(gpu.pinned, host.pinned, true, Eviction::Lru),
        inclusive_lru: run(0, 0, false, Eviction::Lru),
        inclusive_pinned_lru: run(gpu.pinned, host.pinned, false, Eviction::Lru),
    }
}

#[derive(Default)]
struct Demoted {
    kept: u64,
    copied: u64,
}

/// Promotes GPU working slot `slot`; with `host` (exclusive tiers), the expert it evicts
/// goes down there (step 4): kept (touched, or promoted out of a working slot) or copied
/// down, as `GpuExperts::promote` and `StreamedExperts::demote_begin` do.
fn promote(gpu: &mut SlotTable, slot: usize, host: Option<&mut SlotTable>, demoted: &mut Demoted) {
    let (Some(key), Some(host)) = (gpu.promote(slot).evicted(), host) else { return };
    match host.keep(key) {
        Keep::Kept => demoted.kept += 1,
        Keep::Absent => {
            if let Some((slot, generation)) = host.begin_demotion(key) {
                host.finish_load(slot, generation);
                demoted.copied += 1;
            }
        }
        Keep::Loading => {}
    }
}

/// Step 1: the GPU's hits (leased, released, working ones promoted, what they evict
/// demoted to `host`); returns the misses in ascending order.
fn gpu_lookup(
    table: &mut SlotTable,
    layer: usize,
    experts: &[usize],
    tally: &mut SlabTally,
    mut host: Option<&mut SlotTable>,
    demoted: &mut Demoted,
) -> Vec<usize> {
    let (hits, misses) = slab::lease_hits(table, layer, experts, tally);
    for slot in hits {
        table.release(slot);
        if table.slot(slot).role == SlotRole::Working {
            promote(table, slot, host.as_deref_mut(), demoted);
        }
    }
    misses
}

/// Step 3: each miss copied into a GPU working slot, chunk by chunk, then promoted; with
/// `host`, each expert a promotion evicts is demoted there (step 4).
fn gpu_bring_in(
    table: &mut SlotTable,
    layer: usize,
    misses: &[usize],
    mut host: Option<&mut SlotTable>,
    demoted: &mut Demoted,
) {
    let mut i = 0;
    while i < misses.len() {
        let mut chunk = Vec::new();
        while let Some(&e) = misses.get(i) {
            let Some(loading) = table.begin_load((layer, e)) else { break };
            chunk.push(loading);
            i += 1;
        }
        if chunk.is_empty() {
            return; // the engine fails such a forward; the plan's working bank prevents it
        }
        for &(slot, generation) in &chunk {
            table.finish_load(slot, generation);
            table.lease(slot);
        }
        for (slot, _) in chunk {
            table.release(slot);
            promote(table, slot, host.as_deref_mut(), demoted);
        }
    }
}

impl std::fmt::Display for TiersReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "tiers: GPU {} slots per layer, {} working, {} pinned; host {} slots per layer, {} working, {} pinned",
            self.gpu.slots_per_layer,
            self.gpu.working,
            self.gpu.pinned,
            self.host.slots_per_layer,
            self.host.working,
            self.host.pinned
        )?;
        writeln!(
            f,
            "{:<18} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "policy", "GPU slots", "host slots", "GPU hits", "host hits", "disk"
        )?;
        for (name, r) in [
            ("LRU", &self.lru),
            ("LFRU (GPU)", &self.lfru),
            ("pinned+LRU", &self.pinned_lru),
            ("LRU, inclusive", &self.inclusive_lru),
            ("pinned+LRU, incl.", &self.inclusive_pinned_lru),
        ] {
            writeln!(
                f,
                "{:<18} {:>10} {:>10} {:>9.2}% {:>9.2}% {:>9.2}%",
                name,
                r.gpu_slots,
                r.host_slots,
                r.gpu_hit_rate * 100.0,
                r.host_hit_rate * 100.0,
                r.disk_rate * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cfg, single_rows};
    use super::*;
    use crate::TestRng;

    fn rows(layer: usize, forwards: &[Vec<usize>]) -> Vec<TraceRecord> {
        single_rows(layer, &forwards.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }

    #[test]
    fn experts_that_fit_the_gpu_miss_once() {
        let trace = rows(2, &vec![vec![1, 2, 3]; 5]);
        let r = replay_tiers(&trace, &cfg(4, 2, 0), &cfg(4, 2, 0)).lru;
        assert_eq!((r.accesses, r.gpu_hits, r.host_hits, r.disk_reads), (15, 12, 0, 3));
        assert_eq!((r.gpu_slots, r.host_slots), (6, 6));
    }

    #[test]
    fn a_cycle_too_big_for_the_gpu_is_served_by_the_host_after_the_cold_reads() {
        // Six experts cycle through a GPU of 2 layer slots + 1 working; the host holds all.
        let forwards: Vec<Vec<usize>> = (0..30).map(|i| vec![i % 6]).collect();
        let r = replay_tiers(&rows(0, &forwards), &cfg(2, 1, 0), &cfg(8, 2, 0)).lru;
        assert_eq!(r.accesses, 30);
        assert_eq!(r.disk_reads, 6, "only the first use of each expert reads the disk");
        assert_eq!(r.gpu_hits, 0, "LRU over a cycle longer than the GPU tier never hits it");
        assert_eq!(r.host_hits, 24);
        assert!((r.gpu_hit_rate + r.host_hit_rate + r.disk_rate - 1.0).abs() < 1e-12);
    }

    #[test]
    fn exclusive_tiers_keep_what_the_gpu_evicts() {
        // A cycle of 6 experts over a GPU of 2 layer slots + 1 working and a host of 5 + 1
        // (one more than the cycle needs: the host expert being handed up is leased while
        // the GPU's eviction comes down): together they hold the cycle once the host keeps
        // the GPU's victims (exclusive), not a second copy of the GPU's experts (inclusive:
        // the host's LRU order is the GPU's, so it has lost each expert when the GPU has).
        let forwards: Vec<Vec<usize>> = (0..60).map(|i| vec![i % 6]).collect();
        let t = replay_tiers(&rows(0, &forwards), &cfg(2, 1, 0), &cfg(5, 1, 0));
        assert_eq!(t.inclusive_lru.disk_reads, 60, "inclusive: every use reads the disk");
        assert_eq!(t.lru.disk_reads, 6, "exclusive: only the first use of each expert");
        assert_eq!(t.lru.host_hits, 54);
        assert_eq!(t.lru.layer_mix, vec![[0, 1, 6], [1, 0, 54]], "six cold reads, then one host hit a forward");
        assert!(t.lru.demotions_copied + t.lru.demotions_kept > 0);
        assert_eq!((t.inclusive_lru.demotions_copied, t.inclusive_lru.demotions_kept), (0, 0));
    }

    #[test]
    fn pins_keep_the_hottest_expert_on_the_gpu() {
        // Expert 7 in every forward, the rest a long cycle that flushes an LRU of 1 slot.
        let forwards: Vec<Vec<usize>> = (0..40).map(|i| vec![7, 10 + i % 9]).collect();
        let t = replay_tiers(&rows(1, &forwards), &cfg(1, 1, 1), &cfg(2, 1, 0));
        assert_eq!(t.pinned_lru.gpu_hits, 40, "the pinned expert hits in every forward");
        assert!(t.pinned_lru.gpu_hits > t.lru.gpu_hits, "{t:?}");
        assert_eq!(t.pinned_lru.gpu_slots, t.lru.gpu_slots + 1);
    }

    #[test]
    fn every_access_is_served_once_on_random_traces() {
        let mut rng = TestRng::new(11);
        for _ in 0..20 {
            let mut trace = Vec::new();
            for f in 0..60u64 {
                for layer in [3usize, 5, 9] {
                    let experts: Vec<usize> = (0..4).map(|_| rng.below(24)).collect();
                    trace.push(TraceRecord { segment: (f / 20) as u32, forward: f, row: 0, layer, experts });
                }
            }
            let gpu = cfg(1 + rng.below(6), 1 + rng.below(4), rng.below(5));
            let host = cfg(1 + rng.below(10), 1 + rng.below(4), rng.below(5));
            let t = replay_tiers(&trace, &gpu, &host);
            let accesses = crate::replay(&trace, &gpu).accesses;
            for r in [t.lru, t.lfru, t.pinned_lru, t.inclusive_lru, t.inclusive_pinned_lru] {
                assert_eq!(r.accesses, accesses);
                assert_eq!(r.gpu_hits + r.host_hits + r.disk_reads + r.skipped, r.accesses, "{gpu:?} {host:?}");
                // The layer mix accounts for every group, host hit and disk read.
                let sum = |i: usize| r.layer_mix.iter().map(|m| if i == 2 { m[2] } else { m[i] * m[2] }).sum::<u64>();
                assert_eq!((sum(2), sum(0), sum(1)), (180, r.host_hits, r.disk_reads), "{gpu:?} {host:?}");
                // Every distinct key is read from disk at least once.
                let distinct: std::collections::HashSet<(usize, usize)> =
                    trace.iter().flat_map(|t| t.experts.iter().map(move |&e| (t.layer, e))).collect();
                assert!(r.disk_reads >= distinct.len() as u64 - (gpu.pinned + host.pinned) as u64);
            }
        }
    }
}

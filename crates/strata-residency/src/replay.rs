//! Offline replay of a route trace against residency policies, judged against the
//! offline optimum at the same capacity (`strata replay`).
//!
//! Access model (the runtime's): the routes of all rows of one forward at one layer
//! are deduplicated; each unique expert is one access, a hit if it is resident when the
//! forward reaches the layer. Policies:
//!
//! - **LRU**: the runtime itself: the same [`SlotTable`](crate::SlotTable) driven in the
//!   runtime's order (see `replay/slab.rs`): misses load into the working bank in waves
//!   of free working slots and are promoted into the layer's `slots_per_layer` slots by
//!   role swap (victim: an empty slot, else the oldest last use, ties to the lowest
//!   slot; the forward's hits are leased and never victims); an expert that found no
//!   victim stays in the working bank and still hits until that slot is reused. So the
//!   runtime's effective capacity is the layer slots plus whatever the working bank
//!   still holds, and this row reproduces its hit rate on the same trace.
//! - **pinned+LRU**: the runtime with the `pinned` most selected (layer, expert) keys of
//!   the trace pinned (in `pinned` extra slots) before the first access.
//! - **LFRU**: the runtime with LFRU eviction (`--eviction lfru`: uses decayed by half
//!   every `lfru_half_life` forwards, see `slots/heat.rs`) in place of LRU.
//! - **LFRU/turn** (offline comparison, no working bank): evict the lowest
//!   `heat * 256 + max(0, 255 - age)`; heat counts every selection (before dedup) and
//!   halves at each new segment (turn); age counts selections since the expert's last one.
//! - **Belady** (offline optimum with bypass, `slots_per_layer` per layer, or all layers'
//!   slots together under the global scope; no working bank): after each forward keep the
//!   experts whose next use is soonest; a miss may skip caching. It bounds LFRU from
//!   above; the runtime rows may beat it thanks to the working bank and pins.
//! - **Belady-nobypass**: the same without bypass: every missed expert is admitted
//!   (up to `slots_per_layer` per forward, soonest next use first), evicting the
//!   residents used farthest in the future.
//!
//! `waves` counts I/O waves: for the runtime rows the waves the slot table formed (a
//! wave holds the misses that found a free working slot); for the offline rows each
//! access group's misses in chunks of `working`.

mod slab;
mod tiers;

pub use tiers::{replay_tiers, TiersReport, TiersResult};

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::Serialize;

use crate::slots::{Eviction, EvictionScope};
use crate::trace::TraceRecord;
use crate::ExpertKey;

/// Capacity to replay at.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReplayConfig {
    pub slots_per_layer: usize,
    /// Working bank size (wave width); 0 is treated as 1.
    pub working: usize,
    /// Pinned slots for pinned+LRU.
    pub pinned: usize,
    /// Half-life of the LFRU rows' heat, in forwards (the runtime's `--eviction lfru:H`).
    pub lfru_half_life: f64,
    /// Approximate decode, as the runtime's `--skip-misses-from-rank R`: in one-row
    /// forwards the runtime rows leave out misses of rank R or lower (in a two-tier replay,
    /// the host's misses, i.e. disk reads; the GPU config's setting applies).
    pub skip_misses_from_rank: Option<usize>,
    /// Where the runtime rows' slot tables find a victim (the runtime's `--eviction-scope`).
    pub scope: EvictionScope,
}

impl ReplayConfig {
    /// At a capacity, LFRU at its default half-life, nothing skipped, the runtime's
    /// default scope.
    pub fn new(slots_per_layer: usize, working: usize, pinned: usize) -> Self {
        ReplayConfig {
            slots_per_layer,
            working,
            pinned,
            lfru_half_life: Eviction::DEFAULT_HALF_LIFE,
            skip_misses_from_rank: None,
            scope: EvictionScope::default(),
        }
    }

    fn lfru(&self) -> Eviction {
        Eviction::Lfru { half_life: self.lfru_half_life }
    }
}

/// One policy's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyResult {
    pub name: String,
    /// Expert slots the policy keeps (layers x slots per layer, plus pins).
    pub slots: usize,
    pub hits: u64,
    pub misses: u64,
    /// Misses left out instead of read (`skip_misses_from_rank`; runtime rows only).
    pub skipped: u64,
    /// hits / (hits + misses + skipped); 0 for an empty trace.
    pub hit_rate: f64,
    pub waves: u64,
}

/// The replay table (`Display`) and its JSON (`Serialize`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    pub config: ReplayConfig,
    pub records: usize,
    /// Selections before dedup.
    pub selections: u64,
    /// Unique (forward, layer, expert) accesses after dedup.
    pub accesses: u64,
    pub forwards: usize,
    pub segments: usize,
    pub layers: usize,
    /// LRU (the runtime's slot table), LFRU (the same with LFRU eviction), LFRU/turn,
    /// pinned+LRU (the runtime's, with pins), Belady (with bypass), Belady-nobypass, in
    /// that order.
    pub policies: Vec<PolicyResult>,
    /// A GPU tier in front of a host tier (`strata replay --host-slots-per-layer`): the
    /// GPU at `config`'s capacity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TiersReport>,
}

impl ReplayReport {
    pub fn policy(&self, name: &str) -> Option<&PolicyResult> {
        self.policies.iter().find(|p| p.name == name)
    }
}

impl ReplayReport {
    /// Pretty JSON for `strata replay --json`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a replay report always serializes")
    }
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "route trace: {} records, {} forwards, {} segments, {} layers; {} selections, {} accesses after dedup",
            self.records, self.forwards, self.segments, self.layers, self.selections, self.accesses
        )?;
        writeln!(
            f,
            "capacity: {} slots per layer, {} working, {} pinned; runtime rows evict within the {} scope",
            self.config.slots_per_layer, self.config.working, self.config.pinned, self.config.scope
        )?;
        writeln!(
            f,
            "{:<16} {:>8} {:>12} {:>12} {:>9} {:>10}",
            "policy", "slots", "hits", "misses", "hit rate", "waves"
        )?;
        for p in &self.policies {
            writeln!(
                f,
                "{:<16} {:>8} {:>12} {:>12} {:>8.2}% {:>10}",
                p.name,
                p.slots,
                p.hits,
                p.misses,
                p.hit_rate * 100.0,
                p.waves
            )?;
        }
        if let Some(tiers) = &self.tiers {
            write!(f, "{tiers}")?;
        }
        Ok(())
    }
}

/// The unique experts one forward needs at one layer.
struct Access {
    segment: u32,
    /// Forward ordinal + 1 (the LRU clock).
    time: u64,
    layer_pos: usize,
    /// Every selection, in row-major router order (LFRU heat).
    selections: Vec<usize>,
    /// Rows (records) of the forward at this layer.
    rows: u32,
    /// Deduplicated in stable first-selection order.
    experts: Vec<usize>,
}

impl Access {
    /// The experts a miss leaves out under `--skip-misses-from-rank R`: in a one-row
    /// forward, those the router ranked R or lower (a row lists them best first).
    fn skippable(&self, from_rank: Option<usize>) -> &[usize] {
        match from_rank {
            Some(r) if self.rows == 1 && r >= 1 => &self.selections[(r - 1).min(self.selections.len())..],
            _ => &[],
        }
    }
}

struct Grouped {
    accesses: Vec<Access>,
    layers: Vec<usize>,
    forwards: usize,
    segments: usize,
}

/// Groups records into per-(segment, forward, layer) accesses in first-appearance order.
fn group(records: &[TraceRecord]) -> Grouped {
    let mut layers: Vec<usize> = records.iter().map(|r| r.layer).collect();
    layers.sort_unstable();
    layers.dedup();
    let layer_pos: HashMap<usize, usize> = layers.iter().enumerate().map(|(i, &l)| (l, i)).collect();
    let mut forwards: HashMap<(u32, u64), u64> = HashMap::new();
    let mut groups: HashMap<(u32, u64, usize), usize> = HashMap::new();
    let mut seen: HashSet<(usize, usize)> = HashSet::new();
    let mut segments: Vec<u32> = Vec::new();
    let mut accesses: Vec<Access> = Vec::new();
    for r in records {
        let next = forwards.len() as u64 + 1;
        let time = *forwards.entry((r.segment, r.forward)).or_insert(next);
        let index = *groups.entry((r.segment, r.forward, r.layer)).or_insert_with(|| {
            accesses.push(Access {
                segment: r.segment,
                time,
                layer_pos: layer_pos[&r.layer],
                selections: Vec::new(),
                rows: 0,
                experts: Vec::new(),
            });
            accesses.len() - 1
        });
        if segments.last() != Some(&r.segment) {
            segments.push(r.segment);
        }
        let access = &mut accesses[index];
        access.rows += 1;
        for &e in &r.experts {
            access.selections.push(e);
            if seen.insert((index, e)) {
                access.experts.push(e);
            }
        }
    }
    segments.sort_unstable();
    segments.dedup();
    Grouped { accesses, layers, forwards: forwards.len(), segments: segments.len() }
}

#[derive(Default)]
struct Tally {
    hits: u64,
    misses: u64,
    skipped: u64,
    waves: u64,
}

impl Tally {
    fn add(&mut self, hits: usize, misses: usize, working: usize) {
        self.hits += hits as u64;
        self.misses += misses as u64;
        self.waves += misses.div_ceil(working) as u64;
    }

    fn result(self, name: &str, slots: usize) -> PolicyResult {
        let total = self.hits + self.misses + self.skipped;
        PolicyResult {
            name: name.to_string(),
            slots,
            hits: self.hits,
            misses: self.misses,
            skipped: self.skipped,
            hit_rate: if total == 0 { 0.0 } else { self.hits as f64 / total as f64 },
            waves: self.waves,
        }
    }
}

/// Session heat with lazy halving per segment, and selection-clock recency, in dense
/// per-layer tables (the victim scan reads them for every resident slot).
#[derive(Default)]
struct Lfru {
    /// [layer position][expert] -> (heat, epoch it was last brought up to date, last
    /// selection clock)
    state: Vec<Vec<(u32, u32, u64)>>,
    clock: u64,
    epoch: u32,
}

impl Lfru {
    fn entry(&self, layer_pos: usize, expert: usize) -> (u32, u32, u64) {
        self.state.get(layer_pos).and_then(|row| row.get(expert)).copied().unwrap_or((0, 0, 0))
    }

    fn heat(&self, layer_pos: usize, expert: usize) -> u32 {
        let (h, epoch, _) = self.entry(layer_pos, expert);
        h.checked_shr(self.epoch - epoch).unwrap_or(0)
    }

    fn record(&mut self, layer_pos: usize, expert: usize) {
        let heat = self.heat(layer_pos, expert).saturating_add(1);
        self.clock += 1;
        if self.state.len() <= layer_pos {
            self.state.resize(layer_pos + 1, Vec::new());
        }
        let row = &mut self.state[layer_pos];
        if row.len() <= expert {
            row.resize(expert + 1, (0, 0, 0));
        }
        row[expert] = (heat, self.epoch, self.clock);
    }

    fn score(&self, layer_pos: usize, expert: usize) -> u64 {
        let last = self.entry(layer_pos, expert).2;
        self.heat(layer_pos, expert) as u64 * 256 + 255u64.saturating_sub(self.clock - last)
    }
}

/// The runtime's slot table (LRU or LFRU; with `pins`, pinned) over the trace.
fn runtime(g: &Grouped, cfg: &ReplayConfig, pins: &[ExpertKey], eviction: Eviction) -> Tally {
    let mut table = slab::table(&g.layers, cfg.slots_per_layer, cfg.working, pins, eviction, cfg.scope);
    let mut tally = slab::SlabTally::default();
    for a in &g.accesses {
        let skip = a.skippable(cfg.skip_misses_from_rank);
        slab::forward_layer(&mut table, g.layers[a.layer_pos], &a.experts, skip, &mut tally, None, false);
    }
    Tally { hits: tally.hits, misses: tally.misses, skipped: tally.skipped, waves: tally.waves }
}

/// LFRU over per-layer slot banks (an offline comparison: no working bank).
fn lfru(g: &Grouped, cfg: &ReplayConfig) -> Tally {
    let cap = cfg.slots_per_layer;
    let working = cfg.working.max(1);
    let mut lfru = Lfru::default();
    let mut banks: Vec<Vec<Option<usize>>> = vec![vec![None; cap]; g.layers.len()];
    let mut last_use: Vec<Vec<u64>> = vec![vec![0; cap]; g.layers.len()];
    let mut protected = vec![false; cap];
    let mut segment = None;
    let mut tally = Tally::default();
    for a in &g.accesses {
        if segment.is_some_and(|s| s != a.segment) {
            lfru.epoch += 1; // turn boundary: heat halves
        }
        for &e in &a.selections {
            lfru.record(a.layer_pos, e);
        }
        segment = Some(a.segment);
        let (bank, last) = (&mut banks[a.layer_pos], &mut last_use[a.layer_pos]);
        protected.fill(false);
        let mut hits = 0;
        let mut missed = Vec::new();
        for &e in &a.experts {
            if let Some(i) = bank.iter().position(|&s| s == Some(e)) {
                hits += 1;
                last[i] = a.time;
                protected[i] = true;
            } else {
                missed.push(e);
            }
        }
        for &e in &missed {
            let victim = (0..cap).filter(|&i| !protected[i]).min_by_key(|&i| {
                let rank = bank[i].map_or(0, |k| lfru.score(a.layer_pos, k));
                (bank[i].is_some(), rank, i)
            });
            if let Some(i) = victim {
                bank[i] = Some(e);
                last[i] = a.time;
                protected[i] = true;
            }
        }
        tally.add(hits, missed.len(), working);
    }
    tally
}

/// Belady's optimum per layer, or over all layers' slots together under the global scope
/// (no floor: a bound on what any global policy keeps). With `bypass`: after each access
/// group keep the `cap` experts (of the resident set and the group) whose next use is
/// soonest; never-used-again ones go. Without: the group's experts are admitted first (the
/// `cap` soonest when there are more), then the residents used soonest fill what is left.
fn belady(g: &Grouped, cfg: &ReplayConfig, bypass: bool) -> Tally {
    const NEVER: usize = usize::MAX;
    let global = cfg.scope == EvictionScope::Global;
    let cap = cfg.slots_per_layer * if global { g.layers.len() } else { 1 };
    let bank = |layer_pos: usize| if global { 0 } else { layer_pos };
    let working = cfg.working.max(1);
    // Next use of each (access, expert), as an access index, scanning backwards.
    let mut next_use: Vec<Vec<usize>> = vec![Vec::new(); g.accesses.len()];
    let mut upcoming: Vec<HashMap<usize, usize>> = vec![HashMap::new(); g.layers.len()];
    for (i, a) in g.accesses.iter().enumerate().rev() {
        let map = &mut upcoming[a.layer_pos];
        next_use[i] = a.experts.iter().map(|e| map.get(e).copied().unwrap_or(NEVER)).collect();
        for &e in &a.experts {
            map.insert(e, i);
        }
    }
    // Resident (layer position, expert) -> next use, per bank.
    let mut resident: Vec<HashMap<(usize, usize), usize>> = vec![HashMap::new(); g.layers.len()];
    let mut tally = Tally::default();
    let mut pool: Vec<(usize, (usize, usize))> = Vec::new();
    for (i, a) in g.accesses.iter().enumerate() {
        let cache = &mut resident[bank(a.layer_pos)];
        let key = |e: usize| (a.layer_pos, e);
        let hits = a.experts.iter().filter(|&&e| cache.contains_key(&key(e))).count();
        tally.add(hits, a.experts.len() - hits, working);
        if bypass {
            for (&e, &next) in a.experts.iter().zip(&next_use[i]) {
                cache.insert(key(e), next);
            }
            pool.clear();
            pool.extend(cache.iter().map(|(&e, &next)| (next, e)).filter(|&(next, _)| next != NEVER));
            pool.sort_unstable();
            pool.truncate(cap);
            cache.clear();
            cache.extend(pool.iter().map(|&(next, e)| (e, next)));
        } else {
            let mut admitted: Vec<(usize, (usize, usize))> =
                next_use[i].iter().copied().zip(a.experts.iter().map(|&e| key(e))).collect();
            admitted.sort_unstable();
            admitted.truncate(cap);
            for (_, k) in &admitted {
                cache.remove(k);
            }
            pool.clear();
            pool.extend(cache.iter().map(|(&e, &next)| (next, e)));
            pool.sort_unstable();
            pool.truncate(cap - admitted.len());
            cache.clear();
            cache.extend(admitted.iter().chain(pool.iter()).map(|&(next, e)| (e, next)));
        }
    }
    tally
}

/// The `n` most selected keys of the trace (ties: layer, then expert).
fn most_selected(records: &[TraceRecord], n: usize) -> Vec<ExpertKey> {
    let mut counts: HashMap<ExpertKey, u64> = HashMap::new();
    for r in records {
        for &e in &r.experts {
            *counts.entry((r.layer, e)).or_default() += 1;
        }
    }
    let mut ranked: Vec<(ExpertKey, u64)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.into_iter().take(n).map(|(k, _)| k).collect()
}

/// Replays `records` (in trace order) under every policy at `cfg`'s capacity.
pub fn replay(records: &[TraceRecord], cfg: &ReplayConfig) -> ReplayReport {
    let g = group(records);
    let layer_slots = g.layers.len() * cfg.slots_per_layer;
    let pins = most_selected(records, cfg.pinned);
    let policies = vec![
        runtime(&g, cfg, &[], Eviction::Lru).result("LRU", layer_slots),
        runtime(&g, cfg, &[], cfg.lfru()).result("LFRU", layer_slots),
        lfru(&g, cfg).result("LFRU/turn", layer_slots),
        runtime(&g, cfg, &pins, Eviction::Lru).result("pinned+LRU", layer_slots + pins.len()),
        belady(&g, cfg, true).result("Belady", layer_slots),
        belady(&g, cfg, false).result("Belady-nobypass", layer_slots),
    ];
    ReplayReport {
        config: *cfg,
        records: records.len(),
        selections: g.accesses.iter().map(|a| a.selections.len() as u64).sum(),
        accesses: g.accesses.iter().map(|a| a.experts.len() as u64).sum(),
        forwards: g.forwards,
        segments: g.segments,
        layers: g.layers.len(),
        policies,
        tiers: None,
    }
}

#[cfg(test)]
mod tests;

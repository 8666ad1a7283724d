//! The slot table: which expert occupies which slab slot, and in what state.
//!
//! Slots are numbered `0..total_slots`: the working bank first, then the pinned bank,
//! then each sparse layer's LRU bank (layer-major, in `sparse_layers` order). The
//! integrator maps slot `i` to slab bytes `[i * slot_bytes, (i + 1) * slot_bytes)`;
//! roles move between slots (promotion swaps roles, never bytes), so after start-up the
//! numbering says nothing about a slot's current role: ask [`SlotTable::slot`].
//!
//! A miss goes: [`SlotTable::begin_load`] (a free working slot, phase Loading, a fresh
//! generation) -> the I/O -> [`SlotTable::finish_load`] (Ready; rejected when stale) ->
//! [`SlotTable::lease`] / [`SlotTable::release`] around the compute ->
//! [`SlotTable::promote`] (the working slot takes the role of the layer's LRU victim).
//! A hit is [`SlotTable::lookup`] + lease/release. Keep a forward's hits leased while
//! its misses are promoted: leased slots are never victims, so one forward never evicts
//! an expert it is using.
//!
//! Invariants (checked by [`SlotTable::check_invariants`], tested after every operation
//! of random operation sequences):
//! 1. the key index maps `k -> s` exactly when slot `s` holds key `k`; keys are unique;
//! 2. a slot holds a key exactly when its phase is not Idle;
//! 3. a slot is Leased exactly when its lease count is positive;
//! 4. a `Layer(l)` slot holds only keys of layer `l`; Loading happens in Working and
//!    Pinned slots, and in Layer slots only by [`SlotTable::begin_demotion`]; Disabled
//!    slots are Idle;
//! 5. every sparse layer keeps at least one layer slot; the working and pinned banks
//!    keep their planned sizes; layer + disabled slots = `sparse_layers * slots_per_layer`
//!    (capacity only moves from Layer to Disabled, and between layers under
//!    [`EvictionScope::Global`]);
//! 6. generations never exceed the table's counter and differ between occupied slots;
//!    last uses never exceed the clock;
//! 7. a layer's victim kept for global choices is the one a scan of its bank finds.

use std::collections::HashMap;

use serde::Serialize;

use crate::plan::ResidencyPlan;
use crate::ExpertKey;

mod heat;
mod victims;
pub use heat::Eviction;
use heat::Heat;
pub use victims::EvictionScope;

/// What a slot is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotRole {
    /// The global miss/scratch bank: misses load here, then promote.
    Working,
    /// One of a layer's LRU slots (model layer id).
    Layer(usize),
    /// Holds a pinned expert; never evicted.
    Pinned,
    /// Decommitted under memory pressure; holds nothing, ever again.
    Disabled,
}

/// Where a slot's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotPhase {
    /// Empty.
    Idle,
    /// A read is in flight into it.
    Loading,
    /// Holds a complete expert.
    Ready,
    /// Holds a complete expert that compute is reading; not evictable.
    Leased,
}

/// One slot's state (read-only view via [`SlotTable::slot`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotInfo {
    pub role: SlotRole,
    pub phase: SlotPhase,
    pub key: Option<ExpertKey>,
    /// Bumped on every (re)assignment of the slot's storage.
    pub generation: u64,
    /// The table clock at the last lookup hit, lease, load completion or promotion.
    pub last_use: u64,
    pub leases: u32,
}

/// Result of [`SlotTable::promote`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    /// The expert took an empty layer slot; nothing was evicted.
    Filled,
    /// The expert took the layer's LRU victim; that expert was evicted.
    Evicted(ExpertKey),
    /// Every slot of the layer is leased: the expert stays in its working slot (still a
    /// hit) until [`SlotTable::begin_load`] reuses that slot.
    NoVictim,
}

impl Promotion {
    pub fn evicted(self) -> Option<ExpertKey> {
        match self {
            Promotion::Evicted(key) => Some(key),
            _ => None,
        }
    }
}

/// Result of [`SlotTable::keep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Held ready: touched, or promoted out of the working bank.
    Kept,
    /// Not in the table: bring its bytes in ([`SlotTable::begin_demotion`]) to keep it.
    Absent,
    /// On its way in (a read or another copy in flight): nothing to do.
    Loading,
}

/// Counts by role and phase plus the event counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SlotSnapshot {
    pub clock: u64,
    pub generation: u64,
    pub total: usize,
    pub working: usize,
    pub layer: usize,
    pub pinned: usize,
    pub disabled: usize,
    pub idle: usize,
    pub loading: usize,
    pub ready: usize,
    pub leased: usize,
    pub hits: u64,
    /// Demand loads begun ([`SlotTable::begin_load`]).
    pub misses: u64,
    /// Pin loads begun ([`SlotTable::pin`] of a non-resident expert).
    pub pin_loads: u64,
    pub evictions: u64,
    pub pressure_evictions: u64,
    /// Slots decommitted by pressure correction (with or without an expert in them).
    pub decommitted: u64,
    pub repin_swaps: u64,
    /// Completions rejected because the slot was reassigned meanwhile.
    pub stale_completions: u64,
}

/// One occupied slot in the residency map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResidencyEntry {
    pub slot: usize,
    pub layer: usize,
    pub expert: usize,
    pub role: SlotRole,
    pub phase: SlotPhase,
    pub last_use: u64,
}

/// The slab's slot bookkeeping. See the module docs for the protocol and invariants.
#[derive(Debug, Clone)]
pub struct SlotTable {
    slots: Vec<SlotInfo>,
    layers: Vec<usize>,
    layer_pos: HashMap<usize, usize>,
    /// Slot ids with role `Layer(layers[i])`, per layer position `i`.
    layer_slots: Vec<Vec<usize>>,
    /// Slot ids with role `Working` (so a miss scans the bank, not the slab).
    working: Vec<usize>,
    /// Every slot that holds a key, in any phase.
    index: HashMap<ExpertKey, usize>,
    planned_working: usize,
    planned_pinned: usize,
    planned_layer_slots: usize,
    clock: u64,
    generation: u64,
    counters: SlotSnapshot,
    eviction: Eviction,
    heat: Heat,
    scope: EvictionScope,
    /// Per layer position, its victim as last found (None: changed since; see victims.rs).
    best: Vec<Option<Option<usize>>>,
}

impl SlotTable {
    /// Lays out `plan.total_slots` slots: working, pinned, then each layer's bank.
    ///
    /// Panics if `sparse_layers` does not list `plan.input.sparse_layers` distinct layers
    /// (a wiring error, not a runtime condition).
    pub fn new(plan: &ResidencyPlan, sparse_layers: &[usize]) -> Self {
        let input = &plan.input;
        assert_eq!(
            sparse_layers.len(),
            input.sparse_layers,
            "slot table: {} sparse layer ids for a plan of {} sparse layers",
            sparse_layers.len(),
            input.sparse_layers
        );
        let layer_pos: HashMap<usize, usize> = sparse_layers.iter().enumerate().map(|(i, &l)| (l, i)).collect();
        assert_eq!(layer_pos.len(), sparse_layers.len(), "slot table: duplicate sparse layer ids");
        let empty = |role| SlotInfo { role, phase: SlotPhase::Idle, key: None, generation: 0, last_use: 0, leases: 0 };
        let mut slots = Vec::with_capacity(plan.total_slots);
        slots.extend((0..input.working_slots).map(|_| empty(SlotRole::Working)));
        slots.extend((0..input.pinned_experts).map(|_| empty(SlotRole::Pinned)));
        let mut layer_slots = Vec::with_capacity(sparse_layers.len());
        for &layer in sparse_layers {
            let first = slots.len();
            slots.extend((0..plan.slots_per_layer).map(|_| empty(SlotRole::Layer(layer))));
            layer_slots.push((first..slots.len()).collect());
        }
        assert_eq!(slots.len(), plan.total_slots, "slot table: plan total_slots is inconsistent");
        SlotTable {
            slots,
            layers: sparse_layers.to_vec(),
            layer_pos,
            layer_slots,
            working: (0..input.working_slots).collect(),
            index: HashMap::new(),
            planned_working: input.working_slots,
            planned_pinned: input.pinned_experts,
            planned_layer_slots: plan.layer_slots(),
            clock: 0,
            generation: 0,
            counters: SlotSnapshot::default(),
            eviction: Eviction::Lru,
            heat: Heat::default(),
            scope: EvictionScope::Layer,
            best: vec![None; sparse_layers.len()],
        }
    }

    /// How layers pick their victims from now on (LRU until set); forgets past heat.
    pub fn set_eviction(&mut self, eviction: Eviction) {
        self.eviction = eviction;
        self.heat = Heat::new(eviction, self.layers.len());
        self.stale_all();
    }

    pub fn eviction(&self) -> Eviction {
        self.eviction
    }

    /// The experts one forward routes to at `layer` (once each, after its `tick`): their
    /// heat under LFRU eviction; nothing under LRU. Hits and loads do not count uses: a
    /// prefetch is not one, and a tier below a device sees only the device's misses.
    pub fn record_uses(&mut self, layer: usize, experts: impl IntoIterator<Item = usize>) {
        if self.heat.enabled() {
            let mut rescaled = false;
            experts.into_iter().for_each(|e| rescaled |= self.heat.add((layer, e), self.clock));
            match rescaled {
                true => self.stale_all(),
                false => self.stale_layer(layer),
            }
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// One slot's state. Panics when out of range.
    pub fn slot(&self, slot: usize) -> &SlotInfo {
        &self.slots[slot]
    }

    pub fn sparse_layers(&self) -> &[usize] {
        &self.layers
    }

    /// Current slots of a layer (fewer under pressure; under the global scope, as many as
    /// its demand won), or None if not sparse.
    pub fn layer_capacity(&self, layer: usize) -> Option<usize> {
        self.layer_pos.get(&layer).map(|&i| self.layer_slots[i].len())
    }

    /// The slot holding `key` in any phase, without touching its last use.
    pub fn peek(&self, key: ExpertKey) -> Option<usize> {
        self.index.get(&key).copied()
    }

    /// The keys currently held by pinned slots (loading or ready), sorted.
    pub fn pinned_keys(&self) -> Vec<ExpertKey> {
        let mut keys: Vec<_> = self.slots.iter().filter(|s| s.role == SlotRole::Pinned).filter_map(|s| s.key).collect();
        keys.sort_unstable();
        keys
    }

    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Advances the clock: once per forward. Uses within one forward share a time;
    /// LRU ties go to the lowest slot id.
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.generation
    }

    fn is_sparse(&self, layer: usize) -> bool {
        self.layer_pos.contains_key(&layer)
    }

    /// A hit: the slot holding `key` ready (or already leased), with its last use
    /// touched. None when absent or still loading.
    pub fn lookup(&mut self, key: ExpertKey) -> Option<usize> {
        let slot = *self.index.get(&key)?;
        let s = &mut self.slots[slot];
        if !matches!(s.phase, SlotPhase::Ready | SlotPhase::Leased) {
            return None;
        }
        s.last_use = self.clock;
        self.counters.hits += 1;
        self.stale_slot(slot);
        Some(slot)
    }

    /// Starts a miss: takes a free working slot (an empty one first, else the ready one
    /// with the oldest last use, ties to the lowest id; a ready working slot holds an
    /// unpromoted expert, which is dropped), assigns `key`, phase Loading, and a fresh
    /// generation. Read into the slot, then call [`Self::finish_load`] or
    /// [`Self::fail_load`] with that generation.
    ///
    /// None when the key is already in the table (look it up, or wait for its load) or
    /// every working slot is loading or leased (finish the wave first).
    /// Panics when `key.0` is not a sparse layer of this table.
    pub fn begin_load(&mut self, key: ExpertKey) -> Option<(usize, u64)> {
        assert!(self.is_sparse(key.0), "begin_load: layer {} is not a sparse layer", key.0);
        if self.index.contains_key(&key) {
            return None;
        }
        let slot = self.free_working_slot()?;
        if let Some(old) = self.slots[slot].key.take() {
            self.index.remove(&old);
        }
        self.counters.misses += 1;
        Some((slot, self.start_loading(slot, key)))
    }

    /// `slot` (emptied by the caller) takes `key`, phase Loading, a fresh generation.
    fn start_loading(&mut self, slot: usize, key: ExpertKey) -> u64 {
        let generation = self.next_generation();
        let s = &mut self.slots[slot];
        s.key = Some(key);
        s.phase = SlotPhase::Loading;
        s.generation = generation;
        self.index.insert(key, slot);
        self.stale_slot(slot);
        generation
    }

    fn free_working_slot(&self) -> Option<usize> {
        self.working
            .iter()
            .map(|&i| (i, &self.slots[i]))
            .filter(|(_, s)| matches!(s.phase, SlotPhase::Idle | SlotPhase::Ready))
            .min_by_key(|&(i, s)| (s.phase != SlotPhase::Idle, s.last_use, i))
            .map(|(i, _)| i)
    }

    /// Publishes a completed read. False (and nothing changes) when `generation` is
    /// stale: the slot was reassigned since the read was submitted.
    pub fn finish_load(&mut self, slot: usize, generation: u64) -> bool {
        let clock = self.clock;
        let s = &mut self.slots[slot];
        if s.generation != generation || s.phase != SlotPhase::Loading {
            self.counters.stale_completions += 1;
            return false;
        }
        s.phase = SlotPhase::Ready;
        s.last_use = clock;
        self.stale_slot(slot);
        true
    }

    /// A read failed: the slot is emptied (a pinned slot loses its pin). Stale calls
    /// are ignored; returns whether the call applied.
    pub fn fail_load(&mut self, slot: usize, generation: u64) -> bool {
        let s = &self.slots[slot];
        if s.generation != generation || s.phase != SlotPhase::Loading {
            self.counters.stale_completions += 1;
            return false;
        }
        self.empty_slot(slot);
        true
    }

    /// Empties a slot (index, key, phase) and retires its generation.
    fn empty_slot(&mut self, slot: usize) -> Option<ExpertKey> {
        let generation = self.next_generation();
        let s = &mut self.slots[slot];
        let key = s.key.take();
        s.phase = SlotPhase::Idle;
        s.leases = 0;
        s.generation = generation;
        if let Some(k) = key {
            self.index.remove(&k);
        }
        self.stale_slot(slot);
        key
    }

    /// Marks a ready slot as read by compute (counted; nests). Panics unless the slot
    /// is Ready or Leased.
    pub fn lease(&mut self, slot: usize) {
        let clock = self.clock;
        let s = &mut self.slots[slot];
        assert!(matches!(s.phase, SlotPhase::Ready | SlotPhase::Leased), "lease: slot {slot} is {:?}", s.phase);
        s.leases += 1;
        s.phase = SlotPhase::Leased;
        s.last_use = clock;
        self.stale_slot(slot);
    }

    /// Ends one lease. Panics unless the slot is Leased.
    pub fn release(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        assert_eq!(s.phase, SlotPhase::Leased, "release: slot {slot} is not leased");
        s.leases -= 1;
        if s.leases == 0 {
            s.phase = SlotPhase::Ready;
        }
        self.stale_slot(slot);
    }

    /// The slot [`Self::promote`] of `slot` would take (and whose expert it would evict),
    /// or None when it would find no victim. Changes no slot.
    pub fn promotion_victim(&mut self, slot: usize) -> Option<usize> {
        let layer = self.slots[slot].key?.0;
        self.victim_for(layer)
    }

    /// A tier below a device keeps `key`, which the device has just evicted: held ready
    /// in a working slot, it is promoted into its layer's slots; in a layer or pinned
    /// slot, touched. No hit is counted.
    pub fn keep(&mut self, key: ExpertKey) -> Keep {
        let Some(&slot) = self.index.get(&key) else { return Keep::Absent };
        match self.slots[slot].phase {
            SlotPhase::Ready | SlotPhase::Leased if self.slots[slot].role == SlotRole::Working => {
                self.promote(slot);
                Keep::Kept
            }
            SlotPhase::Ready | SlotPhase::Leased => {
                self.touch(key);
                Keep::Kept
            }
            _ => Keep::Loading,
        }
    }

    /// Starts bringing `key` straight into one of its layer's slots (a tier below a device
    /// takes back an expert the device evicted, copied from the device while the tier's
    /// working bank may be busy): the layer's LRU victim (neither loading nor leased) is
    /// emptied, its expert evicted, and assigned `key`, phase Loading, a fresh generation.
    /// Publish with [`Self::finish_load`] or [`Self::fail_load`]. None when `key` is in the
    /// table or every slot of the layer is loading or leased.
    /// Panics when `key.0` is not a sparse layer of this table.
    pub fn begin_demotion(&mut self, key: ExpertKey) -> Option<(usize, u64)> {
        assert!(self.is_sparse(key.0), "begin_demotion: layer {} is not a sparse layer", key.0);
        if self.index.contains_key(&key) {
            return None;
        }
        let slot = self.victim_for(key.0)?;
        if self.empty_slot(slot).is_some() {
            self.counters.evictions += 1;
        }
        if self.slots[slot].role != SlotRole::Layer(key.0) {
            self.leave_bank(slot);
            self.join_bank(slot, key.0);
        }
        Some((slot, self.start_loading(slot, key)))
    }

    /// Marks `key` as used now without counting a hit. False when `key` is absent or not
    /// yet loaded.
    pub fn touch(&mut self, key: ExpertKey) -> bool {
        let Some(&slot) = self.index.get(&key) else { return false };
        let s = &mut self.slots[slot];
        if !matches!(s.phase, SlotPhase::Ready | SlotPhase::Leased) {
            return false;
        }
        s.last_use = self.clock;
        self.stale_slot(slot);
        true
    }

    /// Makes `key`, held ready in one of its layer's slots, that layer's first victim (a
    /// tier below the device cools the copy it has just handed up: the device holds it
    /// now). False, and nothing changes, for other slots (pinned, working, loading).
    pub fn cool(&mut self, key: ExpertKey) -> bool {
        let Some(&slot) = self.index.get(&key) else { return false };
        let s = &mut self.slots[slot];
        if !matches!(s.role, SlotRole::Layer(_)) || !matches!(s.phase, SlotPhase::Ready | SlotPhase::Leased) {
            return false;
        }
        s.last_use = 0;
        self.stale_slot(slot);
        true
    }

    /// Promotes a loaded miss: the working slot `slot` (Ready or Leased) becomes a slot
    /// of its expert's layer and the layer's victim slot becomes a working slot (empty,
    /// new generation). No bytes move. Panics unless `slot` is a working slot holding a
    /// complete expert.
    pub fn promote(&mut self, slot: usize) -> Promotion {
        let s = &self.slots[slot];
        assert!(
            s.role == SlotRole::Working && matches!(s.phase, SlotPhase::Ready | SlotPhase::Leased),
            "promote: slot {slot} is {:?}/{:?}, not a loaded working slot",
            s.role,
            s.phase
        );
        let layer = s.key.expect("loaded slots hold a key").0;
        let Some(victim) = self.victim_for(layer) else {
            return Promotion::NoVictim;
        };
        let evicted = self.empty_slot(victim);
        if evicted.is_some() {
            self.counters.evictions += 1;
        }
        self.leave_bank(victim);
        self.slots[victim].role = SlotRole::Working;
        self.slots[slot].last_use = self.clock;
        self.join_bank(slot, layer);
        self.replace_in_bank(SlotRole::Working, slot, victim);
        match evicted {
            Some(key) => Promotion::Evicted(key),
            None => Promotion::Filled,
        }
    }

    fn free_pinned_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| s.role == SlotRole::Pinned && s.phase == SlotPhase::Idle)
    }

    /// Pins `key` into the pinned bank. If the expert is already resident (ready or
    /// leased, in a working or layer slot), roles swap: its slot becomes pinned and a
    /// free pinned slot takes its old role, empty; the returned slot is then Ready.
    /// Otherwise a free pinned slot is assigned, phase Loading: read the expert into it,
    /// then `finish_load(slot, table.slot(slot).generation)`.
    pub fn pin(&mut self, key: ExpertKey) -> Result<usize, String> {
        let (layer, expert) = key;
        if !self.is_sparse(layer) {
            return Err(format!("cannot pin {layer}:{expert}: layer {layer} is not a sparse layer"));
        }
        let existing = self.index.get(&key).copied();
        if let Some(slot) = existing {
            let s = &self.slots[slot];
            if s.role == SlotRole::Pinned {
                return Err(format!("expert {layer}:{expert} is already pinned"));
            }
            if s.phase == SlotPhase::Loading {
                return Err(format!("expert {layer}:{expert} is loading; pin it once it is ready"));
            }
        }
        let free = self.free_pinned_slot().ok_or_else(|| {
            format!("cannot pin {layer}:{expert}: all {} pinned slots are in use", self.planned_pinned)
        })?;
        match existing {
            Some(slot) => {
                self.swap_roles(slot, free);
                Ok(slot)
            }
            None => {
                self.start_loading(free, key);
                self.counters.pin_loads += 1;
                Ok(free)
            }
        }
    }

    /// `occupied` (working or layer role, holding an expert) becomes pinned; the empty
    /// pinned slot `pinned` takes its old role with a new generation.
    fn swap_roles(&mut self, occupied: usize, pinned: usize) {
        let role = self.slots[occupied].role;
        self.stale_slot(occupied);
        self.slots[occupied].role = SlotRole::Pinned;
        self.empty_slot(pinned);
        self.slots[pinned].role = role;
        self.replace_in_bank(role, occupied, pinned);
    }

    /// `new` takes `old`'s place in the list of slots with `role`.
    fn replace_in_bank(&mut self, role: SlotRole, old: usize, new: usize) {
        let bank = match role {
            SlotRole::Layer(l) => &mut self.layer_slots[self.layer_pos[&l]],
            SlotRole::Working => &mut self.working,
            SlotRole::Pinned | SlotRole::Disabled => return,
        };
        let at = bank.iter().position(|&i| i == old).expect("slot is in its bank");
        bank[at] = new;
    }

    /// Drops a pin: its slot is emptied (the expert leaves the table). Refused while
    /// the slot is loading or leased.
    pub fn unpin(&mut self, key: ExpertKey) -> Result<usize, String> {
        let slot = self.pinned_slot(key)?;
        if self.slots[slot].phase != SlotPhase::Ready {
            return Err(format!("cannot unpin {}:{}: slot {slot} is {:?}", key.0, key.1, self.slots[slot].phase));
        }
        self.empty_slot(slot);
        Ok(slot)
    }

    fn pinned_slot(&self, key: ExpertKey) -> Result<usize, String> {
        match self.index.get(&key) {
            Some(&slot) if self.slots[slot].role == SlotRole::Pinned => Ok(slot),
            _ => Err(format!("expert {}:{} is not pinned", key.0, key.1)),
        }
    }

    /// Live repin by role swap: the resident `hot` expert's slot becomes pinned and the
    /// `cold` pin's slot takes its old role. The cold expert stays resident there as the
    /// layer's next victim (last use 0) when the role is a slot of its own layer,
    /// otherwise it is dropped. `hot` must be Ready/Leased in a working or layer slot
    /// (load it through the miss path first, or use [`Self::unpin`] + [`Self::pin`]).
    /// Returns the slot now holding `hot`.
    pub fn repin(&mut self, cold: ExpertKey, hot: ExpertKey) -> Result<usize, String> {
        let cold_slot = self.pinned_slot(cold)?;
        if self.slots[cold_slot].phase != SlotPhase::Ready {
            return Err(format!("cannot repin: cold pin {}:{} is {:?}", cold.0, cold.1, self.slots[cold_slot].phase));
        }
        let hot_slot = match self.index.get(&hot) {
            Some(&s)
                if matches!(self.slots[s].role, SlotRole::Working | SlotRole::Layer(_))
                    && matches!(self.slots[s].phase, SlotPhase::Ready | SlotPhase::Leased) =>
            {
                s
            }
            _ => return Err(format!("cannot repin: hot expert {}:{} is not resident and ready", hot.0, hot.1)),
        };
        let role = self.slots[hot_slot].role;
        self.stale_slot(hot_slot);
        self.slots[hot_slot].role = SlotRole::Pinned;
        self.slots[cold_slot].role = role;
        self.replace_in_bank(role, hot_slot, cold_slot);
        match role {
            SlotRole::Layer(l) if l == cold.0 => {
                self.slots[cold_slot].last_use = 0;
                self.stale_layer(l);
            }
            SlotRole::Working => self.slots[cold_slot].last_use = 0,
            _ => {
                self.empty_slot(cold_slot);
            }
        }
        self.counters.repin_swaps += 1;
        Ok(hot_slot)
    }

    /// Pressure correction, one step: disables the oldest unpinned layer slot that is
    /// not loading or leased (an empty one first, ties to the lowest id), never taking a
    /// layer below one slot. Returns the slot, whose bytes the caller may now release.
    /// Capacity only shrinks.
    pub fn decommit_one(&mut self) -> Option<usize> {
        let victim = self
            .layer_slots
            .iter()
            .filter(|bank| bank.len() > 1)
            .flat_map(|bank| bank.iter().copied())
            .filter(|&i| matches!(self.slots[i].phase, SlotPhase::Idle | SlotPhase::Ready))
            .min_by_key(|&i| (self.slots[i].phase != SlotPhase::Idle, self.slots[i].last_use, i))?;
        if self.empty_slot(victim).is_some() {
            self.counters.pressure_evictions += 1;
        }
        self.counters.decommitted += 1;
        self.leave_bank(victim);
        self.slots[victim].role = SlotRole::Disabled;
        Some(victim)
    }

    /// Counts by role and phase, and the event counters.
    pub fn snapshot(&self) -> SlotSnapshot {
        let mut snap = self.counters.clone();
        snap.clock = self.clock;
        snap.generation = self.generation;
        snap.total = self.slots.len();
        for s in &self.slots {
            match s.role {
                SlotRole::Working => snap.working += 1,
                SlotRole::Layer(_) => snap.layer += 1,
                SlotRole::Pinned => snap.pinned += 1,
                SlotRole::Disabled => snap.disabled += 1,
            }
            match s.phase {
                SlotPhase::Idle => snap.idle += 1,
                SlotPhase::Loading => snap.loading += 1,
                SlotPhase::Ready => snap.ready += 1,
                SlotPhase::Leased => snap.leased += 1,
            }
        }
        snap
    }

    /// Every slot that holds an expert, by slot id.
    pub fn residency_map(&self) -> Vec<ResidencyEntry> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                let (layer, expert) = s.key?;
                Some(ResidencyEntry { slot, layer, expert, role: s.role, phase: s.phase, last_use: s.last_use })
            })
            .collect()
    }

    /// Verifies the invariants listed in the module docs.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut roles = [0usize; 4];
        let mut generations = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            roles[match s.role {
                SlotRole::Working => 0,
                SlotRole::Pinned => 1,
                SlotRole::Layer(_) => 2,
                SlotRole::Disabled => 3,
            }] += 1;
            if s.key.is_some() == (s.phase == SlotPhase::Idle) {
                return Err(format!("slot {i}: key {:?} in phase {:?}", s.key, s.phase));
            }
            if (s.leases > 0) != (s.phase == SlotPhase::Leased) {
                return Err(format!("slot {i}: {} leases in phase {:?}", s.leases, s.phase));
            }
            if let Some(key) = s.key {
                if self.index.get(&key) != Some(&i) {
                    return Err(format!("slot {i}: key {key:?} indexed at {:?}", self.index.get(&key)));
                }
                if let Some(other) = generations.insert(s.generation, i) {
                    return Err(format!("slots {other} and {i} share generation {}", s.generation));
                }
            }
            match s.role {
                SlotRole::Layer(l) => {
                    let Some(&pos) = self.layer_pos.get(&l) else {
                        return Err(format!("slot {i}: layer {l} is not sparse"));
                    };
                    if !self.layer_slots[pos].contains(&i) {
                        return Err(format!("slot {i}: missing from layer {l}'s bank"));
                    }
                    if s.key.is_some_and(|k| k.0 != l) {
                        return Err(format!("slot {i}: layer {l} slot holds {:?}", s.key));
                    }
                }
                SlotRole::Disabled if s.phase != SlotPhase::Idle => {
                    return Err(format!("slot {i}: disabled slot is {:?}", s.phase));
                }
                _ => {}
            }
            if s.generation > self.generation || s.last_use > self.clock {
                return Err(format!("slot {i}: generation/last use from the future"));
            }
        }
        if self.index.len() != self.slots.iter().filter(|s| s.key.is_some()).count() {
            return Err("key index has entries for no slot".into());
        }
        for (pos, bank) in self.layer_slots.iter().enumerate() {
            let l = self.layers[pos];
            if bank.is_empty() {
                return Err(format!("layer {l} has no slot"));
            }
            if bank.iter().any(|&i| self.slots[i].role != SlotRole::Layer(l)) {
                return Err(format!("layer {l}'s bank lists a slot of another role"));
            }
        }
        let mut working = self.working.clone();
        working.sort_unstable();
        let expected: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].role == SlotRole::Working).collect();
        if working != expected {
            return Err(format!("working list {working:?} != working slots {expected:?}"));
        }
        if roles[0] != self.planned_working || roles[1] != self.planned_pinned {
            return Err(format!("banks changed size: {} working, {} pinned", roles[0], roles[1]));
        }
        if roles[2] + roles[3] != self.planned_layer_slots {
            return Err(format!("{} layer + {} disabled slots != {}", roles[2], roles[3], self.planned_layer_slots));
        }
        self.check_victims()
    }
}

#[cfg(test)]
mod tests;

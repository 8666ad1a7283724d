//! Choosing the slot an incoming expert takes: from its own layer's bank
//! ([`EvictionScope::Layer`], the plan's fixed split) or from any layer's
//! ([`EvictionScope::Global`]: banks grow and shrink with demand, each keeping at least one
//! slot). Layers do not reuse experts alike, so a fixed split leaves some layers' slots
//! holding experts that are never asked for again while another layer misses; on the
//! trained 256-expert trace a global host tier reads 5-6% fewer experts from disk
//! (docs/performance.md, "One slab for all layers").
//!
//! A global choice compares each layer's own victim. Those are kept per layer and
//! recomputed only for the layers changed since: a forward touches one layer at a time,
//! and a slab may hold thousands of slots, too many to scan at every miss.

use std::cmp::Ordering;

use serde::Serialize;

use super::{SlotPhase, SlotRole, SlotTable};

const FLOOR_NUM: usize = 3;
const FLOOR_DEN: usize = 4;

/// Where a tier looks for the slot an incoming expert takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionScope {
    /// Its own layer's slots: every layer keeps the plan's share.
    #[default]
    Layer,
    /// Any layer's slots: the victim is the coldest of the whole tier.
    Global,
}

impl EvictionScope {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "layer" => Ok(EvictionScope::Layer),
            "global" => Ok(EvictionScope::Global),
            _ => Err(format!("invalid eviction scope {text:?}: expected layer or global")),
        }
    }
}

impl std::fmt::Display for EvictionScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictionScope::Layer => "layer",
            EvictionScope::Global => "global",
        })
    }
}

impl SlotTable {
    /// Victims come from the incoming expert's layer or from any layer, from now on.
    pub fn set_scope(&mut self, scope: EvictionScope) {
        self.scope = scope;
    }

    pub fn scope(&self) -> EvictionScope {
        self.scope
    }

    /// Which of two evictable slots goes first: an empty one, then under LRU the oldest
    /// last use; under LFRU a cooled slot (last use 0), then the least heat, then the
    /// oldest last use; ties to the lowest slot id.
    fn victim_order(&self, a: usize, b: usize) -> Ordering {
        let (sa, sb) = (&self.slots[a], &self.slots[b]);
        let lru = |i: usize, s: &super::SlotInfo| (s.phase != SlotPhase::Idle, s.last_use, i);
        if !self.heat.enabled() {
            return lru(a, sa).cmp(&lru(b, sb));
        }
        let heat = |s: &super::SlotInfo| s.key.map_or(0.0, |k| self.heat.get(k));
        (sa.phase != SlotPhase::Idle, sa.last_use != 0)
            .cmp(&(sb.phase != SlotPhase::Idle, sb.last_use != 0))
            .then(heat(sa).total_cmp(&heat(sb)))
            .then(lru(a, sa).cmp(&lru(b, sb)))
    }

    /// The victim among the slots of the layer at position `pos` that are neither loading
    /// nor leased (a scan of its bank).
    pub(super) fn layer_victim(&self, pos: usize) -> Option<usize> {
        self.layer_slots[pos]
            .iter()
            .copied()
            .filter(|&i| matches!(self.slots[i].phase, SlotPhase::Idle | SlotPhase::Ready))
            .min_by(|&a, &b| self.victim_order(a, b))
    }

    /// The slot an incoming expert of `layer` takes, by the scope: None when every slot it
    /// may take is loading or leased. Under the global scope another layer gives up a slot
    /// only while it has more than its floor (`layer_floor`).
    pub(super) fn victim_for(&mut self, layer: usize) -> Option<usize> {
        let own = self.layer_pos[&layer];
        if self.scope == EvictionScope::Layer {
            return self.layer_victim(own);
        }
        for pos in 0..self.layer_slots.len() {
            if self.best[pos].is_none() {
                self.best[pos] = Some(self.layer_victim(pos));
            }
        }
        let keep = self.layer_floor();
        (0..self.layer_slots.len())
            .filter(|&pos| pos == own || self.layer_slots[pos].len() > keep)
            .filter_map(|pos| self.best[pos].flatten())
            .min_by(|&a, &b| self.victim_order(a, b))
    }

    /// Slots a layer keeps under the global scope: FLOOR_NUM / FLOOR_DEN of its planned
    /// share (rounded up), at least one.
    fn layer_floor(&self) -> usize {
        let share = self.planned_layer_slots / self.layers.len().max(1);
        (share * FLOOR_NUM).div_ceil(FLOOR_DEN).max(1)
    }

    /// `slot` leaves its layer's bank (to another layer's, or to the working bank).
    pub(super) fn leave_bank(&mut self, slot: usize) {
        if let SlotRole::Layer(l) = self.slots[slot].role {
            let pos = self.layer_pos[&l];
            self.best[pos] = None;
            self.layer_slots[pos].retain(|&i| i != slot);
        }
    }

    /// `slot` becomes a slot of `layer`'s bank.
    pub(super) fn join_bank(&mut self, slot: usize, layer: usize) {
        let pos = self.layer_pos[&layer];
        self.best[pos] = None;
        self.slots[slot].role = SlotRole::Layer(layer);
        self.layer_slots[pos].push(slot);
    }

    /// The layer `slot` belongs to has changed (a slot's phase, last use or key): its
    /// victim is recomputed when next needed.
    pub(super) fn stale_slot(&mut self, slot: usize) {
        if let SlotRole::Layer(l) = self.slots[slot].role {
            self.stale_layer(l);
        }
    }

    pub(super) fn stale_layer(&mut self, layer: usize) {
        if let Some(&pos) = self.layer_pos.get(&layer) {
            self.best[pos] = None;
        }
    }

    pub(super) fn stale_all(&mut self) {
        self.best.iter_mut().for_each(|b| *b = None);
    }

    /// Invariant 7: every layer victim kept is the one a scan of its bank finds now.
    pub(super) fn check_victims(&self) -> Result<(), String> {
        for (pos, kept) in self.best.iter().enumerate() {
            if let Some(kept) = kept {
                let now = self.layer_victim(pos);
                if *kept != now {
                    return Err(format!("layer {}: kept victim {kept:?}, a scan finds {now:?}", self.layers[pos]));
                }
            }
        }
        Ok(())
    }
}

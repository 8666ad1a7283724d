use super::*;
use crate::plan::{plan, PlanInput};
use crate::TestRng;

/// 2 working, `pinned` pinned, layers 3 and 5 with `per_layer` slots each.
fn table(pinned: usize, per_layer: usize) -> SlotTable {
    let p = plan(PlanInput {
        budget_bytes: 1 << 40,
        fixed_bytes: 0,
        slot_bytes: 1,
        sparse_layers: 2,
        working_slots: 2,
        pinned_experts: pinned,
        max_slots_per_layer: Some(per_layer),
    })
    .unwrap();
    SlotTable::new(&p, &[3, 5])
}

/// The full miss path: load into a working slot, publish, promote.
fn miss(t: &mut SlotTable, key: ExpertKey) -> (usize, Promotion) {
    let (slot, generation) = t.begin_load(key).expect("free working slot");
    assert!(t.finish_load(slot, generation));
    let promotion = t.promote(slot);
    t.check_invariants().unwrap();
    (slot, promotion)
}

#[test]
fn slots_are_numbered_working_pinned_then_layers() {
    let t = table(2, 3);
    assert_eq!(t.len(), 2 + 2 + 6);
    let roles: Vec<_> = (0..t.len()).map(|i| t.slot(i).role).collect();
    use SlotRole::*;
    assert_eq!(roles, [Working, Working, Pinned, Pinned, Layer(3), Layer(3), Layer(3), Layer(5), Layer(5), Layer(5)]);
    assert_eq!(t.layer_capacity(3), Some(3));
    assert_eq!(t.layer_capacity(4), None);
    t.check_invariants().unwrap();
}

#[test]
fn misses_fill_empty_slots_then_evict_the_least_recently_used() {
    let mut t = table(0, 2);
    t.tick();
    let (a, p) = miss(&mut t, (3, 10));
    assert_eq!(p, Promotion::Filled);
    assert_eq!(t.slot(a).role, SlotRole::Layer(3));
    t.tick();
    assert_eq!(miss(&mut t, (3, 11)).1, Promotion::Filled);
    t.tick();
    // 10 is older than 11: it goes.
    assert_eq!(miss(&mut t, (3, 12)).1, Promotion::Evicted((3, 10)));
    assert_eq!(t.lookup((3, 10)), None);
    // A hit refreshes 11, so 12 is now the oldest.
    t.tick();
    assert!(t.lookup((3, 11)).is_some());
    t.tick();
    assert_eq!(miss(&mut t, (3, 13)).1, Promotion::Evicted((3, 12)));
    // The other layer is untouched.
    assert_eq!(miss(&mut t, (5, 1)).1, Promotion::Filled);
    let snap = t.snapshot();
    assert_eq!((snap.hits, snap.misses, snap.pin_loads, snap.evictions), (1, 5, 0, 2));
}

#[test]
fn a_cooled_expert_goes_first_and_a_touched_one_last() {
    let mut t = table(0, 3);
    for e in [1, 2, 3] {
        t.tick();
        miss(&mut t, (3, e));
    }
    // 1 is the oldest; cooling 3 (the newest) makes it the victim instead.
    assert!(t.cool((3, 3)));
    t.tick();
    let (incoming, _) = {
        let (slot, g) = t.begin_load((3, 4)).unwrap();
        assert!(t.finish_load(slot, g));
        (slot, g)
    };
    let victim = t.promotion_victim(incoming).unwrap();
    assert_eq!(t.slot(victim).key, Some((3, 3)));
    assert_eq!(t.promote(incoming), Promotion::Evicted((3, 3)));
    // Touching 1 (now the oldest) without a lookup keeps it past 2.
    t.tick();
    let hits = t.snapshot().hits;
    assert!(t.touch((3, 1)));
    assert_eq!(t.snapshot().hits, hits);
    t.tick();
    assert_eq!(miss(&mut t, (3, 5)).1, Promotion::Evicted((3, 2)));
    // Neither applies to absent, loading or working-bank keys.
    assert!(!t.touch((3, 9)) && !t.cool((3, 9)));
    let (slot, _) = t.begin_load((5, 1)).unwrap();
    assert!(!t.touch((5, 1)) && !t.cool((5, 1)));
    assert_eq!(t.slot(slot).phase, SlotPhase::Loading);
    t.check_invariants().unwrap();
}

#[test]
fn lfru_keeps_the_expert_used_most_and_evicts_the_one_used_once() {
    // Layer 3 has 2 slots. Expert 10 is used in three forwards, 11 in one, then 12 comes.
    let run = |eviction: Eviction| {
        let mut t = table(0, 2);
        t.set_eviction(eviction);
        let forward = |t: &mut SlotTable, e: usize| {
            t.tick();
            t.record_uses(3, [e]);
            match t.lookup((3, e)) {
                Some(_) => None,
                None => miss(t, (3, e)).1.evicted(),
            }
        };
        for e in [10, 10, 10, 11] {
            assert_eq!(forward(&mut t, e), None);
        }
        forward(&mut t, 12)
    };
    assert_eq!(run(Eviction::Lru), Some((3, 10)), "LRU: 10 was used longest ago");
    assert_eq!(run(Eviction::Lfru { half_life: 4.0 }), Some((3, 11)), "LFRU: 11 is colder");
    // With a half-life far below the gap, heat is recency again.
    assert_eq!(run(Eviction::Lfru { half_life: 0.05 }), Some((3, 10)));
}

#[test]
fn lfru_evicts_a_cooled_expert_before_a_colder_one() {
    let mut t = table(0, 2);
    t.set_eviction(Eviction::Lfru { half_life: 8.0 });
    for e in [10, 10, 11] {
        t.tick();
        t.record_uses(3, [e]);
        if t.lookup((3, e)).is_none() {
            miss(&mut t, (3, e));
        }
    }
    assert!(t.cool((3, 10)), "the hottest, handed up to a device");
    t.tick();
    assert_eq!(miss(&mut t, (3, 12)).1, Promotion::Evicted((3, 10)));
    assert_eq!(t.eviction(), Eviction::Lfru { half_life: 8.0 });
}

#[test]
fn a_global_scope_takes_the_oldest_slot_of_any_layer_down_to_three_quarters_of_a_share() {
    let mut t = table(0, 4);
    t.set_scope(EvictionScope::Global);
    for key in [(5, 1), (5, 2), (5, 3), (5, 4), (3, 1), (3, 2), (3, 3), (3, 4)] {
        t.tick();
        assert_eq!(miss(&mut t, key).1, Promotion::Filled);
    }
    // Layer 5's experts are the oldest: layer 3 takes the oldest one's slot.
    t.tick();
    assert_eq!(miss(&mut t, (3, 5)).1, Promotion::Evicted((5, 1)));
    assert_eq!((t.layer_capacity(3), t.layer_capacity(5)), (Some(5), Some(3)));
    // Layer 5 is down to 3 of its 4: layer 3 now evicts its own oldest, although (5, 2) is
    // older.
    t.tick();
    assert_eq!(miss(&mut t, (3, 6)).1, Promotion::Evicted((3, 1)));
    // Layer 5's experts used again, a miss of layer 5 wins a slot back from layer 3's oldest.
    t.tick();
    for e in [2, 3, 4] {
        assert!(t.lookup((5, e)).is_some());
    }
    t.tick();
    assert_eq!(miss(&mut t, (5, 5)).1, Promotion::Evicted((3, 2)));
    assert_eq!((t.layer_capacity(3), t.layer_capacity(5)), (Some(4), Some(4)));
    // The layer scope never moves a slot.
    let mut t = table(0, 4);
    for key in [(5, 1), (5, 2), (5, 3), (5, 4), (3, 1), (3, 2), (3, 3), (3, 4), (3, 5)] {
        t.tick();
        miss(&mut t, key);
    }
    assert_eq!((t.layer_capacity(3), t.layer_capacity(5)), (Some(4), Some(4)));
    assert_eq!(t.peek((5, 1)).map(|s| t.slot(s).role), Some(SlotRole::Layer(5)));
    assert_eq!(t.peek((3, 1)), None);
}

#[test]
fn a_global_lfru_scope_evicts_the_coldest_expert_of_any_layer() {
    let mut t = table(0, 4);
    t.set_eviction(Eviction::Lfru { half_life: 4.0 });
    t.set_scope(EvictionScope::Global);
    let use_now = |t: &mut SlotTable, key: ExpertKey| {
        t.tick();
        t.record_uses(key.0, [key.1]);
        if t.lookup(key).is_none() {
            miss(t, key);
        }
    };
    for key in [(3, 1), (3, 2), (3, 3), (3, 4), (5, 1), (5, 2), (5, 3), (5, 4)] {
        use_now(&mut t, key);
    }
    // (3, 1) is used three more times: (3, 2), the oldest used once, goes.
    for _ in 0..3 {
        use_now(&mut t, (3, 1));
    }
    t.tick();
    t.record_uses(5, [5]);
    assert_eq!(miss(&mut t, (5, 5)).1, Promotion::Evicted((3, 2)));
    assert_eq!((t.layer_capacity(3), t.layer_capacity(5)), (Some(3), Some(5)));
    // Layer 3's experts warm up; a demotion into layer 3 takes layer 5's coldest slot.
    for key in [(3, 1), (3, 3), (3, 4), (3, 3), (3, 4)] {
        use_now(&mut t, key);
    }
    t.tick();
    let (slot, g) = t.begin_demotion((3, 9)).unwrap();
    assert_eq!(t.slot(slot).role, SlotRole::Layer(3));
    assert!(t.finish_load(slot, g));
    assert_eq!(t.peek((5, 1)), None, "the coldest of layer 5 made room");
    assert_eq!((t.layer_capacity(3), t.layer_capacity(5)), (Some(4), Some(4)));
    t.check_invariants().unwrap();
}

#[test]
fn scopes_parse_and_refuse_by_name() {
    assert_eq!(EvictionScope::parse("layer"), Ok(EvictionScope::Layer));
    assert_eq!(EvictionScope::parse("global"), Ok(EvictionScope::Global));
    let err = EvictionScope::parse("model").unwrap_err();
    assert!(err.contains("\"model\"") && err.contains("layer or global"), "{err}");
    for s in [EvictionScope::Layer, EvictionScope::Global] {
        assert_eq!(EvictionScope::parse(&s.to_string()), Ok(s));
    }
}

#[test]
fn lru_ties_go_to_the_lowest_slot_id() {
    let mut t = table(0, 2);
    // Same clock for both: the lower slot id is the victim.
    let (s1, _) = miss(&mut t, (3, 1));
    let (s2, _) = miss(&mut t, (3, 2));
    let victim_key = if s1 < s2 { (3, 1) } else { (3, 2) };
    assert_eq!(miss(&mut t, (3, 3)).1, Promotion::Evicted(victim_key));
}

#[test]
fn promotion_swaps_roles_without_moving_the_expert() {
    let mut t = table(0, 1);
    let (s1, _) = miss(&mut t, (3, 1));
    let layer_slot_before = 2; // the only slot of layer 3 at start
    assert_eq!(t.slot(layer_slot_before).role, SlotRole::Working);
    assert_eq!(t.slot(s1).key, Some((3, 1)));
    assert_eq!(t.lookup((3, 1)), Some(s1));
    // The old layer slot is now an empty working slot and is used for the next miss.
    let (s2, generation) = t.begin_load((3, 2)).unwrap();
    assert!(s2 == layer_slot_before || t.slot(s2).role == SlotRole::Working);
    assert!(t.finish_load(s2, generation));
    assert_eq!(t.promote(s2), Promotion::Evicted((3, 1)));
    assert_eq!(t.slot(s1).role, SlotRole::Working);
    assert_eq!(t.slot(s1).phase, SlotPhase::Idle);
    t.check_invariants().unwrap();
}

#[test]
fn late_completion_for_reused_storage_is_rejected() {
    let mut t = table(0, 1);
    let (slot, g1) = t.begin_load((3, 1)).unwrap();
    // The read is abandoned (error or cancel); the slot is reused for another expert.
    assert!(t.fail_load(slot, g1));
    let (slot2, g2) = t.begin_load((3, 2)).unwrap();
    assert_eq!(slot2, slot, "the emptied slot is the first free one");
    assert_ne!(g1, g2);
    // The late completion of the first read must not publish.
    assert!(!t.finish_load(slot, g1));
    assert!(!t.fail_load(slot, g1));
    assert_eq!(t.slot(slot).key, Some((3, 2)));
    assert_eq!(t.slot(slot).phase, SlotPhase::Loading);
    assert!(t.finish_load(slot, g2));
    // A duplicate completion is stale too.
    assert!(!t.finish_load(slot, g2));
    assert_eq!(t.snapshot().stale_completions, 3);
    t.check_invariants().unwrap();
}

#[test]
fn loading_keys_are_not_hits_and_are_not_loaded_twice() {
    let mut t = table(0, 1);
    let (slot, generation) = t.begin_load((3, 1)).unwrap();
    assert_eq!(t.lookup((3, 1)), None);
    assert_eq!(t.peek((3, 1)), Some(slot));
    assert_eq!(t.begin_load((3, 1)), None);
    assert!(t.finish_load(slot, generation));
    assert_eq!(t.lookup((3, 1)), Some(slot));
}

#[test]
fn working_bank_exhaustion_returns_none() {
    let mut t = table(0, 1);
    let (a, ga) = t.begin_load((3, 1)).unwrap();
    let (_b, _) = t.begin_load((3, 2)).unwrap();
    assert_eq!(t.begin_load((3, 3)), None, "both working slots are loading");
    assert!(t.finish_load(a, ga));
    t.lease(a);
    assert_eq!(t.begin_load((3, 3)), None, "a leased working slot is not free");
    t.release(a);
    // A ready, unpromoted working slot is reused (its expert dropped).
    let (c, _) = t.begin_load((3, 3)).unwrap();
    assert_eq!(c, a);
    assert_eq!(t.peek((3, 1)), None);
    t.check_invariants().unwrap();
}

#[test]
fn leased_slots_are_never_victims() {
    let mut t = table(0, 2);
    let (a, _) = miss(&mut t, (3, 1));
    let (b, _) = miss(&mut t, (3, 2));
    t.tick();
    // A forward uses both residents and misses a third: no victim while both leased.
    let hit_a = t.lookup((3, 1)).unwrap();
    let hit_b = t.lookup((3, 2)).unwrap();
    assert_eq!((hit_a, hit_b), (a, b));
    t.lease(a);
    t.lease(b);
    let (c, generation) = t.begin_load((3, 3)).unwrap();
    assert!(t.finish_load(c, generation));
    t.lease(c);
    assert_eq!(t.promote(c), Promotion::NoVictim);
    assert_eq!(t.slot(c).role, SlotRole::Working);
    assert_eq!(t.lookup((3, 3)), Some(c), "an unpromoted expert is still a hit");
    // Leases nest.
    t.lease(a);
    t.release(a);
    assert_eq!(t.slot(a).phase, SlotPhase::Leased);
    t.release(a);
    t.release(b);
    assert_eq!(t.slot(a).phase, SlotPhase::Ready);
    // Now 1 and 2 (same age) are candidates: the lowest slot id goes.
    assert_eq!(t.promote(c), Promotion::Evicted((3, 1)));
    t.release(c);
    t.check_invariants().unwrap();
}

#[test]
#[should_panic(expected = "not leased")]
fn releasing_an_unleased_slot_panics() {
    let mut t = table(0, 1);
    let (slot, _) = miss(&mut t, (3, 1));
    t.release(slot);
}

#[test]
fn pins_load_into_the_pinned_bank_and_are_never_evicted() {
    let mut t = table(2, 1);
    let slot = t.pin((3, 7)).unwrap();
    assert_eq!(t.slot(slot).role, SlotRole::Pinned);
    assert_eq!(t.slot(slot).phase, SlotPhase::Loading);
    assert!(t.finish_load(slot, t.slot(slot).generation));
    assert_eq!(t.pin((3, 7)), Err("expert 3:7 is already pinned".into()));
    assert!(t.pin((4, 1)).unwrap_err().contains("not a sparse layer"));
    for e in 0..50 {
        t.tick();
        miss(&mut t, (3, e + 100));
    }
    assert_eq!(t.lookup((3, 7)), Some(slot));
    assert_eq!(t.pinned_keys(), vec![(3, 7)]);
    let other = t.pin((5, 1)).unwrap();
    assert!(t.pin((5, 2)).unwrap_err().contains("all 2 pinned slots are in use"));
    // A failed pin load frees the pinned slot.
    assert!(t.fail_load(other, t.slot(other).generation));
    assert!(t.pin((5, 2)).is_ok());
    t.check_invariants().unwrap();
}

#[test]
fn pinning_a_resident_expert_swaps_roles() {
    let mut t = table(1, 2);
    let (s, _) = miss(&mut t, (3, 1));
    let pinned_slot_before = 2;
    assert_eq!(t.pin((3, 1)), Ok(s));
    assert_eq!(t.slot(s).role, SlotRole::Pinned);
    assert_eq!(t.slot(s).phase, SlotPhase::Ready);
    assert_eq!(t.slot(pinned_slot_before).role, SlotRole::Layer(3));
    assert_eq!(t.layer_capacity(3), Some(2));
    t.check_invariants().unwrap();
    // Unpin drops it.
    assert_eq!(t.unpin((3, 1)), Ok(s));
    assert_eq!(t.peek((3, 1)), None);
    assert!(t.unpin((3, 1)).is_err());
    t.check_invariants().unwrap();
}

#[test]
fn repin_swaps_a_hot_resident_with_the_cold_pin() {
    let mut t = table(1, 2);
    let cold = t.pin((3, 1)).unwrap();
    assert!(t.finish_load(cold, t.slot(cold).generation));
    let (hot, _) = miss(&mut t, (3, 2));
    t.tick();
    miss(&mut t, (3, 3));
    assert_eq!(t.repin((3, 1), (3, 2)), Ok(hot));
    assert_eq!(t.slot(hot).role, SlotRole::Pinned);
    assert_eq!(t.slot(cold).role, SlotRole::Layer(3));
    assert_eq!(t.slot(cold).key, Some((3, 1)), "the cold expert stays resident");
    assert_eq!(t.pinned_keys(), vec![(3, 2)]);
    // ... as the layer's next victim.
    t.tick();
    assert_eq!(miss(&mut t, (3, 4)).1, Promotion::Evicted((3, 1)));
    // Cross-layer repin drops the cold expert.
    let (other, _) = miss(&mut t, (5, 9));
    assert_eq!(t.repin((3, 2), (5, 9)), Ok(other));
    assert_eq!(t.peek((3, 2)), None);
    assert!(t.repin((3, 2), (5, 9)).unwrap_err().contains("not pinned"));
    assert!(t.repin((5, 9), (5, 77)).unwrap_err().contains("not resident"));
    assert_eq!(t.snapshot().repin_swaps, 2);
    t.check_invariants().unwrap();
}

#[test]
fn decommit_shrinks_to_one_slot_per_layer_oldest_first() {
    let mut t = table(1, 3);
    let pin = t.pin((3, 99)).unwrap();
    assert!(t.finish_load(pin, t.slot(pin).generation));
    for e in [1, 2, 3] {
        t.tick();
        miss(&mut t, (3, e));
    }
    t.tick();
    miss(&mut t, (5, 1)); // layer 5: one occupied, two empty
                          // Empty slots go first (layer 5's two empties), then the oldest resident.
    let mut decommitted = Vec::new();
    while let Some(slot) = t.decommit_one() {
        assert_eq!(t.slot(slot).role, SlotRole::Disabled);
        decommitted.push(slot);
        t.check_invariants().unwrap();
    }
    assert_eq!(decommitted.len(), 4);
    assert_eq!(t.layer_capacity(3), Some(1));
    assert_eq!(t.layer_capacity(5), Some(1));
    assert_eq!(t.lookup((3, 3)).map(|s| t.slot(s).role), Some(SlotRole::Layer(3)), "newest survives");
    assert_eq!(t.lookup((3, 1)), None);
    assert_eq!(t.lookup((3, 99)), Some(pin), "pins survive pressure");
    assert!(t.lookup((5, 1)).is_some());
    let snap = t.snapshot();
    assert_eq!((snap.decommitted, snap.pressure_evictions, snap.disabled), (4, 2, 4));
    // Capacity never comes back: later misses still fit in one slot per layer.
    miss(&mut t, (3, 50));
    assert_eq!(t.snapshot().disabled, 4);
}

#[test]
fn snapshot_and_residency_map_describe_every_occupied_slot() {
    let mut t = table(1, 2);
    let p = t.pin((5, 4)).unwrap();
    t.tick();
    let (s, _) = miss(&mut t, (3, 1));
    t.lease(s);
    let snap = t.snapshot();
    assert_eq!((snap.total, snap.working, snap.pinned, snap.layer, snap.disabled), (7, 2, 1, 4, 0));
    assert_eq!((snap.loading, snap.leased, snap.ready, snap.idle), (1, 1, 0, 5));
    assert_eq!((snap.clock, snap.misses, snap.pin_loads), (1, 1, 1));
    let map = t.residency_map();
    assert_eq!(
        map,
        vec![
            ResidencyEntry {
                slot: s,
                layer: 3,
                expert: 1,
                role: SlotRole::Layer(3),
                phase: SlotPhase::Leased,
                last_use: 1
            },
            ResidencyEntry {
                slot: p,
                layer: 5,
                expert: 4,
                role: SlotRole::Pinned,
                phase: SlotPhase::Loading,
                last_use: 0
            },
        ]
    );
    let json = serde_json::to_value(&map).unwrap();
    assert_eq!(json[0]["role"]["layer"], 3);
    assert_eq!(json[0]["phase"], "leased");
    assert_eq!(json[1]["role"], "pinned");
    assert!(serde_json::to_string(&snap).unwrap().contains("\"pressure_evictions\":0"));
}

/// Random operation sequences, invariants checked after every step; also a shadow
/// model of which keys are resident checks lookups and stale completions.
#[test]
fn random_operation_sequences_keep_the_invariants() {
    for seed in 0..60 {
        let mut rng = TestRng::new(seed);
        let pinned = rng.below(3);
        let per_layer = 1 + rng.below(4);
        let mut t = table(pinned, per_layer);
        if seed % 2 == 1 {
            t.set_eviction(Eviction::Lfru { half_life: 1.5 });
        }
        if seed % 4 >= 2 {
            t.set_scope(EvictionScope::Global);
        }
        let layers = [3usize, 5];
        let mut in_flight: Vec<(usize, u64, ExpertKey)> = Vec::new();
        let mut retired: Vec<(usize, u64)> = Vec::new();
        let mut leased: Vec<usize> = Vec::new();
        for _step in 0..400 {
            let key = (layers[rng.below(2)], rng.below(8));
            match rng.below(15) {
                0 => {
                    t.tick();
                    t.record_uses(key.0, [key.1, rng.below(8)]);
                }
                1 => {
                    if let Some(slot) = t.lookup(key) {
                        assert_eq!(t.slot(slot).key, Some(key));
                        t.lease(slot);
                        leased.push(slot);
                    }
                }
                2 | 3 => {
                    if let Some((slot, g)) = t.begin_load(key) {
                        assert!(!in_flight.iter().any(|&(s, _, _)| s == slot));
                        in_flight.push((slot, g, key));
                    }
                }
                4 | 5 if !in_flight.is_empty() => {
                    let (slot, g, key) = in_flight.swap_remove(rng.below(in_flight.len()));
                    if rng.below(5) == 0 {
                        assert!(t.fail_load(slot, g));
                        assert_eq!(t.peek(key), None);
                    } else {
                        assert!(t.finish_load(slot, g));
                        assert_eq!(t.lookup(key), Some(slot));
                    }
                    retired.push((slot, g));
                }
                6 if !retired.is_empty() => {
                    let (slot, g) = retired[rng.below(retired.len())];
                    assert!(!t.finish_load(slot, g), "a retired generation published");
                }
                7 if !leased.is_empty() => {
                    let slot = leased.swap_remove(rng.below(leased.len()));
                    t.release(slot);
                }
                8 => {
                    let ready: Vec<usize> = (0..t.len())
                        .filter(|&i| {
                            t.slot(i).role == SlotRole::Working
                                && matches!(t.slot(i).phase, SlotPhase::Ready | SlotPhase::Leased)
                        })
                        .collect();
                    if let Some(&slot) = ready.get(rng.below(ready.len().max(1))) {
                        let key = t.slot(slot).key.unwrap();
                        let pinned_before = t.pinned_keys();
                        let victim = t.promotion_victim(slot);
                        let victim_key = victim.and_then(|v| t.slot(v).key);
                        let promotion = t.promote(slot);
                        assert_eq!(t.peek(key), Some(slot));
                        assert_eq!(promotion == Promotion::NoVictim, victim.is_none(), "{promotion:?} {victim:?}");
                        assert_eq!(promotion.evicted(), victim_key, "promotion_victim named another slot");
                        if let Some(v) = victim {
                            assert_eq!(t.slot(v).role, SlotRole::Working, "the victim became a working slot");
                        }
                        if let Some(evicted) = promotion.evicted() {
                            assert_eq!(t.peek(evicted), None);
                            assert!(!pinned_before.contains(&evicted));
                        }
                        assert_eq!(t.pinned_keys(), pinned_before, "promotion touched a pin");
                    }
                }
                9 => {
                    let pinned_before = t.pinned_keys();
                    if let Some(slot) = t.decommit_one() {
                        assert_eq!(t.slot(slot).role, SlotRole::Disabled);
                    }
                    assert_eq!(t.pinned_keys(), pinned_before, "pressure touched a pin");
                }
                10 => match t.pin(key) {
                    Ok(slot) if t.slot(slot).phase == SlotPhase::Loading => {
                        in_flight.push((slot, t.slot(slot).generation, key));
                    }
                    _ => {}
                },
                11 => {
                    let pins = t.pinned_keys();
                    if let Some(&cold) = pins.get(rng.below(pins.len().max(1))) {
                        if rng.below(2) == 0 {
                            let _ = t.unpin(cold);
                        } else {
                            let _ = t.repin(cold, key);
                        }
                    }
                }
                12 => {
                    let (hits, last) = (t.snapshot().hits, t.peek(key).map(|s| t.slot(s).last_use));
                    let ready =
                        t.peek(key).is_some_and(|s| matches!(t.slot(s).phase, SlotPhase::Ready | SlotPhase::Leased));
                    assert_eq!(t.touch(key), ready);
                    assert_eq!(t.snapshot().hits, hits, "a touch is not a hit");
                    if ready {
                        assert_eq!(t.slot(t.peek(key).unwrap()).last_use, t.clock());
                    } else {
                        assert_eq!(t.peek(key).map(|s| t.slot(s).last_use), last);
                    }
                }
                13 => {
                    let layer_ready = t.peek(key).is_some_and(|s| {
                        matches!(t.slot(s).role, SlotRole::Layer(_))
                            && matches!(t.slot(s).phase, SlotPhase::Ready | SlotPhase::Leased)
                    });
                    assert_eq!(t.cool(key), layer_ready);
                    if layer_ready {
                        assert_eq!(t.slot(t.peek(key).unwrap()).last_use, 0);
                    }
                }
                14 => {
                    let before = t.peek(key);
                    match t.begin_demotion(key) {
                        Some((slot, g)) => {
                            assert_eq!(before, None);
                            assert_eq!(t.slot(slot).role, SlotRole::Layer(key.0));
                            assert!(!in_flight.iter().any(|&(s, _, _)| s == slot));
                            in_flight.push((slot, g, key));
                        }
                        None => assert!(before.is_some() || t.layer_capacity(key.0).is_some()),
                    }
                }
                _ => {}
            }
            if let Err(e) = t.check_invariants() {
                panic!("seed {seed}: {e}\n{t:#?}");
            }
        }
    }
}

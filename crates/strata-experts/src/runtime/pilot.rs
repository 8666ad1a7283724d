//! PILOT's side of the host tier: a prediction of the next layer's routing is kept for
//! scoring and, per `--pilot`, hinted or prefetched. Prefetch reads wait until the current
//! layer has submitted its own (the prediction comes before that layer's experts run) and
//! go surest rank first; `run_layer` lets one its layer needs join that layer's first wave
//! and lands mispredicted ones in the background.

use super::{PilotMode, State, StreamedExperts};
use std::time::Instant;
use strata_residency::ExpertKey;

impl StreamedExperts {
    /// Completes the prefetch reads whose expert satisfies `which`: each lands Ready in
    /// its working slot (a hit for the next lookup) or, on error, goes back to idle (the
    /// demand path then reads it again and reports any error).
    pub(super) fn settle_prefetches(&self, st: &mut State, which: impl Fn(&ExpertKey) -> bool) {
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

    /// Starts the deferred prefetch reads, surest first, while working slots are free.
    pub(super) fn start_prefetches(&self, st: &mut State) {
        for key in std::mem::take(&mut st.deferred) {
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

    /// For a tier in front whose layer needed nothing from this one: the next layer's
    /// prefetches start now.
    #[cfg(feature = "cuda")]
    pub(crate) fn start_deferred_prefetches(&self) {
        self.start_prefetches(&mut self.state.lock().unwrap());
    }

    /// Completes the prefetch reads that are done, waiting for none.
    pub(super) fn settle_landed_prefetches(&self, st: &mut State) {
        let done: Vec<ExpertKey> =
            st.prefetch.iter_mut().filter_map(|(k, (_, _, ticket))| ticket.is_done().then_some(*k)).collect();
        if !done.is_empty() {
            self.settle_prefetches(st, |k| done.contains(k));
        }
    }

    /// PILOT's prediction for `layer` (rows of `top_k` ids): kept for scoring, and per
    /// `--pilot` hinted or prefetched, except the experts `held_above` says a tier in
    /// front of this one holds (they will not miss here).
    pub(crate) fn predicted_skipping(
        &self,
        layer: usize,
        ids: &[u32],
        top_k: usize,
        held_above: &dyn Fn(usize) -> bool,
    ) {
        let t = Instant::now();
        let mut st = self.state.lock().unwrap();
        // Rank by rank over the rows (the router's first choices are the surest), so that
        // the reads start in that order and, short of working slots, the least sure go.
        let width = top_k.max(1);
        let ranks = self.pilot_ranks.unwrap_or(width).min(width);
        let mut unique: Vec<usize> = Vec::new();
        for r in 0..ranks {
            for row in ids.chunks(width) {
                if let Some(&e) = row.get(r) {
                    let e = e as usize;
                    if !held_above(e) && !unique.contains(&e) {
                        unique.push(e);
                    }
                }
            }
        }
        if self.pilot == PilotMode::Hint {
            for &e in &unique {
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
            // Read after the current layer's misses (`start_prefetches`): this prediction
            // comes before that layer's experts run.
            st.deferred = unique.iter().map(|&e| (layer, e)).collect();
        }
        let rows: Vec<Vec<usize>> = ids.chunks(top_k.max(1)).map(|r| r.iter().map(|&e| e as usize).collect()).collect();
        st.pending.insert(layer, (Instant::now(), rows));
        st.pilot.hint_latency.push(t.elapsed());
    }
}

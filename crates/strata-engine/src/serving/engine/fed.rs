//! Fed steps: decoding with the samples picked on the device and fed to the next forward
//! there, queued before the host has read them, so the device never waits for the host
//! between tokens.
//!
//! When every running request decodes one token a step and the device can make its
//! sample (greedy, or a keyed draw without anything the host must apply first), a step
//! queues its forward with each request's row fed the pick the step before made for it
//! (`strata_models::fed`), then reads that step's picks and follows them. A request whose
//! pick in flight ends it by length (its token limit, a full context) gets no row after
//! it. One the read ends otherwise (an end-of-sequence id, a stop string) had a row in
//! the forward just queued: its position is rolled back and its pick dropped, as if the
//! row had never been. Tokens are the same as one step at a time; anything else (a request
//! waiting, a prompt, speculation, a grammar, no room in the KV pool) first reads the
//! picks in flight and runs an ordinary step.

use super::{BatchEngine, Step};
use crate::serving::Update;
use anyhow::Result;
use strata_models::{fed, Logits};

impl BatchEngine<'_> {
    /// Whether the next step can be a fed one (see the module's doc).
    pub(super) fn fed_ready(&self) -> bool {
        let on = self.device_picks.unwrap_or_else(|| self.session.picks_on_device());
        let busy = !self.waiting.is_empty() || self.running.is_empty() || self.trace.is_some();
        if !on || busy || self.running.len() > self.opts.step_tokens {
            return false;
        }
        let in_flight = |id: u64| self.inflight.as_ref().is_some_and(|f| f.contains(&Some(id)));
        let Some(pool) = self.session.kv() else { return false };
        let mut need = 0;
        for a in &self.running {
            let Some(seq) = a.seq else { return false };
            let ready = a.decoding() || (in_flight(a.id) && a.tokens.len() == a.computed);
            // (A fed row reads back no hidden state: a request that logs them steps plainly.)
            let logs = a.spec.is_some() || a.hidden_log.is_some();
            if !ready || logs || !a.picks_on_device() || a.computed + 1 >= self.opts.context {
                return false;
            }
            need += pool.blocks_needed(seq, 1);
        }
        need <= pool.free_blocks()
    }

    /// One fed step: queue this step's forward, then read and follow the picks of the one
    /// before (see the module's doc).
    pub(super) fn step_fed(&mut self, out: &mut Vec<(u64, Update)>) -> Result<()> {
        let t_step = std::time::Instant::now();
        let prev = self.inflight.take();
        // The samples this step reads (one a request in flight): its tokens.
        let taken = prev.as_ref().map_or(0, |p| p.iter().flatten().count()) as u64;
        self.batch.clear();
        self.fed_order.clear();
        self.fed_draws.clear();
        let context = self.opts.context;
        for a in self.running.iter_mut() {
            let seq = a.seq.expect("running");
            let token = match prev.as_ref().and_then(|p| p.iter().position(|&id| id == Some(a.id))) {
                // Its pick in flight is its last token: no row after it.
                Some(_) if a.ends_after_next(context) => continue,
                Some(j) => fed(j as u32),
                None => a.tokens[a.computed],
            };
            self.batch.push(seq, &[token], Logits::Last);
            self.fed_draws.push(a.next_draw());
            self.fed_order.push(Some(a.id));
        }
        if self.batch.is_empty() {
            // Every request ends with its pick in flight.
            self.inflight = prev;
            return self.settle_inflight(out);
        }
        self.batch.pick_greedy();
        if self.fed_draws.iter().any(|d| !d.is_greedy()) {
            self.batch.draw_rows(self.fed_draws.iter().copied());
        }
        if let Err(e) = self.session.forward(&self.batch) {
            // Nothing was queued; the picks in flight are still owed.
            self.inflight = prev;
            self.settle_inflight(out)?;
            let ids = self.running.iter().map(|a| a.id).collect();
            self.fail(ids, &format!("generation failed: {e:#}"), out);
            return Ok(());
        }
        for a in self.running.iter_mut().filter(|a| self.fed_order.contains(&Some(a.id))) {
            a.computed += 1;
            a.fed += 1;
        }
        let rows = self.batch.len() as u64;
        self.counters.steps += 1;
        self.counters.rows += rows;
        self.counters.decode_rows += rows;
        self.counters.picked_steps += 1;
        self.counters.fed_steps += 1;
        let mut order = std::mem::take(&mut self.fed_order);
        if let Some(mut prev) = prev {
            self.follow_picks(&prev, Some(&mut order), out)?;
            // (The two lists trade places step by step: no allocation.)
            prev.clear();
            self.fed_order = prev;
        }
        // Fed steps are plain decoding's steps: the draft epochs measure them too.
        let step = Step {
            tokens: taken,
            seconds: t_step.elapsed().as_secs_f64(),
            requests: rows,
            forward_seconds: 0.0,
            speculating: false,
        };
        self.record_epoch_step(step);
        if order.iter().any(Option::is_some) {
            self.inflight = Some(order);
        } else {
            // Every request ended: the last forward's picks are read now, and dropped.
            self.session.take_picks(&mut self.picks)?;
            order.clear();
            self.fed_order = order;
        }
        Ok(())
    }

    /// Reads the picks in flight, if any, and follows them (no forward is queued after
    /// them).
    pub(super) fn settle_inflight(&mut self, out: &mut Vec<(u64, Update)>) -> Result<()> {
        if let Some(prev) = self.inflight.take() {
            self.follow_picks(&prev, None, out)?;
        }
        Ok(())
    }

    /// Reads the oldest picks not taken (those of the forward whose rows were `prev`'s
    /// requests) and follows them. A request they end leaves the engine; where `queued`
    /// holds the rows of a forward queued since, its row there is rolled back and its
    /// entry dropped.
    fn follow_picks(
        &mut self,
        prev: &[Option<u64>],
        mut queued: Option<&mut Vec<Option<u64>>>,
        out: &mut Vec<(u64, Update)>,
    ) -> Result<()> {
        if let Err(e) = self.session.take_picks(&mut self.picks) {
            let ids: Vec<u64> = prev.iter().flatten().copied().collect();
            let ids = ids.into_iter().filter(|id| self.running.iter().any(|a| a.id == *id)).collect();
            self.fail(ids, &format!("generation failed: {e:#}"), out);
            return Ok(());
        }
        let context = self.opts.context;
        for (j, id) in prev.iter().enumerate() {
            let Some(id) = *id else { continue };
            let Some(i) = self.running.iter().position(|a| a.id == id) else { continue };
            let pick = self.picks.get(j).copied();
            let a = &mut self.running[i];
            // (A sample counts once taken: a row queued past its request's end picks
            // nothing that counts.)
            self.counters.picked_samples += u64::from(pick.is_some());
            let result = match pick {
                Some(p) => a.take_pick(p, self.tok, context),
                None => Err(anyhow::anyhow!("the device returned no pick for this request")),
            };
            let done = match result {
                Ok((update, finish)) => {
                    if let Some(u) = update {
                        out.push((id, u));
                    }
                    finish.map(Ok)
                }
                Err(e) => Some(Err(format!("generation failed: {e:#}"))),
            };
            let Some(done) = done else { continue };
            let mut a = self.running.remove(i);
            if let Some(q) = queued.as_deref_mut() {
                if let Some(slot) = q.iter_mut().find(|s| **s == Some(id)) {
                    // Its row in the forward queued since was never needed.
                    *slot = None;
                    a.computed -= 1;
                    if let Some(seq) = a.seq {
                        self.session.truncate(seq, a.computed);
                    }
                }
            }
            self.release(&mut a);
            let update = match done {
                Ok(reason) => Update::Done(Ok(Box::new(self.finish(&mut a, reason)))),
                Err(e) => Update::Done(Err(e)),
            };
            out.push((id, update));
        }
        Ok(())
    }

    /// Drops the picks in flight (a reset or shutdown: their requests are gone).
    pub(super) fn drop_inflight(&mut self) {
        if self.inflight.take().is_some() {
            let _ = self.session.take_picks(&mut self.picks);
        }
    }
}

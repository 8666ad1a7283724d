//! How many tokens the adaptive requests of a batch draft each step.
//!
//! In a batch a request's drafts cost every request time: its verify rows lengthen the
//! shared target forward and its draft rows the draft forwards. So the engine decides for
//! the adaptive requests together. A model of a step's seconds, fitted online by
//! recursive least squares over the steps run,
//!
//! `seconds = base + per_row * rows + per_draft * drafts + per_forward * draft_forwards`,
//!
//! predicts the decoding part of the next step for each draft count `g` (every adaptive
//! decoding request drafting up to `g`), and each request's acceptance estimate `a`
//! predicts the tokens it emits, `1 + a + ... + a^g`; the `g` emitting the most tokens a
//! second wins. Now and then a step tries the other side (none while drafting, one draft
//! while not), so the fit and the acceptance estimates stay current: every
//! [`PROBE_EVERY`] steps while drafting, and while not, after [`PROBE_FIRST`] steps,
//! twice as many after each probe that changed nothing, up to [`PROBE_MAX`]. Where even
//! drafts that are always right would not pay for this batch, nothing is probed: no
//! acceptance could change the answer. Only steps of decoding rows are fitted (a prompt's
//! rows cost differently). When drafting cannot pay for this batch even with drafts that are
//! always right, or three probes in a row found it a loss, [`BatchDrafts::choose`] says
//! so: the engine then stops speculating for the adaptive requests running (they no longer
//! feed the draft layer, which costs a batch of many rows as much as a tenth of its
//! step) and they decode as without MTP; requests submitted later start afresh. Alone, a
//! request gets what [`crate::draft_policy`] would choose from the same measurements;
//! in a batch on a compute-bound device drafting stops once verify rows cost more than
//! their accepted tokens save, while on a memory-bound one (the target's weights read
//! once a step whatever its rows) it goes on.

/// Weight of the past in the fit, per step (about the last 100 steps count).
const FORGET: f64 = 0.99;
/// While drafting, a step in this many probes drafting nothing.
const PROBE_EVERY: u64 = 16;
/// While not, steps between probes of one draft: at first and at most (doubling between).
const PROBE_FIRST: u64 = 16;
const PROBE_MAX: u64 = 256;
/// Steps between probes once probes in a row have doubled it to this: drafting is given up.
const GIVE_UP_AT: u64 = 128;
/// The fit's starting uncertainty (and its cap, against wind-up while nothing varies).
const P0: f64 = 1e6;

#[derive(Debug)]
pub(crate) struct BatchDrafts {
    /// base, per_row, per_draft, per_forward.
    theta: [f64; 4],
    p: [[f64; 4]; 4],
    observed: u64,
    drafting_steps: u64,
    plain_steps: u64,
    decisions: u64,
    /// Steps since the last probe of drafting, and the steps until the next one.
    idle: u64,
    probe_every: u64,
}

impl BatchDrafts {
    pub fn new() -> Self {
        let mut p = [[0.0; 4]; 4];
        (0..4).for_each(|i| p[i][i] = P0);
        Self {
            theta: [0.0; 4],
            p,
            observed: 0,
            drafting_steps: 0,
            plain_steps: 0,
            decisions: 0,
            idle: 0,
            probe_every: PROBE_FIRST,
        }
    }

    /// A step ran: `rows` target rows (`drafts` of them verifying drafts) and
    /// `forwards` draft forwards in `seconds`.
    pub fn observe(&mut self, rows: usize, drafts: usize, forwards: usize, seconds: f64) {
        let x = [1.0, rows as f64, drafts as f64, forwards as f64];
        let px: Vec<f64> = (0..4).map(|i| (0..4).map(|j| self.p[i][j] * x[j]).sum()).collect();
        let denom = FORGET + (0..4).map(|i| x[i] * px[i]).sum::<f64>();
        let err = seconds - self.predict_x(&x);
        for (t, p) in self.theta.iter_mut().zip(&px) {
            *t += p / denom * err;
        }
        for i in 0..4 {
            for j in 0..4 {
                self.p[i][j] = (self.p[i][j] - px[i] * px[j] / denom) / FORGET;
            }
        }
        let trace: f64 = (0..4).map(|i| self.p[i][i]).sum();
        if trace > 4.0 * P0 {
            let s = 4.0 * P0 / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        self.observed += 1;
        match drafts {
            0 => self.plain_steps += 1,
            _ => self.drafting_steps += 1,
        }
    }

    fn predict_x(&self, x: &[f64; 4]) -> f64 {
        self.theta.iter().zip(x).map(|(t, x)| t * x).sum()
    }

    /// Tokens a second the decoding requests emit drafting up to `g` each.
    fn rate(&self, requests: &[(f64, usize)], g: usize) -> f64 {
        let mut tokens = 0.0;
        let mut drafts = 0;
        for &(a, most) in requests {
            let k = g.min(most);
            tokens += (0..=k).map(|i| a.powi(i as i32)).sum::<f64>();
            drafts += k;
        }
        let forwards = requests.iter().map(|r| g.min(r.1)).max().unwrap_or(0);
        let x = [1.0, (requests.len() + drafts) as f64, drafts as f64, forwards as f64];
        tokens / self.predict_x(&x).max(1e-9)
    }

    /// The draft count for the adaptive requests decoding this step, given each one's
    /// acceptance estimate and the most it may draft (its room and its own count); `None`
    /// where drafting does not pay and these requests should stop speculating.
    pub fn choose(&mut self, requests: &[(f64, usize)]) -> Option<usize> {
        let most = requests.iter().map(|r| r.1).max().unwrap_or(0);
        if most == 0 {
            return Some(0);
        }
        self.decide(requests, most)
    }

    fn decide(&mut self, requests: &[(f64, usize)], most: usize) -> Option<usize> {
        self.decisions += 1;
        // Measure both kinds of step before judging: two drafting steps, then one plain.
        if self.drafting_steps < 2 {
            return Some(most);
        }
        if self.plain_steps < 1 {
            return Some(0);
        }
        let best_for = |reqs: &[(f64, usize)]| {
            (0..=most).max_by(|&a, &b| self.rate(reqs, a).total_cmp(&self.rate(reqs, b))).unwrap_or(0)
        };
        let best = best_for(requests);
        if best > 0 {
            self.idle = 0;
            self.probe_every = PROBE_FIRST;
            return Some(if self.decisions.is_multiple_of(PROBE_EVERY) { 0 } else { best });
        }
        let perfect: Vec<(f64, usize)> = requests.iter().map(|&(_, m)| (1.0, m)).collect();
        if best_for(&perfect) == 0 {
            return None;
        }
        self.idle += 1;
        if self.probe_every >= GIVE_UP_AT {
            self.idle = 0;
            self.probe_every = PROBE_FIRST;
            return None;
        }
        if self.idle >= self.probe_every {
            self.idle = 0;
            self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
            return Some(1);
        }
        Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `batch` requests that agree with probability-like frequency
    /// `agree` on a device where a step takes `base + per_row * rows + per_draft *
    /// drafts + per_forward * forwards` seconds; returns the draft counts chosen.
    fn simulate(batch: usize, agree: f64, cost: [f64; 4], steps: usize) -> Vec<usize> {
        let mut policy = BatchDrafts::new();
        let mut seen = 0.0f64;
        // Decayed acceptance counts, as the requests' own controllers keep them.
        let (mut accepted, mut judged) = (0.0, 0.0);
        let mut out = Vec::new();
        for _ in 0..steps {
            let a = (accepted + 1.0) / (judged + 2.0);
            let g = policy.choose(&vec![(a, 3); batch]).unwrap_or(0);
            for _ in 0..batch {
                let mut kept = 0;
                for _ in 0..g {
                    seen += agree;
                    if seen >= 1.0 {
                        seen -= 1.0;
                        kept += 1;
                    } else {
                        break;
                    }
                }
                if g > 0 {
                    accepted = accepted * 0.97 + kept as f64;
                    judged = judged * 0.97 + (kept + usize::from(kept < g)) as f64;
                }
            }
            let (rows, drafts, forwards) = (batch * (1 + g), batch * g, g);
            let secs = cost[0] + cost[1] * rows as f64 + cost[2] * drafts as f64 + cost[3] * forwards as f64;
            policy.observe(rows, drafts, forwards, secs);
            out.push(g);
        }
        out
    }

    #[test]
    fn memory_bound_steps_draft_the_most() {
        // A big model: the step reads its weights once (base), rows are nearly free.
        for batch in [1, 8] {
            let gs = simulate(batch, 0.7, [10e-3, 0.05e-3, 0.02e-3, 0.3e-3], 300);
            let full = gs[50..].iter().filter(|&&g| g == 3).count();
            assert!(full >= 220, "batch {batch}: {full} of 250 steps drafted 3: {:?}", &gs[50..]);
        }
    }

    #[test]
    fn compute_bound_batches_stop_drafting() {
        // A tiny model on a CPU: each row costs as much as the step's fixed part. Alone,
        // drafting pays; eight rows a step already fill the machine and it does not.
        let cost = [1.0e-3, 0.1e-3, 0.05e-3, 0.1e-3];
        let alone = simulate(1, 0.7, cost, 300);
        assert!(alone[50..].iter().filter(|&&g| g > 0).count() >= 220, "{:?}", &alone[50..]);
        let batch = simulate(8, 0.7, cost, 300);
        let drafting = batch[50..].iter().filter(|&&g| g > 0).count();
        assert!(drafting <= 25, "{drafting} of 250 steps drafted: {:?}", &batch[50..]);
    }

    #[test]
    fn a_draft_that_never_agrees_is_dropped() {
        let gs = simulate(4, 0.0, [10e-3, 0.05e-3, 0.02e-3, 0.3e-3], 300);
        let drafting = gs[50..].iter().filter(|&&g| g > 0).count();
        assert!(drafting <= 25, "{drafting} of 250 steps drafted");
    }

    #[test]
    fn requests_without_room_draft_nothing() {
        let mut p = BatchDrafts::new();
        assert_eq!(p.choose(&[(0.9, 0), (0.9, 0)]), Some(0));
        assert_eq!(p.choose(&[]), Some(0));
        assert_eq!(p.choose(&[(0.9, 2), (0.9, 1)]), Some(2), "first steps measure drafting at the most");
    }

    #[test]
    fn drafting_that_cannot_pay_is_given_up() {
        // Compute-bound batch of 8: even drafts that are always right lose (32 tokens in
        // 22.1 ms against 8 in 5).
        let mut p = BatchDrafts::new();
        let cost = [1.0e-3, 0.5e-3, 0.2e-3, 0.1e-3];
        let mut verdicts = Vec::new();
        for _ in 0..60 {
            let v = p.choose(&[(0.7, 3); 8]);
            let g = v.unwrap_or(0);
            let (rows, drafts, forwards) = (8 * (1 + g), 8 * g, g);
            p.observe(
                rows,
                drafts,
                forwards,
                cost[0] + cost[1] * rows as f64 + cost[2] * drafts as f64 + cost[3] * forwards as f64,
            );
            verdicts.push(v);
        }
        assert!(verdicts[10..].iter().all(|v| v.is_none()), "{verdicts:?}");
        // Alone it pays: one request keeps drafting.
        let alone = simulate(1, 0.7, cost, 100);
        assert!(alone[20..].iter().filter(|&&g| g > 0).count() >= 70, "{alone:?}");
    }
}

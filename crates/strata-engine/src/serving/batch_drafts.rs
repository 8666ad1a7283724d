//! How many tokens the adaptive requests of a batch draft each step.
//!
//! In a batch a request's drafts cost every request time: its verify rows lengthen the
//! shared target forward and its draft rows the draft forwards. So the engine decides for
//! the adaptive requests together. A model of a step's seconds, fitted online by
//! recursive least squares over the steps run,
//!
//! `seconds = base + per_row * rows + per_prompt_row * prompt_rows + per_draft * drafts
//!           + per_forward * draft_forwards`,
//!
//! predicts the decoding part of the next step for each draft count `g` (every adaptive
//! decoding request drafting up to `g`), and each request's acceptance estimate `a`
//! predicts the tokens it emits, `1 + a + ... + a^g`; the `g` emitting the most tokens a
//! second wins. Now and then a step tries the other side (none while drafting, one draft
//! while not), so the fit and the acceptance estimates stay current: every
//! [`PROBE_EVERY`] steps while drafting, and while not, after [`PROBE_FIRST`] steps,
//! twice as many after each probe that changed nothing, up to [`PROBE_MAX`]. A prompt's
//! rows are a term of their own (they cost differently, and under load most steps carry
//! some). Whether to speculate at all is measured apart ([`super::draft_epochs`]). Alone, a
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
/// Terms of the cost model.
const N: usize = 5;
/// The fit's starting uncertainty (and its cap, against wind-up while nothing varies).
const P0: f64 = 1e6;

#[derive(Debug)]
pub(crate) struct BatchDrafts {
    /// base, per_row, per_draft, per_forward, per_prompt_row.
    theta: [f64; N],
    p: [[f64; N]; N],
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
        let mut p = [[0.0; N]; N];
        (0..N).for_each(|i| p[i][i] = P0);
        Self {
            theta: [0.0; N],
            p,
            observed: 0,
            drafting_steps: 0,
            plain_steps: 0,
            decisions: 0,
            idle: 0,
            probe_every: PROBE_FIRST,
        }
    }

    /// A step ran: `rows` decoding rows (`drafts` of them verifying drafts),
    /// `prompt_rows` rows of prompts and `forwards` draft forwards in `seconds`.
    pub fn observe(&mut self, rows: usize, prompt_rows: usize, drafts: usize, forwards: usize, seconds: f64) {
        let x = [1.0, rows as f64, drafts as f64, forwards as f64, prompt_rows as f64];
        let px: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| self.p[i][j] * x[j]).sum());
        let denom = FORGET + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        let err = seconds - self.predict_x(&x);
        for (t, p) in self.theta.iter_mut().zip(&px) {
            *t += p / denom * err;
        }
        for i in 0..N {
            for j in 0..N {
                self.p[i][j] = (self.p[i][j] - px[i] * px[j] / denom) / FORGET;
            }
        }
        let trace: f64 = (0..N).map(|i| self.p[i][i]).sum();
        if trace > N as f64 * P0 {
            let s = N as f64 * P0 / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        self.observed += 1;
        match drafts {
            0 => self.plain_steps += 1,
            _ => self.drafting_steps += 1,
        }
    }

    fn predict_x(&self, x: &[f64; N]) -> f64 {
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
        let x = [1.0, (requests.len() + drafts) as f64, drafts as f64, forwards as f64, 0.0];
        tokens / self.predict_x(&x).max(1e-9)
    }

    /// The draft count for the adaptive requests decoding this step, given each one's
    /// acceptance estimate and the most it may draft (its room and its own count).
    pub fn choose(&mut self, requests: &[(f64, usize)]) -> usize {
        let most = requests.iter().map(|r| r.1).max().unwrap_or(0);
        if most == 0 {
            return 0;
        }
        self.decisions += 1;
        // Measure both kinds of step before judging: two drafting steps, then one plain.
        if self.drafting_steps < 2 {
            return most;
        }
        if self.plain_steps < 1 {
            return 0;
        }
        let best = (0..=most).max_by(|&a, &b| self.rate(requests, a).total_cmp(&self.rate(requests, b))).unwrap_or(0);
        if best > 0 {
            self.idle = 0;
            self.probe_every = PROBE_FIRST;
            return if self.decisions.is_multiple_of(PROBE_EVERY) { 0 } else { best };
        }
        self.idle += 1;
        if self.idle >= self.probe_every {
            self.idle = 0;
            self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
            return 1;
        }
        0
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
            let g = policy.choose(&vec![(a, 3); batch]);
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
            policy.observe(rows, 0, drafts, forwards, secs);
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
        assert!(drafting > 0, "probes keep the estimates current");
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
        assert_eq!(p.choose(&[(0.9, 0), (0.9, 0)]), 0);
        assert_eq!(p.choose(&[]), 0);
        assert_eq!(p.choose(&[(0.9, 2), (0.9, 1)]), 2, "first steps measure drafting at the most");
    }
}

//! Whether the serving engine speculates at all, decided by measured throughput.
//!
//! Drafting costs a batch more than its drafts: every speculating request feeds the draft
//! layer (a forward over its owed rows every so often, which under a budget reads the
//! draft layer's experts from disk), keeps its hidden states, and on a GPU gives up device
//! picks. Whether that pays depends on the model, the device, the batch and the text, so
//! the engine measures it: it runs in epochs of decoding steps, speculating (adaptive
//! requests get a draft state when admitted, and [`super::batch_drafts`] chooses their
//! drafts) or not (none do, and the running ones are dropped from speculation when such
//! an epoch begins), and compares the tokens a second each kind emitted, the first few
//! steps after a switch left out. It starts speculating for [`EXPLORE`] steps, then
//! tries not, then keeps the winner for a while (longer each time it wins again) before
//! trying the other side once more. A speculating try whose batch keeps drafting nothing
//! ends early ([`DraftEpochs::cut_short`]): it would pay the costs for no drafts. So does
//! one that is slower than plain decoding could be at its slowest: a plain step decodes a
//! token for each of the step's requests in at most the time of the speculating step's
//! own target forward (fewer rows, and fed steps keep the host out of the way), so
//! speculation that emits fewer tokens a second than `requests / forward seconds` over
//! [`BOUND_STEPS`] measured steps is losing, whatever plain decoding turns out to do.

/// Decoding steps of an epoch that tries a side.
const EXPLORE: u64 = 16;
/// Steps after a switch not measured (requests admitted before it still run as they were).
const SETTLE: u64 = 2;
/// One decoding step, as [`DraftEpochs::record`] measures it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step {
    /// Tokens the step emitted, in `seconds`.
    pub tokens: u64,
    pub seconds: f64,
    /// Requests decoding in it, and its target forward's seconds (with reading back).
    pub requests: u64,
    pub forward_seconds: f64,
    /// Whether any of them speculated.
    pub speculating: bool,
}

/// Measured steps of a speculating try before it may end as surely losing.
const BOUND_STEPS: u64 = 3;
/// Steps the winner keeps at first, and at most (doubling each time it wins again).
const KEEP_FIRST: u64 = 64;
const KEEP_MAX: u64 = 1024;

#[derive(Debug)]
pub(crate) struct DraftEpochs {
    /// Whether this epoch speculates.
    on: bool,
    /// Decoding steps left in this epoch.
    left: u64,
    /// Steps run in this epoch, and the tokens and seconds of its measured ones.
    steps: u64,
    tokens: u64,
    seconds: f64,
    /// Of the measured steps: the requests decoding, and their target forwards' seconds
    /// (what plain decoding would take at most to emit a token each).
    requests: u64,
    forward_seconds: f64,
    /// The last rate (tokens a second) measured without and with speculation.
    rate: [Option<f64>; 2],
    /// Which rates this engine measured (not kept from an earlier one).
    measured_here: [bool; 2],
    /// Whether this epoch keeps a winner (else it tries a side), and the next keep's length.
    keeping: bool,
    keep: u64,
    /// Epochs switched to, each way (for the counters).
    pub switches: u64,
}

impl DraftEpochs {
    pub fn new() -> Self {
        Self {
            on: true,
            left: EXPLORE,
            steps: 0,
            tokens: 0,
            seconds: 0.0,
            requests: 0,
            forward_seconds: 0.0,
            rate: [None, None],
            measured_here: [false, false],
            keeping: false,
            keep: KEEP_FIRST,
            switches: 0,
        }
    }

    /// Epochs that start by keeping the faster side of rates measured before (a kept
    /// verdict: [`super::speculation_memory`]), trying the other side when the keep ends.
    pub fn from_rates(plain: f64, speculating: f64) -> Self {
        let on = speculating > plain;
        Self { on, left: KEEP_FIRST, rate: [Some(plain), Some(speculating)], keeping: true, ..Self::new() }
    }

    /// Both rates (plain, speculating), once this engine measured each side itself.
    pub fn measured(&self) -> Option<(f64, f64)> {
        match (self.measured_here, self.rate) {
            ([true, true], [Some(off), Some(on)]) => Some((off, on)),
            _ => None,
        }
    }

    /// Whether requests speculate in this epoch.
    pub fn on(&self) -> bool {
        self.on
    }

    /// Ends a speculating try at its next step, once some of it is measured: the batch's
    /// draft counts chose none, so speculating pays its costs (unfed steps, the draft
    /// layer's rows) for nothing.
    pub fn cut_short(&mut self) {
        if self.on && !self.keeping && self.steps > SETTLE {
            self.left = self.left.min(1);
        }
    }

    /// Whether the measured steps emitted fewer tokens a second than plain decoding would
    /// at its slowest (see the module's doc).
    fn surely_losing(&self) -> bool {
        self.seconds > 0.0
            && self.forward_seconds > 0.0
            && (self.tokens as f64 / self.seconds) < (self.requests as f64 / self.forward_seconds)
    }

    /// A decoding step of `requests` decoding requests emitted `tokens` in `seconds`, its
    /// target forward (with reading its outputs back) taking `forward_seconds`. Returns
    /// the new setting when an epoch ends with a switch.
    pub fn record(&mut self, step: Step) -> Option<bool> {
        let Step { tokens, seconds, requests, forward_seconds, speculating } = step;
        self.steps += 1;
        // A step measures its epoch's side only when it runs that side: requests admitted
        // before a switch still run as they were admitted.
        if self.steps > SETTLE && speculating == self.on {
            self.tokens += tokens;
            self.seconds += seconds;
            self.requests += requests;
            self.forward_seconds += forward_seconds;
        }
        self.left = self.left.saturating_sub(1);
        let trying = self.on && !self.keeping;
        if trying && self.steps >= SETTLE + BOUND_STEPS && self.surely_losing() {
            self.left = 0;
        }
        if self.left > 0 {
            return None;
        }
        let measured = (self.seconds > 0.0).then(|| self.tokens as f64 / self.seconds);
        let side = usize::from(self.on);
        if measured.is_some() {
            self.rate[side] = measured;
            self.measured_here[side] = true;
        }
        let next = match (self.keeping, self.rate) {
            // A side is untried: try it.
            (_, [None, _]) => false,
            (_, [_, None]) => true,
            // A keep ends: try the other side.
            (true, _) => !self.on,
            // A try ends: keep the faster (ties to not speculating).
            (false, [Some(off), Some(on)]) => {
                let winner = on > off;
                if winner == self.on {
                    // The side just tried won: it takes over from the start.
                    self.keep = KEEP_FIRST;
                } else {
                    // The side kept before won again: it keeps longer.
                    self.keep = (self.keep * 2).min(KEEP_MAX);
                }
                winner
            }
        };
        // What follows a try of both sides, or a keep, is the other kind of epoch.
        let both_tried = self.rate.iter().all(Option::is_some);
        self.keeping = both_tried && !self.keeping;
        self.left = if self.keeping { self.keep } else { EXPLORE };
        (self.steps, self.tokens, self.seconds) = (0, 0, 0.0);
        (self.requests, self.forward_seconds) = (0, 0.0);
        let switched = next != self.on;
        self.on = next;
        self.switches += u64::from(switched);
        switched.then_some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records a step of the epoch's own side.
    fn run(e: &mut DraftEpochs, tokens: u64, seconds: f64, requests: u64, forward_seconds: f64) -> Option<bool> {
        e.record(Step { tokens, seconds, requests, forward_seconds, speculating: e.on() })
    }

    /// Runs `steps` decoding steps where speculating emits `on` tokens a second and not
    /// `off`; returns the share of steps that speculated after the first 100.
    fn share_on(on: f64, off: f64, steps: usize) -> f64 {
        let mut e = DraftEpochs::new();
        let mut spec = 0;
        for i in 0..steps {
            let rate = if e.on() { on } else { off };
            if i >= 100 && e.on() {
                spec += 1;
            }
            run(&mut e, (rate * 0.01) as u64, 0.01, 1, 0.0);
        }
        spec as f64 / (steps - 100) as f64
    }

    #[test]
    fn speculation_that_pays_is_kept_and_rarely_left() {
        let s = share_on(2000.0, 1000.0, 3000);
        assert!(s > 0.95, "speculated {s:.3} of the steps");
    }

    #[test]
    fn speculation_that_loses_is_left_and_rarely_tried() {
        let s = share_on(700.0, 1000.0, 3000);
        assert!(s < 0.05, "speculated {s:.3} of the steps");
    }

    #[test]
    fn a_speculating_try_that_drafts_nothing_ends_early() {
        let mut e = DraftEpochs::new();
        // Not before anything is measured.
        for _ in 0..SETTLE {
            e.cut_short();
            assert_eq!(run(&mut e, 10, 0.01, 1, 0.0), None);
        }
        run(&mut e, 10, 0.01, 1, 0.0);
        e.cut_short();
        assert_eq!(run(&mut e, 10, 0.01, 1, 0.0), Some(false), "ended at the next step");
        assert!(!e.on());
        // A plain epoch is not cut.
        e.cut_short();
        assert_eq!(run(&mut e, 10, 0.01, 1, 0.0), None);
    }

    #[test]
    fn epochs_start_speculating_then_try_without() {
        let mut e = DraftEpochs::new();
        assert!(e.on());
        let switches: Vec<Option<bool>> = (0..EXPLORE * 2).map(|_| run(&mut e, 10, 0.01, 1, 0.0)).collect();
        assert_eq!(switches[EXPLORE as usize - 1], Some(false), "after the first epoch: without");
        assert!(!e.on());
        // Equal rates: not speculating wins the tie, and keeps.
        assert_eq!(switches[2 * EXPLORE as usize - 1], None);
        assert!(!e.on());
    }

    #[test]
    fn a_try_slower_than_plain_at_its_slowest_ends_once_measured() {
        // Speculating: 2 tokens a step of 1.5 ms whose target forward took 0.6 ms; plain
        // decoding would emit at least one token per 0.6 ms (1,667/s > 1,333/s).
        let mut e = DraftEpochs::new();
        let steps: Vec<Option<bool>> = (0..EXPLORE).map(|_| run(&mut e, 2, 0.0015, 1, 0.0006)).collect();
        let end = (SETTLE + BOUND_STEPS) as usize - 1;
        assert_eq!(steps[end], Some(false), "{steps:?}");
        assert!(steps[..end].iter().all(Option::is_none));
        // Where the forward is most of the step, the bound proves nothing: the try runs on.
        let mut e = DraftEpochs::new();
        let steps: Vec<Option<bool>> = (0..EXPLORE).map(|_| run(&mut e, 2, 0.0015, 1, 0.0012)).collect();
        assert_eq!(steps.iter().position(Option::is_some), Some(EXPLORE as usize - 1));
        // A batch: four requests, 6 tokens a step; their forward bounds plain at 4 per step.
        let mut e = DraftEpochs::new();
        let steps: Vec<Option<bool>> = (0..EXPLORE).map(|_| run(&mut e, 6, 0.002, 4, 0.0015)).collect();
        assert_eq!(steps.iter().position(Option::is_some), Some(EXPLORE as usize - 1), "6/2ms beats 4/1.5ms");
    }

    #[test]
    fn kept_rates_start_with_the_faster_side_and_try_the_other_later() {
        let mut e = DraftEpochs::from_rates(2000.0, 1500.0);
        assert!(!e.on(), "plain was faster");
        assert_eq!(e.measured(), None, "nothing measured here yet");
        let switches: Vec<Option<bool>> = (0..KEEP_FIRST).map(|_| run(&mut e, 10, 0.005, 1, 0.0)).collect();
        assert_eq!(switches[KEEP_FIRST as usize - 1], Some(true), "the keep ends with a try of speculating");
        assert!(DraftEpochs::from_rates(1000.0, 1800.0).on());
        // Measured here on both sides: rates to keep.
        let mut e = DraftEpochs::new();
        for _ in 0..2 * EXPLORE {
            run(&mut e, 10, 0.01, 1, 0.0);
        }
        let (plain, spec) = e.measured().expect("both sides measured");
        assert!((plain - 1000.0).abs() < 1e-6 && (spec - 1000.0).abs() < 1e-6, "{plain} {spec}");
    }

    #[test]
    fn steps_of_the_other_side_measure_nothing() {
        // A speculating epoch whose requests all run plain (admitted before the switch)
        // leaves the speculating rate unmeasured.
        let mut e = DraftEpochs::from_rates(2000.0, 1500.0);
        while !e.on() {
            run(&mut e, 10, 0.005, 1, 0.0);
        }
        for _ in 0..EXPLORE {
            e.record(Step { tokens: 10, seconds: 0.004, requests: 1, forward_seconds: 0.0, speculating: false });
        }
        assert_eq!(e.measured(), None);
    }
}

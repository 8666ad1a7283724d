//! Which runs of kernel launches have become device graphs (the CUDA backend's launch
//! queue, `cuda/queue.rs`): graphs kept by their run's words (hash, then the words
//! themselves), the least recently launched dropped first, and the runs seen once, since
//! a run becomes a graph the second time it is seen. Pure bookkeeping, generic over the
//! graph handle, so it is tested without a GPU.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::collections::HashMap;

/// What to do with a run about to be sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan<E> {
    /// Launch this graph: it runs `kernels` kernels.
    Replay(E, usize),
    /// The run was seen before: build its graph, launch it and `insert` it.
    Build,
    /// Launch the kernels one by one.
    Each,
}

struct Entry<E> {
    words: Vec<u64>,
    exec: E,
    kernels: usize,
    /// When it was last launched: the least recent goes first.
    used: u64,
}

pub(crate) struct GraphCache<E> {
    graphs: HashMap<u64, Vec<Entry<E>>>,
    kept: usize,
    /// Hashes of runs sent one by one, with when they were last seen.
    seen: HashMap<u64, u64>,
    clock: u64,
    max_graphs: usize,
    max_seen: usize,
    min_kernels: usize,
}

/// FNV-1a over the words.
fn hash(words: &[u64]) -> u64 {
    words.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| (h ^ w).wrapping_mul(0x0000_0100_0000_01b3))
}

impl<E: Copy> GraphCache<E> {
    /// Up to `max_graphs` graphs and `max_seen` candidates; runs shorter than
    /// `min_kernels` are always sent one by one.
    pub fn new(max_graphs: usize, max_seen: usize, min_kernels: usize) -> Self {
        assert!(max_graphs >= 1 && max_seen >= 2, "a graph cache needs room");
        Self { graphs: HashMap::new(), kept: 0, seen: HashMap::new(), clock: 0, max_graphs, max_seen, min_kernels }
    }

    /// Graphs held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.kept
    }

    /// The plan for a run of `kernels` launches encoded as `words`.
    pub fn plan(&mut self, words: &[u64], kernels: usize) -> Plan<E> {
        self.clock += 1;
        let (h, now) = (hash(words), self.clock);
        if let Some(e) = self.graphs.get_mut(&h).and_then(|v| v.iter_mut().find(|e| e.words == words)) {
            e.used = now;
            return Plan::Replay(e.exec, e.kernels);
        }
        if kernels < self.min_kernels {
            return Plan::Each;
        }
        if self.seen.remove(&h).is_some() {
            return Plan::Build;
        }
        self.seen.insert(h, now);
        if self.seen.len() > self.max_seen {
            // Forget the older half.
            let mut ages: Vec<u64> = self.seen.values().copied().collect();
            ages.sort_unstable();
            let cut = ages[ages.len() / 2];
            self.seen.retain(|_, &mut t| t > cut);
        }
        Plan::Each
    }

    /// Keeps the graph built for `words` (after `Plan::Build`); returns the graph dropped
    /// to make room, for the caller to destroy.
    pub fn insert(&mut self, words: Vec<u64>, exec: E, kernels: usize) -> Option<E> {
        let h = hash(&words);
        self.graphs.entry(h).or_default().push(Entry { words, exec, kernels, used: self.clock });
        self.kept += 1;
        if self.kept <= self.max_graphs {
            return None;
        }
        let (used, h) = self.graphs.iter().flat_map(|(&h, v)| v.iter().map(move |e| (e.used, h))).min()?;
        let list = self.graphs.get_mut(&h).expect("the oldest graph's list");
        let i = list.iter().position(|e| e.used == used).expect("the oldest graph");
        let old = list.swap_remove(i);
        if list.is_empty() {
            self.graphs.remove(&h);
        }
        self.kept -= 1;
        Some(old.exec)
    }

    /// Every graph held, for the caller to destroy; the cache is empty afterwards.
    pub fn drain(&mut self) -> Vec<E> {
        self.kept = 0;
        self.graphs.drain().flat_map(|(_, v)| v.into_iter().map(|e| e.exec)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_becomes_a_graph_the_second_time_and_replays_after() {
        let mut c = GraphCache::<u32>::new(4, 8, 4);
        let run = vec![1, 2, 3];
        assert_eq!(c.plan(&run, 5), Plan::Each);
        assert_eq!(c.plan(&run, 5), Plan::Build);
        assert_eq!(c.insert(run.clone(), 7, 5), None);
        for _ in 0..3 {
            assert_eq!(c.plan(&run, 5), Plan::Replay(7, 5));
        }
        // Another run, and short runs, go one by one.
        assert_eq!(c.plan(&[9, 9], 5), Plan::Each);
        assert_eq!(c.plan(&[4], 3), Plan::Each);
        assert_eq!(c.plan(&[4], 3), Plan::Each);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn equal_hashes_are_told_apart_by_the_words() {
        let mut c = GraphCache::<u32>::new(4, 8, 1);
        let (a, b) = (vec![1u64, 2], vec![2u64, 1]);
        for (run, exec) in [(&a, 10), (&b, 20)] {
            assert_eq!(c.plan(run, 1), Plan::Each);
            assert_eq!(c.plan(run, 1), Plan::Build);
            c.insert(run.clone(), exec, 1);
        }
        assert_eq!(c.plan(&a, 1), Plan::Replay(10, 1));
        assert_eq!(c.plan(&b, 1), Plan::Replay(20, 1));
    }

    #[test]
    fn the_least_recently_launched_graph_goes_first() {
        let mut c = GraphCache::<u32>::new(2, 8, 1);
        let runs: Vec<Vec<u64>> = (0..3).map(|i| vec![i]).collect();
        let build = |c: &mut GraphCache<u32>, i: usize| {
            assert_eq!(c.plan(&runs[i], 1), Plan::Each);
            assert_eq!(c.plan(&runs[i], 1), Plan::Build);
            c.insert(runs[i].clone(), i as u32, 1)
        };
        assert_eq!(build(&mut c, 0), None);
        assert_eq!(build(&mut c, 1), None);
        // Run 0 launched again: run 1 is now the oldest.
        assert_eq!(c.plan(&runs[0], 1), Plan::Replay(0, 1));
        assert_eq!(build(&mut c, 2), Some(1));
        assert_eq!(c.len(), 2);
        assert_eq!(c.plan(&runs[0], 1), Plan::Replay(0, 1));
        assert_eq!(c.plan(&runs[2], 1), Plan::Replay(2, 1));
        // Run 1 starts over as a candidate.
        assert_eq!(c.plan(&runs[1], 1), Plan::Each);
        assert_eq!(c.plan(&runs[1], 1), Plan::Build);
        let mut left = c.drain();
        left.sort_unstable();
        assert_eq!((left, c.len()), (vec![0, 2], 0));
    }

    #[test]
    fn candidates_beyond_the_limit_forget_the_older_half() {
        let mut c = GraphCache::<u32>::new(4, 4, 1);
        for i in 0..5u64 {
            assert_eq!(c.plan(&[i], 1), Plan::Each);
        }
        // Runs 0..=2 were forgotten when the fifth arrived; 3 and 4 are remembered.
        assert_eq!(c.plan(&[0], 1), Plan::Each);
        assert_eq!(c.plan(&[4], 1), Plan::Build);
        assert_eq!(c.plan(&[3], 1), Plan::Build);
    }
}

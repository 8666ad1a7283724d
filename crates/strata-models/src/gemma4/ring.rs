//! The sliding layers' KV cache: a ring per sequence. A sliding layer's row at position
//! `p` sees positions `p - window + 1 ..= p`, so a sequence keeps only its last `size`
//! positions, `size >= window + rows - 1` (a forward's rows are written before any is
//! attended, and the earliest row must still find its window). The ring is expressed as
//! block tables that wrap (entry `j` of sequence `s` is block `s * blocks + j % blocks`),
//! so the backend's attention ops run on it unchanged: position `p` lives in slot
//! `s * size + p % size`.
//!
//! Rolling back is possible while the ring still holds the window the next row needs;
//! otherwise the sequence starts over (its cache is recomputed from the prompt).

use crate::kv::BLOCK_SIZE;
use strata_backend::Step;

pub(super) struct Ring {
    window: usize,
    /// Blocks per sequence.
    blocks: usize,
    /// The step of the sliding layers: the forward's rows over the ring tables.
    pub step: Step,
    /// Per sequence index: the lowest position the ring still holds.
    floor: Vec<usize>,
}

impl Ring {
    /// Rings of at least `window + max_rows - 1` positions (at most `max_len`, rounded up
    /// to whole blocks) for `max_seqs` sequences; `max_blocks` is the full layers' table
    /// width (a sequence's table has that many entries here too).
    pub fn new(window: usize, max_rows: usize, max_len: usize, max_seqs: usize, max_blocks: usize) -> Self {
        let size = (window + max_rows.max(1) - 1).min(max_len.max(1));
        let blocks = size.div_ceil(BLOCK_SIZE).max(1);
        let mut step = Step { block_size: BLOCK_SIZE, max_blocks, ..Default::default() };
        step.tokens.reserve(max_rows);
        step.positions.reserve(max_rows);
        step.seq.reserve(max_rows);
        step.blocks = (0..max_seqs * max_blocks)
            .map(|i| ((i / max_blocks) * blocks + (i % max_blocks) % blocks) as u32)
            .collect();
        Self { window, blocks, step, floor: vec![0; max_seqs] }
    }

    /// Positions a sequence's ring holds.
    pub fn size(&self) -> usize {
        self.blocks * BLOCK_SIZE
    }

    /// Cache slots over every sequence.
    pub fn slots(&self) -> usize {
        self.floor.len() * self.size()
    }

    /// Takes the forward's rows from the full layers' step. `blocks`: rows fed by an
    /// embedding (image soft tokens) also see the later rows of their run (a maximal run
    /// of such rows of one sequence at consecutive positions): Gemma 4's bidirectional
    /// image attention on sliding layers.
    pub fn refresh(&mut self, full: &Step, blocks: bool) {
        let s = &mut self.step;
        s.tokens.clear();
        s.tokens.extend_from_slice(&full.tokens);
        s.positions.clear();
        s.positions.extend_from_slice(&full.positions);
        s.seq.clear();
        s.seq.extend_from_slice(&full.seq);
        s.visible_to.clear();
        if !blocks || !full.tokens.contains(&u32::MAX) {
            return;
        }
        let rows = full.rows();
        s.visible_to.extend(full.positions.iter().map(|&p| p + 1));
        let mut r = 0;
        while r < rows {
            if full.tokens[r] != u32::MAX {
                r += 1;
                continue;
            }
            let mut end = r + 1;
            while end < rows
                && full.tokens[end] == u32::MAX
                && full.seq[end] == full.seq[r]
                && full.positions[end] == full.positions[end - 1] + 1
            {
                end += 1;
            }
            let last = full.positions[end - 1] + 1;
            s.visible_to[r..end].iter_mut().for_each(|v| *v = last);
            r = end;
        }
    }

    /// Records that sequence `seq` now holds `len` positions.
    pub fn commit(&mut self, seq: usize, len: usize) {
        self.floor[seq] = self.floor[seq].max(len.saturating_sub(self.size()));
    }

    /// Whether the sequence can continue from `len` positions (the window of position
    /// `len` is still in the ring).
    pub fn can_keep(&self, seq: usize, len: usize) -> bool {
        self.floor[seq] <= (len + 1).saturating_sub(self.window)
    }

    /// A sequence starting over (new, or rolled back past its ring).
    pub fn reset(&mut self, seq: usize) {
        self.floor[seq] = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_wrap_within_each_sequence() {
        // Window 20, 8 rows a forward: 27 positions needed, 32 held (two blocks).
        let r = Ring::new(20, 8, 1000, 2, 63);
        assert_eq!((r.size(), r.slots()), (32, 64));
        let mut step = r.step.clone();
        step.seq = vec![0, 1];
        step.positions = vec![0, 0];
        for (row, seq) in [(0usize, 0usize), (1, 1)] {
            for p in [0usize, 5, 31, 32, 33, 100, 999] {
                assert_eq!(step.slot(row, p), seq * 32 + p % 32, "seq {seq} pos {p}");
            }
        }
    }

    #[test]
    fn image_rows_see_the_rest_of_their_run() {
        let mut r = Ring::new(8, 8, 100, 2, 7);
        let m = u32::MAX;
        let full = Step {
            tokens: vec![5, m, m, m, 6, m, m, m],
            positions: vec![3, 4, 5, 6, 7, 0, 1, 9],
            seq: vec![0, 0, 0, 0, 0, 1, 1, 1],
            ..Default::default()
        };
        r.refresh(&full, true);
        assert_eq!(r.step.visible_to, vec![4, 7, 7, 7, 8, 2, 2, 10]);
        r.refresh(&full, false);
        assert!(r.step.visible_to.is_empty());
        assert_eq!(r.step.visible(1), 5);
    }

    #[test]
    fn rollback_is_refused_past_the_ring() {
        let mut r = Ring::new(8, 4, 1000, 1, 63);
        assert_eq!(r.size(), 16);
        r.commit(0, 10);
        assert!(r.can_keep(0, 3));
        r.commit(0, 40);
        // The ring holds 24..40; position 35's window starts at 28.
        assert!(r.can_keep(0, 35) && r.can_keep(0, 31) && !r.can_keep(0, 30) && !r.can_keep(0, 5));
        r.reset(0);
        assert!(r.can_keep(0, 0));
    }
}

//! Batch union: the experts routed by all rows of one forward at one layer (prefill
//! rows, MTP verify rows, batched requests), deduplicated in a stable order, so each
//! unique expert is loaded once and runs over every row that chose it.

/// One unique expert and the (row, rank) positions that selected it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnionEntry {
    pub expert: usize,
    /// (row, rank within the row's top-k), in row-major order.
    pub consumers: Vec<(usize, usize)>,
}

/// Deduplicates row-major top-k routes (`ids[row * top_k + rank]`) keeping each
/// expert's first position. Record usage (ledger, trace) on `ids` *before* calling
/// this: every selection counts. A forward's misses go to the working bank in waves:
/// `misses.chunks(working_slots)`.
///
/// Panics if `top_k` is 0 or does not divide `ids.len()`.
pub fn batch_union(ids: &[usize], top_k: usize) -> Vec<UnionEntry> {
    assert!(top_k > 0 && ids.len() % top_k == 0, "batch_union: {} ids are not rows of top-{top_k}", ids.len());
    let mut entries: Vec<UnionEntry> = Vec::new();
    // Expert ids are small (< 256 for GLM-5): a dense position table beats hashing.
    let mut position: Vec<usize> = Vec::new();
    for (i, &expert) in ids.iter().enumerate() {
        if expert >= position.len() {
            position.resize(expert + 1, usize::MAX);
        }
        if position[expert] == usize::MAX {
            position[expert] = entries.len();
            entries.push(UnionEntry { expert, consumers: Vec::new() });
        }
        entries[position[expert]].consumers.push((i / top_k, i % top_k));
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn union_keeps_first_positions_and_every_consumer() {
        // Two rows of top-3: row 0 = [5, 2, 9], row 1 = [2, 7, 5].
        let entries = batch_union(&[5, 2, 9, 2, 7, 5], 3);
        let experts: Vec<_> = entries.iter().map(|e| e.expert).collect();
        assert_eq!(experts, vec![5, 2, 9, 7]);
        assert_eq!(entries[0].consumers, vec![(0, 0), (1, 2)]);
        assert_eq!(entries[1].consumers, vec![(0, 1), (1, 0)]);
        assert_eq!(entries[3].consumers, vec![(1, 1)]);
        let selections: usize = entries.iter().map(|e| e.consumers.len()).sum();
        assert_eq!(selections, 6);
    }

    #[test]
    fn single_row_and_empty_batches() {
        assert_eq!(batch_union(&[3, 1], 2).len(), 2);
        assert!(batch_union(&[], 8).is_empty());
    }

    #[test]
    #[should_panic(expected = "not rows of top-3")]
    fn ragged_input_panics() {
        batch_union(&[1, 2], 3);
    }
}

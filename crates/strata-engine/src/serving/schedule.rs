//! Scheduling decisions, apart from memory and execution: how many rows each running
//! request feeds in the next forward, and whether a waiting request may start.

/// Rows for each running request (by its pending tokens, in admission order) in one
/// forward of at most `budget` rows: first one row for every request that decodes (its
/// only pending token is its last sample), then the rows of the drafts each decoding
/// request wants verified (`drafts`), then prompt chunks, oldest request first, in what
/// the budget leaves. A long prompt so never holds up the others' next tokens: it
/// advances by what each step has room for.
pub fn plan_rows(pending: &[usize], drafts: &[usize], budget: usize, rows: &mut Vec<usize>) {
    rows.clear();
    rows.resize(pending.len(), 0);
    let mut left = budget;
    for (r, &p) in rows.iter_mut().zip(pending) {
        if p == 1 && left > 0 {
            *r = 1;
            left -= 1;
        }
    }
    for ((r, &p), &d) in rows.iter_mut().zip(pending).zip(drafts) {
        if p == 1 && *r == 1 {
            let more = d.min(left);
            *r += more;
            left -= more;
        }
    }
    for (r, &p) in rows.iter_mut().zip(pending) {
        if p > 1 && left > 0 {
            *r = p.min(left);
            left -= *r;
        }
    }
}

/// Whether a request that needs `need` more KV blocks may start while `running`
/// sequences hold theirs and `available` blocks are free (or evictable): it must fit
/// with a block of headroom left for each running sequence. Alone, it always starts.
pub fn admits(need: usize, available: usize, running: usize) -> bool {
    running == 0 || need + running <= available
}

/// Whole KV blocks two token sequences have in common from their start.
pub fn shared_blocks(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count() / strata_models::kv::BLOCK_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(pending: &[usize], drafts: &[usize], budget: usize) -> Vec<usize> {
        // (Over what a step before left.)
        let mut rows = vec![7; 9];
        plan_rows(pending, drafts, budget, &mut rows);
        rows
    }

    #[test]
    fn decode_rows_come_first_then_prompt_chunks_in_order() {
        let none = [0; 4];
        assert_eq!(plan(&[300, 1, 1, 40], &none, 256), vec![254, 1, 1, 0]);
        assert_eq!(plan(&[10, 1, 40], &none, 64), vec![10, 1, 40]);
        assert_eq!(plan(&[10, 1, 60], &none, 64), vec![10, 1, 53]);
        // More decoders than the budget: the oldest go first.
        assert_eq!(plan(&[1, 1, 1], &none, 2), vec![1, 1, 0]);
        assert_eq!(plan(&[], &none, 8), Vec::<usize>::new());
        // Drafts to verify come after every decoder's own row, before prompt chunks.
        assert_eq!(plan(&[1, 40, 1], &[3, 0, 3], 16), vec![4, 8, 4]);
        assert_eq!(plan(&[1, 40, 1], &[3, 0, 3], 6), vec![4, 0, 2]);
        assert_eq!(plan(&[1, 1], &[2, 2], 2), vec![1, 1]);
    }

    #[test]
    fn shared_prefixes_count_whole_blocks() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        assert_eq!(shared_blocks(&a, &b), 2);
        b[20] = 0;
        assert_eq!(shared_blocks(&a, &b), 1);
        assert_eq!(shared_blocks(&a, &a[..15]), 0);
    }

    #[test]
    fn admission_keeps_headroom_for_running_sequences() {
        assert!(admits(100, 0, 0));
        assert!(admits(4, 6, 2));
        assert!(!admits(5, 6, 2));
    }
}

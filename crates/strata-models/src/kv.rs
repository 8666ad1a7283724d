//! KV cache bookkeeping on the host: a pool of fixed-size blocks and each sequence's block
//! table. The device holds, per layer, `[blocks * block_size, width]`; a position's slot is
//! `table[pos / block_size] * block_size + pos % block_size`. Fixed-size blocks make
//! rollback (truncate) and, later, prefix sharing a matter of table edits.

use crate::batch::SeqId;
use anyhow::{bail, Result};

/// Positions per block.
pub const BLOCK_SIZE: usize = 16;

#[derive(Debug)]
struct SeqBlocks {
    blocks: Vec<u32>,
    len: usize,
}

#[derive(Debug)]
pub struct KvBlocks {
    /// Free blocks, lowest last (handed out lowest first: touched memory stays compact).
    free: Vec<u32>,
    total: usize,
    seqs: Vec<Option<SeqBlocks>>,
    max_blocks: usize,
}

impl KvBlocks {
    /// `tokens` positions in all (rounded up to whole blocks), at most `max_seqs`
    /// sequences of at most `max_len` positions each.
    pub fn new(tokens: usize, max_seqs: usize, max_len: usize) -> Self {
        let total = tokens.div_ceil(BLOCK_SIZE).max(1);
        let max_blocks = max_len.div_ceil(BLOCK_SIZE).max(1);
        Self { free: (0..total as u32).rev().collect(), total, seqs: (0..max_seqs).map(|_| None).collect(), max_blocks }
    }

    pub fn slots(&self) -> usize {
        self.total * BLOCK_SIZE
    }

    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    pub fn max_len(&self) -> usize {
        self.max_blocks * BLOCK_SIZE
    }

    pub fn free_positions(&self) -> usize {
        self.free.len() * BLOCK_SIZE
    }

    pub fn add(&mut self) -> Result<SeqId> {
        let Some(i) = self.seqs.iter().position(|s| s.is_none()) else {
            bail!("the session already holds its {} sequences", self.seqs.len())
        };
        self.seqs[i] = Some(SeqBlocks { blocks: Vec::with_capacity(self.max_blocks), len: 0 });
        Ok(SeqId(i as u32))
    }

    pub fn remove(&mut self, s: SeqId) {
        if let Some(seq) = self.seqs.get_mut(s.0 as usize).and_then(Option::take) {
            self.free.extend(seq.blocks.iter().rev());
            self.sort_free();
        }
    }

    fn seq(&self, s: SeqId) -> Result<&SeqBlocks> {
        match self.seqs.get(s.0 as usize) {
            Some(Some(q)) => Ok(q),
            _ => bail!("sequence {} is not in this session", s.0),
        }
    }

    pub fn len(&self, s: SeqId) -> usize {
        self.seq(s).map_or(0, |q| q.len)
    }

    pub fn contains(&self, s: SeqId) -> bool {
        self.seq(s).is_ok()
    }

    /// Makes room for `extra` more positions of `s` (blocks from the pool); an error
    /// names the limit when the sequence or the pool is full.
    pub fn reserve(&mut self, s: SeqId, extra: usize) -> Result<()> {
        let max_len = self.max_len();
        let len = self.seq(s)?.len;
        if len + extra > max_len {
            bail!("the sequence would hold {} positions; the session's context is {max_len}", len + extra);
        }
        let need = (len + extra).div_ceil(BLOCK_SIZE);
        let have = self.seq(s)?.blocks.len();
        if need > have && need - have > self.free.len() {
            bail!(
                "the KV cache is full: {} more positions needed, {} free of {}",
                extra,
                self.free.len() * BLOCK_SIZE + (have * BLOCK_SIZE - len),
                self.slots()
            );
        }
        for _ in have..need {
            let b = self.free.pop().expect("checked above");
            self.seqs[s.0 as usize].as_mut().unwrap().blocks.push(b);
        }
        Ok(())
    }

    /// Records that `s` now holds `len` positions (after a forward wrote them).
    pub fn set_len(&mut self, s: SeqId, len: usize) {
        if let Some(Some(q)) = self.seqs.get_mut(s.0 as usize) {
            debug_assert!(len <= q.blocks.len() * BLOCK_SIZE);
            q.len = len;
        }
    }

    /// Drops positions `len..` of `s` and returns whole blocks beyond them to the pool.
    pub fn truncate(&mut self, s: SeqId, len: usize) {
        let Some(Some(q)) = self.seqs.get_mut(s.0 as usize) else { return };
        q.len = q.len.min(len);
        let keep = q.len.div_ceil(BLOCK_SIZE);
        while q.blocks.len() > keep {
            let b = q.blocks.pop().unwrap();
            self.free.push(b);
        }
        self.sort_free();
    }

    fn sort_free(&mut self) {
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// Writes every sequence's table into `tables` (`max_blocks` entries per sequence
    /// index; unused entries 0).
    pub fn write_tables(&self, tables: &mut Vec<u32>) {
        tables.clear();
        tables.resize(self.seqs.len() * self.max_blocks, 0);
        for (i, s) in self.seqs.iter().enumerate() {
            if let Some(s) = s {
                tables[i * self.max_blocks..i * self.max_blocks + s.blocks.len()].copy_from_slice(&s.blocks);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_and_go_with_sequences() {
        let mut kv = KvBlocks::new(64, 2, 48);
        let a = kv.add().unwrap();
        let b = kv.add().unwrap();
        assert!(kv.add().is_err());
        kv.reserve(a, 20).unwrap();
        kv.set_len(a, 20);
        kv.reserve(b, 30).unwrap();
        kv.set_len(b, 30);
        assert_eq!(kv.free_positions(), 64 - 2 * 16 - 2 * 16);
        let err = kv.reserve(b, 30).unwrap_err().to_string();
        assert!(err.contains("context is 48"), "{err}");
        kv.truncate(a, 5);
        assert_eq!(kv.len(a), 5);
        assert_eq!(kv.free_positions(), 16);
        let err = kv.reserve(a, 40).unwrap_err().to_string();
        assert!(err.contains("KV cache is full"), "{err}");
        kv.reserve(b, 17).unwrap();
        kv.remove(a);
        assert_eq!(kv.free_positions(), 16);
        let mut t = Vec::new();
        kv.write_tables(&mut t);
        assert_eq!(t.len(), 2 * 3);
        assert!(kv.reserve(a, 1).is_err());
    }
}

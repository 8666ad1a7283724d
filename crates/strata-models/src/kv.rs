//! KV cache bookkeeping on the host: a pool of fixed-size blocks and each sequence's block
//! table. The device holds, per layer, `[blocks * block_size, width]`; a position's slot is
//! `table[pos / block_size] * block_size + pos % block_size`. Fixed-size blocks make
//! rollback (truncate) and prefix sharing a matter of table edits.
//!
//! Prefix sharing: blocks are reference-counted. A sequence may start from full blocks
//! that another sequence (or a prefix cache, through [`KvBlocks::retain`]) holds
//! ([`KvBlocks::attach`]); it then only appends after them, so a shared block is never
//! written again (no copy-on-write). A block returns to the pool when its last holder
//! lets it go.

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
    /// Holders of each block (sequences and [`KvBlocks::retain`] calls); 0 when free.
    refs: Vec<u32>,
}

impl KvBlocks {
    /// `tokens` positions in all (rounded up to whole blocks), at most `max_seqs`
    /// sequences of at most `max_len` positions each.
    pub fn new(tokens: usize, max_seqs: usize, max_len: usize) -> Self {
        let total = tokens.div_ceil(BLOCK_SIZE).max(1);
        let max_blocks = max_len.div_ceil(BLOCK_SIZE).max(1);
        Self {
            free: (0..total as u32).rev().collect(),
            total,
            seqs: (0..max_seqs).map(|_| None).collect(),
            max_blocks,
            refs: vec![0; total],
        }
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
            for &b in seq.blocks.iter().rev() {
                self.unref(b);
            }
            self.sort_free();
        }
    }

    /// Drops one reference to `b`; the last one returns it to the pool (unsorted).
    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        debug_assert!(*r > 0, "block {b} released more often than held");
        *r = r.saturating_sub(1);
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.total
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Holders of block `b` (0: free).
    pub fn refs(&self, b: u32) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// The block table of `s` (empty for an unknown sequence).
    pub fn blocks_of(&self, s: SeqId) -> &[u32] {
        self.seq(s).map_or(&[], |q| &q.blocks)
    }

    /// Blocks `s` still needs to hold `extra` more positions.
    pub fn blocks_needed(&self, s: SeqId, extra: usize) -> usize {
        self.seq(s).map_or(0, |q| (q.len + extra).div_ceil(BLOCK_SIZE).saturating_sub(q.blocks.len()))
    }

    /// Starts the empty sequence `s` from `blocks`, full blocks held elsewhere (a prefix
    /// another sequence or a cache computed): `s` then holds `blocks.len() * BLOCK_SIZE`
    /// positions and appends after them.
    pub fn attach(&mut self, s: SeqId, blocks: &[u32]) -> Result<()> {
        let q = self.seq(s)?;
        if q.len != 0 || !q.blocks.is_empty() {
            bail!("sequence {} already holds positions; a shared prefix goes first", s.0);
        }
        if blocks.len() > self.max_blocks {
            bail!("a prefix of {} blocks exceeds the session's {} blocks per sequence", blocks.len(), self.max_blocks);
        }
        if let Some(&b) = blocks.iter().find(|&&b| self.refs(b) == 0) {
            bail!("block {b} is free: only held blocks can be shared");
        }
        for &b in blocks {
            self.refs[b as usize] += 1;
        }
        let q = self.seqs[s.0 as usize].as_mut().expect("checked above");
        q.blocks.extend_from_slice(blocks);
        q.len = blocks.len() * BLOCK_SIZE;
        Ok(())
    }

    /// Holds `blocks` outside any sequence (a prefix cache), so they outlive the
    /// sequences that wrote them.
    pub fn retain(&mut self, blocks: &[u32]) -> Result<()> {
        if let Some(&b) = blocks.iter().find(|&&b| self.refs(b) == 0) {
            bail!("block {b} is free: only held blocks can be retained");
        }
        for &b in blocks {
            self.refs[b as usize] += 1;
        }
        Ok(())
    }

    /// Lets go of blocks taken with [`KvBlocks::retain`].
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.refs(b) > 0 {
                self.unref(b);
            }
        }
        self.sort_free();
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
            self.refs[b as usize] = 1;
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

    /// Drops positions `len..` of `s` and lets go of whole blocks beyond them. A shared
    /// block is never written again: when `len` falls inside one, the sequence lets go of
    /// all of it and keeps the positions before it (`len(s)` says where it stands).
    pub fn truncate(&mut self, s: SeqId, len: usize) {
        let Some(Some(q)) = self.seqs.get_mut(s.0 as usize) else { return };
        let mut len = q.len.min(len);
        if !len.is_multiple_of(BLOCK_SIZE) {
            let b = q.blocks[len / BLOCK_SIZE];
            if self.refs[b as usize] > 1 {
                len -= len % BLOCK_SIZE;
            }
        }
        q.len = len;
        let keep = len.div_ceil(BLOCK_SIZE);
        // Block by block (no list of the dropped ones: a verify's rollback runs every step).
        while let Some(b) =
            self.seqs[s.0 as usize].as_mut().filter(|q| q.blocks.len() > keep).and_then(|q| q.blocks.pop())
        {
            self.unref(b);
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

    #[test]
    fn shared_prefix_blocks_live_while_held() {
        let mut kv = KvBlocks::new(8 * 16, 3, 64);
        let a = kv.add().unwrap();
        kv.reserve(a, 40).unwrap();
        kv.set_len(a, 40);
        let prefix = kv.blocks_of(a)[..2].to_vec();
        kv.retain(&prefix).unwrap();
        let b = kv.add().unwrap();
        kv.attach(b, &prefix).unwrap();
        assert_eq!(kv.len(b), 32);
        assert_eq!(kv.refs(prefix[0]), 3);
        // b appends after the shared blocks, in a block of its own.
        assert_eq!(kv.blocks_needed(b, 1), 1);
        kv.reserve(b, 5).unwrap();
        kv.set_len(b, 37);
        assert!(!prefix.contains(&kv.blocks_of(b)[2]));
        assert_eq!(kv.free_blocks(), 8 - 4);
        // Attaching to a sequence that holds positions, or a free block, is refused.
        assert!(kv.attach(b, &prefix).is_err());
        let c = kv.add().unwrap();
        assert!(kv.attach(c, &[7]).is_err());
        kv.remove(c);
        // Truncating into a shared block lets go of all of it.
        kv.truncate(b, 20);
        assert_eq!(kv.len(b), 16);
        assert_eq!(kv.blocks_of(b), &prefix[..1]);
        kv.remove(a);
        kv.remove(b);
        // Only the retained prefix is held now.
        assert_eq!(kv.free_blocks(), 8 - 2);
        assert_eq!(kv.refs(prefix[1]), 1);
        kv.release(&prefix);
        assert_eq!(kv.free_blocks(), 8);
        assert!(kv.retain(&prefix).is_err());
    }
}

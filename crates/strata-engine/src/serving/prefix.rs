//! The prompt cache: full KV blocks kept after the sequences that wrote them, found again
//! by the tokens they hold. Each block is keyed by a hash chained over every token from
//! the start of the sequence to the block's end, so a key names a whole prefix; the
//! block's own tokens are kept to rule out hash collisions. The cache holds one
//! reference to each block it keeps ([`KvBlocks::retain`]); a block can be evicted
//! when nothing else holds it and no longer cached prefix extends it. Eviction is least
//! recently used, longest prefix first, within a byte cap, and on demand when running
//! sequences need the blocks.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use strata_models::kv::{KvBlocks, BLOCK_SIZE};

struct Entry {
    block: u32,
    parent: Option<u64>,
    tokens: [u32; BLOCK_SIZE],
    depth: u32,
    /// Cached blocks whose parent this is.
    children: u32,
    last_used: u64,
    /// The target's final hidden states of the block's positions, where the cache keeps
    /// them (for a draft layer's cache: see `super::speculate`).
    hidden: Option<Box<[f32]>>,
}

pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Blocks the cache may keep (its byte cap over the bytes of one block).
    capacity: usize,
    tick: u64,
    /// Prompt tokens requests took from the cache (counted by the engine at admission).
    pub hit_tokens: u64,
    pub evicted_blocks: u64,
}

/// The chained key of the block after `parent` holding `tokens`.
fn chain(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// A cache of at most `capacity_blocks` blocks (0 disables it).
    pub fn new(capacity_blocks: usize) -> Self {
        Self { entries: HashMap::new(), capacity: capacity_blocks, tick: 0, hit_tokens: 0, evicted_blocks: 0 }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks the cache holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The cached blocks holding the longest prefix of `tokens` in whole blocks, leaving
    /// at least one token to compute (its logits are needed). Marks them used.
    pub fn lookup(&mut self, tokens: &[u32]) -> Vec<u32> {
        self.lookup_with(tokens, None)
    }

    /// [`PrefixCache::lookup`]; with `hidden`, only blocks that kept their hidden states
    /// count, and those states are appended to it.
    pub fn lookup_with(&mut self, tokens: &[u32], mut hidden: Option<&mut Vec<f32>>) -> Vec<u32> {
        let mut out = Vec::new();
        if self.capacity == 0 || tokens.is_empty() {
            return out;
        }
        self.tick += 1;
        let mut parent = None;
        for block in tokens[..tokens.len() - 1].chunks_exact(BLOCK_SIZE) {
            let key = chain(parent, block);
            match self.entries.get_mut(&key) {
                Some(e) if e.tokens == block && e.parent == parent => {
                    if let Some(h) = hidden.as_deref_mut() {
                        let Some(kept) = e.hidden.as_deref() else { break };
                        h.extend_from_slice(kept);
                    }
                    e.last_used = self.tick;
                    out.push(e.block);
                }
                _ => break,
            }
            parent = Some(key);
        }
        out
    }

    /// Offers the full blocks of a sequence: `blocks[i]` holds `tokens[16 i..16 (i + 1)]`.
    /// Blocks of prefixes not yet cached are kept (one reference each); a prefix cached
    /// already keeps its own block. Then trims the cache to its capacity.
    pub fn insert(&mut self, kv: &mut KvBlocks, tokens: &[u32], blocks: &[u32]) {
        self.insert_with(kv, tokens, blocks, None)
    }

    /// [`PrefixCache::insert`], keeping the hidden states of the positions (`hidden`
    /// holds as many rows as `tokens`): a block cached without them gains them.
    pub fn insert_with(&mut self, kv: &mut KvBlocks, tokens: &[u32], blocks: &[u32], hidden: Option<&[f32]>) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        let mut parent = None;
        let width = hidden.map_or(0, |h| h.len() / tokens.len().max(1) * BLOCK_SIZE);
        let rows = |depth: usize| hidden.map(|h| Box::<[f32]>::from(&h[depth * width..(depth + 1) * width]));
        for (depth, (block, &b)) in tokens.chunks_exact(BLOCK_SIZE).zip(blocks).enumerate() {
            let key = chain(parent, block);
            match self.entries.get_mut(&key) {
                Some(e) if e.tokens == block && e.parent == parent => {
                    e.last_used = self.tick;
                    if e.hidden.is_none() {
                        e.hidden = rows(depth);
                    }
                }
                Some(_) => break, // a hash collision: leave the cached prefix alone
                None => {
                    if kv.retain(&[b]).is_err() {
                        break;
                    }
                    let mut t = [0u32; BLOCK_SIZE];
                    t.copy_from_slice(block);
                    self.entries.insert(
                        key,
                        Entry {
                            block: b,
                            parent,
                            tokens: t,
                            depth: depth as u32,
                            children: 0,
                            last_used: self.tick,
                            hidden: rows(depth),
                        },
                    );
                    if let Some(p) = parent.and_then(|p| self.entries.get_mut(&p)) {
                        p.children += 1;
                    }
                }
            }
            parent = Some(key);
        }
        let over = self.entries.len().saturating_sub(self.capacity);
        self.evict(kv, over);
    }

    /// Evicts up to `n` blocks that nothing but the cache holds, least recently used
    /// first and the longest prefix first among equals; returns how many went.
    pub fn evict(&mut self, kv: &mut KvBlocks, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.children == 0 && kv.refs(e.block) == 1)
                .min_by_key(|(_, e)| (e.last_used, u32::MAX - e.depth))
                .map(|(&k, _)| k);
            let Some(key) = victim else { break };
            let e = self.entries.remove(&key).expect("found above");
            if let Some(p) = e.parent.and_then(|p| self.entries.get_mut(&p)) {
                p.children -= 1;
            }
            kv.release(&[e.block]);
            self.evicted_blocks += 1;
            done += 1;
        }
        done
    }

    /// Blocks that [`PrefixCache::evict`] could free now.
    pub fn evictable(&self, kv: &KvBlocks) -> usize {
        // Every block held by the cache alone can go, leaves first.
        self.entries.values().filter(|e| kv.refs(e.block) == 1).count()
    }

    /// Lets go of every block (the session is being replaced).
    pub fn clear(&mut self, kv: Option<&mut KvBlocks>) {
        if let Some(kv) = kv {
            let blocks: Vec<u32> = self.entries.values().map(|e| e.block).collect();
            kv.release(&blocks);
        }
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence of `n` tokens computed into fresh blocks.
    fn computed(kv: &mut KvBlocks, tokens: &[u32]) -> strata_models::SeqId {
        let s = kv.add().unwrap();
        kv.reserve(s, tokens.len()).unwrap();
        kv.set_len(s, tokens.len());
        s
    }

    #[test]
    fn finds_whole_block_prefixes_and_leaves_a_token_to_compute() {
        let mut kv = KvBlocks::new(16 * 16, 4, 256);
        let mut cache = PrefixCache::new(100);
        let a: Vec<u32> = (0..40).collect();
        let s = computed(&mut kv, &a);
        let blocks = kv.blocks_of(s).to_vec();
        cache.insert(&mut kv, &a, &blocks);
        assert_eq!(cache.len(), 2);
        kv.remove(s);
        // The cache keeps both full blocks alive.
        assert_eq!(kv.free_blocks(), 16 - 2);
        assert_eq!(cache.lookup(&a), blocks[..2]);
        // Exactly two blocks: one token must be computed, so one block is used.
        assert_eq!(cache.lookup(&a[..32]), blocks[..1]);
        let mut other = a.clone();
        other[20] = 999;
        assert_eq!(cache.lookup(&other), blocks[..1]);
        other[3] = 999;
        assert!(cache.lookup(&other).is_empty());
        // The same tokens at another place are another prefix.
        assert!(cache.lookup(&a[16..]).is_empty());
    }

    #[test]
    fn hidden_states_travel_with_their_blocks() {
        let mut kv = KvBlocks::new(16 * 16, 4, 256);
        let mut cache = PrefixCache::new(100);
        let a: Vec<u32> = (0..40).collect();
        let s = computed(&mut kv, &a);
        let blocks = kv.blocks_of(s).to_vec();
        // Only the first block is offered with hidden states (2 values a position).
        cache.insert(&mut kv, &a[..32], &blocks[..2]);
        let h: Vec<f32> = (0..32).map(|i| i as f32 * 0.5 - 3.0).collect();
        cache.insert_with(&mut kv, &a[..16], &blocks[..1], Some(&h));
        let mut got = Vec::new();
        assert_eq!(cache.lookup_with(&a, Some(&mut got)), blocks[..1], "the second block kept no hidden states");
        assert_eq!(got, h);
        // Without asking for them, both blocks count.
        assert_eq!(cache.lookup(&a), blocks[..2]);
        // Offered again with hidden states, the second block gains them.
        let h2: Vec<f32> = (0..64).map(|i| (i * 7 % 13) as f32 - 6.0).collect();
        cache.insert_with(&mut kv, &a[..32], &blocks[..2], Some(&h2));
        got.clear();
        assert_eq!(cache.lookup_with(&a, Some(&mut got)), blocks[..2]);
        assert_eq!(&got[..32], &h[..], "the first block keeps the states it had");
        assert_eq!(&got[32..], &h2[32..]);
    }

    #[test]
    fn evicts_least_recent_leaves_within_its_capacity() {
        let mut kv = KvBlocks::new(16 * 16, 4, 256);
        let mut cache = PrefixCache::new(3);
        let a: Vec<u32> = (0..33).collect();
        let b: Vec<u32> = (100..133).collect();
        for t in [&a, &b] {
            let s = computed(&mut kv, t);
            let blocks = kv.blocks_of(s).to_vec();
            cache.insert(&mut kv, t, &blocks);
            kv.remove(s);
        }
        // Four blocks offered, three kept: a's second block (the oldest leaf) went.
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.lookup(&a).len(), 1);
        assert_eq!(cache.lookup(&b).len(), 2);
        assert_eq!(kv.free_blocks(), 16 - 3);
        // A block a running sequence holds is not evicted.
        let s = kv.add().unwrap();
        let held = cache.lookup(&b);
        kv.attach(s, &held).unwrap();
        assert_eq!(cache.evictable(&kv), 1);
        assert_eq!(cache.evict(&mut kv, 5), 1);
        assert_eq!(cache.len(), 2);
        kv.remove(s);
        assert_eq!(cache.evict(&mut kv, 5), 2);
        assert_eq!(kv.free_blocks(), 16);
        assert!(cache.is_empty());
    }
}

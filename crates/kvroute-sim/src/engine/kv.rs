//! The paged KV cache with prefix caching.
//!
//! A fixed pool of blocks (16 tokens each). A block is in one of three
//! states:
//!
//! * in use: referenced by one or more running sequences (`refs > 0`);
//! * cached: unreferenced but holding a registered hash, so a later request
//!   with the same prefix can take it back; these are evictable, oldest
//!   release first (LRU);
//! * free: unreferenced and unhashed.
//!
//! Allocation takes a free block first, then evicts the least recently
//! released cached block. When a sequence releases its blocks it does so
//! tail first, so the tail of a prompt is evicted before its head (a
//! shorter shared prefix outlives a longer private suffix), as vLLM does.
//! Two sequences that fill blocks with the same content get one cached
//! entry: the second block stays unhashed and is freed on release.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for keys that are block hashes already (chained xxh64, uniform
/// in every bit): the key is its own hash. Hashing them again with std's
/// SipHash was a fifth of a 1,024-replica fleet simulation's time (perf,
/// in the hit-rate ceilings' maps).
#[derive(Debug, Clone, Copy, Default)]
pub struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are expected; anything else still gets a defined
        // (if weak) hash.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by block hash.
pub type BlockMap<V> = HashMap<u64, V, BuildHasherDefault<Prehashed>>;
/// A set of block hashes.
pub type BlockSet = HashSet<u64, BuildHasherDefault<Prehashed>>;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

/// No block (the ends of the LRU list).
const NONE: BlockId = BlockId::MAX;

#[derive(Debug, Clone)]
struct Block {
    refs: u32,
    hash: Option<u64>,
    /// Neighbours in the LRU list while cached and unreferenced.
    older: BlockId,
    newer: BlockId,
    in_lru: bool,
}

impl Default for Block {
    fn default() -> Self {
        Self {
            refs: 0,
            hash: None,
            older: NONE,
            newer: NONE,
            in_lru: false,
        }
    }
}

/// The block pool and its prefix cache (hash -> block).
#[derive(Debug, Clone)]
pub(crate) struct KvCache {
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    cached: BlockMap<BlockId>,
    /// Unreferenced cached blocks in release order, a list through the
    /// blocks themselves: O(1) to append, to take out and to evict (a
    /// sorted map was a fifth of a fleet simulation's time).
    oldest: BlockId,
    newest: BlockId,
    lru_len: usize,
    in_use: usize,
}

impl KvCache {
    /// A pool of `capacity` free blocks (capacity is capped to `u32`).
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.min(u32::MAX as usize);
        // Reverse so that pop() hands out block 0 first (only for tidiness).
        let free = (0..capacity as BlockId).rev().collect();
        Self {
            blocks: vec![Block::default(); capacity],
            free,
            cached: BlockMap::default(),
            oldest: NONE,
            newest: NONE,
            lru_len: 0,
            in_use: 0,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by running sequences.
    pub(crate) fn in_use(&self) -> usize {
        self.in_use
    }

    /// Blocks an allocation could get: free plus evictable.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    /// Blocks holding a cached hash (in use or not).
    #[cfg(test)]
    pub(crate) fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Whether the block holding `hash` is cached.
    #[cfg(test)]
    pub(crate) fn contains(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// The blocks of the longest run of leading `hashes` that are cached.
    pub(crate) fn match_prefix(&self, hashes: &[u64]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// How many of `ids` are unreferenced (so counted in [`Self::available`]).
    pub(crate) fn evictable_among(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| self.block(id).is_some_and(|b| b.refs == 0))
            .count()
    }

    fn block(&self, id: BlockId) -> Option<&Block> {
        self.blocks.get(id as usize)
    }

    fn block_mut(&mut self, id: BlockId) -> Option<&mut Block> {
        self.blocks.get_mut(id as usize)
    }

    /// Appends block `id` to the LRU list (it was released last).
    fn lru_push(&mut self, id: BlockId) {
        let newest = self.newest;
        if let Some(b) = self.block_mut(id) {
            b.older = newest;
            b.newer = NONE;
            b.in_lru = true;
        } else {
            return;
        }
        match self.block_mut(newest) {
            Some(n) => n.newer = id,
            None => self.oldest = id,
        }
        self.newest = id;
        self.lru_len += 1;
    }

    /// Takes block `id` out of the LRU list, if it is in it.
    fn lru_remove(&mut self, id: BlockId) {
        let Some(b) = self.block_mut(id).filter(|b| b.in_lru) else {
            return;
        };
        let (older, newer) = (b.older, b.newer);
        b.in_lru = false;
        b.older = NONE;
        b.newer = NONE;
        match self.block_mut(older) {
            Some(o) => o.newer = newer,
            None => self.oldest = newer,
        }
        match self.block_mut(newer) {
            Some(n) => n.older = older,
            None => self.newest = older,
        }
        self.lru_len -= 1;
    }

    /// Takes a reference on every block of `ids` (cache hits).
    pub(crate) fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            let first = b.refs == 0;
            b.refs += 1;
            if first {
                self.lru_remove(id);
                self.in_use += 1;
            }
        }
    }

    /// One block with a reference taken, or None when every block is in use.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.oldest;
                if id == NONE {
                    return None;
                }
                self.lru_remove(id);
                let hash = self.block_mut(id).and_then(|b| b.hash.take());
                if let Some(h) = hash {
                    if self.cached.get(&h) == Some(&id) {
                        self.cached.remove(&h);
                    }
                }
                id
            }
        };
        if let Some(b) = self.block_mut(id) {
            b.refs = 1;
            b.hash = None;
        }
        self.in_use += 1;
        Some(id)
    }

    /// Registers a block, now full and computed, under its chained hash.
    /// Returns false when another block already holds that hash.
    pub(crate) fn register(&mut self, id: BlockId, hash: u64) -> bool {
        if self.cached.contains_key(&hash) {
            return false;
        }
        let Some(b) = self.block_mut(id) else {
            return false;
        };
        if b.hash.is_some() {
            return false;
        }
        b.hash = Some(hash);
        self.cached.insert(hash, id);
        true
    }

    /// Drops one reference on every block of a sequence, tail first; blocks
    /// left unreferenced become evictable (if hashed) or free.
    pub(crate) fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let Some(b) = self.blocks.get_mut(id as usize) else {
                continue;
            };
            if b.refs == 0 {
                continue;
            }
            b.refs -= 1;
            if b.refs > 0 {
                continue;
            }
            self.in_use -= 1;
            if b.hash.is_some() {
                self.lru_push(id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Empties the prefix cache: no block keeps a hash, evictable blocks
    /// become free. Blocks in use stay in use.
    pub(crate) fn flush(&mut self) {
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        while self.oldest != NONE {
            let id = self.oldest;
            self.lru_remove(id);
            self.free.push(id);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn evicts_least_recently_released_tail_first() {
        let mut kv = KvCache::new(4);
        let a: Vec<_> = (0..2).map(|_| kv.allocate().unwrap()).collect();
        let b: Vec<_> = (0..2).map(|_| kv.allocate().unwrap()).collect();
        assert!(kv.allocate().is_none());
        for (i, &id) in a.iter().enumerate() {
            assert!(kv.register(id, 10 + i as u64));
        }
        for (i, &id) in b.iter().enumerate() {
            assert!(kv.register(id, 20 + i as u64));
        }
        kv.release(&a);
        kv.release(&b);
        assert_eq!(kv.in_use(), 0);
        assert_eq!(kv.available(), 4);
        // a released first, its tail (11) before its head (10).
        kv.allocate().unwrap();
        assert!(!kv.contains(11) && kv.contains(10));
        kv.allocate().unwrap();
        assert!(!kv.contains(10) && kv.contains(21));
        // A hit takes a block out of the LRU order.
        let hit = kv.match_prefix(&[20, 21]);
        assert_eq!(hit.len(), 2);
        kv.touch(&hit[..1]);
        kv.allocate().unwrap();
        assert!(kv.contains(20) && !kv.contains(21));
        assert!(kv.allocate().is_none());
    }

    #[test]
    fn duplicate_content_is_cached_once_and_flush_frees() {
        let mut kv = KvCache::new(3);
        let x = kv.allocate().unwrap();
        let y = kv.allocate().unwrap();
        assert!(kv.register(x, 1));
        assert!(!kv.register(y, 1));
        kv.release(&[x, y]);
        assert_eq!(kv.cached_blocks(), 1);
        assert_eq!(kv.available(), 3);
        kv.flush();
        assert_eq!(kv.cached_blocks(), 0);
        assert!(kv.match_prefix(&[1]).is_empty());
        assert_eq!(kv.available(), 3);
    }
}

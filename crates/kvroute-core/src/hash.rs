//! Prefix block hashing.
//!
//! A request's prompt is turned into a *canonical byte stream* (see
//! [`crate::request`]), one message after another. That stream is cut into
//! fixed blocks of `block_bytes` bytes and each block gets a chained hash:
//!
//! ```text
//! seed    = xxh64(model name, 0)
//! h[0]    = xxh64(block 0 bytes, seed)
//! h[i]    = xxh64(block i bytes, h[i-1])
//! ```
//!
//! Because every hash folds in its predecessor, two requests share `h[i]`
//! only if they share every byte of blocks `0..=i` (up to hash collisions),
//! which is exactly the condition for an engine's prefix cache to reuse those
//! blocks. Seeding with the model name keeps two models' caches apart.
//!
//! Only whole blocks produce hashes (an engine caches whole blocks only); at
//! most `max_blocks` are produced so that a huge prompt cannot make the
//! filter allocate without bound. The running digest can also be read at any
//! byte offset, which the affinity key uses (see [`BlockHasher::digest`]).
//!
//! The hasher is streaming: bytes are fed as the request parser walks the
//! borrowed JSON, so no copy of the canonical stream is ever built.

use xxhash_rust::xxh64::{xxh64, Xxh64};

/// Hash of the model name, the seed of the first block.
pub fn model_seed(model: &str) -> u64 {
    xxh64(model.as_bytes(), 0)
}

/// Streaming chained block hasher over the canonical byte stream.
pub struct BlockHasher {
    block_bytes: usize,
    max_blocks: usize,
    /// Seed of the block being filled: the previous block's hash.
    chain: u64,
    /// Digest of the bytes of the current, not yet full, block.
    current: Xxh64,
    /// Bytes already in the current block.
    filled: usize,
    /// Total bytes seen, hashed or not.
    total: u64,
    blocks: Vec<u64>,
}

impl BlockHasher {
    /// `block_bytes` and `max_blocks` are validated by the config (both >= 1);
    /// a zero here is clamped to 1 so the hasher never loops without progress.
    pub fn new(seed: u64, block_bytes: usize, max_blocks: usize) -> Self {
        BlockHasher {
            block_bytes: block_bytes.max(1),
            max_blocks,
            chain: seed,
            current: Xxh64::new(seed),
            filled: 0,
            total: 0,
            blocks: Vec::new(),
        }
    }

    /// Feeds bytes of the canonical stream.
    pub fn write(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        while !bytes.is_empty() && self.blocks.len() < self.max_blocks {
            let room = self.block_bytes - self.filled;
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            self.current.update(now);
            self.filled += now.len();
            bytes = rest;
            if self.filled == self.block_bytes {
                self.chain = self.current.digest();
                self.blocks.push(self.chain);
                self.current = Xxh64::new(self.chain);
                self.filled = 0;
            }
        }
    }

    /// The chained digest of every byte hashed so far. At a block boundary it
    /// is that block's hash; inside a block it folds in the partial block.
    pub fn digest(&self) -> u64 {
        if self.filled == 0 {
            self.chain
        } else {
            self.current.digest()
        }
    }

    /// Bytes written so far (including those past `max_blocks`).
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Bytes that went into hashes or the running digest.
    pub fn hashed_bytes(&self) -> u64 {
        (self.blocks.len() * self.block_bytes + self.filled) as u64
    }

    pub fn blocks(&self) -> &[u64] {
        &self.blocks
    }

    pub fn into_blocks(self) -> Vec<u64> {
        self.blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks_of(data: &[u8], chunks: &[usize], bs: usize) -> Vec<u64> {
        let mut h = BlockHasher::new(model_seed("m"), bs, 1000);
        let mut rest = data;
        for &c in chunks.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (a, b) = rest.split_at(c.min(rest.len()).max(1));
            h.write(a);
            rest = b;
        }
        h.into_blocks()
    }

    #[test]
    fn chunking_does_not_change_hashes() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let whole = blocks_of(&data, &[1000], 64);
        assert_eq!(whole.len(), 1000 / 64);
        assert_eq!(whole, blocks_of(&data, &[1, 7, 63, 64, 65], 64));
    }

    #[test]
    fn chain_depends_on_every_earlier_byte() {
        let a = vec![b'a'; 256];
        let mut b = a.clone();
        b[3] = b'b';
        let ha = blocks_of(&a, &[256], 64);
        let hb = blocks_of(&b, &[256], 64);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
    }

    #[test]
    fn model_seed_separates_models() {
        let mut a = BlockHasher::new(model_seed("a"), 4, 10);
        let mut b = BlockHasher::new(model_seed("b"), 4, 10);
        a.write(b"abcd");
        b.write(b"abcd");
        assert_ne!(a.blocks(), b.blocks());
    }

    #[test]
    fn max_blocks_bounds_the_output() {
        let mut h = BlockHasher::new(0, 16, 3);
        h.write(&[0u8; 1000]);
        assert_eq!(h.blocks().len(), 3);
        assert_eq!(h.total_bytes(), 1000);
        assert_eq!(h.hashed_bytes(), 48);
    }

    #[test]
    fn digest_at_boundary_is_block_hash() {
        let mut h = BlockHasher::new(1, 8, 10);
        h.write(b"12345678");
        assert_eq!(h.digest(), h.blocks()[0]);
        h.write(b"9");
        assert_ne!(h.digest(), h.blocks()[0]);
    }
}

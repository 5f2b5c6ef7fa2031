//! Where a bare prompt's shared part ends, learned from the traffic.
//!
//! A chat request says where its system prompt ends: its first user
//! message starts there ([`crate::decide`] keys a conversation by its bytes
//! up to the end of that message). A *bare* prompt does not: a
//! `/v1/completions` prompt, a conversation a client flattens into one user
//! message, a trace replayed as text. Its affinity key is its first
//! `affinityBlocks` blocks, and when those are a system prompt or document
//! that many conversations open with, every one of them shares one key and
//! one home (in the fleet simulation, the chat family sent flattened and
//! without session headers: TTFT p95 477 ms at one gateway and 2933 ms at
//! four, 1645 preemptions; docs/fleet-state.md, "Bare prompts").
//!
//! The bytes do say where the shared part ends, once two conversations
//! have been seen: it is where their chained block hashes first differ.
//! [`SharedSplits`] keeps, for the block hash at each of a few *rungs* of a
//! prompt (after `affinityBlocks` blocks, twice that, four times, then
//! every [`SPAN`] blocks), the hashes of the [`SPAN`] blocks that followed
//! it in a reference request. A later request with the same rung hash that
//! differs from the reference at block `s` shows that the part before `s`
//! is shared; a request that only extends the reference (the same
//! conversation, one turn later) shows nothing. The splits a request
//! reaches, one per shared part on its path (a system prompt, then a
//! document under it), go to [`crate::decide::route`], which counts each
//! part in the worker's traffic and keys the request by its first block
//! after each part it passes, shallow to deep, until a part that is rare
//! and most of its prompt: those requests keep the key they have, and
//! co-locate as the group's first request did before any split was known.
//! Keying by the deepest split instead scattered such groups (the Mooncake
//! trace without keys: hit rate 41.4 -> 35.9 % at one gateway, seed 1).
//!
//! A worker learns from its own traffic; every gateway that has seen two
//! conversations under a prompt finds the same split. The table is fixed
//! in size ([`SETS`] x [`WAYS`] entries of [`SPAN`] 32-bit hashes, about
//! 150 KiB), whatever the traffic: an entry that has shown a split is
//! kept over one that has not, and any entry unused for `prefixTtlMs` is
//! free.

/// Blocks after a rung that an entry keeps, and the farthest gap between
/// two rungs (so every block past the first rung is some rung's
/// continuation).
pub const SPAN: usize = 64;
/// Sets of the table (an entry's set is its rung hash modulo this).
pub const SETS: usize = 256;
/// Entries per set.
pub const WAYS: usize = 2;
/// Rungs examined per request at most (a prompt of 2048 blocks at the
/// default `affinityBlocks`).
pub const MAX_RUNGS: usize = 32;

#[derive(Debug, Clone)]
struct Entry {
    /// The chained hash of the rung's last block.
    rung: u64,
    at_ms: u64,
    /// The first block (index in the prompt) at which two requests with
    /// this rung were seen to differ; 0 while none was.
    split: usize,
    len: usize,
    /// Low 32 bits of the reference's block hashes after the rung.
    cont: [u32; SPAN],
}

/// A worker's learned splits; see the module doc.
#[derive(Debug, Clone, Default)]
pub struct SharedSplits {
    entries: Vec<Option<Entry>>,
}

/// The rungs of a prompt of `n` blocks: block counts `c` (the rung's last
/// block is `c - 1`) with at least one block after them, from `first`.
fn rungs(first: usize, n: usize) -> impl Iterator<Item = usize> {
    let first = first.max(1);
    std::iter::successors(Some(first), |&c| c.checked_add(c.min(SPAN)))
        .take_while(move |&c| c < n)
        .take(MAX_RUNGS)
}

impl SharedSplits {
    /// Learns from a request's block hashes and returns its splits, in
    /// ascending order: the block counts before which this request shares
    /// its prompt with a different conversation, those known, at least
    /// `first` (`affinityBlocks`) and at most the request's blocks (a
    /// request that ends inside a shared part is not past it). Entries unused for `ttl_ms` are
    /// forgotten.
    pub fn learn(&mut self, blocks: &[u64], first: usize, now_ms: u64, ttl_ms: u64) -> Vec<usize> {
        if self.entries.is_empty() {
            self.entries = vec![None; SETS * WAYS];
        }
        let live = |e: &Entry| now_ms.saturating_sub(e.at_ms) < ttl_ms;
        let mut splits = Vec::new();
        for c in rungs(first, blocks.len()) {
            let Some(&rung) = blocks.get(c - 1) else {
                break;
            };
            let after = blocks.get(c..).unwrap_or_default();
            let after = after.get(..SPAN).unwrap_or(after);
            let set = (rung % SETS as u64) as usize * WAYS;
            let Some(ways) = self.entries.get_mut(set..set + WAYS) else {
                break;
            };
            let hit = ways
                .iter_mut()
                .flatten()
                .find(|e| e.rung == rung && live(e));
            match hit {
                Some(e) => {
                    e.at_ms = now_ms;
                    let differs = e
                        .cont
                        .iter()
                        .take(e.len)
                        .zip(after)
                        .position(|(&a, &b)| a != b as u32);
                    if let Some(m) = differs {
                        let s = c + m;
                        e.split = if e.split == 0 { s } else { e.split.min(s) };
                    } else if after.len() > e.len {
                        for (slot, &b) in e.cont.iter_mut().zip(after).skip(e.len) {
                            *slot = b as u32;
                        }
                        e.len = after.len();
                    }
                    if e.split >= first && e.split <= blocks.len() {
                        splits.push(e.split);
                    }
                }
                None => {
                    let mut cont = [0u32; SPAN];
                    for (slot, &b) in cont.iter_mut().zip(after) {
                        *slot = b as u32;
                    }
                    let fresh = Entry {
                        rung,
                        at_ms: now_ms,
                        split: 0,
                        len: after.len(),
                        cont,
                    };
                    // A free or forgotten way, else the oldest that has
                    // shown no split, else the oldest.
                    let victim = ways.iter_mut().min_by_key(|w| match w {
                        None => (0u8, 0u8, 0u64),
                        Some(e) if !live(e) => (0, 1, e.at_ms),
                        Some(e) => (1, u8::from(e.split != 0), e.at_ms),
                    });
                    if let Some(v) = victim {
                        let keep = matches!(v, Some(e) if live(e) && e.split != 0);
                        if !keep {
                            *v = Some(fresh);
                        }
                    }
                }
            }
        }
        splits.sort_unstable();
        splits.dedup();
        splits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Vec<usize> = Vec::new();

    /// Chained-looking hashes: `shared` common blocks, then `own` blocks
    /// of conversation `conv`.
    fn prompt(shared: usize, conv: u64, own: usize) -> Vec<u64> {
        (0..shared as u64)
            .map(|i| 0x5100_0000 + i)
            .chain((0..own as u64).map(|i| (conv << 16) + 0x7700_0000 + i))
            .collect()
    }

    #[test]
    fn rungs_cover_every_block_after_the_first() {
        let r: Vec<usize> = rungs(16, 300).collect();
        assert_eq!(r, vec![16, 32, 64, 128, 192, 256]);
        for w in r.windows(2) {
            assert!(w[1] - w[0] <= SPAN);
        }
        assert_eq!(rungs(16, 16).count(), 0, "no block after the first rung");
        assert_eq!(rungs(0, 3).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(rungs(1, usize::MAX).count(), MAX_RUNGS);
    }

    #[test]
    fn two_conversations_show_where_the_shared_part_ends() {
        let mut s = SharedSplits::default();
        // One conversation, growing: nothing is shared with another.
        assert_eq!(s.learn(&prompt(40, 1, 5), 16, 0, 1000), NONE);
        assert_eq!(s.learn(&prompt(40, 1, 30), 16, 1, 1000), NONE);
        // A second conversation under the same 40 blocks.
        assert_eq!(s.learn(&prompt(40, 2, 8), 16, 2, 1000), vec![40]);
        // Every later request under them knows it, the first one too.
        assert_eq!(s.learn(&prompt(40, 1, 31), 16, 3, 1000), vec![40]);
        assert_eq!(s.learn(&prompt(40, 3, 2), 16, 4, 1000), vec![40]);
        // A request that ends inside the shared part has no split.
        assert_eq!(s.learn(&prompt(30, 3, 0), 16, 5, 1000), NONE);
    }

    #[test]
    fn a_shared_part_shorter_than_the_first_rung_is_no_split() {
        let mut s = SharedSplits::default();
        s.learn(&prompt(10, 1, 40), 16, 0, 1000);
        assert_eq!(s.learn(&prompt(10, 2, 40), 16, 1, 1000), NONE);
    }

    #[test]
    fn every_split_on_the_path_and_entries_expire() {
        let mut s = SharedSplits::default();
        // A 20-block system prompt, then two documents of 100 blocks under it.
        let doc = |d: u64, q: u64| {
            let mut p = prompt(20, d, 100);
            p.extend((0..10).map(|i| (q << 24) + i));
            p
        };
        s.learn(&doc(1, 1), 16, 0, 1000);
        s.learn(&doc(2, 2), 16, 1, 1000);
        assert_eq!(s.learn(&doc(1, 3), 16, 2, 1000), vec![20, 120]);
        // Unused for the TTL, the entries are gone.
        assert_eq!(s.learn(&doc(1, 4), 16, 5000, 1000), NONE);
    }

    #[test]
    fn memory_is_bounded_and_learned_splits_are_kept() {
        let mut s = SharedSplits::default();
        s.learn(&prompt(40, 1, 5), 16, 0, u64::MAX);
        s.learn(&prompt(40, 2, 5), 16, 0, u64::MAX);
        for conv in 3..20_000u64 {
            let p: Vec<u64> = (0..80).map(|i| (conv << 20) + i).collect();
            s.learn(&p, 16, conv, u64::MAX);
        }
        assert_eq!(s.entries.len(), SETS * WAYS);
        assert_eq!(s.learn(&prompt(40, 7, 5), 16, 1, u64::MAX), vec![40]);
    }
}

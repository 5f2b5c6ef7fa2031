//! The gateway's prefix index: which replicas were last sent which prefix.
//!
//! The expected prefix hit of a replica is worked out from what the gateway
//! routed there (engines do not export their cache contents). The index is a
//! direct-mapped table in proxy-wasm shared data: `slots` keys, one entry
//! each, so its memory is bounded by configuration whatever the traffic
//! (`slots` x at most 88 bytes of value, about 160 with Envoy's per-key
//! overhead). Shared data is process-wide, so every Envoy worker reads and
//! writes the same index; gateway replicas each keep their own.
//!
//! Each entry is a block hash and up to [`OWNERS`] replicas it was sent to,
//! the most recent first, each as `(host id, depth, written at)`: a request
//! of `depth` blocks whose block at this position hashed to `block hash`
//! was sent to `host id`. Because block hashes are chained, a match at
//! position `p` means the replica was sent this request's first `p + 1`
//! blocks. An entry that named only its last sender (as before 2026-12-04)
//! hid every other replica holding a popular prefix: the replicas a shared
//! document's readers were spread over looked cold but one, and a
//! conversation sent elsewhere once (a spill) seemed to have left its home
//! (docs/fleet-state.md, "Several owners per index entry").
//!
//! A request records itself at the sampled positions `0, 1, 3, 7, 15, ...`
//! (2^k - 1) and at its last block: at most `log2(maxBlocks) + 2` writes,
//! each making its replica the entry's most recent owner and keeping the
//! [`OWNERS`] - 1 most recent others (an entry whose most recent owner is
//! already that replica, written less than half a TTL ago, is not
//! rewritten). A lookup probes the same positions, deepest first, and for
//! each owner of a match it counts checks one more position, the last
//! block of the request that wrote it (which that request recorded). The
//! caller says how many owners count: [`crate::decide`] counts them all
//! for a request placed by its shared prefix, and only the most recent for
//! any other, which keeps following a conversation to where it was last
//! served. With more than [`OWNERS`] replicas sent a shared system
//! prompt, its sampled positions name only the latest, so those probes
//! alone may miss a conversation's previous turn. A request that continues
//! a conversation therefore also probes where its previous request's
//! prompt ended ([`crate::decide::Facts::previous_blocks`]): that request
//! recorded its last block there, so the replica that served it and its
//! full depth are found exactly.
//! Collisions between blocks evict (last writer wins); owners older than
//! `ttl_ms` count as evicted by the engine. An overwritten entry only loses
//! locality information, never correctness.
//!
//! Engines also evict sooner than any TTL (memory pressure, a restart, a
//! flushed cache). When an answer reports fewer cached tokens than the
//! index expected ([`crate::answers`]), [`Index::forget`] removes that
//! replica from the entries of that request's blocks beyond the depth the
//! engine still held, where its claim predates the decision (a
//! compare-and-swap on the value read; an entry left with no owner is
//! written empty: shared data has no delete). An empty slot reads as no
//! entry.
//!
//! Each read is a host call, so a worker keeps what it read or wrote in an
//! [`IndexCache`] for [`CACHE_MS`]: a hot prefix (a shared system prompt, a
//! burst of one agent's calls) is read from shared data a few times a
//! second per worker rather than on every request. An entry is a fact ("this
//! block was sent to these hosts at these times"), so a cached one stays
//! true; what the cache can miss, for at most [`CACHE_MS`], is another
//! worker's newer write to the same slot. Conversations come back seconds
//! apart, so their next turn reads the shared index.

use crate::config::FleetConfig;
use crate::host::SharedData;

/// Replicas an entry remembers for its block, the most recently sent first.
pub const OWNERS: usize = 4;
/// Encoded sizes: the block hash, then 20 bytes per owner.
const BLOCK_BYTES: usize = 8;
const OWNER_BYTES: usize = 20;

/// Index parameters, from the config.
#[derive(Debug, Clone, Copy)]
pub struct Index<'a> {
    pub slots: u64,
    pub ttl_ms: u64,
    pub key_prefix: &'a str,
}

/// What a lookup read at each sampled position (`None`: no live entry for
/// that block), and the longest earlier request it found whole within
/// this one ([`Seen::extends`]).
#[derive(Debug, Clone, Default)]
pub struct Seen {
    read: Vec<(usize, Option<Entry>)>,
    extends: usize,
}

impl Seen {
    /// The most blocks of an earlier request, sent to a live owner, that
    /// this request holds whole: that request's prompt ended within this
    /// one (the owner's depth reaches no further than this request, and
    /// its last block matches), so this one extends it, as a
    /// conversation's next turn extends the previous. 0 when none did.
    pub fn extends(&self) -> usize {
        self.extends
    }
}

/// One replica sent the block: by a request of `depth` blocks, at `at_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Owner {
    host: u64,
    depth: u32,
    at_ms: u64,
}

/// A slot's value: a block and up to [`OWNERS`] replicas it was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    block: u64,
    owners: [Owner; OWNERS],
    len: usize,
}

impl Entry {
    fn single(block: u64, owner: Owner) -> Entry {
        let mut owners = [Owner::default(); OWNERS];
        owners[0] = owner;
        Entry {
            block,
            owners,
            len: 1,
        }
    }

    fn owners(&self) -> &[Owner] {
        self.owners.get(..self.len).unwrap_or(&[])
    }

    fn owner(&self, host: u64) -> Option<Owner> {
        self.owners().iter().copied().find(|o| o.host == host)
    }

    /// The same block with only the owners `keep` accepts (`None`: none).
    fn filter(&self, keep: impl Fn(&Owner) -> bool) -> Option<Entry> {
        let mut out = Entry { len: 0, ..*self };
        for o in self.owners().iter().filter(|o| keep(o)) {
            out.push(*o);
        }
        (out.len > 0).then_some(out)
    }

    /// `owner` first, then the others it does not replace, at most
    /// [`OWNERS`] (the least recently sent falls off).
    fn with(&self, owner: Owner) -> Entry {
        let mut out = Entry::single(self.block, owner);
        for o in self.owners().iter().filter(|o| o.host != owner.host) {
            out.push(*o);
        }
        out
    }

    /// Appends `o` as the least recent owner, if there is room.
    fn push(&mut self, o: Owner) {
        if let Some(slot) = self.owners.get_mut(self.len) {
            *slot = o;
            self.len += 1;
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BLOCK_BYTES + OWNER_BYTES * self.len);
        out.extend_from_slice(&self.block.to_le_bytes());
        for o in self.owners() {
            out.extend_from_slice(&o.host.to_le_bytes());
            out.extend_from_slice(&o.depth.to_le_bytes());
            out.extend_from_slice(&o.at_ms.to_le_bytes());
        }
        out
    }

    /// Any other length than a block and one to [`OWNERS`] owners reads
    /// as no entry (an empty value is a removed one).
    fn decode(b: &[u8]) -> Option<Entry> {
        let rest = b.len().checked_sub(BLOCK_BYTES)?;
        let len = rest / OWNER_BYTES;
        if rest % OWNER_BYTES != 0 || len == 0 || len > OWNERS {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        let mut owners = [Owner::default(); OWNERS];
        for (i, o) in owners.iter_mut().take(len).enumerate() {
            let at = BLOCK_BYTES + i * OWNER_BYTES;
            *o = Owner {
                host: u64_at(at)?,
                depth: u32::from_le_bytes(b.get(at + 8..at + 12)?.try_into().ok()?),
                at_ms: u64_at(at + 12)?,
            };
        }
        Some(Entry {
            block: u64_at(0)?,
            owners,
            len,
        })
    }
}

/// How long a worker trusts its copy of an index slot.
pub const CACHE_MS: u64 = 250;
/// Slots a worker keeps a copy of (direct-mapped; about 120 bytes each).
pub const CACHE_LINES: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Line {
    slot: u64,
    entry: Option<Entry>,
    at_ms: u64,
}

/// A worker's own state for the index: its copy of the slots it read or
/// wrote recently, and its traffic per long shared prefix (which
/// [`crate::decide::route`] reads to choose a session's affinity key).
#[derive(Debug, Clone, Default)]
pub struct IndexCache {
    lines: Vec<Option<Line>>,
    /// The worker's traffic per long shared prefix.
    pub traffic: PrefixTraffic,
    /// Where bare prompts' shared parts end ([`crate::split`]).
    pub splits: crate::split::SharedSplits,
}

/// Counters of the sketch (two rows).
const TRAFFIC_COUNTERS: usize = 2048;
/// Observations between two halvings: the shares follow the last few
/// thousand requests.
const TRAFFIC_HALF_LIFE: u32 = 4096;

/// A worker's decayed request counts per prefix key, with the sum of each
/// request's first-message share: a count-min sketch of two rows, halved
/// every [`TRAFFIC_HALF_LIFE`] observations, so its memory is fixed
/// whatever the traffic.
#[derive(Debug, Clone, Default)]
pub struct PrefixTraffic {
    counts: Vec<u32>,
    shares: Vec<f32>,
    total: u32,
    since_halving: u32,
}

impl PrefixTraffic {
    fn cells(key: u64) -> [usize; 2] {
        let n = TRAFFIC_COUNTERS as u64;
        [
            (key % n) as usize,
            (TRAFFIC_COUNTERS as u64 + (key >> 32) % n) as usize,
        ]
    }

    /// Counts one request without a long shared prefix (it counts in the
    /// total that shares are taken of).
    pub fn observe_other(&mut self) {
        self.since_halving += 1;
        if self.since_halving >= TRAFFIC_HALF_LIFE {
            self.since_halving = 0;
            self.total /= 2;
            for c in &mut self.counts {
                *c /= 2;
            }
            for c in &mut self.shares {
                *c /= 2.0;
            }
        }
        self.total = self.total.saturating_add(1);
    }

    /// Counts one request of `key` whose prompt is `first` first message,
    /// and returns the key's share of the worker's recent requests (at most
    /// 1; over-estimated on collisions) and its requests' mean `first`.
    pub fn observe(&mut self, key: u64, first: f64) -> (f64, f64) {
        self.observe_other();
        self.count(key, first)
    }

    /// [`Self::observe`] without counting a request in the total: a
    /// request with several shared prefixes ([`crate::split`]) counts once
    /// there ([`Self::observe_other`]) and then once under each prefix.
    pub fn count(&mut self, key: u64, first: f64) -> (f64, f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; 2 * TRAFFIC_COUNTERS];
            self.shares = vec![0.0; 2 * TRAFFIC_COUNTERS];
        }
        let mut best = (u32::MAX, 0.0f32);
        for i in Self::cells(key) {
            if let (Some(c), Some(f)) = (self.counts.get_mut(i), self.shares.get_mut(i)) {
                *c = c.saturating_add(1);
                *f += first as f32;
                if *c < best.0 {
                    best = (*c, *f);
                }
            }
        }
        let share = (f64::from(best.0) / f64::from(self.total.max(1))).min(1.0);
        (share, f64::from(best.1) / f64::from(best.0.max(1)))
    }
}

impl IndexCache {
    fn line(slot: u64) -> usize {
        (slot % CACHE_LINES as u64) as usize
    }

    /// The slot's value as last read or written, if that was recent.
    fn get(&self, slot: u64, now_ms: u64) -> Option<Option<Entry>> {
        let l = self.lines.get(Self::line(slot)).copied().flatten()?;
        let recent = l.slot == slot && now_ms >= l.at_ms && now_ms - l.at_ms < CACHE_MS;
        recent.then_some(l.entry)
    }

    fn put(&mut self, slot: u64, entry: Option<Entry>, now_ms: u64) {
        if self.lines.is_empty() {
            self.lines = vec![None; CACHE_LINES];
        }
        if let Some(l) = self.lines.get_mut(Self::line(slot)) {
            *l = Some(Line {
                slot,
                entry,
                at_ms: now_ms,
            });
        }
    }
}

/// Sampled positions for a request of `n` blocks, deepest first.
pub fn positions(n: usize) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    if n == 0 {
        return out;
    }
    out.push(n - 1);
    let mut p = 1usize;
    while p <= n {
        if p - 1 != n - 1 {
            out.push(p - 1);
        }
        p = p.saturating_mul(2);
        if p == usize::MAX {
            break;
        }
    }
    out.sort_unstable_by(|a, b| b.cmp(a));
    out
}

impl<'a> Index<'a> {
    /// The gateway's index as the config sets it.
    pub fn of(f: &'a FleetConfig) -> Index<'a> {
        Index {
            slots: f.prefix_index_slots,
            ttl_ms: f.prefix_ttl_ms,
            key_prefix: &f.index_key_prefix,
        }
    }
}

impl Index<'_> {
    fn slot(&self, block: u64) -> u64 {
        block % self.slots.max(1)
    }

    /// The shared-data key of the slot that holds `block`'s entry.
    pub fn key(&self, block: u64) -> String {
        format!("{}{:x}", self.key_prefix, self.slot(block))
    }

    fn read(
        &self,
        store: &dyn SharedData,
        cache: &mut IndexCache,
        block: u64,
        now_ms: u64,
    ) -> Option<Entry> {
        let slot = self.slot(block);
        let stored = match cache.get(slot, now_ms) {
            Some(entry) => entry,
            None => {
                let entry = match store.get(&self.key(block)) {
                    Ok((Some(v), _)) => Entry::decode(&v),
                    _ => None,
                };
                cache.put(slot, entry, now_ms);
                entry
            }
        };
        let e = stored.filter(|e| e.block == block)?;
        e.filter(|o| now_ms.saturating_sub(o.at_ms) <= self.ttl_ms)
    }

    /// Blocks of `blocks` that each host was sent, as `(host id, blocks)`,
    /// one pair per host found.
    pub fn lookup(&self, store: &dyn SharedData, blocks: &[u64], now_ms: u64) -> Vec<(u64, u32)> {
        self.lookup_seen(
            store,
            &mut IndexCache::default(),
            blocks,
            None,
            OWNERS,
            now_ms,
        )
        .0
    }

    /// [`Index::lookup`], plus what it read at each sampled position, for
    /// [`Index::record_after`]. `previous` is the depth, in blocks, of the
    /// previous request of the conversation when the prompt says where that
    /// request ended ([`crate::decide::Facts::previous_blocks`]): that request
    /// recorded its last block, so one more read there finds its replica
    /// and full depth, where the sampled positions would not (they hold
    /// whoever last sent a shared system prompt, or the depth of the
    /// conversation's first turn). `owners` is how many of each entry's
    /// owners count, the most recent first (1: its last sender only).
    pub fn lookup_seen(
        &self,
        store: &dyn SharedData,
        cache: &mut IndexCache,
        blocks: &[u64],
        previous: Option<usize>,
        owners: usize,
        now_ms: u64,
    ) -> (Vec<(u64, u32)>, Seen) {
        let mut found: Vec<(u64, u32)> = Vec::new();
        let mut seen = Seen::default();
        let mut note = |host: u64, depth: u32| match found.iter_mut().find(|(h, _)| *h == host) {
            Some((_, d)) => *d = (*d).max(depth),
            None => found.push((host, depth)),
        };
        let n = blocks.len();
        let mut probes = positions(n);
        if let Some(at) = previous.filter(|&d| d > 0 && d < n).map(|d| d - 1) {
            if let Err(i) = probes.binary_search_by(|q| at.cmp(q)) {
                probes.insert(i, at);
            }
        }
        for p in probes {
            let Some(&block) = blocks.get(p) else {
                continue;
            };
            let entry = self.read(store, cache, block, now_ms);
            seen.read.push((p, entry));
            let Some(e) = entry else {
                continue;
            };
            for o in e.owners().iter().take(owners.max(1)) {
                note(o.host, (p + 1) as u32);
                // A writer whose request ended here is held whole.
                if o.depth as usize == p + 1 {
                    seen.extends = seen.extends.max(p + 1);
                }
                // The writer's last block, if it lies deeper within this
                // request.
                let last = (o.depth as usize).min(n);
                if last > p + 1 {
                    if let Some(&deep) = blocks.get(last - 1) {
                        let d = self.read(store, cache, deep, now_ms);
                        if d.is_some_and(|d| d.owner(o.host).is_some()) {
                            note(o.host, last as u32);
                            if o.depth as usize <= n {
                                seen.extends = seen.extends.max(last);
                            }
                        }
                    }
                }
            }
        }
        (found, seen)
    }

    /// Records that `host` was sent `block`, the block at position
    /// `depth - 1` of a request of `depth` blocks, at `at_ms` (what another
    /// gateway did, [`crate::placed`]: a key's placement, depth 1, or a
    /// request's last block), unless the block's most recent live owner
    /// was recorded at `at_ms` or later, or is `host` at the same depth
    /// recorded less than half the TTL before (the same send delivered
    /// again). Returns whether it wrote.
    pub fn record_if_newer(
        &self,
        store: &dyn SharedData,
        cache: &mut IndexCache,
        block: u64,
        host: u64,
        depth: u32,
        at_ms: u64,
    ) -> bool {
        let current = self.read(store, cache, block, at_ms);
        let first = current.and_then(|e| e.owners().first().copied());
        let same = |o: &Owner| {
            o.host == host && o.depth == depth && at_ms.saturating_sub(o.at_ms) <= self.ttl_ms / 2
        };
        if first.is_some_and(|o| o.at_ms >= at_ms || same(&o)) {
            return false;
        }
        let owner = Owner { host, depth, at_ms };
        let e = current.map_or(Entry::single(block, owner), |e| e.with(owner));
        let _ = store.set(&self.key(block), &e.encode(), None);
        cache.put(self.slot(block), Some(e), at_ms);
        true
    }

    /// Records that `blocks` were sent to `host`.
    pub fn record(&self, store: &dyn SharedData, blocks: &[u64], host: u64, now_ms: u64) {
        let mut cache = IndexCache::default();
        let _ = self.record_after(store, &mut cache, blocks, host, now_ms, &Seen::default());
    }

    /// [`Index::record`], skipping the writes that would change nothing
    /// that matters: a position whose entry, as `seen` by the lookup just
    /// before, already names this block and this host and is less than half
    /// its TTL old. (Its depth may be an older request's; the request's own
    /// last block is always written, so the full depth stays findable.)
    /// Each write is a host call, and a repeated prompt or a conversation's
    /// shared opening would otherwise rewrite the same entries every time.
    /// Returns how many entries it wrote.
    pub fn record_after(
        &self,
        store: &dyn SharedData,
        cache: &mut IndexCache,
        blocks: &[u64],
        host: u64,
        now_ms: u64,
        seen: &Seen,
    ) -> usize {
        let mut written = 0;
        let depth = u32::try_from(blocks.len()).unwrap_or(u32::MAX);
        let last = blocks.len().saturating_sub(1);
        for p in positions(blocks.len()) {
            let Some(&block) = blocks.get(p) else {
                continue;
            };
            // The slot as the lookup saw it (read now if it did not look).
            let current = match seen.read.iter().find(|(q, _)| *q == p) {
                Some((_, e)) => *e,
                None => self.read(store, cache, block, now_ms),
            }
            .filter(|e| e.block == block);
            // Already there as the most recent owner: nothing to write.
            let mine = current
                .and_then(|e| e.owners().first().copied())
                .filter(|o| o.host == host)
                .filter(|o| now_ms.saturating_sub(o.at_ms) <= self.ttl_ms / 2);
            if mine.is_some() && (p != last || mine.is_some_and(|o| o.depth == depth)) {
                continue;
            }
            let owner = Owner {
                host,
                depth,
                at_ms: now_ms,
            };
            let e = current.map_or(Entry::single(block, owner), |e| e.with(owner));
            // A write between the lookup and this one is lost: only a hint.
            let _ = store.set(&self.key(block), &e.encode(), None);
            cache.put(self.slot(block), Some(e), now_ms);
            written += 1;
        }
        written
    }

    /// Forgets that `host` holds `blocks` beyond their first `keep`: the
    /// entries at this request's sampled positions `p >= keep` (each claims
    /// `p + 1` blocks), and at the last block of the request that wrote a
    /// removed entry (what [`Index::lookup_seen`] checks next), that still
    /// name this block and `host` and were written before `before_ms`.
    /// Returns how many were removed.
    ///
    /// An entry written at or after `before_ms` (the decision whose answer
    /// fell short) records a later send that the engine has not answered
    /// about, so it stays. Removal is a compare-and-swap on the value just
    /// read, to an empty value (shared data has no delete): a slot another
    /// worker rewrote in between keeps its new entry. The worker's `cache`
    /// forgets the slot too; other workers' copies age out within
    /// [`CACHE_MS`].
    #[allow(clippy::too_many_arguments)]
    pub fn forget(
        &self,
        store: &dyn SharedData,
        cache: &mut IndexCache,
        blocks: &[u64],
        keep: usize,
        host: u64,
        before_ms: u64,
        now_ms: u64,
    ) -> u64 {
        let mut todo: Vec<usize> = positions(blocks.len())
            .into_iter()
            .filter(|&p| p >= keep)
            .collect();
        let mut done: Vec<usize> = Vec::with_capacity(todo.len());
        let mut removed = 0;
        while let Some(p) = todo.pop() {
            if done.contains(&p) {
                continue;
            }
            done.push(p);
            let Some(&block) = blocks.get(p) else {
                continue;
            };
            let key = self.key(block);
            let Ok((Some(v), Some(cas))) = store.get(&key) else {
                continue;
            };
            let Some(e) = Entry::decode(&v).filter(|e| e.block == block) else {
                continue;
            };
            let Some(o) = e.owner(host).filter(|o| o.at_ms < before_ms) else {
                continue;
            };
            // The other owners stay; with none left, an empty value.
            let rest = e.filter(|x| x.host != host);
            let value = rest.map_or_else(Vec::new, |r| r.encode());
            if store.set(&key, &value, Some(cas)).is_ok() {
                removed += 1;
                cache.put(self.slot(block), rest, now_ms);
                let last = (o.depth as usize).min(blocks.len());
                if last > p + 1 {
                    todo.push(last - 1);
                }
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts reads and writes, to see which ones a repeated request or the
    /// cache saves.
    #[derive(Default)]
    struct Counting {
        inner: crate::host::MemorySharedData,
        gets: std::cell::Cell<usize>,
        sets: std::cell::Cell<usize>,
    }

    impl SharedData for Counting {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), crate::host::HostError> {
            self.gets.set(self.gets.get() + 1);
            self.inner.get(key)
        }
        fn set(
            &self,
            key: &str,
            value: &[u8],
            cas: Option<u32>,
        ) -> Result<(), crate::host::SetError> {
            self.sets.set(self.sets.get() + 1);
            self.inner.set(key, value, cas)
        }
    }

    /// Two conversations share a 32-block system prompt. The first turn of
    /// A goes to host 1, then B's to host 2, which takes every sampled
    /// position of the shared part. A's second turn finds host 1 beyond
    /// the system prompt only by probing where its previous prompt ended.
    #[test]
    fn the_previous_turn_is_found_past_a_shared_system_prompt() {
        let store = MemorySharedData::default();
        let system = chain(9, 32);
        let grow = |base: u64, n: usize| {
            let mut b = system.clone();
            b.extend(chain(base, n - 32).iter().map(|x| x ^ base << 40));
            b
        };
        let a1 = grow(1, 40);
        IX.record(&store, &a1, 1, 0);
        // OWNERS more conversations on other hosts push host 1 out of the
        // shared part's entries.
        for h in 2..2 + OWNERS as u64 {
            IX.record(&store, &grow(h, 38), h, 1);
        }
        // A's second turn: its first 40 blocks are A's first prompt.
        let mut a2 = a1.clone();
        a2.extend(chain(3, 30));
        let mut cache = IndexCache::default();
        let (without, _) = IX.lookup_seen(&store, &mut cache, &a2, None, OWNERS, 2);
        let latest = 1 + OWNERS as u64;
        assert!(without.contains(&(latest, 32)), "{without:?}");
        assert!(without.iter().all(|&(h, _)| h != 1), "{without:?}");
        let (with, _) =
            IX.lookup_seen(&store, &mut IndexCache::default(), &a2, Some(40), OWNERS, 2);
        assert!(with.contains(&(1, 40)), "{with:?}");
        assert!(with.contains(&(latest, 32)), "{with:?}");
        // A depth at or past the request's own length, or none, adds nothing.
        for d in [Some(0), Some(70), Some(500)] {
            let (h, _) = IX.lookup_seen(&store, &mut IndexCache::default(), &a2, d, OWNERS, 2);
            assert_eq!(h, without, "{d:?}");
        }
    }

    #[test]
    fn unchanged_entries_are_not_rewritten() {
        let store = Counting::default();
        let blocks = chain(3, 40);
        let (_, seen) =
            IX.lookup_seen(&store, &mut IndexCache::default(), &blocks, None, OWNERS, 0);
        IX.record_after(&store, &mut IndexCache::default(), &blocks, 7, 0, &seen);
        let first = store.sets.get();
        assert_eq!(first, positions(40).len());
        // The same request again, to the same host: nothing to write.
        let (hits, seen) = IX.lookup_seen(
            &store,
            &mut IndexCache::default(),
            &blocks,
            None,
            OWNERS,
            10,
        );
        assert_eq!(hits, vec![(7, 40)]);
        IX.record_after(&store, &mut IndexCache::default(), &blocks, 7, 10, &seen);
        assert_eq!(store.sets.get(), first);
        // To another host: every position is rewritten.
        IX.record_after(&store, &mut IndexCache::default(), &blocks, 8, 10, &seen);
        assert_eq!(store.sets.get(), 2 * first);
        // A longer turn of the same conversation finds the full earlier depth
        // on both hosts (the latest first), writes only its new positions
        // and its own last block.
        let longer = chain(3, 100);
        let (hits, seen) = IX.lookup_seen(
            &store,
            &mut IndexCache::default(),
            &longer,
            None,
            OWNERS,
            20,
        );
        assert_eq!(hits, vec![(8, 40), (7, 40)]);
        IX.record_after(&store, &mut IndexCache::default(), &longer, 8, 20, &seen);
        let (hits, _) = IX.lookup_seen(
            &store,
            &mut IndexCache::default(),
            &longer,
            None,
            OWNERS,
            30,
        );
        assert_eq!(hits, vec![(8, 100), (7, 40)]);
        // Entries past half their TTL are refreshed.
        let before = store.sets.get();
        let (_, seen) = IX.lookup_seen(
            &store,
            &mut IndexCache::default(),
            &longer,
            None,
            OWNERS,
            IX.ttl_ms / 2 + 100,
        );
        IX.record_after(
            &store,
            &mut IndexCache::default(),
            &longer,
            8,
            IX.ttl_ms / 2 + 100,
            &seen,
        );
        assert!(store.sets.get() > before);
    }
    use crate::host::MemorySharedData;

    const IX: Index = Index {
        slots: 1 << 16,
        ttl_ms: 1000,
        key_prefix: "t.px.",
    };

    fn chain(base: u64, n: usize) -> Vec<u64> {
        (0..n as u64)
            .map(|i| base.wrapping_mul(31).wrapping_add(i) ^ 0x9e37)
            .collect()
    }

    #[test]
    fn positions_are_powers_of_two_and_the_last() {
        assert_eq!(positions(0), Vec::<usize>::new());
        assert_eq!(positions(1), vec![0]);
        assert_eq!(positions(5), vec![4, 3, 1, 0]);
        assert_eq!(positions(8), vec![7, 3, 1, 0]);
        assert!(positions(1024).len() <= 12);
    }

    #[test]
    fn growing_conversation_finds_exact_previous_depth() {
        let store = MemorySharedData::default();
        let turn2 = chain(1, 40);
        let turn1 = &turn2[..23];
        IX.record(&store, turn1, 7, 0);
        assert_eq!(IX.lookup(&store, &turn2, 10), vec![(7, 23)]);
        // A shorter request sharing the prefix matches to its deepest
        // sampled position (8 of its 10 blocks): an underestimate, at least half.
        assert_eq!(IX.lookup(&store, &turn2[..10], 10), vec![(7, 8)]);
    }

    /// A request that holds an earlier one whole extends it, by that
    /// request's depth; one that shares only a prefix, or is shorter, does
    /// not.
    #[test]
    fn extends_counts_only_an_earlier_request_held_whole() {
        let store = MemorySharedData::default();
        let turn2 = chain(1, 40);
        IX.record(&store, &turn2[..23], 7, 0);
        let extends_at = |blocks: &[u64], now_ms: u64| {
            let (_, seen) = IX.lookup_seen(
                &store,
                &mut IndexCache::default(),
                blocks,
                None,
                OWNERS,
                now_ms,
            );
            seen.extends()
        };
        let extends = |blocks: &[u64]| extends_at(blocks, 10);
        assert_eq!(extends(&turn2), 23);
        assert_eq!(extends(&turn2[..23]), 23, "the same prompt again");
        assert_eq!(extends(&turn2[..10]), 0, "a shorter prompt");
        // A sibling: the first 20 blocks, then its own.
        let mut sibling = turn2[..20].to_vec();
        sibling.extend(chain(5, 20).iter().map(|x| x ^ 5 << 40));
        assert_eq!(extends(&sibling), 0);
        // An earlier request ending at a sampled position (8 blocks).
        IX.record(&store, &turn2[..8], 3, 0);
        assert_eq!(extends(&sibling), 8);
        // Expired owners extend nothing.
        assert_eq!(extends_at(&turn2, 10_000_000), 0);
    }

    #[test]
    fn different_hosts_and_expiry() {
        let store = MemorySharedData::default();
        let a = chain(2, 16);
        let mut b = a[..4].to_vec();
        b.extend(chain(3, 12));
        IX.record(&store, &a, 1, 0);
        IX.record(&store, &b, 2, 0);
        // Both hosts own the shared first blocks: a's deep blocks say host
        // 1, its shallow ones hosts 2 and 1.
        let mut found = IX.lookup(&store, &a, 5);
        found.sort_unstable();
        assert_eq!(found, vec![(1, 16), (2, 4)]);
        assert!(IX.lookup(&store, &a, 5000).is_empty(), "entries expire");
        assert!(IX.lookup(&store, &chain(9, 16), 5).is_empty());
    }

    #[test]
    fn a_worker_cache_saves_reads_and_sees_other_workers_after_cache_ms() {
        let store = Counting::default();
        let (mut a, mut b) = (IndexCache::default(), IndexCache::default());
        let blocks = chain(4, 40);
        // Worker a routes the request to host 7: its own writes are cached.
        let (_, seen) = IX.lookup_seen(&store, &mut a, &blocks, None, OWNERS, 0);
        let cold = store.gets.get();
        assert_eq!(cold, positions(40).len(), "one read per sampled position");
        IX.record_after(&store, &mut a, &blocks, 7, 0, &seen);
        let (hits, _) = IX.lookup_seen(&store, &mut a, &blocks, None, OWNERS, 10);
        assert_eq!(hits, vec![(7, 40)]);
        assert_eq!(store.gets.get(), cold, "no read while the copy is recent");

        // Worker b sends the same prompt to host 8 (it read the slots itself).
        let (hits, seen) = IX.lookup_seen(&store, &mut b, &blocks, None, OWNERS, 20);
        assert_eq!(hits, vec![(7, 40)]);
        IX.record_after(&store, &mut b, &blocks, 8, 20, &seen);
        // a still sees its own fact (true: host 7 was sent these blocks) ...
        let (hits, _) = IX.lookup_seen(&store, &mut a, &blocks, None, OWNERS, CACHE_MS - 1);
        assert_eq!(hits, vec![(7, 40)]);
        // ... and b's newer one beside it once its copy is CACHE_MS old.
        let (hits, _) = IX.lookup_seen(&store, &mut a, &blocks, None, OWNERS, CACHE_MS);
        assert_eq!(hits, vec![(8, 40), (7, 40)]);
        // A clock that goes back reads the store again.
        let before = store.gets.get();
        IX.lookup_seen(&store, &mut a, &blocks, None, OWNERS, 5);
        assert!(store.gets.get() > before);
    }

    #[test]
    fn the_cache_is_bounded() {
        let store = MemorySharedData::default();
        let mut c = IndexCache::default();
        let big = Index {
            slots: u64::MAX,
            ..IX
        };
        for r in 0..5_000 {
            big.record_after(&store, &mut c, &chain(r, 64), r, 0, &Seen::default());
        }
        assert_eq!(c.lines.len(), CACHE_LINES);
    }

    #[test]
    fn forget_removes_only_older_claims_of_that_host_beyond_the_depth() {
        let store = MemorySharedData::default();
        let mut cache = IndexCache::default();
        // Turn 1 (23 blocks) went to host 7 at 0 ms.
        let turn2 = chain(5, 40);
        IX.record(&store, &turn2[..23], 7, 0);
        // Turn 2 is decided at 100 ms: the index expects 23 blocks on 7,
        // and turn 2 records its new positions (31, 39) there.
        let (hits, seen) = IX.lookup_seen(&store, &mut cache, &turn2, None, OWNERS, 100);
        assert_eq!(hits, vec![(7, 23)]);
        IX.record_after(&store, &mut cache, &turn2, 7, 100, &seen);
        // The engine had only the first 2 blocks: turn 1's claims from
        // position 2 on go (3, 7, 15, and its last block, 22); positions 0
        // and 1 are within the depth, and turn 2's own entries are newer
        // than the decision.
        assert_eq!(IX.forget(&store, &mut cache, &turn2, 2, 7, 100, 150), 4);
        // The forgetting worker's copy saw the removal at once.
        assert_eq!(
            IX.lookup_seen(&store, &mut cache, &turn2[..16], None, OWNERS, 160)
                .0,
            vec![(7, 2)]
        );
        let fresh = &mut IndexCache::default();
        assert_eq!(
            IX.lookup_seen(&store, fresh, &turn2, None, OWNERS, 200).0,
            vec![(7, 40)]
        );
        assert_eq!(IX.lookup(&store, &turn2[..23], 200), vec![(7, 2)]);
        // Nothing left to remove.
        assert_eq!(IX.forget(&store, &mut cache, &turn2, 2, 7, 100, 300), 0);
    }

    #[test]
    fn forget_spares_other_hosts_and_slots_rewritten_meanwhile() {
        let store = MemorySharedData::default();
        let mut cache = IndexCache::default();
        let blocks = chain(9, 8);
        IX.record(&store, &blocks, 9, 0);
        assert_eq!(IX.forget(&store, &mut cache, &blocks, 0, 7, 1000, 10), 0);
        // Every compare-and-swap loses: another worker wrote first.
        store.conflicts.set(usize::MAX);
        assert_eq!(IX.forget(&store, &mut cache, &blocks, 0, 9, 1000, 10), 0);
        store.conflicts.set(0);
        assert_eq!(IX.lookup(&store, &blocks, 10), vec![(9, 8)]);
        assert_eq!(IX.forget(&store, &mut cache, &blocks, 0, 9, 1000, 10), 4);
        assert!(IX.lookup(&store, &blocks, 10).is_empty());
    }

    #[test]
    fn an_entry_keeps_the_latest_owners_and_forgets_one_of_them() {
        let store = MemorySharedData::default();
        let mut cache = IndexCache::default();
        let blocks = chain(11, 8);
        let n = OWNERS as u64 + 1;
        for h in 1..=n {
            IX.record(&store, &blocks, h, h);
        }
        // The oldest falls off; the latest comes first.
        let hits = IX.lookup(&store, &blocks, 10);
        let latest: Vec<(u64, u32)> = (2..=n).rev().map(|h| (h, 8)).collect();
        assert_eq!(hits, latest);
        // Or only the last sender of each block.
        let last = IX.lookup_seen(&store, &mut IndexCache::default(), &blocks, None, 1, 10);
        assert_eq!(last.0, vec![(n, 8)]);
        // A host sending again becomes the most recent owner.
        IX.record(&store, &blocks, 2, 11);
        assert_eq!(IX.lookup(&store, &blocks, 12).first(), Some(&(2, 8)));
        IX.record(&store, &blocks, n, 12);
        // Forgetting one host leaves the others in place.
        assert_eq!(IX.forget(&store, &mut cache, &blocks, 0, 3, 1000, 20), 4);
        let hits = IX.lookup(&store, &blocks, 20);
        assert_eq!(hits, vec![(n, 8), (2, 8), (n - 1, 8)]);
        // Owners past the TTL are not reported, and a rewrite drops them.
        IX.record(&store, &blocks, 9, 1004);
        assert_eq!(
            IX.lookup(&store, &blocks, 1005),
            vec![(9, 8), (n, 8), (2, 8)]
        );
    }

    #[test]
    fn entries_encode_one_to_owners_owners() {
        let o = |host: u64| Owner {
            host,
            depth: 7,
            at_ms: 99,
        };
        let mut e = Entry::single(5, o(1));
        assert_eq!(e.encode().len(), 28, "one owner: the single-owner layout");
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        for h in 2..=6 {
            e = e.with(o(h));
        }
        assert_eq!(e.owners().len(), OWNERS);
        assert_eq!(e.owners().first().map(|x| x.host), Some(6));
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        let bytes = e.encode();
        for bad in [&bytes[..0], &bytes[..8], &bytes[..27], &bytes[..29]] {
            assert_eq!(Entry::decode(bad), None, "{} bytes", bad.len());
        }
        let mut long = bytes.clone();
        long.extend_from_slice(&bytes[8..28]);
        assert_eq!(Entry::decode(&long), None, "more than OWNERS owners");
    }

    #[test]
    fn memory_is_bounded_by_slots() {
        let store = MemorySharedData::default();
        let small = Index { slots: 8, ..IX };
        for r in 0..200 {
            small.record(&store, &chain(r, 64), r, 0);
        }
        assert!(store.len() <= 8);
    }
}

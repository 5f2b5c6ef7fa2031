//! Key memory: where a gateway placed a key's cold request, remembered in
//! the prefix index and shared with the other gateways through the
//! collector.
//!
//! With `fleet.coldHomeShare` below `homeCachedShare` a cold request (the
//! prefix index knows none of its blocks, it continues no conversation) may
//! leave its key's rendezvous home by cost ([`crate::decide`]); so may a
//! first request whose system prompt the index knows. For any request
//! that continues no conversation, of a key no gateway placed, the gateway
//! records the replica in its prefix index under the key, salted
//! ([`key_block`]), and that replica stands for the key's home while the
//! entry lives. Other gateways must learn it too: their indexes know none
//! of the key's blocks, so they would take its next request for cold and
//! place it by cost, or send it to the rendezvous home, where nothing of it
//! may be cached. So:
//!
//! 1. a decision that writes the memory (a new key placed, on its
//!    rendezvous home or off it, or a remembered key's memory renewed,
//!    every half `prefixTtlMs` while in use) also appends `(key, replica,
//!    time)` to a small ring in shared data ([`note`]; [`RING`] entries,
//!    compare-and-swap, a lost race drops the note);
//! 2. the gateway's load report (`GET /v1/fleet/load`,
//!    [`crate::load::LoadReport::placed`]) carries the ring's entries
//!    younger than [`REPORT_MS`], by address;
//! 3. a collector that reads several gateways' reports puts the *other*
//!    gateways' placements in the snapshot it pushes to each
//!    (`placed`, at most [`MAX_SNAPSHOT`]), and only to a gateway whose
//!    own report had the field (one that reads it);
//! 4. each router worker, when it decodes a new snapshot (on its 100 ms
//!    tick, or on a request), writes each into the prefix index
//!    ([`apply`]), unless the index already remembers the key at a later
//!    time. The tick matters: a gateway that gets no request for longer
//!    than [`REPORT_MS`] still learns every placement.
//!
//! A placement reaches the other gateways within a push interval or two
//! (250 ms by default) and is delivered several times while it is younger
//! than [`REPORT_MS`]; applying it again changes nothing.
//!
//! The ring holds [`RING`] placements: at a 250 ms read interval, about
//! 1,000 new keys a second per gateway. The gateway records when a report
//! last carried its ring ([`report`]), and [`note`] says how many
//! placements left the ring unread, which the filter counts
//! (`kvroute_placements_lost_total`, beside `kvroute_placements_noted_total`;
//! fleet simulation, docs/fleet-state.md "Key memory").
//!
//! Ring encoding (little endian): the magic `KVP1`, then 24 bytes per
//! entry, oldest first: key (u64), host id (u64), time (u64, gateway ms).
//!
//! **Last blocks** (`fleet.shareLastBlocks`, on by default). Key memory
//! gives the other gateways a conversation's first placement only. Each
//! gateway sees a share of a conversation's turns; for the others its
//! index does not know where the previous turn went, and it sends the
//! turn to the key's home or remembered replica while the conversation's
//! longest prefix sits elsewhere (a turn that spilled, or that another
//! gateway placed by its own load). So every request in fleet mode also
//! appends its last block to a second ring ([`note_last`]: block hash,
//! host, time, the request's length in blocks), through the same channel:
//! the load report carries the ring's entries younger than
//! [`LAST_REPORT_MS`] when asked with `lastBlocks=1` (`lastBlocks`), the
//! collector hands each gateway the others' (`lastBlocks` in its
//! snapshot, at most [`MAX_SNAPSHOT_LAST`]), and the gateway writes each
//! into its index as that block's owner at that depth ([`apply_last`]),
//! unless it holds a later send of the block. The next turn probes that
//! block ([`crate::decide::Facts::previous_blocks`]) and finds the replica
//! and the whole previous turn. One entry a request, where the
//! index records up to `log2(blocks) + 2`: the fleet simulation measured
//! the whole index shared (an upper bound, `kvroute-oracle-shared-index`)
//! and found the last block alone worth as much (docs/fleet-state.md,
//! "Last blocks, shared through the collector").
//!
//! The ring grows with the request rate, not the key rate: it keeps
//! [`LAST_RING`] entries and none older than [`LAST_REPORT_MS`], 32 bytes
//! each (block, host, time, blocks; magic `KVL1`). A gateway writes it only
//! while a load report carried it within [`LAST_READER_MS`] (a collector
//! that reads several gateways asks for it), so a lone gateway pays
//! nothing; `kvroute_last_blocks_noted_total` and
//! `kvroute_last_blocks_lost_total` count as the placements' counters do.

use serde::{Deserialize, Serialize};

use crate::host::{SetError, SharedData};
use crate::index::{Index, IndexCache};
use crate::load::MAX_CAS_TRIES;
use crate::picker::{host_id, HostSet};

const MAGIC: &[u8; 4] = b"KVP1";
/// Entries kept in a gateway's ring (6 KB).
pub const RING: usize = 256;
/// Placements younger than this are reported: a collector that reads
/// every 250 ms delivers each several times.
pub const REPORT_MS: u64 = 5000;
/// Most placements a snapshot carries (the others' rings, youngest first).
pub const MAX_SNAPSHOT: usize = 4096;

/// Turns an affinity key into the prefix-index block under which the
/// gateway remembers where it placed the key.
const KEY_SALT: u64 = 0x6b65_795f_686f_6d65;

/// The prefix-index block of a key's memory.
pub fn key_block(key: u64) -> u64 {
    key ^ KEY_SALT
}

/// A placement as reported and pushed: the affinity key (16 hex digits),
/// the replica's address, and how long ago it was made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Placement {
    pub key: String,
    pub address: String,
    pub age_ms: u64,
}

impl Placement {
    /// The key, when it is 16 hex digits.
    pub fn key_value(&self) -> Option<u64> {
        hex16(&self.key)
    }
}

/// The little-endian word `k` of `bytes` (0 where `bytes` is too short).
pub(crate) fn word(bytes: &[u8], k: usize) -> u64 {
    bytes
        .get(k * 8..k * 8 + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// A ring's entries: `W` little-endian words each, after the ring's magic.
/// A value with another magic reads as empty.
fn decode<const W: usize>(magic: &[u8; 4], bytes: &[u8]) -> Vec<[u64; W]> {
    let Some(body) = bytes.strip_prefix(magic.as_slice()) else {
        return Vec::new();
    };
    body.chunks_exact(W * 8)
        .map(|c| std::array::from_fn(|k| word(c, k)))
        .collect()
}

/// Where a ring lives and what it keeps: entries of `W` words whose word
/// [`AT`] is the time they were made (gateway ms).
struct Ring<'a> {
    key: &'a str,
    magic: &'static [u8; 4],
    /// Most entries kept.
    cap: usize,
    /// Entries older than this are dropped when the ring is next written.
    keep_ms: u64,
}

/// The word of a ring entry that holds its time.
const AT: usize = 2;

impl Ring<'_> {
    fn read<const W: usize>(&self, store: &dyn SharedData) -> Vec<[u64; W]> {
        match store.get(self.key) {
            Ok((Some(v), _)) => decode(self.magic, &v),
            _ => Vec::new(),
        }
    }

    /// Appends `entry` (made at `now_ms`), dropping the oldest beyond
    /// `cap` and those older than `keep_ms`; `reported` is when a load
    /// report last carried the ring ([`reported_at`], read by the caller).
    /// See [`note`] for the count it returns.
    ///
    /// It runs on every request, so it works on the stored bytes: the kept
    /// entries are copied as they are, and only the dropped ones' times are
    /// read (a ring of 200 last blocks, `benches/decide.rs`: 1.65 µs a
    /// request when every entry was decoded and encoded again).
    fn append<const W: usize>(
        &self,
        store: &dyn SharedData,
        entry: [u64; W],
        reported: Option<u64>,
        now_ms: u64,
    ) -> u64 {
        // This entry, if it is not written.
        let unwritten = u64::from(reported.is_some());
        let width = W * 8;
        for _ in 0..MAX_CAS_TRIES {
            let Ok((value, cas)) = store.get(self.key) else {
                return unwritten;
            };
            // The stored entries (none under another magic; a torn tail is
            // not an entry), oldest first.
            let body = value
                .as_deref()
                .and_then(|v| v.strip_prefix(self.magic.as_slice()))
                .unwrap_or_default();
            let stored = body.len() / width.max(1);
            // When stored entry `i` was made (0 for an entry too short to say).
            let at = |i: usize| {
                let e = body.get(i * width..(i + 1) * width).unwrap_or_default();
                word(e, AT)
            };
            let old = (0..stored)
                .take_while(|&i| now_ms.saturating_sub(at(i)) > self.keep_ms)
                .count();
            let drop = (stored + 1).saturating_sub(self.cap).max(old).min(stored);
            let kept = body.get(drop * width..stored * width).unwrap_or_default();
            let mut out = Vec::with_capacity(4 + kept.len() + width);
            out.extend_from_slice(self.magic);
            out.extend_from_slice(kept);
            for w in entry {
                out.extend_from_slice(&w.to_le_bytes());
            }
            match store.set(self.key, &out, cas) {
                Err(SetError::CasMismatch) => continue,
                Ok(()) => {
                    let Some(r) = reported else {
                        return 0;
                    };
                    return (0..drop).filter(|&i| at(i) > r).count() as u64;
                }
                Err(_) => return unwritten,
            }
        }
        unwritten
    }
}

/// The shared-data key under which a gateway keeps the time of the last
/// load report that carried its ring ([`report`]).
fn reported_key(ring_key: &str) -> String {
    format!("{ring_key}.reported")
}

/// When a load report last carried the ring, gateway ms; `None`: never
/// (no collector reads this gateway's placements).
fn reported_at(store: &dyn SharedData, ring_key: &str) -> Option<u64> {
    match store.get(&reported_key(ring_key)) {
        Ok((Some(v), _)) => v
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes),
        _ => None,
    }
}

/// Appends a placement to the gateway's ring under `ring_key`, dropping the
/// oldest beyond [`RING`]. A hint: after [`MAX_CAS_TRIES`] lost races, or
/// if the host refuses, it is dropped.
///
/// Returns how many placements the other gateways can no longer learn of:
/// those pushed out of the ring that no load report has carried (made after
/// the last report, [`report`]), and this one if it was not written.
/// Counted only once some collector has read the ring: a gateway no
/// collector reads for placements loses nothing it could have shared.
pub fn note(store: &dyn SharedData, ring_key: &str, key: u64, host: u64, now_ms: u64) -> u64 {
    let reported = reported_at(store, ring_key);
    placements(ring_key).append(store, [key, host, now_ms], reported, now_ms)
}

/// The ring of key placements under `ring_key`.
fn placements(ring_key: &str) -> Ring<'_> {
    Ring {
        key: ring_key,
        magic: MAGIC,
        cap: RING,
        keep_ms: u64::MAX,
    }
}

/// [`recent`], for a load report that carries the ring to a collector: it
/// also records that the ring was read at `now_ms` (see [`note`]).
pub fn report(
    store: &dyn SharedData,
    ring_key: &str,
    known: &[&HostSet],
    now_ms: u64,
) -> Vec<Placement> {
    let placed = recent(store, ring_key, known, now_ms);
    let _ = store.set(&reported_key(ring_key), &now_ms.to_le_bytes(), None);
    placed
}

/// The ring's placements younger than [`REPORT_MS`] whose host is in one
/// of `known`, youngest first.
pub fn recent(
    store: &dyn SharedData,
    ring_key: &str,
    known: &[&HostSet],
    now_ms: u64,
) -> Vec<Placement> {
    let entries: Vec<[u64; 3]> = placements(ring_key).read(store);
    entries
        .iter()
        .rev()
        .filter(|&&[_, _, at]| now_ms.saturating_sub(at) <= REPORT_MS)
        .filter_map(|&[key, host, at]| {
            let address = address_of(known, host)?;
            Some(Placement {
                key: format!("{key:016x}"),
                address,
                age_ms: now_ms.saturating_sub(at),
            })
        })
        .collect()
}

/// Several gateways' placements as one snapshot's: youngest first, one per
/// key (its youngest), at most [`MAX_SNAPSHOT`].
pub fn merge(placed: impl IntoIterator<Item = Placement>) -> Vec<Placement> {
    youngest(placed, |p| p.age_ms, |p| p.key.clone(), MAX_SNAPSHOT)
}

/// `items` youngest first (by `age`), the youngest of each `key`, at most
/// `cap`.
fn youngest<T, K: std::hash::Hash + Eq>(
    items: impl IntoIterator<Item = T>,
    age: impl Fn(&T) -> u64,
    key: impl Fn(&T) -> K,
    cap: usize,
) -> Vec<T> {
    let mut all: Vec<T> = items.into_iter().collect();
    all.sort_by_key(&age);
    let mut seen = std::collections::HashSet::new();
    all.retain(|x| seen.insert(key(x)));
    all.truncate(cap);
    all
}

/// The address of `host` in the first of `known` that has it.
fn address_of(known: &[&HostSet], host: u64) -> Option<String> {
    known.iter().find_map(|set| {
        let i = set.index_of(host)?;
        set.get(i).map(|h| h.addr.clone())
    })
}

/// Writes pushed placements into the prefix index, each as made `ageMs`
/// before `now_ms`, unless the index remembers the key at the same time or
/// later. Returns how many were written.
pub fn apply(
    store: &dyn SharedData,
    index: &Index<'_>,
    placed: &[Placement],
    now_ms: u64,
) -> usize {
    let mut cache = IndexCache::default();
    let mut written = 0;
    for p in placed {
        let Some(key) = p.key_value() else {
            continue;
        };
        let at = now_ms.saturating_sub(p.age_ms);
        if index.record_if_newer(
            store,
            &mut cache,
            key_block(key),
            host_id(&p.address),
            1,
            at,
        ) {
            written += 1;
        }
    }
    written
}

/// A request's last block as reported and pushed: its hash (16 hex
/// digits), the request's length in blocks, the replica it was sent to,
/// and how long ago. The next turn of a conversation extends that request,
/// and the gateway that sees it probes exactly this block
/// ([`crate::decide::Facts::previous_blocks`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LastBlock {
    pub block: String,
    pub blocks: u32,
    pub address: String,
    pub age_ms: u64,
}

impl LastBlock {
    /// The block hash, when it is 16 hex digits.
    pub fn block_value(&self) -> Option<u64> {
        hex16(&self.block)
    }
}

/// `s` as a u64, when it is 16 hex digits.
fn hex16(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

const LAST_MAGIC: &[u8; 4] = b"KVL1";
/// Last blocks kept in a gateway's ring (32 bytes each): two seconds of
/// requests at 500 a second, and a collector reads every 250 ms.
pub const LAST_RING: usize = 1024;
/// Last blocks younger than this are reported, and kept in the ring no
/// longer: a collector that reads every 250 ms delivers each several
/// times, and the next turn of a conversation comes seconds later.
pub const LAST_REPORT_MS: u64 = 2000;
/// A gateway writes its last blocks only while some load report carried
/// them this recently: with no collector that hands them to another
/// gateway, the ring would cost a write per request for no reader.
pub const LAST_READER_MS: u64 = 10_000;
/// Most last blocks a snapshot carries (the others' rings, youngest first).
pub const MAX_SNAPSHOT_LAST: usize = 4096;

/// The ring of last blocks under `ring_key`.
fn last_blocks(ring_key: &str) -> Ring<'_> {
    Ring {
        key: ring_key,
        magic: LAST_MAGIC,
        cap: LAST_RING,
        keep_ms: LAST_REPORT_MS,
    }
}

/// Appends a request's last block (`block`, the request being `blocks`
/// long) sent to `host` to the gateway's ring under `ring_key`, if a load
/// report carried that ring within [`LAST_READER_MS`]; `None` when none
/// did (nothing written). Otherwise, as [`note`]: how many last blocks the
/// other gateways can no longer learn of (pushed out, by the cap or by
/// age, before a report carried them; or this one, not written).
pub fn note_last(
    store: &dyn SharedData,
    ring_key: &str,
    block: u64,
    blocks: u32,
    host: u64,
    now_ms: u64,
) -> Option<u64> {
    let read = reported_at(store, ring_key)?;
    if now_ms.saturating_sub(read) > LAST_READER_MS {
        return None;
    }
    let entry = [block, host, now_ms, u64::from(blocks)];
    Some(last_blocks(ring_key).append(store, entry, Some(read), now_ms))
}

/// The ring's last blocks younger than [`LAST_REPORT_MS`] whose host is
/// in one of `known`, youngest first, for a load report; records that the
/// ring was read at `now_ms` (see [`note_last`]).
pub fn report_last(
    store: &dyn SharedData,
    ring_key: &str,
    known: &[&HostSet],
    now_ms: u64,
) -> Vec<LastBlock> {
    let entries: Vec<[u64; 4]> = last_blocks(ring_key).read(store);
    let out = entries
        .iter()
        .rev()
        .filter(|&&[_, _, at, _]| now_ms.saturating_sub(at) <= LAST_REPORT_MS)
        .filter_map(|&[block, host, at, blocks]| {
            let address = address_of(known, host)?;
            Some(LastBlock {
                block: format!("{block:016x}"),
                blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
                address,
                age_ms: now_ms.saturating_sub(at),
            })
        })
        .collect();
    let _ = store.set(&reported_key(ring_key), &now_ms.to_le_bytes(), None);
    out
}

/// Several gateways' last blocks as one snapshot's: youngest first, one
/// per block and replica (its youngest), at most [`MAX_SNAPSHOT_LAST`].
pub fn merge_last(last: impl IntoIterator<Item = LastBlock>) -> Vec<LastBlock> {
    youngest(
        last,
        |b| b.age_ms,
        |b| (b.block.clone(), b.address.clone()),
        MAX_SNAPSHOT_LAST,
    )
}

/// Writes pushed last blocks into the prefix index, each as sent `ageMs`
/// before `now_ms` by a request of `blocks` blocks, unless the block's
/// most recent owner was recorded at the same time or later (this
/// gateway's own later send, or the same block delivered again). Returns
/// how many were written.
pub fn apply_last(
    store: &dyn SharedData,
    index: &Index<'_>,
    last: &[LastBlock],
    now_ms: u64,
) -> usize {
    let mut cache = IndexCache::default();
    let mut written = 0;
    for b in last {
        let Some(block) = b.block_value().filter(|_| b.blocks > 0) else {
            continue;
        };
        let at = now_ms.saturating_sub(b.age_ms);
        let host = host_id(&b.address);
        if index.record_if_newer(store, &mut cache, block, host, b.blocks, at) {
            written += 1;
        }
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemorySharedData;

    fn index() -> Index<'static> {
        Index {
            slots: 1024,
            ttl_ms: 600_000,
            key_prefix: "t.px.",
        }
    }

    #[test]
    fn the_ring_keeps_the_latest_and_reports_the_young_by_address() {
        let store = MemorySharedData::default();
        let hosts = HostSet::new(["10.0.0.1:80".to_owned(), "10.0.0.2:80".to_owned()]);
        let a = host_id("10.0.0.1:80");
        for k in 0..(RING as u64 + 10) {
            note(&store, "ring", k, a, 1000 + k);
        }
        let entries: Vec<[u64; 3]> = placements("ring").read(&store);
        assert_eq!(entries.len(), RING);
        assert_eq!(entries[0][0], 10, "the oldest ten were dropped");
        // An unknown host is left out; so is what is older than REPORT_MS.
        note(&store, "ring", 7777, 42, 1000 + RING as u64 + 10);
        let now = 1000 + REPORT_MS + 200;
        let r = recent(&store, "ring", &[&hosts], now);
        assert!(r.iter().all(|p| p.address == "10.0.0.1:80"));
        assert!(r.iter().all(|p| p.age_ms <= REPORT_MS));
        assert_eq!(r.len(), RING + 10 - 200);
        assert_eq!(
            r[0].key,
            format!("{:016x}", RING as u64 + 9),
            "youngest first"
        );
        assert_eq!(r[0].key_value(), Some(RING as u64 + 9));
        // A value that is not a ring reads as empty and is replaced.
        store.set("ring", b"junk", None).unwrap();
        assert!(recent(&store, "ring", &[&hosts], now).is_empty());
        note(&store, "ring", 1, a, now);
        assert_eq!(recent(&store, "ring", &[&hosts], now).len(), 1);
    }

    #[test]
    fn placements_pushed_out_before_a_report_carried_them_are_lost() {
        let store = MemorySharedData::default();
        let hosts = HostSet::new(["10.0.0.1:80".to_owned()]);
        let a = host_id("10.0.0.1:80");
        // No collector reads the ring: nothing is lost, however full.
        let lost: u64 = (0..2 * RING as u64)
            .map(|k| note(&store, "ring", k, a, 1000 + k))
            .sum();
        assert_eq!(lost, 0);
        // A report at 3000 carried everything noted until then.
        let carried = report(&store, "ring", &[&hosts], 3000);
        assert_eq!(carried.len(), RING);
        // RING more notes push out the carried ones: none lost.
        let lost: u64 = (0..RING as u64)
            .map(|k| note(&store, "ring", 10_000 + k, a, 3001 + k))
            .sum();
        assert_eq!(lost, 0);
        // Ten more before the next report push out ten never carried.
        let lost: u64 = (0..10)
            .map(|k| note(&store, "ring", 20_000 + k, a, 3600 + k))
            .sum();
        assert_eq!(lost, 10);
        // After another report, the ring's entries are carried again.
        report(&store, "ring", &[&hosts], 3700);
        assert_eq!(note(&store, "ring", 30_000, a, 3701), 0);
        // `recent` alone (a read that is no report) records nothing.
        recent(&store, "ring", &[&hosts], 9000);
        let lost: u64 = (0..RING as u64)
            .map(|k| note(&store, "ring", 40_000 + k, a, 9001 + k))
            .sum();
        assert_eq!(lost, 1, "the one noted after the last report");
    }

    /// The ring's append, on the stored bytes, against a plain list:
    /// keeps the last `cap` entries not older than `keep_ms`, counts the
    /// dropped ones made after the last report, and replaces a value it
    /// cannot read (another magic, a torn tail) with a ring of its own.
    #[cfg(not(target_arch = "wasm32"))]
    mod append_model {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn append_keeps_what_a_list_keeps(
                start in prop_oneof![Just(Vec::new()), Just(b"KVX1junk".to_vec()), Just(b"KVL1torn".to_vec())],
                steps in proptest::collection::vec((0u64..400, any::<bool>()), 1..120),
            ) {
                let store = MemorySharedData::default();
                let _ = store.set("r", &start, None);
                let ring = Ring { key: "r", magic: LAST_MAGIC, cap: 16, keep_ms: 1000 };
                let mut model: Vec<[u64; 4]> = Vec::new();
                let (mut now, mut reported) = (1000u64, None);
                for (i, (gap, read)) in steps.into_iter().enumerate() {
                    now += gap;
                    if read {
                        reported = Some(now);
                    }
                    let entry = [i as u64, 7, now, 3];
                    let lost = ring.append(&store, entry, reported, now);
                    model.push(entry);
                    let old = model.iter().take_while(|e| now - e[AT] > 1000).count();
                    let drop = model.len().saturating_sub(16).max(old);
                    let want = reported.map_or(0, |r| {
                        model.iter().take(drop).filter(|e| e[AT] > r).count() as u64
                    });
                    model.drain(..drop);
                    prop_assert_eq!(lost, want);
                    prop_assert_eq!(ring.read::<4>(&store), model.clone());
                }
            }
        }
    }

    #[test]
    fn merged_placements_keep_each_keys_youngest() {
        let p = |key: &str, age_ms: u64| Placement {
            key: key.to_owned(),
            address: format!("10.0.0.1:{}", 80 + age_ms),
            age_ms,
        };
        let m = merge([p("a", 30), p("b", 10), p("a", 5), p("c", 20)]);
        let got: Vec<(&str, u64)> = m.iter().map(|p| (p.key.as_str(), p.age_ms)).collect();
        assert_eq!(got, [("a", 5), ("b", 10), ("c", 20)]);
        let many = (0..MAX_SNAPSHOT as u64 + 5).map(|k| p(&format!("{k:016x}"), k));
        assert_eq!(merge(many).len(), MAX_SNAPSHOT);
    }

    #[test]
    fn applied_placements_never_overwrite_a_later_memory() {
        let store = MemorySharedData::default();
        let idx = index();
        let p = |key: u64, addr: &str, age_ms: u64| Placement {
            key: format!("{key:016x}"),
            address: addr.to_owned(),
            age_ms,
        };
        let remembered = |key: u64, now: u64| {
            idx.lookup_seen(
                &store,
                &mut IndexCache::default(),
                &[key_block(key)],
                None,
                1,
                now,
            )
            .0
            .first()
            .map(|h| h.0)
        };
        // Key 1 pushed at 10 s, made 500 ms before.
        assert_eq!(apply(&store, &idx, &[p(1, "10.0.0.1:80", 500)], 10_000), 1);
        assert_eq!(remembered(1, 10_000), Some(host_id("10.0.0.1:80")));
        // The same placement again (the next push): nothing written.
        assert_eq!(apply(&store, &idx, &[p(1, "10.0.0.1:80", 750)], 10_250), 0);
        // This gateway placed key 1 elsewhere at 11 s; an older placement
        // from another gateway arrives later and does not win.
        idx.record(&store, &[key_block(1)], host_id("10.0.0.2:80"), 11_000);
        assert_eq!(
            apply(&store, &idx, &[p(1, "10.0.0.1:80", 2_000)], 12_000),
            0
        );
        assert_eq!(remembered(1, 12_000), Some(host_id("10.0.0.2:80")));
        // A younger one does.
        assert_eq!(apply(&store, &idx, &[p(1, "10.0.0.1:80", 100)], 12_000), 1);
        assert_eq!(remembered(1, 12_000), Some(host_id("10.0.0.1:80")));
        // A key that is not 16 hex digits is skipped.
        let bad = Placement {
            key: "xyz".into(),
            address: "10.0.0.1:80".into(),
            age_ms: 0,
        };
        assert_eq!(apply(&store, &idx, &[bad], 12_000), 0);
    }

    #[test]
    fn last_blocks_are_written_while_read_and_age_out() {
        let store = MemorySharedData::default();
        let hosts = HostSet::new(["10.0.0.1:80".to_owned()]);
        let a = host_id("10.0.0.1:80");
        // No collector has read the ring: nothing written.
        assert_eq!(note_last(&store, "last", 1, 3, a, 1000), None);
        assert!(report_last(&store, "last", &[&hosts], 1000).is_empty());
        // Read at 1000: written from then on, and reported youngest first
        // with their length; an unknown host is left out.
        assert_eq!(note_last(&store, "last", 1, 3, a, 1100), Some(0));
        assert_eq!(note_last(&store, "last", 2, 5, 42, 1150), Some(0));
        assert_eq!(note_last(&store, "last", 3, 7, a, 1200), Some(0));
        let r = report_last(&store, "last", &[&hosts], 1300);
        let got: Vec<(Option<u64>, u32, u64)> = r
            .iter()
            .map(|b| (b.block_value(), b.blocks, b.age_ms))
            .collect();
        assert_eq!(got, [(Some(3), 7, 100), (Some(1), 3, 200)]);
        assert!(r.iter().all(|b| b.address == "10.0.0.1:80"));
        // One noted after that read, then none read it before it aged out:
        // the next write drops it, lost, with the reported ones.
        assert_eq!(note_last(&store, "last", 4, 2, a, 1400), Some(0));
        let later = 1400 + LAST_REPORT_MS + 1;
        assert_eq!(note_last(&store, "last", 5, 2, a, later), Some(1));
        let entries: Vec<[u64; 4]> = last_blocks("last").read(&store);
        assert_eq!(entries.len(), 1, "only the last one is young");
        // Older than LAST_REPORT_MS is not reported.
        assert!(report_last(&store, "last", &[&hosts], later + LAST_REPORT_MS + 1).is_empty());
        // The ring holds at most LAST_RING; a write long after the last
        // read writes nothing.
        let t = later + LAST_REPORT_MS + 2;
        for k in 0..LAST_RING as u64 + 5 {
            note_last(&store, "last", 100 + k, 2, a, t);
        }
        assert_eq!(last_blocks("last").read::<4>(&store).len(), LAST_RING);
        let gone = later + LAST_REPORT_MS + 1 + LAST_READER_MS + 1;
        assert_eq!(note_last(&store, "last", 9, 2, a, gone), None);
    }

    #[test]
    fn merged_last_blocks_keep_each_blocks_youngest_per_replica() {
        let b = |block: u64, address: &str, age_ms: u64| LastBlock {
            block: format!("{block:016x}"),
            blocks: 4,
            address: address.to_owned(),
            age_ms,
        };
        let m = merge_last([
            b(1, "10.0.0.1:80", 30),
            b(1, "10.0.0.1:80", 10),
            b(1, "10.0.0.2:80", 20),
            b(2, "10.0.0.1:80", 5),
        ]);
        let got: Vec<(Option<u64>, &str, u64)> = m
            .iter()
            .map(|x| (x.block_value(), x.address.as_str(), x.age_ms))
            .collect();
        assert_eq!(
            got,
            [
                (Some(2), "10.0.0.1:80", 5),
                (Some(1), "10.0.0.1:80", 10),
                (Some(1), "10.0.0.2:80", 20)
            ]
        );
        let many = (0..MAX_SNAPSHOT_LAST as u64 + 5).map(|k| b(k, "10.0.0.1:80", k));
        assert_eq!(merge_last(many).len(), MAX_SNAPSHOT_LAST);
    }

    /// An applied last block makes the next turn's probe of it find the
    /// replica and the whole earlier request; delivered again, or older
    /// than this gateway's own send of the block, it writes nothing.
    #[test]
    fn applied_last_blocks_give_the_next_turn_its_replica_and_depth() {
        let store = MemorySharedData::default();
        let idx = index();
        let turn: Vec<u64> = (0..12u64).map(|b| b * 7 + 1).collect();
        let b = |address: &str, age_ms: u64| LastBlock {
            block: format!("{:016x}", turn[9]),
            blocks: 10,
            address: address.to_owned(),
            age_ms,
        };
        let found = |now: u64| {
            idx.lookup_seen(&store, &mut IndexCache::default(), &turn, Some(10), 1, now)
                .0
        };
        assert!(found(10_000).is_empty());
        assert_eq!(
            apply_last(&store, &idx, &[b("10.0.0.1:80", 300)], 10_000),
            1
        );
        assert_eq!(found(10_000), [(host_id("10.0.0.1:80"), 10)]);
        assert_eq!(
            apply_last(&store, &idx, &[b("10.0.0.1:80", 550)], 10_250),
            0
        );
        // This gateway sent the block itself later; an older report loses.
        idx.record(&store, &turn[..10], host_id("10.0.0.2:80"), 11_000);
        assert_eq!(
            apply_last(&store, &idx, &[b("10.0.0.3:80", 2_000)], 12_000),
            0
        );
        assert_eq!(found(12_000)[0], (host_id("10.0.0.2:80"), 10));
        // A malformed block or a length of 0 is skipped.
        let bad = [
            LastBlock {
                block: "xyz".into(),
                ..b("10.0.0.1:80", 0)
            },
            LastBlock {
                blocks: 0,
                ..b("10.0.0.1:80", 0)
            },
        ];
        assert_eq!(apply_last(&store, &idx, &bad, 12_000), 0);
    }
}

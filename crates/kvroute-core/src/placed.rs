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

use serde::{Deserialize, Serialize};

use crate::host::{SetError, SharedData};
use crate::index::{Index, IndexCache};
use crate::load::MAX_CAS_TRIES;
use crate::picker::{host_id, HostSet};

const MAGIC: &[u8; 4] = b"KVP1";
const ENTRY: usize = 24;
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
        (self.key.len() == 16)
            .then(|| u64::from_str_radix(&self.key, 16).ok())
            .flatten()
    }
}

fn decode(bytes: &[u8]) -> Vec<(u64, u64, u64)> {
    let Some(body) = bytes.strip_prefix(MAGIC.as_slice()) else {
        return Vec::new();
    };
    body.chunks_exact(ENTRY)
        .map(|c| {
            let word = |k: usize| {
                let mut w = [0u8; 8];
                if let Some(s) = c.get(k * 8..k * 8 + 8) {
                    w.copy_from_slice(s);
                }
                u64::from_le_bytes(w)
            };
            (word(0), word(1), word(2))
        })
        .collect()
}

fn encode(entries: &[(u64, u64, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + entries.len() * ENTRY);
    out.extend_from_slice(MAGIC);
    for &(key, host, at) in entries {
        out.extend_from_slice(&key.to_le_bytes());
        out.extend_from_slice(&host.to_le_bytes());
        out.extend_from_slice(&at.to_le_bytes());
    }
    out
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
    // This placement, if it is not written.
    let unwritten = u64::from(reported.is_some());
    for _ in 0..MAX_CAS_TRIES {
        let Ok((value, cas)) = store.get(ring_key) else {
            return unwritten;
        };
        let mut entries = value.as_deref().map(decode).unwrap_or_default();
        entries.push((key, host, now_ms));
        let drop = entries.len().saturating_sub(RING);
        match store.set(
            ring_key,
            &encode(entries.get(drop..).unwrap_or_default()),
            cas,
        ) {
            Err(SetError::CasMismatch) => continue,
            Ok(()) => {
                let Some(r) = reported else {
                    return 0;
                };
                let unread = entries.iter().take(drop).filter(|&&(_, _, at)| at > r);
                return unread.count() as u64;
            }
            Err(_) => return unwritten,
        }
    }
    unwritten
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
    let entries = match store.get(ring_key) {
        Ok((Some(v), _)) => decode(&v),
        _ => return Vec::new(),
    };
    entries
        .iter()
        .rev()
        .filter(|&&(_, _, at)| now_ms.saturating_sub(at) <= REPORT_MS)
        .filter_map(|&(key, host, at)| {
            let address = known.iter().find_map(|set| {
                let i = set.index_of(host)?;
                set.get(i).map(|h| h.addr.clone())
            })?;
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
    let mut all: Vec<Placement> = placed.into_iter().collect();
    all.sort_by_key(|p| p.age_ms);
    let mut keys = std::collections::HashSet::new();
    all.retain(|p| keys.insert(p.key.clone()));
    all.truncate(MAX_SNAPSHOT);
    all
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
        if index.record_if_newer(store, &mut cache, key_block(key), host_id(&p.address), at) {
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
        let (v, _) = store.get("ring").unwrap();
        let entries = decode(&v.unwrap());
        assert_eq!(entries.len(), RING);
        assert_eq!(entries[0].0, 10, "the oldest ten were dropped");
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
}

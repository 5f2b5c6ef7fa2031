//! The gateway's own in-flight accounting, kept in shared data.
//!
//! Each host carries two figures, both in tokens, for the requests this
//! gateway sent it:
//! - **prefill pending**: estimated prompt tokens, released at the first
//!   response byte (the work ahead of a new request's first token);
//! - **memory held**: estimated prompt plus output tokens, released at the
//!   end of the stream (the KV memory the request holds for its whole
//!   life). Bounded load acts on this figure.
//!
//! The table lives under one shared-data key so that every Envoy worker
//! thread (one Wasm VM each) sees one figure, and is updated with
//! compare-and-swap: read, change, write back with the version read, retry
//! on a conflict.
//!
//! Beside them, per host, the requests this gateway sent it lately: a count
//! that decays exponentially over `fleet.arrivalWindowMs`, so that it
//! divided by the window is the recent arrival rate
//! ([`LoadTable::arrival_rate`]). A prefill delays every request that
//! arrives behind it on its replica; the score charges that delay by this
//! rate (`fleet.arrivalDelayWeight`, [`crate::decide`]).
//!
//! Encoding (little endian): the magic `KVL3`, the number of busy hosts
//! (u32), then 24 bytes per busy host: host id (u64), prefill pending
//! (u64), memory held (u64); then 24 bytes per host with recent arrivals:
//! host id (u64), the decayed count in thousandths (u64), when it was last
//! counted (gateway clock, ms, u64). Hosts with no load are dropped, and
//! arrivals once they have decayed away, so the value stays as small as
//! the busy part of the fleet. Hosts are keyed by id, not position, so a
//! config change that reorders the host list keeps everyone's load.
//! The key is `load.v3`: a plugin of the previous version (`KVL2`, the
//! same without the count and the arrivals, under `load.v2`) running
//! beside this one during a reload keeps its own table rather than taking
//! this one for corrupt and replacing it. `KVL2` is still decoded, as a
//! table without arrivals. (`KVL1` held prefill and decode tokens, under
//! `load.v1`.)
//!
//! Entries are kept sorted by host id, so that a decision, which reads one
//! entry per candidate replica, merges the table with its candidate list in
//! one pass ([`LoadTable::aligned`]), and a single host is found by binary
//! search: with a linear search per candidate a busy 1,024-replica fleet
//! cost 352 µs a decision instead of 74 µs idle (`cargo bench -p
//! kvroute-core --bench decide`, `decide_fleet`).
//! A stored table that is not sorted (or repeats a host) is put in order
//! when decoded, repeated hosts summed.
//!
//! A collector that pushes to several gateways reads each one's table on
//! the ingest listener (`GET /v1/fleet/load`, [`LoadReport`], by address)
//! and gives each gateway the others' pending prefill in its snapshot
//! (`peerPendingTokens`), and their recent placements
//! (`placed`, [`crate::placed`]).

use serde::{Deserialize, Serialize};

use crate::fleet::MAX_HOSTS;
use crate::host::{SetError, SharedData};
use crate::picker::HostSet;
use crate::placed::{self, LastBlock, Placement};

const MAGIC: &[u8; 4] = b"KVL3";
/// The previous encoding: load entries only.
const MAGIC_V2: &[u8; 4] = b"KVL2";
const ENTRY: usize = 24;
/// An arrival count decayed over this many windows is gone (e^-30 is
/// 1e-13: below one thousandth for any count under 1e10 requests a
/// window, far above any replica's).
const ARRIVALS_KEPT_WINDOWS: u64 = 30;

/// One host's in-flight tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Entry {
    pub host: u64,
    pub prefill: u64,
    pub memory: u64,
}

/// One host's recent arrivals: a count that decays by `e^(-age / window)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Arrivals {
    host: u64,
    /// The count at `at_ms`, in thousandths.
    milli: u64,
    at_ms: u64,
}

impl Arrivals {
    /// The count at `now_ms` (the clock never runs back for it).
    fn count(&self, now_ms: u64, window_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(self.at_ms) as f64;
        self.milli as f64 / 1000.0 * (-age / window_ms.max(1) as f64).exp()
    }
}

/// In-flight tokens and recent arrivals per host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTable {
    entries: Vec<Entry>,
    /// Sorted by host, one per host.
    arrivals: Vec<Arrivals>,
}

/// A stored value that is not a load table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError;

/// Tokens to add to or take from one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    pub host: u64,
    pub prefill: u64,
    pub memory: u64,
}

impl LoadTable {
    pub fn decode(bytes: &[u8]) -> Result<LoadTable, DecodeError> {
        let (loads, arrivals) = if let Some(body) = bytes.strip_prefix(MAGIC.as_slice()) {
            let (n, rest) = body.split_first_chunk::<4>().ok_or(DecodeError)?;
            let split = (u32::from_le_bytes(*n) as usize)
                .checked_mul(ENTRY)
                .filter(|&k| k <= rest.len())
                .ok_or(DecodeError)?;
            rest.split_at(split)
        } else {
            let body = bytes.strip_prefix(MAGIC_V2.as_slice()).ok_or(DecodeError)?;
            (body, &[][..])
        };
        if loads.len() % ENTRY != 0 || arrivals.len() % ENTRY != 0 {
            return Err(DecodeError);
        }
        // Both sections are rows of three little-endian words.
        fn rows(b: &[u8]) -> impl Iterator<Item = [u64; 3]> + '_ {
            let word = |c: &[u8], k: usize| -> u64 {
                let mut w = [0u8; 8];
                if let Some(s) = c.get(k * 8..k * 8 + 8) {
                    w.copy_from_slice(s);
                }
                u64::from_le_bytes(w)
            };
            b.chunks_exact(ENTRY)
                .map(move |c| [word(c, 0), word(c, 1), word(c, 2)])
        }
        let entries = rows(loads)
            .map(|[host, prefill, memory]| Entry {
                host,
                prefill,
                memory,
            })
            .collect();
        let arrivals = rows(arrivals)
            .map(|[host, milli, at_ms]| Arrivals { host, milli, at_ms })
            .collect();
        let mut table = LoadTable { entries, arrivals };
        table.normalise();
        Ok(table)
    }

    /// Restores the order (sorted by host, one entry per host, no idle
    /// entry) of a table read from elsewhere; free when it holds.
    fn normalise(&mut self) {
        let ordered = self.entries.windows(2).all(|w| match w {
            [a, b] => a.host < b.host,
            _ => true,
        });
        let arrivals_ordered = self.arrivals.windows(2).all(|w| match w {
            [a, b] => a.host < b.host,
            _ => true,
        });
        if !arrivals_ordered {
            // A stored table never repeats a host; if one does, its counts
            // are added, at the latest time.
            let mut arrivals = std::mem::take(&mut self.arrivals);
            arrivals.sort_by_key(|a| (a.host, a.at_ms));
            for a in arrivals {
                match self.arrivals.last_mut() {
                    Some(last) if last.host == a.host => {
                        last.milli = last.milli.saturating_add(a.milli);
                        last.at_ms = a.at_ms;
                    }
                    _ => self.arrivals.push(a),
                }
            }
        }
        if ordered && self.entries.iter().all(|e| e.prefill != 0 || e.memory != 0) {
            return;
        }
        let mut entries = std::mem::take(&mut self.entries);
        entries.sort_by_key(|e| e.host);
        for e in entries {
            self.add(Charge {
                host: e.host,
                prefill: e.prefill,
                memory: e.memory,
            });
        }
    }

    fn position(&self, host: u64) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&host, |e| e.host)
    }

    pub fn encode(&self) -> Vec<u8> {
        let rows = self.entries.len() + self.arrivals.len();
        let mut out = Vec::with_capacity(MAGIC.len() + 4 + rows * ENTRY);
        out.extend_from_slice(MAGIC);
        // At most one entry per host id seen, far below u32::MAX.
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        let words = self
            .entries
            .iter()
            .map(|e| [e.host, e.prefill, e.memory])
            .chain(self.arrivals.iter().map(|a| [a.host, a.milli, a.at_ms]));
        for w in words.flatten() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Counts a request sent to `host` at `now_ms`, and forgets the counts
    /// that have decayed away.
    pub fn arrived(&mut self, host: u64, now_ms: u64, window_ms: u64) {
        let gone = window_ms.max(1).saturating_mul(ARRIVALS_KEPT_WINDOWS);
        self.arrivals
            .retain(|a| a.host == host || now_ms.saturating_sub(a.at_ms) < gone);
        let counted = |a: &Arrivals| ((a.count(now_ms, window_ms) + 1.0) * 1000.0) as u64;
        match self.arrivals.binary_search_by_key(&host, |a| a.host) {
            Ok(i) => {
                if let Some(a) = self.arrivals.get_mut(i) {
                    // A clock behind the count's time restarts it there
                    // (undecayed), so it cannot grow without decaying.
                    *a = Arrivals {
                        host,
                        milli: counted(a),
                        at_ms: now_ms,
                    };
                }
            }
            Err(i) => self.arrivals.insert(
                i,
                Arrivals {
                    host,
                    milli: 1000,
                    at_ms: now_ms,
                },
            ),
        }
    }

    /// The requests per second this gateway sent `host` lately: the
    /// decayed count over the window (an exponentially weighted rate).
    pub fn arrival_rate(&self, host: u64, now_ms: u64, window_ms: u64) -> f64 {
        self.arrivals
            .binary_search_by_key(&host, |a| a.host)
            .ok()
            .and_then(|i| self.arrivals.get(i))
            .map_or(0.0, |a| {
                let rate = a.count(now_ms, window_ms) * 1000.0 / window_ms.max(1) as f64;
                // A stored count no gateway could reach (a corrupt or
                // foreign value): at most what a snapshot or a collector
                // accepts, so the report stays readable.
                rate.min(crate::fleet::MAX_ARRIVALS_PER_S)
            })
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// One host's entry (zero when idle).
    pub fn entry(&self, host: u64) -> Entry {
        self.position(host)
            .ok()
            .and_then(|i| self.entries.get(i))
            .copied()
            .unwrap_or(Entry {
                host,
                ..Entry::default()
            })
    }

    /// Every host's entry, aligned with `hosts` (idle ones zero): one merge
    /// of two lists sorted by id, linear in the fleet.
    pub fn aligned(&self, hosts: &HostSet) -> Vec<Entry> {
        let mut out: Vec<Entry> = hosts
            .iter()
            .map(|h| Entry {
                host: h.id,
                ..Entry::default()
            })
            .collect();
        let mut entries = self.entries.iter().peekable();
        for &(id, i) in hosts.by_id() {
            while entries.next_if(|e| e.host < id).is_some() {}
            // Peeked, not taken: a host listed twice gets its entry twice.
            if let (Some(e), Some(slot)) = (entries.peek().filter(|e| e.host == id), out.get_mut(i))
            {
                *slot = **e;
            }
        }
        out
    }

    /// Memory held per host, aligned with `hosts`: the load of bounded
    /// load.
    pub fn loads_for(&self, hosts: &HostSet) -> Vec<u64> {
        self.aligned(hosts).iter().map(|e| e.memory).collect()
    }

    /// Sums over all hosts: (prefill pending, memory held).
    pub fn totals(&self) -> (u64, u64) {
        self.entries.iter().fold((0, 0), |(p, d), e| {
            (p.saturating_add(e.prefill), d.saturating_add(e.memory))
        })
    }

    pub fn add(&mut self, c: Charge) {
        match self.position(c.host) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.prefill = e.prefill.saturating_add(c.prefill);
                    e.memory = e.memory.saturating_add(c.memory);
                }
            }
            Err(_) if c.prefill == 0 && c.memory == 0 => {}
            Err(i) => self.entries.insert(
                i,
                Entry {
                    host: c.host,
                    prefill: c.prefill,
                    memory: c.memory,
                },
            ),
        }
    }

    /// Takes a charge back. Saturates at zero: a release can never make a
    /// host look less than idle, even if an earlier charge was lost.
    pub fn release(&mut self, c: Charge) {
        let Ok(i) = self.position(c.host) else {
            return;
        };
        let idle = self.entries.get_mut(i).is_some_and(|e| {
            e.prefill = e.prefill.saturating_sub(c.prefill);
            e.memory = e.memory.saturating_sub(c.memory);
            e.prefill == 0 && e.memory == 0
        });
        if idle {
            self.entries.remove(i);
        }
    }
}

/// A gateway's load table by address, as the ingest listener serves it:
/// `{"hosts": [{"address": "10.0.0.11:8000", "prefillPendingTokens": 2048,
/// "memoryTokens": 9000, "arrivalsPerS": 1.5}]}`, `arrivalsPerS` being the
/// recent arrival rate ([`LoadTable::arrival_rate`]; absent for a host
/// sent nothing lately). Replicas neither busy nor sent anything lately
/// are left out. `"arrivalWindowMs": 10000` says the gateway counts
/// arrivals (and reads `peerArrivalsPerS`). Asked with
/// `?placed=1` ([`crate::ingest::LOAD_PLACED_QUERY`]) it also carries
/// `"placed": [{"key": "00c0ffee00c0ffee", "address": "10.0.0.11:8000",
/// "ageMs": 120}]`, the gateway's recent placements; with `?lastBlocks=1`
/// ([`crate::ingest::LOAD_LAST_BLOCKS_QUERY`]) `"lastBlocks": [{"block":
/// "5e1f00c0ffee0001", "blocks": 12, "address": "10.0.0.11:8000", "ageMs":
/// 80}]`, its recent requests' last blocks ([`crate::placed::note_last`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadReport {
    pub hosts: Vec<HostLoad>,
    /// This gateway's recent placements ([`crate::placed`]).
    /// Present (maybe empty) from a gateway that reads them in a snapshot;
    /// absent from an older one, which gets none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placed: Option<Vec<Placement>>,
    /// This gateway's recent requests' last blocks
    /// ([`crate::placed::report_last`]); present (maybe empty) when asked
    /// for and the gateway shares them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_blocks: Option<Vec<LastBlock>>,
    /// The window over which this gateway counts arrivals
    /// (`fleet.arrivalWindowMs`): present from a gateway that counts them
    /// and reads `peerArrivalsPerS` in a snapshot (a collector gives that
    /// field to no other gateway, whose snapshot check would reject it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_window_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostLoad {
    pub address: String,
    pub prefill_pending_tokens: u64,
    pub memory_tokens: u64,
    /// Requests per second the gateway sent it lately; absent from a
    /// gateway that does not count them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrivals_per_s: Option<f64>,
}

impl LoadReport {
    /// The table's hosts (busy, or sent something lately) that are in one
    /// of `known` (the snapshot's and the configured hosts; the table keys
    /// hosts by id), at most [`MAX_HOSTS`]; arrival rates at `now_ms` over
    /// `window_ms`.
    pub fn of(table: &LoadTable, known: &[&HostSet], now_ms: u64, window_ms: u64) -> LoadReport {
        let mut ids: Vec<u64> = table.entries.iter().map(|e| e.host).collect();
        ids.extend(table.arrivals.iter().map(|a| a.host));
        ids.sort_unstable();
        ids.dedup();
        let hosts = ids
            .into_iter()
            .filter_map(|id| {
                known.iter().find_map(|set| {
                    let host = set.index_of(id).and_then(|i| set.get(i))?;
                    let e = table.entry(id);
                    let counted = table.arrivals.binary_search_by_key(&id, |a| a.host).is_ok();
                    Some(HostLoad {
                        address: host.addr.clone(),
                        prefill_pending_tokens: e.prefill,
                        memory_tokens: e.memory,
                        arrivals_per_s: counted.then(|| table.arrival_rate(id, now_ms, window_ms)),
                    })
                })
            })
            .take(MAX_HOSTS)
            .collect();
        LoadReport {
            hosts,
            placed: None,
            last_blocks: None,
            arrival_window_ms: Some(window_ms),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a gateway's answer; more than [`MAX_HOSTS`] hosts is an
    /// error.
    pub fn from_json(bytes: &[u8]) -> Result<LoadReport, String> {
        let r: LoadReport = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if r.hosts.len() > MAX_HOSTS {
            return Err(format!("{} hosts, at most {MAX_HOSTS}", r.hosts.len()));
        }
        if let Some(n) = r
            .placed
            .as_ref()
            .map(Vec::len)
            .filter(|&n| n > placed::RING)
        {
            return Err(format!("{n} placements, at most {}", placed::RING));
        }
        if let Some(n) = r
            .last_blocks
            .as_ref()
            .map(Vec::len)
            .filter(|&n| n > placed::LAST_RING)
        {
            return Err(format!("{n} last blocks, at most {}", placed::LAST_RING));
        }
        let max = crate::fleet::MAX_ARRIVALS_PER_S;
        if let Some(h) = r.hosts.iter().find(|h| {
            h.arrivals_per_s
                .is_some_and(|v| !(v.is_finite() && (0.0..=max).contains(&v)))
        }) {
            return Err(format!(
                "{}: arrivalsPerS must be a number from 0 to {max}",
                h.address
            ));
        }
        Ok(r)
    }
}

/// Why a load-table update did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    /// Other workers kept winning the compare-and-swap.
    Contended,
    /// The host refused the read or the write.
    Host,
}

/// Bound on compare-and-swap retries: contention only comes from the other
/// worker threads, so a handful of tries settles it; past that, the request
/// is routed without accounting rather than spinning on the request path.
pub const MAX_CAS_TRIES: usize = 8;

/// Read-modify-write of the load table with compare-and-swap.
///
/// `f` sees the current table (empty when missing or corrupt: a corrupt value
/// is replaced rather than blocking every request) and changes it; its result
/// and the table as written are returned. `f` may run several times.
pub fn update<R>(
    store: &dyn SharedData,
    key: &str,
    mut f: impl FnMut(&mut LoadTable) -> R,
) -> Result<(R, LoadTable), UpdateError> {
    for _ in 0..MAX_CAS_TRIES {
        let (value, cas) = store.get(key).map_err(|_| UpdateError::Host)?;
        let mut table = value
            .as_deref()
            .and_then(|v| LoadTable::decode(v).ok())
            .unwrap_or_default();
        let r = f(&mut table);
        match store.set(key, &table.encode(), cas) {
            Ok(()) => return Ok((r, table)),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Host) => return Err(UpdateError::Host),
        }
    }
    Err(UpdateError::Contended)
}

/// Reads the table without changing it.
pub fn read(store: &dyn SharedData, key: &str) -> LoadTable {
    match store.get(key) {
        Ok((Some(v), _)) => LoadTable::decode(&v).unwrap_or_default(),
        _ => LoadTable::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemorySharedData;

    #[test]
    fn round_trip_and_corrupt_values() {
        let mut t = LoadTable::default();
        t.add(Charge {
            host: 1,
            prefill: 10,
            memory: 5,
        });
        t.add(Charge {
            host: 2,
            prefill: 3,
            memory: 0,
        });
        t.add(Charge {
            host: 1,
            prefill: 1,
            memory: 1,
        });
        assert_eq!(LoadTable::decode(&t.encode()), Ok(t.clone()));
        assert_eq!(t.totals(), (14, 6));
        assert_eq!(LoadTable::decode(b"KVL2abc"), Err(DecodeError));
        assert_eq!(LoadTable::decode(b"nope"), Err(DecodeError));
        assert_eq!(LoadTable::decode(b""), Err(DecodeError));
    }

    #[test]
    fn release_saturates_and_drops_idle_hosts() {
        let mut t = LoadTable::default();
        t.add(Charge {
            host: 7,
            prefill: 10,
            memory: 5,
        });
        t.release(Charge {
            host: 7,
            prefill: 100,
            memory: 0,
        });
        assert_eq!(
            t.entries(),
            &[Entry {
                host: 7,
                prefill: 0,
                memory: 5
            }]
        );
        t.release(Charge {
            host: 7,
            prefill: 0,
            memory: 5,
        });
        assert!(t.entries().is_empty());
        t.release(Charge {
            host: 9,
            prefill: 1,
            memory: 1,
        });
        assert!(t.entries().is_empty());
    }

    #[test]
    fn loads_align_with_hosts_by_id() {
        let hosts = HostSet::new(["10.0.0.1:1".to_string(), "10.0.0.2:1".to_string()]);
        let id1 = hosts.get(1).unwrap().id;
        let mut t = LoadTable::default();
        t.add(Charge {
            host: id1,
            prefill: 4,
            memory: 6,
        });
        t.add(Charge {
            host: 999,
            prefill: 1,
            memory: 1,
        });
        assert_eq!(t.loads_for(&hosts), vec![0, 6]);
        // A host listed twice (the same address) gets its entry both times.
        let twice = HostSet::new([
            "10.0.0.2:1".to_string(),
            "10.0.0.1:1".to_string(),
            "10.0.0.2:1".to_string(),
        ]);
        assert_eq!(t.loads_for(&twice), vec![6, 0, 6]);
    }

    #[test]
    fn update_retries_on_conflict_and_gives_up_bounded() {
        let store = MemorySharedData::default();
        let (n, t) = update(&store, "k", |t| {
            t.add(Charge {
                host: 1,
                prefill: 2,
                memory: 3,
            });
            t.entries().len()
        })
        .unwrap();
        assert_eq!(n, 1);
        assert_eq!(read(&store, "k"), t);

        // Another writer sneaks in before each of our writes: one conflict, then success.
        store.conflicts.set(1);
        let mut runs = 0;
        update(&store, "k", |t| {
            runs += 1;
            t.release(Charge {
                host: 1,
                prefill: 2,
                memory: 3,
            })
        })
        .unwrap();
        assert_eq!(runs, 2);
        assert!(read(&store, "k").entries().is_empty());

        store.conflicts.set(usize::MAX);
        assert_eq!(
            update(&store, "k", |_| ()).unwrap_err(),
            UpdateError::Contended
        );
    }

    #[test]
    fn the_report_names_known_hosts_by_address() {
        let snapshot = HostSet::new(["10.0.0.1:1".to_string(), "10.0.0.2:1".to_string()]);
        let configured = HostSet::new(["10.0.0.3:1".to_string()]);
        let mut t = LoadTable::default();
        for (host, prefill) in [
            (snapshot.get(1).unwrap().id, 5),
            (configured.get(0).unwrap().id, 7),
            (999, 1),
        ] {
            t.add(Charge {
                host,
                prefill,
                memory: 2 * prefill,
            });
        }
        // Sent a request lately, with nothing in flight now: reported.
        t.arrived(snapshot.get(0).unwrap().id, 0, 1000);
        let r = LoadReport::of(&t, &[&snapshot, &configured], 0, 1000);
        let got: Vec<(&str, u64, u64, Option<f64>)> = r
            .hosts
            .iter()
            .map(|h| {
                (
                    h.address.as_str(),
                    h.prefill_pending_tokens,
                    h.memory_tokens,
                    h.arrivals_per_s,
                )
            })
            .collect();
        let mut got = got;
        got.sort_unstable_by(|a, b| a.0.cmp(b.0));
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:1", 0, 0, Some(1.0)),
                ("10.0.0.2:1", 5, 10, None),
                ("10.0.0.3:1", 7, 14, None)
            ]
        );
        assert_eq!(LoadReport::from_json(&r.to_json()), Ok(r));
        assert!(LoadReport::from_json(br#"{"hosts":[{"address":"a"}]}"#).is_err());
        assert!(LoadReport::from_json(b"nope").is_err());
        let rate = |v: &str| {
            format!(
                r#"{{"hosts":[{{"address":"a","prefillPendingTokens":1,"memoryTokens":1,"arrivalsPerS":{v}}}]}}"#
            )
        };
        assert!(LoadReport::from_json(rate("1.5").as_bytes()).is_ok());
        for bad in ["-1", "1e300"] {
            let e = LoadReport::from_json(rate(bad).as_bytes()).unwrap_err();
            assert!(e.contains("arrivalsPerS"), "{bad}: {e}");
        }
        let many = format!(
            r#"{{"hosts":[{}]}}"#,
            vec![r#"{"address":"a","prefillPendingTokens":1,"memoryTokens":1}"#; MAX_HOSTS + 1]
                .join(",")
        );
        assert!(LoadReport::from_json(many.as_bytes()).is_err());
        // Last blocks round-trip, and more than a ring holds is refused.
        let b = |k: usize| LastBlock {
            block: format!("{k:016x}"),
            blocks: 3,
            address: "10.0.0.1:1".into(),
            age_ms: 5,
        };
        let with = |n: usize| LoadReport {
            last_blocks: Some((0..n).map(b).collect()),
            ..LoadReport::default()
        };
        let ok = with(placed::LAST_RING);
        assert_eq!(LoadReport::from_json(&ok.to_json()), Ok(ok));
        let e = LoadReport::from_json(&with(placed::LAST_RING + 1).to_json()).unwrap_err();
        assert!(e.contains("last blocks"), "{e}");
    }

    /// The table against a map model: any sequence of charges and releases
    /// gives the same figures, and the encoded table decodes to itself.
    #[test]
    fn charges_and_releases_match_a_map() {
        use proptest::prelude::*;
        let op = (any::<bool>(), 0u64..12, 0u64..50, 0u64..50);
        proptest!(|(ops in prop::collection::vec(op, 0..200))| {
            let mut t = LoadTable::default();
            let mut model = std::collections::BTreeMap::<u64, (u64, u64)>::new();
            for (add, host, prefill, memory) in ops {
                let c = Charge { host, prefill, memory };
                let e = model.entry(host).or_default();
                if add {
                    t.add(c);
                    *e = (e.0 + prefill, e.1 + memory);
                } else {
                    t.release(c);
                    *e = (e.0.saturating_sub(prefill), e.1.saturating_sub(memory));
                }
                model.retain(|_, v| *v != (0, 0));
            }
            let want: Vec<Entry> = model
                .iter()
                .map(|(&host, &(prefill, memory))| Entry { host, prefill, memory })
                .collect();
            prop_assert_eq!(t.entries(), want.as_slice());
            for host in 0..12 {
                let (prefill, memory) = model.get(&host).copied().unwrap_or_default();
                prop_assert_eq!(t.entry(host), Entry { host, prefill, memory });
            }
            prop_assert_eq!(LoadTable::decode(&t.encode()), Ok(t));
        });
    }

    #[test]
    fn an_unordered_stored_table_is_put_in_order() {
        // Written in the previous encoding, which is still read.
        let mut bytes = MAGIC_V2.to_vec();
        for (host, prefill, memory) in [(9u64, 1u64, 2u64), (3, 0, 0), (4, 5, 0), (9, 10, 20)] {
            for w in [host, prefill, memory] {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
        }
        let t = LoadTable::decode(&bytes).unwrap();
        assert_eq!(
            t.entries(),
            &[
                Entry {
                    host: 4,
                    prefill: 5,
                    memory: 0
                },
                Entry {
                    host: 9,
                    prefill: 11,
                    memory: 22
                }
            ]
        );
        assert_eq!(t.entry(9).memory, 22);
        assert_eq!(
            t.entry(3),
            Entry {
                host: 3,
                ..Entry::default()
            }
        );
    }

    #[test]
    fn arrivals_decay_over_the_window_and_are_kept_apart_from_load() {
        let w = 10_000;
        let mut t = LoadTable::default();
        t.arrived(5, 1000, w);
        t.arrived(5, 1000, w);
        // Two requests over a 10 s window: 0.2 a second.
        assert!((t.arrival_rate(5, 1000, w) - 0.2).abs() < 1e-9);
        // A window later, e^-1 of it; a clock behind the count, no decay.
        let later = t.arrival_rate(5, 1000 + w, w);
        assert!((later - 0.2 / std::f64::consts::E).abs() < 1e-6, "{later}");
        assert!((t.arrival_rate(5, 0, w) - 0.2).abs() < 1e-9);
        assert_eq!(t.arrival_rate(6, 1000, w), 0.0);
        // Arrivals are no load, and survive the encoding.
        assert!(t.entries().is_empty());
        assert_eq!(t.totals(), (0, 0));
        assert_eq!(LoadTable::decode(&t.encode()), Ok(t.clone()));
        // A load released to nothing leaves the arrivals alone.
        let c = Charge {
            host: 5,
            prefill: 3,
            memory: 4,
        };
        t.add(c);
        t.release(c);
        assert!(t.entries().is_empty());
        assert!(t.arrival_rate(5, 1000, w) > 0.0);
        // A clock that ran back restarts the count there, undecayed: it
        // then decays from that time (it does not keep growing undecayed).
        let mut back = t.clone();
        back.arrived(5, 500, w);
        assert!((back.arrival_rate(5, 500, w) - 0.3).abs() < 1e-9);
        let decayed = back.arrival_rate(5, 500 + w, w);
        assert!(
            (decayed - 0.3 / std::f64::consts::E).abs() < 1e-6,
            "{decayed}"
        );
        // Counts decayed over 30 windows are forgotten at the next arrival.
        t.arrived(9, 1000 + 30 * w, w);
        assert_eq!(t.arrival_rate(5, 1000 + 30 * w, w), 0.0);
        assert_eq!(t.arrivals.len(), 1);
    }

    #[test]
    fn a_malformed_table_is_rejected() {
        let with = |count: u32, body: usize| {
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&count.to_le_bytes());
            b.extend_from_slice(&vec![0u8; body]);
            b
        };
        // The count of load entries past the end; arrivals not whole.
        for (count, body) in [
            (2, ENTRY),
            (0, ENTRY - 1),
            (1, 2 * ENTRY - 1),
            (u32::MAX, ENTRY),
        ] {
            assert_eq!(
                LoadTable::decode(&with(count, body)),
                Err(DecodeError),
                "{count} {body}"
            );
        }
        assert_eq!(LoadTable::decode(b"KVL3"), Err(DecodeError));
        assert_eq!(LoadTable::decode(b"KVL3\x00\x00"), Err(DecodeError));
        assert!(LoadTable::decode(&with(1, 2 * ENTRY)).is_ok());
    }

    /// A stored arrival count beyond any real traffic (a corrupt or
    /// foreign value) gives a rate no higher than a snapshot or a
    /// collector accepts, so the gateway's load report stays readable
    /// (found by the `gateway_state` fuzz target).
    #[test]
    fn an_absurd_arrival_count_still_makes_a_readable_report() {
        let hosts = HostSet::new(["127.0.0.1:8001".to_string()]);
        let id = hosts.get(0).map(|h| h.id).unwrap();
        let now = 1_764_400_000_000;
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&1u32.to_le_bytes());
        for w in [id, 1, 1, id, u64::MAX, now] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        let t = LoadTable::decode(&b).unwrap();
        let rate = t.arrival_rate(id, now, 10_000);
        assert_eq!(rate, crate::fleet::MAX_ARRIVALS_PER_S);
        let report = LoadReport::of(&t, &[&hosts], now, 10_000);
        assert_eq!(report.hosts[0].arrivals_per_s, Some(rate));
        assert_eq!(LoadReport::from_json(&report.to_json()), Ok(report));
    }

    #[test]
    fn corrupt_stored_value_is_replaced() {
        let store = MemorySharedData::default();
        store.set("k", b"garbage", None).unwrap();
        let (_, t) = update(&store, "k", |t| {
            t.add(Charge {
                host: 1,
                prefill: 1,
                memory: 0,
            })
        })
        .unwrap();
        assert_eq!(t.entries().len(), 1);
        assert_eq!(read(&store, "k"), t);
    }
}

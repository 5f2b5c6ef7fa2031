//! Fleet snapshots in shared data: the ingest side (validate, store) and the
//! router side (decode once per stored version per VM).
//!
//! Three keys:
//! - `<prefix>.fleet.v1`: 16-byte header (`seq`, ingest time, little endian)
//!   followed by the snapshot JSON;
//! - `<prefix>.fleet.stamp.v1`: the same 16-byte header alone;
//! - `<prefix>.fleet.owner.v1`: the collector that owns the snapshot (8-byte
//!   time of its last accepted push, then its id).
//!
//! One collector owns a gateway's snapshot at a time. Two collectors with
//! different views pushing to one gateway (a misconfigured Service, a second
//! deployment) would otherwise make the view flip on every push, since both
//! `seq`s follow the wall clock. The rule: a push from another collector
//! than the owner is refused with 409 (`kvroute_ingest_conflicts_total`,
//! logged at most once per lease) while the owner's last accepted push is
//! younger than `ingest.ownerLeaseMs`; after that the pusher takes over
//! (logged). So a standby collector is a working failover: it takes over
//! when the owner's data would go stale anyway (the lease's default is the
//! router's default `fleet.staleAfterMs`). The owner check and the snapshot
//! write are two shared-data operations: two collectors whose first pushes
//! race can both be accepted once, and the next push settles the owner.
//!
//! Ingest replaces the snapshot with compare-and-swap and only with a higher
//! `seq`, so an older or replayed push never replaces a newer snapshot, even
//! when two pushes race on two worker threads. It then raises the stamp the
//! same way. Routers read the 16-byte stamp on every request (proxy-wasm
//! copies a value on every read, so the large key is not touched) and read
//! and decode the snapshot only when the stamp's `seq` is newer than what
//! they hold.

use std::rc::Rc;

use crate::config::{Config, IngestConfig};
use crate::fleet::{FleetView, Snapshot, Stamp};
use crate::host::{Counter, SetError, SharedData};
use crate::index::Index;
use crate::placed;
use crate::rates;

/// Path the collector pushes to.
pub const INGEST_PATH: &str = "/v1/fleet/snapshot";
/// Path a collector reads the gateway's in-flight load from
/// ([`crate::load::LoadReport`]), with the same bearer token.
pub const LOAD_PATH: &str = "/v1/fleet/load";
/// The query by which a collector asks the load report for the gateway's
/// recent placements too ([`crate::placed`]); without it the
/// report is what an older collector reads.
pub const LOAD_PLACED_QUERY: &str = "placed=1";

/// The query by which a collector that hands each gateway the others'
/// requests' last blocks asks for them ([`crate::placed::report_last`]).
pub const LOAD_LAST_BLOCKS_QUERY: &str = "lastBlocks=1";

/// Whether a load read asks for the placements.
pub fn wants_placed(path: &str) -> bool {
    asks(path, LOAD_PLACED_QUERY)
}

/// Whether a load read asks for the last blocks.
pub fn wants_last_blocks(path: &str) -> bool {
    asks(path, LOAD_LAST_BLOCKS_QUERY)
}

fn asks(path: &str, query: &str) -> bool {
    path.split_once('?')
        .is_some_and(|(_, q)| q.split('&').any(|kv| kv == query))
}

/// What a request on the ingest listener asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ask {
    /// `POST /v1/fleet/snapshot`: store a snapshot.
    Push,
    /// `GET /v1/fleet/load`: this gateway's in-flight load per replica.
    Load,
}

/// The answer to one push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// 204: stored.
    Accepted {
        seq: u64,
    },
    /// 401: no or wrong bearer token.
    Unauthorized,
    /// 413: over `ingest.maxBytes`.
    TooLarge {
        limit: usize,
    },
    /// 400: malformed or invalid, with what is wrong.
    Invalid(String),
    /// 204: stored, and the pusher took the snapshot over from a silent
    /// owner.
    TookOver {
        seq: u64,
        from: String,
        silent_ms: u64,
    },
    /// 409: not newer than the stored snapshot.
    Stale {
        stored: u64,
        pushed: u64,
    },
    /// 409: another collector owns the snapshot and pushed recently.
    Conflict {
        owner: String,
        pushed: String,
        silent_ms: u64,
        lease_ms: u64,
    },
    /// 404 / 405: not the ingest endpoint.
    NotFound,
    MethodNotAllowed,
    /// 503: shared data refused the write.
    Unavailable,
}

impl Outcome {
    pub fn status(&self) -> u32 {
        match self {
            Outcome::Accepted { .. } | Outcome::TookOver { .. } => 204,
            Outcome::Unauthorized => 401,
            Outcome::TooLarge { .. } => 413,
            Outcome::Invalid(_) => 400,
            Outcome::Stale { .. } | Outcome::Conflict { .. } => 409,
            Outcome::NotFound => 404,
            Outcome::MethodNotAllowed => 405,
            Outcome::Unavailable => 503,
        }
    }

    /// JSON error body (none for 204).
    pub fn body(&self) -> Option<String> {
        let msg = match self {
            Outcome::Accepted { .. } | Outcome::TookOver { .. } => return None,
            Outcome::Unauthorized => "missing or wrong bearer token".to_owned(),
            Outcome::TooLarge { limit } => format!("snapshot larger than {limit} bytes"),
            Outcome::Invalid(e) => format!("invalid snapshot: {e}"),
            Outcome::Stale { stored, pushed } => {
                format!("seq {pushed} is not newer than the stored seq {stored}")
            }
            Outcome::Conflict {
                owner,
                pushed,
                silent_ms,
                lease_ms,
            } => format!(
                "collector {pushed:?} conflicts with {owner:?}, which owns this gateway's snapshot \
                 (last push {silent_ms} ms ago); it takes over after {lease_ms} ms without one"
            ),
            Outcome::NotFound => format!(
                "not found: push snapshots to POST {INGEST_PATH}, read the load at GET {LOAD_PATH}"
            ),
            Outcome::MethodNotAllowed => {
                format!("method not allowed: use POST {INGEST_PATH} or GET {LOAD_PATH}")
            }
            Outcome::Unavailable => "shared data unavailable".to_owned(),
        };
        Some(serde_json::json!({ "error": msg }).to_string())
    }

    pub fn counter(&self) -> Option<Counter> {
        match self {
            Outcome::Accepted { .. } | Outcome::TookOver { .. } => Some(Counter::IngestAccepted),
            Outcome::Unauthorized => Some(Counter::IngestUnauthorized),
            Outcome::TooLarge { .. } => Some(Counter::IngestTooLarge),
            Outcome::Invalid(_) => Some(Counter::IngestInvalid),
            Outcome::Stale { .. } => Some(Counter::IngestStale),
            Outcome::Conflict { .. } => Some(Counter::IngestConflict),
            _ => None,
        }
    }
}

/// Checks `Authorization: Bearer <token>` in time independent of where the
/// token differs.
pub fn authorized(cfg: &IngestConfig, authorization: Option<&str>) -> bool {
    // The scheme is case-insensitive (RFC 9110 section 11.1).
    let Some((scheme, given)) = authorization.and_then(|a| a.trim().split_once(' ')) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let (a, b) = (given.trim().as_bytes(), cfg.token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Method and path check, before the body is read.
pub fn route(method: &str, path: &str) -> Result<Ask, Outcome> {
    let path = path.split('?').next().unwrap_or(path);
    let (ask, wanted) = match path {
        INGEST_PATH => (Ask::Push, "POST"),
        LOAD_PATH => (Ask::Load, "GET"),
        _ => return Err(Outcome::NotFound),
    };
    if method.eq_ignore_ascii_case(wanted) {
        Ok(ask)
    } else {
        Err(Outcome::MethodNotAllowed)
    }
}

const MAX_CAS_TRIES: usize = 8;

fn header_of(bytes: &[u8]) -> Option<Stamp> {
    Stamp::decode(bytes.get(..16)?)
}

/// Longest collector id kept in the owner key (longer ids compare by this
/// prefix).
const MAX_OWNER_ID: usize = 256;

/// The owner key's value: when its last push was accepted, and its id.
struct Owner {
    at_ms: u64,
    id: Vec<u8>,
}

impl Owner {
    fn new(at_ms: u64, id: &str) -> Owner {
        let id = id.as_bytes();
        Owner {
            at_ms,
            id: id.iter().take(MAX_OWNER_ID).copied().collect(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + self.id.len());
        v.extend_from_slice(&self.at_ms.to_le_bytes());
        v.extend_from_slice(&self.id);
        v
    }

    fn decode(bytes: &[u8]) -> Option<Owner> {
        let at_ms = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
        Some(Owner {
            at_ms,
            id: bytes.get(8..)?.to_vec(),
        })
    }

    fn name(&self) -> String {
        String::from_utf8_lossy(&self.id).into_owned()
    }
}

/// Refuses a push from another collector than a recently active owner;
/// `Ok(Some(..))` names a silent owner the pusher takes over from.
fn check_owner(
    store: &dyn SharedData,
    key: &str,
    lease_ms: u64,
    pusher: &Owner,
    now_ms: u64,
) -> Result<Option<(String, u64)>, Outcome> {
    let Ok((current, _)) = store.get(key) else {
        return Err(Outcome::Unavailable);
    };
    let Some(owner) = current.as_deref().and_then(Owner::decode) else {
        return Ok(None);
    };
    if owner.id == pusher.id {
        return Ok(None);
    }
    let silent_ms = now_ms.saturating_sub(owner.at_ms);
    if silent_ms < lease_ms {
        return Err(Outcome::Conflict {
            owner: owner.name(),
            pushed: pusher.name(),
            silent_ms,
            lease_ms,
        });
    }
    Ok(Some((owner.name(), silent_ms)))
}

/// Records the pusher as the owner. A lost race is left to the next push.
fn claim_owner(store: &dyn SharedData, key: &str, pusher: &Owner) -> Result<(), Outcome> {
    let value = pusher.encode();
    for _ in 0..MAX_CAS_TRIES {
        let Ok((current, cas)) = store.get(key) else {
            return Err(Outcome::Unavailable);
        };
        if let Some(owner) = current.as_deref().and_then(Owner::decode) {
            if owner.at_ms > pusher.at_ms {
                return Ok(());
            }
        }
        match store.set(key, &value, cas) {
            Ok(()) => return Ok(()),
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Host) => return Err(Outcome::Unavailable),
        }
    }
    Ok(())
}

/// Validates and stores a pushed snapshot.
pub fn store(cfg: &Config, store: &dyn SharedData, body: &[u8], now_ms: u64) -> Outcome {
    // Without a clock (the host refused it) there is no lease to judge.
    let lease_ms = match now_ms {
        0 => 0,
        _ => cfg.ingest.as_ref().map_or(0, |i| i.owner_lease_ms),
    };
    if let Some(ing) = &cfg.ingest {
        if body.len() > ing.max_bytes {
            return Outcome::TooLarge {
                limit: ing.max_bytes,
            };
        }
    }
    let snap = match Snapshot::from_json(body) {
        Ok(s) => s,
        Err(e) => return Outcome::Invalid(e.to_string()),
    };
    let pusher = Owner::new(now_ms, &snap.collector);
    let mut took_over = None;
    if lease_ms > 0 {
        // An old or replayed push is stale whoever sent it.
        if let Ok((Some(v), _)) = store.get(&cfg.fleet.stamp_key) {
            if let Some(old) = Stamp::decode(&v).filter(|old| old.seq >= snap.seq) {
                return Outcome::Stale {
                    stored: old.seq,
                    pushed: snap.seq,
                };
            }
        }
        match check_owner(store, &cfg.fleet.owner_key, lease_ms, &pusher, now_ms) {
            Ok(t) => took_over = t,
            Err(o) => return o,
        }
    }
    let stamp = Stamp {
        seq: snap.seq,
        ingested_at_ms: now_ms,
    };
    let mut value = Vec::with_capacity(16 + body.len());
    value.extend_from_slice(&stamp.encode());
    value.extend_from_slice(body);
    let header = stamp.encode();
    let writes: [(&str, &[u8]); 2] = [
        (&cfg.fleet.snapshot_key, &value),
        (&cfg.fleet.stamp_key, &header),
    ];
    for (key, value) in writes {
        let is_snapshot = key == cfg.fleet.snapshot_key;
        let mut stored = false;
        for _ in 0..MAX_CAS_TRIES {
            let Ok((current, cas)) = store.get(key) else {
                return Outcome::Unavailable;
            };
            if let Some(old) = current.as_deref().and_then(header_of) {
                if old.seq >= snap.seq {
                    if is_snapshot {
                        return Outcome::Stale {
                            stored: old.seq,
                            pushed: snap.seq,
                        };
                    }
                    // A newer push finished first: the snapshot key already
                    // holds that one, and the stamp says so.
                    stored = true;
                    break;
                }
            }
            match store.set(key, value, cas) {
                Ok(()) => {
                    stored = true;
                    break;
                }
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Host) => return Outcome::Unavailable,
            }
        }
        if !stored {
            return Outcome::Unavailable;
        }
    }
    if lease_ms > 0 {
        if let Err(o) = claim_owner(store, &cfg.fleet.owner_key, &pusher) {
            return o;
        }
    }
    match took_over {
        Some((from, silent_ms)) => Outcome::TookOver {
            seq: snap.seq,
            from,
            silent_ms,
        },
        None => Outcome::Accepted { seq: snap.seq },
    }
}

/// A router VM's decoded snapshot, refreshed when the stamp moves.
#[derive(Default)]
pub struct FleetCache {
    view: Option<Rc<FleetView>>,
    /// Highest seq decoded or found undecodable, so a bad value is not
    /// decoded again on every request.
    seen: u64,
    /// The millisecond of the last look at the stamp by a request.
    checked_ms: u64,
}

/// What a refresh did, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    Unchanged,
    Decoded,
    Failed,
}

impl FleetCache {
    /// The snapshot in use, without looking for a newer one.
    pub fn current(&self) -> Option<Rc<FleetView>> {
        self.view.clone()
    }

    /// [`FleetCache::refresh`] for a request: at most one look at the stamp
    /// per millisecond (`now_ms`, 0 if the clock is unknown: always look).
    /// Requests in the same millisecond share the look, which saves a host
    /// call and a copy per request at high rates; a push is seen at most
    /// 1 ms later.
    pub fn refresh_at(
        &mut self,
        cfg: &Config,
        store: &dyn SharedData,
        now_ms: u64,
    ) -> (Option<Rc<FleetView>>, Refresh) {
        if now_ms != 0 && now_ms == self.checked_ms {
            return (self.view.clone(), Refresh::Unchanged);
        }
        self.checked_ms = now_ms;
        self.refresh(cfg, store)
    }

    /// The current view, reading shared data only when the stamp is newer
    /// than what this VM holds.
    pub fn refresh(
        &mut self,
        cfg: &Config,
        store: &dyn SharedData,
    ) -> (Option<Rc<FleetView>>, Refresh) {
        let stamp = match store.get(&cfg.fleet.stamp_key) {
            Ok((Some(v), _)) => Stamp::decode(&v),
            _ => None,
        };
        let mut outcome = Refresh::Unchanged;
        if stamp.is_some_and(|s| s.seq > self.seen) {
            outcome = Refresh::Failed;
            if let Ok((Some(v), _)) = store.get(&cfg.fleet.snapshot_key) {
                if let Some(h) = header_of(&v) {
                    // Even if this value fails to decode, do not retry it on
                    // every request: wait for the next push.
                    self.seen = self.seen.max(h.seq);
                    if let Ok(mut s) = Snapshot::from_json(v.get(16..).unwrap_or_default()) {
                        // The other gateways' placements, into the prefix
                        // index (another worker may have done it: then
                        // nothing is written).
                        // Only a router applies them, with its own index
                        // settings (the ingest listener also decodes
                        // snapshots, to name hosts in its load report).
                        let router = cfg.role == crate::config::Role::Router;
                        let index = Index::of(&cfg.fleet);
                        if router && cfg.fleet.key_memory && !s.placed.is_empty() {
                            placed::apply(store, &index, &s.placed, h.ingested_at_ms);
                        }
                        // And their requests' last blocks, likewise.
                        if router && cfg.fleet.share_last_blocks && !s.last_blocks.is_empty() {
                            placed::apply_last(store, &index, &s.last_blocks, h.ingested_at_ms);
                        }
                        s.placed = Vec::new();
                        s.last_blocks = Vec::new();
                        // Replicas the answers show prefilling slower.
                        if router && cfg.fleet.learn_prefill_rates {
                            let table = rates::read(store, &cfg.fleet.rates_key);
                            rates::apply(&mut s.hosts, &table, cfg.fleet.prefill_tokens_per_s);
                        }
                        self.view = Some(Rc::new(FleetView::new(s, h.ingested_at_ms)));
                        outcome = Refresh::Decoded;
                    }
                }
            }
        }
        (self.view.clone(), outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{HostState, SNAPSHOT_VERSION};
    use crate::host::MemorySharedData;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"role":"ingest","ingest":{"token":"0123456789abcdef","maxBytes":100000}}"#,
        )
        .unwrap()
    }

    fn snap(seq: u64, hosts: usize) -> Vec<u8> {
        snap_by("c", seq, hosts)
    }

    fn snap_by(collector: &str, seq: u64, hosts: usize) -> Vec<u8> {
        Snapshot {
            placed: Vec::new(),
            last_blocks: Vec::new(),
            version: SNAPSHOT_VERSION,
            seq,
            collector: collector.into(),
            taken_at_ms: 1000,
            hosts: (0..hosts)
                .map(|i| HostState {
                    address: format!("10.0.{}.{}:8000", i / 200, i % 200 + 1),
                    ready: true,
                    draining: false,
                    models: vec!["m".into()],
                    kv_utilization: 0.1,
                    waiting: 0,
                    running: 1,
                    kv_capacity_tokens: None,
                    block_size: None,
                    scraped_at_ms: 990,
                    engine: None,
                    peer_pending_tokens: None,
                    peer_arrivals_per_s: None,
                    prefill_tokens_per_s: None,
                })
                .collect(),
        }
        .to_json()
    }

    #[test]
    fn auth_and_routes() {
        let c = cfg();
        let ing = c.ingest.as_ref().unwrap();
        assert!(authorized(ing, Some("Bearer 0123456789abcdef")));
        assert!(!authorized(ing, Some("Bearer 0123456789abcdeX")));
        assert!(!authorized(ing, Some("Bearer 0123456789abcde")));
        assert!(!authorized(ing, Some("0123456789abcdef")));
        assert!(authorized(ing, Some("bearer 0123456789abcdef")));
        assert!(!authorized(ing, Some("Basic 0123456789abcdef")));
        assert!(!authorized(ing, None));
        assert_eq!(route("POST", INGEST_PATH), Ok(Ask::Push));
        assert_eq!(route("GET", INGEST_PATH), Err(Outcome::MethodNotAllowed));
        assert_eq!(route("GET", LOAD_PATH), Ok(Ask::Load));
        assert_eq!(route("get", &format!("{LOAD_PATH}?x=1")), Ok(Ask::Load));
        assert_eq!(route("POST", LOAD_PATH), Err(Outcome::MethodNotAllowed));
        assert!(wants_placed(&format!("{LOAD_PATH}?{LOAD_PLACED_QUERY}")));
        assert!(wants_placed(&format!("{LOAD_PATH}?x=1&placed=1")));
        assert!(!wants_placed(LOAD_PATH));
        assert!(!wants_placed(&format!("{LOAD_PATH}?placed=10")));
        let both = format!("{LOAD_PATH}?{LOAD_PLACED_QUERY}&{LOAD_LAST_BLOCKS_QUERY}");
        assert!(wants_last_blocks(&both) && wants_placed(&both));
        assert!(!wants_last_blocks(&format!(
            "{LOAD_PATH}?{LOAD_PLACED_QUERY}"
        )));
        assert!(!wants_last_blocks(&format!("{LOAD_PATH}?lastBlocks=0")));
        assert_eq!(
            route("POST", "/v1/chat/completions"),
            Err(Outcome::NotFound)
        );
    }

    #[test]
    fn newer_replaces_older_never() {
        let c = cfg();
        let s = MemorySharedData::default();
        assert_eq!(
            store(&c, &s, &snap(5, 2), 100),
            Outcome::Accepted { seq: 5 }
        );
        assert_eq!(
            store(&c, &s, &snap(5, 3), 101),
            Outcome::Stale {
                stored: 5,
                pushed: 5
            }
        );
        assert_eq!(
            store(&c, &s, &snap(4, 3), 102),
            Outcome::Stale {
                stored: 5,
                pushed: 4
            }
        );
        assert!(matches!(store(&c, &s, b"{nope", 103), Outcome::Invalid(_)));
        assert!(matches!(
            store(&c, &s, &[b' '; 100_001], 103),
            Outcome::TooLarge { .. }
        ));
        let mut cache = FleetCache::default();
        let (v, r) = cache.refresh(&c, &s);
        assert_eq!(r, Refresh::Decoded);
        let v = v.unwrap();
        assert_eq!((v.seq, v.hosts.len(), v.ingested_at_ms), (5, 2, 100));
        // Unchanged stamp: nothing decoded again.
        assert_eq!(cache.refresh(&c, &s).1, Refresh::Unchanged);
        assert_eq!(
            store(&c, &s, &snap(6, 4), 200),
            Outcome::Accepted { seq: 6 }
        );
        let (v, r) = cache.refresh(&c, &s);
        assert_eq!((r, v.unwrap().hosts.len()), (Refresh::Decoded, 4));
    }

    fn hosts_in_view(s: &MemorySharedData, c: &Config) -> usize {
        FleetCache::default().refresh(c, s).0.unwrap().hosts.len()
    }

    #[test]
    fn a_second_collector_is_refused_until_the_owner_falls_silent() {
        let c = cfg();
        assert_eq!(c.ingest.as_ref().unwrap().owner_lease_ms, 2000);
        let s = MemorySharedData::default();
        assert_eq!(
            store(&c, &s, &snap_by("a", 10, 4), 1000),
            Outcome::Accepted { seq: 10 }
        );
        // b pushes newer seqs with another view: refused while a pushes.
        let o = store(&c, &s, &snap_by("b", 11, 2), 1500);
        assert_eq!(
            o,
            Outcome::Conflict {
                owner: "a".into(),
                pushed: "b".into(),
                silent_ms: 500,
                lease_ms: 2000
            }
        );
        assert_eq!(o.status(), 409);
        assert_eq!(o.counter(), Some(Counter::IngestConflict));
        assert!(o.body().unwrap().contains("owns this gateway's snapshot"));
        assert_eq!(
            store(&c, &s, &snap_by("a", 12, 4), 2500),
            Outcome::Accepted { seq: 12 }
        );
        assert_eq!(hosts_in_view(&s, &c), 4);
        // 1999 ms after a's last push: still a's.
        assert!(matches!(
            store(&c, &s, &snap_by("b", 13, 2), 4499),
            Outcome::Conflict {
                silent_ms: 1999,
                ..
            }
        ));
        assert_eq!(hosts_in_view(&s, &c), 4);
        // a silent for the lease: b takes over, and a is now the other one.
        let o = store(&c, &s, &snap_by("b", 14, 2), 4500);
        assert_eq!(
            o,
            Outcome::TookOver {
                seq: 14,
                from: "a".into(),
                silent_ms: 2000
            }
        );
        assert_eq!(
            (o.status(), o.counter()),
            (204, Some(Counter::IngestAccepted))
        );
        assert_eq!(hosts_in_view(&s, &c), 2);
        assert!(matches!(
            store(&c, &s, &snap_by("a", 15, 4), 4600),
            Outcome::Conflict { .. }
        ));
        assert_eq!(
            store(&c, &s, &snap_by("b", 16, 2), 4700),
            Outcome::Accepted { seq: 16 }
        );
    }

    #[test]
    fn a_lease_of_zero_keeps_the_newest_push_from_anyone() {
        let c = Config::from_json(
            br#"{"role":"ingest","ingest":{"token":"0123456789abcdef","ownerLeaseMs":0}}"#,
        )
        .unwrap();
        let s = MemorySharedData::default();
        assert_eq!(
            store(&c, &s, &snap_by("a", 1, 4), 10),
            Outcome::Accepted { seq: 1 }
        );
        assert_eq!(
            store(&c, &s, &snap_by("b", 2, 2), 11),
            Outcome::Accepted { seq: 2 }
        );
        assert_eq!(hosts_in_view(&s, &c), 2);
        let e = Config::from_json(
            br#"{"role":"ingest","ingest":{"token":"0123456789abcdef","ownerLeaseMs":3600001}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "ingest.ownerLeaseMs");
    }

    #[test]
    fn a_refused_conflicting_push_does_not_renew_the_lease_nor_move_seq() {
        let c = cfg();
        let s = MemorySharedData::default();
        store(&c, &s, &snap_by("a", 5, 3), 1);
        // An old seq from another collector is stale first.
        assert!(matches!(
            store(&c, &s, &snap_by("b", 4, 1), 2),
            Outcome::Stale {
                stored: 5,
                pushed: 4
            }
        ));
        // b keeps pushing during a's lease; none of it counts as a's or b's.
        for t in (100..2001).step_by(250) {
            assert!(matches!(
                store(&c, &s, &snap_by("b", 100 + t, 1), t),
                Outcome::Conflict { .. }
            ));
        }
        let (v, _) = FleetCache::default().refresh(&c, &s);
        assert_eq!(v.unwrap().seq, 5);
        assert!(matches!(
            store(&c, &s, &snap_by("b", 3000, 1), 2001),
            Outcome::TookOver { .. }
        ));
    }

    #[test]
    fn error_bodies_say_what_is_wrong() {
        let c = cfg();
        let s = MemorySharedData::default();
        let o = store(
            &c,
            &s,
            br#"{"version":1,"seq":0,"collector":"c","takenAtMs":1,"hosts":[]}"#,
            1,
        );
        assert_eq!(o.status(), 400);
        assert!(
            o.body().unwrap().contains("seq: must be at least 1"),
            "{:?}",
            o.body()
        );
        assert_eq!(
            Outcome::Stale {
                stored: 2,
                pushed: 1
            }
            .status(),
            409
        );
        assert!(Outcome::Accepted { seq: 1 }.body().is_none());
    }

    #[test]
    fn no_snapshot_means_no_view() {
        let c = cfg();
        let s = MemorySharedData::default();
        assert_eq!(
            FleetCache::default().refresh(&c, &s),
            (None, Refresh::Unchanged)
        );
    }

    #[test]
    fn lost_race_keeps_the_newer_snapshot() {
        let c = cfg();
        let s = MemorySharedData::default();
        assert_eq!(store(&c, &s, &snap(7, 1), 1), Outcome::Accepted { seq: 7 });
        // A conflicting writer makes our first CAS fail; the retry sees 7 >= 6.
        s.conflicts.set(1);
        assert_eq!(
            store(&c, &s, &snap(6, 1), 2),
            Outcome::Stale {
                stored: 7,
                pushed: 6
            }
        );
        let (v, _) = FleetCache::default().refresh(&c, &s);
        assert_eq!(v.unwrap().seq, 7);
    }

    #[test]
    fn requests_look_at_the_stamp_once_per_millisecond() {
        let c = cfg();
        let s = MemorySharedData::default();
        let mut cache = FleetCache::default();
        assert_eq!(store(&c, &s, &snap(1, 2), 1), Outcome::Accepted { seq: 1 });
        let seq = |r: (Option<Rc<FleetView>>, Refresh)| (r.0.map(|v| v.seq), r.1);
        assert_eq!(
            seq(cache.refresh_at(&c, &s, 50)),
            (Some(1), Refresh::Decoded)
        );
        assert_eq!(store(&c, &s, &snap(2, 3), 2), Outcome::Accepted { seq: 2 });
        // Same millisecond: the look is shared, the push not seen yet.
        assert_eq!(
            seq(cache.refresh_at(&c, &s, 50)),
            (Some(1), Refresh::Unchanged)
        );
        // The next millisecond looks again.
        assert_eq!(
            seq(cache.refresh_at(&c, &s, 51)),
            (Some(2), Refresh::Decoded)
        );
        // An unknown clock always looks.
        assert_eq!(store(&c, &s, &snap(3, 1), 3), Outcome::Accepted { seq: 3 });
        assert_eq!(
            seq(cache.refresh_at(&c, &s, 0)),
            (Some(3), Refresh::Decoded)
        );
        assert_eq!(store(&c, &s, &snap(4, 1), 4), Outcome::Accepted { seq: 4 });
        assert_eq!(
            seq(cache.refresh_at(&c, &s, 0)),
            (Some(4), Refresh::Decoded)
        );
        // The tick's refresh always looks.
        assert_eq!(store(&c, &s, &snap(5, 1), 5), Outcome::Accepted { seq: 5 });
        cache.checked_ms = 60;
        assert_eq!(seq(cache.refresh(&c, &s)), (Some(5), Refresh::Decoded));
    }
}

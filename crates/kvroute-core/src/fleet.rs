//! The fleet snapshot: what the collector reports about every replica.
//!
//! One versioned type, shared by the collector (which builds and pushes it)
//! and the filter (whose ingest role validates it and stores it in shared
//! data, and whose router role decodes it once per stored version).
//!
//! Wire format: JSON (serde, camelCase, unknown fields rejected), e.g.
//!
//! ```json
//! {"version": 1, "seq": 42, "collector": "collector-a", "takenAtMs": 1764400000000,
//!  "hosts": [{"address": "10.0.0.11:8000", "ready": true, "draining": false,
//!             "models": ["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"],
//!             "kvUtilization": 0.42, "waiting": 3, "running": 17,
//!             "kvCapacityTokens": 456000, "blockSize": 16,
//!             "scrapedAtMs": 1764399999900, "engine": "vllm"}]}
//! ```
//!
//! A snapshot may carry `placed`: the other gateways' recent placements
//! `[{"key": "00c0ffee00c0ffee", "address": "10.0.0.11:8000",
//! "ageMs": 120}]`, which a gateway with key memory writes into its prefix
//! index ([`crate::placed`]). Absent, there are none. It may carry
//! `lastBlocks`: the other gateways' recent requests' last blocks
//! `[{"block": "5e1f00c0ffee0001", "blocks": 12, "address":
//! "10.0.0.11:8000", "ageMs": 80}]`, which a gateway that shares them
//! (`fleet.shareLastBlocks`) writes into its prefix index
//! ([`crate::placed::apply_last`]).
//!
//! A host may also carry `peerPendingTokens`: the prefill the other
//! gateways had sent it without a first byte yet, as a collector that reads
//! their load tables saw it (the filter drains it at `prefillTokensPerS`
//! from then; `decide.rs`). Absent, it is unknown.
//!
//! A host may carry `prefillTokensPerS`: the prompt tokens it prefills per
//! second. The filter's cost divides the prefill ahead of a request, and
//! its own, by it (`decide.rs`); absent, by the configured
//! `fleet.prefillTokensPerS`. A fleet of two GPU generations is where it
//! matters (docs/fleet-state.md, "A fleet of two GPU generations"). No
//! engine exports its rate and kvroute-collector does not fill it yet; the
//! filter learns which replicas are slower from their answers
//! ([`crate::rates`]) and prices them so where the snapshot gives no rate.
//! The fleet simulation's `kvroute-known-rates` measures what the true
//! rates are worth.
//!
//! `seq` increases monotonically per collector; the ingest endpoint refuses
//! a snapshot older than the stored one. Times are the collector's clock in
//! Unix milliseconds; the filter only ever compares them with each other
//! (`takenAtMs - scrapedAtMs` is a host's age at push time) and measures the
//! rest with its own clock from the moment of ingest, so gateway and
//! collector clocks need not agree.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::picker::HostSet;
use crate::placed::{self, LastBlock, Placement};

/// The snapshot schema version this build reads and writes.
pub const SNAPSHOT_VERSION: u32 = 1;
/// Bounds that keep a snapshot's decoded size bounded whatever is pushed.
pub const MAX_HOSTS: usize = 4096;
pub const MAX_MODELS_PER_HOST: usize = 64;
pub const MAX_NAME_LEN: usize = 256;
/// Bound on a host's `peerArrivalsPerS`: far above any replica's request
/// rate, so that a value past it is a collector's error.
pub const MAX_ARRIVALS_PER_S: f64 = 1_000_000.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Snapshot {
    /// Schema version, [`SNAPSHOT_VERSION`].
    pub version: u32,
    /// Monotonically increasing sequence number (per collector).
    pub seq: u64,
    /// The collector's identity (for logs and conflict diagnosis).
    pub collector: String,
    /// When the snapshot was assembled, collector clock, Unix ms.
    pub taken_at_ms: u64,
    pub hosts: Vec<HostState>,
    /// The other gateways' recent placements, for key memory
    /// ([`crate::placed`]); at most [`placed::MAX_SNAPSHOT`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placed: Vec<Placement>,
    /// The other gateways' recent requests' last blocks
    /// ([`crate::placed::note_last`]); at most
    /// [`placed::MAX_SNAPSHOT_LAST`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_blocks: Vec<LastBlock>,
}

/// One replica as last scraped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostState {
    /// `ip:port`, as in the destination header.
    pub address: String,
    /// Answers `/health` with 200 (weights loaded).
    pub ready: bool,
    /// Being taken out of service: no new work.
    #[serde(default)]
    pub draining: bool,
    /// Served model names, LoRA adapters included. Empty: unknown (any model).
    #[serde(default)]
    pub models: Vec<String>,
    /// KV-cache utilisation, 0..1.
    #[serde(default)]
    pub kv_utilization: f64,
    /// Requests waiting to be scheduled.
    #[serde(default)]
    pub waiting: u32,
    /// Requests running (in the batch).
    #[serde(default)]
    pub running: u32,
    /// KV capacity in tokens, when the engine reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<u64>,
    /// KV block size in tokens, when the engine reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Last successful scrape, collector clock, Unix ms.
    pub scraped_at_ms: u64,
    /// `vllm`, `sglang`, `trtllm`, ... (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// Prefill tokens the other gateways had sent this replica and not yet
    /// seen a first byte for, as the collector read their load tables at
    /// `scrapedAtMs`. Absent: unknown (one gateway, or a collector that
    /// does not read its peers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_pending_tokens: Option<u64>,
    /// Requests per second the other gateways sent this replica lately
    /// (their load reports' `arrivalsPerS`, summed), as the collector
    /// read them. Absent: unknown, as for `peerPendingTokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_arrivals_per_s: Option<f64>,
    /// Prompt tokens the replica prefills per second, when known. Absent:
    /// the filter's `fleet.prefillTokensPerS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_s: Option<f64>,
}

/// What is wrong with a snapshot: a JSON path and a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for SnapshotError {}

fn bad(field: impl Into<String>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError {
        field: field.into(),
        reason: reason.into(),
    }
}

impl Snapshot {
    /// Decodes and validates. The JSON is decoded directly first; only a
    /// value that fails is decoded again with its path tracked, to name the
    /// field in the error (the tracking doubled the decode time of a valid
    /// snapshot: criterion, `snapshot_decode`).
    pub fn from_json(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let snap = match serde_json::from_slice::<Snapshot>(bytes) {
            Ok(snap) => snap,
            Err(_) => Self::decode_error(bytes)?,
        };
        snap.validate()?;
        Ok(snap)
    }

    /// Decodes `bytes` with the path of the failing field tracked: the
    /// error for a value the plain decode refused.
    fn decode_error(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let snap: Snapshot = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." || path == "?" {
                "snapshot".to_owned()
            } else {
                path
            };
            bad(field, e.inner().to_string())
        })?;
        de.end().map_err(|e| bad("snapshot", e.to_string()))?;
        Ok(snap)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Checks every bound and invariant the router relies on.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.version != SNAPSHOT_VERSION {
            return Err(bad(
                "version",
                format!(
                    "{} is not supported (this build reads {SNAPSHOT_VERSION})",
                    self.version
                ),
            ));
        }
        if self.seq == 0 {
            return Err(bad("seq", "must be at least 1"));
        }
        if self.collector.is_empty() || self.collector.len() > MAX_NAME_LEN {
            return Err(bad(
                "collector",
                format!("must be 1 to {MAX_NAME_LEN} bytes"),
            ));
        }
        if self.hosts.len() > MAX_HOSTS {
            return Err(bad(
                "hosts",
                format!("{} hosts, at most {MAX_HOSTS}", self.hosts.len()),
            ));
        }
        if self.placed.len() > placed::MAX_SNAPSHOT {
            return Err(bad(
                "placed",
                format!(
                    "{} placements, at most {}",
                    self.placed.len(),
                    placed::MAX_SNAPSHOT
                ),
            ));
        }
        for (i, p) in self.placed.iter().enumerate() {
            if p.key_value().is_none() {
                return Err(bad(format!("placed[{i}].key"), "must be 16 hex digits"));
            }
            if p.address.parse::<SocketAddr>().is_err() {
                return Err(bad(
                    format!("placed[{i}].address"),
                    format!("{:?} is not ip:port", p.address),
                ));
            }
        }
        if self.last_blocks.len() > placed::MAX_SNAPSHOT_LAST {
            return Err(bad(
                "lastBlocks",
                format!(
                    "{} last blocks, at most {}",
                    self.last_blocks.len(),
                    placed::MAX_SNAPSHOT_LAST
                ),
            ));
        }
        for (i, b) in self.last_blocks.iter().enumerate() {
            if b.block_value().is_none() {
                return Err(bad(
                    format!("lastBlocks[{i}].block"),
                    "must be 16 hex digits",
                ));
            }
            if b.blocks == 0 {
                return Err(bad(format!("lastBlocks[{i}].blocks"), "must be at least 1"));
            }
            if b.address.parse::<SocketAddr>().is_err() {
                return Err(bad(
                    format!("lastBlocks[{i}].address"),
                    format!("{:?} is not ip:port", b.address),
                ));
            }
        }
        let mut seen = HashSet::new();
        for (i, h) in self.hosts.iter().enumerate() {
            let at = |f: &str| format!("hosts[{i}].{f}");
            let addr: SocketAddr = h
                .address
                .parse()
                .map_err(|_| bad(at("address"), format!("{:?} is not ip:port", h.address)))?;
            if addr.port() == 0 {
                return Err(bad(at("address"), "port 0 is not routable"));
            }
            if !seen.insert(addr) {
                return Err(bad(at("address"), format!("{} is listed twice", h.address)));
            }
            if !(h.kv_utilization.is_finite() && (0.0..=1.0).contains(&h.kv_utilization)) {
                return Err(bad(at("kvUtilization"), "must be a number from 0 to 1"));
            }
            if h.peer_arrivals_per_s
                .is_some_and(|r| !(r.is_finite() && (0.0..=MAX_ARRIVALS_PER_S).contains(&r)))
            {
                return Err(bad(
                    at("peerArrivalsPerS"),
                    format!("must be a number from 0 to {MAX_ARRIVALS_PER_S}"),
                ));
            }
            if h.prefill_tokens_per_s
                .is_some_and(|r| !(r.is_finite() && (1.0..=1e9).contains(&r)))
            {
                return Err(bad(
                    at("prefillTokensPerS"),
                    "must be a number from 1 to 1e9",
                ));
            }
            if h.models.len() > MAX_MODELS_PER_HOST {
                return Err(bad(
                    at("models"),
                    format!("at most {MAX_MODELS_PER_HOST} models"),
                ));
            }
            if let Some(k) = h
                .models
                .iter()
                .position(|m| m.is_empty() || m.len() > MAX_NAME_LEN)
            {
                return Err(bad(
                    format!("hosts[{i}].models[{k}]"),
                    format!("must be 1 to {MAX_NAME_LEN} bytes"),
                ));
            }
            if h.scraped_at_ms > self.taken_at_ms {
                return Err(bad(at("scrapedAtMs"), "is later than takenAtMs"));
            }
            if h.block_size == Some(0) {
                return Err(bad(at("blockSize"), "must be at least 1"));
            }
            if h.engine.as_ref().is_some_and(|e| e.len() > MAX_NAME_LEN) {
                return Err(bad(at("engine"), format!("at most {MAX_NAME_LEN} bytes")));
            }
        }
        Ok(())
    }
}

impl HostState {
    /// Serves `model`; a host that reports no models is assumed to serve any.
    pub fn serves(&self, model: &str) -> bool {
        model.is_empty() || self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

/// The version stamp stored next to the snapshot: its `seq` and when the
/// gateway accepted it (gateway clock). Readers compare stamps (16 bytes)
/// on every request and decode the snapshot only when the stamp changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stamp {
    pub seq: u64,
    pub ingested_at_ms: u64,
}

impl Stamp {
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let (a, b) = out.split_at_mut(8);
        a.copy_from_slice(&self.seq.to_le_bytes());
        b.copy_from_slice(&self.ingested_at_ms.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Stamp> {
        let seq = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
        let ingested_at_ms = u64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
        (bytes.len() == 16).then_some(Stamp {
            seq,
            ingested_at_ms,
        })
    }
}

/// A snapshot as the router uses it: hosts with ids and ages.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetView {
    pub seq: u64,
    pub ingested_at_ms: u64,
    pub hosts: Vec<FleetHost>,
    pub set: HostSet,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FleetHost {
    pub state: HostState,
    /// How old the host's data was when the snapshot was taken.
    pub age_at_push_ms: u64,
}

impl FleetView {
    pub fn new(snapshot: Snapshot, ingested_at_ms: u64) -> FleetView {
        let taken = snapshot.taken_at_ms;
        let set = HostSet::new(snapshot.hosts.iter().map(|h| h.address.clone()));
        let hosts = snapshot
            .hosts
            .into_iter()
            .map(|state| FleetHost {
                age_at_push_ms: taken.saturating_sub(state.scraped_at_ms),
                state,
            })
            .collect();
        FleetView {
            seq: snapshot.seq,
            ingested_at_ms,
            hosts,
            set,
        }
    }

    /// Age of the snapshot itself, by the gateway's clock.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.ingested_at_ms)
    }
}

impl FleetHost {
    /// Age of this host's data now: its age at push plus the time since
    /// ingest (both measured on one clock each, never across clocks).
    pub fn age_ms(&self, view_age_ms: u64) -> u64 {
        self.age_at_push_ms.saturating_add(view_age_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(addr: &str) -> HostState {
        HostState {
            address: addr.into(),
            ready: true,
            draining: false,
            models: vec!["m".into()],
            kv_utilization: 0.5,
            waiting: 1,
            running: 2,
            kv_capacity_tokens: Some(1000),
            block_size: Some(16),
            scraped_at_ms: 90,
            engine: Some("vllm".into()),
            peer_pending_tokens: None,
            peer_arrivals_per_s: None,
            prefill_tokens_per_s: None,
        }
    }

    fn snap(hosts: Vec<HostState>) -> Snapshot {
        Snapshot {
            placed: Vec::new(),
            last_blocks: Vec::new(),
            version: 1,
            seq: 7,
            collector: "c".into(),
            taken_at_ms: 100,
            hosts,
        }
    }

    #[test]
    fn round_trip() {
        let s = snap(vec![host("10.0.0.1:80"), host("[::1]:8000")]);
        assert_eq!(Snapshot::from_json(&s.to_json()), Ok(s.clone()));
        // Without placements the field is left out, as an older filter
        // expects; with them it round-trips.
        assert!(!String::from_utf8(s.to_json()).unwrap().contains("placed"));
        let with = Snapshot {
            placed: vec![Placement {
                key: "00c0ffee00c0ffee".into(),
                address: "[::1]:8000".into(),
                age_ms: 120,
            }],
            ..s
        };
        assert_eq!(Snapshot::from_json(&with.to_json()), Ok(with.clone()));
        // Last blocks likewise: absent when none, else they round-trip.
        assert!(!String::from_utf8(with.to_json())
            .unwrap()
            .contains("lastBlocks"));
        let last = Snapshot {
            last_blocks: vec![last_block("5e1f00c0ffee0001", 12, "[::1]:8000")],
            ..with
        };
        assert_eq!(Snapshot::from_json(&last.to_json()), Ok(last.clone()));
        // A replica's prefill rate: absent when unknown, else it round-trips.
        assert!(!String::from_utf8(last.to_json())
            .unwrap()
            .contains("prefillTokensPerS"));
        let mut rated = last;
        rated.hosts[0].prefill_tokens_per_s = Some(9_274.5);
        let json = String::from_utf8(rated.to_json()).unwrap();
        assert!(json.contains(r#""prefillTokensPerS":9274.5"#), "{json}");
        assert_eq!(Snapshot::from_json(json.as_bytes()), Ok(rated));
    }

    fn last_block(block: &str, blocks: u32, address: &str) -> LastBlock {
        LastBlock {
            block: block.into(),
            blocks,
            address: address.into(),
            age_ms: 80,
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Snapshot, &str)> = vec![
            (
                Snapshot {
                    version: 2,
                    ..snap(vec![])
                },
                "version",
            ),
            (
                Snapshot {
                    seq: 0,
                    ..snap(vec![])
                },
                "seq",
            ),
            (
                Snapshot {
                    collector: String::new(),
                    ..snap(vec![])
                },
                "collector",
            ),
            (
                Snapshot {
                    placed: vec![Placement {
                        key: "not hex".into(),
                        address: "10.0.0.1:80".into(),
                        age_ms: 0,
                    }],
                    ..snap(vec![])
                },
                "placed[0].key",
            ),
            (
                Snapshot {
                    placed: vec![Placement {
                        key: "00000000000000ff".into(),
                        address: "somewhere".into(),
                        age_ms: 0,
                    }],
                    ..snap(vec![])
                },
                "placed[0].address",
            ),
            (
                Snapshot {
                    last_blocks: vec![last_block("5e1f", 12, "10.0.0.1:80")],
                    ..snap(vec![])
                },
                "lastBlocks[0].block",
            ),
            (
                Snapshot {
                    last_blocks: vec![last_block("5e1f00c0ffee0001", 0, "10.0.0.1:80")],
                    ..snap(vec![])
                },
                "lastBlocks[0].blocks",
            ),
            (
                Snapshot {
                    last_blocks: vec![last_block("5e1f00c0ffee0001", 3, "nowhere")],
                    ..snap(vec![])
                },
                "lastBlocks[0].address",
            ),
            (
                Snapshot {
                    last_blocks: (0..=placed::MAX_SNAPSHOT_LAST)
                        .map(|k| last_block(&format!("{k:016x}"), 3, "10.0.0.1:80"))
                        .collect(),
                    ..snap(vec![])
                },
                "lastBlocks",
            ),
            (
                Snapshot {
                    placed: (0..=placed::MAX_SNAPSHOT)
                        .map(|k| Placement {
                            key: format!("{k:016x}"),
                            address: "10.0.0.1:80".into(),
                            age_ms: 0,
                        })
                        .collect(),
                    ..snap(vec![])
                },
                "placed",
            ),
            (
                snap(vec![HostState {
                    address: "x".into(),
                    ..host("")
                }]),
                "hosts[0].address",
            ),
            (
                snap(vec![host("10.0.0.1:80"), host("10.0.0.1:80")]),
                "hosts[1].address",
            ),
            (
                snap(vec![HostState {
                    kv_utilization: 1.5,
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].kvUtilization",
            ),
            (
                snap(vec![HostState {
                    kv_utilization: f64::NAN,
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].kvUtilization",
            ),
            (
                snap(vec![HostState {
                    peer_arrivals_per_s: Some(-1.0),
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].peerArrivalsPerS",
            ),
            (
                snap(vec![HostState {
                    prefill_tokens_per_s: Some(0.0),
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].prefillTokensPerS",
            ),
            (
                snap(vec![HostState {
                    prefill_tokens_per_s: Some(f64::INFINITY),
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].prefillTokensPerS",
            ),
            (
                snap(vec![HostState {
                    models: vec![String::new()],
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].models[0]",
            ),
            (
                snap(vec![HostState {
                    scraped_at_ms: 101,
                    ..host("10.0.0.1:80")
                }]),
                "hosts[0].scrapedAtMs",
            ),
        ];
        for (s, field) in cases {
            assert_eq!(s.validate().unwrap_err().field, field, "{s:?}");
        }
        let e = Snapshot::from_json(br#"{"version":1,"seq":"x"}"#).unwrap_err();
        assert_eq!(e.field, "seq");
        let e = Snapshot::from_json(
            br#"{"version":1,"seq":1,"collector":"c","takenAtMs":1,"hosts":[],"extra":1}"#,
        )
        .unwrap_err();
        assert!(e.reason.contains("unknown field `extra`"), "{e}");
        let e = Snapshot::from_json(br#"{"version":1,"seq":1,"collector":"c","takenAtMs":1,"hosts":[{"address":"10.0.0.1:1","ready":true,"scrapedAtMs":1,"waiting":-1}]}"#).unwrap_err();
        assert_eq!(e.field, "hosts[0].waiting");
        assert!(Snapshot::from_json(b"garbage").is_err());
        // Trailing bytes after a valid snapshot are refused as well.
        let valid = snap(vec![host("10.0.0.1:80")]).to_json();
        assert!(Snapshot::from_json(&valid).is_ok());
        let e = Snapshot::from_json(&[valid.as_slice(), b" x"].concat()).unwrap_err();
        assert_eq!(e.field, "snapshot", "{e}");
    }

    #[test]
    fn stamp_round_trip_and_ages() {
        let st = Stamp {
            seq: 9,
            ingested_at_ms: 1234,
        };
        assert_eq!(Stamp::decode(&st.encode()), Some(st));
        assert_eq!(Stamp::decode(b"short"), None);
        let v = FleetView::new(snap(vec![host("10.0.0.1:80")]), 1000);
        assert_eq!(v.age_ms(1500), 500);
        assert_eq!(v.hosts[0].age_ms(v.age_ms(1500)), 510);
        assert_eq!(
            v.set.index_of(crate::picker::host_id("10.0.0.1:80")),
            Some(0)
        );
    }

    #[test]
    fn serves_models() {
        let h = host("10.0.0.1:80");
        assert!(h.serves("m"));
        assert!(!h.serves("other"));
        assert!(HostState {
            models: vec![],
            ..host("10.0.0.1:80")
        }
        .serves("other"));
    }
}

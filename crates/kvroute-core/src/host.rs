//! The host, behind narrow traits: shared data with compare-and-swap, and
//! metrics. The filter implements them over `proxy_wasm::hostcalls`; the test
//! doubles here let the core be tested natively.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// The host refused a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since it was read.
    CasMismatch,
    Host,
}

/// Process-wide key-value store with versions (proxy-wasm shared data).
pub trait SharedData {
    /// The value and its version, `(None, None)` when the key is missing.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError>;
    /// Writes `value` if the stored version still equals `cas` (`None`: always).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}

/// In-memory shared data with proxy-wasm's CAS semantics.
#[derive(Default)]
pub struct MemorySharedData {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// Makes the next N compare-and-swaps fail, as if another worker had
    /// written first.
    pub conflicts: Cell<usize>,
}

impl MemorySharedData {
    /// Number of keys stored.
    pub fn len(&self) -> usize {
        self.map.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.borrow().is_empty()
    }
}

impl SharedData for MemorySharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        Ok(match self.map.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut map = self.map.borrow_mut();
        let current = map.get(key).map(|(_, c)| *c);
        if let Some(expected) = cas {
            let pending = self.conflicts.get();
            if pending > 0 {
                self.conflicts.set(pending - 1);
                return Err(SetError::CasMismatch);
            }
            if current != Some(expected) {
                return Err(SetError::CasMismatch);
            }
        }
        let next = current.unwrap_or(0).wrapping_add(1).max(1);
        map.insert(key.to_owned(), (value.to_vec(), next));
        Ok(())
    }
}

/// A header value as the filter reads it: text, or absent.
///
/// Header values are bytes on the wire (RFC 9110 keeps obs-text, 0x80-0xFF,
/// and Envoy passes such bytes through), so any client can send a value that
/// is not UTF-8. kvroute only reads headers it compares as text (session ids,
/// the ingest token, `:status`, `content-type`), and none of them means
/// anything when it is not text, so such a value reads as absent. (The
/// proxy-wasm SDK's own `get_map_value` unwraps this conversion: one such
/// header trapped the VM. The filter reads bytes and decodes them here.)
pub fn header_text(raw: Option<Vec<u8>>) -> Option<String> {
    raw.and_then(|bytes| String::from_utf8(bytes).ok())
}

/// Counters the filter keeps, each a `kvroute_*` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    DecisionSession,
    DecisionPrefix,
    DecisionSpill,
    DecisionFallback,
    DecisionNoHosts,
    UnparsedNotInference,
    UnparsedEmpty,
    UnparsedInvalid,
    UnparsedTooDeep,
    UnparsedTooLarge,
    BodyBytes,
    LoadUpdateFailed,
    DecisionDegraded,
    IngestAccepted,
    IngestUnauthorized,
    IngestTooLarge,
    IngestInvalid,
    IngestStale,
    IngestConflict,
    SnapshotDecodeFailed,
    /// Answers whose cached tokens were compared with the index's
    /// expectation ([`crate::answers`]).
    PrefixAnswers,
    /// ... of which the engine's cached tokens fell short of it.
    PrefixShortfalls,
    /// Prefix-index entries removed after a shortfall.
    PrefixEntriesDropped,
    /// Placements written to the gateway's ring for the other gateways
    /// ([`crate::placed`]).
    PlacementsNoted,
    /// Placements the other gateways can no longer learn of: pushed out of
    /// the ring before any load report carried them, or never written
    /// (counted once a collector reads the ring).
    PlacementsLost,
    /// Requests' last blocks written to the gateway's ring for the other
    /// gateways ([`crate::placed::note_last`]).
    LastBlocksNoted,
    /// Last blocks the other gateways can no longer learn of (as
    /// `PlacementsLost`).
    LastBlocksLost,
    /// Answers that were a sample of their replica's prefill rate
    /// ([`crate::rates`]).
    PrefillRateSamples,
}

impl Counter {
    pub const ALL: [Counter; 28] = [
        Counter::DecisionSession,
        Counter::DecisionPrefix,
        Counter::DecisionSpill,
        Counter::DecisionFallback,
        Counter::DecisionNoHosts,
        Counter::UnparsedNotInference,
        Counter::UnparsedEmpty,
        Counter::UnparsedInvalid,
        Counter::UnparsedTooDeep,
        Counter::UnparsedTooLarge,
        Counter::BodyBytes,
        Counter::LoadUpdateFailed,
        Counter::DecisionDegraded,
        Counter::IngestAccepted,
        Counter::IngestUnauthorized,
        Counter::IngestTooLarge,
        Counter::IngestInvalid,
        Counter::IngestStale,
        Counter::IngestConflict,
        Counter::SnapshotDecodeFailed,
        Counter::PrefixAnswers,
        Counter::PrefixShortfalls,
        Counter::PrefixEntriesDropped,
        Counter::PlacementsNoted,
        Counter::PlacementsLost,
        Counter::LastBlocksNoted,
        Counter::LastBlocksLost,
        Counter::PrefillRateSamples,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Counter::DecisionSession => "kvroute_decisions_session_total",
            Counter::DecisionPrefix => "kvroute_decisions_prefix_total",
            Counter::DecisionSpill => "kvroute_decisions_spill_total",
            Counter::DecisionFallback => "kvroute_decisions_fallback_total",
            Counter::DecisionNoHosts => "kvroute_decisions_no_hosts_total",
            Counter::UnparsedNotInference => "kvroute_unparsed_not_inference_total",
            Counter::UnparsedEmpty => "kvroute_unparsed_empty_body_total",
            Counter::UnparsedInvalid => "kvroute_unparsed_invalid_total",
            Counter::UnparsedTooDeep => "kvroute_unparsed_too_deep_total",
            Counter::UnparsedTooLarge => "kvroute_unparsed_too_large_total",
            Counter::BodyBytes => "kvroute_body_bytes_total",
            Counter::LoadUpdateFailed => "kvroute_load_update_failures_total",
            Counter::DecisionDegraded => "kvroute_decisions_degraded_total",
            Counter::IngestAccepted => "kvroute_ingest_accepted_total",
            Counter::IngestUnauthorized => "kvroute_ingest_unauthorized_total",
            Counter::IngestTooLarge => "kvroute_ingest_too_large_total",
            Counter::IngestInvalid => "kvroute_ingest_invalid_total",
            Counter::IngestStale => "kvroute_ingest_stale_total",
            Counter::IngestConflict => "kvroute_ingest_conflicts_total",
            Counter::SnapshotDecodeFailed => "kvroute_snapshot_decode_failures_total",
            Counter::PrefixAnswers => "kvroute_prefix_answers_total",
            Counter::PrefixShortfalls => "kvroute_prefix_shortfalls_total",
            Counter::PrefixEntriesDropped => "kvroute_prefix_entries_dropped_total",
            Counter::PlacementsNoted => "kvroute_placements_noted_total",
            Counter::PlacementsLost => "kvroute_placements_lost_total",
            Counter::LastBlocksNoted => "kvroute_last_blocks_noted_total",
            Counter::LastBlocksLost => "kvroute_last_blocks_lost_total",
            Counter::PrefillRateSamples => "kvroute_prefill_rate_samples_total",
        }
    }
}

/// Gauges the filter keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gauge {
    InflightPrefillTokens,
    InflightMemoryTokens,
    /// Age of the fleet snapshot in use (gateway clock), ms.
    SnapshotAgeMs,
    /// Replicas in the snapshot in use.
    FleetHosts,
    /// Requests held by admission control (every worker adds its own
    /// change, so the gauge sums the workers' queues).
    AdmissionQueued,
}

impl Gauge {
    pub const ALL: [Gauge; 5] = [
        Gauge::InflightPrefillTokens,
        Gauge::InflightMemoryTokens,
        Gauge::SnapshotAgeMs,
        Gauge::FleetHosts,
        Gauge::AdmissionQueued,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Gauge::InflightPrefillTokens => "kvroute_inflight_prefill_tokens",
            Gauge::InflightMemoryTokens => "kvroute_inflight_memory_tokens",
            Gauge::SnapshotAgeMs => "kvroute_fleet_snapshot_age_ms",
            Gauge::FleetHosts => "kvroute_fleet_hosts",
            Gauge::AdmissionQueued => "kvroute_admission_queued_requests",
        }
    }
}

/// Counters kept per replica: one series per replica address, for the
/// first [`REPLICA_SERIES`] replicas a worker counts, the rest summed in
/// one series labelled [`OTHER_REPLICAS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaCounter {
    /// Prompt tokens the prefix index expected cached on the replica.
    ExpectedTokens,
    /// Prompt tokens the replica's answers reported cached.
    CachedTokens,
}

impl ReplicaCounter {
    pub const ALL: [ReplicaCounter; 2] =
        [ReplicaCounter::ExpectedTokens, ReplicaCounter::CachedTokens];

    pub fn name(self) -> &'static str {
        match self {
            ReplicaCounter::ExpectedTokens => "kvroute_prefix_expected_tokens_total",
            ReplicaCounter::CachedTokens => "kvroute_prefix_cached_tokens_total",
        }
    }

    /// The host's metric name for one replica's series (see
    /// [`replica_series`]).
    pub fn series(self, replica: &str) -> String {
        replica_series(self.name(), replica)
    }
}

/// Gauges kept per replica, for the first [`REPLICA_SERIES`] replicas of
/// the snapshot in use (no `other` series: a sum of these is meaningless).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaGauge {
    /// The prefill rate the cost uses for the replica, tokens/s: the
    /// snapshot's, else the one learned from its answers when it is
    /// priced slower ([`crate::rates`]), else `fleet.prefillTokensPerS`.
    PrefillRate,
}

impl ReplicaGauge {
    pub fn name(self) -> &'static str {
        match self {
            ReplicaGauge::PrefillRate => "kvroute_prefill_rate_tokens_per_s",
        }
    }

    /// The host's metric name for one replica's series (see
    /// [`replica_series`]).
    pub fn series(self, replica: &str) -> String {
        replica_series(self.name(), replica)
    }
}

/// The host's metric name for one replica's series of metric `name`:
/// `<name>.replica.<label>`, where Envoy's stats tag extraction (see
/// envoy-config/envoy.yaml, `stats_tags`) turns the suffix into the label
/// `replica`. The label is the address with every byte other than
/// `[A-Za-z0-9_-]` replaced by `_` (`127.0.0.1:8001` -> `127_0_0_1_8001`):
/// a dot would split Envoy's stat name.
pub fn replica_series(name: &str, replica: &str) -> String {
    let label: String = replica
        .chars()
        .take(MAX_LABEL)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{name}.replica.{label}")
}

/// Admission-control counters, one series per objective
/// ([`crate::admit`]): `<name>.objective.<objective>`, which Envoy's stats
/// tag extraction turns into the label `objective` (objective names are
/// `[A-Za-z0-9_-]`, checked by the config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionCounter {
    /// Requests sent on to a replica, at once or after being held.
    Admitted,
    /// Requests held because the fleet was saturated.
    Queued,
    /// Requests answered by the gateway instead (429, or 503 past a
    /// queue bound).
    Shed,
    /// Held requests whose client left before they were sent on.
    Abandoned,
}

impl AdmissionCounter {
    pub const ALL: [AdmissionCounter; 4] = [
        AdmissionCounter::Admitted,
        AdmissionCounter::Queued,
        AdmissionCounter::Shed,
        AdmissionCounter::Abandoned,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AdmissionCounter::Admitted => "kvroute_admission_admitted_total",
            AdmissionCounter::Queued => "kvroute_admission_queued_total",
            AdmissionCounter::Shed => "kvroute_admission_shed_total",
            AdmissionCounter::Abandoned => "kvroute_admission_abandoned_total",
        }
    }

    pub fn series(self, objective: &str) -> String {
        format!("{}.objective.{objective}", self.name())
    }
}

/// How long held requests waited, ms (a histogram: one value per request
/// that left the queue, sent on or answered).
pub const ADMISSION_WAIT_MS: &str = "kvroute_admission_wait_ms";

/// Replicas that get their own series per worker.
pub const REPLICA_SERIES: usize = 128;
/// The series of the replicas past [`REPLICA_SERIES`].
pub const OTHER_REPLICAS: &str = "other";
/// Longest replica label kept (an address is far shorter).
const MAX_LABEL: usize = 64;

pub trait Metrics {
    fn count(&self, c: Counter, n: u64);
    fn gauge(&self, g: Gauge, v: u64);
    /// Adds to one replica's series of `c` (no-op unless implemented).
    fn count_replica(&self, _c: ReplicaCounter, _replica: &str, _n: u64) {}
    /// Sets one replica's series of `g` (no-op unless implemented).
    fn gauge_replica(&self, _g: ReplicaGauge, _replica: &str, _v: u64) {}
}

/// Counts kept in the VM and handed to the host in batches.
///
/// Each counter increment is a host call; the request path makes two or
/// three. A worker counts here and flushes on its sync (at most every few
/// ms while busy, and on its tick when quiet), so Envoy's counters lag by
/// at most a tick. Gauges are not batched: the filter only sets them on the
/// tick.
#[derive(Debug, Default)]
pub struct Tally {
    counts: [Cell<u64>; Counter::ALL.len()],
    /// Per-replica counts: `(replica, counts by ReplicaCounter::ALL)`, at
    /// most [`REPLICA_SERIES`] replicas plus [`OTHER_REPLICAS`].
    replicas: RefCell<Vec<(String, [u64; ReplicaCounter::ALL.len()])>>,
}

impl Tally {
    /// The counts since the last drain, non-zero ones only, and zeroed.
    pub fn drain(&self) -> Vec<(Counter, u64)> {
        Counter::ALL
            .iter()
            .zip(&self.counts)
            .filter_map(|(c, n)| Some((*c, n.take())).filter(|(_, n)| *n > 0))
            .collect()
    }

    /// The per-replica counts since the last drain, non-zero ones only, and
    /// zeroed (the replicas stay known, so the cap holds across drains).
    pub fn drain_replicas(&self) -> Vec<(String, ReplicaCounter, u64)> {
        let Ok(mut rows) = self.replicas.try_borrow_mut() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (replica, counts) in rows.iter_mut() {
            for (c, n) in ReplicaCounter::ALL.iter().zip(counts.iter_mut()) {
                if *n > 0 {
                    out.push((replica.clone(), *c, std::mem::take(n)));
                }
            }
        }
        out
    }
}

impl Metrics for Tally {
    fn count(&self, c: Counter, n: u64) {
        if let Some(cell) = Counter::ALL
            .iter()
            .position(|x| *x == c)
            .and_then(|i| self.counts.get(i))
        {
            cell.set(cell.get().saturating_add(n));
        }
    }

    fn gauge(&self, _g: Gauge, _v: u64) {}

    fn count_replica(&self, c: ReplicaCounter, replica: &str, n: u64) {
        let Some(i) = ReplicaCounter::ALL.iter().position(|x| *x == c) else {
            return;
        };
        let Ok(mut rows) = self.replicas.try_borrow_mut() else {
            return;
        };
        let known = rows.iter().position(|(r, _)| r == replica);
        let row = match known {
            Some(k) => k,
            None if rows.len() < REPLICA_SERIES => {
                rows.push((replica.to_owned(), [0; ReplicaCounter::ALL.len()]));
                rows.len() - 1
            }
            None => match rows.iter().position(|(r, _)| r == OTHER_REPLICAS) {
                Some(k) => k,
                None => {
                    rows.push((OTHER_REPLICAS.to_owned(), [0; ReplicaCounter::ALL.len()]));
                    rows.len() - 1
                }
            },
        };
        if let Some(v) = rows.get_mut(row).and_then(|(_, counts)| counts.get_mut(i)) {
            *v = v.saturating_add(n);
        }
    }
}

/// Records metrics in memory, for tests.
#[derive(Default)]
pub struct MemoryMetrics {
    pub counters: RefCell<HashMap<&'static str, u64>>,
    pub gauges: RefCell<HashMap<&'static str, u64>>,
    /// Per-replica series (counters and gauges) by their host metric name.
    pub series: RefCell<HashMap<String, u64>>,
}

impl MemoryMetrics {
    pub fn counter(&self, c: Counter) -> u64 {
        self.counters.borrow().get(c.name()).copied().unwrap_or(0)
    }

    pub fn replica(&self, c: ReplicaCounter, replica: &str) -> u64 {
        self.series
            .borrow()
            .get(&c.series(replica))
            .copied()
            .unwrap_or(0)
    }
}

impl Metrics for MemoryMetrics {
    fn count(&self, c: Counter, n: u64) {
        *self.counters.borrow_mut().entry(c.name()).or_default() += n;
    }
    fn gauge(&self, g: Gauge, v: u64) {
        self.gauges.borrow_mut().insert(g.name(), v);
    }
    fn count_replica(&self, c: ReplicaCounter, replica: &str, n: u64) {
        *self
            .series
            .borrow_mut()
            .entry(c.series(replica))
            .or_default() += n;
    }
    fn gauge_replica(&self, g: ReplicaGauge, replica: &str, v: u64) {
        self.series.borrow_mut().insert(g.series(replica), v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_batches_counts_until_drained() {
        let t = Tally::default();
        assert!(t.drain().is_empty());
        t.count(Counter::DecisionPrefix, 1);
        t.count(Counter::BodyBytes, 1024);
        t.count(Counter::DecisionPrefix, 1);
        t.count(Counter::SnapshotDecodeFailed, 1);
        t.gauge(Gauge::FleetHosts, 9);
        assert_eq!(
            t.drain(),
            vec![
                (Counter::DecisionPrefix, 2),
                (Counter::BodyBytes, 1024),
                (Counter::SnapshotDecodeFailed, 1)
            ]
        );
        assert!(t.drain().is_empty(), "drained counts start again from zero");
        t.count(Counter::BodyBytes, u64::MAX);
        t.count(Counter::BodyBytes, 5);
        assert_eq!(t.drain(), vec![(Counter::BodyBytes, u64::MAX)]);
    }

    #[test]
    fn replica_series_are_bounded_and_batched() {
        let t = Tally::default();
        t.count_replica(ReplicaCounter::ExpectedTokens, "127.0.0.1:8001", 100);
        t.count_replica(ReplicaCounter::CachedTokens, "127.0.0.1:8001", 60);
        t.count_replica(ReplicaCounter::ExpectedTokens, "127.0.0.1:8001", 1);
        assert_eq!(
            t.drain_replicas(),
            vec![
                (
                    "127.0.0.1:8001".to_owned(),
                    ReplicaCounter::ExpectedTokens,
                    101
                ),
                (
                    "127.0.0.1:8001".to_owned(),
                    ReplicaCounter::CachedTokens,
                    60
                )
            ]
        );
        assert!(t.drain_replicas().is_empty());
        for r in 0..REPLICA_SERIES + 50 {
            t.count_replica(
                ReplicaCounter::CachedTokens,
                &format!("10.0.{}.{}:80", r / 256, r % 256),
                1,
            );
        }
        let drained = t.drain_replicas();
        // 127.0.0.1:8001 took one of the series; the rest went to "other".
        assert_eq!(drained.len(), REPLICA_SERIES);
        let other: u64 = drained
            .iter()
            .filter(|(r, _, _)| r == OTHER_REPLICAS)
            .map(|(_, _, n)| n)
            .sum();
        assert_eq!(other, 51);
        assert_eq!(
            drained.iter().map(|(_, _, n)| n).sum::<u64>(),
            REPLICA_SERIES as u64 + 50
        );
        assert_eq!(
            ReplicaCounter::CachedTokens.series("127.0.0.1:8001"),
            "kvroute_prefix_cached_tokens_total.replica.127_0_0_1_8001"
        );
        assert_eq!(
            ReplicaCounter::ExpectedTokens.series("[::1]:80"),
            "kvroute_prefix_expected_tokens_total.replica.___1__80"
        );
    }

    #[test]
    fn header_text_is_utf8_or_absent() {
        assert_eq!(header_text(None), None);
        assert_eq!(header_text(Some(Vec::new())), Some(String::new()));
        assert_eq!(
            header_text(Some(b"session-1".to_vec())),
            Some("session-1".to_owned())
        );
        assert_eq!(
            header_text(Some("h\u{e9}llo \u{1f642}".as_bytes().to_vec())),
            Some("h\u{e9}llo \u{1f642}".to_owned())
        );
        // What the e2e hostile suite sent in x-session-id: obs-text bytes.
        assert_eq!(header_text(Some(b"\xff\xfe\x80".to_vec())), None);
        // A multi-byte sequence cut short, and a lone continuation byte.
        assert_eq!(header_text(Some(b"abc\xe2\x82".to_vec())), None);
        assert_eq!(header_text(Some(b"\x80abc".to_vec())), None);
        // Latin-1 text is not UTF-8 either.
        assert_eq!(header_text(Some(b"caf\xe9".to_vec())), None);
    }
}

//! Learning from answers which replicas prefill slower than the others.
//!
//! The cost ([`crate::decide`]) turns prefill tokens into seconds at each
//! replica's rate: the snapshot's `prefillTokensPerS` for it, else
//! `fleet.prefillTokensPerS`. A fleet of two GPU generations (an H100 pool
//! beside an A100 pool, the A100 prefilling at about a third of the
//! H100's rate) looks uniform at one configured rate, and no engine
//! exports its rate. The gateway sees it in the answers: a request with
//! nothing queued ahead of it gets its first byte after its own prefill.
//!
//! # A sample
//!
//! A decision keeps a [`Probe`]: its primary, the prefill the decision saw
//! pending there ([`crate::decide::Decision::pending`]), the prompt part it
//! expected to compute, and the decision's time; the first response byte
//! stamps it. The answer (read when the filter reads it anyway: the
//! output-length sample or an expected hit, [`crate::answers::read_answer`];
//! from the primary) gives the tokens the engine computed, `prompt_tokens`
//! less `cached_tokens`. It is a sample when
//!
//! - the decision saw at most [`PENDING_SHARE`] of the request's own
//!   uncached estimate pending on the replica (nothing much queued ahead);
//! - the engine computed at least [`MIN_COMPUTED`] tokens (so the step's
//!   fixed time and the network weigh little);
//! - the answer reports both figures (an answer without `cached_tokens`
//!   teaches nothing).
//!
//! The sample is the computed tokens and the seconds from the decision to
//! the first byte. The time includes the decodes batched with the prefill
//! and the wait for the step under way, so the rate it gives is below the
//! engine's own prefill rate; what it is good for is the comparison
//! between replicas under the same traffic.
//!
//! # The table
//!
//! Per replica, an estimate of the [`QUANTILE`] of its samples' rates and
//! their count. Decodes, a step under way and prefill the decision could
//! not see (another gateway's, sent since the last snapshot) only ever
//! slow a sample down, and a replica cannot prefill faster than its
//! hardware, so the upper part of the samples is the clean part: a high
//! quantile reads the hardware where a mean reads the traffic (on the
//! simulated H100 fleet at four gateways a ratio of summed tokens to
//! summed seconds put a busy conversation's home at 0.48 of the fastest
//! replica, beside the A100s' 0.3-0.4 on a mixed fleet). The first
//! [`MIN_SAMPLES`] give their maximum (a mean of them left replicas whose
//! first samples were slowed by traffic marked slower for a while: on the
//! H100 fleet at four gateways 7 of 90 runs changed); each later sample
//! moves the
//! estimate by a factor `exp(STEP x QUANTILE)` up when above it and
//! `exp(-STEP x (1 - QUANTILE))` down when below, which settles where a
//! share `1 - QUANTILE` of the samples lie above ([`STEP`]). One
//! shared-data key (`<prefix>.rates.v1`) that every worker updates with
//! compare-and-swap. Encoding (little endian): the magic `KVR1`, then 24
//! bytes per replica: host id (u64), rate (f64 bits), samples (u64),
//! sorted by host id, at most [`MAX_HOSTS`] replicas (a new replica beyond
//! that is not recorded). A value that does not decode is replaced.
//!
//! # Use
//!
//! At each snapshot a router's [`crate::ingest::FleetCache`] decodes, it
//! reads the table ([`RateTable::slower`]): the reference is the second
//! highest rate among replicas with at least [`MIN_SAMPLES`], so that one
//! replica's estimate alone cannot mark all the others slower (a real
//! engine's sample can be spuriously fast when it reuses tokens it does
//! not report as cached, e.g. from a KV cache outside its prefix cache;
//! with fewer than two such replicas nothing is marked); a replica with that
//! many samples whose rate is below [`SLOWER`] x the reference is given
//! `fleet.prefillTokensPerS x rate / reference`, unless the snapshot
//! gives its rate. The others keep the configured rate, taken as the
//! fastest replicas'. A fleet of one GPU kind is therefore priced as
//! before: its replicas' rates differ by the traffic each had, within
//! [`SLOWER`] (measured in docs/fleet-state.md, "Prefill rates learned
//! from answers"). Off with `fleet.learnPrefillRates`.
//!
//! Each router sets the gauge `kvroute_prefill_rate_tokens_per_s` per
//! replica (label `replica`) to the rate the cost uses for it, on the
//! worker's tick after it decodes a snapshot ([`report`]); a replica that
//! left the snapshot reads 0.

use crate::decide::Decision;
use crate::fleet::{HostState, MAX_HOSTS};
use crate::host::{Counter, Metrics, ReplicaGauge, SetError, SharedData, REPLICA_SERIES};
use crate::picker::host_id;
use crate::placed::word;
use crate::usage::Learned;

const MAGIC: &[u8; 4] = b"KVR1";
const ENTRY: usize = 24;
/// The quantile of a replica's sample rates that stands for its rate.
pub const QUANTILE: f64 = 0.8;
/// How far one sample moves the estimate (a log step).
pub const STEP: f64 = 0.05;
/// The most prefill the decision may have seen pending on the replica, as
/// a share of the request's own uncached estimate, for its answer to be a
/// sample.
pub const PENDING_SHARE: f64 = 0.25;
/// The fewest tokens the engine must have computed for a sample.
pub const MIN_COMPUTED: u64 = 512;
/// Samples before a replica's rate is used (as the reference or as slower).
pub const MIN_SAMPLES: u64 = 5;
/// A replica counts as slower when its rate is below this share of the
/// fastest's. In the fleet simulation at four gateways (each learning on
/// its own) the H100 replicas ended between 0.66 and 1 of the fastest
/// (chat without session headers, the widest spread seen; at 0.6 two of
/// its ten runs changed), the A100s of a mixed fleet between 0.32 and
/// 0.42 (their true ratio is 0.3).
pub const SLOWER: f64 = 0.5;

/// What a decision leaves for its answer to be a rate sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// The primary's id.
    pub host: u64,
    /// Prefill the decision saw pending on the primary (gateway tokens).
    pub pending: u64,
    /// The prompt part the decision expected to compute (gateway tokens).
    pub uncached: u64,
    /// When the decision was made (gateway clock, ms).
    pub decided_ms: u64,
    /// When the first response byte came.
    pub first_byte_ms: Option<u64>,
}

impl Probe {
    /// The probe of a decision that charged a primary at least
    /// [`MIN_COMPUTED`] tokens of prefill (by the gateway's estimate) with
    /// little pending ahead of it (`None`: its answer is not read for a
    /// sample).
    pub fn of(d: &Decision, decided_ms: u64) -> Option<Probe> {
        let c = d.charge?;
        let long = c.prefill >= MIN_COMPUTED;
        (long && d.pending as f64 <= PENDING_SHARE * c.prefill as f64).then_some(Probe {
            host: c.host,
            pending: d.pending,
            uncached: c.prefill,
            decided_ms,
            first_byte_ms: None,
        })
    }

    /// Stamps the first response byte (later calls change nothing).
    pub fn first_byte(&mut self, now_ms: u64) {
        self.first_byte_ms.get_or_insert(now_ms);
    }

    /// The computed prompt tokens and the seconds to the first byte, if the
    /// answer is a sample (see the module doc).
    pub fn sample(&self, learned: &Learned) -> Option<Sample> {
        let first = self.first_byte_ms?;
        let prompt = learned.prompt_tokens?;
        let cached = learned.cached_tokens?;
        let computed = prompt.saturating_sub(cached);
        if computed < MIN_COMPUTED {
            return None;
        }
        let ms = first.saturating_sub(self.decided_ms).max(1);
        Some(Sample {
            tokens: computed as f64,
            seconds: ms as f64 / 1000.0,
        })
    }
}

/// One answer's prefill: tokens computed, seconds to the first byte.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub tokens: f64,
    pub seconds: f64,
}

impl Sample {
    pub fn rate(&self) -> f64 {
        self.tokens / self.seconds
    }
}

/// One replica's learned rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    pub host: u64,
    /// Computed tokens per second to the first byte: the samples' upper
    /// quantile (see the module doc).
    pub rate: f64,
    pub samples: u64,
}

/// Every replica's learned rate, sorted by host id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RateTable {
    pub entries: Vec<Entry>,
}

impl RateTable {
    /// `None` for a value that is not a rate table.
    pub fn decode(bytes: &[u8]) -> Option<RateTable> {
        let body = bytes.strip_prefix(MAGIC.as_slice())?;
        if body.len() % ENTRY != 0 || body.len() / ENTRY > MAX_HOSTS {
            return None;
        }
        let mut entries: Vec<Entry> = body
            .chunks_exact(ENTRY)
            .map(|c| Entry {
                host: word(c, 0),
                rate: f64::from_bits(word(c, 1)),
                samples: word(c, 2),
            })
            .filter(|e| e.rate.is_finite() && e.rate > 0.0)
            .collect();
        entries.sort_by_key(|e| e.host);
        entries.dedup_by_key(|e| e.host);
        Some(RateTable { entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MAGIC.len() + ENTRY * self.entries.len());
        out.extend_from_slice(MAGIC);
        for e in &self.entries {
            out.extend_from_slice(&e.host.to_le_bytes());
            out.extend_from_slice(&e.rate.to_bits().to_le_bytes());
            out.extend_from_slice(&e.samples.to_le_bytes());
        }
        out
    }

    /// The table with one more sample for `host` (unchanged when the
    /// table is full and `host` is new).
    pub fn with_sample(mut self, host: u64, sample: Sample) -> RateTable {
        let x = sample.rate();
        if !x.is_finite() || x <= 0.0 {
            return self;
        }
        match self.entries.binary_search_by_key(&host, |e| e.host) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.rate = if e.samples < MIN_SAMPLES {
                        e.rate.max(x)
                    } else if x > e.rate {
                        e.rate * (STEP * QUANTILE).exp()
                    } else {
                        e.rate * (-STEP * (1.0 - QUANTILE)).exp()
                    };
                    e.samples = e.samples.saturating_add(1);
                }
            }
            Err(i) if self.entries.len() < MAX_HOSTS => self.entries.insert(
                i,
                Entry {
                    host,
                    rate: x,
                    samples: 1,
                },
            ),
            Err(_) => {}
        }
        self
    }

    /// The replicas that prefill slower than the fastest, each with its
    /// rate: `configured x rate / reference` (see the module doc).
    pub fn slower(&self, configured: f64) -> Vec<(u64, f64)> {
        let known = || self.entries.iter().filter(|e| e.samples >= MIN_SAMPLES);
        // The second fastest: one replica's estimate alone cannot mark
        // every other one slower.
        let (mut first, mut reference) = (0.0f64, 0.0f64);
        for r in known().map(|e| e.rate) {
            if r > first {
                (first, reference) = (r, first);
            } else if r > reference {
                reference = r;
            }
        }
        if reference <= 0.0 {
            return Vec::new();
        }
        known()
            .filter(|e| e.rate < SLOWER * reference)
            .map(|e| (e.host, configured * e.rate / reference))
            .collect()
    }
}

/// Gives each host without a rate of its own that `table` shows slower
/// its learned rate (see the module doc).
pub fn apply(hosts: &mut [HostState], table: &RateTable, configured: f64) {
    let slower = table.slower(configured);
    if slower.is_empty() {
        return;
    }
    for h in hosts
        .iter_mut()
        .filter(|h| h.prefill_tokens_per_s.is_none())
    {
        let id = host_id(&h.address);
        if let Ok(i) = slower.binary_search_by_key(&id, |s| s.0) {
            h.prefill_tokens_per_s = slower.get(i).map(|s| s.1);
        }
    }
}

/// Sets each replica's [`ReplicaGauge::PrefillRate`] to the rate the cost
/// uses for it (its own, else `configured`), for the first
/// [`REPLICA_SERIES`] hosts, so that operators see which replicas are
/// priced slower; the replicas in `shown` (those set last time) that are
/// no longer among them read 0. `shown` becomes the replicas set now.
pub fn report<'a>(
    m: &dyn Metrics,
    hosts: impl IntoIterator<Item = &'a HostState>,
    configured: f64,
    shown: &mut Vec<String>,
) {
    let mut now: Vec<String> = Vec::new();
    for h in hosts.into_iter().take(REPLICA_SERIES) {
        let rate = h.prefill_tokens_per_s.unwrap_or(configured);
        // A float to integer cast saturates.
        m.gauge_replica(ReplicaGauge::PrefillRate, &h.address, rate.round() as u64);
        now.push(h.address.clone());
    }
    now.sort_unstable();
    for gone in shown.iter().filter(|a| now.binary_search(a).is_err()) {
        m.gauge_replica(ReplicaGauge::PrefillRate, gone, 0);
    }
    *shown = now;
}

/// The stored table (empty when missing or not a table).
pub fn read(store: &dyn SharedData, key: &str) -> RateTable {
    match store.get(key) {
        Ok((Some(v), _)) => RateTable::decode(&v).unwrap_or_default(),
        _ => RateTable::default(),
    }
}

/// Adds the answer's sample, if it is one, to its replica's estimate;
/// returns the sample.
pub fn learn(
    store: &dyn SharedData,
    metrics: &dyn Metrics,
    key: &str,
    probe: &Probe,
    learned: &Learned,
) -> Option<Sample> {
    let sample = probe.sample(learned)?;
    metrics.count(Counter::PrefillRateSamples, 1);
    for _ in 0..4 {
        let Ok((v, cas)) = store.get(key) else {
            return Some(sample);
        };
        let table = v.as_deref().and_then(RateTable::decode).unwrap_or_default();
        // A value that is not a table is replaced (no version check).
        let cas = if v.as_deref().and_then(RateTable::decode).is_some() {
            cas
        } else {
            None
        };
        let next = table.with_sample(probe.host, sample);
        match store.set(key, &next.encode(), cas) {
            Err(SetError::CasMismatch) => continue,
            _ => return Some(sample),
        }
    }
    Some(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::Reason;
    use crate::host::{MemoryMetrics, MemorySharedData};
    use crate::load::Charge;

    fn decision(pending: u64, prefill: u64) -> Decision {
        Decision {
            reason: Reason::Prefix,
            pick: None,
            targets: vec!["a".to_owned()],
            degraded: false,
            key: None,
            charge: Some(Charge {
                host: 7,
                prefill,
                memory: prefill + 100,
            }),
            expected_cached: 0,
            pending,
        }
    }

    fn answer(prompt: u64, cached: Option<u64>) -> Learned {
        Learned {
            output_tokens: Some(10),
            cached_tokens: cached,
            prompt_tokens: Some(prompt),
        }
    }

    fn rate_of(p: &Probe, l: &Learned) -> Option<f64> {
        p.sample(l).map(|s| s.rate())
    }

    fn sample(rate: f64) -> Sample {
        Sample {
            tokens: rate,
            seconds: 1.0,
        }
    }

    #[test]
    fn an_answer_with_little_queued_ahead_is_a_sample_of_its_replicas_rate() {
        // Nothing pending: a probe; 8000 computed tokens in 400 ms.
        let mut p = Probe::of(&decision(0, 8000), 1_000).unwrap();
        assert_eq!(
            p.sample(&answer(9000, Some(1000))),
            None,
            "no first byte yet"
        );
        p.first_byte(1_400);
        p.first_byte(9_999);
        assert_eq!(rate_of(&p, &answer(9000, Some(1000))), Some(20_000.0));
        // Too little computed, or no cached figure: no sample.
        assert_eq!(p.sample(&answer(9000, Some(8600))), None);
        assert_eq!(p.sample(&answer(9000, None)), None);
        assert_eq!(p.sample(&Learned::default()), None);
        // A quarter of its own prefill pending ahead is still a probe; more
        // is not; nor is a short prefill, or a decision without a charge.
        assert!(Probe::of(&decision(2000, 8000), 0).is_some());
        assert!(Probe::of(&decision(2001, 8000), 0).is_none());
        assert!(Probe::of(&decision(0, 0), 0).is_none());
        assert!(
            Probe::of(&decision(0, MIN_COMPUTED - 1), 0).is_none(),
            "too short"
        );
        let uncharged = Decision {
            charge: None,
            ..decision(0, 8000)
        };
        assert!(Probe::of(&uncharged, 0).is_none());
        // A first byte stamped before the decision (a clock step) counts as
        // one millisecond, never a division by zero.
        let mut early = Probe::of(&decision(0, 8000), 5_000).unwrap();
        early.first_byte(4_000);
        assert_eq!(rate_of(&early, &answer(2024, Some(0))), Some(2_024_000.0));
    }

    #[test]
    fn samples_settle_on_an_upper_quantile_per_replica_in_shared_data() {
        let store = MemorySharedData::default();
        let metrics = MemoryMetrics::default();
        let key = "kv.rates.v1";
        let mut p = Probe::of(&decision(0, 8000), 0).unwrap();
        p.first_byte(1000);
        // The first samples give their maximum.
        for prompt in [10_000, 30_000, 20_000] {
            learn(&store, &metrics, key, &p, &answer(prompt, Some(0)));
        }
        let t = read(&store, key);
        assert_eq!(t.entries.len(), 1);
        assert_eq!(t.entries[0].host, 7);
        assert_eq!(t.entries[0].samples, 3);
        assert_eq!(t.entries[0].rate, 30_000.0);
        assert_eq!(metrics.counter(Counter::PrefillRateSamples), 3);
        // Not a sample: not counted, not stored.
        learn(&store, &metrics, key, &p, &answer(100, Some(0)));
        assert_eq!(read(&store, key).entries[0].samples, 3);
        // Then the estimate settles where a fifth of the samples lie above
        // it: 1000 samples spread evenly over 10k..20k tokens/s (slowed
        // down by traffic; the replica's own speed is the upper end) put
        // it near 18k (each step moves it a few per cent), above the median
        // a mean would give, whatever the start.
        for start in [1_000.0, 100_000.0] {
            let mut t = RateTable::default();
            for _ in 0..MIN_SAMPLES {
                t = t.with_sample(1, sample(start));
            }
            for i in 0..2000u64 {
                // A fixed scramble of 0..1000, so that the order is not sorted.
                let k = (i * 7919) % 1000;
                t = t.with_sample(1, sample(10_000.0 + 10.0 * k as f64));
            }
            let r = t.entries[0].rate;
            assert!((15_500.0..20_000.0).contains(&r), "from {start}: {r}");
        }
        // A sample that is no rate (0 or infinite) changes nothing.
        let t = RateTable::default().with_sample(
            1,
            Sample {
                tokens: 1.0,
                seconds: 0.0,
            },
        );
        assert!(t.entries.is_empty());
        // A value that is not a table is replaced.
        store.set(key, b"garbage", None).unwrap();
        learn(&store, &metrics, key, &p, &answer(5000, Some(0)));
        assert_eq!(read(&store, key).entries[0].samples, 1);
    }

    #[test]
    fn only_a_replica_well_below_the_fastest_is_priced_slower() {
        let mut t = RateTable::default();
        for _ in 0..MIN_SAMPLES {
            t = t.with_sample(1, sample(20_000.0)); // the fastest
            t = t.with_sample(2, sample(15_000.0)); // the reference: second
            t = t.with_sample(3, sample(6_000.0)); // 0.4 of it: slower
            t = t.with_sample(6, sample(9_000.0)); // 0.6 of it: the same kind
        }
        // Too few samples: neither a reference nor slower.
        t = t.with_sample(4, sample(1_000.0));
        t = t.with_sample(5, sample(100_000.0));
        let slower = t.slower(30_000.0);
        assert_eq!(slower.len(), 1);
        assert_eq!(slower[0].0, 3);
        assert!((slower[0].1 - 12_000.0).abs() < 1e-6);
        assert!(RateTable::default().slower(30_000.0).is_empty());
        // One replica whose estimate is far above every other's (a few
        // spuriously fast answers) does not mark the others slower.
        let mut t = RateTable::default();
        for _ in 0..MIN_SAMPLES {
            t = t.with_sample(1, sample(1_000_000.0));
            t = t.with_sample(2, sample(20_000.0));
            t = t.with_sample(3, sample(19_000.0));
        }
        assert!(t.slower(30_000.0).is_empty());
    }

    #[test]
    fn a_slower_replica_is_priced_in_the_snapshot_unless_it_gives_its_own_rate() {
        let mut t = RateTable::default();
        for _ in 0..MIN_SAMPLES {
            t = t.with_sample(host_id("a:1"), sample(20_000.0));
            t = t.with_sample(host_id("d:1"), sample(20_000.0));
            t = t.with_sample(host_id("b:1"), sample(5_000.0));
            t = t.with_sample(host_id("c:1"), sample(5_000.0));
        }
        let host = |addr: &str, rate: Option<f64>| HostState {
            prefill_tokens_per_s: rate,
            ..crate::decide::idle_host(addr, true, 0)
        };
        let mut hosts = vec![
            host("a:1", None),
            host("b:1", None),
            host("c:1", Some(9_000.0)),
        ];
        apply(&mut hosts, &t, 40_000.0);
        let rates: Vec<Option<f64>> = hosts.iter().map(|h| h.prefill_tokens_per_s).collect();
        assert_eq!(rates, [None, Some(10_000.0), Some(9_000.0)]);
        // The gauges show the rate the cost uses for each replica.
        let m = crate::host::MemoryMetrics::default();
        let mut shown = Vec::new();
        report(&m, &hosts, 40_000.0, &mut shown);
        let gauge = |addr: &str| {
            m.series
                .borrow()
                .get(&ReplicaGauge::PrefillRate.series(addr))
                .copied()
        };
        assert_eq!(
            ["a:1", "b:1", "c:1", "d:1"].map(gauge),
            [Some(40_000), Some(10_000), Some(9_000), None]
        );
        // A replica that left the snapshot reads 0.
        report(&m, &hosts[..2], 40_000.0, &mut shown);
        assert_eq!(
            ["a:1", "b:1", "c:1"].map(gauge),
            [Some(40_000), Some(10_000), Some(0)]
        );
        assert_eq!(shown, ["a:1", "b:1"]);
        // Nothing learned: nothing changes.
        apply(&mut hosts[..1], &RateTable::default(), 40_000.0);
        assert_eq!(hosts[0].prefill_tokens_per_s, None);
    }

    #[test]
    fn rate_gauges_cover_at_most_the_replica_series_cap() {
        let hosts: Vec<HostState> = (0..REPLICA_SERIES + 10)
            .map(|i| crate::decide::idle_host(&format!("10.0.{}.{}:80", i / 200, i % 200), true, 0))
            .collect();
        let m = crate::host::MemoryMetrics::default();
        let mut shown = Vec::new();
        report(&m, &hosts, 30_000.0, &mut shown);
        let series = m.series.borrow();
        assert_eq!(
            (series.len(), shown.len()),
            (REPLICA_SERIES, REPLICA_SERIES)
        );
        assert!(series.values().all(|v| *v == 30_000));
    }

    #[test]
    fn the_table_round_trips_and_rejects_what_is_not_one() {
        let mut t = RateTable::default();
        for h in [9, 3, 5] {
            t = t.with_sample(h, sample(h as f64 * 100.0));
        }
        let hosts: Vec<u64> = t.entries.iter().map(|e| e.host).collect();
        assert_eq!(hosts, [3, 5, 9], "kept sorted");
        assert_eq!(RateTable::decode(&t.encode()), Some(t.clone()));
        assert_eq!(RateTable::decode(b"KVR1\x01"), None, "a partial entry");
        assert_eq!(RateTable::decode(b"KVL3"), None);
        assert_eq!(RateTable::decode(b""), None);
        // A NaN, infinite, negative or zero rate is dropped, not used.
        let mut bytes = MAGIC.to_vec();
        for (host, rate) in [
            (1u64, f64::NAN),
            (2, -5.0),
            (3, 0.0),
            (4, f64::INFINITY),
            (5, 7.0),
        ] {
            bytes.extend_from_slice(&host.to_le_bytes());
            bytes.extend_from_slice(&f64::to_bits(rate).to_le_bytes());
            bytes.extend_from_slice(&9u64.to_le_bytes());
        }
        let d = RateTable::decode(&bytes).unwrap();
        let kept: Vec<u64> = d.entries.iter().map(|e| e.host).collect();
        assert_eq!(kept, [5]);
        // The table is bounded: a new replica beyond MAX_HOSTS is not kept.
        let mut full = RateTable::default();
        for h in 0..MAX_HOSTS as u64 + 10 {
            full = full.with_sample(h, sample(1.0));
        }
        assert_eq!(full.entries.len(), MAX_HOSTS);
        assert!(RateTable::decode(&full.encode()).is_some());
    }
}

//! One router's run, reduced to the figures the report compares.

use std::collections::{BTreeMap, HashMap};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use kvroute_sim::engine::EngineConfig;

use crate::ceiling::{Blocks, Ceiling, Ceilings};
use crate::client::error_class;
use crate::engines::{EngineReading, Sample};
use crate::replay::Replay;
use crate::workload::Description;

/// Percentiles of one latency, modelled ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// Latencies in microseconds up to an hour, 3 significant digits.
fn histogram() -> Option<Histogram<u64>> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).ok()
}

/// Records a latency in ms (negative, NaN and infinite values are skipped).
fn record(h: &mut Histogram<u64>, v: f64) {
    if v.is_finite() && v >= 0.0 {
        let _ = h.record(((v * 1000.0) as u64).clamp(1, 3_600_000_000));
    }
}

/// Percentiles of latencies in ms (the same histogram as every summary).
pub fn percentiles(values: impl IntoIterator<Item = f64>) -> Percentiles {
    let Some(mut h) = histogram() else {
        return Percentiles::default();
    };
    for v in values {
        record(&mut h, v);
    }
    of_histogram(&h)
}

/// How many TTFT quantiles a summary keeps for the CDF plot.
pub const TTFT_QUANTILES: usize = 1000;

/// One router's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    /// Short name (`envoy-round-robin`, `kvroute`, ...). A modelled peer's
    /// name ends in `(modelled)`.
    pub router: String,
    /// How it was configured, one line.
    pub setup: String,
    pub workload: Description,
    /// Modelled seconds per real second (0: virtual time, the simulation).
    pub time_scale: f64,
    /// Gateway instances the router ran as (each with its own state).
    #[serde(default = "one")]
    pub gateways: usize,
    pub requests: u64,
    pub completed: u64,
    pub errors: u64,
    pub errors_by_class: BTreeMap<String, u64>,
    /// A few error texts, for diagnosis.
    pub error_examples: Vec<String>,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Engine-reported queue wait and prefill time (simulator only).
    pub queue_ms: Percentiles,
    pub prefill_ms: Percentiles,
    /// The no-queue TTFT floor of the same requests: each alone on an idle
    /// engine holding every prefix sent before it (the unbounded ceiling's
    /// cache; [`kvroute_sim::engine::EngineConfig::idle_ttft_s`]).
    pub ttft_floor_ms: Percentiles,
    /// `ttft_ms.p95 / ttft_floor_ms.p95` and the same at p99.
    pub ttft_p95_over_floor: f64,
    pub ttft_p99_over_floor: f64,
    /// Modelled seconds from the first send to the last answer.
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// The headline: prompt tokens served from the prefix cache at each
    /// request's first admission (the answers' `cached_tokens`) / prompt
    /// tokens.
    pub hit_rate: f64,
    /// The engines' own counters (hit tokens / queried tokens), which count
    /// a preempted request again at every re-admission: secondary only.
    pub hit_rate_with_readmissions: f64,
    pub ceilings: Ceilings,
    /// `hit_rate / ceilings.lru_hit_rate`.
    pub hit_fraction_of_lru: f64,
    /// Mean over samples of (max - min) KV utilisation across replicas.
    pub kv_spread_mean: f64,
    pub kv_mean: f64,
    pub preemptions: f64,
    /// The simulator's lag over the run as a fraction of the run's
    /// modelled duration, worst engine. Above a few percent the host could
    /// not keep up with the time scale and the figures are distorted:
    /// rerun with a lower `--time-scale`. Always 0 in virtual time.
    #[serde(default)]
    pub sim_lag_fraction: f64,
    /// The share of completed requests served by their session's most
    /// frequent engine (1: every conversation stayed on one replica).
    #[serde(default)]
    pub conversation_split: f64,
    /// Completed requests per engine (from the simulator's answers).
    pub per_engine_requests: Vec<u64>,
    /// Completed requests per gateway instance.
    #[serde(default)]
    pub per_gateway_requests: Vec<u64>,
    /// TTFT at [`TTFT_QUANTILES`] evenly spaced quantiles (fewer when
    /// fewer requests completed), for the CDF.
    pub ttft_quantiles_ms: Vec<f64>,
    /// The engine timeline (modelled time).
    pub samples: Vec<Sample>,
    /// Per objective (admission control), when the workload's sessions
    /// name objectives (`default` for those that name none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub objectives: BTreeMap<String, ObjectiveFigures>,
}

/// What happened to the requests of one objective.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveFigures {
    pub requests: u64,
    pub completed: u64,
    /// Answered by the gateway's admission control (429, or 503 past a
    /// queue bound).
    pub shed: u64,
    /// Other failures.
    pub failed: u64,
    /// TTFT of completed requests from the client's send (time held in
    /// the gateway included), ms.
    pub ttft_ms: Percentiles,
    /// Output tokens of completed requests.
    pub output_tokens: u64,
    /// `output_tokens` per second of the run (first send to last answer).
    pub goodput_tokens_per_s: f64,
}

/// Counts toward [`ObjectiveFigures`].
#[derive(Debug, Clone, Default)]
pub struct ObjectiveTally {
    pub requests: u64,
    pub completed: u64,
    pub shed: u64,
    pub failed: u64,
    pub output_tokens: u64,
    pub ttft_ms: Vec<f64>,
}

impl ObjectiveTally {
    pub fn figures(&self, duration_s: f64) -> ObjectiveFigures {
        ObjectiveFigures {
            requests: self.requests,
            completed: self.completed,
            shed: self.shed,
            failed: self.failed,
            ttft_ms: percentiles(self.ttft_ms.iter().copied()),
            output_tokens: self.output_tokens,
            goodput_tokens_per_s: self.output_tokens as f64 / duration_s.max(1e-9),
        }
    }
}

/// Whether an answer came from kvroute's admission control: every 429,
/// and a 503 whose JSON error names a queue bound.
pub fn shed_by_admission(status: u16, error: &str) -> bool {
    status == 429
        || (status == 503
            && ["queue_full", "key_queue_full", "queue_timeout", "displaced"]
                .iter()
                .any(|t| error.contains(&format!("\"type\":\"{t}\""))))
}

fn one() -> usize {
    1
}

/// Share of requests on their session's most used engine.
fn split_of(by_session: &HashMap<(usize, u64), u64>) -> f64 {
    let mut top: HashMap<usize, u64> = HashMap::new();
    let mut total = 0;
    for (&(session, _), &n) in by_session {
        let t = top.entry(session).or_insert(0);
        *t = (*t).max(n);
        total += n;
    }
    if total == 0 {
        return 0.0;
    }
    top.values().sum::<u64>() as f64 / total as f64
}

/// Counter change of one engine from the first to the last good reading.
fn counter_delta(samples: &[Sample], engine: usize, f: impl Fn(&EngineReading) -> f64) -> f64 {
    let readings = samples
        .iter()
        .filter_map(|s| s.engines.get(engine).copied().flatten());
    let mut first = None;
    let mut last = None;
    for r in readings {
        first.get_or_insert(f(&r));
        last = Some(f(&r));
    }
    match (first, last) {
        // Engines are started fresh for each router, so the first reading
        // is usually 0; a restarted engine (counter reset) counts from 0.
        (Some(a), Some(b)) if b >= a => b - a,
        (_, Some(b)) => b,
        _ => 0.0,
    }
}

/// One completed request, as the summary needs it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Done {
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub queue_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: u64,
    pub engine: Option<u64>,
    pub gateway: usize,
    /// The workload's session (conversation) the request belongs to.
    pub session: usize,
}

/// Builds a [`RunSummary`] one request at a time, so that the real-time
/// replay and the fleet simulation (which may run millions of requests)
/// reduce their runs the same way.
pub struct Tally {
    engine: EngineConfig,
    ceiling: Ceiling,
    floor_ms: Vec<f64>,
    ttft_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    queue_ms: Vec<f64>,
    prefill_ms: Vec<f64>,
    itl: Option<Histogram<u64>>,
    requests: u64,
    completed: u64,
    errors_by_class: BTreeMap<String, u64>,
    error_examples: Vec<String>,
    output_tokens: u64,
    usage_prompt: u64,
    usage_cached: u64,
    per_engine: Vec<u64>,
    per_gateway: Vec<u64>,
    /// Completed requests per (session, engine).
    by_session: HashMap<(usize, u64), u64>,
}

impl Tally {
    /// `engine` is the engines' configuration (for the TTFT floor),
    /// `fleet_blocks` their KV capacity in all (for the LRU ceiling).
    pub fn new(engine: &EngineConfig, fleet_blocks: u64, engines: usize) -> Self {
        Self {
            engine: engine.clone(),
            ceiling: Ceiling::new(fleet_blocks),
            floor_ms: Vec::new(),
            ttft_ms: Vec::new(),
            e2e_ms: Vec::new(),
            queue_ms: Vec::new(),
            prefill_ms: Vec::new(),
            itl: histogram(),
            requests: 0,
            completed: 0,
            errors_by_class: BTreeMap::new(),
            error_examples: Vec::new(),
            output_tokens: 0,
            usage_prompt: 0,
            usage_cached: 0,
            per_engine: vec![0; engines],
            per_gateway: Vec::new(),
            by_session: HashMap::new(),
        }
    }

    /// A request that was (or will be) served, in send order: its blocks
    /// feed the ceilings and its floor.
    pub fn sent(&mut self, blocks: &Blocks) {
        let cached = self.ceiling.add(blocks);
        let prompt = usize::try_from(blocks.prompt_tokens).unwrap_or(usize::MAX);
        let cached = usize::try_from(cached).unwrap_or(usize::MAX);
        self.floor_ms
            .push(1000.0 * self.engine.idle_ttft_s(prompt, cached));
    }

    pub fn failed(&mut self, error: &str) {
        self.requests += 1;
        *self.errors_by_class.entry(error_class(error)).or_insert(0) += 1;
        if self.error_examples.len() < 5 {
            self.error_examples.push(error.to_owned());
        }
    }

    pub fn completed(&mut self, d: &Done, itl_ms: &[f64]) {
        self.requests += 1;
        self.completed += 1;
        if d.ttft_ms.is_finite() {
            self.ttft_ms.push(d.ttft_ms);
        }
        self.e2e_ms.push(d.e2e_ms);
        self.queue_ms.extend(d.queue_ms);
        self.prefill_ms.extend(d.prefill_ms);
        if let Some(h) = self.itl.as_mut() {
            for &v in itl_ms {
                record(h, v);
            }
        }
        self.output_tokens += d.completion_tokens;
        if let (Some(p), Some(c)) = (d.prompt_tokens, d.cached_tokens) {
            self.usage_prompt += p;
            self.usage_cached += c;
        }
        if let Some(slot) = d.engine.and_then(|e| {
            self.per_engine
                .get_mut(usize::try_from(e).unwrap_or(usize::MAX))
        }) {
            *slot += 1;
        }
        if let Some(e) = d.engine {
            *self.by_session.entry((d.session, e)).or_insert(0) += 1;
        }
        if self.per_gateway.len() <= d.gateway {
            self.per_gateway.resize(d.gateway + 1, 0);
        }
        if let Some(slot) = self.per_gateway.get_mut(d.gateway) {
            *slot += 1;
        }
    }

    /// The summary of the run. `samples` is the engine timeline, `duration_s`
    /// the modelled time from the first send to the last answer.
    pub fn finish(mut self, run: RunInfo<'_>, samples: Vec<Sample>, duration_s: f64) -> RunSummary {
        let engines = samples.iter().map(|s| s.engines.len()).max().unwrap_or(0);
        let sum = |f: &dyn Fn(&EngineReading) -> f64| -> f64 {
            (0..engines).map(|e| counter_delta(&samples, e, f)).sum()
        };
        let queries = sum(&|r| r.cache_queries);
        let hits = sum(&|r| r.cache_hits);
        let preemptions = sum(&|r| r.preemptions);
        let lag = (0..engines)
            .map(|e| counter_delta(&samples, e, |r| r.lag_s))
            .fold(0.0, f64::max);
        let (mut spread, mut level, mut n) = (0.0, 0.0, 0usize);
        for s in &samples {
            let kv: Vec<f64> = s.engines.iter().flatten().map(|r| r.kv).collect();
            if kv.len() >= 2 && kv.len() == s.engines.len() {
                let max = kv.iter().copied().fold(f64::MIN, f64::max);
                let min = kv.iter().copied().fold(f64::MAX, f64::min);
                spread += max - min;
                level += kv.iter().sum::<f64>() / kv.len() as f64;
                n += 1;
            }
        }
        let ceilings = self.ceiling.finish();
        let hit_rate = if self.usage_prompt > 0 {
            self.usage_cached as f64 / self.usage_prompt as f64
        } else {
            0.0
        };
        self.ttft_ms.sort_by(f64::total_cmp);
        let ttft = percentiles(self.ttft_ms.iter().copied());
        let floor = percentiles(self.floor_ms.iter().copied());
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let duration = duration_s.max(1e-9);
        let conversation_split = split_of(&self.by_session);
        RunSummary {
            router: run.router.to_owned(),
            setup: run.setup.to_owned(),
            workload: run.workload.clone(),
            time_scale: run.time_scale,
            gateways: run.gateways,
            requests: self.requests,
            completed: self.completed,
            errors: self.requests - self.completed,
            errors_by_class: self.errors_by_class,
            error_examples: self.error_examples,
            ttft_ms: ttft,
            itl_ms: self
                .itl
                .as_ref()
                .map_or_else(Percentiles::default, of_histogram),
            e2e_ms: percentiles(self.e2e_ms.iter().copied()),
            queue_ms: percentiles(self.queue_ms.iter().copied()),
            prefill_ms: percentiles(self.prefill_ms.iter().copied()),
            ttft_floor_ms: floor,
            ttft_p95_over_floor: ratio(ttft.p95, floor.p95),
            ttft_p99_over_floor: ratio(ttft.p99, floor.p99),
            duration_s,
            requests_per_s: self.completed as f64 / duration,
            output_tokens_per_s: self.output_tokens as f64 / duration,
            hit_rate,
            hit_rate_with_readmissions: if queries > 0.0 { hits / queries } else { 0.0 },
            hit_fraction_of_lru: if ceilings.lru_hit_rate > 0.0 {
                hit_rate / ceilings.lru_hit_rate
            } else {
                0.0
            },
            ceilings,
            kv_spread_mean: if n > 0 { spread / n as f64 } else { 0.0 },
            kv_mean: if n > 0 { level / n as f64 } else { 0.0 },
            preemptions,
            sim_lag_fraction: lag / duration,
            conversation_split,
            per_engine_requests: self.per_engine,
            per_gateway_requests: self.per_gateway,
            ttft_quantiles_ms: quantiles(&self.ttft_ms, TTFT_QUANTILES),
            samples,
            objectives: BTreeMap::new(),
        }
    }
}

/// What names a run in its summary.
#[derive(Debug, Clone, Copy)]
pub struct RunInfo<'a> {
    pub router: &'a str,
    pub setup: &'a str,
    pub workload: &'a Description,
    pub time_scale: f64,
    pub gateways: usize,
}

fn of_histogram(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let ms = |us: u64| us as f64 / 1000.0;
    Percentiles {
        count: h.len(),
        mean: h.mean() / 1000.0,
        p50: ms(h.value_at_quantile(0.50)),
        p95: ms(h.value_at_quantile(0.95)),
        p99: ms(h.value_at_quantile(0.99)),
        max: ms(h.max()),
    }
}

/// At most `n` evenly spaced order statistics of sorted `v`, the last
/// always included.
fn quantiles(v: &[f64], n: usize) -> Vec<f64> {
    if v.len() <= n {
        return v.to_vec();
    }
    (1..=n)
        .filter_map(|k| v.get((k * v.len()).div_ceil(n).saturating_sub(1)).copied())
        .collect()
}

impl RunSummary {
    /// The summary of a real-time replay. The engines are taken to run
    /// the simulator's default step costs (for the floor).
    pub fn new(run: RunInfo<'_>, replay: &Replay) -> Self {
        let engines = replay
            .samples
            .iter()
            .map(|s| s.engines.len())
            .max()
            .unwrap_or(0);
        let fleet_blocks: f64 = (0..engines)
            .map(|e| {
                replay
                    .samples
                    .iter()
                    .filter_map(|s| s.engines.get(e).copied().flatten())
                    .map(|r| r.kv_blocks)
                    .fold(0.0, f64::max)
            })
            .sum();
        let mut tally = Tally::new(&EngineConfig::default(), fleet_blocks as u64, engines);
        for r in &replay.records {
            if r.outcome.error.is_none() {
                tally.sent(&r.blocks);
            }
        }
        for r in &replay.records {
            let o = &r.outcome;
            match (&o.error, o.ttft_ms) {
                (Some(e), _) => tally.failed(e),
                (None, ttft) => tally.completed(
                    &Done {
                        ttft_ms: ttft.unwrap_or(f64::NAN),
                        e2e_ms: o.e2e_ms,
                        queue_ms: o.usage.queue_ms,
                        prefill_ms: o.usage.prefill_ms,
                        prompt_tokens: o.usage.prompt_tokens,
                        cached_tokens: o.usage.cached_tokens,
                        completion_tokens: o
                            .usage
                            .completion_tokens
                            .unwrap_or(o.text.len().div_ceil(4) as u64),
                        engine: o.usage.engine,
                        gateway: 0,
                        session: r.session,
                    },
                    &o.itl_ms,
                ),
            }
        }
        let mut summary = tally.finish(run, replay.samples.clone(), replay.duration_s);
        if replay.records.iter().any(|r| r.objective.is_some()) {
            let mut by: BTreeMap<String, ObjectiveTally> = BTreeMap::new();
            for r in &replay.records {
                let name = r
                    .objective
                    .clone()
                    .unwrap_or_else(|| kvroute_core::admit::DEFAULT_OBJECTIVE.to_owned());
                let t = by.entry(name).or_default();
                let o = &r.outcome;
                t.requests += 1;
                match &o.error {
                    None => {
                        t.completed += 1;
                        t.output_tokens += o
                            .usage
                            .completion_tokens
                            .unwrap_or(o.text.len().div_ceil(4) as u64);
                        if let Some(ttft) = o.ttft_ms {
                            t.ttft_ms.push(ttft);
                        }
                    }
                    Some(e) if shed_by_admission(o.status, e) => t.shed += 1,
                    Some(_) => t.failed += 1,
                }
            }
            summary.objectives = by
                .iter()
                .map(|(n, t)| (n.clone(), t.figures(summary.duration_s)))
                .collect();
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_answers_are_told_from_other_errors() {
        assert!(shed_by_admission(429, "status 429: anything"));
        let body = r#"status 503: {"error":{"message":"kvroute: ...","objective":"default","type":"queue_timeout"}}"#;
        assert!(shed_by_admission(503, body));
        let no_replica =
            r#"status 503: {"error":{"message":"kvroute: no ready replica","type":"no_replica"}}"#;
        assert!(!shed_by_admission(503, no_replica));
        assert!(!shed_by_admission(
            503,
            "status 503: upstream connect error"
        ));
        assert!(!shed_by_admission(0, "transport: connection refused"));
    }

    #[test]
    fn percentiles_of_known_values() {
        let p = percentiles((1..=100).map(f64::from));
        assert_eq!(p.count, 100);
        assert!((p.p50 - 50.0).abs() < 0.1, "{p:?}");
        assert!((p.p99 - 99.0).abs() < 0.1, "{p:?}");
        assert!((p.mean - 50.5).abs() < 0.1, "{p:?}");
        assert_eq!(percentiles([f64::NAN, -1.0]), Percentiles::default());
    }

    #[test]
    fn counters_restart_from_zero() {
        let s = |t: f64, hits: f64| Sample {
            t_s: t,
            engines: vec![Some(EngineReading {
                cache_hits: hits,
                ..EngineReading::default()
            })],
        };
        assert_eq!(
            counter_delta(&[s(0.0, 10.0), s(1.0, 30.0)], 0, |r| r.cache_hits),
            20.0
        );
        assert_eq!(
            counter_delta(&[s(0.0, 10.0), s(1.0, 4.0)], 0, |r| r.cache_hits),
            4.0
        );
        assert_eq!(counter_delta(&[], 0, |r| r.cache_hits), 0.0);
    }
}

//! One router's run, reduced to the figures the report compares.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::ceiling::{self, Ceilings};
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

fn percentiles(values: impl IntoIterator<Item = f64>) -> Percentiles {
    let Some(mut h) = histogram() else {
        return Percentiles::default();
    };
    for v in values {
        if v.is_finite() && v >= 0.0 {
            let _ = h.record(((v * 1000.0) as u64).clamp(1, 3_600_000_000));
        }
    }
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

/// One router's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    /// Short name (`envoy-round-robin`, `kvroute`, ...).
    pub router: String,
    /// How it was configured, one line.
    pub setup: String,
    pub workload: Description,
    pub time_scale: f64,
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
    /// Modelled seconds from the first send to the last answer.
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Fleet prefix-cache hit rate from the engines' counters (hit tokens /
    /// queried tokens, over the run).
    pub hit_rate: f64,
    /// The same from the answers' `cached_tokens` (first admission only).
    pub hit_rate_from_usage: f64,
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
    /// rerun with a lower `--time-scale`.
    #[serde(default)]
    pub sim_lag_fraction: f64,
    /// Completed requests per engine (from the simulator's answers).
    pub per_engine_requests: Vec<u64>,
    /// Every completed request's TTFT, sorted (for the CDF).
    pub ttft_sorted_ms: Vec<f64>,
    /// The engine timeline (modelled time).
    pub samples: Vec<Sample>,
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

impl RunSummary {
    pub fn new(
        router: &str,
        setup: &str,
        workload: &Description,
        time_scale: f64,
        replay: &Replay,
    ) -> Self {
        let records = &replay.records;
        let ok: Vec<_> = records
            .iter()
            .filter(|r| r.outcome.error.is_none())
            .collect();
        let mut errors_by_class = BTreeMap::new();
        let mut error_examples = Vec::new();
        for r in records {
            if let Some(e) = &r.outcome.error {
                *errors_by_class.entry(error_class(e)).or_insert(0) += 1;
                if error_examples.len() < 5 {
                    error_examples.push(e.clone());
                }
            }
        }
        let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.outcome.ttft_ms).collect();
        ttft.sort_by(f64::total_cmp);
        let output_tokens: u64 = ok
            .iter()
            .map(|r| {
                r.outcome
                    .usage
                    .completion_tokens
                    .unwrap_or(r.outcome.text.len().div_ceil(4) as u64)
            })
            .sum();
        let engines = replay
            .samples
            .iter()
            .map(|s| s.engines.len())
            .max()
            .unwrap_or(0);
        let queries: f64 = (0..engines)
            .map(|e| counter_delta(&replay.samples, e, |r| r.cache_queries))
            .sum();
        let hits: f64 = (0..engines)
            .map(|e| counter_delta(&replay.samples, e, |r| r.cache_hits))
            .sum();
        let preemptions: f64 = (0..engines)
            .map(|e| counter_delta(&replay.samples, e, |r| r.preemptions))
            .sum();
        let lag = (0..engines)
            .map(|e| counter_delta(&replay.samples, e, |r| r.lag_s))
            .fold(0.0, f64::max);
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
        let ceilings = ceiling::ceilings(ok.iter().map(|r| &r.blocks), fleet_blocks as u64);
        let hit_rate = if queries > 0.0 { hits / queries } else { 0.0 };
        let usage_prompt: u64 = ok
            .iter()
            .filter_map(|r| r.outcome.usage.prompt_tokens)
            .sum();
        let usage_cached: u64 = ok
            .iter()
            .filter_map(|r| r.outcome.usage.cached_tokens)
            .sum();
        let (mut spread, mut level, mut n) = (0.0, 0.0, 0usize);
        for s in &replay.samples {
            let kv: Vec<f64> = s.engines.iter().flatten().map(|r| r.kv).collect();
            if kv.len() >= 2 && kv.len() == s.engines.len() {
                let max = kv.iter().copied().fold(f64::MIN, f64::max);
                let min = kv.iter().copied().fold(f64::MAX, f64::min);
                spread += max - min;
                level += kv.iter().sum::<f64>() / kv.len() as f64;
                n += 1;
            }
        }
        let mut per_engine = vec![0u64; engines];
        for r in &ok {
            if let Some(slot) = r
                .outcome
                .usage
                .engine
                .and_then(|e| per_engine.get_mut(e as usize))
            {
                *slot += 1;
            }
        }
        let duration = replay.duration_s.max(1e-9);
        Self {
            router: router.to_owned(),
            setup: setup.to_owned(),
            workload: workload.clone(),
            time_scale,
            requests: records.len() as u64,
            completed: ok.len() as u64,
            errors: (records.len() - ok.len()) as u64,
            errors_by_class,
            error_examples,
            ttft_ms: percentiles(ttft.iter().copied()),
            itl_ms: percentiles(ok.iter().flat_map(|r| r.outcome.itl_ms.iter().copied())),
            e2e_ms: percentiles(ok.iter().map(|r| r.outcome.e2e_ms)),
            queue_ms: percentiles(ok.iter().filter_map(|r| r.outcome.usage.queue_ms)),
            prefill_ms: percentiles(ok.iter().filter_map(|r| r.outcome.usage.prefill_ms)),
            duration_s: replay.duration_s,
            requests_per_s: ok.len() as f64 / duration,
            output_tokens_per_s: output_tokens as f64 / duration,
            hit_rate,
            hit_rate_from_usage: if usage_prompt > 0 {
                usage_cached as f64 / usage_prompt as f64
            } else {
                0.0
            },
            hit_fraction_of_lru: if ceilings.lru_hit_rate > 0.0 {
                hit_rate / ceilings.lru_hit_rate
            } else {
                0.0
            },
            ceilings,
            kv_spread_mean: if n > 0 { spread / n as f64 } else { 0.0 },
            kv_mean: if n > 0 { level / n as f64 } else { 0.0 },
            preemptions,
            sim_lag_fraction: lag / replay.duration_s.max(1e-9),
            per_engine_requests: per_engine,
            ttft_sorted_ms: ttft,
            samples: replay.samples.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

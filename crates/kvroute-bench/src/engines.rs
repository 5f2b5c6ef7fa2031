//! What the engines say about themselves, sampled during a replay.
//!
//! A sampler thread reads every engine's `/metrics` at a fixed real-time
//! interval: KV utilisation, running and waiting requests for the
//! timeline, and the prefix-cache and preemption counters, whose change
//! over the run gives the fleet's hit rate from the engines' own counts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use kvroute_collector::expo;

/// One engine's figures at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineReading {
    pub kv: f64,
    pub running: f64,
    pub waiting: f64,
    pub cache_queries: f64,
    pub cache_hits: f64,
    pub preemptions: f64,
    /// `num_gpu_blocks` of `vllm:cache_config_info`.
    pub kv_blocks: f64,
    pub block_size: f64,
    /// `kvroute_sim_lag_seconds_total`: modelled seconds the simulator fell
    /// behind its clock while busy.
    #[serde(default)]
    pub lag_s: f64,
}

/// Every engine at one moment; `None` for an engine that did not answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    /// Modelled seconds since the replay started.
    pub t_s: f64,
    pub engines: Vec<Option<EngineReading>>,
}

/// Reads one engine's `/metrics`.
pub fn read(agent: &ureq::Agent, base: &str) -> Option<EngineReading> {
    let mut resp = agent.get(format!("{base}/metrics")).call().ok()?;
    if resp.status().as_u16() != 200 {
        return None;
    }
    let text = resp
        .body_mut()
        .with_config()
        .limit(4 << 20)
        .read_to_string()
        .ok()?;
    parse(&text)
}

/// Sums each family over its series (one engine may serve several models).
pub fn parse(text: &str) -> Option<EngineReading> {
    let expo = expo::parse(text, |n| {
        n.starts_with("vllm:") || n.starts_with("kvroute_sim_")
    })
    .ok()?;
    let mut r = EngineReading::default();
    for s in &expo.samples {
        let v = if s.value.is_finite() { s.value } else { 0.0 };
        match s.name {
            "vllm:kv_cache_usage_perc" => r.kv = r.kv.max(v),
            "vllm:num_requests_running" => r.running += v,
            "vllm:num_requests_waiting" => r.waiting += v,
            "vllm:prefix_cache_queries_total" => r.cache_queries += v,
            "vllm:prefix_cache_hits_total" => r.cache_hits += v,
            "vllm:num_preemptions_total" => r.preemptions += v,
            "kvroute_sim_lag_seconds_total" => r.lag_s += v,
            "vllm:cache_config_info" => {
                let num = |k: &str| s.label(k).and_then(|x| x.parse::<f64>().ok());
                r.kv_blocks = num("num_gpu_blocks").unwrap_or(r.kv_blocks);
                r.block_size = num("block_size").unwrap_or(r.block_size);
            }
            _ => {}
        }
    }
    Some(r)
}

/// A running sampler; [`Sampler::finish`] stops it and returns the samples.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<Vec<Sample>>>,
}

impl Sampler {
    pub fn start(engines: Vec<String>, every: Duration, time_scale: f64, started: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = thread::Builder::new()
            .name("sampler".to_owned())
            .spawn(move || {
                let agent = crate::client::agent(Duration::from_secs(2));
                let mut out = Vec::new();
                while !flag.load(Ordering::Relaxed) {
                    let t_s = started.elapsed().as_secs_f64() * time_scale;
                    let readings = engines.iter().map(|e| read(&agent, e)).collect();
                    out.push(Sample {
                        t_s,
                        engines: readings,
                    });
                    thread::sleep(every);
                }
                out
            })
            .ok();
        Self { stop, handle }
    }

    pub fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_families() {
        let text = "\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 1000
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 400
vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 2
vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"25000\"} 1
";
        let r = parse(text).unwrap();
        assert_eq!(r.kv, 0.25);
        assert_eq!(r.running, 3.0);
        assert_eq!(r.cache_hits, 400.0);
        assert_eq!(r.kv_blocks, 25000.0);
        assert_eq!(r.block_size, 16.0);
        assert!(parse("not metrics at all {").is_none());
    }
}

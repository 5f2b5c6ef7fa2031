//! The engine's counters and histograms, and their Prometheus text under
//! vLLM V1's metric names (DESIGN.md, "Engine metrics"). All times are
//! modelled seconds.

use std::fmt::Write;

/// vLLM V1's buckets for `vllm:time_to_first_token_seconds`
/// (`vllm/v1/metrics/loggers.py`).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM V1's buckets for `vllm:inter_token_latency_seconds` (same file).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM V1's request-latency buckets, used for
/// `vllm:e2e_request_latency_seconds` (same file).
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (not cumulative) counts; one more for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub(crate) fn observe(&mut self, v: f64) {
        // A negative or NaN duration would come from a clock mix-up; clamp
        // rather than poison the sum.
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        let i = self.bounds.partition_point(|&b| b < v);
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0u64;
        for (i, &b) in self.bounds.iter().enumerate() {
            cum += self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cum}.0");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0",
            self.count
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.count);
    }
}

/// Counters and histograms since start (or the last reset).
#[derive(Debug, Clone)]
pub(crate) struct Stats {
    /// Prompt tokens looked up in the prefix cache (every admission).
    pub(crate) prefix_queries: u64,
    /// Of those, tokens found cached (and used).
    pub(crate) prefix_hits: u64,
    pub(crate) preemptions: u64,
    /// Prompt tokens of requests whose prefill finished.
    pub(crate) prompt_tokens: u64,
    pub(crate) generation_tokens: u64,
    /// Requests finished (all end at max_tokens: finished_reason "length").
    pub(crate) success: u64,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            success: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// The gauges of one scrape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gauges {
    pub(crate) running: usize,
    pub(crate) waiting: usize,
    /// Blocks in use by running requests / capacity.
    pub(crate) kv_usage: f64,
    pub(crate) num_gpu_blocks: usize,
}

/// Prometheus text of one engine. `model` is the metrics' `model_name`
/// (the first served name, as vLLM labels with its first served name).
pub(crate) fn render(model: &str, g: &Gauges, s: &Stats) -> String {
    let l = format!(
        "engine=\"0\",model_name={}",
        crate::http::json_string(model)
    );
    let mut out = String::with_capacity(8 * 1024);
    let gauge = |out: &mut String, name: &str, help: &str, v: String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        let _ = writeln!(out, "{name}{{{l}}} {v}");
    };
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        format!("{}.0", g.running),
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        format!("{}.0", g.waiting),
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{:?}", g.kv_usage),
    );
    let counter = |out: &mut String, name: &str, help: &str, v: u64| {
        // The text format of vLLM's Prometheus client names counter
        // families with their `_total` suffix.
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        let _ = writeln!(out, "{name}{{{l}}} {v}.0");
    };
    counter(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_hits,
    );
    counter(
        &mut out,
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        s.preemptions,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        s.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        s.generation_tokens,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{l},finished_reason=\"length\"}} {}.0",
        s.success
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"{}\"}} 1.0",
        super::BLOCK_TOKENS,
        g.num_gpu_blocks
    );
    s.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
    );
    s.itl.render(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &l,
    );
    s.e2e.render(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &l,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.1);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        h.render(&mut out, "x", "h", "a=\"1\"");
        assert!(out.contains("x_bucket{a=\"1\",le=\"0.1\"} 2.0"));
        assert!(out.contains("x_bucket{a=\"1\",le=\"1.0\"} 3.0"));
        assert!(out.contains("x_bucket{a=\"1\",le=\"+Inf\"} 4.0"));
        assert!(out.contains("x_count{a=\"1\"} 4.0"));
    }
}

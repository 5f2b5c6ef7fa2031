//! The engine's constants, with the configuration they describe.
//!
//! The defaults model ONE named public configuration: Llama-3.1-8B-Instruct
//! in BF16 on one H100 SXM 80GB under vLLM (V1 engine, OpenAI API server),
//! `gpu_memory_utilization` 0.9. Where each number comes from:
//!
//! * Model (Hugging Face `meta-llama/Llama-3.1-8B-Instruct`, `config.json`):
//!   32 layers, 32 attention heads over hidden size 4096 (head dim 128),
//!   8 KV heads, `max_position_embeddings` 131072; about 8.03e9 parameters,
//!   so the BF16 weights are about 16.1 GB.
//! * KV bytes per token = 2 (K and V) x 32 layers x 8 KV heads x 128 x 2
//!   bytes = 131072 B; a 16-token block is 2 MiB.
//! * H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): HBM3 at
//!   3.35 TB/s, 989 TFLOPS dense BF16 (1979 with sparsity).
//! * KV capacity: vLLM gives the KV cache what is left of
//!   `0.9 x total memory` after weights and the profiled peak of
//!   activations, CUDA graphs and non-torch memory. 0.9 x 79.6 GiB (the
//!   80GB part as the driver reports it) = 77.0 GB; minus 16.1 GB weights
//!   and about 8 GB of the rest leaves about 52.9 GB = 25.2k blocks of
//!   2 MiB; [`EngineConfig::kv_blocks`] takes 25,000 (400k tokens).
//! * Scheduler limits: vLLM's `EngineArgs.get_batch_defaults`
//!   (`vllm/engine/arg_utils.py`) sets, for GPUs with at least 70 GiB that
//!   are not A100s (H100, MI300x) and the OpenAI API server context,
//!   `max_num_batched_tokens` 8192 and `max_num_seqs` 1024 (other GPUs:
//!   2048 and 256).
//! * Step time (a roofline sketch, not a measurement): every step reads
//!   all weights once, 16.1 GB at an achievable ~2.7 TB/s (about 80% of
//!   peak) is ~6 ms ([`EngineConfig::step_fixed_us`]); a prefill token
//!   costs 2 x 8.03e9 FLOP, at ~50% of the BF16 peak ~32 us
//!   ([`EngineConfig::prefill_token_us`]); a decode sequence reads its
//!   context's KV, 131072 B per token at 2.7 TB/s = 0.0485 us
//!   ([`EngineConfig::context_token_us`]), plus a per-sequence constant for
//!   its token's share of compute, sampling and bookkeeping
//!   ([`EngineConfig::decode_seq_us`], 30 us; large batches become compute
//!   bound). With these, one decode stream runs at ~6 ms per token and a
//!   batch of 256 at 1k context at ~26 ms per step.

/// Scheduler limits and step-time constants of one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// KV-cache capacity in blocks of 16 tokens.
    pub kv_blocks: usize,
    /// Most sequences running at once (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Longest sequence, prompt plus output, in tokens (the model's
    /// `max_position_embeddings`; vLLM's `max_model_len`).
    pub max_model_len: usize,
    /// Fixed cost of every step, microseconds.
    pub step_fixed_us: f64,
    /// Cost per prefill token in a step, microseconds.
    pub prefill_token_us: f64,
    /// Cost per decoding sequence in a step, microseconds.
    pub decode_seq_us: f64,
    /// Cost per context token of a decoding sequence, microseconds.
    pub context_token_us: f64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_blocks: 25_000,
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            step_fixed_us: 6000.0,
            prefill_token_us: 32.0,
            decode_seq_us: 30.0,
            context_token_us: 0.0485,
        }
    }
}

impl EngineConfig {
    /// The same model and server on one A100 SXM 80GB, the GPU generation
    /// before the H100, for fleets that mix the two (the simulation's
    /// `--a100-engines`). The roofline of the module doc with the A100's
    /// figures (NVIDIA A100 Tensor Core GPU datasheet: HBM2e at
    /// 2,039 GB/s, 312 TFLOPS dense BF16):
    ///
    /// * weights read at ~80 % of peak bandwidth, 16.1 GB / 1.63 TB/s
    ///   = ~9.9 ms a step;
    /// * a prefill token, 2 x 8.03e9 FLOP at half the BF16 peak = ~103 us;
    /// * a decode sequence's per-token share of compute scales as the
    ///   prefill token does, 30 us x 989 / 312 = ~95 us; its context's KV,
    ///   131072 B per token at 1.63 TB/s = 0.0804 us;
    /// * the same 80 GB of memory, weights and profiled activations: the
    ///   same 25,000 KV blocks;
    /// * vLLM's `get_batch_defaults` gives GPUs other than the H100 and
    ///   MI300x `max_num_batched_tokens` 2048 and `max_num_seqs` 256.
    ///
    /// A prefill runs at about 9k tokens/s, 0.3x the H100's 30k.
    pub fn a100_80gb() -> Self {
        Self {
            kv_blocks: 25_000,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 131_072,
            step_fixed_us: 9900.0,
            prefill_token_us: 103.0,
            decode_seq_us: 95.0,
            context_token_us: 0.0804,
        }
    }

    /// The configurations of a fleet of `engines`: `self` for each, but the
    /// last `a100_engines`, which model an A100 ([`EngineConfig::a100_80gb`]):
    /// a fleet of two GPU generations, for the real engines and the
    /// virtual-time simulation alike.
    pub fn fleet(&self, engines: usize, a100_engines: usize) -> Vec<EngineConfig> {
        let first_a100 = engines.saturating_sub(a100_engines);
        (0..engines)
            .map(|i| {
                if i >= first_a100 {
                    EngineConfig::a100_80gb()
                } else {
                    self.clone()
                }
            })
            .collect()
    }
}

/// Why an [`EngineConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl EngineConfig {
    /// Checks every field; the error names the field, the value and why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("kv_blocks", self.kv_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(ConfigError(format!("{name} = 0: must be at least 1")));
            }
        }
        let times = [
            ("step_fixed_us", self.step_fixed_us),
            ("prefill_token_us", self.prefill_token_us),
            ("decode_seq_us", self.decode_seq_us),
            ("context_token_us", self.context_token_us),
        ];
        for (name, v) in times {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError(format!(
                    "{name} = {v}: must be a finite number >= 0"
                )));
            }
        }
        if self.step_fixed_us + self.prefill_token_us <= 0.0 {
            return Err(ConfigError(
                "step_fixed_us + prefill_token_us = 0: a step must take time".to_owned(),
            ));
        }
        Ok(())
    }

    /// Modelled duration of one step, microseconds: fixed + per prefill
    /// token x prefill tokens + for every decoding sequence (per sequence +
    /// per context token x its context length).
    pub fn step_time_us(&self, prefill_tokens: usize, decode_contexts: &[usize]) -> f64 {
        let decode: f64 = decode_contexts
            .iter()
            .map(|&ctx| self.decode_seq_us + self.context_token_us * ctx as f64)
            .sum();
        self.step_fixed_us + self.prefill_token_us * prefill_tokens as f64 + decode
    }

    /// Prompt tokens per second of a long prefill alone on the engine: full
    /// chunks of `max_num_batched_tokens`, one step each.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        let chunk = self.max_num_batched_tokens.max(1);
        chunk as f64 * 1e6 / self.step_time_us(chunk, &[]).max(1.0)
    }

    /// Modelled seconds from arrival to first token for a request alone on
    /// an idle engine with `cached` of its `prompt` tokens in the prefix
    /// cache: its uncached tokens (at least one) in chunks of
    /// `max_num_batched_tokens`, one step each, the last one sampling the
    /// first token. No router can do better for that request; the
    /// benchmark's no-queue TTFT floor is this with the fleet-LRU ceiling's
    /// cached prefix.
    pub fn idle_ttft_s(&self, prompt: usize, cached: usize) -> f64 {
        let mut left = prompt.saturating_sub(cached).max(1);
        let chunk = self.max_num_batched_tokens.max(1);
        let mut us = 0.0;
        while left > 0 {
            let n = left.min(chunk);
            us += self.step_time_us(n, &[]);
            left -= n;
        }
        us / 1e6
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn step_time_formula() {
        let c = EngineConfig {
            step_fixed_us: 100.0,
            prefill_token_us: 2.0,
            decode_seq_us: 10.0,
            context_token_us: 0.5,
            ..EngineConfig::default()
        };
        assert!((c.step_time_us(0, &[]) - 100.0).abs() < 1e-9);
        assert!((c.step_time_us(50, &[]) - 200.0).abs() < 1e-9);
        // 100 + 2*50 + (10 + 0.5*20) + (10 + 0.5*40)
        assert!((c.step_time_us(50, &[20, 40]) - 250.0).abs() < 1e-9);
    }

    #[test]
    fn defaults_are_valid_and_near_the_derivation() {
        let c = EngineConfig::default();
        assert!(c.validate().is_ok());
        // One decode stream at ~6 ms per token.
        let one = c.step_time_us(0, &[1000]);
        assert!((6000.0..6200.0).contains(&one));
        let bad = EngineConfig {
            kv_blocks: 0,
            ..EngineConfig::default()
        };
        assert!(bad.validate().unwrap_err().0.contains("kv_blocks"));
    }

    #[test]
    fn the_a100_is_valid_and_prefills_at_about_a_third_of_the_h100() {
        let a = EngineConfig::a100_80gb();
        assert!(a.validate().is_ok());
        let h = EngineConfig::default();
        // Tokens per second of a long prefill, chunk after chunk.
        let rate = |c: &EngineConfig| 32_768.0 / c.idle_ttft_s(32_768, 0);
        let ratio = rate(&a) / rate(&h);
        assert!((rate(&a) - a.prefill_tokens_per_s()).abs() < 1.0);
        assert!((rate(&h) - h.prefill_tokens_per_s()).abs() < 1.0);
        // The H100's is kvroute's default `prefillTokensPerS` (30k), within 2 %.
        assert!((h.prefill_tokens_per_s() / 30_000.0 - 1.0).abs() < 0.02);
        assert!(
            (0.25..0.35).contains(&ratio),
            "A100 / H100 prefill rate {ratio}"
        );
        // One decode stream: the weight read dominates, ~1.6x slower.
        let one = a.step_time_us(0, &[1000]) / h.step_time_us(0, &[1000]);
        assert!((1.5..1.8).contains(&one), "one decode stream {one}");
    }

    #[test]
    fn idle_ttft_is_the_chunked_prefill_of_the_uncached_part() {
        let c = EngineConfig {
            step_fixed_us: 100.0,
            prefill_token_us: 1.0,
            max_num_batched_tokens: 1000,
            ..EngineConfig::default()
        };
        // 2500 uncached tokens: chunks of 1000, 1000, 500.
        assert!((c.idle_ttft_s(3000, 500) - (3.0 * 100.0 + 2500.0) / 1e6).abs() < 1e-12);
        // A fully cached prompt still computes one token.
        assert!((c.idle_ttft_s(64, 64) - 101.0 / 1e6).abs() < 1e-12);
    }
}

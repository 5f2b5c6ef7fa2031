//! kvroute-sim: simulated inference engines for kvroute's benchmarks.
//!
//! [`engine`] is the realistic engine (the default mode): a paged KV cache
//! with prefix caching, continuous batching with chunked prefill and
//! preemption, and a step-time model of one named GPU configuration, behind
//! a vLLM-like HTTP surface. Its pure parts ([`engine::chat_prompt`],
//! [`engine::block_hashes`], [`engine::cacheable_hit_blocks`]) are shared
//! with the benchmark, which uses them to compute hit-rate ceilings.
//!
//! [`null`] is the "null" engine: it answers every completion request at
//! once with a small fixed OpenAI-style body, so that in a gateway benchmark
//! the gateway, not the upstream, is the bottleneck.

pub mod engine;
mod http;
pub mod null;

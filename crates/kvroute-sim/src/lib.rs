//! kvroute-sim: simulated inference engines for kvroute's benchmarks.
//!
//! [`null`] is the "null" engine: it answers every completion request at
//! once with a small fixed OpenAI-style body, so that in a gateway benchmark
//! the gateway, not the upstream, is the bottleneck. Later modes (a
//! realistic engine with queueing, prefill and a KV cache) live next to it.

pub mod null;

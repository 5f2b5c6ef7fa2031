//! kvroute-collector: the sidecar that tells kvroute's gateways what every
//! inference engine is doing.
//!
//! It scrapes each engine's `/health` and `/metrics` (vLLM, SGLang,
//! TensorRT-LLM), turns them into one [`kvroute_core::fleet::Snapshot`] (KV
//! utilisation and capacity, queue and batch sizes, readiness, served models
//! and LoRA adapters), and pushes it to every gateway's ingest endpoint (the
//! configured ones, and every address a gateway service resolves to), where
//! the kvroute filter stores it in shared data.
//!
//! ```text
//!   discovery (static ip:port, DNS names re-resolved)
//!        | engine set
//!        v
//!   collector loop  <--- one scrape worker per engine: GET /health, GET /metrics
//!        | snapshot JSON (every push-interval, and at once on a readiness change)
//!        v
//!   one pusher per gateway: POST <gateway>/v1/fleet/snapshot (Bearer token)
//!        ^ gateways come and go with gateway discovery (--gateway-service, DNS)
//! ```
//!
//! In the sidecar layout (a collector in each gateway pod, pushing to its
//! own gateway only) `--peer-gateway-service` names the other replicas:
//! their in-flight load is read for the snapshots, nothing is pushed to
//! them ([`push`]).
//!
//! Modules:
//!
//! - [`config`]: TOML file, flags and environment, validated into `Settings`;
//! - [`discovery`]: the `Discovery` trait, static and DNS sources, and how
//!   EndpointSlice discovery would plug in;
//! - [`expo`]: the Prometheus text exposition reader;
//! - [`engines`]: engine metric families to snapshot figures;
//! - [`scrape`]: one engine's scrape, backoff, and its worker thread;
//! - [`collector`]: the loop, the fleet state and snapshot assembly;
//! - [`push`]: the per-gateway pushers and refusal handling;
//! - [`metrics`]: the collector's own metrics and their endpoint.
//!
//! The collector never panics on input: unreachable engines, garbage bodies,
//! NaN values and refusing gateways are logged (once per change of state),
//! counted, and reflected in the snapshot; the loop keeps going.

#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

pub mod collector;
pub mod config;
pub mod discovery;
pub mod engines;
pub mod expo;
pub mod metrics;
pub mod push;
pub mod scrape;

pub use collector::{collect_once, start, start_with, Running, StartError};
pub use config::{Cli, ConfigError, Settings};

/// The collector's clock: Unix time in milliseconds (0 if the clock is
/// before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

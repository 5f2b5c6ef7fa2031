//! kvroute-core: the pure routing logic of kvroute, with no proxy-wasm
//! dependency, shared by the filter, the collector, the simulator and the
//! benchmark.
//!
//! - [`request`]: which requests are parsed, and their canonical byte stream;
//! - [`hash`]: chained prefix block hashes over that stream;
//! - [`picker`]: rendezvous preference order and bounded load;
//! - [`load`]: the gateway's in-flight token accounting in shared data;
//! - [`index`]: the gateway's prefix index in shared data;
//! - [`placed`]: key memory, where a gateway placed keys off their home,
//!   shared with the other gateways through the collector;
//! - [`decide`]: affinity key and cost, and the decision for one request;
//! - [`usage`]: what answers say (output length, cached tokens);
//! - [`answers`]: the cached tokens an answer reports against the index's
//!   expectation, and the entries it drops;
//! - [`rates`]: which replicas prefill slower than the others, learned
//!   from answers;
//! - [`admit`]: objectives, priorities and the queue of held requests
//!   when the fleet is saturated;
//! - [`config`]: plugin JSON, validated and compiled;
//! - [`host`]: the narrow host traits (shared data, metrics) and test doubles.

#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

pub mod admit;
pub mod answers;
pub mod config;
pub mod decide;
pub mod fleet;
pub mod hash;
pub mod host;
pub mod index;
pub mod ingest;
pub mod load;
pub mod picker;
pub mod placed;
pub mod rates;
pub mod request;
pub mod score;
pub mod split;
pub mod usage;

pub use config::{Config, ConfigError};
pub use decide::{analyze, route, Decision, Facts, Reason, Unparsed};
pub use request::Endpoint;

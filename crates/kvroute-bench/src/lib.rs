//! kvroute-bench: measures routing quality on the simulated fleet.
//!
//! ```text
//!   workload (Mooncake trace | chat sessions | shared-prefix groups)
//!        | open-loop replay, streamed chat completions
//!        v
//!   router under test  -->  simulated engines (kvroute-sim --mode engine)
//!        ^                        | /metrics sampled during the run
//!   per-request TTFT, ITL, E2E    v
//!        \-------------------> run summary (one router) --> report (all routers)
//! ```
//!
//! - [`workload`]: trace reader and generators; [`families`]: the workload suite;
//! - [`sim`]: the fleet simulation in virtual time (`simulate`, `suite`);
//!   [`overload`]: admission control under overload in it (`overload`);
//! - [`replay`] and [`client`]: the open-loop client;
//! - [`engines`]: the engine sampler;
//! - [`ceiling`]: hit-rate ceilings on the same requests;
//! - [`records`]: every request as a JSON line (fault and soak runs);
//! - [`summary`]: one run's figures; [`report`] and [`plot`]: the comparison.
//!
//! `scripts/bench.py` starts the fleet and each router in turn and calls
//! this binary (`replay`, then `report`).

#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)
)]

pub mod ceiling;
pub mod client;
pub mod engines;
pub mod families;
pub mod overload;
pub mod plot;
pub mod records;
pub mod replay;
pub mod report;
pub mod rng;
pub mod sim;
pub mod suite;
pub mod summary;
pub mod workload;

//! One request's work in kvroute-core, as the filter does it, in a loop: for
//! profiling the request path natively with callgrind (the issue of gateway
//! overhead suggests it; Envoy's V8 cannot be profiled by function).
//!
//! Per iteration, like `src/lib.rs` for a chat request with a fleet snapshot:
//! `analyze` the body, look at the snapshot stamp (`FleetCache::refresh_at`),
//! `route` (prefix index through the worker's cache, load table
//! compare-and-swap, fleet score and pick, index record), the destination
//! and explain header values, then the two releases. The host is
//! `MemorySharedData`, so host calls cost a hash-map lookup here; in Envoy
//! each is a call out of the VM (see docs/benchmarks.md).
//!
//! The fleet is the gateway overhead benchmark's: 64 hosts, 4 ready, 60 not.
//! Bodies are 16 real-shaped chat bodies of about `--kb` KB, rotated.
//!
//!     cargo build --profile bench -p kvroute-core --example request_path
//!     valgrind --tool=callgrind --callgrind-out-file=/tmp/rp.out \
//!       target/release/examples/request_path --kb 1 --iters 20000
//!     callgrind_annotate --inclusive=yes /tmp/rp.out | head -60

#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used)]

use kvroute_core::decide::{self, analyze};
use kvroute_core::fleet::{HostState, Snapshot, SNAPSHOT_VERSION};
use kvroute_core::host::{MemorySharedData, Tally};
use kvroute_core::index::IndexCache;
use kvroute_core::ingest::{self, FleetCache};
use kvroute_core::load::Charge;
use kvroute_core::{Config, Endpoint};
use std::hint::black_box;

#[path = "../benches/common/mod.rs"]
#[allow(dead_code)] // config(): the benches' static hosts
mod common;
use common::chat_body;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const TOKEN: &str = "profile-token-0123456789";

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let kb = arg("--kb", 1);
    let iters = arg("--iters", 20_000);
    let now = 1_764_400_000_000u64;
    let hosts: Vec<HostState> = (0..64)
        .map(|i| HostState {
            address: format!("127.0.0.{}:{}", 1 + i / 60, 18000 + i),
            ready: i < 4,
            draining: false,
            models: vec![MODEL.into()],
            kv_utilization: 0.1,
            waiting: 0,
            running: 1,
            kv_capacity_tokens: Some(456_000),
            block_size: Some(16),
            scraped_at_ms: now,
            engine: Some("vllm".into()),
            peer_pending_tokens: None,
            peer_arrivals_per_s: None,
            prefill_tokens_per_s: None,
        })
        .collect();
    let addresses: Vec<String> = hosts.iter().map(|h| format!("\"{}\"", h.address)).collect();
    let cfg = Config::from_json(format!(r#"{{"hosts":[{}]}}"#, addresses.join(",")).as_bytes())
        .expect("config");
    let ingest_cfg = Config::from_json(
        format!(r#"{{"role":"ingest","ingest":{{"token":"{TOKEN}"}}}}"#).as_bytes(),
    )
    .expect("ingest config");
    let snapshot = Snapshot {
        placed: Vec::new(),
        last_blocks: Vec::new(),
        version: SNAPSHOT_VERSION,
        seq: 1,
        collector: "profile".into(),
        taken_at_ms: now,
        hosts,
    }
    .to_json();
    let store = MemorySharedData::default();
    let stored = ingest::store(&ingest_cfg, &store, &snapshot, now);
    assert!(
        matches!(stored, ingest::Outcome::Accepted { .. }),
        "{stored:?}"
    );

    let bodies: Vec<Vec<u8>> = (0..16)
        .map(|v| {
            let b = chat_body(kb << 10);
            // 16 variants, as the benchmark rotates: they differ in the
            // first block (the system prompt's first word).
            let at = b
                .windows(11)
                .position(|w| w == b"\"content\":\"")
                .map_or(0, |p| p + 11);
            let mut v = format!("variant {v:02} ").into_bytes();
            v.extend_from_slice(&b[at..]);
            [&b[..at], &v[..]].concat()
        })
        .collect();
    let tally = Tally::default();
    let mut fleet = FleetCache::default();
    let mut cache = IndexCache::default();
    let mut routed = 0usize;
    for i in 0..iters {
        let t = now + (i / 10) as u64; // about 10 requests per ms
        let body = &bodies[i % bodies.len()];
        let facts = analyze(&cfg, Endpoint::ChatCompletions, None, black_box(body));
        let (view, _) = fleet.refresh_at(&cfg, &store, t);
        let view = view.expect("a snapshot");
        let d = decide::route(
            &cfg,
            &store,
            &tally,
            &mut cache,
            facts.as_ref().map_err(|u| *u),
            Some(&view),
            t,
            i as u64,
        );
        if i == 0 {
            eprintln!(
                "first decision: {} ({:?})",
                decide::explain(&d),
                facts.as_ref().err()
            );
        }
        black_box(decide::destination(&d));
        black_box(decide::explain(&d));
        if let Some(c) = d.charge {
            decide::release(&cfg, &store, &tally, Charge { memory: 0, ..c });
            decide::release(&cfg, &store, &tally, Charge { prefill: 0, ..c });
            routed += 1;
        }
    }
    println!("{iters} requests of {kb} KB, {routed} routed");
}

//! What a gateway reads back that it did not check when it was written,
//! and what a collector reads from a gateway:
//!
//! - `LoadReport::from_json`, the collector's decode of a gateway's
//!   `GET /v1/fleet/load` answer (from the network);
//! - `LoadTable::decode`, the router's decode of its load table in shared
//!   data (written by any worker of any plugin version sharing the key, or
//!   corrupt);
//! - the same bytes planted as every shared-data value a request reads:
//!   the load table, the placement and last-block rings
//!   ([`kvroute_core::placed`]), and
//!   (after the block hash each must name) the prefix-index slots of the
//!   request's blocks and of its key memory; then one request is
//!   routed, charged, released, and the ring is read and appended to, as
//!   the filter does.
//!
//! Checks, besides "never panics" (cargo-fuzz builds with debug
//! assertions, so arithmetic overflow panics too): an accepted report keeps
//! its bounds and survives a JSON round trip; a decoded table survives an
//! encode/decode round trip, and the report a gateway makes of it is one
//! a collector accepts; whatever shared data holds, the request gets 1 to
//! `fallbacks + 1` targets, the rings stay within `placed::RING` and
//! `placed::LAST_RING`, and a note after a report loses at most the one
//! entry it pushes out.

#![no_main]

use std::sync::LazyLock;

use kvroute_core::decide;
use kvroute_core::fleet::MAX_HOSTS;
use kvroute_core::host::{MemoryMetrics, MemorySharedData, SharedData};
use kvroute_core::index::{Index, IndexCache};
use kvroute_core::load::{self, LoadReport, LoadTable};
use kvroute_core::placed;
use kvroute_core::{analyze, Config, Endpoint};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: kvroute_fuzz::Capped = kvroute_fuzz::Capped;

/// A router with four hosts and key memory (the default `coldHomeShare`).
static ROUTER: LazyLock<Config> = LazyLock::new(|| {
    let json = r#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"]}"#;
    match Config::from_json(json.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("fuzz config rejected: {e}"),
    }
});

const BODY: &[u8] = br#"{"model":"m","max_tokens":64,"messages":[
    {"role":"system","content":"You are a helpful assistant. Answer briefly and cite your sources."},
    {"role":"user","content":"What is the capital of France, and how many people live there?"}]}"#;

const NOW_MS: u64 = 1_764_400_000_000;

fuzz_target!(|bytes: &[u8]| {
    let cfg = &*ROUTER;
    let window = cfg.fleet.arrival_window_ms;

    // A collector reading a gateway's load report.
    if let Ok(r) = LoadReport::from_json(bytes) {
        assert!(r.hosts.len() <= MAX_HOSTS);
        assert!(r.placed.as_ref().map_or(0, Vec::len) <= placed::RING);
        assert!(r.last_blocks.as_ref().map_or(0, Vec::len) <= placed::LAST_RING);
        // A round trip keeps everything; a rate may move by an ulp or two
        // (serde_json's default float parsing is not exact for every
        // value, found by this target).
        let mut again = LoadReport::from_json(&r.to_json()).expect("report round trip");
        for (a, b) in again.hosts.iter_mut().zip(&r.hosts) {
            if let (Some(x), Some(y)) = (a.arrivals_per_s, b.arrivals_per_s) {
                assert!((x - y).abs() <= 1e-12 * y.abs().max(1.0), "rate {x} vs {y}");
                a.arrivals_per_s = b.arrivals_per_s;
            }
        }
        assert_eq!(again, r, "report round trip");
    }

    // The load table as shared data holds it.
    if let Ok(t) = LoadTable::decode(bytes) {
        assert_eq!(
            LoadTable::decode(&t.encode()).ok(),
            Some(t.clone()),
            "table round trip"
        );
        let _ = (t.totals(), t.loads_for(&cfg.hosts), t.aligned(&cfg.hosts));
        for e in t.entries() {
            let _ = t.arrival_rate(e.host, NOW_MS, window);
        }
        let report = LoadReport::of(&t, &[&cfg.hosts], NOW_MS, window);
        let sent = LoadReport::from_json(&report.to_json());
        assert!(
            sent.is_ok(),
            "a collector refuses the gateway's own report: {sent:?}"
        );
    }

    // The same bytes as every value the request path reads.
    let Ok(facts) = analyze(cfg, Endpoint::ChatCompletions, Some("session-1"), BODY) else {
        panic!("the fixed body no longer parses");
    };
    let store = MemorySharedData::default();
    for key in [
        &cfg.load_key,
        &cfg.fleet.placed_key,
        &cfg.fleet.last_blocks_key,
    ] {
        assert!(store.set(key, bytes, None).is_ok());
    }
    // An index entry is read only if it names the block it is looked up
    // for: each slot gets the block's hash, then the input past its first
    // eight bytes (the owners). So does the key memory's slot.
    let index = Index::of(&cfg.fleet);
    let key_block = placed::key_block(facts.affinity.key());
    for b in facts.blocks.iter().copied().chain([key_block]) {
        let mut value = b.to_le_bytes().to_vec();
        value.extend_from_slice(bytes.get(8..).unwrap_or_default());
        assert!(store.set(&index.key(b), &value, None).is_ok());
    }
    let metrics = MemoryMetrics::default();
    let mut cache = IndexCache::default();
    let d = decide::route(
        cfg,
        &store,
        &metrics,
        &mut cache,
        Ok(&facts),
        None,
        NOW_MS,
        0,
    );
    assert!(!d.targets.is_empty(), "no target");
    assert!(d.targets.len() <= cfg.fallbacks + 1);
    let _ = (decide::destination(&d), decide::explain(&d));
    if let Some(charge) = d.charge {
        decide::release(cfg, &store, &metrics, charge);
    }
    let table = load::read(&store, &cfg.load_key);
    let _ = LoadReport::of(&table, &[&cfg.hosts], NOW_MS, window).to_json();
    placed::note(&store, &cfg.fleet.placed_key, 7, 7, NOW_MS);
    let reported = placed::report(&store, &cfg.fleet.placed_key, &[&cfg.hosts], NOW_MS);
    assert!(reported.len() <= placed::RING);
    // The ring is now within RING entries and was just read: one more
    // note pushes out at most one entry.
    assert!(placed::note(&store, &cfg.fleet.placed_key, 8, 7, NOW_MS) <= 1);
    // The last-block ring likewise, once a report has read it.
    let last = &cfg.fleet.last_blocks_key;
    placed::report_last(&store, last, &[&cfg.hosts], NOW_MS);
    assert!(placed::note_last(&store, last, 7, 3, 7, NOW_MS).is_some());
    let reported = placed::report_last(&store, last, &[&cfg.hosts], NOW_MS);
    assert!(reported.len() <= placed::LAST_RING);
    let lost = placed::note_last(&store, last, 8, 3, 7, NOW_MS);
    assert!(lost.is_some_and(|n| n <= 1));
});

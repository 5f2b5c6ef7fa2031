//! The ingest role's path for a pushed body: `ingest::store` (size limit,
//! `Snapshot::from_json` = serde decode + `validate`, stamp, compare-and-swap
//! into shared data), over the in-memory `SharedData` double; then the
//! router side of the same store: `FleetCache::refresh` decodes what ingest
//! stored into a `FleetView`.
//!
//! Checks, besides "never panics": whatever ingest accepts, a router decodes
//! (same seq, at most `MAX_HOSTS` hosts) and decodes only once; the same
//! push again is refused as stale; the error bodies render. Last, the raw
//! input is planted in shared data as if it were a stored value (header
//! included), and a router refreshes from it: a corrupt or foreign value in
//! shared data must not panic the router either.

#![no_main]

use std::sync::LazyLock;

use kvroute_core::config::Config;
use kvroute_core::fleet::{Stamp, MAX_HOSTS};
use kvroute_core::host::{MemorySharedData, SharedData};
use kvroute_core::ingest::{self, FleetCache, Outcome, Refresh};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: kvroute_fuzz::Capped = kvroute_fuzz::Capped;

/// examples/ingest.json's settings, and a router sharing its prefix.
static INGEST: LazyLock<Config> = LazyLock::new(|| {
    config(
        r#"{"role":"ingest","sharedDataPrefix":"kvroute",
            "ingest":{"token":"kvroute-local-dev-token-REPLACE-ME","maxBytes":4194304}}"#,
    )
});
static ROUTER: LazyLock<Config> =
    LazyLock::new(|| config(r#"{"hosts":["127.0.0.1:8001"],"sharedDataPrefix":"kvroute"}"#));

fn config(json: &str) -> Config {
    match Config::from_json(json.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("fuzz config rejected: {e}"),
    }
}

const NOW_MS: u64 = 1_764_400_000_000;

fuzz_target!(|body: &[u8]| {
    let store = MemorySharedData::default();
    let outcome = ingest::store(&INGEST, &store, body, NOW_MS);
    // The filter logs and answers every outcome.
    let _ = (outcome.status(), outcome.body(), outcome.counter());
    let mut cache = FleetCache::default();
    let (view, refresh) = cache.refresh(&ROUTER, &store);
    match outcome {
        Outcome::Accepted { seq } => {
            let view = match (view, refresh) {
                (Some(v), Refresh::Decoded) => v,
                (_, r) => panic!("accepted seq {seq} but the router got {r:?}"),
            };
            assert_eq!(view.seq, seq);
            assert_eq!(view.ingested_at_ms, NOW_MS);
            assert!(view.hosts.len() <= MAX_HOSTS);
            let _ = view.age_ms(NOW_MS + 1);
            let (_, again) = cache.refresh(&ROUTER, &store);
            assert_eq!(again, Refresh::Unchanged, "decoded twice");
            let replay = ingest::store(&INGEST, &store, body, NOW_MS + 1);
            assert!(
                matches!(replay, Outcome::Stale { stored, pushed } if stored == seq && pushed == seq),
                "replay of seq {seq} answered {replay:?}"
            );
        }
        Outcome::Invalid(_) | Outcome::TooLarge { .. } => {
            assert!(view.is_none() && refresh == Refresh::Unchanged);
            assert!(store.is_empty(), "a refused push was stored");
        }
        other => panic!("unexpected outcome on an empty store: {other:?}"),
    }

    // A value in shared data that ingest did not vet.
    let planted = MemorySharedData::default();
    let header = body.get(..16).and_then(Stamp::decode);
    let stamp = header.map_or([0u8; 16], |h| h.encode());
    let set = planted
        .set(&ROUTER.fleet.stamp_key, &stamp, None)
        .and_then(|()| planted.set(&ROUTER.fleet.snapshot_key, body, None));
    assert!(set.is_ok());
    let mut cache = FleetCache::default();
    let _ = cache.refresh(&ROUTER, &planted);
});

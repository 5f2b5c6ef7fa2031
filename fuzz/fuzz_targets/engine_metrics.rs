//! The collector's reading of an engine's `/metrics` body, as the scrape
//! worker runs it: UTF-8 check, then `engines::interpret` (engine detection
//! and families to figures) on top of `expo::parse` (the exposition
//! reader). `expo::parse` also runs alone, keeping every sample, so the
//! label reader sees every line the fuzzer makes.
//!
//! Checks, besides "never panics": the figures stay in the ranges the
//! snapshot allows, and the host the collector builds from them passes the
//! gateway's snapshot validation and survives a JSON round trip. A metrics
//! page, however odd, must never make the gateway refuse the push.

#![no_main]

use std::net::SocketAddr;

use kvroute_collector::collector::{build_snapshot, EngineState};
use kvroute_collector::{engines, expo};
use kvroute_core::fleet::{Snapshot, MAX_MODELS_PER_HOST, MAX_NAME_LEN};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: kvroute_fuzz::Capped = kvroute_fuzz::Capped;

fuzz_target!(|body: &[u8]| {
    // scrape.rs refuses a body that is not UTF-8 before parsing it.
    let Ok(text) = std::str::from_utf8(body) else {
        return;
    };

    if let Ok(all) = expo::parse(text, |_| true) {
        assert!(all.good_lines >= 1 && all.bad_lines <= all.good_lines);
        assert_eq!(all.samples.len(), all.good_lines);
        for s in &all.samples {
            assert!(!s.name.is_empty());
            for (k, v) in s.labels() {
                assert!(!k.is_empty(), "empty label name in {:?}", s.name);
                let _ = v.len();
            }
            let _ = s.label("model_name");
        }
    }

    let Ok(m) = engines::interpret(text) else {
        return;
    };
    assert!(m.kv_utilization.is_none_or(|v| (0.0..=1.0).contains(&v)));
    assert!(m.block_size != Some(0));
    assert!(m.models.len() <= MAX_MODELS_PER_HOST);
    assert!(m
        .models
        .iter()
        .all(|n| !n.is_empty() && n.len() <= MAX_NAME_LEN));

    let addr = SocketAddr::from(([10, 0, 0, 11], 8000));
    let mut state = EngineState::default();
    state.reported = true;
    state.ready = true;
    state.last_good = Some(m);
    state.scraped_at_ms = 1_764_399_999_900;
    let snap = build_snapshot("fuzz", 1, 1_764_400_000_000, [(&addr, &state)]);
    if let Err(e) = snap.validate() {
        panic!("the gateway would refuse this host: {e}");
    }
    match Snapshot::from_json(&snap.to_json()) {
        Ok(mut back) => {
            // serde_json may read a float back one ulp off (no
            // float_roundtrip feature): compare KV usage with a tolerance.
            for (b, h) in back.hosts.iter_mut().zip(&snap.hosts) {
                assert!((b.kv_utilization - h.kv_utilization).abs() <= 1e-12);
                b.kv_utilization = h.kv_utilization;
            }
            assert_eq!(back, snap);
        }
        Err(e) => panic!("snapshot JSON does not decode: {e}"),
    }
});

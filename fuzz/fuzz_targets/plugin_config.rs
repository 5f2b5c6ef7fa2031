//! The plugin config loader, as `on_configure` runs it on the bytes Envoy
//! hands over: `Config::from_json` (serde with `deny_unknown_fields` ->
//! validate -> compile).
//!
//! Checks, besides "never panics": a refusal names a field and a reason
//! (that is Envoy's log line), and every config that is accepted keeps the
//! bounds the request path relies on and can route a request: a small body
//! is analysed and decided under it (with the in-memory host doubles), the
//! way the filter's first request would be.

#![no_main]

use kvroute_core::config::{Role, MAX_BODY_BYTES, MAX_FALLBACKS, MAX_HOSTS};
use kvroute_core::admit::{self, Objective};
use kvroute_core::decide;
use kvroute_core::host::{MemoryMetrics, MemorySharedData};
use kvroute_core::index::IndexCache;
use kvroute_core::load;
use kvroute_core::{analyze, Config, Endpoint};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: kvroute_fuzz::Capped = kvroute_fuzz::Capped;

const BODY: &[u8] = br#"{"model":"m","max_tokens":64,"messages":[
    {"role":"system","content":"You are a helpful assistant."},
    {"role":"user","content":"What is the capital of France?"}]}"#;

fuzz_target!(|bytes: &[u8]| {
    let config = match Config::from_json(bytes) {
        Ok(c) => c,
        Err(e) => {
            // Envoy's log line. (The field can be empty: a syntax error
            // right after an empty key `""` has the path `""`.)
            assert!(!e.reason.is_empty());
            let _ = e.to_string();
            return;
        }
    };
    assert!(config.hosts.len() <= MAX_HOSTS);
    assert!(config.fallbacks <= MAX_FALLBACKS as usize);
    assert!(config.max_body_bytes >= 1 && config.max_body_bytes as u64 <= MAX_BODY_BYTES);
    assert!(config.block_bytes >= 16 && config.max_blocks >= 1);
    assert!(config.affinity_blocks >= 1 && config.affinity_blocks <= config.max_blocks);
    assert!(config.epsilon.is_finite() && config.epsilon > 0.0);
    match config.role {
        Role::Router => assert!(!config.hosts.is_empty()),
        Role::Ingest => assert!(config.ingest.is_some()),
    }

    let facts = analyze(&config, Endpoint::ChatCompletions, Some("session-1"), BODY);
    let store = MemorySharedData::default();
    let metrics = MemoryMetrics::default();
    // Admission as the filter runs it before the pick: the objective of
    // a configured name and of an unknown one, the verdict, and a hold.
    if let Ok(f) = facts.as_ref() {
        let a = &config.admission;
        let table = load::read(&store, &config.load_key);
        let room = decide::headroom(&config, f, None, &table, 1);
        assert!(room, "no snapshot: admission never holds");
        let mut queue: admit::Queue<()> = admit::Queue::new(a);
        for name in a.objectives.iter().map(|(n, _)| n.as_str()).chain(["unknown"]) {
            let o = Objective::of(a, Some(name));
            let _ = (o.name(a), o.slot(), admit::arrive(a, o, room, &queue, |_| true));
            let _ = queue.push(1, o.priority, f.affinity.key(), 1, ());
        }
        assert!(queue.len() <= a.max_queue);
    }
    let d = decide::route(
        &config,
        &store,
        &metrics,
        &mut IndexCache::default(),
        facts.as_ref().map_err(|u| *u),
        None,
        1,
        0,
    );
    if config.role == Role::Router {
        assert!(!d.targets.is_empty(), "a router config that routes nowhere");
        assert!(d.targets.len() <= config.fallbacks + 1);
    }
    let _ = (decide::destination(&d), decide::explain(&d));
    if let Some(charge) = d.charge {
        decide::release(&config, &store, &metrics, charge);
    }
});

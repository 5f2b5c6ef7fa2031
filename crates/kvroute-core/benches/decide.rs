//! Parse + hash + pick for chat bodies of 1 KB, 32 KB and 128 KB, with 8, 256 and
//! 1,024 hosts: the decision kvroute makes on every request, without the host.
//!
//! `cargo bench -p kvroute-core --bench decide`

#![allow(clippy::indexing_slicing, clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::admit::{arrive, Objective, Queue};
use kvroute_core::decide::{analyze, headroom, pick, route};
use kvroute_core::fleet::{FleetView, HostState, Snapshot, SNAPSHOT_VERSION};
use kvroute_core::host::{MemorySharedData, SharedData, Tally};
use kvroute_core::index::{Index, IndexCache};
use kvroute_core::load::{Charge, LoadTable};
use kvroute_core::placed::{self, LastBlock};
use kvroute_core::split::SharedSplits;
use kvroute_core::{Config, Endpoint};
use std::hint::black_box;
use std::time::Instant;

mod common;
use common::{chat_body, config, loads};

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide");
    for size in [1 << 10, 32 << 10, 128 << 10] {
        let body = chat_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        for hosts in [8usize, 256, 1024] {
            let Some(cfg) = config(hosts) else { continue };
            let table = loads(&cfg);
            let id = BenchmarkId::new(format!("{}KB", size >> 10), format!("{hosts}hosts"));
            group.bench_with_input(id, &body, |b, body| {
                b.iter(|| {
                    let facts = analyze(&cfg, Endpoint::ChatCompletions, None, black_box(body));
                    facts.map(|f| pick(&cfg, &f, None, black_box(&table), &[], 0).pick)
                })
            });
        }
    }
    group.finish();
}

fn snapshot_json(hosts: usize) -> Vec<u8> {
    snapshot_with_last(hosts, 0)
}

/// The snapshot of [`snapshot_json`] carrying `last` of the other
/// gateways' last blocks ([`placed::note_last`]), spread over its replicas
/// and over the last 2 s.
fn snapshot_with_last(hosts: usize, last: usize) -> Vec<u8> {
    let hosts: Vec<HostState> = (0..hosts)
        .map(|i| HostState {
            address: format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
            ready: i % 17 != 0,
            draining: false,
            models: vec!["meta-llama/Llama-3.1-8B-Instruct".into()],
            kv_utilization: (i % 100) as f64 / 100.0,
            waiting: (i % 7) as u32,
            running: (i % 31) as u32,
            kv_capacity_tokens: Some(456_000),
            block_size: Some(16),
            scraped_at_ms: 1_764_400_000_000 - (i % 250) as u64,
            engine: Some("vllm".into()),
            peer_pending_tokens: None,
            peer_arrivals_per_s: None,
            prefill_tokens_per_s: None,
        })
        .collect();
    let last_blocks = (0..last)
        .map(|i| LastBlock {
            block: format!(
                "{:016x}",
                (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ),
            blocks: 100 + (i % 900) as u32,
            address: hosts[i % hosts.len()].address.clone(),
            age_ms: (i * 2000 / last.max(1)) as u64,
        })
        .collect();
    Snapshot {
        placed: Vec::new(),
        last_blocks,
        version: SNAPSHOT_VERSION,
        seq: 1,
        collector: "bench".into(),
        taken_at_ms: 1_764_400_000_000,
        hosts,
    }
    .to_json()
}

/// Decode + validate + index a snapshot: what a router VM does once per
/// stored version.
fn bench_snapshot(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot_decode");
    for hosts in [16usize, 256, 1024] {
        let json = snapshot_json(hosts);
        group.throughput(Throughput::Bytes(json.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(hosts), &json, |b, json| {
            b.iter(|| Snapshot::from_json(black_box(json)).map(|s| FleetView::new(s, 0)))
        });
    }
    group.finish();
}

/// Parse + hash + score + pick against a fleet snapshot (prefix index
/// answer given), 32 KB body.
fn bench_fleet_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide_fleet");
    let body = chat_body(32 << 10);
    for hosts in [16usize, 256, 1024] {
        let Some(cfg) = config(8) else { continue };
        let Ok(snap) = Snapshot::from_json(&snapshot_json(hosts)) else {
            continue;
        };
        let view = FleetView::new(snap, 1_764_400_000_000);
        let hits: Vec<(u64, u32)> = view.set.iter().take(3).map(|h| (h.id, 40)).collect();
        // An idle gateway, and one with requests in flight on every replica
        // (the gateway's load table is read once per replica).
        let busy = busy_table(&view);
        for (name, table) in [("32KB", LoadTable::default()), ("32KB-busy", busy)] {
            group.bench_with_input(
                BenchmarkId::new(name, format!("{hosts}hosts")),
                &body,
                |b, body| {
                    b.iter(|| {
                        let facts = analyze(&cfg, Endpoint::ChatCompletions, None, black_box(body));
                        facts.map(|f| {
                            pick(&cfg, &f, Some(&view), &table, &hits, 1_764_400_000_100).pick
                        })
                    })
                },
            );
        }
    }
    group.finish();
}

/// Uneven load on every replica of `view`.
fn busy_table(view: &FleetView) -> LoadTable {
    let mut table = LoadTable::default();
    for (i, h) in view.set.iter().enumerate() {
        table.add(Charge {
            host: h.id,
            prefill: (i as u64 * 104_729) % 8_000,
            memory: (i as u64 * 7919) % 50_000,
        });
    }
    table
}

/// The admission step a router with `admission.enabled` adds before the
/// pick ([`kvroute_core::admit`]): the objective, `headroom` over the
/// snapshot and the verdict against a worker queue of 256 held requests
/// of another model (the verdict then scans all of them: the worst case).
/// Compare with `decide_fleet` (the pick itself) of the same run.
fn bench_admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("admission");
    let body = chat_body(32 << 10);
    let json = r#"{"hosts":["10.0.0.1:8000","10.0.0.2:8000"],
        "admission":{"enabled":true},"objectives":{"premium":{"priority":1}}}"#;
    let Ok(cfg) = Config::from_json(json.as_bytes()) else {
        return;
    };
    let Ok(facts) = analyze(&cfg, Endpoint::ChatCompletions, None, &body) else {
        return;
    };
    let mut queue: Queue<String> = Queue::new(&cfg.admission);
    for h in 0..256u64 {
        let _ = queue.push(h, 0, h, 0, "another-model".to_owned());
    }
    for hosts in [16usize, 256, 1024] {
        let Ok(snap) = Snapshot::from_json(&snapshot_json(hosts)) else {
            continue;
        };
        let view = FleetView::new(snap, 1_764_400_000_000);
        let table = LoadTable::default();
        group.bench_function(BenchmarkId::new("32KB", format!("{hosts}hosts")), |b| {
            b.iter(|| {
                let o = Objective::of(&cfg.admission, Some(black_box("premium")));
                let room = headroom(
                    &cfg,
                    black_box(&facts),
                    Some(&view),
                    &table,
                    1_764_400_000_100,
                );
                arrive(&cfg.admission, o, room, &queue, |m: &String| {
                    *m == facts.model
                })
            })
        });
    }
    group.finish();
}

/// Learning a bare prompt's split ([`kvroute_core::split`]) against
/// parsing and hashing the same body: what a keyless bare prompt adds to
/// its decision. The table holds a split under the prompt's first half
/// (another request shared it and then differed) and thousands of other
/// prompts' entries.
fn bench_splits(c: &mut Criterion) {
    let mut group = c.benchmark_group("splits");
    let Some(cfg) = config(8) else { return };
    for size in [32usize << 10, 128 << 10] {
        let body = chat_body(size);
        let Ok(facts) = analyze(&cfg, Endpoint::ChatCompletions, None, &body) else {
            continue;
        };
        let mut table = SharedSplits::default();
        let half = facts.blocks.len() / 2;
        let mut other = facts.blocks.clone();
        for (i, b) in other.iter_mut().enumerate().skip(half) {
            *b ^= 0x5eed + i as u64;
        }
        table.learn(&facts.blocks, cfg.affinity_blocks, 0, u64::MAX);
        table.learn(&other, cfg.affinity_blocks, 0, u64::MAX);
        for p in 0..4096u64 {
            let blocks: Vec<u64> = (0..80)
                .map(|i| p.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i)
                .collect();
            table.learn(&blocks, cfg.affinity_blocks, 0, u64::MAX);
        }
        let kb = format!("{}KB", size >> 10);
        group.bench_function(BenchmarkId::new("analyze", &kb), |b| {
            b.iter(|| analyze(&cfg, Endpoint::ChatCompletions, None, black_box(&body)))
        });
        group.bench_function(BenchmarkId::new("learn", &kb), |b| {
            b.iter(|| table.learn(black_box(&facts.blocks), cfg.affinity_blocks, 0, u64::MAX))
        });
    }
    group.finish();
}

/// Gateway ms at which the fleet benches' snapshot was taken.
const T0: u64 = 1_764_400_000_000;

/// What sharing last blocks (`fleet.shareLastBlocks`,
/// [`placed::note_last`]) adds, at four gateways of 100 requests/s each
/// and a 250 ms push:
/// - per request: the fleet-mode decision after the parse (`route`: pick,
///   prefix index, load table, over in-memory shared data; the parse and
///   hash, `analyze`, timed apart), 32 KB body, 16
///   replicas, with sharing off and on. The clock moves 10 ms a request;
///   every 25 requests (not timed) a collector reads the ring, so that it
///   holds the last 2 s (about 200 entries), and the snapshot is pushed
///   again, so that it stays fresh;
/// - per push and worker: decoding a snapshot with the other gateways'
///   600 last blocks, and writing them into the prefix index (first
///   delivery; then the next 7 pushes carry them again and find them).
fn bench_last_blocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("last_blocks");
    let body = chat_body(32 << 10);
    let Ok(snap) = Snapshot::from_json(&snapshot_json(16)) else {
        return;
    };
    // The parse and hash that precede `route` on the request path.
    let Some(cfg) = config(8) else { return };
    group.bench_function(BenchmarkId::new("analyze", "32KB"), |b| {
        b.iter(|| analyze(&cfg, Endpoint::ChatCompletions, None, black_box(&body)))
    });
    for share in [false, true] {
        let mut cfg = cfg.clone();
        cfg.fleet.share_last_blocks = share;
        let Ok(facts) = analyze(&cfg, Endpoint::ChatCompletions, None, &body) else {
            return;
        };
        let store = MemorySharedData::default();
        let metrics = Tally::default();
        let mut cache = IndexCache::default();
        let key = cfg.fleet.last_blocks_key.clone();
        let mut now = T0;
        let mut view = FleetView::new(snap.clone(), now);
        // A reader first (then 2 s of requests below: the ring's steady
        // state).
        let _ = placed::report_last(&store, &key, &[&view.set], now);
        // One request, timed; the push every 25 requests is not.
        let mut step = || {
            now += 10;
            if now % 250 == 0 {
                let _ = placed::report_last(&store, &key, &[&view.set], now);
                view = FleetView::new(snap.clone(), now);
            }
            let start = Instant::now();
            let d = route(
                &cfg,
                &store,
                &metrics,
                &mut cache,
                Ok(&facts),
                Some(&view),
                now,
                now,
            );
            let took = start.elapsed();
            black_box(d.pick);
            took
        };
        for _ in 0..200 {
            let _ = step();
        }
        if share {
            let ring = store
                .get(&key)
                .ok()
                .and_then(|(v, _)| v)
                .unwrap_or_default();
            println!("last_blocks: the ring holds {} bytes after 2 s", ring.len());
        }
        let name = if share { "route-shared" } else { "route" };
        group.bench_function(BenchmarkId::new(name, "32KB-16hosts"), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| step()).sum())
        });
    }
    let index = Index::of(&cfg.fleet);
    for last in [0usize, 600] {
        let json = snapshot_with_last(16, last);
        group.throughput(Throughput::Bytes(json.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("snapshot_decode", format!("16hosts-{last}last")),
            &json,
            |b, json| b.iter(|| Snapshot::from_json(black_box(json)).map(|s| FleetView::new(s, 0))),
        );
    }
    group.throughput(Throughput::Elements(600));
    let Ok(snap) = Snapshot::from_json(&snapshot_with_last(16, 600)) else {
        return;
    };
    group.bench_function(BenchmarkId::new("apply_last", "600-new"), |b| {
        b.iter_batched(
            MemorySharedData::default,
            |store| placed::apply_last(&store, &index, &snap.last_blocks, T0),
            criterion::BatchSize::SmallInput,
        )
    });
    let store = MemorySharedData::default();
    let _ = placed::apply_last(&store, &index, &snap.last_blocks, T0);
    group.bench_function(BenchmarkId::new("apply_last", "600-again"), |b| {
        b.iter(|| placed::apply_last(&store, &index, black_box(&snap.last_blocks), T0))
    });
    group.finish();
}

criterion_group!(
    benches,
    bench_last_blocks,
    bench,
    bench_splits,
    bench_snapshot,
    bench_fleet_pick,
    bench_admission
);
criterion_main!(benches);

//! Parse + hash + pick for chat bodies of 1 KB, 32 KB and 128 KB, with 8, 256 and
//! 1,024 hosts: the decision kvroute makes on every request, without the host.
//!
//! `cargo bench -p kvroute-core --bench decide`

#![allow(clippy::indexing_slicing, clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::admit::{arrive, Objective, Queue};
use kvroute_core::decide::{analyze, headroom, pick};
use kvroute_core::fleet::{FleetView, HostState, Snapshot, SNAPSHOT_VERSION};
use kvroute_core::load::{Charge, LoadTable};
use kvroute_core::split::SharedSplits;
use kvroute_core::{Config, Endpoint};
use std::hint::black_box;

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
        })
        .collect();
    Snapshot {
        placed: Vec::new(),
        last_blocks: Vec::new(),
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

criterion_group!(
    benches,
    bench,
    bench_splits,
    bench_snapshot,
    bench_fleet_pick,
    bench_admission
);
criterion_main!(benches);

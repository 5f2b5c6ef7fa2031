//! Replays a Mooncake-format trace through kvroute's picker against a toy
//! fleet model, for several scoring settings, and prints hit rate, TTFT and
//! KV spread. It exists to choose the fleet-scoring defaults before the
//! realistic simulator and benchmark exist; its engine model is deliberately
//! simple (see `Replica`), so read its figures as relative, not absolute.
//!
//! `cargo run --release -p kvroute-core --example score_sweep -- bench/traces/mooncake_synthetic_trace.jsonl [replicas] [rate]`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use kvroute_core::decide::{pick_fleet, pick_for, Affinity, Facts};
use kvroute_core::fleet::{FleetView, HostState, Snapshot, SNAPSHOT_VERSION};
use kvroute_core::host::MemorySharedData;
use kvroute_core::index::Index;
use kvroute_core::load::{Charge, LoadTable};
use kvroute_core::{Config, Endpoint};

/// Tokens per trace block (the Mooncake release uses 512).
const BLOCK_TOKENS: u64 = 512;

struct Req {
    at_ms: f64,
    input: u64,
    output: u64,
    blocks: Vec<u64>,
}

fn load_trace(path: &str) -> Vec<Req> {
    let text = std::fs::read_to_string(path).expect("trace file");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            Req {
                at_ms: v["timestamp"].as_f64().unwrap_or(0.0),
                input: v["input_length"].as_u64().unwrap_or(0),
                output: v["output_length"].as_u64().unwrap_or(1).max(1),
                blocks: v["hash_ids"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_u64())
                            .map(|x| x.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// A replica: an LRU prefix cache of blocks, `slots` concurrent sequences,
/// FIFO queue, prefill at `prefill_per_ms` tokens/ms, decode at `tpot_ms`
/// per output token. KV in use is the running sequences' tokens.
struct Replica {
    lru: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    tick: u64,
    cap_blocks: usize,
    running: usize,
    queue: std::collections::VecDeque<usize>,
    kv_tokens: u64,
}

impl Replica {
    fn cached_prefix(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.lru.contains_key(b))
            .count()
    }
    fn touch(&mut self, blocks: &[u64]) {
        for &b in blocks {
            self.tick += 1;
            if let Some(old) = self.lru.insert(b, self.tick) {
                self.order.remove(&old);
            }
            self.order.insert(self.tick, b);
        }
        while self.lru.len() > self.cap_blocks {
            let (&t, &b) = self.order.iter().next().unwrap();
            self.order.remove(&t);
            self.lru.remove(&b);
        }
    }
}

#[derive(Clone, Copy)]
enum Policy {
    RoundRobin,
    Foundation,
    Fleet {
        prefix: f64,
        kv: f64,
        queue: f64,
        kvp: f64,
        qp: u32,
        quantum: f64,
    },
}

struct Outcome {
    hit: f64,
    ttft_p50: f64,
    ttft_p95: f64,
    spread: f64,
}

const SLOTS: usize = 32;
const PREFILL_PER_MS: f64 = 10.0;
const TPOT_MS: f64 = 25.0;
/// Llama-3.1-8B (32 layers, 8 KV heads of 128, fp16: 128 KiB per token) on
/// an 80 GB H100 at 90 % memory use, after 16 GB of weights: about 427k
/// tokens. An assumption of this toy, not a measurement.
const CAP_TOKENS: u64 = 427_000;

fn run(reqs: &[Req], n: usize, rate: f64, policy: Policy) -> Outcome {
    let hosts: Vec<String> = (0..n)
        .map(|i| format!("\"10.0.0.{}:8000\"", i + 1))
        .collect();
    let fleet = match policy {
        Policy::Fleet {
            prefix,
            kv,
            queue,
            kvp,
            qp,
            quantum,
        } => format!(
            r#","fleet":{{"weights":{{"prefix":{prefix},"kv":{kv},"queue":{queue}}},"kvPressure":{kvp},"queuePressure":{qp},"scoreQuantum":{quantum}}}"#
        ),
        _ => String::new(),
    };
    let cfg = Config::from_json(format!(r#"{{"hosts":[{}]{fleet}}}"#, hosts.join(",")).as_bytes())
        .unwrap();
    let store = MemorySharedData::default();
    let index = Index {
        slots: cfg.fleet.prefix_index_slots,
        ttl_ms: cfg.fleet.prefix_ttl_ms,
        key_prefix: &cfg.fleet.index_key_prefix,
    };
    let mut reps: Vec<Replica> = (0..n)
        .map(|_| Replica {
            lru: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            cap_blocks: (CAP_TOKENS / BLOCK_TOKENS) as usize,
            running: 0,
            queue: Default::default(),
            kv_tokens: 0,
        })
        .collect();
    let mut table = LoadTable::default();
    // Events: (time µs, seq, kind, request). kind 0 arrival, 1 first token, 2 done, 3 snapshot.
    let mut ev: BinaryHeap<Reverse<(u64, u64, u8, usize)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |ev: &mut BinaryHeap<_>, t: f64, k: u8, r: usize| {
        seq += 1;
        ev.push(Reverse(((t * 1000.0) as u64, seq, k, r)));
    };
    for (i, r) in reqs.iter().enumerate() {
        push(&mut ev, r.at_ms / rate, 0, i);
    }
    push(&mut ev, 0.0, 3, 0);
    let end = reqs.last().map_or(0.0, |r| r.at_ms / rate);
    let mut placed = vec![0usize; reqs.len()];
    let mut charges = vec![Charge::default(); reqs.len()];
    let mut ttft = Vec::new();
    let (mut cached_tok, mut total_tok) = (0u64, 0u64);
    let (mut spread_sum, mut spread_n) = (0.0, 0u64);
    let mut view: Option<FleetView> = None;
    let mut rr = 0usize;
    let mut snap_seq = 0;
    let host_ids: Vec<u64> = cfg.hosts.iter().map(|h| h.id).collect();
    // Experiment: keep the prompt charged until the request ends (its KV
    // stays allocated), instead of releasing it at the first token.
    let hold_prompt = std::env::var_os("SWEEP_HOLD_PROMPT").is_some();

    // Starts request r on replica h at time t (ms).
    let start = |h: usize,
                 r: usize,
                 t: f64,
                 reps: &mut Vec<Replica>,
                 ev: &mut BinaryHeap<_>,
                 push: &mut dyn FnMut(&mut BinaryHeap<_>, f64, u8, usize),
                 ttft: &mut Vec<f64>,
                 cached_tok: &mut u64,
                 total_tok: &mut u64| {
        let q = &reqs[r];
        let rep = &mut reps[h];
        let k = rep.cached_prefix(&q.blocks);
        let cached = (k as u64 * BLOCK_TOKENS).min(q.input);
        *cached_tok += cached;
        *total_tok += q.input;
        rep.touch(&q.blocks);
        rep.running += 1;
        rep.kv_tokens += q.input + q.output;
        let prefill = (q.input - cached) as f64 / PREFILL_PER_MS;
        ttft.push(t - q.at_ms / rate + prefill);
        push(ev, t + prefill, 1, r);
        push(ev, t + prefill + q.output as f64 * TPOT_MS, 2, r);
    };

    while let Some(Reverse((t_us, _, kind, r))) = ev.pop() {
        let t = t_us as f64 / 1000.0;
        match kind {
            0 => {
                let q = &reqs[r];
                let key = q
                    .blocks
                    .get(q.blocks.len().min(2).saturating_sub(1))
                    .copied()
                    .unwrap_or(r as u64);
                let facts = Facts {
                    endpoint: Endpoint::ChatCompletions,
                    model: String::new(),
                    affinity: Affinity::Prefix(key),
                    blocks: q.blocks.clone(),
                    input_tokens: q.input,
                    output_tokens: q.output,
                    stream: true,
                    non_text_parts: 0,
                };
                let h = match policy {
                    Policy::RoundRobin => {
                        rr += 1;
                        rr % n
                    }
                    Policy::Foundation => {
                        pick_for(&cfg, &facts, &table.loads_for(&cfg.hosts))
                            .pick
                            .unwrap()
                            .primary
                    }
                    Policy::Fleet { .. } => match &view {
                        None => {
                            pick_for(&cfg, &facts, &table.loads_for(&cfg.hosts))
                                .pick
                                .unwrap()
                                .primary
                        }
                        Some(v) => {
                            let hits = index.lookup(&store, &facts.blocks, t as u64);
                            let h = pick_fleet(&cfg, &facts, v, &table, &hits, t as u64)
                                .pick
                                .unwrap()
                                .primary;
                            index.record(&store, &facts.blocks, host_ids[h], t as u64);
                            h
                        }
                    },
                };
                placed[r] = h;
                charges[r] = Charge {
                    host: host_ids[h],
                    prefill: q.input,
                    decode: q.output,
                };
                table.add(charges[r]);
                if reps[h].running < SLOTS {
                    start(
                        h,
                        r,
                        t,
                        &mut reps,
                        &mut ev,
                        &mut push,
                        &mut ttft,
                        &mut cached_tok,
                        &mut total_tok,
                    );
                } else {
                    reps[h].queue.push_back(r);
                }
            }
            1 => {
                if !hold_prompt {
                    table.release(Charge {
                        decode: 0,
                        ..charges[r]
                    });
                }
            }
            2 => {
                table.release(if hold_prompt {
                    charges[r]
                } else {
                    Charge {
                        prefill: 0,
                        ..charges[r]
                    }
                });
                let h = placed[r];
                reps[h].running -= 1;
                reps[h].kv_tokens -= reqs[r].input + reqs[r].output;
                if let Some(next) = reps[h].queue.pop_front() {
                    start(
                        h,
                        next,
                        t,
                        &mut reps,
                        &mut ev,
                        &mut push,
                        &mut ttft,
                        &mut cached_tok,
                        &mut total_tok,
                    );
                }
            }
            _ => {
                let kv: Vec<f64> = reps
                    .iter()
                    .map(|p| (p.kv_tokens as f64 / CAP_TOKENS as f64).min(1.0))
                    .collect();
                let max = kv.iter().cloned().fold(0.0, f64::max);
                let min = kv.iter().cloned().fold(1.0, f64::min);
                spread_sum += max - min;
                spread_n += 1;
                snap_seq += 1;
                let now = t as u64;
                let snap = Snapshot {
                    version: SNAPSHOT_VERSION,
                    seq: snap_seq,
                    collector: "sim".into(),
                    taken_at_ms: now,
                    hosts: cfg
                        .hosts
                        .iter()
                        .zip(&reps)
                        .zip(&kv)
                        .map(|((h, p), &k)| HostState {
                            address: h.addr.clone(),
                            ready: true,
                            draining: false,
                            models: vec![],
                            kv_utilization: k,
                            waiting: p.queue.len() as u32,
                            running: p.running as u32,
                            kv_capacity_tokens: Some(CAP_TOKENS),
                            block_size: Some(16),
                            scraped_at_ms: now,
                            engine: None,
                        })
                        .collect(),
                };
                // Pushed and ingested 50 ms after the scrape: the router sees it stale by that much.
                view = Some(FleetView::new(snap, now + 50));
                if t < end {
                    push(&mut ev, t + 250.0, 3, 0);
                }
            }
        }
    }
    ttft.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| {
        ttft.get(((ttft.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Outcome {
        hit: cached_tok as f64 / total_tok.max(1) as f64,
        ttft_p50: pct(0.5),
        ttft_p95: pct(0.95),
        spread: spread_sum / spread_n.max(1) as f64,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        eprintln!("usage: score_sweep TRACE.jsonl [replicas=8] [rate=1.0]");
        std::process::exit(2);
    };
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(8);
    let rate: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let reqs = load_trace(path);
    eprintln!("{} requests, {n} replicas, rate x{rate}, {SLOTS} slots, {PREFILL_PER_MS} prefill tok/ms, {TPOT_MS} ms/token, {CAP_TOKENS} KV tokens each", reqs.len());
    let mut policies: Vec<(String, Policy)> = vec![
        ("round robin".into(), Policy::RoundRobin),
        (
            "foundation (rendezvous + bounded load)".into(),
            Policy::Foundation,
        ),
    ];
    // (prefix, kv, queue, kvPressure, queuePressure, scoreQuantum); the
    // first row is the default.
    let settings = [
        (3.0, 0.0, 2.0, 0.9, 32, 0.05),
        (3.0, 0.0, 1.0, 0.9, 32, 0.05),
        (3.0, 1.0, 1.0, 0.9, 32, 0.05),
        (3.0, 0.25, 2.0, 0.9, 32, 0.05),
        (3.0, 2.0, 2.0, 0.9, 32, 0.05),
        (1.0, 0.0, 2.0, 0.9, 32, 0.05),
        (6.0, 0.0, 2.0, 0.9, 32, 0.05),
        (0.0, 0.0, 2.0, 0.9, 32, 0.05),
        (3.0, 0.0, 0.0, 0.9, 32, 0.05),
        (3.0, 0.0, 2.0, 0.8, 16, 0.05),
        (3.0, 0.0, 2.0, 0.9, 32, 0.5),
    ];
    for (p, k, q, kvp, qp, quantum) in settings {
        let name = format!("fleet prefix={p} kv={k} queue={q}, pressure kv>={kvp} or waiting>={qp}, quantum {quantum}");
        policies.push((
            name,
            Policy::Fleet {
                prefix: p,
                kv: k,
                queue: q,
                kvp,
                qp,
                quantum,
            },
        ));
    }
    println!("| policy | prefix hit | TTFT p50 ms | TTFT p95 ms | mean KV spread |");
    println!("|---|---|---|---|---|");
    for (name, p) in policies {
        let o = run(&reqs, n, rate, p);
        println!(
            "| {name} | {:.3} | {:.0} | {:.0} | {:.3} |",
            o.hit, o.ttft_p50, o.ttft_p95, o.spread
        );
    }
}

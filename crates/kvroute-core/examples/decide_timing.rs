//! The decision alone, timed with `std::time::Instant`: the same work as the
//! criterion group `decide/` in benches/decide.rs (`analyze` + `pick` without a snapshot on
//! real-shaped chat bodies of 1 KB, 32 KB and 128 KB, 8, 256 and 1,024 hosts), in a
//! plain loop so that it also runs as a wasm32-wasip1 program under a WASI
//! host. Criterion does not build for wasm32; this does, so the native build
//! and the Wasm build time exactly the same code.
//!
//! For each case: a warm-up (at least `WARMUP`, so V8 has tiered the hot
//! functions up to its optimising compiler), then `BATCHES` batches, each
//! long enough to last about `BATCH` so the clock's resolution does not
//! matter; the figure is the median of the batch means. One JSON object per
//! case on stdout:
//!
//! ```text
//! {"case":"128KB/256hosts","body_bytes":131089,"hosts":256,"ns_median":61023.4,"ns_min":...,"ns_max":...,"batches":15,"iters_per_batch":...}
//! ```
//!
//!     cargo run --release -p kvroute-core --example decide_timing
//!     cargo build --release -p kvroute-core --example decide_timing --target wasm32-wasip1
//!     node scripts/run_wasi.mjs target/wasm32-wasip1/release/examples/decide_timing.wasm
//!
//! `make bench-decide-wasm` runs both and prints wasm/native per case.
//! Arguments (both builds): `--quick` for short batches, `--batches N`.

#![allow(clippy::indexing_slicing)]

use kvroute_core::decide::{analyze, pick};
use kvroute_core::load::LoadTable;
use kvroute_core::{Config, Endpoint};
use std::hint::black_box;
use std::time::{Duration, Instant};

// The same bodies and configs as the criterion bench (criterion itself does
// not build for wasm32).
#[path = "../benches/common/mod.rs"]
mod common;
use common::{chat_body, config, loads};

struct Plan {
    warmup: Duration,
    batch: Duration,
    batches: usize,
}

/// One decision, exactly the closure criterion times in benches/decide.rs.
fn decide(cfg: &Config, body: &[u8], table: &LoadTable) -> Option<usize> {
    let facts = analyze(cfg, Endpoint::ChatCompletions, None, black_box(body));
    facts.ok().and_then(|f| {
        pick(cfg, &f, None, black_box(table), &[], 0)
            .pick
            .map(|p| p.primary)
    })
}

fn time_case(plan: &Plan, cfg: &Config, body: &[u8], table: &LoadTable) -> (Vec<f64>, u64) {
    // Warm-up, which also sizes a batch: iterations per `plan.batch`.
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < plan.warmup || n < 10 {
        black_box(decide(cfg, body, table));
        n += 1;
    }
    let per = start.elapsed().as_secs_f64() / n as f64;
    let iters = ((plan.batch.as_secs_f64() / per) as u64).max(1);
    let mut means = Vec::with_capacity(plan.batches);
    for _ in 0..plan.batches {
        let t = Instant::now();
        for _ in 0..iters {
            black_box(decide(cfg, body, table));
        }
        means.push(t.elapsed().as_secs_f64() * 1e9 / iters as f64);
    }
    means.sort_by(f64::total_cmp);
    (means, iters)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let mut plan = if quick {
        Plan {
            warmup: Duration::from_millis(300),
            batch: Duration::from_millis(50),
            batches: 7,
        }
    } else {
        Plan {
            warmup: Duration::from_secs(1),
            batch: Duration::from_millis(200),
            batches: 15,
        }
    };
    if let Some(i) = args.iter().position(|a| a == "--batches") {
        if let Some(n) = args.get(i + 1).and_then(|v| v.parse().ok()) {
            plan.batches = n;
        }
    }
    let engine = if cfg!(target_arch = "wasm32") {
        "wasm32"
    } else {
        "native"
    };
    for size in [1usize << 10, 32 << 10, 128 << 10] {
        let body = chat_body(size);
        for hosts in [8usize, 256, 1024] {
            let Some(cfg) = config(hosts) else {
                eprintln!("decide_timing: config with {hosts} hosts refused");
                std::process::exit(1);
            };
            // Uneven in-flight load so that bounded load has work to do (as in the bench).
            let table = loads(&cfg);
            if decide(&cfg, &body, &table).is_none() {
                eprintln!("decide_timing: no pick for {size} bytes, {hosts} hosts");
                std::process::exit(1);
            }
            let (means, iters) = time_case(&plan, &cfg, &body, &table);
            let median = means[means.len() / 2];
            println!(
                "{{\"case\":\"{}KB/{hosts}hosts\",\"engine\":\"{engine}\",\"body_bytes\":{},\"hosts\":{hosts},\
                 \"ns_median\":{median:.1},\"ns_min\":{:.1},\"ns_max\":{:.1},\"batches\":{},\"iters_per_batch\":{iters}}}",
                size >> 10,
                body.len(),
                means[0],
                means[means.len() - 1],
                means.len(),
            );
        }
    }
}

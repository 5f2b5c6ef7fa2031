//! Golden test vectors: hashes, keys, costs and picks for fixed inputs.
//!
//! The same file runs natively (`cargo test`) and on wasm32-unknown-unknown
//! under Node (`wasm-bindgen-test`), against the same expected lines, which
//! proves the filter (Wasm) and the native tools (collector, benchmark) hash
//! and pick bit-identically. A change to any line is a change to where
//! existing traffic goes: update it only on purpose.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use kvroute_core::decide::{analyze, pick};
use kvroute_core::hash::model_seed;
use kvroute_core::load::{Charge, LoadTable};
use kvroute_core::picker::{preference_order, rank};
use kvroute_core::{Config, Endpoint};

/// Deterministic pseudo-text (a 64-bit LCG), no randomness crate needed.
fn text(seed: u64, len: usize) -> String {
    let words = [
        "kv", "cache", "route", "token", "prefix", "block", "engine", "replica", "é", "中文",
    ];
    let mut s = seed;
    let mut out = String::new();
    while out.len() < len {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(words[(s >> 33) as usize % words.len()]);
        out.push(' ');
    }
    out
}

fn config(hosts: usize) -> Config {
    let hosts: Vec<String> = (0..hosts)
        .map(|i| format!("\"10.0.{}.{}:8000\"", i / 200, i % 200 + 1))
        .collect();
    Config::from_json(format!(r#"{{"hosts":[{}]}}"#, hosts.join(",")).as_bytes()).unwrap()
}

fn requests() -> Vec<(Endpoint, Option<&'static str>, String)> {
    let doc = text(1, 9000);
    vec![
        (Endpoint::ChatCompletions, None, format!(r#"{{"model":"llama","messages":[{{"role":"system","content":"{doc}"}},{{"role":"user","content":"q1"}}],"max_tokens":64}}"#)),
        (Endpoint::ChatCompletions, None, format!(r#"{{"model":"llama","messages":[{{"role":"system","content":"{doc}"}},{{"role":"user","content":"q2"}}]}}"#)),
        (Endpoint::ChatCompletions, None, format!(r#"{{"model":"llama","messages":[{{"role":"user","content":"{}"}}]}}"#, text(2, 300))),
        (Endpoint::ChatCompletions, Some("session-42"), r#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#.to_string()),
        (Endpoint::ChatCompletions, None, r#"{"model":"llama","prompt_cache_key":"pck","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}]}"#.to_string()),
        (Endpoint::Completions, None, format!(r#"{{"model":"m","prompt":"{}","max_tokens":5000}}"#, text(3, 3000))),
        (Endpoint::Completions, None, r#"{"model":"m","prompt":[[1,2,3],[4,5]]}"#.to_string()),
        (Endpoint::Responses, None, format!(r#"{{"model":"m","instructions":"be brief","input":"{}","max_output_tokens":9}}"#, text(4, 700))),
        (Endpoint::Messages, None, format!(r#"{{"model":"claude","system":"{}","max_tokens":100,"metadata":{{"user_id":"u-7"}},"messages":[{{"role":"user","content":"q"}}]}}"#, text(5, 500))),
    ]
}

fn vectors() -> Vec<String> {
    let mut out = Vec::new();
    out.push(format!("seed llama {:016x}", model_seed("llama")));
    out.push(format!("rank {:016x}", rank(0x0123_4567_89ab_cdef, 42)));
    let small = config(8);
    let large = config(256);
    for (i, (ep, session, body)) in requests().iter().enumerate() {
        let f = analyze(&small, *ep, *session, body.as_bytes()).unwrap();
        let idle = LoadTable::default();
        let idle8 = pick(&small, &f, None, &idle, &[], 0);
        let idle256 = pick(&large, &f, None, &idle, &[], 0);
        // A loaded fleet: the first preference is busy, so the pick spills.
        let mut loads = LoadTable::default();
        loads.add(Charge {
            host: small
                .hosts
                .get(idle8.pick.as_ref().unwrap().primary)
                .unwrap()
                .id,
            prefill: 0,
            memory: 1_000_000,
        });
        let busy8 = pick(&small, &f, None, &loads, &[], 0);
        let p8 = idle8.pick.unwrap();
        let b8 = busy8.pick.unwrap();
        out.push(format!(
            "{i} {:?} key={:016x} blocks={} first={:016x} last={:016x} in={} out={} idle8={}{:?} busy8={}:{}{:?} idle256={}",
            idle8.reason,
            f.affinity.key(),
            f.blocks.len(),
            f.blocks.first().copied().unwrap_or(0),
            f.blocks.last().copied().unwrap_or(0),
            f.input_tokens,
            f.output_tokens,
            p8.primary,
            p8.fallbacks,
            busy8.reason.as_str(),
            b8.primary,
            b8.fallbacks,
            idle256.pick.unwrap().primary,
        ));
    }
    let order: Vec<usize> = preference_order(&large.hosts, 7)
        .into_iter()
        .take(6)
        .collect();
    out.push(format!("order256 key=7 {order:?}"));
    let mut t = LoadTable::default();
    t.add(Charge {
        host: 1,
        prefill: 2,
        memory: 3,
    });
    out.push(format!("table {:02x?}", t.encode()));
    out
}

const EXPECTED: &[&str] = &[
    "seed llama dcb63eabb0e1361a",
    "rank ad2ad1ac61c2919a",
    "0 Prefix key=fecd1884ad59a685 blocks=35 first=6304106facd3dfa6 last=a7ef49bb6d66653c in=2254 out=64 idle8=7[0, 4] busy8=spill:0[4, 1] idle256=138",
    "1 Prefix key=3fe673ede1f8c4c4 blocks=35 first=6304106facd3dfa6 last=a7ef49bb6d66653c in=2254 out=1024 idle8=4[6, 5] busy8=spill:6[5, 3] idle256=189",
    "2 Prefix key=355dc2fb96c9b8ba blocks=1 first=19ea1468f86a4a3e last=19ea1468f86a4a3e in=78 out=1024 idle8=4[5, 3] busy8=spill:5[3, 6] idle256=76",
    "3 Session key=38cfa3225de32298 blocks=0 first=0000000000000000 last=0000000000000000 in=2 out=1024 idle8=1[3, 7] busy8=spill:3[7, 6] idle256=165",
    "4 Session key=dcd116db7120ffcd blocks=0 first=0000000000000000 last=0000000000000000 in=5 out=1024 idle8=3[6, 0] busy8=spill:6[0, 7] idle256=69",
    "5 Prefix key=d76209e1d0aead5f blocks=11 first=a493cee04e321f5f last=cc5052b3b94338bd in=751 out=1024 idle8=6[1, 7] busy8=spill:1[7, 4] idle256=184",
    "6 Prefix key=0d406dc4b2dd9a30 blocks=0 first=0000000000000000 last=0000000000000000 in=5 out=1024 idle8=0[3, 6] busy8=spill:3[6, 2] idle256=219",
    "7 Prefix key=959b04c65878d07b blocks=2 first=41c97fc4ae41ae52 last=b3f1eafb478e7d1e in=184 out=9 idle8=3[6, 4] busy8=spill:6[4, 5] idle256=17",
    "8 Session key=e9246d289a65a220 blocks=2 first=0bb5e227447a6a22 last=c216564322ba74e3 in=129 out=100 idle8=3[1, 5] busy8=spill:1[5, 2] idle256=80",
    "order256 key=7 [57, 143, 4, 180, 28, 42]",
    "table [4b, 56, 4c, 33, 01, 00, 00, 00, 01, 00, 00, 00, 00, 00, 00, 00, 02, 00, 00, 00, 00, 00, 00, 00, 03, 00, 00, 00, 00, 00, 00, 00]",
];

#[cfg_attr(not(target_arch = "wasm32"), test)]
#[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
fn golden_vectors() {
    let got = vectors();
    for (i, line) in got.iter().enumerate() {
        assert_eq!(
            Some(&line.as_str()),
            EXPECTED.get(i),
            "vector {i} differs; all lines:\n{}",
            got.join("\n")
        );
    }
    assert_eq!(got.len(), EXPECTED.len());
}

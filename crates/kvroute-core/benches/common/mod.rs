//! Inputs shared by the criterion bench (benches/decide.rs) and the
//! Wasm-vs-native timing example (examples/decide_timing.rs), so both time
//! the same bytes. Not a bench target itself (a subdirectory module).

use kvroute_core::Config;

/// A multi-turn chat body of about `size` bytes, real-shaped: a system
/// prompt, then alternating user and assistant turns of prose.
pub fn chat_body(size: usize) -> Vec<u8> {
    let words = [
        "the", "cache", "holds", "keys", "and", "values", "for", "every", "token", "of", "a",
        "prompt",
    ];
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut prose = |n: usize| {
        let mut t = String::new();
        while t.len() < n {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            t.push_str(words[(s % words.len() as u64) as usize]);
            t.push(' ');
        }
        t
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": prose(size / 8)})];
    let mut used = size / 8 + 200;
    let mut user = true;
    while used < size {
        let n = (size / 10).clamp(64, 8192).min(size - used + 1);
        let role = if user { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": prose(n)}));
        used += n + 40;
        user = !user;
    }
    serde_json::to_vec(&serde_json::json!({"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 256, "stream": true}))
        .unwrap_or_default()
}

/// The default plugin configuration with `hosts` static hosts.
pub fn config(hosts: usize) -> Option<Config> {
    let list: Vec<String> = (0..hosts)
        .map(|i| format!("\"10.0.{}.{}:8000\"", i / 200, i % 200 + 1))
        .collect();
    Config::from_json(format!(r#"{{"hosts":[{}]}}"#, list.join(",")).as_bytes()).ok()
}

/// Uneven memory held per configured host (what a gateway sent there), so
/// that bounded load has work to do.
pub fn loads(cfg: &Config) -> kvroute_core::load::LoadTable {
    let mut table = kvroute_core::load::LoadTable::default();
    for (i, h) in cfg.hosts.iter().enumerate() {
        table.add(kvroute_core::load::Charge {
            host: h.id,
            prefill: 0,
            memory: (i as u64 * 7919) % 50_000,
        });
    }
    table
}

//! The request path: `decide::analyze`, the function the filter calls on a
//! buffered request body (parse, canonical stream, prefix block hashing,
//! affinity key, cost), for each of the four endpoints.
//!
//! Every input is analysed as all four endpoints, so the corpus holds plain
//! request bodies. Two configs: the default one (what a gateway runs), and
//! the smallest blocks the validator admits, so that the affinity cut and
//! the `maxBlocks` cap are reached by inputs of fuzzer size (with the
//! default config they need 4 KiB and 256 KiB of prompt).
//!
//! Besides "never panics", it checks what routing relies on: at most
//! `maxBlocks` hashes, the output estimate within its cap, the input
//! estimate bounded by the body size, and facts that do not depend on the
//! hashing settings.

#![no_main]

use std::sync::LazyLock;

use kvroute_core::{analyze, Config, Endpoint};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: kvroute_fuzz::Capped = kvroute_fuzz::Capped;

/// The defaults, with the one host the router role requires.
static DEFAULT: LazyLock<Config> = LazyLock::new(|| config(r#"{"hosts":["127.0.0.1:8001"]}"#));

static SMALL_BLOCKS: LazyLock<Config> = LazyLock::new(|| {
    config(
        r#"{"hosts":["127.0.0.1:8001"],
            "hashing":{"blockBytes":16,"maxBlocks":8,"affinityBlocks":2}}"#,
    )
});

fn config(json: &str) -> Config {
    match Config::from_json(json.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("fuzz config rejected: {e}"),
    }
}

const ENDPOINTS: [Endpoint; 4] = [
    Endpoint::ChatCompletions,
    Endpoint::Completions,
    Endpoint::Responses,
    Endpoint::Messages,
];

fuzz_target!(|body: &[u8]| {
    for endpoint in ENDPOINTS {
        let Ok(a) = analyze(&DEFAULT, endpoint, None, body) else {
            // Parsing does not depend on the hashing settings (checked
            // below for bodies that parse), so a refused body is refused
            // under both configs: skip the second run.
            continue;
        };
        let b = match analyze(&SMALL_BLOCKS, endpoint, None, body) {
            Ok(b) => b,
            Err(e) => panic!("parses with the default config, {e:?} with small blocks"),
        };
        for (cfg, f) in [(&*DEFAULT, &a), (&*SMALL_BLOCKS, &b)] {
            assert!(f.blocks.len() <= cfg.max_blocks, "too many blocks");
            assert!(f.output_tokens <= cfg.output_tokens_cap, "output over cap");
            assert_eq!(f.endpoint, endpoint);
            // The canonical stream is at most a few times the body (a `{}`
            // content part becomes GS + "unknown", 8 bytes from 3), and an
            // input token is 4 bytes of it or at least 2 of JSON.
            assert!(
                f.input_tokens <= body.len() as u64 + 2,
                "input tokens {} for a {}-byte body",
                f.input_tokens,
                body.len()
            );
        }
        assert_eq!(a.model, b.model);
        assert_eq!(a.input_tokens, b.input_tokens);
        assert_eq!(a.output_tokens, b.output_tokens);
        assert_eq!(a.stream, b.stream);
        assert_eq!(a.non_text_parts, b.non_text_parts);
        // The small config's blocks are whole 16-byte blocks of the same
        // stream, so a default-config block implies small-config ones.
        if !a.blocks.is_empty() {
            assert_eq!(b.blocks.len(), SMALL_BLOCKS.max_blocks);
        }
    }
});

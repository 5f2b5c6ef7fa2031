//! Learning from answers: the prefix hit an engine reports, against the
//! one the gateway's prefix index expected.
//!
//! The index ([`crate::index`]) only knows what the gateway sent where;
//! engines evict on their own (memory pressure, a restart, a cache flush),
//! and an entry outlives its blocks until its TTL. The answers say what
//! really happened: OpenAI-style engines (vLLM, SGLang) report
//! `usage.prompt_tokens_details.cached_tokens`, Anthropic
//! `usage.cache_read_input_tokens` (read by [`crate::usage::Tracker`], in
//! JSON bodies and in a stream's late usage event).
//!
//! # What is kept until the answer
//!
//! A decision whose primary the index expected to hold part of the prompt
//! ([`crate::decide::Decision::expected_cached`] > 0) keeps an
//! [`Expectation`]: the replica, the expected tokens, the prompt estimate
//! and the request's block hashes (at most `maxBlocks`, 8 bytes each). Only
//! these answers are read for it (see [`read_answer`]); the others cannot
//! show an index entry that outlived its blocks.
//!
//! # Units
//!
//! The gateway counts tokens as canonical bytes / `bytesPerToken`; the
//! engine counts its tokenizer's tokens, chat template included. When the
//! answer gives the prompt's size (`prompt_tokens`, or Anthropic's three
//! input figures), the expectation is scaled by `prompt / estimate` into
//! the engine's tokens before the comparison, so a tokenizer that makes
//! more or fewer tokens than the estimate is not read as an eviction.
//!
//! # The rule
//!
//! With `block` = one index block (`blockBytes / bytesPerToken` tokens,
//! scaled likewise), the answer **falls short** when
//!
//! ```text
//! cached + block + SCALE_SLACK * expected < expected
//! ```
//!
//! i.e. the engine found more than one index block and a tenth less than
//! the index expected. The block covers the engine's own rounding (vLLM
//! and SGLang cache whole blocks of their own, 16 tokens by default, and
//! always compute the prompt's last token), which is less than one index
//! block (64 tokens by default). The tenth ([`SCALE_SLACK`]) covers the
//! scale: it is the whole prompt's ratio, and a prefix can tokenize at
//! another ratio than the rest. On a real vLLM (tests/engines), a
//! five-turn conversation whose every turn the index expected in full
//! (the previous turn's prompt) had the engine report 2816 tokens cached
//! against 2873 expected over four answers, one of them more than a block
//! short, although nothing was evicted. On a shortfall the engine evidently no longer
//! held the blocks past `kept = ceil(cached / block)`: the index entries of
//! this request's blocks that claim more than `kept` blocks on that replica
//! and were written at least [`SETTLE_MS`] before this request's decision
//! are removed ([`crate::index::Index::forget`]). Younger entries stay:
//! entries written at or after the decision (this request's own, or a
//! later request's) record sends the engine has not answered about, and an
//! entry written just before it may be for a prompt still being prefilled
//! (an engine only hits on computed blocks), which is not an eviction.
//!
//! The answering request has itself been prefilled on that replica, so
//! the replica may hold the prefix again right after; the rule gives up
//! that hint (the next request of the prefix is placed without it) rather
//! than keep steering a prefix at a replica whose cache evidently keeps
//! losing it, or at one that does not cache at all.
//!
//! # Metrics
//!
//! Per replica (label `replica`, see [`crate::host::ReplicaCounter`]):
//! `kvroute_prefix_expected_tokens_total` and
//! `kvroute_prefix_cached_tokens_total`, over the answers compared, both in
//! the engine's tokens. Their ratio is the routing precision: the share of
//! the prefix hits the router counted on that the engines delivered
//! (above 1: the engine held more than the index knew, e.g. another
//! gateway's sends). `kvroute_prefix_answers_total`,
//! `kvroute_prefix_shortfalls_total` and
//! `kvroute_prefix_entries_dropped_total` count the answers compared, those
//! that fell short, and the entries removed.

use crate::config::Config;
use crate::decide::{Decision, Facts};
use crate::host::{Counter, Metrics, ReplicaCounter, SharedData};
use crate::index::{Index, IndexCache};
use crate::usage::{self, Learned};

/// The share of the expected figure an answer may fall short by, on top
/// of one index block, before it counts as a shortfall: the scale into
/// engine tokens is the whole prompt's ratio (see the module doc).
pub const SCALE_SLACK: f64 = 0.1;

/// How old an index entry must have been at the decision for a shortfall
/// to remove it: a send this recent may still be in its prefill (TTFT p99
/// is a few hundred ms on the simulated fleets), so its blocks were not
/// cached yet rather than evicted.
pub const SETTLE_MS: u64 = 2000;

/// What a decision expected of its primary, kept until the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectation {
    /// The primary's id in the prefix index.
    pub host: u64,
    /// The primary's address (the metric label).
    pub replica: String,
    /// Prompt tokens the index expected cached there (gateway tokens).
    pub expected_cached: u64,
    /// The prompt, by the gateway's estimate.
    pub input_tokens: u64,
    /// The request's prefix block hashes.
    pub blocks: Vec<u64>,
    /// When the decision was made (gateway clock, ms).
    pub decided_ms: u64,
}

impl Expectation {
    /// The expectation of a decision, when it expected a hit on a charged
    /// primary (`None` otherwise: nothing to learn from the answer).
    pub fn of(facts: &Facts, d: &Decision, decided_ms: u64) -> Option<Expectation> {
        if d.expected_cached == 0 {
            return None;
        }
        let host = d.charge?.host;
        let replica = d.targets.first()?.clone();
        Some(Expectation {
            host,
            replica,
            expected_cached: d.expected_cached,
            input_tokens: facts.input_tokens,
            blocks: facts.blocks.clone(),
            decided_ms,
        })
    }
}

impl Expectation {
    /// Engine tokens per gateway token, by the engine's count of the
    /// prompt (1 when the answer does not say).
    pub fn scale(&self, engine_prompt_tokens: Option<u64>) -> f64 {
        match engine_prompt_tokens {
            Some(p) if p > 0 && self.input_tokens > 0 => p as f64 / self.input_tokens as f64,
            _ => 1.0,
        }
    }
}

/// Whether the answer of stream `stream_id` is read: the output-length
/// sample ([`usage::observed`]), every answer with an expectation, and
/// every answer that may be a prefill-rate sample ([`crate::rates::Probe`]).
///
/// Reading costs one host call per body chunk (a copy of it) and a JSON
/// parse per SSE event; Envoy enters the filter for every chunk whether it
/// is read or not. Every expected hit is read, not a sample, because the
/// event it looks for is rare and local: one replica losing one prefix. A
/// sample of one in four would leave an evicted prefix's entries in place
/// for about four more answers, and the counters would be a sample too.
/// Every probe is read because rate samples are few (a long prefill with
/// little queued ahead), and each is a long prefill, beside which reading
/// its answer costs little.
pub fn read_answer(
    stream_id: u32,
    expectation: Option<&Expectation>,
    probe: Option<&crate::rates::Probe>,
) -> bool {
    usage::observed(stream_id) || expectation.is_some() || probe.is_some()
}

/// What one answer taught: the figures compared (engine tokens) and the
/// index entries removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub expected: u64,
    pub cached: u64,
    pub short: bool,
    pub dropped: u64,
}

/// Compares the answer's cached tokens with the expectation, counts both
/// for the replica, and on a shortfall removes the index entries the engine
/// evidently evicted (see the module doc). An answer without a cached
/// figure teaches nothing (`None`).
pub fn learn(
    cfg: &Config,
    store: &dyn SharedData,
    metrics: &dyn Metrics,
    cache: &mut IndexCache,
    exp: &Expectation,
    learned: &Learned,
    now_ms: u64,
) -> Option<Verdict> {
    let reported = learned.cached_tokens?;
    let scale = exp.scale(learned.prompt_tokens);
    // An engine cannot have cached more than the prompt.
    let cached = learned.prompt_tokens.map_or(reported, |p| reported.min(p));
    let expected = (exp.expected_cached as f64 * scale).round() as u64;
    // One index block in engine tokens (at least one token).
    let block = (cfg.block_bytes as f64 / cfg.bytes_per_token.max(1) as f64 * scale).max(1.0);
    metrics.count(Counter::PrefixAnswers, 1);
    metrics.count_replica(ReplicaCounter::ExpectedTokens, &exp.replica, expected);
    metrics.count_replica(ReplicaCounter::CachedTokens, &exp.replica, cached);
    let expected_f = expected as f64;
    let short = cached as f64 + block + SCALE_SLACK * expected_f < expected_f;
    let mut dropped = 0;
    if short {
        metrics.count(Counter::PrefixShortfalls, 1);
        let keep = (cached as f64 / block).ceil() as usize;
        let index = Index::of(&cfg.fleet);
        dropped = index.forget(
            store,
            cache,
            &exp.blocks,
            keep,
            exp.host,
            exp.decided_ms.saturating_sub(SETTLE_MS),
            now_ms,
        );
        metrics.count(Counter::PrefixEntriesDropped, dropped);
    }
    Some(Verdict {
        expected,
        cached,
        short,
        dropped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{MemoryMetrics, MemorySharedData};

    fn cfg() -> Config {
        Config::from_json(br#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002"]}"#).unwrap()
    }

    fn index(cfg: &Config) -> Index<'_> {
        Index::of(&cfg.fleet)
    }

    /// 32 blocks (2048 gateway tokens at 64 per block) recorded on host 7
    /// at 0 ms, and a request of them decided SETTLE_MS + 100 ms later
    /// expecting them all.
    fn setup(cfg: &Config, store: &MemorySharedData) -> Expectation {
        let blocks: Vec<u64> = (0..32u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9) ^ 0x55)
            .collect();
        index(cfg).record(store, &blocks, 7, 0);
        Expectation {
            host: 7,
            replica: "127.0.0.1:8001".into(),
            expected_cached: 2047,
            input_tokens: 2048,
            blocks,
            decided_ms: SETTLE_MS + 100,
        }
    }

    /// [`learn`] with a worker cache of its own.
    fn learn_fresh(
        c: &Config,
        store: &MemorySharedData,
        m: &MemoryMetrics,
        exp: &Expectation,
        answer: &Learned,
        now_ms: u64,
    ) -> Option<Verdict> {
        learn(c, store, m, &mut IndexCache::default(), exp, answer, now_ms)
    }

    fn answer(cached: Option<u64>, prompt: Option<u64>) -> Learned {
        Learned {
            output_tokens: Some(5),
            cached_tokens: cached,
            prompt_tokens: prompt,
        }
    }

    #[test]
    fn a_delivered_hit_is_counted_and_keeps_the_entries() {
        let (c, store, m) = (cfg(), MemorySharedData::default(), MemoryMetrics::default());
        let exp = setup(&c, &store);
        // The engine's tokenizer makes 10% more tokens; it held the prefix
        // less its last partial engine block.
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(2240), Some(2253)), 200).unwrap();
        assert_eq!(
            v,
            Verdict {
                expected: 2252,
                cached: 2240,
                short: false,
                dropped: 0
            }
        );
        assert_eq!(
            m.replica(ReplicaCounter::ExpectedTokens, "127.0.0.1:8001"),
            2252
        );
        assert_eq!(
            m.replica(ReplicaCounter::CachedTokens, "127.0.0.1:8001"),
            2240
        );
        assert_eq!(m.counter(Counter::PrefixAnswers), 1);
        assert_eq!(m.counter(Counter::PrefixShortfalls), 0);
        assert_eq!(index(&c).lookup(&store, &exp.blocks, 300), vec![(7, 32)]);
        // Within one index block (64 tokens) short: still not a shortfall.
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(1984), Some(2048)), 200).unwrap();
        assert!(!v.short, "{v:?}");
    }

    #[test]
    fn a_shortfall_drops_the_entries_beyond_the_cached_depth() {
        let (c, store, m) = (cfg(), MemorySharedData::default(), MemoryMetrics::default());
        let exp = setup(&c, &store);
        // The engine held 5 blocks' worth (320 tokens): ceil(320/64) = 5
        // blocks kept; positions 7, 15 and 31 claimed more and go.
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(320), Some(2048)), 200).unwrap();
        assert_eq!(
            v,
            Verdict {
                expected: 2047,
                cached: 320,
                short: true,
                dropped: 3
            }
        );
        assert_eq!(m.counter(Counter::PrefixShortfalls), 1);
        assert_eq!(m.counter(Counter::PrefixEntriesDropped), 3);
        assert_eq!(index(&c).lookup(&store, &exp.blocks, 300), vec![(7, 4)]);
        // A flushed cache: nothing kept, every entry of host 7 goes.
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(0), None), 200).unwrap();
        assert_eq!((v.short, v.dropped), (true, 3));
        assert!(index(&c).lookup(&store, &exp.blocks, 300).is_empty());
        assert_eq!(
            m.replica(ReplicaCounter::CachedTokens, "127.0.0.1:8001"),
            320
        );
        assert_eq!(
            m.replica(ReplicaCounter::ExpectedTokens, "127.0.0.1:8001"),
            2 * 2047
        );
    }

    #[test]
    fn entries_younger_than_settle_ms_at_the_decision_stay() {
        let (c, store, m) = (cfg(), MemorySharedData::default(), MemoryMetrics::default());
        let exp = Expectation {
            decided_ms: SETTLE_MS,
            ..setup(&c, &store)
        };
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(0), Some(2048)), 200).unwrap();
        assert_eq!((v.short, v.dropped), (true, 0));
        assert_eq!(index(&c).lookup(&store, &exp.blocks, 300), vec![(7, 32)]);
    }

    #[test]
    fn no_cached_figure_teaches_nothing() {
        let (c, store, m) = (cfg(), MemorySharedData::default(), MemoryMetrics::default());
        let exp = setup(&c, &store);
        assert_eq!(
            learn(
                &c,
                &store,
                &m,
                &mut IndexCache::default(),
                &exp,
                &answer(None, Some(2048)),
                200
            ),
            None
        );
        assert_eq!(m.counter(Counter::PrefixAnswers), 0);
        assert!(m.series.borrow().is_empty());
        // A figure above the prompt is capped at it; a zero prompt is no scale.
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(9999), Some(2048)), 200).unwrap();
        assert_eq!((v.cached, v.short), (2048, false));
        let v = learn_fresh(&c, &store, &m, &exp, &answer(Some(u64::MAX), Some(0)), 200).unwrap();
        assert_eq!((v.expected, v.cached, v.short), (2047, 0, true));
    }

    #[test]
    fn only_expected_hits_and_the_prior_sample_are_read() {
        let exp = Expectation {
            host: 1,
            replica: "a".into(),
            expected_cached: 1,
            input_tokens: 1,
            blocks: vec![],
            decided_ms: 0,
        };
        assert!(read_answer(1, Some(&exp), None));
        assert!(!read_answer(1, None, None));
        assert!(read_answer(usage::OBSERVE_EVERY, None, None));
    }
}

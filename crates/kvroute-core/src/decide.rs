//! From a request to a routing decision: analyse, pick, account.
//!
//! # Affinity key
//!
//! The key that places a request on the ring is, in order:
//! 1. the **session key**, when the client names one: the first configured
//!    session header present (default `x-session-id`), else the body's
//!    `prompt_cache_key`, else `user` / `metadata.user_id`. A session is the
//!    client telling us which requests share a conversation, and it survives
//!    edits to the history that would change every prefix hash;
//! 2. else a **conversation key** (a [`Affinity::Prefix`]): the chained
//!    digest of the canonical stream up to the end of the first `user`
//!    message. Every turn of a conversation repeats the system prompt and
//!    the first question, so all its turns share this key, while
//!    conversations that ask different first questions get different keys
//!    and spread. Where the part before the first user message is shorter
//!    than `affinityBlocks` blocks, the digest is cut at that many blocks
//!    (a long first question does not change the key).
//!
//! A *bare* prompt without a session (a `/v1/completions` prompt, a
//! conversation sent as one message, or any request whose key was cut
//! inside its first user message) says nothing of where a shared part
//! ends. [`route`] learns it from the traffic ([`crate::split`]: two
//! requests that share their first `affinityBlocks` blocks and then
//! differ) and keys the request by its first block after each shared part
//! it passes, shallow to deep, until one that is rare and most of its
//! prompt, whose requests keep the key they have (the first request of
//! such a group, sent before any split was known, had it too). The
//! deepest part passed is its shared prefix, under the rule below. In the
//! fleet simulation with every conversation sent as one prompt and no
//! session headers (16 replicas, seed 1), chat's TTFT p95 went from 477
//! to 284 ms at one gateway and from 2933 to 280 ms at four
//! (docs/fleet-state.md, "Bare prompts"); `hashing.learnSplits` false
//! keeps the key of the first `affinityBlocks` blocks.
//!
//! A bare prompt holds no answers, so [`request::Body::continues`] is
//! false for it. [`route`] takes it as continuing a conversation (the
//! home among every replica, the spill guard, an arrival counted) when
//! its key is remembered ([`crate::placed`]) and the gateway's index
//! holds an earlier request whole within it past its shared part
//! ([`crate::index::Seen::extends`]): a turn that extends an earlier
//! one. A request that only shares a prefix with earlier ones does not.
//! Agent loops sent as one prompt, no session header, 16 replicas, five
//! seeds: TTFT p95 median 1454 -> 234 ms at one gateway, 1687 -> 1320 at
//! four (docs/fleet-state.md, "Bare prompts that continue").
//!
//! A request whose system part alone is `affinityBlocks` long (a long
//! system prompt, a shared document), with a session or without, also
//! carries that prefix's key ([`Facts::shared_prefix`]), which takes the
//! place of the session or conversation key when the prefix is rare (see
//! below). Until 2026-12-05 a request without a session always took the
//! shared prefix's key: every conversation over a popular system prompt
//! then had one home. In the fleet simulation without session headers
//! (16 replicas, seeds 1-3), the chat family's TTFT p95 was 324 ms at one
//! gateway and 1011 at four; with the conversation key, 196 and 212, as
//! with session headers (docs/fleet-state.md, "Conversations without a
//! session").
//!
//! Both are seeded by the model name, so one conversation's requests to two
//! models are placed independently.
//!
//! [`route`] makes a request's shared prefix the
//! affinity key instead of its session or conversation when the prefix is
//! rare and most of its requests: its share of the worker's recent requests times the
//! replicas is under `prefixAffinityShare` (default 0.25: a quarter of one
//! replica's requests) and, on average over those requests, at least
//! `prefixAffinityFirst` (0.5) of the prompt comes before the first user
//! message. A worker keeps these figures in a fixed-size decayed sketch
//! ([`crate::index::PrefixTraffic`]); no host call. Then a tenant's
//! sessions share one home where its prompt is cached, instead of a home
//! each that all hold it; a popular prompt (a chat product's few system
//! prompts) or one that is a small part of long conversations (an
//! agent's tools) keeps sessions apart. A prefix too popular for one home
//! but under the whole fleet's share, whose requests are mostly that
//! prefix (`prefixSubsetFirst`, 0.8: documents many users ask about),
//! homes its sessions within a subset: the rendezvous top of its key, one
//! replica per `prefixAffinityShare` of a replica's requests it carries.
//! Gateways estimate the figures from their own traffic, so they agree
//! except near the thresholds.
//!
//! # Cost
//!
//! Input tokens are the canonical text bytes divided by `bytesPerToken`
//! (rounded up) plus any token ids given directly; output tokens are
//! `max_tokens` (or `max_completion_tokens` / `max_output_tokens`), capped at
//! `outputTokensCap`, or the cap itself when the client gives no limit.
//!
//! A decision charges its primary twice ([`crate::load`]): the prefill it
//! expects there (the prompt less what the prefix index says is cached),
//! released at the first response body byte (the first token; not the
//! headers, which vLLM and SGLang send a stream as soon as they take the
//! request), and the KV memory it will hold
//! ([`Facts::memory`]: the prompt and half the expected output), released
//! at the end of the stream.
//!
//! # One pipeline, with or without fleet state
//!
//! A parsed request is placed by [`pick`]: a list of replicas, each with
//! the inputs of its score (prefill pending, memory held, KV capacity and
//! utilisation, headroom), then one scoring and one bounded-load pick
//! ([`crate::score`]). Only the list differs:
//!
//! - with a fleet snapshot, the snapshot's replicas that may take the
//!   request (ready, serving its model), with their engine data; where the
//!   snapshot gives the other gateways' pending prefill on a replica
//!   (`peerPendingTokens`), it adds to this gateway's, less what the
//!   replica has prefilled since it was read, at its rate (the snapshot's
//!   `prefillTokensPerS` for it, else the one its answers taught where it
//!   is well below the fastest's, [`crate::rates`], else the configured
//!   one); so
//!   do the other gateways' recent arrivals (`peerArrivalsPerS`) to this
//!   gateway's ([`crate::load`]), which a decision that continues a
//!   conversation counts on its primary in the same compare-and-swap as
//!   its charge;
//! - without one (foundation mode), the configured hosts, none with engine
//!   data: each is judged on the gateway's own figures, exactly as a
//!   snapshot replica whose data is stale (pending = the gateway's pending
//!   prefill there, memory = its memory held, no capacity so the
//!   bounded-load floor is `loadFloorTokens`, the whole `recomputeWeight`,
//!   and headroom, so the key's home is its rendezvous top over the
//!   hosts). Such decisions count as degraded. A property test checks that
//!   no snapshot and a snapshot of the same hosts with only stale data
//!   decide alike.
//!
//! On an idle gateway this is the rendezvous pick it always was: the home
//! costs the least (its assumed cached share), the other replicas tie and
//! follow in rendezvous order, and the golden vectors
//! (`tests/vectors.rs`) did not change. Under load the order after the
//! home is the gateway's pending prefill, then the rendezvous rank, and a
//! key leaves its home when its pending prefill costs more than the cache
//! saves there, or when bounded load on memory moves it (reason `spill`).
//!
//! # Key memory
//!
//! Every gateway credits a key's home with `homeCachedShare` of any prompt
//! sent under the key, even a *cold* one (the index knows none of its
//! blocks, it continues no conversation): that credit is what makes
//! gateways agree where a new key goes, and makes its later requests find
//! it, but it keeps a cold prompt on a busy home where it is as cold as
//! anywhere. With `coldHomeShare` set below `homeCachedShare`, a cold
//! request's home is credited with that share instead, so it leaves a busy
//! home by cost (its cost carries no `recomputeWeight`: a cold request
//! computes nothing a second time), and the gateway remembers where it
//! placed the key ([`crate::placed`]: an entry in the prefix index under
//! the key, salted, written by the key's first request that continues no
//! conversation, cold or not, and kept current by every later request of
//! the key; a first request whose system prompt the index knows elsewhere
//! may leave the home by cost too, and the other gateways, which know
//! nothing of its own text, need its replica all the same). While the entry lives (`prefixTtlMs`), that replica stands
//! for the key's rendezvous top, and a request of the key is not cold.
//! The gateway also reports the placement in its load, and a collector
//! that reads several gateways hands it to the others, which write it
//! into their own index. In the fleet simulation (16 replicas, five
//! seeds) the default, 0.25 with no weight on cold requests, gives the
//! Mooncake trace a TTFT p95 of 1434 ms at one gateway (1640 without key
//! memory, 1556 with 0.75 and the weight) and 1612 at four with one
//! collector (1660 with 0.75 and the weight); mix 4-5 % lower; agent's
//! ten-seed median 12 % higher at one gateway (the rule moves its cold
//! first turns off busy homes); the other families' medians within 2 ms
//! (docs/fleet-state.md, "Key memory, shared through the collector").
//!
//! A request that starts a conversation, of which the index knows only
//! the part before its first user message (a system prompt other
//! conversations share), is not cold, and its home is credited with
//! `sharedOnlyHomeShare`. At 0.25 (as `coldHomeShare`) it leaves a busy
//! home by cost as a cold one does, and the key memory records where it
//! went. Unset, it is 0.25 where the snapshot carries other gateways' load
//! (`peerPendingTokens`: one collector for every gateway, or sidecars that
//! read their peers), so every gateway learns where the request went, and
//! `homeCachedShare` elsewhere: gateways that read no other gateway would
//! send the next turn home (in the fleet simulation, `kvroute-alone`, four
//! gateways, every family slowed and stickiness fell 2-7 points), and a
//! single gateway cannot be told from those. With other gateways' load it
//! took agent's TTFT p95 from 219 to 181 ms at four gateways with session
//! headers and from 1250 to 148 without (docs/fleet-state.md, "A first
//! request known only by its shared part"). A bare prompt, whose shared
//! part is learned from traffic, keeps `homeCachedShare` in any case:
//! there 0.25 made bursts 9-11 % worse.
//!
//! The prefix index ([`crate::index`]) is used in both modes. It lives in
//! shared data, records what this gateway sent where, and needs no
//! snapshot; it is the gateway's own evidence, not engine data. Without it
//! the cost would mislead: the pending prefill charged to a replica is the
//! prompt less what the index expects cached there, so without the index
//! each request of a hot conversation would count its whole prompt as
//! pending at the home where most of it is cached, and the home would look
//! busier than it is by that much per request in flight. In
//! `a_hot_session_stays_home_until_bounded_load` (about 5000-token
//! prompts) the fifth concurrent request then left its home by cost, under
//! its own reason, before bounded load would have moved it; with the index
//! it stays home until bounded load spills it, as the foundation pick did.
//! The index also places a continuing request that shares a long prefix
//! but not the affinity key (different sessions over one document) where
//! the prefix was sent. A request that starts a conversation (no answers
//! in it yet) is not put behind a replica the index names only for the
//! part before its first user message (a system prompt or document that
//! other conversations share): its later turns go to the key's home on
//! every gateway, so the home is credited with as much of that part as
//! the index knows anywhere, and only the cost (the home's pending
//! prefill) or bounded load moves it. Measured on the chat family
//! (16 replicas, three seeds): TTFT p95 227 -> 212 ms at one gateway, 226
//! -> 216 at four; docs/fleet-state.md has every family. The index gives
//! answers something to check ([`crate::answers`]:
//! an engine that evicted the prefix removes the entries). Its cost is a
//! lookup and a record per parsed request in shared data (the worker's
//! [`IndexCache`] saves most reads), as with a snapshot; not measured for
//! foundation mode separately.

use xxhash_rust::xxh64::xxh64;

use crate::config::Config;
use crate::fleet::{FleetHost, FleetView};
use crate::hash::{model_seed, BlockHasher};
use crate::host::{Counter, Gauge, Metrics, SharedData};
use crate::index::{self, Index, IndexCache};
use crate::load::{self, Charge, Entry, LoadTable};
use crate::picker::{self, Bounds, HostSet, Pick};
use crate::placed;
use crate::request::{self, CanonicalSink, Endpoint, ParseError};
use crate::score::{self, Candidate, SpillGuard};
use crate::usage;

/// Separates session keys from prefix keys of the same model.
const SESSION_SALT: u64 = 0x5e55_1011_4b65_7900;

/// Why a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The session key's first admissible preference.
    Session,
    /// The prefix key's first admissible preference.
    Prefix,
    /// Bounded load moved the request off its first preference.
    Spill,
    /// The request was not parsed; least-loaded order.
    Fallback,
    /// No host to route to.
    NoHosts,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Session => "session",
            Reason::Prefix => "prefix",
            Reason::Spill => "spill",
            Reason::Fallback => "fallback",
            Reason::NoHosts => "no-hosts",
        }
    }

    fn counter(self) -> Counter {
        match self {
            Reason::Session => Counter::DecisionSession,
            Reason::Prefix => Counter::DecisionPrefix,
            Reason::Spill => Counter::DecisionSpill,
            Reason::Fallback => Counter::DecisionFallback,
            Reason::NoHosts => Counter::DecisionNoHosts,
        }
    }
}

/// Why a request was not parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unparsed {
    /// Another method or path.
    NotInference,
    Empty,
    /// Not JSON, wrong types, missing required fields.
    Invalid,
    TooDeep,
    /// Larger than `maxBodyBytes`.
    TooLarge,
}

impl Unparsed {
    pub fn counter(self) -> Counter {
        match self {
            Unparsed::NotInference => Counter::UnparsedNotInference,
            Unparsed::Empty => Counter::UnparsedEmpty,
            Unparsed::Invalid => Counter::UnparsedInvalid,
            Unparsed::TooDeep => Counter::UnparsedTooDeep,
            Unparsed::TooLarge => Counter::UnparsedTooLarge,
        }
    }
}

/// How the affinity key was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    Session(u64),
    Prefix(u64),
}

impl Affinity {
    pub fn key(self) -> u64 {
        match self {
            Affinity::Session(k) | Affinity::Prefix(k) => k,
        }
    }
}

/// What routing needs to know about a parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub endpoint: Endpoint,
    /// The request's `model` ("" when absent).
    pub model: String,
    pub affinity: Affinity,
    /// Chained prefix block hashes, at most `maxBlocks`.
    pub blocks: Vec<u64>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub stream: bool,
    pub non_text_parts: u64,
    /// The prompt continues a conversation ([`request::Body::continues`]);
    /// [`route`] also takes a bare prompt that extends an earlier one as
    /// continuing.
    pub continues: bool,
    /// The prefix key, when the prompt's first `affinityBlocks` blocks come
    /// before the end of its first user message (a long shared prefix);
    /// the affinity key is then the session's or the conversation's.
    pub shared_prefix: Option<SharedPrefix>,
    /// For a request that continues a conversation: the whole blocks of
    /// its previous request's prompt (the canonical stream before the last
    /// answer), when they reach into the first user message's text.
    pub previous_blocks: Option<usize>,
    /// Whole blocks that end before the first user message's text (a
    /// system prompt or document other conversations may share; 0 without
    /// a user message).
    pub shared_blocks: usize,
    /// For a request without a session or conversation key (a bare
    /// prompt, or a key cut inside the first user message: nothing says
    /// where a shared part ends), the digest of its whole prompt; [`route`]
    /// may key it past a shared part it learns ([`crate::split`]).
    pub bare_digest: Option<u64>,
}

/// A long prefix a session's request shares with others, and how much of
/// the prompt comes before the end of its first user message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedPrefix {
    pub key: u64,
    pub share: f64,
}

impl Eq for SharedPrefix {}

impl Facts {
    pub fn cost(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// The KV memory the request is expected to hold, in tokens: its prompt
    /// and half its expected output (the output grows from none to all
    /// over the request's life). With the whole output, the gateway's
    /// figure ran at about 1.35x the engines' KV in use on the chat family
    /// (16 replicas, one gateway), and the memory term moved conversations
    /// off replicas that had room.
    pub fn memory(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens / 2)
    }
}

/// Feeds the canonical stream into the block hasher and captures the prefix
/// key at the anchor or at the affinity cut, whichever comes first.
struct Sink {
    hasher: BlockHasher,
    cut: u64,
    key: Option<u64>,
    /// The digest at the anchor (the end of the first user message).
    conversation: Option<u64>,
    /// Canonical bytes before the first user message.
    first_user_at: Option<u64>,
    /// Canonical bytes before the last answer.
    answer_at: Option<u64>,
    text_bytes: u64,
    token_ids: u64,
}

impl Sink {
    fn feed(&mut self, mut bytes: &[u8]) {
        if self.key.is_none() {
            let room = self.cut.saturating_sub(self.hasher.total_bytes());
            if (bytes.len() as u64) >= room {
                let (head, tail) = bytes.split_at(room as usize);
                self.hasher.write(head);
                self.key = Some(self.hasher.digest());
                bytes = tail;
            }
        }
        self.hasher.write(bytes);
    }
}

impl CanonicalSink for Sink {
    fn bytes(&mut self, bytes: &[u8]) {
        self.text_bytes += bytes.len() as u64;
        self.feed(bytes);
    }

    fn first_user(&mut self) {
        if self.first_user_at.is_none() {
            self.first_user_at = Some(self.hasher.total_bytes());
        }
    }

    fn answer_starts(&mut self) {
        self.answer_at = Some(self.hasher.total_bytes());
    }

    fn anchor(&mut self) {
        let at = self.hasher.digest();
        self.key.get_or_insert(at);
        self.conversation.get_or_insert(at);
    }

    fn token_ids(&mut self, ids: &[u32]) {
        self.token_ids += ids.len() as u64;
        for id in ids {
            self.feed(&id.to_le_bytes());
        }
    }
}

fn non_empty(s: Option<&str>) -> Option<&str> {
    s.map(str::trim).filter(|s| !s.is_empty())
}

/// Whether the request's declared `content-length` already exceeds
/// `maxBodyBytes`, so its body will not be parsed: the filter then decides in
/// the header callback and never holds any of the body.
///
/// Holding part of such a body is not only useless, it can turn the request
/// into a 413 from Envoy: when a filter that paused the headers continues,
/// Envoy first appends the newly read data to what that filter buffered and
/// checks the sum against the listener's buffer limit. One socket read can
/// bring up to that limit, so a body over the limit was refused whenever a
/// small first piece had been held (found by tests/e2e/test_hostile.py).
/// A missing or unparsable value is not "too large": the body callbacks
/// count the bytes as they come.
pub fn declared_over_cap(content_length: Option<&str>, max_body_bytes: usize) -> bool {
    content_length
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > u64::try_from(max_body_bytes).unwrap_or(u64::MAX))
}

/// Parses and hashes a request body. `session_header` is the value of the
/// first configured session header present.
pub fn analyze(
    cfg: &Config,
    endpoint: Endpoint,
    session_header: Option<&str>,
    body: &[u8],
) -> Result<Facts, Unparsed> {
    if body.len() > cfg.max_body_bytes {
        return Err(Unparsed::TooLarge);
    }
    let parsed = request::parse(endpoint, body).map_err(|e| match e {
        ParseError::Empty => Unparsed::Empty,
        ParseError::TooDeep => Unparsed::TooDeep,
        ParseError::Invalid(_) => Unparsed::Invalid,
    })?;
    let seed = model_seed(parsed.model.as_deref().unwrap_or(""));
    let mut sink = Sink {
        hasher: BlockHasher::new(seed, cfg.block_bytes, cfg.max_blocks),
        // In u64: on wasm32 the product of two allowed values (65536 each)
        // would wrap usize to 0 (found by reading for the fuzz campaign).
        cut: (cfg.affinity_blocks as u64).saturating_mul(cfg.block_bytes as u64),
        key: None,
        conversation: None,
        first_user_at: None,
        answer_at: None,
        text_bytes: 0,
        token_ids: 0,
    };
    parsed.canonical(&mut sink);
    let session = non_empty(session_header)
        .or_else(|| non_empty(parsed.prompt_cache_key.as_deref()))
        .or_else(|| non_empty(parsed.user.as_deref()));
    // The key was cut before the first user message (the anchor, which
    // comes after it, did not take it): the shared part alone is
    // `affinityBlocks` long.
    let long_prefix = sink.key.is_some() && sink.first_user_at.is_none_or(|at| at >= sink.cut);
    // Without a session, a conversation whose shared part alone is
    // `affinityBlocks` long is keyed by its bytes up to the anchor, as a
    // session would be: the shared part is then its `shared_prefix`, which
    // places it only when rare ([`route`]).
    let conversation = sink.conversation.filter(|_| long_prefix);
    let affinity = match (session, conversation) {
        (Some(s), _) => Affinity::Session(xxh64(s.as_bytes(), seed ^ SESSION_SALT)),
        (None, Some(c)) => Affinity::Prefix(c),
        (None, None) => Affinity::Prefix(sink.key.unwrap_or_else(|| sink.hasher.digest())),
    };
    let total = sink.hasher.total_bytes().max(1);
    let shared_prefix = match (session, conversation) {
        (Some(_), _) | (None, Some(_)) if long_prefix => sink.key.map(|k| SharedPrefix {
            key: k,
            share: sink.first_user_at.unwrap_or(total).min(total) as f64 / total as f64,
        }),
        _ => None,
    };
    // The previous prompt's whole blocks must reach into the first user
    // message's text: blocks of a shared system prompt say nothing of
    // where the conversation was served.
    let bb = cfg.block_bytes.max(1) as u64;
    let previous_blocks = sink
        .answer_at
        .map(|at| at / bb)
        .filter(|&whole| {
            whole * bb
                > sink
                    .first_user_at
                    .map_or(u64::MAX, |a| a + request::USER_HEADER)
        })
        .map(|whole| whole as usize);
    let shared_blocks = sink
        .first_user_at
        .map_or(0, |a| ((a + request::USER_HEADER) / bb) as usize);
    let bare_digest = (session.is_none() && conversation.is_none()).then(|| sink.hasher.digest());
    let input_tokens = sink.text_bytes.div_ceil(cfg.bytes_per_token) + sink.token_ids;
    let output_tokens = parsed
        .max_tokens
        .unwrap_or(cfg.output_tokens_cap)
        .min(cfg.output_tokens_cap);
    Ok(Facts {
        endpoint,
        model: parsed.model.as_deref().unwrap_or("").to_owned(),
        affinity,
        blocks: sink.hasher.into_blocks(),
        input_tokens,
        output_tokens,
        stream: parsed.stream,
        non_text_parts: parsed.non_text_parts,
        continues: parsed.continues(),
        shared_prefix,
        previous_blocks,
        shared_blocks,
        bare_digest,
    })
}

/// Replaces the output-token estimate with the model's learned prior when
/// the client asks for far more than the model typically produces.
pub fn apply_prior(cfg: &Config, store: &dyn SharedData, facts: &mut Facts) {
    apply_prior_value(
        facts,
        usage::read(store, &cfg.shared_data_prefix, &facts.model),
    );
}

/// [`apply_prior`] with a prior already read (e.g. from a
/// [`usage::PriorCache`]).
pub fn apply_prior_value(facts: &mut Facts, prior: Option<usage::Prior>) {
    if let Some(prior) = prior {
        facts.output_tokens = prior.estimate(facts.output_tokens);
    }
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub reason: Reason,
    /// Positions in the routing universe (config hosts, or the snapshot's).
    pub pick: Option<Pick>,
    /// Addresses: the primary, then the fallbacks.
    pub targets: Vec<String>,
    /// Some candidate was scored on gateway-side load only (its data was
    /// stale), or there was no snapshot at all.
    pub degraded: bool,
    pub key: Option<u64>,
    /// What was added to the load table, to be released later.
    pub charge: Option<Charge>,
    /// Prompt tokens the prefix index expected cached on the primary (the
    /// prompt less the prefill charged there; 0 without an index hit). The
    /// answer's own figure is compared with it ([`crate::answers`]).
    pub expected_cached: u64,
    /// Prefill tokens the decision saw pending on the primary, ahead of
    /// this request (0 where the decision scored no replica). An answer
    /// with little pending ahead is a sample of the replica's prefill rate
    /// ([`crate::rates`]).
    pub pending: u64,
}

/// The bounded-load parameters of a decision. The floor is per replica
/// ([`Candidate::floor`]), so the shared one is 0.
fn bounds(cfg: &Config) -> Bounds {
    Bounds {
        epsilon: cfg.epsilon,
        floor: 0,
        fallbacks: cfg.fallbacks,
    }
}

fn targets(hosts: &HostSet, p: &Pick) -> Vec<String> {
    std::iter::once(p.primary)
        .chain(p.fallbacks.iter().copied())
        .filter_map(|i| hosts.get(i).map(|h| h.addr.clone()))
        .collect()
}

/// What one replica looks like to a decision: the inputs of its score.
struct Replica {
    /// Position in the routing universe (the snapshot's or the configured
    /// host list).
    index: usize,
    id: u64,
    /// Its engine data is current.
    fresh: bool,
    /// Headroom by the snapshot alone (the same on every gateway); true
    /// where nothing is known of the engine.
    headroom: bool,
    pending: u64,
    memory: u64,
    capacity: Option<u64>,
    /// The snapshot's KV utilisation (0 without current engine data).
    kv: f64,
    /// Requests that continue a conversation, per second, sent it lately
    /// (`arrivalWindowMs`): this gateway's ([`LoadTable::arrival_rate`]),
    /// plus the other gateways' (`peerArrivalsPerS`) where its data is
    /// current.
    arrivals: f64,
    /// Its current data carries other gateways' load
    /// (`peerPendingTokens`): the collector reads them, and hands each
    /// gateway the others' placements.
    peers: bool,
    /// Prompt tokens it prefills per second: the snapshot's
    /// `prefillTokensPerS` for it where given, or the one learned from its
    /// answers ([`crate::rates`], written into the view's host when the
    /// snapshot was decoded) (current or stale data: a
    /// rate, like a capacity, does not change with the data's age), else
    /// `fleet.prefillTokensPerS`.
    rate: f64,
}

impl Replica {
    /// A replica with no engine data: no snapshot at all, or stale metrics.
    /// It is judged on the gateway's own figures (what it sent there:
    /// prefill pending, memory held) and may be a home.
    fn unobserved(index: usize, id: u64, gw: Entry, arrivals: f64, rate: f64) -> Replica {
        Replica {
            index,
            id,
            fresh: false,
            headroom: true,
            pending: gw.prefill,
            memory: gw.memory,
            capacity: None,
            kv: 0.0,
            arrivals,
            peers: false,
            rate,
        }
    }
}

/// The configured hosts as replicas, none with engine data.
fn configured(cfg: &Config, table: &LoadTable, now_ms: u64) -> Vec<Replica> {
    let window = cfg.fleet.arrival_window_ms;
    table
        .aligned(&cfg.hosts)
        .into_iter()
        .enumerate()
        .map(|(index, gw)| {
            let arrivals = table.arrival_rate(gw.host, now_ms, window);
            Replica::unobserved(index, gw.host, gw, arrivals, cfg.fleet.prefill_tokens_per_s)
        })
        .collect()
}

/// The snapshot's replicas that may take the request (ready, serving its
/// model; see [`Standing`]), and whether any of them has stale data.
fn observed(
    cfg: &Config,
    facts: &Facts,
    view: &FleetView,
    table: &LoadTable,
    now_ms: u64,
) -> (Vec<Replica>, bool) {
    let f = &cfg.fleet;
    let view_age = view.age_ms(now_ms);
    // One pass over the fleet: the standing first (a few field reads), the
    // model list only for replicas that are not out. (Measured cheaper than
    // two passes without this list: callgrind, examples/request_path.rs.)
    let serving: Vec<(usize, Standing)> = view
        .hosts
        .iter()
        .enumerate()
        .filter_map(|(index, host)| {
            let s = standing(cfg, host, view_age);
            (s != Standing::Out && host.state.serves(&facts.model)).then_some((index, s))
        })
        .collect();
    let wanted = wanted(|s| serving.iter().any(|&(_, t)| t == s));
    let gateway = table.aligned(&view.set);
    let mut degraded = false;
    let mut replicas = Vec::with_capacity(serving.len());
    for &(index, _) in serving.iter().filter(|&&(_, s)| s == wanted) {
        let (Some(host), Some(id), Some(&gw)) = (
            view.hosts.get(index),
            view.set.get(index),
            gateway.get(index),
        ) else {
            continue;
        };
        let st = &host.state;
        let capacity = st.kv_capacity_tokens.filter(|&c| c > 0);
        // This gateway's recent arrivals there; the other gateways' as the
        // collector read them (`peerArrivalsPerS`) are added below, for
        // current data only (the figure is not aged).
        let arrivals = table.arrival_rate(id.id, now_ms, f.arrival_window_ms);
        // A replica's prefill rate, like its capacity, does not change with
        // the age of its data.
        let rate = st.prefill_tokens_per_s.unwrap_or(f.prefill_tokens_per_s);
        // Stale metrics say nothing reliable about load: such a replica is
        // judged on the gateway's own figures, as without a snapshot (only
        // its capacity, which does not change, is still used), and Envoy's
        // retries cover it if it is gone.
        if host.age_ms(view_age) > f.stale_after_ms {
            degraded = true;
            replicas.push(Replica {
                capacity,
                ..Replica::unobserved(index, id.id, gw, arrivals, rate)
            });
            continue;
        }
        let waiting = u64::from(st.waiting).saturating_mul(f.waiting_request_tokens);
        // The other gateways' pending prefill here, as the collector read
        // it, at `peerPendingWeight` (their charges know less of what is
        // cached here than this gateway's), less what the replica has
        // prefilled since at its rate.
        let peer = st.peer_pending_tokens.map_or(0, |p| {
            let age_s = host.age_ms(view_age) as f64 / 1000.0;
            let counted = (p as f64 * f.peer_pending_weight) as u64;
            counted.saturating_sub((age_s * rate) as u64)
        });
        let pending = waiting.max(gw.prefill.saturating_add(peer));
        // The engine's KV in use, plus what waits to be admitted (not in
        // its KV yet).
        let engine_memory = st.kv_capacity_tokens.map(|c| {
            ((st.kv_utilization.clamp(0.0, 1.0) * c as f64) as u64).saturating_add(pending)
        });
        replicas.push(Replica {
            index,
            id: id.id,
            fresh: true,
            headroom: st.kv_utilization < f.kv_pressure && st.waiting < f.queue_pressure,
            pending,
            memory: engine_memory.unwrap_or(0).max(gw.memory),
            capacity,
            kv: st.kv_utilization.clamp(0.0, 1.0),
            arrivals: arrivals + st.peer_arrivals_per_s.unwrap_or(0.0),
            peers: st.peer_pending_tokens.is_some(),
            rate,
        });
    }
    (replicas, degraded)
}

/// Whether some replica that may take the request has room for it, by the
/// placement's own figures: the prefill pending ahead of it (the larger of
/// the engine's queue and the gateway's dispatches) takes at most
/// `admission.maxPendingS` at its rate (the snapshot's or the learned one,
/// else `prefillTokensPerS`), and its memory with the
/// request stays within `admission.maxMemory` of its KV capacity (without a
/// capacity: KV utilisation below `kvPressure`). A replica without current
/// engine data has room (nothing is held on missing data), and so has a
/// gateway without a snapshot; when no replica serves the model the
/// request goes on to get its 503 from [`route`]. Used by admission
/// control ([`crate::admit`]); `table` is the gateway's load.
pub fn headroom(
    cfg: &Config,
    facts: &Facts,
    fleet: Option<&FleetView>,
    table: &LoadTable,
    now_ms: u64,
) -> bool {
    let Some(view) = fleet else {
        return true;
    };
    let (replicas, _) = observed(cfg, facts, view, table, now_ms);
    if replicas.is_empty() {
        return true;
    }
    let a = &cfg.admission;
    let need = facts.memory();
    replicas.iter().any(|r| {
        if !r.fresh {
            return true;
        }
        let memory = match r.capacity {
            Some(c) => r.memory.saturating_add(need) as f64 <= a.max_memory * c as f64,
            None => r.kv < cfg.fleet.kv_pressure,
        };
        memory && r.pending as f64 <= a.max_pending_s * r.rate
    })
}

/// The share of the prompt the prefix index expects cached on `id`.
fn indexed_share(hits: &[(u64, u32)], id: u64, blocks: usize) -> f64 {
    hits.iter()
        .find(|(h, _)| *h == id)
        .map_or(0.0, |&(_, d)| f64::from(d) / blocks.max(1) as f64)
        .min(1.0)
}

/// What the gateway counts as pending on `id` until the first byte: the
/// prompt less what its own index knows is cached there (not the home's
/// assumed share: a hot key's home would look idle), at least one token.
fn uncached_by_index(facts: &Facts, hits: &[(u64, u32)], id: u64) -> u64 {
    let share = indexed_share(hits, id, facts.blocks.len());
    ((facts.input_tokens as f64 * (1.0 - share)) as u64).max(1)
}

/// Picks a replica for parsed facts: the one decision pipeline
/// ([`crate::score`]). With a snapshot the candidates are its replicas
/// that may take the request, scored on their engine data; without one,
/// the configured hosts, none with engine data, scored on `table` (the
/// gateway's load) alone. `hits` is the prefix index's answer for the
/// request's blocks. No accounting: [`route`] charges the result.
pub fn pick(
    cfg: &Config,
    facts: &Facts,
    fleet: Option<&FleetView>,
    table: &LoadTable,
    hits: &[(u64, u32)],
    now_ms: u64,
) -> Decision {
    let keyed = Keyed {
        affinity: facts.affinity,
        subset: None,
        moved: None,
        shared_blocks: facts.shared_blocks,
        continues: facts.continues,
    };
    pick_keyed(cfg, facts, keyed, fleet, table, hits, now_ms)
}

/// The replicas a shared prefix's sessions are homed on: the `size`
/// rendezvous top of its key (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Subset {
    key: u64,
    size: usize,
}

/// How [`route`] keys a request, where it differs from the request's own
/// facts.
#[derive(Debug, Clone, Copy)]
struct Keyed {
    /// The key placed on the ring (a session placed by its shared prefix,
    /// a bare prompt past the part it shares: see the module doc).
    affinity: Affinity,
    subset: Option<Subset>,
    /// Where this gateway remembers placing the key (`coldHomeShare`).
    moved: Option<u64>,
    /// Whole blocks of the part other conversations share
    /// ([`Facts::shared_blocks`], or past a learned split).
    shared_blocks: usize,
    /// The request continues a conversation: its prompt holds an answer
    /// ([`Facts::continues`]), or it is a bare prompt of a remembered key
    /// that holds an earlier request whole (see [`route`]).
    continues: bool,
}

/// [`pick`] keyed as `keyed` says.
fn pick_keyed(
    cfg: &Config,
    facts: &Facts,
    keyed: Keyed,
    fleet: Option<&FleetView>,
    table: &LoadTable,
    hits: &[(u64, u32)],
    now_ms: u64,
) -> Decision {
    match fleet {
        Some(view) => {
            let (replicas, degraded) = observed(cfg, facts, view, table, now_ms);
            scored(cfg, facts, keyed, &view.set, &replicas, hits, degraded)
        }
        None => {
            let replicas = configured(cfg, table, now_ms);
            scored(cfg, facts, keyed, &cfg.hosts, &replicas, hits, true)
        }
    }
}

/// Scores `replicas` (positions in `hosts`) and picks among them under
/// bounded load; the decision charges the primary.
fn scored(
    cfg: &Config,
    facts: &Facts,
    keyed: Keyed,
    hosts: &HostSet,
    replicas: &[Replica],
    hits: &[(u64, u32)],
    degraded: bool,
) -> Decision {
    let Keyed {
        affinity,
        subset,
        moved,
        shared_blocks,
        continues,
    } = keyed;
    let f = &cfg.fleet;
    let key = affinity.key();
    // A shared prefix's subset: the replicas whose rank for its key is
    // among the `size` highest (the least of those ranks is the cut).
    let cut = subset.and_then(|sub| {
        let mut ranks: Vec<u64> = replicas
            .iter()
            .map(|r| picker::rank(sub.key, r.id))
            .collect();
        let k = sub.size.max(1) - 1;
        (k < ranks.len()).then(|| (sub.key, *ranks.select_nth_unstable_by(k, |a, b| b.cmp(a)).1))
    });
    let within = |id: u64| cut.is_some_and(|(key, least)| picker::rank(key, id) >= least);
    // The key's home: its rendezvous top among the replicas with headroom
    // (within the subset first); for a request that continues a
    // conversation, among them all (the conversation is there; the cost
    // moves it if it must).
    // Where this gateway placed the key's cold request, if it remembers
    // (`coldHomeShare`), stands for the rendezvous top.
    let eligible = |r: &&Replica| r.headroom || continues;
    let home = moved
        .filter(|&m| replicas.iter().filter(eligible).any(|r| r.id == m))
        .or_else(|| {
            replicas
                .iter()
                .filter(eligible)
                .max_by_key(|r| (within(r.id), picker::rank(key, r.id)))
                .map(|r| r.id)
        });
    // A cold request: the index knows none of its blocks anywhere, it
    // continues no conversation, and no gateway has said where its key
    // went (a remembered key's earlier request is on the replica that
    // stands for its home). It computes nothing a second time anywhere,
    // so no replica's cost carries `recomputeWeight`: the home's credit is
    // an assumption about where the key's later requests go, not a cache
    // it would duplicate elsewhere.
    let starts = !continues && moved.is_none();
    let cold = starts && hits.is_empty();
    // A request that starts a conversation, of a key no gateway placed,
    // which the index knows only as far as the part it shares with other
    // conversations (a system prompt): nothing of its own text is cached
    // anywhere, so the home's credit is an assumption about its later
    // requests, as for a cold one (`sharedOnlyHomeShare`). Only where its
    // messages say where that part ends: a bare prompt's shared part is
    // learned from traffic (a split), and there the home's full credit
    // measured better (docs/fleet-state.md, "A first request known only
    // by its shared part"). Unset, the rule applies only where the
    // snapshot carries other gateways' load: there every gateway learns
    // where the request went. Gateways that read no other gateway would
    // send its next turn home.
    let shared_only = starts
        && facts.shared_blocks > 0
        && !hits.is_empty()
        && hits.iter().all(|&(_, d)| d as usize <= shared_blocks);
    let home_share = if cold {
        f.cold_home_share
    } else if shared_only && replicas.iter().any(|r| r.peers) {
        f.shared_only_with_peers
    } else if shared_only {
        f.shared_only_home_share
    } else {
        f.home_cached_share
    };
    let input = facts.input_tokens as f64;
    let need = facts.memory();
    let blocks = facts.blocks.len();
    // Whether this gateway's index shows `id` served the previous request
    // of the conversation: it was sent that request's whole prompt.
    let previous = facts.previous_blocks.map_or(0, |p| p.min(blocks));
    let served = |&(_, d): &(u64, u32)| previous > 0 && d as usize >= previous;
    // The index shows another replica served the conversation's previous
    // request (from this gateway), and the home did not: the home's
    // assumed share does not apply, the index's evidence decides.
    let elsewhere = hits.iter().any(served)
        && home.is_some_and(|h| !hits.iter().any(|hit| hit.0 == h && served(hit)));
    // A request that starts a conversation decides where its later turns
    // find their history: they go to the key's home on every gateway. The
    // index (counting each block's most recent owner only, as for any
    // request placed by its session key) names the last replica sent the
    // part before the first
    // user message (a system prompt or document other conversations
    // share), which says nothing of where this conversation belongs, so
    // the home is credited with as much of that part as the index knows
    // anywhere; the cost still moves the request off a busy home. Evidence
    // that reaches into the user's own text is not shared and still wins.
    let first_turn_share = if continues {
        0.0
    } else {
        let shared = shared_blocks.min(blocks);
        hits.iter()
            .map(|&(_, d)| (d as usize).min(shared))
            .max()
            .map_or(0.0, |d| d as f64 / blocks.max(1) as f64)
    };
    let cands: Vec<Candidate> = replicas
        .iter()
        .map(|r| {
            let indexed = indexed_share(hits, r.id, facts.blocks.len());
            // The home is assumed to hold what every gateway sent there
            // under this key; the index's own evidence elsewhere wins when
            // it is deeper, and the assumption is dropped when the index
            // shows the previous turn went elsewhere.
            let share = if home == Some(r.id) && !elsewhere {
                indexed.max(home_share).max(first_turn_share)
            } else {
                indexed
            };
            let uncached = input * (1.0 - share);
            // Predicted KV use; without a capacity, the engine's own
            // utilisation (this request's share unknown; 0 without
            // engine data, so no memory term).
            let used = r
                .capacity
                .map_or(r.kv, |c| r.memory.saturating_add(need) as f64 / c as f64);
            let over = ((used - f.memory_knee) / (1.0 - f.memory_knee)).max(0.0);
            let memory_term = f.memory_seconds * over * over;
            // A prefix computed again costs others only where memory is in
            // demand: the whole weight from `recomputeFullKv` of predicted
            // use, in proportion below it. Without engine data nothing is
            // known of the replica's memory: the whole weight. A cold
            // request computes no prefix again: none.
            let weight = if cold {
                0.0
            } else if r.fresh && f.recompute_full_kv > 0.0 {
                f.recompute_weight * (used / f.recompute_full_kv).clamp(0.0, 1.0)
            } else {
                f.recompute_weight
            };
            let ttft = (r.pending as f64 + uncached * (1.0 + weight)) / r.rate;
            // The requests that arrive behind this prefill wait for it:
            // at the replica's recent arrival rate, `rate x prefill` of
            // them, half the prefill each on average.
            let prefill_s = uncached / r.rate;
            let delay = f.arrival_delay_weight * r.arrivals * prefill_s * prefill_s / 2.0;
            Candidate {
                index: r.index,
                id: r.id,
                score: -(ttft + memory_term + delay),
                pressured: r.fresh && !r.headroom,
                memory_costed: r.fresh && r.capacity.is_some(),
                load: r.memory,
                floor: r.capacity.map_or(cfg.load_floor_tokens, |c| {
                    ((c as f64 * f.memory_floor) as u64).saturating_sub(need)
                }),
            }
        })
        .collect();
    // A conversation's history is on its home: bounded load moves it off
    // only when the move costs little more (the cost's memory term already
    // moves it off a full home).
    let guard = (continues && f.spill_cost_ratio > 0.0).then_some(SpillGuard {
        ratio: f.spill_cost_ratio,
        margin_s: f.spill_margin_s,
    });
    let pick = score::pick_scored(&cands, key, need, f.cost_quantum_s, bounds(cfg), guard);
    let key = Some(key);
    let Some(p) = pick else {
        return Decision {
            reason: Reason::NoHosts,
            pick: None,
            targets: Vec::new(),
            degraded,
            key,
            charge: None,
            expected_cached: 0,
            pending: 0,
        };
    };
    let reason = match (p.spilled, affinity) {
        (true, _) => Reason::Spill,
        (false, Affinity::Session(_)) => Reason::Session,
        (false, Affinity::Prefix(_)) => Reason::Prefix,
    };
    let primary = hosts.get(p.primary);
    let uncached = primary.map_or(facts.input_tokens, |h| uncached_by_index(facts, hits, h.id));
    Decision {
        reason,
        targets: targets(hosts, &p),
        pick: Some(p),
        degraded,
        key,
        charge: primary.map(|h| Charge {
            host: h.id,
            prefill: uncached,
            memory: facts.memory(),
        }),
        expected_cached: facts.input_tokens.saturating_sub(uncached),
        pending: primary
            .and_then(|h| replicas.iter().find(|r| r.id == h.id))
            .map_or(0, |r| r.pending),
    }
}

fn publish_totals(metrics: &dyn Metrics, table: &LoadTable) {
    let (prefill, memory) = table.totals();
    metrics.gauge(Gauge::InflightPrefillTokens, prefill);
    metrics.gauge(Gauge::InflightMemoryTokens, memory);
}

/// Whether a replica may take work, by what the snapshot says of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Ready and not draining; or the whole snapshot is stale, so nothing
    /// current is known of it.
    Usable,
    /// A current snapshot calls it not ready (or draining) on the
    /// collector's latest attempt, while its metrics are stale: the
    /// collector cannot reach it (an engine that died or hangs). Used only
    /// when no usable replica serves the model, so that a collector cut off
    /// from every engine does not take the fleet down with it.
    LastResort,
    /// Its engine answered, recently, that it is not ready or is draining.
    Out,
}

fn standing(cfg: &Config, host: &FleetHost, view_age: u64) -> Standing {
    let stale_after = cfg.fleet.stale_after_ms;
    if host.state.ready && !host.state.draining {
        Standing::Usable
    } else if host.age_ms(view_age) <= stale_after {
        Standing::Out
    } else if view_age <= stale_after {
        Standing::LastResort
    } else {
        Standing::Usable
    }
}

/// The standing a candidate needs: usable if `any` finds a usable replica;
/// replicas a current snapshot calls down are used only when it does not.
fn wanted(any: impl Fn(Standing) -> bool) -> Standing {
    if any(Standing::Usable) {
        Standing::Usable
    } else {
        Standing::LastResort
    }
}

/// The snapshot's replicas that may take any request (see [`Standing`]).
fn usable_hosts(cfg: &Config, view: &FleetView, now_ms: u64) -> HostSet {
    let view_age = view.age_ms(now_ms);
    let is = |h: &FleetHost, s: Standing| standing(cfg, h, view_age) == s;
    let want = wanted(|s| view.hosts.iter().any(|h| is(h, s)));
    HostSet::new(
        view.hosts
            .iter()
            .filter(|h| is(h, want))
            .map(|h| h.state.address.clone()),
    )
}

/// Decides for one request and charges its cost to the chosen host, in one
/// compare-and-swap on the shared load table (so concurrent workers see each
/// other's picks). If the table cannot be updated the decision is still made,
/// on the loads last read, without accounting, and counted.
///
/// A parsed request is placed by [`pick`], over the snapshot's replicas
/// when `fleet` holds a decoded snapshot, else over the configured hosts,
/// with the prefix index's answer either way; its prefix is then recorded
/// in the index under its primary. `now_ms` is the gateway's clock, `cache`
/// the worker's copy of recently read index slots.
#[allow(clippy::too_many_arguments)]
pub fn route(
    cfg: &Config,
    store: &dyn SharedData,
    metrics: &dyn Metrics,
    cache: &mut IndexCache,
    facts: Result<&Facts, Unparsed>,
    fleet: Option<&FleetView>,
    now_ms: u64,
    tiebreak: u64,
) -> Decision {
    let hosts = fleet.map_or(&cfg.hosts, |v| &v.set);
    let decision = match facts {
        Ok(facts) => {
            let index = Index::of(&cfg.fleet);
            let n = fleet.map_or(cfg.hosts.len(), |v| v.hosts.len()).max(1);
            let traffic_on = cfg.fleet.prefix_affinity_share > 0.0;
            // Replicas' worth of requests a prefix carries, in
            // `prefixAffinityShare`s of a replica's.
            let replicas_of = |share: f64| share * n as f64 / cfg.fleet.prefix_affinity_share;
            // A bare prompt past parts it shares with other conversations
            // ([`crate::split`]): each part on its path is counted in the
            // traffic, and the key moves past each part, shallow to deep,
            // until one that is rare and most of the prompt (whose requests
            // then keep the key they have, and co-locate as its first
            // request did). The deepest part passed is its shared prefix.
            let (mut own, mut shared_prefix, mut shared_blocks) =
                (facts.affinity, facts.shared_prefix, facts.shared_blocks);
            let mut counted = None;
            let mut in_total = false;
            if let Some(whole) = facts.bare_digest.filter(|_| cfg.learn_splits) {
                let splits = cache.splits.learn(
                    &facts.blocks,
                    cfg.affinity_blocks,
                    now_ms,
                    cfg.fleet.prefix_ttl_ms,
                );
                let nb = facts.blocks.len().max(1) as f64;
                if traffic_on && !splits.is_empty() {
                    cache.traffic.observe_other();
                    in_total = true;
                }
                // Without traffic figures (`prefixAffinityShare` 0) no part
                // is rare: the key moves past every one.
                let mut passing = true;
                for &s in &splits {
                    let Some(&key) = s.checked_sub(1).and_then(|i| facts.blocks.get(i)) else {
                        continue;
                    };
                    let share = s as f64 / nb;
                    let figures = traffic_on.then(|| cache.traffic.count(key, share));
                    passing = passing
                        && figures.is_none_or(|(part, first)| {
                            first < cfg.fleet.prefix_affinity_first || replicas_of(part) >= 1.0
                        });
                    if passing {
                        own = Affinity::Prefix(facts.blocks.get(s).copied().unwrap_or(whole));
                        shared_prefix = Some(SharedPrefix { key, share });
                        shared_blocks = s;
                        counted = figures;
                    }
                }
            }
            // A long shared prefix that carries less than a replica's share
            // of the traffic is the affinity key: its sessions co-locate.
            let (affinity, subset) = match shared_prefix {
                Some(p) if traffic_on => {
                    let (share, first) =
                        counted.unwrap_or_else(|| cache.traffic.observe(p.key, p.share));
                    let replicas = replicas_of(share);
                    let size = replicas.ceil() as usize;
                    if first < cfg.fleet.prefix_affinity_first {
                        (own, None)
                    } else if replicas < 1.0 {
                        (Affinity::Prefix(p.key), None)
                    } else if first >= cfg.fleet.prefix_subset_first && size < n {
                        (own, Some(Subset { key: p.key, size }))
                    } else {
                        (own, None)
                    }
                }
                _ => {
                    if traffic_on && !in_total {
                        cache.traffic.observe_other();
                    }
                    (own, None)
                }
            };
            // Where a shared prefix places the request (its affinity key or
            // its subset), every replica the index knows was sent it counts
            // (up to `index::OWNERS`); otherwise only the last one sent each
            // block, which follows a conversation where it was last served
            // (docs/fleet-state.md, "Several owners per index entry").
            // A request keyed by its conversation (no session, a long shared
            // part) is placed as a session's is, unless its shared part is
            // the key.
            let by_prefix = subset.is_some()
                || match affinity {
                    Affinity::Prefix(k) => shared_prefix.is_none_or(|p| p.key == k),
                    Affinity::Session(_) => false,
                };
            let owners = if by_prefix { index::OWNERS } else { 1 };
            let (hits, seen) = index.lookup_seen(
                store,
                cache,
                &facts.blocks,
                facts.previous_blocks,
                owners,
                now_ms,
            );
            // Key memory (`coldHomeShare`): where this gateway placed the
            // key since its last cold request.
            let key_block = [placed::key_block(affinity.key())];
            let (moved, key_seen) = if cfg.fleet.key_memory {
                let (found, seen) = index.lookup_seen(store, cache, &key_block, None, 1, now_ms);
                (found.first().map(|h| h.0), Some(seen))
            } else {
                (None, None)
            };
            // A bare prompt has no answers to show it continues a
            // conversation. It does when some gateway placed its key before
            // (key memory) and this gateway's index holds an earlier
            // request whole within it, past the part it shares with other
            // conversations: a turn that extends an earlier turn, as an
            // agent's or a chat's next request does when sent as one
            // prompt. A request that only shares a prefix with earlier ones
            // (a question over a document, the Mooncake trace's families)
            // does not (docs/fleet-state.md, "Bare prompts that continue").
            let extends = seen.extends();
            let continues = facts.continues
                || (facts.bare_digest.is_some()
                    && moved.is_some()
                    && extends > shared_blocks
                    && extends >= cfg.affinity_blocks);
            let decide = |table: &LoadTable| {
                let keyed = Keyed {
                    affinity,
                    subset,
                    moved,
                    shared_blocks,
                    continues,
                };
                pick_keyed(cfg, facts, keyed, fleet, table, &hits, now_ms)
            };
            let result = load::update(store, &cfg.load_key, |table| {
                let d = decide(table);
                if let Some(c) = d.charge {
                    table.add(c);
                    if continues {
                        table.arrived(c.host, now_ms, cfg.fleet.arrival_window_ms);
                    }
                }
                d
            });
            let d = match result {
                Ok((d, table)) => {
                    publish_totals(metrics, &table);
                    d
                }
                Err(_) => {
                    metrics.count(Counter::LoadUpdateFailed, 1);
                    Decision {
                        charge: None,
                        ..decide(&load::read(store, &cfg.load_key))
                    }
                }
            };
            if let Some(h) = d.pick.as_ref().and_then(|p| hosts.get(p.primary)) {
                index.record_after(store, cache, &facts.blocks, h.id, now_ms, &seen);
                // The other gateways learn where this request's last block
                // went: a conversation's next turn, wherever it arrives,
                // probes that block (`Facts::previous_blocks`). Only where a
                // collector reads them (`placed::note_last`).
                let last = facts.blocks.last().copied();
                if let Some(block) = last.filter(|_| cfg.fleet.share_last_blocks && fleet.is_some())
                {
                    let blocks = u32::try_from(facts.blocks.len()).unwrap_or(u32::MAX);
                    let key = &cfg.fleet.last_blocks_key;
                    if let Some(lost) = placed::note_last(store, key, block, blocks, h.id, now_ms) {
                        metrics.count(Counter::LastBlocksNoted, 1);
                        metrics.count(Counter::LastBlocksLost, lost);
                    }
                }
                // A request that starts a conversation, of a key nobody
                // placed, starts the memory, cold or not: its prompt may
                // share a system prompt the index knows elsewhere, and the
                // other gateways need the key's replica all the same. A
                // request of a remembered key sent there keeps it current
                // (a spill elsewhere does not move it: the index follows
                // the prompt).
                let remember = (!continues && moved.is_none()) || moved == Some(h.id);
                if let Some(seen) = key_seen.filter(|_| remember) {
                    let wrote = index.record_after(store, cache, &key_block, h.id, now_ms, &seen);
                    // The other gateways learn where the key went, and
                    // again whenever this gateway renews that memory
                    // (every half `prefixTtlMs` while the key is in use),
                    // so that their copies live as long as this one. Also
                    // when it went to its rendezvous top: another gateway,
                    // whose index knows none of the key's blocks, would
                    // take its next request for cold and place it by cost.
                    if wrote > 0 {
                        let key = affinity.key();
                        let lost = placed::note(store, &cfg.fleet.placed_key, key, h.id, now_ms);
                        metrics.count(Counter::PlacementsNoted, 1);
                        metrics.count(Counter::PlacementsLost, lost);
                    }
                }
            }
            d
        }
        Err(cause) => {
            metrics.count(cause.counter(), 1);
            let table = load::read(store, &cfg.load_key);
            // Unparsed requests have no model: any usable replica.
            let usable;
            let hosts = match fleet {
                Some(view) => {
                    usable = usable_hosts(cfg, view, now_ms);
                    &usable
                }
                None => hosts,
            };
            let pick =
                picker::pick_least_loaded(hosts, &table.loads_for(hosts), tiebreak, cfg.fallbacks);
            Decision {
                reason: if pick.is_some() {
                    Reason::Fallback
                } else {
                    Reason::NoHosts
                },
                targets: pick.as_ref().map(|p| targets(hosts, p)).unwrap_or_default(),
                pick,
                degraded: fleet.is_none(),
                key: None,
                charge: None,
                expected_cached: 0,
                pending: 0,
            }
        }
    };
    metrics.count(decision.reason.counter(), 1);
    if decision.degraded {
        metrics.count(Counter::DecisionDegraded, 1);
    }
    decision
}

/// Takes back (part of) a charge.
pub fn release(cfg: &Config, store: &dyn SharedData, metrics: &dyn Metrics, charge: Charge) {
    if charge.prefill == 0 && charge.memory == 0 {
        return;
    }
    match load::update(store, &cfg.load_key, |t| t.release(charge)) {
        Ok(((), table)) => publish_totals(metrics, &table),
        Err(_) => metrics.count(Counter::LoadUpdateFailed, 1),
    }
}

/// The destination header's value: primary, then fallbacks.
pub fn destination(d: &Decision) -> String {
    d.targets.join(",")
}

/// The `x-kvroute-decision` explanation.
pub fn explain(d: &Decision) -> String {
    let host = d.targets.first().map_or("-", String::as_str);
    match d.key {
        Some(k) => format!(
            "reason={}; host={}; key={:016x}; expected_cached={}",
            d.reason.as_str(),
            host,
            k,
            d.expected_cached
        ),
        None => format!(
            "reason={}; host={}; key=-; expected_cached=0",
            d.reason.as_str(),
            host
        ),
    }
}

/// An idle replica serving any model, for the tests' snapshots.
#[cfg(test)]
pub(crate) fn idle_host(addr: &str, ready: bool, scraped_at_ms: u64) -> crate::fleet::HostState {
    crate::fleet::HostState {
        address: addr.into(),
        ready,
        draining: false,
        models: vec![],
        kv_utilization: 0.0,
        waiting: 0,
        running: 0,
        kv_capacity_tokens: None,
        block_size: None,
        scraped_at_ms,
        engine: None,
        peer_pending_tokens: None,
        peer_arrivals_per_s: None,
        prefill_tokens_per_s: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{MemoryMetrics, MemorySharedData};
    use serde_json::json;
    use std::collections::HashSet;

    fn cfg() -> Config {
        Config::from_json(
            br#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"]}"#,
        )
        .unwrap()
    }

    fn chat(messages: serde_json::Value, extra: serde_json::Value) -> Vec<u8> {
        let mut body = json!({"model": "llama", "messages": messages});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        serde_json::to_vec(&body).unwrap()
    }

    /// Routes parsed facts without a snapshot, at time 0, on a worker
    /// with a fresh index cache.
    fn route_fresh(c: &Config, store: &MemorySharedData, m: &MemoryMetrics, f: &Facts) -> Decision {
        route(c, store, m, &mut IndexCache::default(), Ok(f), None, 0, 0)
    }

    /// The gateway's prefix index under `c`, as [`route`] builds it.
    fn index_of(c: &Config) -> Index<'_> {
        Index::of(&c.fleet)
    }

    fn facts(body: &[u8], session: Option<&str>) -> Facts {
        analyze(&cfg(), Endpoint::ChatCompletions, session, body).unwrap()
    }

    /// The previous request's prompt is the canonical stream before the
    /// last run of answers, counted in whole blocks; it is known only when
    /// those blocks reach into the first user message's text.
    #[test]
    fn a_continuing_prompt_says_where_its_previous_request_ended() {
        let c = cfg();
        let bb = c.block_bytes;
        let system = "s".repeat(3 * bb);
        let first = "question ".repeat(bb / 3);
        let turn1 =
            json!([{"role": "system", "content": system}, {"role": "user", "content": first}]);
        let f1 = facts(&chat(turn1.clone(), json!({})), None);
        assert_eq!(f1.previous_blocks, None, "a first turn");
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": "answer ".repeat(bb)}));
        turn2.push(json!({"role": "user", "content": "more"}));
        let f2 = facts(&chat(json!(turn2), json!({})), None);
        // Turn 1's blocks are the first blocks of turn 2's.
        let p = f2.previous_blocks.expect("turn 2 knows turn 1");
        assert_eq!(p, f1.blocks.len());
        assert_eq!(f2.blocks[..p], f1.blocks[..]);
        // A tool call and its answer after the last user message: the
        // previous request ended before the answers' run.
        let mut turn3 = turn2.clone();
        turn3.push(json!({"role": "assistant", "content": "calling"}));
        turn3.push(json!({"role": "tool", "content": "result ".repeat(bb)}));
        let mut asked = turn2.clone();
        asked.truncate(4);
        let f3 = facts(&chat(json!(turn3), json!({})), None);
        let before = facts(&chat(json!(asked), json!({})), None);
        assert_eq!(f3.previous_blocks, Some(before.blocks.len()));
        // A first user message too short to fill a block past the shared
        // system prompt: nothing in whole blocks is the conversation's own.
        let short = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ]);
        assert_eq!(facts(&chat(short, json!({})), None).previous_blocks, None);
    }

    /// A conversation whose previous turn this gateway sent away from the
    /// key's home (so the index holds its whole prompt there) follows it
    /// there; without that evidence it goes home.
    #[test]
    fn a_conversation_follows_its_previous_turn_off_home() {
        let c = cfg();
        let bb = c.block_bytes;
        let turn1 = json!([
            {"role": "system", "content": "s".repeat(2 * bb)},
            {"role": "user", "content": "question ".repeat(bb)},
        ]);
        let f1 = facts(&chat(turn1.clone(), json!({})), Some("conv"));
        let mut t2 = turn1.as_array().unwrap().clone();
        t2.push(json!({"role": "assistant", "content": "answer ".repeat(bb)}));
        t2.push(json!({"role": "user", "content": "more"}));
        let f2 = facts(&chat(json!(t2), json!({})), Some("conv"));
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let home = route_fresh(&c, &store, &m, &f2).targets[0].clone();
        let other = c.hosts.iter().find(|h| h.addr != home).unwrap();
        let index = index_of(&c);
        let store = MemorySharedData::default();
        index.record(&store, &f1.blocks, other.id, 0);
        assert_eq!(route_fresh(&c, &store, &m, &f2).targets[0], other.addr);
        // Only the system prompt there: not the previous turn, home wins.
        let store = MemorySharedData::default();
        index.record(&store, &f1.blocks[..2], other.id, 0);
        assert_eq!(route_fresh(&c, &store, &m, &f2).targets[0], home);
    }

    /// A request that starts a conversation goes to its key's home even
    /// where the index names another replica for every whole block of it,
    /// when those blocks are all before the user's text (a system prompt
    /// many conversations share): its later turns go home. The cost still
    /// moves it off a busy home.
    #[test]
    fn a_first_turn_goes_home_past_a_replica_holding_its_system_prompt() {
        let c = cfg();
        let bb = c.block_bytes;
        let first = json!([
            {"role": "system", "content": "s".repeat(16 * bb)},
            {"role": "user", "content": "hi"},
        ]);
        let f = facts(&chat(first, json!({})), Some("conv"));
        assert!(!f.continues);
        let m = MemoryMetrics::default();
        let home = route_fresh(&c, &MemorySharedData::default(), &m, &f).targets[0].clone();
        let other = c.hosts.iter().find(|h| h.addr != home).unwrap();
        let index = index_of(&c);
        let store = MemorySharedData::default();
        index.record(&store, &f.blocks, other.id, 0);
        let whole = u32::try_from(f.blocks.len()).unwrap();
        assert_eq!(index.lookup(&store, &f.blocks, 0), vec![(other.id, whole)]);
        assert_eq!(route_fresh(&c, &store, &m, &f).targets[0], home);
        // A busy home (the same index, two seconds of prefill pending
        // there): the cost moves it.
        let store = MemorySharedData::default();
        index.record(&store, &f.blocks, other.id, 0);
        let home_id = c.hosts.iter().find(|h| h.addr == home).unwrap().id;
        load::update(&store, &c.load_key, |t| {
            t.add(Charge {
                host: home_id,
                prefill: 60_000,
                memory: 0,
            })
        })
        .unwrap();
        assert_eq!(route_fresh(&c, &store, &m, &f).targets[0], other.addr);
        // Evidence that reaches into the user's own text is not shared: a
        // replica sent this very prompt still beats the home.
        let own = json!([
            {"role": "system", "content": "s".repeat(16 * bb)},
            {"role": "user", "content": "question ".repeat(bb)},
        ]);
        let f = facts(&chat(own, json!({})), Some("conv"));
        assert!(f.shared_blocks < f.blocks.len());
        let home = route_fresh(&c, &MemorySharedData::default(), &m, &f).targets[0].clone();
        let other = c.hosts.iter().find(|h| h.addr != home).unwrap();
        let store = MemorySharedData::default();
        index.record(&store, &f.blocks, other.id, 0);
        assert_eq!(route_fresh(&c, &store, &m, &f).targets[0], other.addr);
    }

    /// A first request of which the index knows only the system prompt it
    /// shares with other conversations has nothing of its own cached
    /// anywhere: with `sharedOnlyHomeShare` at 0.25 its home is credited
    /// as a cold request's and a busy home loses it to the replica sent
    /// the system prompt. By default (`homeCachedShare`) it stays home;
    /// so does the same text sent as a bare prompt, keyed past a split
    /// learned at the same block, with the knob at 0.25.
    #[test]
    fn a_first_request_known_only_by_its_shared_part() {
        let off = cfg();
        let c = Config::from_json(
            br#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"],
                 "fleet":{"sharedOnlyHomeShare":0.25}}"#,
        )
        .unwrap();
        let bb = c.block_bytes;
        let (system, question) = ("s".repeat(16 * bb), "question ".repeat(6 * bb));
        let first = json!([
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]);
        let f = facts(&chat(first, json!({})), None);
        assert!(!f.continues && f.shared_blocks == 16 && f.blocks.len() > 60);
        let bare =
            serde_json::to_vec(&json!({"model": "llama", "prompt": system + &question})).unwrap();
        let bare = analyze(&c, Endpoint::Completions, None, &bare).unwrap();
        assert!(!bare.continues && bare.shared_blocks == 0 && bare.bare_digest.is_some());
        // With a snapshot: unset, the rule applies where the snapshot
        // carries other gateways' load (`peerPendingTokens`, even 0), so
        // that every gateway learns where the request went; without it,
        // only when set.
        let snapshot = |peers: bool| {
            let hosts: Vec<(&str, bool, f64, u32, &[&str])> = c
                .hosts
                .iter()
                .map(|h| (h.addr.as_str(), true, 0.3, 0, &[][..]))
                .collect();
            let mut v = view(&hosts, 0);
            for h in &mut v.hosts {
                h.state.peer_pending_tokens = peers.then_some(0);
            }
            v
        };
        // Both keyed as `route` keys them past a shared part of 16 blocks
        // (the bare prompt's learned).
        let pick = |config: &Config,
                    f: &Facts,
                    v: Option<&FleetView>,
                    table: &LoadTable,
                    hits: &[(u64, u32)]| {
            let keyed = Keyed {
                affinity: f.affinity,
                subset: None,
                moved: None,
                shared_blocks: 16,
                continues: false,
            };
            pick_keyed(config, f, keyed, v, table, hits, 1000)
        };
        let (with_peers, without_peers) = (snapshot(true), snapshot(false));
        for (config, f, v, leaves) in [
            (&c, &f, None, true),
            (&off, &f, None, false),
            (&c, &bare, None, false),
            (&off, &f, Some(&with_peers), true),
            (&off, &f, Some(&without_peers), false),
            (&c, &f, Some(&without_peers), true),
        ] {
            let home = pick(config, f, v, &LoadTable::default(), &[]).targets[0].clone();
            let home_id = c.hosts.iter().find(|h| h.addr == home).unwrap().id;
            let other = c.hosts.iter().find(|h| h.addr != home).unwrap();
            // Another replica was sent the system prompt; the home has a
            // prompt's worth of prefill pending.
            let mut table = LoadTable::default();
            table.add(Charge {
                host: home_id,
                prefill: f.input_tokens,
                memory: 0,
            });
            let d = pick(config, f, v, &table, &[(other.id, 16)]);
            let to = &d.targets[0];
            assert_eq!(to != &home, leaves, "snapshot {}: {d:?}", v.is_some());
            if leaves {
                assert_eq!(to, &other.addr, "{d:?}");
            }
        }
    }

    #[test]
    fn declared_over_cap_only_for_a_length_above_the_cap() {
        let cap = 1 << 20;
        assert!(!declared_over_cap(None, cap));
        assert!(!declared_over_cap(Some("0"), cap));
        assert!(!declared_over_cap(Some("1048576"), cap));
        assert!(declared_over_cap(Some("1048577"), cap));
        assert!(declared_over_cap(Some(" 6291456 "), cap));
        // Not a number, or too big for u64: unknown, counted as it arrives.
        assert!(!declared_over_cap(Some("lots"), cap));
        assert!(!declared_over_cap(Some("-5"), cap));
        assert!(!declared_over_cap(Some("99999999999999999999999"), cap));
        assert!(declared_over_cap(Some("18446744073709551615"), cap));
    }

    /// A session's request over a long system prompt knows that prompt's
    /// key and how much of the request comes before the first question.
    #[test]
    fn a_session_knows_its_long_shared_prefix() {
        let body = |system: String, question: String| {
            chat(
                json!([{"role":"system","content": system},{"role":"user","content": question}]),
                json!({}),
            )
        };
        let tenant = body("policy ".repeat(1200), "hi".into());
        let p = facts(&tenant, Some("s1"))
            .shared_prefix
            .expect("a long prefix");
        assert!(p.share > 0.95, "{p:?}");
        let other = facts(&tenant, Some("s2")).shared_prefix.map(|q| q.key);
        assert_eq!(other, Some(p.key), "one key for every session over it");
        let long_question = body("policy ".repeat(1200), "x".repeat(8400));
        let q = facts(&long_question, Some("s1")).shared_prefix.unwrap();
        assert_eq!(q.key, p.key);
        assert!((0.45..0.55).contains(&q.share), "{q:?}");
        // Without a session the request is keyed by its conversation (its
        // bytes to the end of the first question) and knows the same
        // shared prefix.
        let keyless = facts(&tenant, None);
        assert_eq!(keyless.shared_prefix.map(|q| q.key), Some(p.key));
        assert_ne!(keyless.affinity, Affinity::Prefix(p.key));
        // A short system prompt: the key would hold the first question.
        let short = body("be brief".into(), "x".repeat(8400));
        assert_eq!(facts(&short, Some("s1")).shared_prefix, None);
        assert_eq!(facts(&short, None).shared_prefix, None);
    }

    /// Sessions over a long system prompt that carries a small share of
    /// the traffic take its key (one home); over a prompt that carries most
    /// of it, each session keeps its own.
    #[test]
    fn a_rare_long_prefix_is_the_affinity_key_of_its_sessions() {
        rare_long_prefix_places(true);
    }

    /// The same without a session: each conversation is keyed by its first
    /// question, and the prompt's traffic decides as for sessions.
    #[test]
    fn a_rare_long_prefix_is_the_affinity_key_of_keyless_conversations() {
        rare_long_prefix_places(false);
    }

    fn rare_long_prefix_places(sessions: bool) {
        let c = Config::from_json(
            br#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"],
                "fleet":{"prefixAffinityShare":0.5,"prefixAffinityFirst":0.5}}"#,
        )
        .unwrap();
        let (store, m) = (MemorySharedData::default(), MemoryMetrics::default());
        let mut cache = IndexCache::default();
        let mut send = |system: &str, session: &str| {
            let body = chat(
                json!([{"role":"system","content": system.repeat(1200)},
                       {"role":"user","content": format!("hi from {session}")}]),
                json!({}),
            );
            let header = sessions.then_some(session);
            let f = analyze(&c, Endpoint::ChatCompletions, header, &body).unwrap();
            let d = route(&c, &store, &m, &mut cache, Ok(&f), None, 0, 0);
            release(&c, &store, &m, d.charge.unwrap());
            (d.reason, d.key)
        };
        for i in 0..50 {
            send("hot ", &format!("hot-{i}"));
        }
        let (a, b) = (send("rare ", "rare-a"), send("rare ", "rare-b"));
        assert_eq!(a.0, Reason::Prefix, "{a:?}");
        assert_eq!(a, b, "both sessions on the prompt's key");
        let (c1, c2) = (send("hot ", "hot-x"), send("hot ", "hot-y"));
        let own = if sessions {
            Reason::Session
        } else {
            Reason::Prefix
        };
        assert_eq!(c1.0, own, "{c1:?}");
        assert_ne!(c1.1, c2.1, "each conversation its own key");
        assert_ne!(c1.1, a.1, "not the rare prompt's key");
        // At 0 every session keeps its own key.
        let d = Config::from_json(
            br#"{"hosts":["127.0.0.1:8001","127.0.0.1:8002"],"fleet":{"prefixAffinityShare":0}}"#,
        )
        .unwrap();
        let body = chat(
            json!([{"role":"system","content": "rare ".repeat(1200)},{"role":"user","content":"hi"}]),
            json!({}),
        );
        let f = analyze(
            &d,
            Endpoint::ChatCompletions,
            sessions.then_some("rare-c"),
            &body,
        )
        .unwrap();
        let dec = route_fresh(&d, &store, &m, &f);
        assert_eq!(dec.reason, own);
        assert_ne!(dec.key, a.1);
    }

    /// Bare prompts (`/v1/completions`, one string) over one shared 8 KB
    /// prompt, no session: once the worker has seen two conversations
    /// differ after the prompt, each is keyed by its own text after it
    /// (while the prompt is popular), every turn of a conversation keeps
    /// that key, and the prompt is its shared prefix. Without
    /// `learnSplits`, every one of them takes the prompt's key; with
    /// `prefixAffinityShare` 0 (no traffic figures), each keeps its own.
    #[test]
    fn bare_prompts_are_keyed_past_the_part_they_share() {
        let hosts =
            r#""hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004"]"#;
        let learn = Config::from_json(format!("{{{hosts}}}").as_bytes()).unwrap();
        let fixed = Config::from_json(
            format!(r#"{{{hosts},"hashing":{{"learnSplits":false}}}}"#).as_bytes(),
        )
        .unwrap();
        let shared = "shared prompt ".repeat(600);
        let turn = |conv: usize, t: usize| {
            let mut p = format!(
                "{shared}\n\nUser: conversation {conv} asks {}",
                "why ".repeat(80)
            );
            for k in 0..t {
                p.push_str(&format!(
                    "\n\nAssistant: {}\n\nUser: and {k}?",
                    "because ".repeat(60)
                ));
            }
            serde_json::to_vec(&json!({"model": "llama", "prompt": p, "max_tokens": 16})).unwrap()
        };
        let no_traffic = Config::from_json(
            format!(r#"{{{hosts},"fleet":{{"prefixAffinityShare":0}}}}"#).as_bytes(),
        )
        .unwrap();
        for (c, learns) in [(&learn, true), (&fixed, false), (&no_traffic, true)] {
            let (store, m) = (MemorySharedData::default(), MemoryMetrics::default());
            let mut cache = IndexCache::default();
            let mut send = |conv: usize, t: usize| {
                let f = analyze(c, Endpoint::Completions, None, &turn(conv, t)).unwrap();
                assert!(f.bare_digest.is_some() && f.shared_prefix.is_none());
                let d = route(c, &store, &m, &mut cache, Ok(&f), None, 0, 0);
                release(c, &store, &m, d.charge.unwrap());
                (d.reason, d.key)
            };
            // The prompt becomes most of the worker's traffic.
            for conv in 0..40 {
                send(conv, 0);
            }
            let keys: Vec<_> = (100..104)
                .map(|conv| {
                    let all: Vec<_> = (0..4).map(|t| send(conv, t)).collect();
                    assert!(
                        all.iter().all(|d| *d == all[0]),
                        "conversation {conv}: {all:?}"
                    );
                    all[0]
                })
                .collect();
            assert!(keys.iter().all(|k| k.0 == Reason::Prefix), "{keys:?}");
            let distinct: HashSet<_> = keys.iter().map(|k| k.1).collect();
            assert_eq!(distinct.len(), if learns { 4 } else { 1 }, "{keys:?}");
        }
        // The split the filter learned: the shared prompt's blocks.
        let mut cache = IndexCache::default();
        let f = |conv| analyze(&learn, Endpoint::Completions, None, &turn(conv, 1)).unwrap();
        let (a, b) = (f(1), f(2));
        let first = learn.affinity_blocks;
        assert!(cache.splits.learn(&a.blocks, first, 0, 1000).is_empty());
        let splits = cache.splits.learn(&b.blocks, first, 0, 1000);
        assert_eq!(splits.len(), 1, "one shared part: {splits:?}");
        let s = splits[0];
        assert_eq!(a.blocks[..s], b.blocks[..s]);
        assert_ne!(a.blocks[s], b.blocks[s]);
        // They first differ at about byte 8421 (the 8400-byte prompt, the
        // same "User: conversation ", then the number), in block 32.
        assert_eq!(s, 32);
    }

    /// A bare prompt that holds an earlier one whole (a conversation's next
    /// turn sent as one prompt) continues it: it counts as an arrival on
    /// its replica and stays there past bounded load as a turn with
    /// answers does. Prompts that only share their first blocks with
    /// earlier ones (questions over one document, under one key) do not.
    #[test]
    fn a_bare_prompt_that_extends_an_earlier_one_continues_it() {
        let c = Config::from_json(
            br#"{"hosts":["10.0.0.1:8000","10.0.0.2:8000"],"hashing":{"learnSplits":false}}"#,
        )
        .unwrap();
        let (store, m) = (MemorySharedData::default(), MemoryMetrics::default());
        let mut cache = IndexCache::default();
        let doc = "a long shared document ".repeat(400);
        let ask = |q: &str| format!("{doc}\n\nQuestion: {}", q.repeat(60));
        let mut send = |prompt: &str| {
            let body = serde_json::to_vec(&json!({"model": "llama", "prompt": prompt})).unwrap();
            let f = analyze(&c, Endpoint::Completions, None, &body).unwrap();
            assert!(f.bare_digest.is_some() && !f.continues);
            let d = route(&c, &store, &m, &mut cache, Ok(&f), None, 1000, 0);
            let table = load::read(&store, &c.load_key);
            let arrivals: f64 = c
                .hosts
                .iter()
                .map(|h| table.arrival_rate(h.id, 1000, c.fleet.arrival_window_ms))
                .sum();
            release(&c, &store, &m, d.charge.unwrap());
            (d.key, arrivals)
        };
        let (key, _) = send(&ask("why "));
        for q in ["how ", "when ", "where "] {
            assert_eq!(send(&ask(q)), (key, 0.0), "a question over the document");
        }
        // The first question, answered and followed up: it holds the first
        // request whole. One arrival in the 10 s window.
        let next = format!(
            "{}\n\nAnswer: {}\n\nQuestion: and then?",
            ask("why "),
            "because ".repeat(80)
        );
        let (k, arrivals) = send(&next);
        assert_eq!(k, key);
        assert!((arrivals - 0.1).abs() < 1e-9, "{arrivals}");
    }

    /// Eight configured hosts, with `fleet.prefixSubsetFirst` as given.
    fn eight_hosts(subset_first: f64) -> Config {
        Config::from_json(
            format!(
                r#"{{"hosts":["127.0.0.1:8001","127.0.0.1:8002","127.0.0.1:8003","127.0.0.1:8004",
                    "127.0.0.1:8005","127.0.0.1:8006","127.0.0.1:8007","127.0.0.1:8008"],
                    "fleet":{{"prefixSubsetFirst":{subset_first}}}}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// Request `i` of a stream in which every tenth asks a question about
    /// one shared document (a 6000-byte system prompt) and the others are
    /// short distinct prompts.
    fn one_in_ten_a_document(c: &Config, i: usize, session: &str) -> Facts {
        let messages = if i % 10 == 0 {
            json!([{"role":"system","content": "doc ".repeat(1500)},{"role":"user","content":"q"}])
        } else {
            json!([{"role":"user","content": format!("other {i}")}])
        };
        analyze(
            c,
            Endpoint::ChatCompletions,
            Some(session),
            &chat(messages, json!({})),
        )
        .unwrap()
    }

    #[test]
    fn a_prefix_placed_request_sees_every_replica_it_was_sent_to() {
        // A document request goes to its home, then the same prompt is sent
        // to a replica outside this gateway's list: only a request placed
        // by its shared prefix still counts the home as holding it.
        let placed_on = |subset_first: f64| {
            let c = eight_hosts(subset_first);
            let (store, m) = (MemorySharedData::default(), MemoryMetrics::default());
            let mut cache = IndexCache::default();
            let doc = |i: usize| one_in_ten_a_document(&c, i, &format!("s-{i}"));
            // Traffic in which the document carries a tenth of the requests
            // (to the index, every request goes to 8001..8008 at 0 ms).
            for i in 1..300 {
                let d = route(&c, &store, &m, &mut cache, Ok(&doc(i)), None, 0, 0);
                release(&c, &store, &m, d.charge.unwrap());
            }
            let f = doc(300);
            let first = route(&c, &store, &m, &mut cache, Ok(&f), None, 0, 0);
            release(&c, &store, &m, first.charge.unwrap());
            let ix = index_of(&c);
            ix.record(&store, &f.blocks, picker::host_id(&first.targets[0]), 1);
            ix.record(&store, &f.blocks, picker::host_id("10.9.9.9:1"), 2);
            // The same worker (its traffic sketch), once its copies of the
            // index slots are older than CACHE_MS.
            let later = crate::index::CACHE_MS + 3;
            let d = route(&c, &store, &m, &mut cache, Ok(&f), None, later, 0);
            (d.targets[0].clone(), d.expected_cached)
        };
        // Placed by its prefix (within a subset): the replicas that were
        // sent it before the outsider still count.
        let (to, cached) = placed_on(0.8);
        assert!(cached > 1000, "{to}: {cached}");
        // Placed by its session key: the last sender alone counts, and it
        // is not a replica of this gateway.
        let (_, cached) = placed_on(1.0);
        assert_eq!(cached, 0);
    }

    /// Sessions over a long shared prefix that carries a tenth of the
    /// traffic (too much for one home at `prefixAffinityShare` 0.25 of a
    /// replica, on 8 replicas) are homed within its 4-replica rendezvous
    /// subset; with `prefixSubsetFirst` at 1 they spread over all 8.
    #[test]
    fn a_shared_prefix_homes_its_sessions_within_a_subset() {
        let homes = |subset_first: f64| {
            let c = eight_hosts(subset_first);
            let (store, m) = (MemorySharedData::default(), MemoryMetrics::default());
            let mut cache = IndexCache::default();
            let mut seen = std::collections::BTreeSet::new();
            for i in 0..600 {
                let session = if i % 10 == 0 {
                    format!("doc-{i}")
                } else {
                    format!("o-{i}")
                };
                let f = one_in_ten_a_document(&c, i, &session);
                let d = route(&c, &store, &m, &mut cache, Ok(&f), None, 0, 0);
                release(&c, &store, &m, d.charge.unwrap());
                if i >= 200 && i % 10 == 0 {
                    assert_eq!(d.reason, Reason::Session, "{d:?}");
                    seen.insert(d.targets[0].clone());
                }
            }
            seen.len()
        };
        let within = homes(0.8);
        assert!((2..=4).contains(&within), "{within} replicas");
        assert!(homes(1.0) > 4);
    }

    /// A prefix's share of a worker's requests, and its requests' mean
    /// first-message share, follow the recent traffic.
    #[test]
    fn prefix_traffic_follows_the_recent_requests() {
        let mut t = crate::index::PrefixTraffic::default();
        for i in 0..300u64 {
            t.observe(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), 0.2);
        }
        let (share, first) = t.observe(7, 0.9);
        assert!(share < 0.01, "{share}");
        assert!((first - 0.9).abs() < 1e-6, "{first}");
        // After many of one key (past the halvings) it holds most of them.
        let mut last = (0.0, 0.0);
        for _ in 0..10_000 {
            last = t.observe(7, 0.5);
        }
        assert!(last.0 > 0.9, "{last:?}");
        assert!((last.1 - 0.5).abs() < 0.01, "{last:?}");
        // Requests without a long shared prefix count in the total.
        let mut u = crate::index::PrefixTraffic::default();
        for _ in 0..99 {
            u.observe_other();
        }
        let (share, _) = u.observe(7, 1.0);
        assert!((share - 0.01).abs() < 1e-9, "{share}");
    }

    #[test]
    fn turns_of_a_conversation_share_the_prefix_key() {
        let t1 = chat(
            json!([{"role":"system","content":"You help."},{"role":"user","content":"What is KV cache?"}]),
            json!({}),
        );
        let t2 = chat(
            json!([{"role":"system","content":"You help."},{"role":"user","content":"What is KV cache?"},
                   {"role":"assistant","content":"Memory of attention keys."},{"role":"user","content":"And paging?"}]),
            json!({}),
        );
        let other = chat(
            json!([{"role":"system","content":"You help."},{"role":"user","content":"Tell a joke"}]),
            json!({}),
        );
        let (a, b, c) = (facts(&t1, None), facts(&t2, None), facts(&other, None));
        assert!(matches!(a.affinity, Affinity::Prefix(_)));
        assert_eq!(a.affinity, b.affinity);
        assert_ne!(a.affinity, c.affinity);
    }

    /// Without a session, conversations over one long system prompt are
    /// keyed each by its first question, and all share the prompt's key as
    /// their shared prefix; every turn of one conversation has its key.
    #[test]
    fn long_shared_prefix_is_shared_and_each_conversation_keyed() {
        let doc = "lorem ipsum ".repeat(1000); // 12 KB > 16 blocks of 256 bytes
        let a = chat(
            json!([{"role":"system","content":doc},{"role":"user","content":"q1"}]),
            json!({}),
        );
        let b = chat(
            json!([{"role":"system","content":doc},{"role":"user","content":"q2"}]),
            json!({}),
        );
        let a2 = chat(
            json!([{"role":"system","content":doc},{"role":"user","content":"q1"},
                   {"role":"assistant","content":"an answer"},{"role":"user","content":"and then?"}]),
            json!({}),
        );
        let (fa, fb, fa2) = (facts(&a, None), facts(&b, None), facts(&a2, None));
        assert_ne!(fa.affinity, fb.affinity);
        assert_eq!(fa.affinity, fa2.affinity, "one key per conversation");
        let shared = |f: &Facts| f.shared_prefix.map(|p| p.key);
        assert!(shared(&fa).is_some());
        assert_eq!(shared(&fa), shared(&fb));
        assert_eq!(shared(&fa), shared(&fa2));
        assert_eq!(fa.blocks[..40], fb.blocks[..40]);
        // A different model seeds different hashes.
        let c = serde_json::to_vec(&json!({"model":"other","messages":[{"role":"system","content":doc},{"role":"user","content":"q1"}]})).unwrap();
        let fc = facts(&c, None);
        assert_ne!(fa.affinity, fc.affinity);
        assert_ne!(fa.blocks[0], fc.blocks[0]);
    }

    #[test]
    fn session_sources_in_order() {
        let body = chat(
            json!([{"role":"user","content":"x"}]),
            json!({"prompt_cache_key":"pck","user":"usr"}),
        );
        let by_header = facts(&body, Some("s1"));
        let by_pck = facts(&body, None);
        let only_user = chat(
            json!([{"role":"user","content":"x"}]),
            json!({"user":"usr"}),
        );
        let by_user = facts(&only_user, None);
        let pck_alone = chat(
            json!([{"role":"user","content":"y"}]),
            json!({"prompt_cache_key":"pck"}),
        );
        assert!(matches!(by_header.affinity, Affinity::Session(_)));
        assert_eq!(facts(&only_user, Some("s1")).affinity, by_header.affinity);
        assert_eq!(by_pck.affinity, facts(&pck_alone, None).affinity);
        assert_ne!(by_pck.affinity, by_user.affinity);
        // Blank values do not count.
        assert!(matches!(
            facts(&chat(json!([]), json!({"user":"  "})), Some(" ")).affinity,
            Affinity::Prefix(_)
        ));
    }

    #[test]
    fn cost_estimate() {
        let body = chat(
            json!([{"role":"user","content":"abcdefgh"}]),
            json!({"max_tokens": 10}),
        );
        let f = facts(&body, None);
        // "user" US "abcdefgh" RS = 14 bytes -> 4 tokens.
        assert_eq!(f.input_tokens, 4);
        assert_eq!(f.output_tokens, 10);
        let f = facts(&chat(json!([]), json!({"max_tokens": 1_000_000})), None);
        assert_eq!(f.output_tokens, 1024);
        let f = facts(&chat(json!([]), json!({})), None);
        assert_eq!(f.output_tokens, 1024);
        let f = analyze(
            &cfg(),
            Endpoint::Completions,
            None,
            br#"{"prompt":[1,2,3,4,5]}"#,
        )
        .unwrap();
        assert_eq!(f.input_tokens, 5);
    }

    #[test]
    fn oversized_and_bad_bodies_are_unparsed() {
        let c = Config::from_json(br#"{"hosts":["127.0.0.1:1"],"maxBodyBytes":16}"#).unwrap();
        assert_eq!(
            analyze(&c, Endpoint::ChatCompletions, None, &[b' '; 17]),
            Err(Unparsed::TooLarge)
        );
        assert_eq!(
            analyze(&c, Endpoint::ChatCompletions, None, b""),
            Err(Unparsed::Empty)
        );
        assert_eq!(
            analyze(&c, Endpoint::ChatCompletions, None, b"{]"),
            Err(Unparsed::Invalid)
        );
    }

    #[test]
    fn route_charges_and_release_returns_to_idle() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let f = facts(
            &chat(
                json!([{"role":"user","content":"hello"}]),
                json!({"max_tokens": 50}),
            ),
            Some("s"),
        );
        let d = route_fresh(&c, &store, &m, &f);
        assert_eq!(d.reason, Reason::Session);
        let charge = d.charge.unwrap();
        // The prompt is pending until the first byte (the prefix index has
        // not seen it: all of it); the prompt and half the output are held
        // until the end.
        let held = f.input_tokens + 25;
        assert_eq!(held, f.memory());
        assert_eq!((charge.prefill, charge.memory), (f.input_tokens, held));
        assert_eq!(
            load::read(&store, &c.load_key).totals(),
            (f.input_tokens, held)
        );
        assert_eq!(m.gauges.borrow()["kvroute_inflight_memory_tokens"], held);
        release(
            &c,
            &store,
            &m,
            Charge {
                memory: 0,
                ..charge
            },
        );
        assert_eq!(load::read(&store, &c.load_key).totals(), (0, held));
        release(
            &c,
            &store,
            &m,
            Charge {
                prefill: 0,
                ..charge
            },
        );
        assert!(load::read(&store, &c.load_key).entries().is_empty());
        assert_eq!(m.counter(Counter::DecisionSession), 1);
    }

    #[test]
    fn hot_session_spills_and_explains() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        // 80 KB: about 20k tokens, over the 16384-token load floor.
        let f = facts(
            &chat(
                json!([{"role":"user","content":"x".repeat(80_000)}]),
                json!({}),
            ),
            Some("hot"),
        );
        let first = route_fresh(&c, &store, &m, &f);
        let second = route_fresh(&c, &store, &m, &f);
        assert_eq!(first.reason, Reason::Session);
        assert_eq!(second.reason, Reason::Spill);
        let (p1, p2) = (first.pick.unwrap(), second.pick.clone().unwrap());
        assert_ne!(p1.primary, p2.primary);
        assert_eq!(m.counter(Counter::DecisionSpill), 1);
        let text = explain(&second);
        assert!(
            text.starts_with("reason=spill; host=127.0.0.1:80"),
            "{text}"
        );
        assert!(text.contains(&format!("key={:016x}", f.affinity.key())));
        let dest = destination(&second);
        assert_eq!(dest.split(',').count(), 3);
    }

    #[test]
    fn unparsed_requests_fall_back_to_least_loaded() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let f = facts(&chat(json!([]), json!({})), Some("busy"));
        let busy = route_fresh(&c, &store, &m, &f).pick.unwrap().primary;
        for tiebreak in 0..8 {
            let d = route(
                &c,
                &store,
                &m,
                &mut IndexCache::default(),
                Err(Unparsed::Invalid),
                None,
                0,
                tiebreak,
            );
            assert_eq!(d.reason, Reason::Fallback);
            assert_eq!(d.charge, None);
            assert_ne!(d.pick.unwrap().primary, busy);
        }
        assert_eq!(m.counter(Counter::UnparsedInvalid), 8);
        assert_eq!(
            explain(&route(
                &c,
                &store,
                &m,
                &mut IndexCache::default(),
                Err(Unparsed::Empty),
                None,
                0,
                0
            ))
            .split("; ")
            .nth(2),
            Some("key=-")
        );
    }

    #[test]
    fn prior_replaces_far_larger_asks() {
        let c = cfg();
        let store = MemorySharedData::default();
        let mut f = facts(&chat(json!([]), json!({"max_tokens": 1000})), None);
        apply_prior(&c, &store, &mut f);
        assert_eq!(f.output_tokens, 1000, "no prior yet");
        for _ in 0..25 {
            usage::observe(&store, &c.shared_data_prefix, "llama", 50);
        }
        apply_prior(&c, &store, &mut f);
        assert_eq!(f.output_tokens, 100);
    }

    fn view(hosts: &[(&str, bool, f64, u32, &[&str])], age_ms: u64) -> FleetView {
        let snap = crate::fleet::Snapshot {
            placed: Vec::new(),
            last_blocks: Vec::new(),
            version: 1,
            seq: 1,
            collector: "t".into(),
            taken_at_ms: 1000,
            hosts: hosts
                .iter()
                .map(
                    |&(addr, ready, kv, waiting, models)| crate::fleet::HostState {
                        address: addr.into(),
                        ready,
                        draining: false,
                        models: models.iter().map(|m| m.to_string()).collect(),
                        kv_utilization: kv,
                        waiting,
                        running: 0,
                        kv_capacity_tokens: Some(100_000),
                        block_size: Some(16),
                        scraped_at_ms: 1000 - age_ms,
                        engine: None,
                        peer_pending_tokens: None,
                        peer_arrivals_per_s: None,
                        prefill_tokens_per_s: None,
                    },
                )
                .collect(),
        };
        FleetView::new(snap, 5000)
    }

    fn fleet_pick(v: &FleetView, f: &Facts, now: u64) -> Decision {
        fleet_pick_with(&cfg(), v, f, now)
    }

    /// One decision on a fresh gateway (empty load table and index).
    fn fleet_pick_with(c: &Config, v: &FleetView, f: &Facts, now: u64) -> Decision {
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        route(
            c,
            &store,
            &m,
            &mut IndexCache::default(),
            Ok(f),
            Some(v),
            now,
            0,
        )
    }

    /// The key's home on two idle replicas, and the other one.
    fn home_of_two(f: &Facts) -> (String, &'static str) {
        let calm = view(
            &[
                ("10.0.0.1:80", true, 0.0, 0, &[]),
                ("10.0.0.2:80", true, 0.0, 0, &[]),
            ],
            0,
        );
        let home = fleet_pick(&calm, f, 5000).targets[0].clone();
        let other = if home == "10.0.0.1:80" {
            "10.0.0.2:80"
        } else {
            "10.0.0.1:80"
        };
        (home, other)
    }

    #[test]
    fn headroom_is_judged_on_queue_and_memory_with_fresh_data_only() {
        let c = cfg();
        let f = facts(
            &chat(json!([{"role":"user","content":"hi"}]), json!({})),
            None,
        );
        let empty = LoadTable::default();
        // Default bound: 1 s of prefill at 30k tokens/s, about 29 waiting
        // requests of 1024 tokens.
        let busy = |kv: f64, waiting: u32, age_ms: u64| {
            view(
                &[
                    ("10.0.0.1:80", true, kv, waiting, &[]),
                    ("10.0.0.2:80", true, kv, waiting, &[]),
                ],
                age_ms,
            )
        };
        assert!(headroom(&c, &f, Some(&busy(0.2, 3, 0)), &empty, 5000));
        assert!(!headroom(&c, &f, Some(&busy(0.2, 40, 0)), &empty, 5000));
        assert!(!headroom(&c, &f, Some(&busy(0.99, 0, 0)), &empty, 5000));
        // Stale engine data, no snapshot, or no replica for the model: room.
        assert!(headroom(&c, &f, Some(&busy(0.99, 40, 0)), &empty, 8000));
        assert!(headroom(&c, &f, None, &empty, 5000));
        let other = view(&[("10.0.0.1:80", true, 0.99, 40, &["other"])], 0);
        assert!(headroom(&c, &f, Some(&other), &empty, 5000));
        // One replica with room is enough.
        let mixed = view(
            &[
                ("10.0.0.1:80", true, 0.99, 40, &[]),
                ("10.0.0.2:80", true, 0.1, 0, &[]),
            ],
            0,
        );
        assert!(headroom(&c, &f, Some(&mixed), &empty, 5000));
        // The gateway's own dispatches count before the engine reports them.
        let mut table = LoadTable::default();
        for host in ["10.0.0.1:80", "10.0.0.2:80"] {
            table.add(Charge {
                host: picker::host_id(host),
                prefill: 40_000,
                memory: 1000,
            });
        }
        assert!(!headroom(&c, &f, Some(&busy(0.2, 0, 0)), &table, 5000));
        // The queue is judged at each replica's own rate: 20 waiting
        // requests (about 20k tokens) are within a second at 30k tokens/s,
        // not at a rate of 10k (the snapshot's, or one learned from answers).
        assert!(headroom(&c, &f, Some(&busy(0.2, 20, 0)), &empty, 5000));
        let mut slow = busy(0.2, 20, 0);
        for h in &mut slow.hosts {
            h.state.prefill_tokens_per_s = Some(10_000.0);
        }
        assert!(!headroom(&c, &f, Some(&slow), &empty, 5000));
    }

    #[test]
    fn fleet_filters_unready_and_other_models() {
        let v = view(
            &[
                ("10.0.0.1:80", false, 0.0, 0, &["llama"]),
                ("10.0.0.2:80", true, 0.0, 0, &["other"]),
                ("10.0.0.3:80", true, 0.5, 0, &["llama"]),
            ],
            0,
        );
        for s in 0..20 {
            let f = facts(&chat(json!([]), json!({})), Some(&format!("s{s}")));
            let d = fleet_pick(&v, &f, 5000);
            assert_eq!(d.targets, vec!["10.0.0.3:80".to_string()], "{d:?}");
            assert!(!d.degraded);
        }
        let other = serde_json::to_vec(&json!({"model": "nobody", "messages": []})).unwrap();
        let d = fleet_pick(&v, &facts(&other, None), 5000);
        assert_eq!(d.reason, Reason::NoHosts);
        assert!(d.targets.is_empty());
    }

    #[test]
    fn stale_hosts_are_candidates_scored_on_gateway_load() {
        let v = view(
            &[
                ("10.0.0.1:80", false, 0.99, 50, &[]),
                ("10.0.0.2:80", false, 0.99, 50, &[]),
            ],
            0,
        );
        let f = facts(&chat(json!([]), json!({})), Some("s"));
        // 5000 ms since ingest > staleAfterMs: readiness and pressure are unknown.
        let d = fleet_pick(&v, &f, 5000 + 2001);
        assert!(d.degraded);
        assert_eq!(d.targets.len(), 2);
        assert_eq!(fleet_pick(&v, &f, 5000).reason, Reason::NoHosts);
    }

    /// A view whose hosts each have their own readiness and metrics age.
    fn view_aged(hosts: &[(&str, bool, u64)]) -> FleetView {
        let snap = crate::fleet::Snapshot {
            placed: Vec::new(),
            last_blocks: Vec::new(),
            version: 1,
            seq: 1,
            collector: "t".into(),
            taken_at_ms: 10_000,
            hosts: hosts
                .iter()
                .map(|&(addr, ready, age)| idle_host(addr, ready, 10_000 - age))
                .collect(),
        };
        FleetView::new(snap, 5000)
    }

    #[test]
    fn a_replica_the_collector_cannot_reach_is_a_last_resort() {
        // The collector is current (snapshot ingested at 5000) and calls
        // .1 not ready with metrics 10 s old: it died or hangs.
        let v = view_aged(&[
            ("10.0.0.1:80", false, 10_000),
            ("10.0.0.2:80", true, 100),
            ("10.0.0.3:80", true, 100),
        ]);
        for i in 0..40 {
            let f = facts(&chat(json!([]), json!({})), Some(&format!("s{i}")));
            let d = fleet_pick(&v, &f, 5100);
            assert!(!d.targets.iter().any(|t| t == "10.0.0.1:80"), "{d:?}");
            let d = route(
                &cfg(),
                &MemorySharedData::default(),
                &MemoryMetrics::default(),
                &mut IndexCache::default(),
                Err(Unparsed::Invalid),
                Some(&v),
                5100,
                i,
            );
            assert!(!d.targets.iter().any(|t| t == "10.0.0.1:80"), "{d:?}");
        }
        // When the collector can reach none of them, they all stay in use
        // (degraded) rather than every request failing.
        let v = view_aged(&[
            ("10.0.0.1:80", false, 10_000),
            ("10.0.0.2:80", false, 10_000),
        ]);
        let f = facts(&chat(json!([]), json!({})), Some("s"));
        let d = fleet_pick(&v, &f, 5100);
        assert_eq!(d.targets.len(), 2, "{d:?}");
        assert!(d.degraded);
        // An engine that answered, recently, that it is not ready is out,
        // even alone.
        let v = view_aged(&[("10.0.0.1:80", false, 100)]);
        assert_eq!(fleet_pick(&v, &f, 5100).reason, Reason::NoHosts);
    }

    #[test]
    fn locality_yields_when_the_queue_outweighs_the_cache() {
        // A conversation (about 2400 prompt tokens) whose prefix the index
        // places on its replica.
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let on = |f: &Facts, view: &FleetView| {
            let fleet = Some(view);
            route(
                &c,
                &store,
                &m,
                &mut IndexCache::default(),
                Ok(f),
                fleet,
                5000,
                0,
            )
        };
        let doc = "shared document ".repeat(600);
        let f = facts(
            &chat(json!([{"role":"user","content":doc}]), json!({})),
            None,
        );
        let calm = view(
            &[
                ("10.0.0.1:80", true, 0.0, 0, &[]),
                ("10.0.0.2:80", true, 0.0, 0, &[]),
            ],
            0,
        );
        let home = on(&f, &calm);
        let home_addr = home.targets[0].clone();
        let other_addr = if home_addr == "10.0.0.1:80" {
            "10.0.0.2:80"
        } else {
            "10.0.0.1:80"
        };
        release(&c, &store, &m, home.charge.unwrap());
        // A queue shorter than the prompt (one waiting request, 1024
        // tokens): the cache saves more than the queue costs, it stays.
        let busy = view(
            &[
                (&home_addr, true, 0.3, 1, &[]),
                (other_addr, true, 0.0, 0, &[]),
            ],
            0,
        );
        let d = on(&f, &busy);
        assert_eq!(d.targets[0], home_addr, "{d:?}");
        release(&c, &store, &m, d.charge.unwrap());
        // Twenty waiting (about 20k tokens of prefill ahead): the queue
        // costs more than the prefill elsewhere, it moves.
        let queued = view(
            &[
                (&home_addr, true, 0.3, 20, &[]),
                (other_addr, true, 0.0, 0, &[]),
            ],
            0,
        );
        let d = on(&f, &queued);
        assert_eq!(d.targets[0], other_addr, "{d:?}");
        release(&c, &store, &m, d.charge.unwrap());
        // Nearly full KV and no queue: the memory term moves it.
        let hot = view(
            &[
                (&home_addr, true, 0.97, 0, &[]),
                (other_addr, true, 0.0, 0, &[]),
            ],
            0,
        );
        let d = on(&f, &hot);
        assert_eq!(d.targets[0], other_addr, "{d:?}");
        release(&c, &store, &m, d.charge.unwrap());
        // A new conversation (a few tokens) avoids even a short queue.
        let new = facts(
            &chat(
                json!([{"role":"user","content":"fresh question"}]),
                json!({}),
            ),
            None,
        );
        let d = on(&new, &busy);
        assert_eq!(d.targets[0], other_addr);
    }

    /// A conversation's second turn over a document of about 2400 tokens:
    /// not cold (a cold request's cost carries no `recomputeWeight`), so
    /// its home's assumed share is `homeCachedShare`.
    pub(super) fn continuing_document() -> Facts {
        let doc = "shared document ".repeat(600);
        let f = facts(
            &chat(
                json!([{"role":"user","content":doc},{"role":"assistant","content":"read"},
                       {"role":"user","content":"summarise it"}]),
                json!({}),
            ),
            None,
        );
        assert!(f.continues);
        f
    }

    /// Where memory is not in demand, a prefix computed a second time
    /// costs little: a replica with a short queue keeps the request at
    /// high KV use, and loses it at low KV use.
    #[test]
    fn the_recompute_weight_follows_kv_use() {
        let f = continuing_document();
        let pick = |c: &Config, home_kv: f64, other_kv: f64, home: &str, other: &str| {
            // Four waiting at the home: about 4k tokens of prefill ahead.
            let v = view(
                &[
                    (home, true, home_kv, 4, &[]),
                    (other, true, other_kv, 0, &[]),
                ],
                0,
            );
            fleet_pick_with(c, &v, &f, 5000).targets[0].clone()
        };
        let c = cfg();
        let (home, other) = home_of_two(&f);
        assert_eq!(pick(&c, 0.5, 0.5, &home, other), home, "busy memory: stays");
        assert_eq!(
            pick(&c, 0.02, 0.0, &home, other),
            other,
            "idle memory: moves"
        );
        let whole =
            Config::from_json(br#"{"hosts":["127.0.0.1:8001"],"fleet":{"recomputeFullKv":0}}"#)
                .unwrap();
        assert_eq!(
            pick(&whole, 0.02, 0.0, &home, other),
            home,
            "whole weight: stays"
        );
    }

    /// The prefill other gateways have pending on a replica (the
    /// snapshot's `peerPendingTokens`) is work ahead of the request, as if
    /// this gateway had sent it, and counts for as long as it would take
    /// to drain at `prefillTokensPerS` from when the collector read it.
    #[test]
    fn other_gateways_pending_prefill_counts_until_it_drains() {
        let f = continuing_document();
        let (home, other) = home_of_two(&f);
        let with_peers = |peer: Option<u64>| {
            let mut v = view(&[(&home, true, 0.3, 0, &[]), (other, true, 0.3, 0, &[])], 0);
            if let Some(h) = v.hosts.iter_mut().find(|h| h.state.address == home) {
                h.state.peer_pending_tokens = peer;
            }
            v
        };
        let c = cfg();
        let at = |v: &FleetView, now: u64| fleet_pick_with(&c, v, &f, now).targets[0].clone();
        // 20k tokens (about 0.67 s at 30k tokens/s) ahead at the home, read
        // just now: the prefill elsewhere is cheaper, it moves.
        assert_eq!(at(&with_peers(Some(20_000)), 5000), other);
        // The same figure read a second ago has drained: it stays.
        assert_eq!(at(&with_peers(Some(20_000)), 6000), home);
        // Without the figure (one gateway, or a collector that does not
        // read its peers) it stays as well.
        assert_eq!(at(&with_peers(None), 5000), home);
        assert_eq!(at(&with_peers(Some(0)), 5000), home);
        // `peerPendingWeight` counts a share of it: a tenth of 20k tokens
        // is less than the prefill the home saves.
        let tenth =
            Config::from_json(br#"{"hosts":["127.0.0.1:8001"],"fleet":{"peerPendingWeight":0.1}}"#)
                .unwrap();
        let v = with_peers(Some(20_000));
        assert_eq!(fleet_pick_with(&tenth, &v, &f, 5000).targets[0], home);
        assert_eq!(
            fleet_pick_with(&tenth, &with_peers(Some(200_000)), &f, 5000).targets[0],
            other
        );
    }

    /// The first and second turn of one conversation (session `conv`) that
    /// opens with `opening`.
    fn two_turns(opening: &str) -> (Facts, Facts) {
        let first = chat(json!([{"role":"user","content":opening}]), json!({}));
        let next = chat(
            json!([{"role":"user","content":opening},{"role":"assistant","content":"hi"},
                   {"role":"user","content":"and then?"}]),
            json!({}),
        );
        let (f1, f2) = (facts(&first, Some("conv")), facts(&next, Some("conv")));
        assert!(!f1.continues && f2.continues);
        (f1, f2)
    }

    /// A new conversation leaves a home whose memory is past the bound (by
    /// cost: cold, it costs its own prefill on the other replica), but a
    /// continuing one is not spilled when the replica it would go to costs
    /// more than `spillCostRatio` times as much (its history would be
    /// computed again there); with the ratio at 0 it spills.
    #[test]
    fn a_conversation_is_not_spilled_where_it_costs_much_more() {
        let opening = "a long opening question ".repeat(5000); // about 30k tokens
        let (f1, f2) = two_turns(&opening);
        let (home, other) = home_of_two(&f2);
        // The home holds 60k of 100k tokens: above the bound (1.25 x the
        // average) and the memory floor (90 % less the request's ~31k), yet
        // predicted at about 0.5 s against about 4 s cold on the other.
        let full = view(&[(&home, true, 0.6, 0, &[]), (other, true, 0.0, 0, &[])], 0);
        let d1 = fleet_pick(&full, &f1, 5000);
        assert_eq!(d1.targets[0], other, "{d1:?}");
        let d2 = fleet_pick(&full, &f2, 5000);
        assert_eq!((d2.reason, &d2.targets[0]), (Reason::Session, &home));
        assert_eq!(d2.targets[1], other, "the spill target is the fallback");
        let off =
            Config::from_json(br#"{"hosts":["127.0.0.1:8001"],"fleet":{"spillCostRatio":0}}"#)
                .unwrap();
        let d3 = fleet_pick_with(&off, &full, &f2, 5000);
        assert_eq!((d3.reason, d3.targets[0].as_str()), (Reason::Spill, other));
    }

    /// A replica without headroom by the snapshot takes no new
    /// conversation as their home, but stays the home of the conversations
    /// it holds.
    #[test]
    fn a_pressed_home_keeps_its_conversations() {
        let c = Config::from_json(br#"{"hosts":["127.0.0.1:8001"],"fleet":{"kvPressure":0.5}}"#)
            .unwrap();
        let opening = "a long opening question ".repeat(400); // about 2400 tokens
        let (f1, f2) = two_turns(&opening);
        assert_eq!(f1.affinity, f2.affinity);
        let (home, other) = home_of_two(&f2);
        // The home at 60 % KV: past kvPressure, below the memory knee.
        let pressed = view(&[(&home, true, 0.6, 0, &[]), (other, true, 0.0, 0, &[])], 0);
        let pick = |f: &Facts| fleet_pick_with(&c, &pressed, f, 5000).targets[0].clone();
        assert_eq!(pick(&f1), other, "a new conversation avoids it");
        assert_eq!(pick(&f2), home, "a continuing one stays");
    }

    #[test]
    fn unparsed_requests_avoid_unready_replicas() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let v = view(
            &[
                ("10.0.0.1:80", false, 0.0, 0, &[]),
                ("10.0.0.2:80", true, 0.0, 0, &[]),
                ("10.0.0.3:80", false, 0.0, 0, &[]),
            ],
            0,
        );
        for t in 0..10 {
            let d = route(
                &c,
                &store,
                &m,
                &mut IndexCache::default(),
                Err(Unparsed::NotInference),
                Some(&v),
                5000,
                t,
            );
            assert_eq!(d.targets[0], "10.0.0.2:80");
            assert!(!d.targets.iter().any(|t| t == "10.0.0.1:80"));
        }
    }

    /// Without a snapshot a hot session stays on its home until its memory
    /// passes bounded load, and the rest spill (reason `spill`, never its
    /// own reason elsewhere). The prefix index is what keeps it home: the
    /// gateway's pending prefill there is the uncached part only, not the
    /// whole prompt of every request in flight (without the index, the
    /// fifth request here moved off home by cost, as `session`). Once the
    /// load is released the session follows the index: for a request placed
    /// by its session key it names the last replica the prompt was sent to
    /// (the most recent owner of each block), whose whole-prompt evidence
    /// outweighs the home's assumed share, as with a snapshot.
    #[test]
    fn a_hot_session_stays_home_until_bounded_load() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let mut cache = IndexCache::default();
        // About 5000 prompt tokens and 512 out (tests/e2e: the hot key).
        let f = facts(
            &chat(
                json!([{"role":"user","content":"y".repeat(20_000)}]),
                json!({"max_tokens": 512}),
            ),
            Some("hot"),
        );
        let home = route(&c, &store, &m, &mut cache, Ok(&f), None, 0, 0);
        release(&c, &store, &m, home.charge.unwrap());
        // 5256 tokens held each: three in flight stay under the 16384
        // floor, so the fourth is admitted home; the fifth is not.
        let mut burst = Vec::new();
        for i in 0..12 {
            let d = route(&c, &store, &m, &mut cache, Ok(&f), None, 10, 0);
            let at_home = d.targets[0] == home.targets[0];
            if i < 4 {
                assert_eq!((d.reason, at_home), (Reason::Session, true), "{i}: {d:?}");
                assert_eq!(d.expected_cached, f.input_tokens - 1, "the index hit");
            } else {
                assert_eq!((d.reason, at_home), (Reason::Spill, false), "{i}: {d:?}");
            }
            burst.push(d);
        }
        for d in &burst {
            release(&c, &store, &m, d.charge.unwrap());
        }
        let last = burst.last().unwrap().targets[0].clone();
        for _ in 0..3 {
            let d = route(&c, &store, &m, &mut cache, Ok(&f), None, 20, 0);
            assert_eq!(d.reason, Reason::Session);
            assert_eq!(d.targets[0], last, "{d:?}");
            assert_eq!(d.expected_cached, f.input_tokens - 1);
            release(&c, &store, &m, d.charge.unwrap());
        }
    }

    #[test]
    fn contended_store_still_decides() {
        let c = cfg();
        let store = MemorySharedData::default();
        let m = MemoryMetrics::default();
        store.set(&c.load_key, b"KVL1", None).unwrap();
        store.conflicts.set(usize::MAX);
        let f = facts(&chat(json!([]), json!({})), Some("s"));
        let d = route_fresh(&c, &store, &m, &f);
        assert_eq!(d.reason, Reason::Session);
        assert_eq!(d.charge, None);
        assert_eq!(m.counter(Counter::LoadUpdateFailed), 1);
    }
}

#[cfg(test)]
mod equivalence {
    use super::*;
    use crate::host::{MemoryMetrics, MemorySharedData};
    use proptest::prelude::*;

    fn config(n: usize) -> Config {
        let hosts: Vec<String> = (0..n)
            .map(|i| format!("\"10.0.0.{}:8000\"", i + 1))
            .collect();
        Config::from_json(format!(r#"{{"hosts":[{}]}}"#, hosts.join(",")).as_bytes()).unwrap()
    }

    fn request(k: u64, input_tokens: u64, blocks: usize) -> Facts {
        Facts {
            endpoint: Endpoint::ChatCompletions,
            model: String::new(),
            affinity: Affinity::Prefix(k.wrapping_mul(0x9e3779b97f4a7c15)),
            blocks: (0..blocks as u64).map(|b| b ^ k).collect(),
            input_tokens,
            output_tokens: 100,
            stream: false,
            non_text_parts: 0,
            continues: false,
            shared_prefix: None,
            previous_blocks: None,
            shared_blocks: 0,
            bare_digest: None,
        }
    }

    /// A snapshot of the configured hosts, each scraped at `scraped_at_ms`
    /// and ingested at 0.
    fn snapshot_of(cfg: &Config, scraped_at_ms: u64) -> FleetView {
        let hosts = cfg
            .hosts
            .iter()
            .map(|h| idle_host(&h.addr, true, scraped_at_ms))
            .collect();
        FleetView::new(snapshot(hosts, scraped_at_ms), 0)
    }

    /// A snapshot of `hosts` taken at `taken_at_ms`, nothing else in it.
    fn snapshot(hosts: Vec<crate::fleet::HostState>, taken_at_ms: u64) -> crate::fleet::Snapshot {
        crate::fleet::Snapshot {
            placed: Vec::new(),
            last_blocks: Vec::new(),
            version: 1,
            seq: 1,
            collector: "c".into(),
            taken_at_ms,
            hosts,
        }
    }

    /// With `coldHomeShare` below `homeCachedShare` a cold request leaves
    /// a busy home by cost, and the gateway remembers where: the key's
    /// next request, which shares half its prompt with the first, follows
    /// it there, where without the memory it goes home. With
    /// `coldHomeShare` and `sharedOnlyHomeShare` equal to
    /// `homeCachedShare` (no key memory) the cold request stays home.
    #[test]
    fn a_cold_key_placed_off_home_is_remembered() {
        let hosts: Vec<String> = (0..8)
            .map(|i| format!("\"10.0.0.{}:8000\"", i + 1))
            .collect();
        let off = r#"{"coldHomeShare":0.95,"sharedOnlyHomeShare":0.95}"#;
        for (fleet, remembers) in [(off, false), (r#"{"coldHomeShare":0.5}"#, true)] {
            let json = format!(r#"{{"hosts":[{}],"fleet":{fleet}}}"#, hosts.join(","));
            let c = Config::from_json(json.as_bytes()).unwrap();
            assert_eq!(c.fleet.key_memory, remembers);
            let store = MemorySharedData::default();
            let m = MemoryMetrics::default();
            let first = request(7, 1000, 16);
            let home = picker::preference_order(&c.hosts, first.affinity.key())[0];
            let home_id = c.hosts.get(home).unwrap().id;
            // 700 tokens of prefill pending on the home: more than the
            // cache would save at share 0.5 (0.5 x 1000; a cold request's
            // cost carries no `recomputeWeight`), less than at 0.95.
            let busy = Charge {
                host: home_id,
                prefill: 700,
                memory: 0,
            };
            load::update(&store, &c.load_key, |t| t.add(busy)).unwrap();
            let route_at = |f: &Facts, now: u64| {
                route(
                    &c,
                    &store,
                    &m,
                    &mut IndexCache::default(),
                    Ok(f),
                    None,
                    now,
                    0,
                )
            };
            let d = route_at(&first, 0);
            let placed = d.pick.as_ref().unwrap().primary;
            assert_eq!(placed != home, remembers, "{d:?}");
            release(&c, &store, &m, d.charge.unwrap());
            release(&c, &store, &m, busy);
            // The next request of the key, the home idle again: the first
            // eight blocks are the first request's, the rest new.
            let mut next = request(7, 1000, 16);
            for b in next.blocks.iter_mut().skip(8) {
                *b ^= 0xdead_beef;
            }
            // Without the memory the home's assumed share (0.95) beats the
            // index's half elsewhere.
            let index = Index::of(&c.fleet);
            let hits = index.lookup(&store, &next.blocks, 1000);
            let table = load::read(&store, &c.load_key);
            let forgetful = pick(&c, &next, None, &table, &hits, 1000);
            assert_eq!(forgetful.pick.unwrap().primary, home);
            let d = route_at(&next, 1000);
            let expected = if remembers { placed } else { home };
            assert_eq!(d.pick.as_ref().unwrap().primary, expected, "{d:?}");
        }
    }

    /// Key memory across gateways: gateway A places a key's cold request
    /// off its busy home and reports it; a snapshot that carries A's
    /// placements makes gateway B, which never saw the key, send its next
    /// request there. Without the placements B sends it home.
    #[test]
    fn a_placement_off_home_reaches_the_other_gateways() {
        let hosts: Vec<String> = (0..8)
            .map(|i| format!("\"10.0.0.{}:8000\"", i + 1))
            .collect();
        let json = format!(
            r#"{{"hosts":[{}],"fleet":{{"coldHomeShare":0.5}}}}"#,
            hosts.join(",")
        );
        let c = Config::from_json(json.as_bytes()).unwrap();
        let a = MemorySharedData::default();
        let first = request(9, 1000, 16);
        let home = picker::preference_order(&c.hosts, first.affinity.key())[0];
        let busy = Charge {
            host: c.hosts.get(home).unwrap().id,
            prefill: 3000,
            memory: 0,
        };
        load::update(&a, &c.load_key, |t| t.add(busy)).unwrap();
        let d = on_gateway_a(&c, &a, &first);
        let placed_at = d.pick.unwrap().primary;
        assert_ne!(placed_at, home);
        let report = placed::recent(&a, &c.fleet.placed_key, &[&c.hosts], 1200);
        assert_eq!(report.len(), 1);
        assert_eq!(report[0].age_ms, 200);
        let mut next = request(9, 1000, 16);
        for b in next.blocks.iter_mut().skip(8) {
            *b ^= 0xdead_beef;
        }
        for (told, expected) in [(false, home), (true, placed_at)] {
            let placed = if told { report.clone() } else { Vec::new() };
            let d = on_gateway_told(&c, &placed, &[], None, &next);
            let target = &c.hosts.get(expected).unwrap().addr;
            assert_eq!(&d.targets[0], target, "told {told}: {d:?}");
        }
    }

    /// A conversation's turns over two gateways: gateway A sends the first
    /// turn off its busy home and, read by a collector, reports the turn's
    /// last block; gateway B, told of it in a snapshot, sends the next turn
    /// (which extends the first) where the first went. Not told, B sends
    /// it home. With `shareLastBlocks` off, or no collector reading A, A
    /// reports nothing.
    #[test]
    fn a_conversations_next_turn_follows_its_last_block_to_another_gateway() {
        let json = |share: bool| {
            let hosts: Vec<String> = (0..8)
                .map(|i| format!("\"10.0.0.{}:8000\"", i + 1))
                .collect();
            let fleet = format!(r#"{{"coldHomeShare":0.95,"shareLastBlocks":{share}}}"#);
            format!(r#"{{"hosts":[{}],"fleet":{fleet}}}"#, hosts.join(","))
        };
        let c = Config::from_json(json(true).as_bytes()).unwrap();
        let mut first = request(21, 40 * 16, 40);
        first.continues = true;
        let home = picker::preference_order(&c.hosts, first.affinity.key())[0];
        let busy = Charge {
            host: c.hosts.get(home).unwrap().id,
            prefill: 3000,
            memory: 0,
        };
        // Gateway A, in fleet mode, its home busy; `read` says whether a
        // collector has read its last blocks.
        let on_a = |c: &Config, read: bool| {
            let (a, m) = (MemorySharedData::default(), MemoryMetrics::default());
            load::update(&a, &c.load_key, |t| t.add(busy)).unwrap();
            let key = &c.fleet.last_blocks_key;
            if read {
                assert!(placed::report_last(&a, key, &[&c.hosts], 500).is_empty());
            }
            let view = snapshot_of(c, 0);
            let d = route(
                c,
                &a,
                &m,
                &mut IndexCache::default(),
                Ok(&first),
                Some(&view),
                1000,
                0,
            );
            let report = placed::report_last(&a, key, &[&c.hosts], 1200);
            (
                d.pick.unwrap().primary,
                report,
                m.counter(Counter::LastBlocksNoted),
            )
        };
        let (sent_to, report, noted) = on_a(&c, true);
        assert_ne!(sent_to, home);
        assert_eq!(noted, 1);
        assert_eq!(report.len(), 1, "{report:?}");
        let last = &report[0];
        assert_eq!(last.block_value(), first.blocks.last().copied());
        assert_eq!((last.blocks, last.age_ms), (40, 200));
        assert_eq!(last.address, c.hosts.get(sent_to).unwrap().addr);
        // The next turn: the first's 40 blocks and one more.
        let mut next = request(21, 41 * 16, 41);
        next.continues = true;
        next.previous_blocks = Some(40);
        for (told, expected) in [(false, home), (true, sent_to)] {
            let last = if told { report.clone() } else { Vec::new() };
            let d = on_gateway_told(&c, &[], &last, None, &next);
            let target = &c.hosts.get(expected).unwrap().addr;
            assert_eq!(&d.targets[0], target, "told {told}: {d:?}");
        }
        // No collector reads A: nothing is written or counted.
        let (_, report, noted) = on_a(&c, false);
        assert_eq!((report.len(), noted), (0, 0));
        // Sharing off: likewise, however often A is read.
        let off = Config::from_json(json(false).as_bytes()).unwrap();
        let (_, report, noted) = on_a(&off, true);
        assert_eq!((report.len(), noted), (0, 0));
    }

    /// Every placement written for the other gateways is counted, and so
    /// is each one pushed out of the ring before a load report carried it.
    #[test]
    fn placements_no_report_carried_are_counted_lost() {
        let c = config(8);
        let a = MemorySharedData::default();
        let m = MemoryMetrics::default();
        let send = |k: u64, now: u64| {
            let f = request((k + 1) << 20, 1000, 16);
            route(&c, &a, &m, &mut IndexCache::default(), Ok(&f), None, now, 0)
        };
        send(0, 1000);
        assert_eq!(m.counter(Counter::PlacementsNoted), 1);
        placed::report(&a, &c.fleet.placed_key, &[&c.hosts], 1100);
        let more = placed::RING as u64 + 3;
        for k in 1..=more {
            send(k, 1200 + k);
        }
        assert_eq!(m.counter(Counter::PlacementsNoted), 1 + more);
        // Four pushed out: the first, which the report carried, and three
        // noted since.
        assert_eq!(m.counter(Counter::PlacementsLost), 3);
    }

    /// A new conversation's first request is remembered and reported even
    /// when the index knows part of its prompt (a system prompt another
    /// key sent elsewhere): the other gateways, which know nothing of its
    /// own text, must learn where its key went.
    #[test]
    fn a_first_request_sharing_a_known_prompt_is_reported() {
        let c = config(8);
        let a = MemorySharedData::default();
        let mut first = request(13, 1000, 16);
        let mut other = request(14, 1000, 16);
        // The two share their first eight blocks.
        other.blocks[..8].copy_from_slice(&first.blocks[..8]);
        first.shared_blocks = 8;
        on_gateway_a(&c, &a, &other);
        let index = Index::of(&c.fleet);
        assert!(!index.lookup(&a, &first.blocks, 1000).is_empty());
        let d = on_gateway_a(&c, &a, &first);
        let to = &c.hosts.get(d.pick.unwrap().primary).unwrap().addr;
        let report = placed::recent(&a, &c.fleet.placed_key, &[&c.hosts], 1200);
        let key = format!("{:016x}", first.affinity.key());
        let mine: Vec<_> = report.iter().filter(|p| p.key == key).collect();
        assert_eq!(mine.len(), 1, "{report:?}");
        assert_eq!(&mine[0].address, to);
    }

    /// A conversation's later turns come back to the replica that holds it
    /// and wait behind any prefill sent there: a new conversation's long
    /// first prompt goes where fewer of them arrive
    /// (`arrivalDelayWeight`), past the home's credit for it.
    #[test]
    fn a_long_first_prompt_avoids_the_replica_conversations_return_to() {
        for (weight, goes_home) in [(0.0, true), (4.0, false)] {
            let json = format!(
                r#"{{"hosts":["10.0.0.1:8000","10.0.0.2:8000"],"fleet":{{"arrivalDelayWeight":{weight}}}}}"#
            );
            let c = Config::from_json(json.as_bytes()).unwrap();
            let store = MemorySharedData::default();
            // Cold, 30k tokens: its home is credited with a quarter of it
            // (0.25 s of prefill at 30k tokens/s).
            let first = request(7, 30_000, 16);
            let home = picker::preference_order(&c.hosts, first.affinity.key())[0];
            let home_id = c.hosts.get(home).unwrap().id;
            // Five turns came back to the home in the last second: about
            // 0.5 a second over the 10 s window, so 0.75 s of prefill there
            // delays others by 4 x 0.5 x 0.75^2 / 2, 0.56 s.
            load::update(&store, &c.load_key, |t| {
                for at in [0, 250, 500, 750, 1000] {
                    t.arrived(home_id, at, c.fleet.arrival_window_ms);
                }
            })
            .unwrap();
            let d = on_gateway_a(&c, &store, &first);
            assert_eq!(
                d.pick.unwrap().primary == home,
                goes_home,
                "weight {weight}"
            );
        }
    }

    /// Only a request that continues a conversation counts as an arrival:
    /// it is bound to where its history is, while a new one is free to go
    /// where no prefill is pending.
    #[test]
    fn only_a_continuing_request_counts_as_an_arrival() {
        let c = config(2);
        let store = MemorySharedData::default();
        let rate = |d: &Decision| {
            let id = c.hosts.get(d.pick.as_ref().unwrap().primary).unwrap().id;
            load::read(&store, &c.load_key).arrival_rate(id, 1000, c.fleet.arrival_window_ms)
        };
        let d = on_gateway_a(&c, &store, &request(7, 1000, 16));
        assert_eq!(rate(&d), 0.0);
        let d = on_gateway_a(&c, &store, &super::tests::continuing_document());
        // One request over the 10 s window.
        assert!((rate(&d) - 0.1).abs() < 1e-9, "{}", rate(&d));
    }

    /// The other gateways' arrivals (`peerArrivalsPerS`) count on a
    /// replica with current data only: the figure is not aged, so on a
    /// replica whose data is stale (a collector that stopped) only this
    /// gateway's own count is used.
    #[test]
    fn peer_arrivals_count_only_on_current_data() {
        let c = config(2);
        let mut hosts: Vec<_> = c
            .hosts
            .iter()
            .map(|h| crate::fleet::HostState {
                peer_arrivals_per_s: Some(2.0),
                ..idle_host(&h.addr, true, 10_000)
            })
            .collect();
        // The second replica was last scraped 10 s before the snapshot,
        // past `staleAfterMs`.
        hosts[1].scraped_at_ms = 0;
        let view = FleetView::new(snapshot(hosts, 10_000), 10_000);
        let mut table = LoadTable::default();
        for h in c.hosts.iter() {
            // One arrival of this gateway's on each: 0.1 /s over 10 s.
            table.arrived(h.id, 10_000, c.fleet.arrival_window_ms);
        }
        let (replicas, degraded) = observed(&c, &request(1, 100, 4), &view, &table, 10_000);
        assert!(degraded);
        let rate = |i: usize| replicas.iter().find(|r| r.index == i).unwrap().arrivals;
        assert!(
            (rate(0) - 2.1).abs() < 1e-9,
            "current: own and peers', {}",
            rate(0)
        );
        assert!((rate(1) - 0.1).abs() < 1e-9, "stale: own only, {}", rate(1));
    }

    /// A replica's `prefillTokensPerS` replaces the configured rate in its
    /// cost, on current data and on stale (a rate, like a capacity, does
    /// not change with the data's age); absent, the configured rate.
    #[test]
    fn a_replicas_prefill_rate_from_the_snapshot_prices_its_prefill() {
        let c = config(2);
        // A cold request of 16k tokens; its home is replica `home`.
        let f = request(5, 16_384, 64);
        let home = picker::preference_order(&c.hosts, f.affinity.key())[0];
        let view = |rates: [Option<f64>; 2], scraped_at_ms: u64| {
            let hosts = c
                .hosts
                .iter()
                .zip(rates)
                .map(|(h, r)| crate::fleet::HostState {
                    prefill_tokens_per_s: r,
                    ..idle_host(&h.addr, true, scraped_at_ms)
                })
                .collect();
            FleetView::new(snapshot(hosts, 10_000), 10_000)
        };
        let table = LoadTable::default();
        let mut rates = [None, None];
        rates[home] = Some(5_000.0);
        for scraped in [10_000, 0] {
            let (replicas, _) = observed(&c, &f, &view(rates, scraped), &table, 10_000);
            let rate = |i: usize| replicas.iter().find(|r| r.index == i).unwrap().rate;
            assert_eq!(rate(home), 5_000.0, "scraped at {scraped}");
            assert_eq!(rate(1 - home), c.fleet.prefill_tokens_per_s);
        }
        // Both idle: at the configured rate the home's credit keeps the
        // request home; at a sixth of it the other replica is cheaper.
        let go = |rates: [Option<f64>; 2]| {
            let (a, m) = (MemorySharedData::default(), MemoryMetrics::default());
            let v = view(rates, 10_000);
            let d = route(
                &c,
                &a,
                &m,
                &mut IndexCache::default(),
                Ok(&f),
                Some(&v),
                10_000,
                0,
            );
            d.pick.unwrap().primary
        };
        assert_eq!(go([None, None]), home);
        assert_eq!(go(rates), 1 - home);
        // The other replica three times slower than the home: home again.
        let mut slow_other = [None, None];
        slow_other[home] = Some(30_000.0);
        slow_other[1 - home] = Some(10_000.0);
        assert_eq!(go(slow_other), home);
    }

    /// A decision on gateway `a` (its shared data `a`), without a
    /// snapshot, at time 1000.
    fn on_gateway_a(c: &Config, a: &MemorySharedData, f: &Facts) -> Decision {
        let m = MemoryMetrics::default();
        route(c, a, &m, &mut IndexCache::default(), Ok(f), None, 1000, 0)
    }

    /// A decision on a second gateway `b` (its own shared data, `busy` in
    /// its load table) after a snapshot of idle hosts carrying `placed`.
    fn on_gateway_told(
        c: &Config,
        placed: &[placed::Placement],
        last_blocks: &[placed::LastBlock],
        busy: Option<Charge>,
        f: &Facts,
    ) -> Decision {
        let (b, m) = (MemorySharedData::default(), MemoryMetrics::default());
        if let Some(busy) = busy {
            load::update(&b, &c.load_key, |t| t.add(busy)).unwrap();
        }
        let snap = crate::fleet::Snapshot {
            version: 1,
            seq: 1,
            collector: "c".into(),
            taken_at_ms: 0,
            hosts: c
                .hosts
                .iter()
                .map(|h| idle_host(&h.addr, true, 0))
                .collect(),
            placed: placed.to_vec(),
            last_blocks: last_blocks.to_vec(),
        };
        let stored = crate::ingest::store(c, &b, &snap.to_json(), 1500);
        assert!(
            matches!(stored, crate::ingest::Outcome::Accepted { .. }),
            "{stored:?}"
        );
        let mut fleet = crate::ingest::FleetCache::default();
        let (view, _) = fleet.refresh(c, &b);
        let view = view.unwrap();
        assert!(view.hosts.len() == c.hosts.len());
        route(
            c,
            &b,
            &m,
            &mut IndexCache::default(),
            Ok(f),
            Some(&view),
            2000,
            0,
        )
    }

    /// A key's cold request placed on its own rendezvous home is reported
    /// too: gateway B, whose index knows none of the key's blocks, would
    /// take the key's next request for cold and move it off a home it has
    /// work pending on (more than `coldHomeShare` of the prompt); told,
    /// it keeps it home (the key's earlier request is there).
    #[test]
    fn a_key_placed_on_its_home_is_reported_too() {
        let c = config(8);
        let a = MemorySharedData::default();
        let first = request(11, 1000, 16);
        let home = picker::preference_order(&c.hosts, first.affinity.key())[0];
        let d = on_gateway_a(&c, &a, &first);
        assert_eq!(
            d.pick.unwrap().primary,
            home,
            "an idle gateway sends it home"
        );
        let report = placed::recent(&a, &c.fleet.placed_key, &[&c.hosts], 1200);
        let home_addr = &c.hosts.get(home).unwrap().addr;
        assert_eq!(report.len(), 1);
        assert_eq!(&report[0].address, home_addr);
        // The next request of the key shares no block with the first.
        let mut next = request(11, 1000, 16);
        for blk in next.blocks.iter_mut() {
            *blk ^= 0xdead_beef;
        }
        // 600 tokens pending on the home at B: more than a quarter of the
        // prompt, less than `homeCachedShare` of it.
        let busy = Charge {
            host: c.hosts.get(home).unwrap().id,
            prefill: 600,
            memory: 0,
        };
        let blind = on_gateway_told(&c, &[], &[], Some(busy), &next);
        assert_ne!(&blind.targets[0], home_addr, "{blind:?}");
        let told = on_gateway_told(&c, &report, &[], Some(busy), &next);
        assert_eq!(&told.targets[0], home_addr, "{told:?}");
    }

    /// Every gateway, with an idle snapshot or with none, sends a key to
    /// its home, the rendezvous top of its key over the hosts, whatever
    /// each gateway's own load (while it is below what the home is
    /// credited with: for these cold requests, `coldHomeShare` of the
    /// prompt, 500 tokens and more).
    #[test]
    fn every_gateway_sends_a_key_home() {
        let cfg = config(8);
        let view = snapshot_of(&cfg, 0);
        // Gateway a is idle; gateway b has 400 tokens pending on every
        // other host.
        let idle = LoadTable::default();
        let mut busy = LoadTable::default();
        for h in cfg.hosts.iter().step_by(2) {
            busy.add(Charge {
                host: h.id,
                prefill: 400,
                memory: 3000,
            });
        }
        for k in 0..2000u64 {
            let f = request(k, 2000 + k % 7 * 3000, 0);
            let top = picker::preference_order(&cfg.hosts, f.affinity.key())[0];
            let home = &cfg.hosts.get(top).unwrap().addr;
            for table in [&idle, &busy] {
                let with = pick(&cfg, &f, Some(&view), table, &[], 0);
                let without = pick(&cfg, &f, None, table, &[], 0);
                assert_eq!(&with.targets[0], home, "request {k}");
                assert_eq!(&without.targets[0], home, "request {k}");
                assert!(!with.degraded && without.degraded);
            }
        }
    }

    proptest! {
        /// Without a snapshot a decision is the one a snapshot of the same
        /// hosts with nothing but stale data would give: the foundation
        /// mode is the fleet mode with no engine data.
        #[test]
        fn no_snapshot_is_a_snapshot_with_no_engine_data(
            n in 1usize..12,
            key in any::<u64>(),
            input in 1u64..40_000,
            blocks in 0usize..64,
            continues in any::<bool>(),
            loads in prop::collection::vec((0u64..30_000, 0u64..60_000), 12),
            hits in prop::collection::vec((0usize..12, 0u32..64), 0..4),
        ) {
            let cfg = config(n);
            let mut table = LoadTable::default();
            for (h, &(prefill, memory)) in cfg.hosts.iter().zip(&loads) {
                table.add(Charge { host: h.id, prefill, memory });
            }
            let hits: Vec<(u64, u32)> = hits
                .iter()
                .filter_map(|&(i, d)| cfg.hosts.get(i).map(|h| (h.id, d)))
                .collect();
            let f = Facts { continues, ..request(key, input, blocks) };
            // Scraped at 0, looked at 10 s after ingest: stale.
            let stale = snapshot_of(&cfg, 0);
            let with = pick(&cfg, &f, Some(&stale), &table, &hits, 10_000);
            let without = pick(&cfg, &f, None, &table, &hits, 0);
            prop_assert_eq!(with, without);
        }
    }
}

//! Plugin configuration: serde -> validate -> compile.
//!
//! The raw form ([`RawConfig`]) is exactly the plugin JSON (camelCase, named
//! defaults, unknown fields rejected). [`Config::from_json`] validates every
//! field, naming the field, the value and the reason on error, and compiles
//! the result into the immutable [`Config`] that the request path uses. Raw
//! config never reaches the request path.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;

use serde::Deserialize;

use crate::picker::HostSet;

/// The plugin JSON, as written by the user.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawConfig {
    /// `router` (the default) routes requests; `ingest` accepts fleet
    /// snapshots from the collector on a loopback listener.
    #[serde(default)]
    pub role: Role,
    /// Replicas as `ip:port`, in any order: the routing universe until a
    /// fleet snapshot arrives. Required for the router role.
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default = "defaults::destination_header")]
    pub destination_header: String,
    #[serde(default = "defaults::session_headers")]
    pub session_headers: Vec<String>,
    #[serde(default = "defaults::fallbacks")]
    pub fallbacks: u32,
    #[serde(default = "defaults::epsilon")]
    pub epsilon: f64,
    #[serde(default = "defaults::load_floor_tokens")]
    pub load_floor_tokens: u64,
    #[serde(default = "defaults::max_body_bytes")]
    pub max_body_bytes: u64,
    #[serde(default)]
    pub hashing: RawHashing,
    #[serde(default)]
    pub cost: RawCost,
    #[serde(default)]
    pub explain_header: bool,
    #[serde(default = "defaults::shared_data_prefix")]
    pub shared_data_prefix: String,
    #[serde(default)]
    pub fleet: RawFleet,
    /// Required for the ingest role.
    #[serde(default)]
    pub ingest: Option<RawIngest>,
    /// Named objectives a request may ask for in the objective header
    /// (GIE's `x-gateway-inference-objective`), each with a priority.
    #[serde(default)]
    pub objectives: BTreeMap<String, RawObjective>,
    /// Holding and shedding requests when the fleet is saturated
    /// ([`crate::admit`]). Off unless enabled.
    #[serde(default)]
    pub admission: RawAdmission,
}

/// One objective: its priority (below 0: sheddable).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawObjective {
    pub priority: i32,
}

/// Admission control ([`crate::admit`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawAdmission {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "defaults::objective_header")]
    pub objective_header: String,
    #[serde(default = "defaults::max_queue")]
    pub max_queue: u32,
    #[serde(default = "defaults::max_queued_per_key")]
    pub max_queued_per_key: u32,
    #[serde(default = "defaults::max_wait_ms")]
    pub max_wait_ms: u64,
    #[serde(default = "defaults::retry_after_s")]
    pub retry_after_s: u32,
    #[serde(default = "defaults::max_pending_s")]
    pub max_pending_s: f64,
    #[serde(default = "defaults::max_memory")]
    pub max_memory: f64,
}

impl Default for RawAdmission {
    fn default() -> Self {
        RawAdmission {
            enabled: false,
            objective_header: defaults::objective_header(),
            max_queue: defaults::max_queue(),
            max_queued_per_key: defaults::max_queued_per_key(),
            max_wait_ms: defaults::max_wait_ms(),
            retry_after_s: defaults::retry_after_s(),
            max_pending_s: defaults::max_pending_s(),
            max_memory: defaults::max_memory(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Router,
    Ingest,
}

/// How fleet state (from the collector) enters the pick.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawFleet {
    #[serde(default = "defaults::stale_after_ms")]
    pub stale_after_ms: u64,
    #[serde(default = "defaults::kv_pressure")]
    pub kv_pressure: f64,
    #[serde(default = "defaults::queue_pressure")]
    pub queue_pressure: u32,
    #[serde(default = "defaults::waiting_request_tokens")]
    pub waiting_request_tokens: u64,
    #[serde(default = "defaults::prefill_tokens_per_s")]
    pub prefill_tokens_per_s: u64,
    #[serde(default = "defaults::home_cached_share")]
    pub home_cached_share: f64,
    #[serde(default = "defaults::cold_home_share")]
    pub cold_home_share: f64,
    /// Unset: [`defaults::SHARED_ONLY_HOME_SHARE_WITH_PEERS`] where the
    /// snapshot carries other gateways' load, `homeCachedShare` elsewhere.
    #[serde(default)]
    pub shared_only_home_share: Option<f64>,
    #[serde(default = "defaults::recompute_weight")]
    pub recompute_weight: f64,
    #[serde(default = "defaults::peer_pending_weight")]
    pub peer_pending_weight: f64,
    #[serde(default = "defaults::arrival_delay_weight")]
    pub arrival_delay_weight: f64,
    #[serde(default = "defaults::arrival_window_ms")]
    pub arrival_window_ms: u64,
    #[serde(default = "defaults::memory_knee")]
    pub memory_knee: f64,
    #[serde(default = "defaults::memory_seconds")]
    pub memory_seconds: f64,
    #[serde(default = "defaults::memory_floor")]
    pub memory_floor: f64,
    #[serde(default = "defaults::spill_cost_ratio")]
    pub spill_cost_ratio: f64,
    #[serde(default = "defaults::spill_margin_ms")]
    pub spill_margin_ms: f64,
    #[serde(default = "defaults::cost_quantum_ms")]
    pub cost_quantum_ms: f64,
    #[serde(default = "defaults::recompute_full_kv")]
    pub recompute_full_kv: f64,
    #[serde(default = "defaults::prefix_affinity_share")]
    pub prefix_affinity_share: f64,
    #[serde(default = "defaults::prefix_affinity_first")]
    pub prefix_affinity_first: f64,
    #[serde(default = "defaults::prefix_subset_first")]
    pub prefix_subset_first: f64,
    #[serde(default = "defaults::prefix_index_slots")]
    pub prefix_index_slots: u32,
    #[serde(default = "defaults::prefix_ttl_ms")]
    pub prefix_ttl_ms: u64,
    #[serde(default = "defaults::share_last_blocks")]
    pub share_last_blocks: bool,
    #[serde(default = "defaults::learn_prefill_rates")]
    pub learn_prefill_rates: bool,
}

impl Default for RawFleet {
    fn default() -> Self {
        RawFleet {
            stale_after_ms: defaults::stale_after_ms(),
            kv_pressure: defaults::kv_pressure(),
            queue_pressure: defaults::queue_pressure(),
            waiting_request_tokens: defaults::waiting_request_tokens(),
            prefill_tokens_per_s: defaults::prefill_tokens_per_s(),
            home_cached_share: defaults::home_cached_share(),
            cold_home_share: defaults::cold_home_share(),
            shared_only_home_share: None,
            recompute_weight: defaults::recompute_weight(),
            peer_pending_weight: defaults::peer_pending_weight(),
            arrival_delay_weight: defaults::arrival_delay_weight(),
            arrival_window_ms: defaults::arrival_window_ms(),
            memory_knee: defaults::memory_knee(),
            memory_seconds: defaults::memory_seconds(),
            memory_floor: defaults::memory_floor(),
            spill_cost_ratio: defaults::spill_cost_ratio(),
            spill_margin_ms: defaults::spill_margin_ms(),
            cost_quantum_ms: defaults::cost_quantum_ms(),
            recompute_full_kv: defaults::recompute_full_kv(),
            prefix_affinity_share: defaults::prefix_affinity_share(),
            prefix_affinity_first: defaults::prefix_affinity_first(),
            prefix_subset_first: defaults::prefix_subset_first(),
            prefix_index_slots: defaults::prefix_index_slots(),
            prefix_ttl_ms: defaults::prefix_ttl_ms(),
            share_last_blocks: defaults::share_last_blocks(),
            learn_prefill_rates: defaults::learn_prefill_rates(),
        }
    }
}

/// The ingest role's settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawIngest {
    /// Bearer token the collector must present.
    pub token: String,
    #[serde(default = "defaults::ingest_max_bytes")]
    pub max_bytes: u64,
    /// A collector owns the snapshot while it pushes; another collector's
    /// pushes are refused until the owner has been silent this long.
    #[serde(default = "defaults::owner_lease_ms")]
    pub owner_lease_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawHashing {
    #[serde(default = "defaults::block_bytes")]
    pub block_bytes: u32,
    #[serde(default = "defaults::max_blocks")]
    pub max_blocks: u32,
    #[serde(default = "defaults::affinity_blocks")]
    pub affinity_blocks: u32,
    /// Learn where bare prompts' shared parts end and key them past it
    /// ([`crate::split`]).
    #[serde(default = "defaults::yes")]
    pub learn_splits: bool,
}

impl Default for RawHashing {
    fn default() -> Self {
        RawHashing {
            block_bytes: defaults::block_bytes(),
            max_blocks: defaults::max_blocks(),
            affinity_blocks: defaults::affinity_blocks(),
            learn_splits: true,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawCost {
    #[serde(default = "defaults::bytes_per_token")]
    pub bytes_per_token: u32,
    #[serde(default = "defaults::output_tokens_cap")]
    pub output_tokens_cap: u64,
}

impl Default for RawCost {
    fn default() -> Self {
        RawCost {
            bytes_per_token: defaults::bytes_per_token(),
            output_tokens_cap: defaults::output_tokens_cap(),
        }
    }
}

/// Documented defaults (also in `examples/kvroute.schema.json`).
pub mod defaults {
    /// The Gateway API Inference Extension's objective header.
    pub fn objective_header() -> String {
        "x-gateway-inference-objective".into()
    }
    /// Requests one worker holds at most while the fleet is saturated.
    pub fn max_queue() -> u32 {
        256
    }
    /// Requests one affinity key (a session, else a prefix) may have held
    /// at once: one client cannot fill the queue.
    pub fn max_queued_per_key() -> u32 {
        16
    }
    /// A held request gets its 503 after this long.
    pub fn max_wait_ms() -> u64 {
        10_000
    }
    /// `Retry-After` of a shed request, seconds.
    pub fn retry_after_s() -> u32 {
        1
    }
    /// A replica has room for one more request while the prefill ahead of
    /// it takes at most this long at `prefillTokensPerS` (see
    /// docs/fleet-state.md, "Admission", for the measurement).
    pub fn max_pending_s() -> f64 {
        1.0
    }
    /// ... and its predicted KV use with the request stays at most this
    /// share of its capacity.
    pub fn max_memory() -> f64 {
        0.95
    }
    /// The Gateway API Inference Extension's header, so kvroute drops into
    /// gateways already wired for GIE.
    pub fn destination_header() -> String {
        "x-gateway-destination-endpoint".into()
    }
    pub fn session_headers() -> Vec<String> {
        vec!["x-session-id".into()]
    }
    /// Two fallbacks: three distinct hosts for Envoy's retries to walk.
    pub fn fallbacks() -> u32 {
        2
    }
    /// 25 % slack over the average load before a host is skipped.
    pub fn epsilon() -> f64 {
        0.25
    }
    /// Below this many in-flight tokens a replica always admits: about two
    /// 8192-token prefill steps, half a second of prefill on the modelled
    /// H100 (docs/simulator.md). At light load the MTZ bound is a few
    /// thousand tokens and would move conversations off replicas that
    /// clear their queue in a moment; in `make bench`'s chat-session
    /// workload that spilled 205 of 1596 decisions and cost 6 points of hit
    /// rate (docs/benchmarks.md).
    pub fn load_floor_tokens() -> u64 {
        16_384
    }
    /// Envoy's default per-connection buffer limit: larger bodies would end
    /// in a 413 from Envoy itself if the filter kept buffering.
    pub fn max_body_bytes() -> u64 {
        1 << 20
    }
    /// 64 pseudo-tokens of 4 bytes, the block size GIE's prefix scorer uses.
    pub fn block_bytes() -> u32 {
        256
    }
    /// 1024 blocks of 256 bytes: the first 256 KiB of a prompt are hashed.
    pub fn max_blocks() -> u32 {
        1024
    }
    /// Bare prompts are keyed past the shared part they are seen to
    /// share (docs/fleet-state.md, "Bare prompts").
    pub fn yes() -> bool {
        true
    }
    /// 16 blocks (4 KiB, about 1k tokens): a system part this long is a
    /// shared prefix, which co-locates requests whose first questions
    /// differ while it is rare (`prefixAffinityShare`).
    pub fn affinity_blocks() -> u32 {
        16
    }
    pub fn bytes_per_token() -> u32 {
        4
    }
    pub fn output_tokens_cap() -> u64 {
        1024
    }
    pub fn shared_data_prefix() -> String {
        "kvroute".into()
    }
    /// Eight scrape intervals of 250 ms: a host whose data is older was
    /// missed by several scrapes in a row.
    pub fn stale_after_ms() -> u64 {
        2000
    }
    /// A replica at or past this KV utilisation (by the snapshot) has no
    /// headroom: it cannot be a key's home replica. vLLM starts preempting
    /// near full KV.
    pub fn kv_pressure() -> f64 {
        0.9
    }
    /// Waiting requests at which a replica has no headroom (by the
    /// snapshot): it cannot be a key's home replica.
    pub fn queue_pressure() -> u32 {
        32
    }
    /// Tokens assumed per waiting request (the engine reports counts).
    pub fn waiting_request_tokens() -> u64 {
        1024
    }
    /// A replica's prefill rate when the snapshot does not give one: about
    /// 30k tokens/s, Llama-3.1-8B on one H100 (8192 tokens per step at
    /// 2 x 8.03e9 FLOP per token and half the BF16 peak, plus a 6 ms
    /// weight read; kvroute-sim's roofline, crates/kvroute-sim/src/engine/config.rs).
    pub fn prefill_tokens_per_s() -> u64 {
        30_000
    }
    /// The share of a request's prompt assumed cached on its home replica
    /// when this gateway's prefix index knows less: every gateway sends the
    /// key home, so its earlier turns are most likely there. Below 1, so
    /// that the index's evidence of a nearly whole prefix elsewhere wins
    /// (a conversation whose home moved, a tenant's shared system prompt).
    pub fn home_cached_share() -> f64 {
        0.95
    }
    /// The home's assumed share for a cold request (the index knows none of
    /// its blocks, it continues no conversation, no gateway has said where
    /// its key went); below `homeCachedShare` it turns key memory on
    /// (`crate::placed`). A cold request's cost carries no
    /// `recomputeWeight` (it computes nothing a second time), so the home
    /// keeps it while its queue is shorter than this share of the prompt.
    /// 0.25 measured in the fleet simulation (16 replicas, five seeds, one
    /// and four gateways with one collector; 0.75, 0.5, 0.25 and 0): the
    /// Mooncake trace's TTFT p95 1548 / 1476 / 1434 / 1412 ms at one
    /// gateway and 1618 / 1654 / 1612 / 1669 at four, its hit rate 42.0 /
    /// 41.7 / 41.6 / 41.7 % and 39.6 / 37.4 / 38.8 / 36.6 %; agent's
    /// four-gateway median 1206 / 1368 / 1206 / 1206; tenants at four 95 /
    /// 96 / 97 / 99; chat, groups, mix, bursts and ramp within 2 %
    /// (docs/fleet-state.md, "Key memory").
    pub fn cold_home_share() -> f64 {
        0.25
    }
    /// `sharedOnlyHomeShare` unset, where the gateway's snapshot carries
    /// other gateways' load (and so their placements): one collector for
    /// every gateway, or sidecars that read their peers. As
    /// `coldHomeShare`. docs/fleet-state.md, "A first request known only
    /// by its shared part".
    pub const SHARED_ONLY_HOME_SHARE_WITH_PEERS: f64 = 0.25;
    /// The weight of a request's uncached tokens beyond its own wait: the
    /// prefill it adds delays the requests behind it, and a prefix
    /// computed again on a second replica holds KV memory twice.
    pub fn recompute_weight() -> f64 {
        3.0
    }
    /// The weight of the delay a request's prefill puts on the requests
    /// that arrive behind it: each replica's cost adds this x its recent
    /// arrival rate x the prefill's seconds squared / 2 (the expected
    /// requests arriving during the prefill, each waiting half of it on
    /// average). The rate counts the requests that continue a
    /// conversation (bound to where their history is; a new request sees
    /// a pending prefill and goes elsewhere): this gateway's, decayed over
    /// `arrivalWindowMs`, plus the other gateways' (`peerArrivalsPerS`).
    /// 4 measured in the fleet simulation (16 replicas, seeds 1-5, one and
    /// four gateways; 0, 2, 4, 8): agent's TTFT p95 878 / 588 / 207 / 219
    /// ms at one gateway and 1206 / 1040 / 769 / 1128 at four; chat's 184
    /// / 165 / 156 / 149 and 215 / 204 / 214 / 218; bursts, ramp, groups
    /// and tenants within 2 ms at 4; the Mooncake trace and mix unchanged
    /// (no request continues a conversation there). Counting every request
    /// instead moved the Mooncake trace's p95 from 1434 to 1534-1631 ms
    /// at weights 0.5-2 (docs/fleet-state.md, "Arrivals behind a
    /// prefill").
    pub fn arrival_delay_weight() -> f64 {
        4.0
    }
    /// The time over which the recent arrival rate per replica decays
    /// (`arrivalDelayWeight`). 10 s measured against 5 s and 20 s (agent,
    /// seeds 1-5: TTFT p95 207 / 664 / 219 ms at one gateway, 769 / 1341
    /// / 1064 at four; chat 156 / 161 / 164 and 214 / 205 / 215).
    pub fn arrival_window_ms() -> u64 {
        10_000
    }
    /// The share of the other gateways' pending prefill on a replica
    /// (`peerPendingTokens`, from a collector that pushes to several
    /// gateways) counted in its pending prefill. Each gateway charges a
    /// request's whole prompt less what its *own* prefix index knows is
    /// cached, so with requests spread over gateways the others' figure
    /// overstates the work a conversation's home has ahead; counted
    /// whole, it moved first turns off their homes. Real-time bench,
    /// Mooncake 500..900 s, three gateways and one collector: at 1, 90 %
    /// of one gateway's hit rate and 1.04x its TTFT p95 (6 runs); at 0.75,
    /// 99 % and 1.04x (3 runs); at 0.5, 102 % and 1.09x (2 runs)
    /// (docs/fleet-state.md).
    pub fn peer_pending_weight() -> f64 {
        0.75
    }
    /// Predicted KV use (as a share of a replica's capacity, or its KV
    /// utilisation where the capacity is unknown) from which its uncached
    /// tokens carry the whole `recomputeWeight`; below, the weight falls in
    /// proportion. A prefix computed a second time costs others only where
    /// memory is in demand (it evicts cached prefixes) and the replica is
    /// busy. Fleet simulation, 16 replicas: the Mooncake trace runs at about
    /// 10 % KV and its TTFT p95 went 1903 -> 1625 ms at 0.3 (1617 at 0.5,
    /// 1755 at 0.2), the chat family at about 50 % (251 -> 243 ms); see
    /// docs/fleet-state.md. 0 gives the whole weight everywhere.
    pub fn recompute_full_kv() -> f64 {
        0.3
    }
    /// A long shared prefix (a request's system part alone is
    /// `affinityBlocks` long) becomes the affinity key of the request, in
    /// place of its session or (without one) its conversation, when the
    /// prefix carries less than this share of one replica's requests (its
    /// share of the worker's recent requests times the replicas) and its
    /// requests are mostly that prefix (`prefixAffinityFirst`): its
    /// conversations then share one home, where the prefix is cached,
    /// instead of one home each. 0: every request keeps its session's or
    /// conversation's key. Fleet simulation, 16 replicas: see
    /// docs/fleet-state.md ("The affinity key per prefix", "Conversations
    /// without a session").
    pub fn prefix_affinity_share() -> f64 {
        0.25
    }
    /// The mean share of a prefix's requests that comes before their first
    /// user message, from which the prefix may be the affinity key: a
    /// tenant's 2k-token system prompt before short questions (about 0.9),
    /// not a chat's before long conversations (about 0.3) or an agent's tool
    /// prompt before a 60k-token context.
    /// A session's long shared prefix that carries too much traffic to be
    /// its sessions' affinity key (see above), but less than the whole
    /// fleet's share, homes its sessions within a subset of the replicas:
    /// the rendezvous top of the prefix's key, as many as it has replicas'
    /// shares of requests (its share x replicas / `prefixAffinityShare`,
    /// rounded up), when its requests' prompts are on average at least this
    /// share the prefix. Fewer replicas then hold each copy of a document
    /// many users ask about; a conversation's own history, where it is most
    /// of the prompt, keeps the whole fleet. 1: never. Fleet simulation, 16
    /// replicas, seeds 1-3 (docs/fleet-state.md, "A subset per shared
    /// prefix"): groups p99 216 -> 87 ms (K = 1) and 276 -> 209 (K = 4), p95
    /// +0-3 ms; tenants p95 -1 to -3 ms; chat p95 +1 to +7 ms at K = 1; at
    /// 0.5 chat lost 20-25 ms, at 0.9 tenants kept less of the gain.
    pub fn prefix_subset_first() -> f64 {
        0.8
    }
    pub fn prefix_affinity_first() -> f64 {
        0.5
    }
    /// Predicted KV use (as a share of capacity) past which the memory term
    /// of the cost starts to rise. 0.6 helps chat in the fleet simulation
    /// (TTFT p95 over the best modelled peer 0.47x -> 0.34x at one gateway)
    /// but made two gateways disagree on where conversations go in the
    /// end-to-end test with replicas pinned at 0.6 and 0.8 KV
    /// (docs/fleet-state.md, "`memoryKnee` 0.6: measured, adopted and
    /// reverted"), so it stays 0.8.
    pub fn memory_knee() -> f64 {
        0.8
    }
    /// The memory term at full predicted KV: it grows with the square of
    /// the overshoot past the knee, so a replica predicted past its capacity
    /// (a preemption, or a wait for memory) costs several seconds.
    pub fn memory_seconds() -> f64 {
        1.0
    }
    /// A replica whose predicted KV use stays under this share of its
    /// capacity always admits (bounded load's floor where capacity is known).
    pub fn memory_floor() -> f64 {
        0.9
    }
    /// Bounded load moves a request that continues a conversation off its
    /// first replica (its home, where its history is) only when the
    /// replica it would spill to is predicted to cost at most this many
    /// times as much, plus `spillMarginMs` (0: bounded load always
    /// spills). The memory term already moves a conversation off a full
    /// home; a spill to a cold replica computes its whole history again.
    /// Fleet simulation, 16 replicas, seeds 1-6, TTFT p95 median (mean) ms,
    /// ratio / margin 1.25 / 50, 2 / 100, 4 / 250 and no spill at all:
    /// agent at K = 1 1242 (1111) -> 1212 (998), 1004 (903), 1031 (857),
    /// 1212 (1024); at K = 4 1463 (1428) -> 1212 (1032), 1212 (1024), 1212
    /// (1008), 1212 (1032); chat at K = 4 203 (191) -> 204 (194), 210 (196),
    /// 204 (193), 214 (195); the other families unchanged
    /// (docs/fleet-state.md, "A conversation's spill must be cheap").
    pub fn spill_cost_ratio() -> f64 {
        4.0
    }
    /// See `spillCostRatio`.
    pub fn spill_margin_ms() -> f64 {
        250.0
    }
    /// Predicted costs within this many milliseconds tie, and the
    /// rendezvous rank decides: keeps the pick stable against metric noise.
    pub fn cost_quantum_ms() -> f64 {
        2.0
    }
    /// Slots of the gateway's prefix index (one shared-data key each, a
    /// value of 28 to 88 bytes, up to about 160 bytes with Envoy's
    /// overhead).
    pub fn prefix_index_slots() -> u32 {
        16384
    }
    /// Index entries older than this are assumed evicted by the engine.
    pub fn prefix_ttl_ms() -> u64 {
        600_000
    }
    /// Each request's last block goes to the other gateways through the
    /// collector (`crate::placed`), so that a conversation's next turn,
    /// on whichever gateway, finds where its previous turn went. Measured
    /// in the fleet simulation, four gateways, 16 replicas, seeds 1-5
    /// (docs/fleet-state.md, "Last blocks, shared through the collector").
    pub fn share_last_blocks() -> bool {
        true
    }
    /// Replicas whose answers show them prefilling well below the fastest
    /// are priced at their learned rate (`crate::rates`). Measured in the
    /// fleet simulation on a fleet of two GPU generations and on one of a
    /// single kind (docs/fleet-state.md, "Prefill rates learned from
    /// answers").
    pub fn learn_prefill_rates() -> bool {
        true
    }
    /// Snapshots of 4096 hosts are about 1 MB of JSON.
    pub fn ingest_max_bytes() -> u64 {
        4 << 20
    }
    /// The router's default `fleet.staleAfterMs`: a standby collector takes
    /// over when the owner's data would go stale anyway.
    pub fn owner_lease_ms() -> u64 {
        2000
    }
}

/// A configuration error: which field, what value, why.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}: {}", self.field, self.reason)
        } else {
            write!(f, "{} = {}: {}", self.field, self.value, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, value: impl fmt::Display, reason: &str) -> ConfigError {
    ConfigError {
        field: field.to_owned(),
        value: value.to_string(),
        reason: reason.to_owned(),
    }
}

/// The compiled, validated configuration the request path uses.
#[derive(Debug, Clone)]
pub struct Config {
    pub hosts: HostSet,
    pub destination_header: String,
    pub session_headers: Vec<String>,
    pub fallbacks: usize,
    pub epsilon: f64,
    pub load_floor_tokens: u64,
    pub max_body_bytes: usize,
    pub block_bytes: usize,
    pub max_blocks: usize,
    pub affinity_blocks: usize,
    pub learn_splits: bool,
    pub bytes_per_token: u64,
    pub output_tokens_cap: u64,
    pub explain_header: bool,
    /// Shared-data key of the in-flight load table.
    pub load_key: String,
    pub shared_data_prefix: String,
    pub role: Role,
    pub fleet: FleetConfig,
    pub ingest: Option<IngestConfig>,
    pub admission: AdmissionConfig,
}

/// Compiled admission settings ([`crate::admit`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    pub enabled: bool,
    pub objective_header: String,
    /// The configured objectives, sorted by name; a request's objective is
    /// an index into this list, or none (the default, priority 0).
    pub objectives: Vec<(String, i32)>,
    pub max_queue: usize,
    pub max_queued_per_key: usize,
    pub max_wait_ms: u64,
    pub retry_after_s: u32,
    pub max_pending_s: f64,
    pub max_memory: f64,
}

/// Compiled fleet-scoring settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    pub stale_after_ms: u64,
    pub kv_pressure: f64,
    pub queue_pressure: u32,
    pub waiting_request_tokens: u64,
    pub prefill_tokens_per_s: f64,
    pub home_cached_share: f64,
    /// The home's assumed share for a cold request: `coldHomeShare`, at
    /// most `homeCachedShare`.
    pub cold_home_share: f64,
    /// The home's assumed share for a request that starts a conversation,
    /// whose messages put a part before the first user message, and of
    /// which the prefix index knows only that part, where the snapshot
    /// carries no other gateway's load: `sharedOnlyHomeShare` (unset,
    /// `homeCachedShare`), at most `homeCachedShare`.
    pub shared_only_home_share: f64,
    /// The same where the snapshot carries other gateways' load (so this
    /// gateway learns where they placed a key, and they learn its
    /// placements): `sharedOnlyHomeShare` (unset, 0.25), at most
    /// `homeCachedShare`.
    pub shared_only_with_peers: f64,
    /// Whether this gateway remembers where it placed a key's cold
    /// request, and shares it (`coldHomeShare` or `sharedOnlyHomeShare`
    /// below `homeCachedShare`: such a request may leave its home).
    pub key_memory: bool,
    pub recompute_weight: f64,
    pub peer_pending_weight: f64,
    pub arrival_delay_weight: f64,
    pub arrival_window_ms: u64,
    pub memory_knee: f64,
    pub memory_seconds: f64,
    pub memory_floor: f64,
    pub spill_cost_ratio: f64,
    /// In seconds.
    pub spill_margin_s: f64,
    /// In seconds.
    pub cost_quantum_s: f64,
    pub recompute_full_kv: f64,
    pub prefix_affinity_share: f64,
    pub prefix_affinity_first: f64,
    pub prefix_subset_first: f64,
    pub prefix_index_slots: u64,
    pub prefix_ttl_ms: u64,
    /// Shared-data key of the snapshot JSON.
    pub snapshot_key: String,
    /// Shared-data key of the snapshot's version stamp (seq, ingest time).
    pub stamp_key: String,
    /// Shared-data key of the collector that owns the snapshot.
    pub owner_key: String,
    /// Prefix of the prefix-index slot keys.
    pub index_key_prefix: String,
    /// Shared-data key of the ring of this gateway's recent placements off
    /// home ([`crate::placed`]).
    pub placed_key: String,
    /// Whether this gateway shares each request's last block with the
    /// other gateways, and applies theirs (`shareLastBlocks`).
    pub share_last_blocks: bool,
    /// Shared-data key of the ring of this gateway's recent requests' last
    /// blocks ([`crate::placed::note_last`]).
    pub last_blocks_key: String,
    /// Whether answers teach which replicas prefill slower
    /// (`learnPrefillRates`, [`crate::rates`]).
    pub learn_prefill_rates: bool,
    /// Shared-data key of the learned prefill rates.
    pub rates_key: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct IngestConfig {
    pub token: String,
    pub max_bytes: usize,
    /// 0: any collector's newer push replaces the snapshot.
    pub owner_lease_ms: u64,
}

/// Upper bounds that keep the filter's allocation bounded whatever the
/// config says.
pub const MAX_HOSTS: usize = 4096;
pub const MAX_FALLBACKS: u32 = 16;
pub const MAX_BODY_BYTES: u64 = 64 << 20;
/// Most objectives a config may name (each has its own metric series).
pub const MAX_OBJECTIVES: usize = 32;
/// Longest objective name (a metric label).
pub const MAX_OBJECTIVE_NAME: usize = 63;
/// Largest `admission.maxQueue`.
pub const MAX_QUEUE: u32 = 65_536;
/// Largest `admission.maxWaitMs` (ten minutes).
pub const MAX_WAIT_MS: u64 = 600_000;
/// Largest `loadFloorTokens` (a billion tokens: effectively no bound).
pub const MAX_LOAD_FLOOR_TOKENS: u64 = 1 << 30;

impl Config {
    /// Parses, validates and compiles plugin JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        // serde_path_to_error names the field of a type error too
        // (`explainHeader: invalid type: string "yes", expected a boolean`).
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." || path == "?" {
                "config".to_owned()
            } else {
                path
            };
            err(
                &field,
                "",
                &format!("not a valid kvroute config: {}", e.inner()),
            )
        })?;
        de.end()
            .map_err(|e| err("config", "", &format!("not a valid kvroute config: {e}")))?;
        raw.compile()
    }
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

impl RawConfig {
    pub fn compile(self) -> Result<Config, ConfigError> {
        if self.role == Role::Router && self.hosts.is_empty() {
            return Err(err("hosts", "[]", "must list at least one ip:port"));
        }
        if self.hosts.len() > MAX_HOSTS {
            return Err(err(
                "hosts",
                self.hosts.len(),
                &format!("at most {MAX_HOSTS} hosts"),
            ));
        }
        let mut seen = HashSet::new();
        for (i, h) in self.hosts.iter().enumerate() {
            let field = format!("hosts[{i}]");
            let addr: SocketAddr = h
                .parse()
                .map_err(|_| err(&field, format!("{h:?}"), "not an ip:port address"))?;
            if addr.port() == 0 {
                return Err(err(&field, format!("{h:?}"), "port 0 is not routable"));
            }
            if !seen.insert(addr) {
                return Err(err(&field, format!("{h:?}"), "listed twice"));
            }
        }
        if !valid_header_name(&self.destination_header) {
            return Err(err(
                "destinationHeader",
                format!("{:?}", self.destination_header),
                "must be a lower-case HTTP header name",
            ));
        }
        for (i, h) in self.session_headers.iter().enumerate() {
            if !valid_header_name(h) {
                return Err(err(
                    &format!("sessionHeaders[{i}]"),
                    format!("{h:?}"),
                    "must be a lower-case HTTP header name",
                ));
            }
            if *h == self.destination_header {
                return Err(err(
                    &format!("sessionHeaders[{i}]"),
                    format!("{h:?}"),
                    "must differ from destinationHeader",
                ));
            }
        }
        if self.fallbacks > MAX_FALLBACKS {
            return Err(err(
                "fallbacks",
                self.fallbacks,
                &format!("must be between 0 and {MAX_FALLBACKS}"),
            ));
        }
        if !(self.epsilon.is_finite() && self.epsilon > 0.0 && self.epsilon <= 10.0) {
            return Err(err(
                "epsilon",
                self.epsilon,
                "must be a number greater than 0 and at most 10",
            ));
        }
        if self.load_floor_tokens > MAX_LOAD_FLOOR_TOKENS {
            return Err(err(
                "loadFloorTokens",
                self.load_floor_tokens,
                &format!("must be between 0 and {MAX_LOAD_FLOOR_TOKENS}"),
            ));
        }
        if self.max_body_bytes == 0 || self.max_body_bytes > MAX_BODY_BYTES {
            return Err(err(
                "maxBodyBytes",
                self.max_body_bytes,
                &format!("must be between 1 and {MAX_BODY_BYTES}"),
            ));
        }
        let h = &self.hashing;
        if !(16..=65536).contains(&h.block_bytes) {
            return Err(err(
                "hashing.blockBytes",
                h.block_bytes,
                "must be between 16 and 65536",
            ));
        }
        if !(1..=65536).contains(&h.max_blocks) {
            return Err(err(
                "hashing.maxBlocks",
                h.max_blocks,
                "must be between 1 and 65536",
            ));
        }
        if h.affinity_blocks == 0 || h.affinity_blocks > h.max_blocks {
            return Err(err(
                "hashing.affinityBlocks",
                h.affinity_blocks,
                "must be between 1 and hashing.maxBlocks",
            ));
        }
        let c = &self.cost;
        if !(1..=64).contains(&c.bytes_per_token) {
            return Err(err(
                "cost.bytesPerToken",
                c.bytes_per_token,
                "must be between 1 and 64",
            ));
        }
        if !(1..=1 << 20).contains(&c.output_tokens_cap) {
            return Err(err(
                "cost.outputTokensCap",
                c.output_tokens_cap,
                "must be between 1 and 1048576",
            ));
        }
        let prefix = &self.shared_data_prefix;
        if prefix.is_empty()
            || prefix.len() > 128
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(err(
                "sharedDataPrefix",
                format!("{prefix:?}"),
                "must be 1 to 128 characters of [A-Za-z0-9._-]",
            ));
        }
        let f = &self.fleet;
        let shares = [
            ("fleet.homeCachedShare", f.home_cached_share),
            ("fleet.coldHomeShare", f.cold_home_share),
            (
                "fleet.sharedOnlyHomeShare",
                f.shared_only_home_share.unwrap_or(f.home_cached_share),
            ),
            ("fleet.memoryFloor", f.memory_floor),
            ("fleet.recomputeFullKv", f.recompute_full_kv),
            ("fleet.prefixAffinityShare", f.prefix_affinity_share),
            ("fleet.prefixAffinityFirst", f.prefix_affinity_first),
            ("fleet.prefixSubsetFirst", f.prefix_subset_first),
            ("fleet.peerPendingWeight", f.peer_pending_weight),
        ];
        for (name, v) in shares {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(err(name, v, "must be between 0 and 1"));
            }
        }
        if !(f.memory_knee.is_finite() && (0.0..1.0).contains(&f.memory_knee)) {
            return Err(err(
                "fleet.memoryKnee",
                f.memory_knee,
                "must be at least 0 and below 1",
            ));
        }
        if !(f.recompute_weight.is_finite() && (0.0..=100.0).contains(&f.recompute_weight)) {
            return Err(err(
                "fleet.recomputeWeight",
                f.recompute_weight,
                "must be between 0 and 100",
            ));
        }
        if !(f.arrival_delay_weight.is_finite() && (0.0..=100.0).contains(&f.arrival_delay_weight))
        {
            return Err(err(
                "fleet.arrivalDelayWeight",
                f.arrival_delay_weight,
                "must be between 0 and 100",
            ));
        }
        if !(100..=3_600_000).contains(&f.arrival_window_ms) {
            return Err(err(
                "fleet.arrivalWindowMs",
                f.arrival_window_ms,
                "must be between 100 and 3600000",
            ));
        }
        if !(f.memory_seconds.is_finite() && (0.0..=3600.0).contains(&f.memory_seconds)) {
            return Err(err(
                "fleet.memorySeconds",
                f.memory_seconds,
                "must be between 0 and 3600",
            ));
        }
        let ratio = f.spill_cost_ratio;
        if !(ratio == 0.0 || (ratio.is_finite() && (1.0..=1000.0).contains(&ratio))) {
            return Err(err(
                "fleet.spillCostRatio",
                ratio,
                "must be 0 (off) or between 1 and 1000",
            ));
        }
        if !(f.spill_margin_ms.is_finite() && (0.0..=60_000.0).contains(&f.spill_margin_ms)) {
            return Err(err(
                "fleet.spillMarginMs",
                f.spill_margin_ms,
                "must be between 0 and 60000",
            ));
        }
        if !(f.cost_quantum_ms.is_finite() && (0.0..=10_000.0).contains(&f.cost_quantum_ms)) {
            return Err(err(
                "fleet.costQuantumMs",
                f.cost_quantum_ms,
                "must be between 0 and 10000",
            ));
        }
        if !(1..=1_000_000_000).contains(&f.prefill_tokens_per_s) {
            return Err(err(
                "fleet.prefillTokensPerS",
                f.prefill_tokens_per_s,
                "must be between 1 and 1000000000",
            ));
        }
        if !(1..=3_600_000).contains(&f.stale_after_ms) {
            return Err(err(
                "fleet.staleAfterMs",
                f.stale_after_ms,
                "must be between 1 and 3600000",
            ));
        }
        if !(f.kv_pressure.is_finite() && f.kv_pressure > 0.0 && f.kv_pressure <= 1.0) {
            return Err(err(
                "fleet.kvPressure",
                f.kv_pressure,
                "must be greater than 0 and at most 1",
            ));
        }
        if f.queue_pressure == 0 {
            return Err(err(
                "fleet.queuePressure",
                f.queue_pressure,
                "must be at least 1",
            ));
        }
        if !(1..=1 << 20).contains(&f.prefix_index_slots) {
            return Err(err(
                "fleet.prefixIndexSlots",
                f.prefix_index_slots,
                "must be between 1 and 1048576",
            ));
        }
        let ingest = match (self.role, &self.ingest) {
            (Role::Ingest, None) => {
                return Err(err(
                    "ingest",
                    "",
                    "required when role is \"ingest\" (set ingest.token)",
                ))
            }
            (_, Some(i)) => {
                if i.token.len() < 16
                    || i.token.len() > 4096
                    || !i.token.bytes().all(|b| b.is_ascii_graphic())
                {
                    return Err(err(
                        "ingest.token",
                        "(hidden)",
                        "must be 16 to 4096 printable ASCII characters without spaces",
                    ));
                }
                if i.max_bytes == 0 || i.max_bytes > MAX_BODY_BYTES {
                    return Err(err(
                        "ingest.maxBytes",
                        i.max_bytes,
                        &format!("must be between 1 and {MAX_BODY_BYTES}"),
                    ));
                }
                if i.owner_lease_ms > 3_600_000 {
                    return Err(err(
                        "ingest.ownerLeaseMs",
                        i.owner_lease_ms,
                        "must be between 0 (no owner) and 3600000",
                    ));
                }
                Some(IngestConfig {
                    token: i.token.clone(),
                    max_bytes: i.max_bytes as usize,
                    owner_lease_ms: i.owner_lease_ms,
                })
            }
            (Role::Router, None) => None,
        };
        let fleet = FleetConfig {
            stale_after_ms: f.stale_after_ms,
            kv_pressure: f.kv_pressure,
            queue_pressure: f.queue_pressure,
            waiting_request_tokens: f.waiting_request_tokens,
            prefill_tokens_per_s: f.prefill_tokens_per_s as f64,
            home_cached_share: f.home_cached_share,
            cold_home_share: f.cold_home_share.min(f.home_cached_share),
            // Unset: 0.25 where the snapshot carries other gateways' load,
            // off (`homeCachedShare`) elsewhere. Gateways that read no
            // other gateway disagree on where a conversation's first turn
            // went when it leaves home, and a single gateway cannot be
            // told from those (docs/fleet-state.md, "A first request known
            // only by its shared part").
            shared_only_home_share: f
                .shared_only_home_share
                .unwrap_or(f.home_cached_share)
                .min(f.home_cached_share),
            shared_only_with_peers: f
                .shared_only_home_share
                .unwrap_or(defaults::SHARED_ONLY_HOME_SHARE_WITH_PEERS)
                .min(f.home_cached_share),
            key_memory: f.cold_home_share < f.home_cached_share
                || f.shared_only_home_share
                    .unwrap_or(defaults::SHARED_ONLY_HOME_SHARE_WITH_PEERS)
                    < f.home_cached_share,
            recompute_weight: f.recompute_weight,
            peer_pending_weight: f.peer_pending_weight,
            arrival_delay_weight: f.arrival_delay_weight,
            arrival_window_ms: f.arrival_window_ms,
            memory_knee: f.memory_knee,
            memory_seconds: f.memory_seconds,
            memory_floor: f.memory_floor,
            spill_cost_ratio: f.spill_cost_ratio,
            spill_margin_s: f.spill_margin_ms / 1000.0,
            cost_quantum_s: f.cost_quantum_ms / 1000.0,
            recompute_full_kv: f.recompute_full_kv,
            prefix_affinity_share: f.prefix_affinity_share,
            prefix_affinity_first: f.prefix_affinity_first,
            prefix_subset_first: f.prefix_subset_first,
            prefix_index_slots: u64::from(f.prefix_index_slots),
            prefix_ttl_ms: f.prefix_ttl_ms,
            snapshot_key: format!("{prefix}.fleet.v1"),
            stamp_key: format!("{prefix}.fleet.stamp.v1"),
            owner_key: format!("{prefix}.fleet.owner.v1"),
            index_key_prefix: format!("{prefix}.px."),
            placed_key: format!("{prefix}.placed.v1"),
            share_last_blocks: f.share_last_blocks,
            last_blocks_key: format!("{prefix}.lastblocks.v1"),
            learn_prefill_rates: f.learn_prefill_rates,
            rates_key: format!("{prefix}.rates.v1"),
        };
        let admission =
            compile_admission(&self.admission, &self.objectives, &self.destination_header)?;
        Ok(Config {
            admission,
            role: self.role,
            fleet,
            ingest,
            hosts: HostSet::new(self.hosts),
            load_key: format!("{prefix}.load.v3"),
            shared_data_prefix: prefix.clone(),
            destination_header: self.destination_header,
            session_headers: self.session_headers,
            fallbacks: self.fallbacks as usize,
            epsilon: self.epsilon,
            load_floor_tokens: self.load_floor_tokens,
            max_body_bytes: self.max_body_bytes as usize,
            block_bytes: h.block_bytes as usize,
            max_blocks: h.max_blocks as usize,
            affinity_blocks: h.affinity_blocks as usize,
            learn_splits: h.learn_splits,
            bytes_per_token: u64::from(c.bytes_per_token),
            output_tokens_cap: c.output_tokens_cap,
            explain_header: self.explain_header,
        })
    }
}

/// Validates the objectives and the admission block.
fn compile_admission(
    a: &RawAdmission,
    objectives: &BTreeMap<String, RawObjective>,
    destination_header: &str,
) -> Result<AdmissionConfig, ConfigError> {
    if objectives.len() > MAX_OBJECTIVES {
        return Err(err(
            "objectives",
            objectives.len(),
            &format!("at most {MAX_OBJECTIVES} objectives"),
        ));
    }
    for name in objectives.keys() {
        let ok = !name.is_empty()
            && name.len() <= MAX_OBJECTIVE_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok {
            return Err(err(
                "objectives",
                format!("{name:?}"),
                &format!("an objective name is 1 to {MAX_OBJECTIVE_NAME} letters, digits, '-' or '_' (it labels metrics)"),
            ));
        }
        if name == crate::admit::DEFAULT_OBJECTIVE {
            return Err(err(
                "objectives",
                format!("{name:?}"),
                "is reserved for requests that name no configured objective (priority 0)",
            ));
        }
    }
    if !valid_header_name(&a.objective_header) || a.objective_header == destination_header {
        return Err(err(
            "admission.objectiveHeader",
            format!("{:?}", a.objective_header),
            "must be a lower-case HTTP header name other than destinationHeader",
        ));
    }
    if a.max_queue == 0 || a.max_queue > MAX_QUEUE {
        return Err(err(
            "admission.maxQueue",
            a.max_queue,
            &format!("must be between 1 and {MAX_QUEUE}"),
        ));
    }
    if a.max_queued_per_key == 0 || a.max_queued_per_key > a.max_queue {
        return Err(err(
            "admission.maxQueuedPerKey",
            a.max_queued_per_key,
            "must be between 1 and admission.maxQueue",
        ));
    }
    if a.max_wait_ms == 0 || a.max_wait_ms > MAX_WAIT_MS {
        return Err(err(
            "admission.maxWaitMs",
            a.max_wait_ms,
            &format!("must be between 1 and {MAX_WAIT_MS}"),
        ));
    }
    if a.retry_after_s == 0 || a.retry_after_s > 3600 {
        return Err(err(
            "admission.retryAfterS",
            a.retry_after_s,
            "must be between 1 and 3600",
        ));
    }
    if !(a.max_pending_s.is_finite() && a.max_pending_s > 0.0 && a.max_pending_s <= 3600.0) {
        return Err(err(
            "admission.maxPendingS",
            a.max_pending_s,
            "must be a number of seconds above 0, at most 3600",
        ));
    }
    if !(a.max_memory.is_finite() && a.max_memory > 0.0 && a.max_memory <= 1.0) {
        return Err(err(
            "admission.maxMemory",
            a.max_memory,
            "must be a share of KV capacity above 0, at most 1",
        ));
    }
    Ok(AdmissionConfig {
        enabled: a.enabled,
        objective_header: a.objective_header.clone(),
        objectives: objectives
            .iter()
            .map(|(n, o)| (n.clone(), o.priority))
            .collect(),
        max_queue: a.max_queue as usize,
        max_queued_per_key: a.max_queued_per_key as usize,
        max_wait_ms: a.max_wait_ms,
        retry_after_s: a.retry_after_s,
        max_pending_s: a.max_pending_s,
        max_memory: a.max_memory,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(json: &str) -> Result<Config, ConfigError> {
        Config::from_json(json.as_bytes())
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = compile(r#"{"hosts":["127.0.0.1:8001"]}"#).unwrap();
        assert_eq!(c.destination_header, "x-gateway-destination-endpoint");
        assert_eq!(c.session_headers, vec!["x-session-id".to_string()]);
        assert_eq!(c.fallbacks, 2);
        assert_eq!(c.block_bytes, 256);
        assert_eq!(c.max_blocks, 1024);
        assert_eq!(c.affinity_blocks, 16);
        assert_eq!(c.bytes_per_token, 4);
        assert_eq!(c.max_body_bytes, 1 << 20);
        assert_eq!(c.load_key, "kvroute.load.v3");
        assert!(!c.explain_header);
        assert_eq!(c.role, Role::Router);
        assert_eq!(c.fleet.stale_after_ms, 2000);
        assert_eq!(c.fleet.home_cached_share, 0.95);
        assert_eq!((c.fleet.cold_home_share, c.fleet.key_memory), (0.25, true));
        assert_eq!(c.fleet.peer_pending_weight, 0.75);
        assert_eq!(c.fleet.cost_quantum_s, 0.002);
        assert_eq!(
            (c.fleet.spill_cost_ratio, c.fleet.spill_margin_s),
            (4.0, 0.25)
        );
        assert_eq!(c.fleet.snapshot_key, "kvroute.fleet.v1");
        assert!(c.ingest.is_none());
    }

    #[test]
    fn ingest_role_needs_a_token_and_no_hosts() {
        let c = compile(r#"{"role":"ingest","ingest":{"token":"0123456789abcdef"}}"#).unwrap();
        assert_eq!(c.role, Role::Ingest);
        assert_eq!(c.ingest.unwrap().max_bytes, 4 << 20);
        let e = compile(r#"{"role":"ingest"}"#).unwrap_err();
        assert_eq!(e.field, "ingest");
        let e = compile(r#"{"role":"ingest","ingest":{"token":"short"}}"#).unwrap_err();
        assert_eq!(e.field, "ingest.token");
        assert!(
            !e.to_string().contains("short"),
            "the token is never echoed: {e}"
        );
        let e = compile(r#"{"role":"gateway"}"#).unwrap_err();
        assert_eq!(e.field, "role");
    }

    #[test]
    fn errors_name_field_value_and_reason() {
        let cases = [
            (r#"{"hosts":[]}"#, "hosts", "at least one"),
            (r#"{"hosts":["nope"]}"#, "hosts[0]", "not an ip:port"),
            (
                r#"{"hosts":["127.0.0.1:1","127.0.0.1:1"]}"#,
                "hosts[1]",
                "twice",
            ),
            (r#"{"hosts":["127.0.0.1:0"]}"#, "hosts[0]", "port 0"),
            (
                r#"{"hosts":["127.0.0.1:1"],"epsilon":-1}"#,
                "epsilon",
                "greater than 0",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fallbacks":99}"#,
                "fallbacks",
                "between 0 and 16",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"destinationHeader":"X-Up"}"#,
                "destinationHeader",
                "lower-case",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"hashing":{"blockBytes":1}}"#,
                "hashing.blockBytes",
                "between 16",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"hashing":{"maxBlocks":4,"affinityBlocks":8}}"#,
                "hashing.affinityBlocks",
                "maxBlocks",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"cost":{"bytesPerToken":0}}"#,
                "cost.bytesPerToken",
                "between 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"sharedDataPrefix":"a b"}"#,
                "sharedDataPrefix",
                "[A-Za-z0-9._-]",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"kvPressure":1.5}}"#,
                "fleet.kvPressure",
                "at most 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"memoryKnee":1}}"#,
                "fleet.memoryKnee",
                "below 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"homeCachedShare":-0.1}}"#,
                "fleet.homeCachedShare",
                "between 0 and 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"coldHomeShare":1.5}}"#,
                "fleet.coldHomeShare",
                "between 0 and 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"sharedOnlyHomeShare":-0.5}}"#,
                "fleet.sharedOnlyHomeShare",
                "between 0 and 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"arrivalDelayWeight":-1}}"#,
                "fleet.arrivalDelayWeight",
                "between 0 and 100",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"arrivalWindowMs":0}}"#,
                "fleet.arrivalWindowMs",
                "between 100 and 3600000",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"peerPendingWeight":1.5}}"#,
                "fleet.peerPendingWeight",
                "between 0 and 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"spillCostRatio":0.5}}"#,
                "fleet.spillCostRatio",
                "0 (off) or between 1 and 1000",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"spillMarginMs":-1}}"#,
                "fleet.spillMarginMs",
                "between 0 and 60000",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"fleet":{"prefillTokensPerS":0}}"#,
                "fleet.prefillTokensPerS",
                "between 1",
            ),
            (
                r#"{"hosts":["127.0.0.1:1"],"maxBodyBytes":0}"#,
                "maxBodyBytes",
                "between 1",
            ),
        ];
        for (json, field, reason) in cases {
            let e = compile(json).unwrap_err();
            assert_eq!(e.field, field, "{json}");
            assert!(e.to_string().contains(reason), "{json}: {e}");
        }
    }

    #[test]
    fn unknown_fields_and_bad_json_are_rejected_readably() {
        let e = compile(r#"{"hosts":["127.0.0.1:1"],"epsilom":1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `epsilom`"), "{e}");
        let e = compile(r#"{"hosts":["127.0.0.1:1"],"hashing":{"blocks":1}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `blocks`"), "{e}");
        let e = compile("not json").unwrap_err();
        assert!(e.to_string().contains("not a valid kvroute config"), "{e}");
        let e = compile(r#"{"hosts":["127.0.0.1:1"],"explainHeader":"yes"}"#).unwrap_err();
        assert_eq!(e.field, "explainHeader");
        assert!(e.to_string().contains("expected a boolean"), "{e}");
        let e = compile(r#"{"hosts":["127.0.0.1:1"],"hashing":{"maxBlocks":"x"}}"#).unwrap_err();
        assert_eq!(e.field, "hashing.maxBlocks");
        let e = compile(r#"{"hosts":["127.0.0.1:1"]} trailing"#).unwrap_err();
        assert!(e.to_string().contains("trailing"), "{e}");
        let e = compile(r#"{"epsilon":1}"#).unwrap_err();
        assert_eq!(e.field, "hosts");
    }
}

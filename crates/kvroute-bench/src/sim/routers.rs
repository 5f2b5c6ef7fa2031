//! The routers of the fleet simulation: kvroute's real request path, and
//! modelled peers.
//!
//! Every router holds the state of all K gateway instances it runs as, one
//! slot per instance, and shares nothing between them unless the real
//! deployment would. The peers are models of their documented algorithms,
//! written from their public descriptions and sources (no code copied), and
//! each name ends in `(modelled)`. Where a constant comes from:
//!
//! | peer | constants | source |
//! |---|---|---|
//! | round robin | start at a seeded host per gateway | Envoy `ROUND_ROBIN` |
//! | least request | 2 random hosts, fewer active requests wins | Envoy `least_request.proto`, `choice_count` default 2 |
//! | ring hash | 1024 ring points, xxh64 of `address_i`, key = the session header, random when absent; bound `hash_balance_factor` 125: a host takes a request while its active requests <= ceil((gateway active + 1) x 1.25 / N), else a permutation seeded by the hash is walked and the least overloaded host is the last resort | Envoy `ring_hash.proto` (`minimum_ring_size` 1024), `thread_aware_lb_impl.cc` (`BoundedLoadHashingLoadBalancer`); 125 is what `scripts/bench.py` configures |
//! | consistent hash | the same ring, no bound | as above, `hash_balance_factor` unset |
//! | SGLang cache-aware | `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold` 1.5, `max_tree_size` 2^26 characters per worker, eviction every 120 s; load = the router's own in-flight requests per worker; imbalanced (max - min > 64 and max > 1.5 x min): least loaded; else the best prefix match if matched / text characters > 0.3, else least loaded; the tree is updated either way. The text is the messages' contents joined by spaces | sglang `sgl-model-gateway/src/main.rs` (CLI defaults), `policies/cache_aware.rs` (`select_worker`), `policies/tree.rs`, `extract_text_for_routing` |
//! | llm-d weighted scorer | prefix 3, queue 2, KV 2 (sum of weight x score in 0..1); queue = min-max of waiting requests (1 when all equal), KV = 1 - usage, prefix = matched / total blocks; blocks of 64 bytes of the JSON messages, chained xxh64 seeded by the model, at most 256 blocks, a partial last block hashed too; an LRU per server of its engine's `num_gpu_blocks` hashes (auto-tune); metrics every 50 ms; max score, random tie-break | llm-d router `pkg/epp/config/loader/defaults.go`, `scorer/queuedepth/queue.go`, `scorer/kvcacheutilization`, `scorer/prefix/plugin.go`, `approximateprefix/types.go` and `hashing.go`, `server/options.go` |
//! | Dynamo KV router | cost = 1.0 x (prefill tokens in flight + uncached prompt tokens) / 16 + (distinct prompt blocks in flight + the request's blocks not among them); argmin, random tie-break; the overlap read from the engines' caches as KV events would report them, with no delay | dynamo `lib/llm/src/kv_router/config.rs` (`overlap_score_weight` 1.0, `router_temperature` 0), `docs/design_docs/router_design.md`, `DefaultWorkerSelector::select_worker` |
//!
//! The approximations, each on the side of the peer: SGLang's character
//! tree is kept as chained hashes of 64-character chunks (a match is
//! counted in whole chunks, and the tenant found at the deepest chunk is
//! its most recent one); Dynamo sees the engines' caches at once and
//! exactly.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Instant;

use xxhash_rust::xxh64::xxh64;

use kvroute_core::admit::{self, Objective, Refusal, Verdict};
use kvroute_core::answers::{self, Expectation};
use kvroute_core::decide::{self, Facts};
use kvroute_core::fleet::{HostState, Snapshot, SNAPSHOT_VERSION};
use kvroute_core::host::{HostError, MemorySharedData, SetError, SharedData, Tally};
use kvroute_core::index::IndexCache;
use kvroute_core::ingest::{self, FleetCache};
use kvroute_core::load::{self, Charge, LoadReport};
use kvroute_core::picker::HostSet;
use kvroute_core::placed;
use kvroute_core::rates::{self, Probe};
use kvroute_core::usage::{self, Learned, PriorCache};
use kvroute_core::{Config, Endpoint};
use kvroute_sim::engine::sched::{NewRequest, Reading, Scheduler, SeqEvent, Summary};
use kvroute_sim::engine::{block_hashes, EngineConfig, BLOCK_TOKENS};

use crate::rng::Rng;

/// A request as a router sees it.
pub struct Request<'a> {
    /// The JSON body the client sends (`POST /v1/chat/completions`).
    pub body: &'a [u8],
    /// The session header's value, when sent.
    pub session: Option<&'a str>,
    /// The messages, (role, content).
    pub messages: &'a [(&'static str, String)],
    /// The engine's prompt bytes (its chat template).
    pub prompt: &'a [u8],
    pub model: &'a str,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    /// The objective header's value, when sent.
    pub objective: Option<&'a str>,
}

/// What a gateway does with a request on arrival (admission control).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Route it now.
    Go,
    /// Held by the gateway; the held requests it displaced get their
    /// answer (handle, HTTP status).
    Hold { displaced: Vec<(u64, u16)> },
    /// Answered by the gateway with this HTTP status (429 or 503).
    Refuse(u16),
}

/// What a router keeps of a request it placed.
#[derive(Debug, Clone, Default)]
pub struct Ticket {
    pub engine: usize,
    /// kvroute: what is charged to the host.
    pub charge: Option<Charge>,
    /// kvroute: the stream's id (one response in four teaches the prior).
    pub stream: u32,
    /// kvroute: the gateway worker that decided (its index cache learns
    /// from the answer).
    pub worker: usize,
    /// kvroute: the prefix hit the decision expected on its primary, when
    /// it expected one (compared with the engine's cached tokens at the end).
    pub expectation: Option<Expectation>,
    pub prompt_tokens: u64,
    /// Dynamo: the prompt's engine blocks.
    pub blocks: Vec<u64>,
    /// kvroute: the decision's reason (`session`, `prefix`, `spill`, ...).
    pub reason: Option<&'static str>,
    /// kvroute: the affinity key the decision placed.
    pub key: Option<u64>,
    /// kvroute: what the answer needs to be a prefill-rate sample, stamped
    /// at the first token.
    pub probe: Cell<Option<Probe>>,
}

/// A router running as K gateway instances.
pub trait Router {
    /// The name in reports (modelled peers end in `(modelled)`).
    fn name(&self) -> String;
    /// One line on how it is configured.
    fn setup(&self) -> String;
    /// How often its gateways get engine figures (None: never).
    fn scrape_interval_s(&self) -> Option<f64> {
        None
    }
    /// From scrape to the figures being in use at a gateway.
    fn scrape_delay_s(&self) -> f64 {
        0.0
    }
    /// Engine figures scraped at `taken_s` reach gateway `gw` at `now_s`.
    fn on_readings(&mut self, _gw: usize, _readings: &[Reading], _taken_s: f64, _now_s: f64) {}
    /// Whether `route` reads the engines it is given beyond their number
    /// (their caches, as a router fed by KV events does): the simulation
    /// then brings every engine to the present first.
    fn reads_engines(&self) -> bool {
        false
    }
    /// For a router that reads the engines: when each engine's step in
    /// flight ends (its next step may take a new request), given just
    /// before [`Router::route`].
    fn engines_free_at(&mut self, _at_s: &[f64]) {}
    /// Places a request that reached gateway `gw`; `Err` is the answer the
    /// client gets instead (e.g. a 503).
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        now_s: f64,
        engines: &[&Scheduler],
    ) -> Result<Ticket, String>;
    /// Admission control on arrival (`handle` names the request if it is
    /// held). Routers without it let everything go.
    fn admit(&mut self, _gw: usize, _req: &Request<'_>, _handle: u64, _now_s: f64) -> Admission {
        Admission::Go
    }
    /// Gateway `gw`'s tick (every 100 ms while it holds requests): the
    /// held requests answered now `(handle, Some(status))`, and at most one
    /// that goes on now `(handle, None)`, which the caller routes before
    /// it calls again (the next one is judged with it charged).
    fn tick(&mut self, _gw: usize, _now_s: f64) -> Vec<(u64, Option<u16>)> {
        Vec::new()
    }
    /// Requests gateway `gw` holds.
    fn holds(&self, _gw: usize) -> usize {
        0
    }
    /// The first response byte.
    fn first_token(&mut self, _gw: usize, _t: &Ticket, _now_s: f64) {}
    /// The end of the stream.
    fn finished(&mut self, gw: usize, t: &Ticket, usage: &Summary, now_s: f64);
    /// The engine failed the request.
    fn finished_failed(&mut self, gw: usize, t: &Ticket, now_s: f64) {
        let none = Summary {
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            queue_s: 0.0,
            prefill_s: 0.0,
            e2e_s: 0.0,
            preempted: 0,
        };
        self.finished(gw, t, &none, now_s);
    }
    /// Native CPU time of each decision, ns (kvroute only).
    fn decision_ns(&mut self) -> Vec<u64> {
        Vec::new()
    }
    /// The router's own counters over the run, summed over its gateways
    /// (kvroute's `kvroute_*` counters; empty for the peers).
    fn counters(&mut self) -> BTreeMap<String, u64> {
        BTreeMap::new()
    }
}

/// The routers `kvroute-bench simulate --routers` knows, in report order.
pub const ALL: &[&str] = &[
    "round-robin",
    "least-request",
    "ring-hash",
    "consistent-hash",
    "sglang-cache-aware",
    "llm-d",
    "dynamo",
    "kvroute",
];

/// Not a deployable router, and not in [`ALL`]: kvroute whose K gateways
/// share one in-flight load table, instantly and exactly (each gateway
/// sees every gateway's pending prefill and memory held on each replica;
/// the prefix index, snapshots and caches stay per gateway). An upper
/// bound on what sharing in-flight load between gateways could give
/// (docs/fleet-state.md, "Several gateways: what the gap is"). At K = 1 it
/// is kvroute.
pub const ORACLE_SHARED_LOAD: &str = "kvroute-oracle-shared-load";

/// Not a deployable router, and not in [`ALL`]: kvroute whose K gateways
/// read and write one prefix index, instantly and exactly (its slots, key
/// memory included; each worker's cache of recently read slots stays its
/// own). Snapshots and the in-flight load are as `kvroute`'s (one
/// collector: the other gateways' pending prefill and placements). An
/// upper bound on what sharing the index between gateways could give
/// (docs/fleet-state.md, "Several gateways: what the gap is"). At K = 1 it
/// is kvroute.
pub const ORACLE_SHARED_INDEX: &str = "kvroute-oracle-shared-index";

/// Not in [`ALL`]: kvroute whose gateways read no other gateway: each
/// gateway's collector reads only the engines, so no snapshot carries the
/// other gateways' pending prefill (`peerPendingTokens`), their key
/// placements (`placed`) or last blocks (`lastBlocks`). The sidecar layout without
/// `--peer-gateway-service` (docs/fleet-state.md, "Sidecars that read each
/// other"). At K = 1 it is kvroute.
pub const ALONE: &str = "kvroute-alone";

/// Not in [`ALL`]: `kvroute` whose snapshots carry each replica's true
/// prefill rate (`prefillTokensPerS`, from the engine model's
/// configuration, [`Setup::prefill_rates`]). No engine exports it and
/// kvroute-collector does not fill it yet: an upper bound on what knowing
/// each GPU's speed is worth in a fleet of two generations, against which
/// `kvroute`'s rates learned from answers (`fleet.learnPrefillRates`) are
/// measured.
pub const KNOWN_RATES: &str = "kvroute-known-rates";

/// The key of a router's report name (`round-robin (modelled)` ->
/// `round-robin`).
pub fn canonical(name: &str) -> &str {
    name.trim_end_matches(" (modelled)")
}

/// How to build a router.
#[derive(Debug, Clone)]
pub struct Setup {
    pub engines: usize,
    /// Gateway instances (each with its own state).
    pub gateways: usize,
    /// Envoy worker threads per gateway: kvroute's workers share the
    /// gateway's shared data (load table, prefix index, snapshot) but each
    /// keeps its own caches of them; round robin keeps a position per
    /// worker. A request lands on a worker drawn at random (seeded).
    pub workers: usize,
    pub seed: u64,
    /// kvroute's plugin JSON without `hosts`.
    pub kvroute_config: serde_json::Value,
    /// kvroute's collector interval, modelled seconds.
    pub collector_s: f64,
    /// kvroute's gateway clock runs this many times slower than modelled
    /// time (1: production).
    pub gateway_clock_scale: f64,
    /// When kvroute releases the prompt part of the charge: with the first
    /// token (the first response body byte, as the filter does), or at
    /// admission (as the filter did while it released at the response
    /// headers, which vLLM and kvroute-sim send on admission).
    pub headers_at_submit: bool,
    /// Each engine's prefill rate, prompt tokens per second of full chunks
    /// ([`kvroute_sim::engine::EngineConfig::prefill_tokens_per_s`]); empty:
    /// the default engine's. Only [`KNOWN_RATES`] hands them to kvroute.
    pub prefill_rates: Vec<f64>,
}

impl Setup {
    /// One worker per gateway, kvroute's defaults, a collector every 250 ms.
    pub fn new(engines: usize, gateways: usize, seed: u64) -> Self {
        Self {
            engines,
            gateways,
            workers: 1,
            seed,
            kvroute_config: serde_json::json!({}),
            collector_s: 0.25,
            gateway_clock_scale: 1.0,
            headers_at_submit: false,
            prefill_rates: Vec::new(),
        }
    }
}

/// Builds router `name`.
pub fn build(name: &str, s: &Setup) -> Result<Box<dyn Router>, String> {
    let (engines, seed) = (s.engines, s.seed);
    let k = s.gateways.max(1);
    let w = s.workers.max(1);
    Ok(match name {
        "round-robin" => Box::new(RoundRobin {
            next: (0..k * w)
                .map(|g| (xxh64(&g.to_le_bytes(), seed) % engines as u64) as usize)
                .collect(),
            n: engines,
            workers: w,
            rng: Rng::new(seed ^ 0x7272),
        }),
        "least-request" => Box::new(LeastRequest {
            active: Active::new(k, engines),
            rng: Rng::new(seed ^ 0x6c72),
        }),
        "ring-hash" | "consistent-hash" => Box::new(RingHash::new(
            engines,
            k,
            seed,
            (name == "ring-hash").then_some(1.25),
        )),
        "sglang-cache-aware" => Box::new(Sglang::new(engines, k)),
        "llm-d" => Box::new(Llmd::new(engines, k, seed)),
        "dynamo" => Box::new(Dynamo::new(engines, k, seed)),
        "kvroute" => Box::new(Kvroute::new(s, Layout::Collector)?),
        ALONE => Box::new(Kvroute::new(s, Layout::Alone)?),
        KNOWN_RATES => Box::new(Kvroute::new(s, Layout::KnownRates)?),
        ORACLE_SHARED_LOAD => Box::new(Kvroute::new(s, Layout::Oracle)?),
        ORACLE_SHARED_INDEX => Box::new(Kvroute::new(s, Layout::OracleIndex)?),
        ORACLE_FIRST_TOKEN => Box::new(OracleFirstToken {
            free_at: Vec::new(),
        }),
        other => {
            let known = ALL.join(", ");
            return Err(format!(
                "unknown router {other:?}; known: {known}, {ALONE} (gateways that read no \
                 other gateway), {KNOWN_RATES} (each replica's true prefill rate in the \
                 snapshot, an upper bound), {ORACLE_SHARED_LOAD} and {ORACLE_SHARED_INDEX} (upper \
                 bounds, not routers), and \
                 {ORACLE_FIRST_TOKEN} (perfect knowledge of the present, not a router)"
            ));
        }
    })
}

// ------------------------------------------------------------------ kvroute

/// A gateway's clock in Unix ms: a fixed origin plus modelled time (0 would
/// mean "clock unknown" to kvroute-core).
const ORIGIN_MS: u64 = 1_700_000_000_000;

/// One Envoy worker: its caches of the gateway's shared data, and the
/// requests it holds (admission control).
struct KvWorker {
    index: IndexCache,
    fleet: FleetCache,
    priors: PriorCache,
    held: admit::Queue<(Facts, Objective)>,
}

impl KvWorker {
    fn new(cfg: &Config) -> Self {
        Self {
            index: IndexCache::default(),
            fleet: FleetCache::default(),
            priors: PriorCache::default(),
            held: admit::Queue::new(&cfg.admission),
        }
    }
}

/// One gateway instance: its shared data and its workers.
struct KvGateway {
    store: GatewayStore,
    metrics: Tally,
    workers: Vec<KvWorker>,
    next_stream: u32,
}

/// A gateway's shared data. With `load` set, the in-flight load table
/// (`cfg.load_key`) is one store for every gateway: the oracle mode of
/// [`ORACLE_SHARED_LOAD`]. With `index` set, so are the prefix index's
/// slots (the keys under its prefix): [`ORACLE_SHARED_INDEX`]. Everything
/// else stays per gateway.
struct GatewayStore {
    own: MemorySharedData,
    load: Option<(Rc<MemorySharedData>, String)>,
    index: Option<(Rc<MemorySharedData>, String)>,
}

impl GatewayStore {
    fn pick(&self, key: &str) -> &MemorySharedData {
        match (&self.load, &self.index) {
            (Some((shared, k)), _) if k == key => shared,
            (_, Some((shared, prefix))) if key.starts_with(prefix.as_str()) => shared,
            _ => &self.own,
        }
    }
}

impl SharedData for GatewayStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        self.pick(key).get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.pick(key).set(key, value, cas)
    }
}

/// What a kvroute gateway's snapshots carry of the other gateways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// `kvroute`: one collector for all K gateways (or sidecars that read
    /// each other, `--collectors per-gateway`), as the real collector does
    /// when it reads several gateways: at each push it reads every
    /// gateway's load report (the ingest listener's answer, with
    /// `?placed=1`) and gives each gateway the sum of the *others'*
    /// pending prefill per replica (`peerPendingTokens`, which the filter
    /// drains at `prefillTokensPerS` from the host's scrape time) and of
    /// their recent arrivals (`peerArrivalsPerS`), their recent key
    /// placements (`placed`) and their requests' last blocks
    /// (`lastBlocks`, with `?lastBlocks=1`) (kvroute-collector, push.rs).
    /// At one gateway, the collector knows it is the only one (it was given
    /// the gateways, by a service or a list) and says no other has load:
    /// `peerPendingTokens` 0 on every replica.
    Collector,
    /// [`ALONE`]: neither.
    Alone,
    /// [`ORACLE_SHARED_LOAD`]: one in-flight load table for every gateway
    /// (no `peerPendingTokens`, the table has it exactly); placements as
    /// `Collector`.
    Oracle,
    /// [`ORACLE_SHARED_INDEX`]: one prefix index for every gateway;
    /// snapshots as `Collector`.
    OracleIndex,
    /// [`KNOWN_RATES`]: snapshots as `Collector`, with each replica's
    /// prefill rate.
    KnownRates,
}

/// kvroute-core's request path, per gateway, as the filter runs it.
pub struct Kvroute {
    cfg: Config,
    gateways: Vec<KvGateway>,
    addresses: Vec<String>,
    by_address: HashMap<String, usize>,
    collector_s: f64,
    clock_scale: f64,
    seq: u64,
    decision_ns: Vec<u64>,
    overrides: String,
    /// The model of the requests (the prior is learned per model).
    model: String,
    rng: Rng,
    headers_at_submit: bool,
    /// Admission counts, `<counter>{objective=<name>}`.
    admission: BTreeMap<String, u64>,
    /// What each gateway's snapshot carries of the other gateways.
    layout: Layout,
    /// The fleet's addresses, for the gateways' load and placement
    /// reports.
    fleet: HostSet,
    /// Each replica's prefill rate, in its snapshot entries
    /// ([`KNOWN_RATES`]); empty: none given.
    known_rates: Vec<f64>,
}

impl Kvroute {
    fn new(s: &Setup, layout: Layout) -> Result<Self, String> {
        let (engines, gateways, config) = (s.engines, s.gateways.max(1), &s.kvroute_config);
        let (collector_s, clock_scale) = (s.collector_s, s.gateway_clock_scale);
        let addresses: Vec<String> = (0..engines).map(super::engine_address).collect();
        let mut json = match config {
            serde_json::Value::Object(m) => m.clone(),
            serde_json::Value::Null => serde_json::Map::new(),
            _ => return Err("kvroute config: must be a JSON object".to_owned()),
        };
        let overrides = serde_json::Value::Object(json.clone()).to_string();
        json.insert("hosts".to_owned(), serde_json::json!(addresses));
        let bytes = serde_json::to_vec(&json).map_err(|e| e.to_string())?;
        let cfg = Config::from_json(&bytes).map_err(|e| format!("kvroute config: {e}"))?;
        let shared_load = Rc::new(MemorySharedData::default());
        let shared_index = Rc::new(MemorySharedData::default());
        let fleet = HostSet::new(addresses.iter().cloned());
        Ok(Self {
            gateways: (0..gateways)
                .map(|_| KvGateway {
                    store: GatewayStore {
                        own: MemorySharedData::default(),
                        load: (layout == Layout::Oracle)
                            .then(|| (Rc::clone(&shared_load), cfg.load_key.clone())),
                        index: (layout == Layout::OracleIndex).then(|| {
                            (Rc::clone(&shared_index), cfg.fleet.index_key_prefix.clone())
                        }),
                    },
                    metrics: Tally::default(),
                    workers: (0..s.workers.max(1)).map(|_| KvWorker::new(&cfg)).collect(),
                    next_stream: 0,
                })
                .collect(),
            by_address: addresses
                .iter()
                .enumerate()
                .map(|(i, a)| (a.clone(), i))
                .collect(),
            addresses,
            collector_s,
            clock_scale: if clock_scale > 0.0 { clock_scale } else { 1.0 },
            seq: 0,
            decision_ns: Vec::new(),
            overrides,
            model: String::new(),
            rng: Rng::new(s.seed ^ 0x776b),
            headers_at_submit: s.headers_at_submit,
            admission: BTreeMap::new(),
            layout,
            fleet,
            known_rates: if layout == Layout::KnownRates {
                if s.prefill_rates.is_empty() {
                    vec![EngineConfig::default().prefill_tokens_per_s(); engines]
                } else {
                    s.prefill_rates.clone()
                }
            } else {
                Vec::new()
            },
            cfg,
        })
    }

    fn count_admission(&mut self, what: &str, objective: Objective) {
        let name = objective.name(&self.cfg.admission);
        *self
            .admission
            .entry(format!(
                "kvroute_admission_{what}_total{{objective={name}}}"
            ))
            .or_insert(0) += 1;
    }

    fn now_ms(&self, t: f64) -> u64 {
        ORIGIN_MS + (t.max(0.0) * 1000.0 / self.clock_scale) as u64
    }

    fn release(&mut self, gw: usize, charge: Charge) {
        if let Some(g) = self.gateways.get(gw) {
            decide::release(&self.cfg, &g.store, &g.metrics, charge);
        }
    }
}

impl Router for Kvroute {
    fn name(&self) -> String {
        match self.layout {
            Layout::Collector => "kvroute",
            Layout::Alone => ALONE,
            Layout::KnownRates => KNOWN_RATES,
            Layout::Oracle => ORACLE_SHARED_LOAD,
            Layout::OracleIndex => ORACLE_SHARED_INDEX,
        }
        .to_owned()
    }

    fn setup(&self) -> String {
        format!(
            "kvroute-core's request path per gateway, {} worker(s) each (plugin config {}; hosts = the fleet), \
             fleet snapshots from a modelled collector every {} ms",
            self.gateways.first().map_or(1, |g| g.workers.len()),
            self.overrides,
            (self.collector_s * 1000.0).round()
        )
    }

    fn scrape_interval_s(&self) -> Option<f64> {
        Some(self.collector_s)
    }

    /// A scrape's answers, the snapshot build and the push over loopback:
    /// a few ms on a real host.
    fn scrape_delay_s(&self) -> f64 {
        0.005
    }

    fn on_readings(&mut self, gw: usize, readings: &[Reading], taken_s: f64, now_s: f64) {
        self.seq += 1;
        let taken_ms = self.now_ms(taken_s);
        // The other gateways' pending prefill and arrivals per replica, as
        // the real collector gets them: each gateway's load report (the ingest
        // listener's answer), read at the push, summed by address. One
        // collector for every gateway knows them all (a gateway service or a
        // list), so at one gateway it says that no other has load (0 on
        // every replica, push.rs `LoadBoard::others`); sidecars that do not
        // read each other say nothing.
        let others = self.gateways.len() > 1;
        let peer_load = matches!(
            self.layout,
            Layout::Collector | Layout::OracleIndex | Layout::KnownRates
        );
        let peer_placements = others && self.layout != Layout::Alone;
        let hosts = &self.fleet;
        let now_ms = self.now_ms(now_s);
        let window = self.cfg.fleet.arrival_window_ms;
        // Per replica: (pending prefill, arrivals per second).
        let peers: Option<Vec<(u64, f64)>> = peer_load.then(|| {
            let mut sum = vec![(0u64, 0.0f64); self.addresses.len()];
            for (i, g) in self.gateways.iter().enumerate() {
                if i == gw {
                    continue;
                }
                let table = load::read(&g.store, &self.cfg.load_key);
                let report = LoadReport::of(&table, &[hosts], now_ms, window);
                for h in &report.hosts {
                    if let Some(slot) = self
                        .by_address
                        .get(&h.address)
                        .and_then(|&k| sum.get_mut(k))
                    {
                        slot.0 = slot.0.saturating_add(h.prefill_pending_tokens);
                        slot.1 += h.arrivals_per_s.unwrap_or(0.0);
                    }
                }
            }
            sum
        });
        // The other gateways' recent placements, as a collector
        // that pushes to several gateways reads them in their load reports
        // at each push.
        let placed = placed::merge(
            self.gateways
                .iter()
                .enumerate()
                .filter(|&(i, _)| peer_placements && i != gw)
                .flat_map(|(_, g)| {
                    placed::report(&g.store, &self.cfg.fleet.placed_key, &[&self.fleet], now_ms)
                }),
        );
        // And their requests' last blocks, read the same way.
        let last_blocks = placed::merge_last(
            self.gateways
                .iter()
                .enumerate()
                .filter(|&(i, _)| peer_placements && i != gw && self.cfg.fleet.share_last_blocks)
                .flat_map(|(_, g)| {
                    let key = &self.cfg.fleet.last_blocks_key;
                    placed::report_last(&g.store, key, &[&self.fleet], now_ms)
                }),
        );
        let snap = Snapshot {
            placed,
            last_blocks,
            version: SNAPSHOT_VERSION,
            seq: self.seq,
            collector: "sim".to_owned(),
            taken_at_ms: taken_ms,
            hosts: readings
                .iter()
                .zip(&self.addresses)
                .enumerate()
                .map(|(k, (r, address))| HostState {
                    address: address.clone(),
                    ready: true,
                    draining: false,
                    models: Vec::new(),
                    kv_utilization: r.kv_usage,
                    waiting: u32::try_from(r.waiting).unwrap_or(u32::MAX),
                    running: u32::try_from(r.running).unwrap_or(u32::MAX),
                    kv_capacity_tokens: Some((r.kv_blocks * BLOCK_TOKENS) as u64),
                    block_size: Some(BLOCK_TOKENS as u32),
                    scraped_at_ms: taken_ms,
                    engine: Some("vllm".to_owned()),
                    peer_pending_tokens: peers.as_ref().and_then(|p| p.get(k)).map(|p| p.0),
                    peer_arrivals_per_s: peers.as_ref().and_then(|p| p.get(k)).map(|p| p.1),
                    prefill_tokens_per_s: self.known_rates.get(k).copied(),
                })
                .collect(),
        };
        if let Some(g) = self.gateways.get_mut(gw) {
            let _ = ingest::store(&self.cfg, &g.store, &snap.to_json(), now_ms);
            // Each worker's tick (every 100 ms, src/lib.rs `TICK`) decodes
            // a new snapshot off the request path, and so writes the other
            // gateways' placements into the prefix index even when no
            // request comes. Modelled at the push: a request would refresh
            // anyway, and a placement stays in the pushed snapshots for
            // `placed::REPORT_MS`.
            for w in &mut g.workers {
                let _ = w.fleet.refresh(&self.cfg, &g.store);
            }
        }
    }

    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        now_s: f64,
        _engines: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let now_ms = self.now_ms(now_s);
        let cfg = &self.cfg;
        let Some(g) = self.gateways.get_mut(gw) else {
            return Err(format!("no gateway {gw}"));
        };
        g.next_stream = g.next_stream.wrapping_add(1);
        let stream = g.next_stream;
        let pick = self.rng.below(g.workers.len() as u64) as usize;
        let Some(w) = g.workers.get_mut(pick) else {
            return Err(format!("no worker {pick}"));
        };
        let started = Instant::now();
        let mut facts = decide::analyze(cfg, Endpoint::ChatCompletions, req.session, req.body);
        if let Ok(f) = facts.as_mut() {
            let prior = w
                .priors
                .get(&g.store, &cfg.shared_data_prefix, &f.model, now_ms);
            decide::apply_prior_value(f, prior);
        }
        let (view, _) = w.fleet.refresh_at(cfg, &g.store, now_ms);
        let d = decide::route(
            cfg,
            &g.store,
            &g.metrics,
            &mut w.index,
            facts.as_ref().map_err(|u| *u),
            view.as_deref(),
            now_ms,
            u64::from(stream),
        );
        let expectation = facts
            .as_ref()
            .ok()
            .and_then(|f| Expectation::of(f, &d, now_ms));
        self.decision_ns
            .push(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX));
        let Some(primary) = d.targets.first() else {
            return Err(format!(
                "503: kvroute: no ready replica serves model {:?}",
                req.model
            ));
        };
        let engine = *self
            .by_address
            .get(primary)
            .ok_or_else(|| format!("kvroute named {primary}, not a replica"))?;
        let probe = Probe::of(&d, now_ms).filter(|_| cfg.fleet.learn_prefill_rates);
        let mut charge = d.charge;
        if let (true, Some(c)) = (self.headers_at_submit, charge) {
            self.release(gw, Charge { memory: 0, ..c });
            charge = Some(Charge { prefill: 0, ..c });
        }
        Ok(Ticket {
            engine,
            charge,
            stream,
            worker: pick,
            expectation,
            prompt_tokens: req.prompt_tokens as u64,
            blocks: Vec::new(),
            reason: Some(d.reason.as_str()),
            key: d.key,
            probe: Cell::new(probe),
        })
    }

    /// The filter's admission step (src/lib.rs `Stream::admit`): the
    /// worker the request lands on judges it on its own snapshot view and
    /// the gateway's load, and holds it in its own queue.
    fn admit(&mut self, gw: usize, req: &Request<'_>, handle: u64, now_s: f64) -> Admission {
        if !self.cfg.admission.enabled {
            return Admission::Go;
        }
        let now_ms = self.now_ms(now_s);
        let cfg = &self.cfg;
        let Some(g) = self.gateways.get_mut(gw) else {
            return Admission::Go;
        };
        let pick = self.rng.below(g.workers.len() as u64) as usize;
        let Some(w) = g.workers.get_mut(pick) else {
            return Admission::Go;
        };
        let Ok(mut facts) = decide::analyze(cfg, Endpoint::ChatCompletions, req.session, req.body)
        else {
            // Unparsed requests are not subject to admission.
            return Admission::Go;
        };
        let prior = w
            .priors
            .get(&g.store, &cfg.shared_data_prefix, &facts.model, now_ms);
        decide::apply_prior_value(&mut facts, prior);
        let (view, _) = w.fleet.refresh_at(cfg, &g.store, now_ms);
        let table = load::read(&g.store, &cfg.load_key);
        let room = decide::headroom(cfg, &facts, view.as_deref(), &table, now_ms);
        let objective = Objective::of(&cfg.admission, req.objective);
        let key = facts.affinity.key();
        let verdict = admit::arrive(&cfg.admission, objective, room, &w.held, |(f, _)| {
            f.model == facts.model
        });
        let pushed = match verdict {
            Verdict::Admit => Ok(None),
            Verdict::Refuse(why) => Err(why),
            Verdict::Hold => w
                .held
                .push(handle, objective.priority, key, now_ms, (facts, objective))
                .map(Some)
                .map_err(|(why, _)| why),
        };
        match pushed {
            Ok(None) => {
                self.count_admission("admitted", objective);
                Admission::Go
            }
            Ok(Some(displaced)) => {
                self.count_admission("queued", objective);
                let mut answered = Vec::new();
                if let Some(d) = displaced {
                    let o = d.item.1;
                    self.count_admission("shed", o);
                    answered.push((d.handle, Refusal::Displaced.status(o) as u16));
                }
                Admission::Hold {
                    displaced: answered,
                }
            }
            Err(why) => {
                self.count_admission("shed", objective);
                Admission::Refuse(why.status(objective) as u16)
            }
        }
    }

    fn tick(&mut self, gw: usize, now_s: f64) -> Vec<(u64, Option<u16>)> {
        let now_ms = self.now_ms(now_s);
        let cfg = &self.cfg;
        let Some(g) = self.gateways.get_mut(gw) else {
            return Vec::new();
        };
        let table = load::read(&g.store, &cfg.load_key);
        let mut out = Vec::new();
        let mut shed = Vec::new();
        let mut admitted = None;
        for w in &mut g.workers {
            for h in w.held.expire(now_ms) {
                shed.push(h.item.1);
                out.push((h.handle, Some(Refusal::Timeout.status(h.item.1) as u16)));
            }
            if admitted.is_some() {
                continue;
            }
            let (view, _) = w.fleet.refresh_at(cfg, &g.store, now_ms);
            let room = w
                .held
                .front()
                .is_some_and(|h| decide::headroom(cfg, &h.item.0, view.as_deref(), &table, now_ms));
            if room {
                if let Some(h) = w.held.pop() {
                    admitted = Some(h.item.1);
                    out.push((h.handle, None));
                }
            }
        }
        for o in shed {
            self.count_admission("shed", o);
        }
        if let Some(o) = admitted {
            self.count_admission("admitted", o);
        }
        out
    }

    fn holds(&self, gw: usize) -> usize {
        self.gateways
            .get(gw)
            .map_or(0, |g| g.workers.iter().map(|w| w.held.len()).sum())
    }

    fn first_token(&mut self, gw: usize, t: &Ticket, now_s: f64) {
        if let Some(c) = t.charge {
            self.release(gw, Charge { memory: 0, ..c });
        }
        if let Some(mut p) = t.probe.get() {
            p.first_byte(self.now_ms(now_s));
            t.probe.set(Some(p));
        }
    }

    fn finished(&mut self, gw: usize, t: &Ticket, u: &Summary, now_s: f64) {
        if let Some(c) = t.charge {
            // The prompt part went at the first byte (if there was one).
            let prefill = if u.completion_tokens > 0 {
                0
            } else {
                c.prefill
            };
            self.release(gw, Charge { prefill, ..c });
        }
        if u.completion_tokens > 0 && usage::observed(t.stream) {
            if let Some(g) = self.gateways.get(gw) {
                usage::observe(
                    &g.store,
                    &self.cfg.shared_data_prefix,
                    &self.model,
                    u.completion_tokens as u64,
                );
            }
        }
        // The filter reads the answer's usage; a failed request has none.
        let probe = t.probe.get();
        let read = answers::read_answer(t.stream, t.expectation.as_ref(), probe.as_ref());
        let learned = Learned {
            output_tokens: Some(u.completion_tokens as u64),
            cached_tokens: Some(u.cached_tokens as u64),
            prompt_tokens: Some(u.prompt_tokens as u64),
        };
        if let (true, true, true, Some(p)) = (
            read,
            u.completion_tokens > 0,
            self.cfg.fleet.learn_prefill_rates,
            probe,
        ) {
            if let Some(g) = self.gateways.get(gw) {
                let key = &self.cfg.fleet.rates_key;
                rates::learn(&g.store, &g.metrics, key, &p, &learned);
            }
        }
        if let (true, true, Some(exp)) = (read, u.completion_tokens > 0, &t.expectation) {
            let now_ms = self.now_ms(now_s);
            if let Some(g) = self.gateways.get_mut(gw) {
                if let Some(w) = g.workers.get_mut(t.worker) {
                    answers::learn(
                        &self.cfg,
                        &g.store,
                        &g.metrics,
                        &mut w.index,
                        exp,
                        &learned,
                        now_ms,
                    );
                }
            }
        }
    }

    fn decision_ns(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.decision_ns)
    }

    fn counters(&mut self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for g in &self.gateways {
            for (c, n) in g.metrics.drain() {
                *out.entry(c.name().to_owned()).or_insert(0) += n;
            }
            // The per-replica series, summed over the replicas.
            for (_, c, n) in g.metrics.drain_replicas() {
                *out.entry(c.name().to_owned()).or_insert(0) += n;
            }
        }
        out.extend(std::mem::take(&mut self.admission));
        out
    }
}

// ------------------------------------------------------------------ helpers

/// Requests a gateway has in flight per engine (its own count, as Envoy's
/// `rq_active` and the peers' routers keep it).
struct Active {
    counts: Vec<Vec<u32>>,
}

impl Active {
    fn new(gateways: usize, engines: usize) -> Self {
        Self {
            counts: vec![vec![0; engines]; gateways],
        }
    }

    fn of(&self, gw: usize) -> &[u32] {
        self.counts.get(gw).map_or(&[], Vec::as_slice)
    }

    fn add(&mut self, gw: usize, engine: usize) {
        if let Some(c) = self.counts.get_mut(gw).and_then(|v| v.get_mut(engine)) {
            *c += 1;
        }
    }

    fn done(&mut self, gw: usize, engine: usize) {
        if let Some(c) = self.counts.get_mut(gw).and_then(|v| v.get_mut(engine)) {
            *c = c.saturating_sub(1);
        }
    }
}

/// The index of the smallest value, first on ties.
fn argmin<T: PartialOrd + Copy>(values: impl IntoIterator<Item = T>) -> Option<usize> {
    let mut best: Option<(usize, T)> = None;
    for (i, v) in values.into_iter().enumerate() {
        if best.is_none_or(|(_, b)| v < b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

fn ticket(engine: usize, req: &Request<'_>) -> Ticket {
    Ticket {
        engine,
        prompt_tokens: req.prompt_tokens as u64,
        ..Ticket::default()
    }
}

// ------------------------------------------------------------------ round robin

struct RoundRobin {
    /// A position per (gateway, worker).
    next: Vec<usize>,
    n: usize,
    workers: usize,
    rng: Rng,
}

impl Router for RoundRobin {
    fn name(&self) -> String {
        "round-robin (modelled)".to_owned()
    }
    fn setup(&self) -> String {
        format!(
            "Envoy ROUND_ROBIN, modelled: each of a gateway's {} worker(s) cycles over the replicas from a seeded start",
            self.workers
        )
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        _: f64,
        _: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let worker = self.rng.below(self.workers as u64) as usize;
        let slot = self
            .next
            .get_mut(gw * self.workers + worker)
            .ok_or("no gateway")?;
        let engine = *slot % self.n.max(1);
        *slot = slot.wrapping_add(1);
        Ok(ticket(engine, req))
    }
    fn finished(&mut self, _: usize, _: &Ticket, _: &Summary, _: f64) {}
}

// ------------------------------------------------------------------ least request

struct LeastRequest {
    active: Active,
    rng: Rng,
}

impl Router for LeastRequest {
    fn name(&self) -> String {
        "least-request (modelled)".to_owned()
    }
    fn setup(&self) -> String {
        "Envoy LEAST_REQUEST, modelled: of 2 random replicas, the one with fewer of this gateway's active requests".to_owned()
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        _: f64,
        engines: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let n = engines.len() as u64;
        let a = self.rng.below(n) as usize;
        let mut b = self.rng.below(n.saturating_sub(1).max(1)) as usize;
        if n > 1 && b >= a {
            b += 1;
        }
        let act = self.active.of(gw);
        let (ca, cb) = (
            act.get(a).copied().unwrap_or(0),
            act.get(b).copied().unwrap_or(0),
        );
        let engine = if cb < ca { b } else { a };
        self.active.add(gw, engine);
        Ok(ticket(engine, req))
    }
    fn finished(&mut self, gw: usize, t: &Ticket, _: &Summary, _: f64) {
        self.active.done(gw, t.engine);
    }
}

// ------------------------------------------------------------------ ring hash

struct RingHash {
    /// (point hash, engine), sorted.
    ring: Vec<(u64, usize)>,
    n: usize,
    factor: Option<f64>,
    active: Active,
    rng: Rng,
}

impl RingHash {
    fn new(n: usize, gateways: usize, seed: u64, factor: Option<f64>) -> Self {
        // Envoy gives each host ceil(min_ring_size / n) points at equal
        // weights, keyed "<address>_<i>".
        let per = 1024usize.div_ceil(n.max(1));
        let mut ring: Vec<(u64, usize)> = (0..n)
            .flat_map(|e| {
                let addr = super::engine_address(e);
                (0..per).map(move |i| (xxh64(format!("{addr}_{i}").as_bytes(), 0), e))
            })
            .collect();
        ring.sort_unstable();
        Self {
            ring,
            n,
            factor,
            active: Active::new(gateways, n),
            rng: Rng::new(seed ^ 0x7269_6e67),
        }
    }
}

impl Router for RingHash {
    fn name(&self) -> String {
        match self.factor {
            Some(_) => "ring-hash (modelled)".to_owned(),
            None => "consistent-hash (modelled)".to_owned(),
        }
    }
    fn setup(&self) -> String {
        match self.factor {
            Some(f) => format!(
                "Envoy RING_HASH on the session header, hash_balance_factor {:.0}, modelled (bounded by each gateway's active requests)",
                f * 100.0
            ),
            None => "consistent hashing on the session header (Envoy RING_HASH without a bound), modelled".to_owned(),
        }
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        _: f64,
        _: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let h = match req.session {
            Some(s) => xxh64(s.as_bytes(), 0),
            None => self.rng.next_u64(),
        };
        let at = self.ring.partition_point(|&(p, _)| p < h);
        let home = self
            .ring
            .get(at)
            .or_else(|| self.ring.first())
            .map_or(0, |&(_, e)| e);
        let act = self.active.of(gw);
        let engine = match self.factor {
            None => home,
            Some(f) => {
                let total: u64 = act.iter().map(|&c| u64::from(c)).sum();
                let slots = (((total + 1) as f64 * f) / self.n.max(1) as f64)
                    .ceil()
                    .max(1.0);
                let over = |e: usize| f64::from(act.get(e).copied().unwrap_or(0)) / slots;
                if over(home) <= 1.0 {
                    home
                } else {
                    // A permutation seeded by the hash, then the least
                    // overloaded host.
                    let mut order: Vec<usize> = (0..self.n).collect();
                    let mut r = Rng::new(h);
                    for i in (1..order.len()).rev() {
                        let j = r.below(i as u64 + 1) as usize;
                        order.swap(i, j);
                    }
                    order
                        .iter()
                        .copied()
                        .find(|&e| over(e) <= 1.0)
                        .or_else(|| argmin((0..self.n).map(over)))
                        .unwrap_or(home)
                }
            }
        };
        self.active.add(gw, engine);
        Ok(ticket(engine, req))
    }
    fn finished(&mut self, gw: usize, t: &Ticket, _: &Summary, _: f64) {
        self.active.done(gw, t.engine);
    }
}

// ------------------------------------------------------------------ SGLang

/// Characters per chunk of the modelled tree.
const SGLANG_CHUNK: usize = 64;
const SGLANG_CACHE_THRESHOLD: f64 = 0.3;
const SGLANG_BALANCE_ABS: u32 = 64;
const SGLANG_BALANCE_REL: f64 = 1.5;
const SGLANG_MAX_TREE_CHARS: usize = 1 << 26;
const SGLANG_EVICTION_S: f64 = 120.0;

/// One gateway's approximate tree: chunk hash -> (worker -> last access),
/// and per worker its chunks by last access.
#[derive(Default)]
struct Tree {
    nodes: HashMap<u64, Vec<(usize, u64)>>,
    lru: Vec<BTreeMap<u64, u64>>,
    tick: u64,
    next_eviction_s: f64,
}

struct Sglang {
    trees: Vec<Tree>,
    active: Active,
    n: usize,
}

impl Sglang {
    fn new(n: usize, gateways: usize) -> Self {
        Self {
            trees: (0..gateways)
                .map(|_| Tree {
                    lru: vec![BTreeMap::new(); n],
                    next_eviction_s: SGLANG_EVICTION_S,
                    ..Tree::default()
                })
                .collect(),
            active: Active::new(gateways, n),
            n,
        }
    }
}

/// Chained hashes of the 64-character chunks of `text`.
fn chunks(text: &[u8], chunk: usize, seed: u64, max: usize) -> Vec<u64> {
    let mut prev = seed;
    text.chunks(chunk)
        .take(max)
        .map(|c| {
            prev = xxh64(c, prev);
            prev
        })
        .collect()
}

impl Router for Sglang {
    fn name(&self) -> String {
        "sglang-cache-aware (modelled)".to_owned()
    }
    fn setup(&self) -> String {
        "SGLang router cache_aware at its CLI defaults (cache_threshold 0.3, balance 64 abs / 1.5 rel), modelled: per-gateway tree of 64-character chunks, load = the gateway's in-flight requests".to_owned()
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        now_s: f64,
        _: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let text: Vec<u8> = req
            .messages
            .iter()
            .map(|(_, c)| c.as_str())
            .collect::<Vec<_>>()
            .join(" ")
            .into_bytes();
        let act = self.active.of(gw).to_vec();
        let tree = self.trees.get_mut(gw).ok_or("no gateway")?;
        if now_s >= tree.next_eviction_s {
            tree.next_eviction_s = now_s + SGLANG_EVICTION_S;
            let budget = SGLANG_MAX_TREE_CHARS / SGLANG_CHUNK;
            for (w, lru) in tree.lru.iter_mut().enumerate() {
                while lru.len() > budget {
                    let Some((_, h)) = lru.pop_first() else { break };
                    if let Some(v) = tree.nodes.get_mut(&h) {
                        v.retain(|&(x, _)| x != w);
                    }
                }
            }
        }
        let hashes = chunks(
            &text,
            SGLANG_CHUNK,
            xxh64(req.model.as_bytes(), 0),
            usize::MAX,
        );
        let (min, max) = (
            act.iter().copied().min().unwrap_or(0),
            act.iter().copied().max().unwrap_or(0),
        );
        let imbalanced =
            max - min > SGLANG_BALANCE_ABS && f64::from(max) > f64::from(min) * SGLANG_BALANCE_REL;
        let least = argmin(act.iter().copied()).unwrap_or(0);
        let engine = if imbalanced {
            least
        } else {
            let mut matched = 0usize;
            let mut owner = None;
            for h in &hashes {
                match tree.nodes.get(h).filter(|v| !v.is_empty()) {
                    Some(v) => {
                        matched += 1;
                        owner = v.iter().max_by_key(|&&(_, at)| at).map(|&(w, _)| w);
                    }
                    None => break,
                }
            }
            let chars = (matched * SGLANG_CHUNK).min(text.len());
            let rate = if text.is_empty() {
                0.0
            } else {
                chars as f64 / text.len() as f64
            };
            match owner {
                Some(w) if rate > SGLANG_CACHE_THRESHOLD => w,
                _ => least,
            }
        };
        tree.tick += 1;
        let tick = tree.tick;
        for &h in &hashes {
            let v = tree.nodes.entry(h).or_default();
            match v.iter_mut().find(|(w, _)| *w == engine) {
                Some(slot) => {
                    if let Some(lru) = tree.lru.get_mut(engine) {
                        lru.remove(&slot.1);
                    }
                    slot.1 = tick;
                }
                None => v.push((engine, tick)),
            }
            if let Some(lru) = tree.lru.get_mut(engine) {
                lru.insert(tick, h);
            }
            tree.tick += 1;
        }
        let _ = self.n;
        self.active.add(gw, engine);
        Ok(ticket(engine, req))
    }
    fn finished(&mut self, gw: usize, t: &Ticket, _: &Summary, _: f64) {
        self.active.done(gw, t.engine);
    }
}

// ------------------------------------------------------------------ llm-d

const LLMD_BLOCK_BYTES: usize = 64;
const LLMD_MAX_BLOCKS: usize = 256;
const LLMD_WEIGHTS: (f64, f64, f64) = (3.0, 2.0, 2.0);
const LLMD_REFRESH_S: f64 = 0.05;

/// One server's LRU of block hashes.
#[derive(Default)]
struct HashLru {
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

struct LlmdGateway {
    /// hash -> servers holding it.
    holders: HashMap<u64, HashSet<usize>>,
    lrus: Vec<HashLru>,
    tick: u64,
    readings: Vec<Reading>,
}

struct Llmd {
    gateways: Vec<LlmdGateway>,
    rng: Rng,
    n: usize,
}

impl Llmd {
    fn new(n: usize, gateways: usize, seed: u64) -> Self {
        Self {
            gateways: (0..gateways)
                .map(|_| LlmdGateway {
                    holders: HashMap::new(),
                    lrus: (0..n).map(|_| HashLru::default()).collect(),
                    tick: 0,
                    readings: vec![Reading::default(); n],
                })
                .collect(),
            rng: Rng::new(seed ^ 0x6c6c_6d64),
            n,
        }
    }
}

impl Router for Llmd {
    fn name(&self) -> String {
        "llm-d (modelled)".to_owned()
    }
    fn setup(&self) -> String {
        "llm-d endpoint picker's default profile, modelled: prefix 3 + queue 2 + KV 2, approximate prefix index per gateway (64-byte blocks of the JSON messages, LRU of num_gpu_blocks per server), metrics every 50 ms".to_owned()
    }
    fn scrape_interval_s(&self) -> Option<f64> {
        Some(LLMD_REFRESH_S)
    }
    fn on_readings(&mut self, gw: usize, readings: &[Reading], _: f64, _: f64) {
        if let Some(g) = self.gateways.get_mut(gw) {
            g.readings = readings.to_vec();
        }
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        _: f64,
        _: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let messages: Vec<serde_json::Value> = req
            .messages
            .iter()
            .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
            .collect();
        let json = serde_json::to_vec(&messages).unwrap_or_default();
        let hashes = chunks(
            &json,
            LLMD_BLOCK_BYTES,
            xxh64(req.model.as_bytes(), 0),
            LLMD_MAX_BLOCKS,
        );
        let g = self.gateways.get_mut(gw).ok_or("no gateway")?;
        let mut matched = vec![0usize; self.n];
        for h in &hashes {
            let Some(set) = g.holders.get(h).filter(|s| !s.is_empty()) else {
                break;
            };
            for &s in set {
                if let Some(m) = matched.get_mut(s) {
                    *m += 1;
                }
            }
        }
        let waiting: Vec<f64> = g.readings.iter().map(|r| r.waiting as f64).collect();
        let (qmin, qmax) = waiting
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &w| (a.min(w), b.max(w)));
        let total = hashes.len().max(1) as f64;
        let (wp, wq, wk) = LLMD_WEIGHTS;
        let scores: Vec<f64> = (0..self.n)
            .map(|e| {
                let q = waiting.get(e).copied().unwrap_or(0.0);
                let queue = if qmax > qmin {
                    (qmax - q) / (qmax - qmin)
                } else {
                    1.0
                };
                let kv = 1.0
                    - g.readings
                        .get(e)
                        .map_or(0.0, |r| r.kv_usage)
                        .clamp(0.0, 1.0);
                let prefix = matched.get(e).copied().unwrap_or(0) as f64 / total;
                wp * prefix.clamp(0.0, 1.0) + wq * queue + wk * kv
            })
            .collect();
        let best = scores.iter().copied().fold(f64::MIN, f64::max);
        let top: Vec<usize> = (0..self.n)
            .filter(|&e| scores.get(e).copied() == Some(best))
            .collect();
        let engine = top
            .get(self.rng.below(top.len() as u64) as usize)
            .copied()
            .unwrap_or(0);
        // PreRequest: the request's blocks go to the chosen server's LRU
        // (auto-tuned to its engine's num_gpu_blocks).
        let cap = g.readings.get(engine).map_or(31_250, |r| {
            if r.kv_blocks > 0 {
                r.kv_blocks
            } else {
                31_250
            }
        });
        for &h in &hashes {
            g.tick += 1;
            let tick = g.tick;
            let Some(lru) = g.lrus.get_mut(engine) else {
                break;
            };
            if let Some(old) = lru.at.insert(h, tick) {
                lru.order.remove(&old);
            }
            lru.order.insert(tick, h);
            g.holders.entry(h).or_default().insert(engine);
            while lru.at.len() > cap {
                let Some((_, victim)) = lru.order.pop_first() else {
                    break;
                };
                lru.at.remove(&victim);
                if let Some(s) = g.holders.get_mut(&victim) {
                    s.remove(&engine);
                }
            }
        }
        Ok(ticket(engine, req))
    }
    fn finished(&mut self, _: usize, _: &Ticket, _: &Summary, _: f64) {}
}

// ------------------------------------------------------------------ Dynamo

const DYNAMO_OVERLAP_WEIGHT: f64 = 1.0;

/// One router instance's own tracking (`ActiveSequences`).
#[derive(Clone)]
struct DynamoGateway {
    /// Per engine: prompt block hash -> in-flight requests holding it.
    active_blocks: Vec<HashMap<u64, u32>>,
    /// Per engine: prompt tokens of requests still in prefill.
    prefill_tokens: Vec<u64>,
}

struct Dynamo {
    gateways: Vec<DynamoGateway>,
    rng: Rng,
}

impl Dynamo {
    fn new(n: usize, gateways: usize, seed: u64) -> Self {
        Self {
            gateways: vec![
                DynamoGateway {
                    active_blocks: vec![HashMap::new(); n],
                    prefill_tokens: vec![0; n],
                };
                gateways
            ],
            rng: Rng::new(seed ^ 0x6479_6e61),
        }
    }
}

impl Router for Dynamo {
    fn reads_engines(&self) -> bool {
        true
    }
    fn name(&self) -> String {
        "dynamo (modelled)".to_owned()
    }
    fn setup(&self) -> String {
        "Dynamo KV router, modelled: cost = 1.0 x prefill blocks + decode blocks, argmin; overlap from the engines' caches (KV events, no delay); each gateway tracks its own in-flight requests (router_replica_sync off, its default)".to_owned()
    }
    fn route(
        &mut self,
        gw: usize,
        req: &Request<'_>,
        _: f64,
        engines: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let blocks = block_hashes(req.model, req.prompt);
        let g = self.gateways.get_mut(gw).ok_or("no gateway")?;
        let bs = BLOCK_TOKENS as f64;
        let costs: Vec<f64> = engines
            .iter()
            .enumerate()
            .map(|(e, s)| {
                let overlap = s.cached_prefix_blocks(&blocks);
                let new_tokens = req.prompt_tokens.saturating_sub(overlap * BLOCK_TOKENS);
                let prefill = g.prefill_tokens.get(e).copied().unwrap_or(0) + new_tokens as u64;
                let active = g.active_blocks.get(e);
                let held = active.map_or(0, HashMap::len);
                let fresh = active.map_or(blocks.len(), |a| {
                    blocks.iter().filter(|h| !a.contains_key(h)).count()
                });
                DYNAMO_OVERLAP_WEIGHT * prefill as f64 / bs + (held + fresh) as f64
            })
            .collect();
        let best = costs.iter().copied().fold(f64::MAX, f64::min);
        let top: Vec<usize> = (0..costs.len())
            .filter(|&e| costs.get(e).copied() == Some(best))
            .collect();
        let engine = top
            .get(self.rng.below(top.len() as u64) as usize)
            .copied()
            .unwrap_or(0);
        if let Some(a) = g.active_blocks.get_mut(engine) {
            for &h in &blocks {
                *a.entry(h).or_insert(0) += 1;
            }
        }
        if let Some(p) = g.prefill_tokens.get_mut(engine) {
            *p += req.prompt_tokens as u64;
        }
        Ok(Ticket {
            engine,
            prompt_tokens: req.prompt_tokens as u64,
            blocks,
            ..Ticket::default()
        })
    }
    fn first_token(&mut self, gw: usize, t: &Ticket, _: f64) {
        if let Some(p) = self
            .gateways
            .get_mut(gw)
            .and_then(|g| g.prefill_tokens.get_mut(t.engine))
        {
            *p = p.saturating_sub(t.prompt_tokens);
        }
    }
    fn finished(&mut self, gw: usize, t: &Ticket, u: &Summary, _: f64) {
        if u.completion_tokens == 0 {
            self.first_token(gw, t, 0.0);
        }
        if let Some(a) = self
            .gateways
            .get_mut(gw)
            .and_then(|g| g.active_blocks.get_mut(t.engine))
        {
            for h in &t.blocks {
                if let Some(c) = a.get_mut(h) {
                    *c -= 1;
                    if *c == 0 {
                        a.remove(h);
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------ oracle

/// Not a router, and not in [`ALL`]: each request goes to the engine on
/// which its first token would come soonest, found by stepping a copy of
/// every engine forward with the request added. It sees what no gateway
/// can: the engines' true queues, batches and caches, and when each one's
/// step in flight ends. It does not see later arrivals, nor what its
/// choice costs the requests after it (it is greedy, request by request).
/// A reference for how much better estimates could give a per-request
/// placement (docs/fleet-state.md, "What perfect knowledge of the present
/// gives"). Gateways make no difference to it.
pub const ORACLE_FIRST_TOKEN: &str = "oracle-first-token";

/// Steps a copy is run at most; an engine whose copy has not given the
/// request its first token by then is not chosen (unless none has).
const ORACLE_MAX_STEPS: usize = 50_000;

struct OracleFirstToken {
    /// When each engine may start its next step (from the simulation).
    free_at: Vec<f64>,
}

/// Seconds from `now` to the first token of `req` on a copy of `engine`
/// that takes it now and starts its next step at `free_at` (None: refused,
/// or not within [`ORACLE_MAX_STEPS`]).
fn first_token_s(engine: &Scheduler, req: &NewRequest, now: f64, free_at: f64) -> Option<f64> {
    let mut copy = engine.clone();
    let id = copy.submit(req.clone(), now).ok()?;
    let mut t = free_at.max(now);
    for _ in 0..ORACLE_MAX_STEPS {
        let out = copy.step(t)?;
        let first = out.events.iter().any(|e| match *e {
            SeqEvent::Token { id: i, index, .. } => i == id && index == 0,
            SeqEvent::Failed { id: i } => i == id,
        });
        if first {
            return Some(out.end() - now);
        }
        t = out.end();
    }
    None
}

impl Router for OracleFirstToken {
    fn reads_engines(&self) -> bool {
        true
    }
    fn engines_free_at(&mut self, at_s: &[f64]) {
        self.free_at.clear();
        self.free_at.extend_from_slice(at_s);
    }
    fn name(&self) -> String {
        ORACLE_FIRST_TOKEN.to_owned()
    }
    fn setup(&self) -> String {
        "not a router: the engine where the request's first token comes soonest, by stepping a copy of each engine forward (true queues, batches and caches; no later arrivals); ties to the engine holding the fewest tokens".to_owned()
    }
    fn route(
        &mut self,
        _: usize,
        req: &Request<'_>,
        now: f64,
        engines: &[&Scheduler],
    ) -> Result<Ticket, String> {
        let new = NewRequest {
            model: req.model.to_owned(),
            prompt: req.prompt.to_vec(),
            max_tokens: req.max_tokens,
        };
        let mut best: Option<(f64, usize, usize)> = None;
        for (e, s) in engines.iter().enumerate() {
            let free_at = self.free_at.get(e).copied().unwrap_or(now);
            let ttft = first_token_s(s, &new, now, free_at).unwrap_or(f64::INFINITY);
            let key = (ttft, s.token_load(), e);
            if best.is_none_or(|b| (key.0, key.1) < (b.0, b.1)) {
                best = Some(key);
            }
        }
        let engine = best.map_or(0, |b| b.2);
        Ok(Ticket {
            engine,
            prompt_tokens: req.prompt_tokens as u64,
            ..Ticket::default()
        })
    }
    fn finished(&mut self, _: usize, _: &Ticket, _: &Summary, _: f64) {}
}

//! kvroute, the proxy-wasm filter: glue between Envoy and kvroute-core.
//!
//! Per request: if the request is an inference API call, buffer its body
//! (returning Pause from the header callback, which needs
//! `allow_on_headers_stop_iteration`), then analyse, pick and charge in
//! kvroute-core, set the destination header (`primary,fallback,...`,
//! replacing every copy a client sent) and continue. Envoy's `override_host` load
//! balancing policy routes to the first address and walks the rest on
//! retries. The charge is released in two steps: the prefill pending at the
//! first response body byte (a stream's first token; vLLM sends the
//! headers before the prefill), the memory held when the stream ends.
//! Answers are read (a copy of each body chunk, never held back) for the
//! output-length prior, for a decision that expected a prefix hit, and for
//! one whose answer may be a sample of its replica's prefill rate
//! (kvroute_core::rates: the first body byte is stamped, the usage read at
//! the end).
//!
//! The request path keeps its host calls few: counters are batched in the
//! worker and handed to Envoy on its 100 ms tick, and prefix-index reads are
//! cached per worker for `index::CACHE_MS`. The load table stays exact
//! (compare-and-swap at the pick and at each release), so every worker sees
//! the others' load at once; requests look at the snapshot's version stamp
//! at most once per millisecond per worker, so a push is in use within 1 ms.
//!
//! With admission control on (`admission.enabled`, kvroute_core::admit), a
//! parsed request that finds the fleet saturated is answered at once (429
//! with `Retry-After` when its objective is sheddable) or held: the stream
//! stays paused, its facts wait in the worker's queue, and the root
//! context's tick sends it on (decision, destination header, then
//! `resume_http_request` on its context) once the fleet has room, or
//! answers it when a queue bound says so. The stream adopts the decision
//! the tick made for it at its first response byte (or at its end).
//!
//! Nothing here panics: host calls go through `proxy_wasm::hostcalls`, whose
//! errors are mapped or skipped, and every malformed input is a fallback
//! decision plus a counter.

mod host;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use kvroute_core::admit::{self, Held, Objective, Refusal, Verdict};
use kvroute_core::answers::{self, Expectation};
use kvroute_core::config::Role;
use kvroute_core::decide::{self, Decision, Unparsed};
use kvroute_core::host::{header_text, AdmissionCounter, Counter, Gauge, Metrics, Tally};
use kvroute_core::index::IndexCache;
use kvroute_core::ingest::{self, Ask, FleetCache, Outcome, Refresh, INGEST_PATH};
use kvroute_core::load::{self, Charge, LoadReport};
use kvroute_core::placed;
use kvroute_core::rates::{self, Probe};
use kvroute_core::usage::{self, Tracker};
use kvroute_core::{Config, Endpoint};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::host::{HostMetrics, HostSharedData};

/// Response header that explains the decision, when enabled.
const EXPLAIN_HEADER: &str = "x-kvroute-decision";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// What every stream of this VM (one Envoy worker) shares: the compiled
/// config, metric ids, the decoded fleet snapshot and the worker's batched
/// state.
struct Shared {
    config: Config,
    metrics: HostMetrics,
    /// Request-path counters, handed to `metrics` on the tick.
    tally: Tally,
    /// Prefix-index slots this worker read or wrote recently.
    index: RefCell<IndexCache>,
    fleet: RefCell<FleetCache>,
    /// Output-length priors read recently (at most one read per model per
    /// second on the request path).
    priors: RefCell<usage::PriorCache>,
    /// When this worker last logged a refused conflicting push (one line
    /// per lease, not one per push).
    conflict_logged_ms: Cell<u64>,
    /// Requests held while the fleet is saturated (admission control).
    held: RefCell<admit::Queue<Parked>>,
    /// Decisions the tick made for held requests, until their stream
    /// adopts them (by context id).
    sent_on: RefCell<HashMap<u32, Dispatched>>,
    /// Admission counts since the tick by objective slot, by
    /// `AdmissionCounter::ALL`.
    admission_counts: RefCell<Vec<[u64; AdmissionCounter::ALL.len()]>>,
    /// The queue length last added to the gauge.
    held_published: Cell<i64>,
    /// A snapshot was decoded since the per-replica rate gauges were last
    /// set (they are set on the tick, off the request path).
    rates_due: Cell<bool>,
    /// The replicas whose rate gauge was set last (kvroute_core::rates::report).
    rates_shown: RefCell<Vec<String>>,
}

/// A held request: what its decision needs.
struct Parked {
    facts: decide::Facts,
    objective: Objective,
}

/// What a decision left for its stream: the decision and the cache
/// expectation to check against the answer.
struct Dispatched {
    decision: Decision,
    expectation: Option<Expectation>,
    /// What the answer needs to be a prefill-rate sample (kvroute_core::rates).
    probe: Option<Probe>,
}

/// The gateway's clock in Unix milliseconds (0 if the host refuses).
fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Shared {
    /// Looks for a newer fleet snapshot and decodes it; keeps the fleet
    /// gauges current.
    fn refresh_fleet(&self, id: u32, now: u64, publish: bool) {
        let Ok(mut cache) = self.fleet.try_borrow_mut() else {
            return;
        };
        // The tick always looks; requests share one look per millisecond.
        let (view, refresh) = if publish {
            cache.refresh(&self.config, &HostSharedData)
        } else {
            cache.refresh_at(&self.config, &HostSharedData, now)
        };
        let m = &self.metrics;
        match (refresh, &view) {
            (Refresh::Decoded, Some(v)) => {
                log::info!(
                    "[{id}] kvroute: fleet snapshot seq {} with {} hosts in use",
                    v.seq,
                    v.hosts.len()
                );
                m.gauge(Gauge::FleetHosts, v.hosts.len() as u64);
                self.rates_due.set(self.config.role == Role::Router);
            }
            (Refresh::Failed, _) => m.count(Counter::SnapshotDecodeFailed, 1),
            _ => {}
        }
        // On the tick, and whenever a new snapshot comes into use.
        if let (true, Some(v)) = (publish || refresh == Refresh::Decoded, &view) {
            m.gauge(Gauge::SnapshotAgeMs, v.age_ms(now));
        }
        // The rate each replica is priced at, on the tick after a decode.
        if let (true, true, Some(v)) = (publish, self.rates_due.get(), &view) {
            if let Ok(mut shown) = self.rates_shown.try_borrow_mut() {
                let hosts = v.hosts.iter().map(|h| &h.state);
                rates::report(m, hosts, self.config.fleet.prefill_tokens_per_s, &mut shown);
                self.rates_due.set(false);
            }
        }
    }

    /// The tick: a newer snapshot, the batched counters handed to the host,
    /// the gauges.
    fn tick(&self, now: u64) {
        self.refresh_fleet(0, now, true);
        for (c, n) in self.tally.drain() {
            self.metrics.count(c, n);
        }
        for (replica, c, n) in self.tally.drain_replicas() {
            self.metrics.count_replica(c, &replica, n);
        }
        let (prefill, memory) = load::read(&HostSharedData, &self.config.load_key).totals();
        self.metrics.gauge(Gauge::InflightPrefillTokens, prefill);
        self.metrics.gauge(Gauge::InflightMemoryTokens, memory);
        if self.config.admission.enabled {
            self.drain_held(now);
            self.publish_admission();
        }
    }

    fn count_admission(&self, objective: Objective, c: AdmissionCounter) {
        let Ok(mut rows) = self.admission_counts.try_borrow_mut() else {
            return;
        };
        let i = AdmissionCounter::ALL.iter().position(|x| *x == c);
        if let Some(n) = i.and_then(|i| rows.get_mut(objective.slot()).and_then(|r| r.get_mut(i))) {
            *n = n.saturating_add(1);
        }
    }

    fn publish_admission(&self) {
        if let Ok(mut rows) = self.admission_counts.try_borrow_mut() {
            for (slot, row) in rows.iter_mut().enumerate() {
                for (c, n) in AdmissionCounter::ALL.iter().zip(row.iter_mut()) {
                    self.metrics.count_admission(slot, *c, std::mem::take(n));
                }
            }
        }
        let len = self.held.try_borrow().map_or(0, |q| q.len());
        let len = i64::try_from(len).unwrap_or(i64::MAX);
        self.metrics.gauge_add(
            Gauge::AdmissionQueued,
            len - self.held_published.replace(len),
        );
    }

    /// Whether the fleet has room for `facts` now.
    fn headroom(&self, id: u32, facts: &decide::Facts, now: u64) -> bool {
        self.refresh_fleet(id, now, false);
        let view = self.fleet.try_borrow().ok().and_then(|c| c.current());
        let table = load::read(&HostSharedData, &self.config.load_key);
        decide::headroom(&self.config, facts, view.as_deref(), &table, now)
    }

    /// The tick's work on held requests: answer those past their wait,
    /// then send on, in queue order, each held request whose model has
    /// room (a model without room keeps its requests and is passed over).
    fn drain_held(&self, now: u64) {
        let expired = match self.held.try_borrow_mut() {
            Ok(mut q) => q.expire(now),
            Err(_) => return,
        };
        for h in expired {
            self.refuse_held(h, Refusal::Timeout, now);
        }
        // In queue order: the first held request of a model not yet found
        // without room goes on if its model has room now; otherwise its
        // model is passed over for this tick (its requests keep their
        // order) and the walk goes on to the others.
        let mut full: Vec<String> = Vec::new();
        loop {
            let next = match self.held.try_borrow() {
                Ok(q) => q
                    .iter()
                    .find(|h| !full.contains(&h.item.facts.model))
                    .map(|h| {
                        (
                            h.handle,
                            self.headroom(0, &h.item.facts, now),
                            h.item.facts.model.clone(),
                        )
                    }),
                Err(_) => None,
            };
            let Some((handle, room, model)) = next else {
                break;
            };
            if !room {
                full.push(model);
                continue;
            }
            let Some(h) = self
                .held
                .try_borrow_mut()
                .ok()
                .and_then(|mut q| q.serve(handle))
            else {
                break;
            };
            self.send_on(h, now);
        }
    }

    /// Sends a held request on: decides on its context, leaves the
    /// decision for its stream, resumes it.
    fn send_on(&self, h: Held<Parked>, now: u64) {
        let Ok(id) = u32::try_from(h.handle) else {
            return;
        };
        self.metrics.record_wait(now.saturating_sub(h.since_ms));
        if hostcalls::set_effective_context(id).is_err() {
            // The stream is gone (its on_log already took it out, so
            // this is not expected).
            self.count_admission(h.item.objective, AdmissionCounter::Abandoned);
            return;
        }
        let (dispatched, action) = dispatch(self, id, Ok(&h.item.facts), now);
        if action == Action::Continue {
            self.count_admission(h.item.objective, AdmissionCounter::Admitted);
        }
        if let Ok(mut m) = self.sent_on.try_borrow_mut() {
            m.insert(id, dispatched);
        }
        if action == Action::Continue {
            if let Err(e) = hostcalls::resume_http_request() {
                log::warn!("[{id}] kvroute: cannot resume a held request: {e:?}");
            }
        }
    }

    /// Answers a held request with its refusal, on its context.
    fn refuse_held(&self, h: Held<Parked>, why: Refusal, now: u64) {
        let Ok(id) = u32::try_from(h.handle) else {
            return;
        };
        self.metrics.record_wait(now.saturating_sub(h.since_ms));
        if hostcalls::set_effective_context(id).is_err() {
            self.count_admission(h.item.objective, AdmissionCounter::Abandoned);
            return;
        }
        log::debug!(
            "[{id}] kvroute: held request answered: {} after {} ms",
            why.kind(),
            now.saturating_sub(h.since_ms)
        );
        self.refuse(id, h.item.objective, why);
    }

    /// Answers the current stream with an admission refusal.
    fn refuse(&self, id: u32, objective: Objective, why: Refusal) {
        self.count_admission(objective, AdmissionCounter::Shed);
        drop_client_destination(self, id);
        let cfg = &self.config.admission;
        let retry = cfg.retry_after_s.to_string();
        let body = why.body(cfg, objective);
        let headers = vec![
            ("content-type", "application/json"),
            ("retry-after", retry.as_str()),
        ];
        if let Err(e) =
            hostcalls::send_http_response(why.status(objective), headers, Some(body.as_bytes()))
        {
            log::warn!("[{id}] kvroute: cannot send admission reply: {e:?}");
        }
    }
}

/// Decides for the current stream (the effective context: the stream's
/// own callback, or a held request the tick sends on), sets the
/// destination header, and returns what the stream keeps and the action.
fn dispatch(
    shared: &Shared,
    id: u32,
    facts: Result<&decide::Facts, Unparsed>,
    now: u64,
) -> (Dispatched, Action) {
    shared.refresh_fleet(id, now, false);
    let view = shared.fleet.try_borrow().ok().and_then(|c| c.current());
    let cfg = &shared.config;
    let d = match shared.index.try_borrow_mut() {
        Ok(mut cache) => decide::route(
            cfg,
            &HostSharedData,
            &shared.tally,
            &mut cache,
            facts,
            view.as_deref(),
            now,
            u64::from(id),
        ),
        Err(_) => {
            drop_client_destination(shared, id);
            return (
                Dispatched {
                    decision: Decision {
                        reason: decide::Reason::Fallback,
                        pick: None,
                        targets: Vec::new(),
                        degraded: true,
                        key: None,
                        charge: None,
                        expected_cached: 0,
                        pending: 0,
                    },
                    expectation: None,
                    probe: None,
                },
                Action::Continue,
            );
        }
    };
    log::debug!(
        "[{id}] kvroute decision reason={} key={:?} targets={:?} degraded={} expected_cached={} unparsed={:?}",
        d.reason.as_str(),
        d.key,
        d.targets,
        d.degraded,
        d.expected_cached,
        facts.err()
    );
    let expectation = facts.ok().and_then(|f| Expectation::of(f, &d, now));
    let probe = Probe::of(&d, now).filter(|_| cfg.fleet.learn_prefill_rates);
    let action = if d.targets.is_empty() {
        let model = facts.map(|f| f.model.as_str()).unwrap_or("");
        let body = serde_json::json!({"error": {
            "message": format!("kvroute: no ready replica serves model {model:?}"),
            "type": "no_replica",
            "model": model,
        }})
        .to_string();
        drop_client_destination(shared, id);
        json_reply(503, Some(&body));
        Action::Pause
    } else {
        let value = decide::destination(&d);
        if let Err(e) = hostcalls::set_map_value(
            MapType::HttpRequestHeaders,
            &cfg.destination_header,
            Some(&value),
        ) {
            log::warn!("[{id}] kvroute: cannot set destination header: {e:?}");
            drop_client_destination(shared, id);
        }
        Action::Continue
    };
    (
        Dispatched {
            decision: d,
            expectation,
            probe,
        },
        action,
    )
}

/// Removes every copy of the destination header a client sent, where
/// the filter does not replace it.
fn drop_client_destination(shared: &Shared, id: u32) {
    let name = &shared.config.destination_header;
    if let Err(e) = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name) {
        log::warn!("[{id}] kvroute: cannot remove client destination header: {e:?}");
    }
}

/// How often a router hands its counters to Envoy, publishes its gauges and
/// looks for a new snapshot off the request path.
const TICK: Duration = Duration::from_millis(100);

fn json_reply(status: u32, body: Option<&str>) {
    let headers = match body {
        Some(_) => vec![("content-type", "application/json")],
        None => vec![],
    };
    if let Err(e) = hostcalls::send_http_response(status, headers, body.map(str::as_bytes)) {
        log::warn!("kvroute: cannot send local reply {status}: {e:?}");
    }
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(b)) => b,
            Ok(None) => {
                log::error!("kvroute: invalid plugin configuration: config: missing (set the filter's configuration to kvroute JSON)");
                return false;
            }
            Err(e) => {
                log::error!("kvroute: cannot read plugin configuration: {e:?}");
                return false;
            }
        };
        match Config::from_json(&bytes) {
            Ok(config) => {
                if config.role == Role::Router {
                    // Keeps the fleet gauges current on a quiet gateway and
                    // decodes new snapshots off the request path.
                    if let Err(e) = hostcalls::set_tick_period(TICK) {
                        log::warn!("kvroute: cannot set tick period: {e:?}");
                    }
                }
                match config.role {
                    Role::Router => log::info!(
                        "kvroute: router configured: {} hosts, header {}, {} fallbacks, epsilon {}",
                        config.hosts.len(),
                        config.destination_header,
                        config.fallbacks,
                        config.epsilon
                    ),
                    Role::Ingest => log::info!(
                        "kvroute: ingest configured at POST {INGEST_PATH} (and GET {})",
                        ingest::LOAD_PATH
                    ),
                }
                let objectives: Vec<&str> = if config.admission.enabled {
                    std::iter::once(admit::DEFAULT_OBJECTIVE)
                        .chain(config.admission.objectives.iter().map(|(n, _)| n.as_str()))
                        .collect()
                } else {
                    Vec::new()
                };
                let metrics = HostMetrics::define(&objectives);
                let admission_counts =
                    RefCell::new(vec![[0; AdmissionCounter::ALL.len()]; objectives.len()]);
                let held = RefCell::new(admit::Queue::new(&config.admission));
                self.shared = Some(Rc::new(Shared {
                    config,
                    metrics,
                    held,
                    sent_on: RefCell::new(HashMap::new()),
                    admission_counts,
                    held_published: Cell::new(0),
                    tally: Tally::default(),
                    index: RefCell::new(IndexCache::default()),
                    fleet: RefCell::new(FleetCache::default()),
                    priors: RefCell::new(usage::PriorCache::default()),
                    conflict_logged_ms: Cell::new(0),
                    rates_due: Cell::new(false),
                    rates_shown: RefCell::new(Vec::new()),
                }));
                true
            }
            Err(e) => {
                log::error!("kvroute: invalid plugin configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        if shared.config.role == Role::Ingest {
            return Some(Box::new(Ingest {
                id: context_id,
                shared,
                done: false,
            }));
        }
        Some(Box::new(Stream {
            id: context_id,
            shared,
            endpoint: None,
            session: None,
            body_size: 0,
            decision: None,
            pending: None,
            model: None,
            tracker: Tracker::Off,
            expectation: None,
            probe: None,
            objective: Objective::default(),
            held: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            if shared.config.role == Role::Router {
                shared.tick(now_ms());
            }
        }
    }
}

/// One HTTP stream.
struct Stream {
    id: u32,
    shared: Rc<Shared>,
    endpoint: Option<Endpoint>,
    session: Option<String>,
    body_size: usize,
    decision: Option<Decision>,
    /// What is still charged to the chosen host.
    pending: Option<Charge>,
    /// The parsed request's model, for learning its output length.
    model: Option<String>,
    tracker: Tracker,
    /// What the decision expected cached on its primary, until the answer
    /// says what was (only for decisions that expected a hit).
    expectation: Option<Expectation>,
    /// What the answer needs to be a sample of the primary's prefill rate,
    /// stamped at the first body byte.
    probe: Option<Probe>,
    /// The objective the request named (admission control).
    objective: Objective,
    /// Held in the worker's queue, or sent on by the tick with a decision
    /// not yet adopted.
    held: bool,
}

/// A header as text; missing, unreadable or not UTF-8 reads as `None`.
///
/// Never `hostcalls::get_map_value`: proxy-wasm 0.2 unwraps its UTF-8
/// conversion, so a client header with bytes 0x80-0xFF trapped the VM (found
/// by tests/e2e/test_hostile.py). Read bytes, decode in kvroute-core.
fn map_value(map: MapType, name: &str) -> Option<String> {
    header_text(hostcalls::get_map_value_bytes(map, name).ok().flatten())
}

/// The address of the upstream host that answered (`ip:port`), if Envoy
/// says.
fn upstream_address() -> Option<String> {
    header_text(
        hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten(),
    )
}

fn header(name: &str) -> Option<String> {
    map_value(MapType::HttpRequestHeaders, name)
}

impl Stream {
    /// Decides once, sets the destination header, and returns the action.
    fn decide(&mut self, facts: Result<decide::Facts, Unparsed>, now: u64) -> Action {
        let shared = Rc::clone(&self.shared);
        let (d, action) = dispatch(&shared, self.id, facts.as_ref().map_err(|u| *u), now);
        self.keep(d);
        action
    }

    fn keep(&mut self, d: Dispatched) {
        self.pending = d.decision.charge;
        self.expectation = d.expectation;
        self.probe = d.probe;
        self.decision = Some(d.decision);
    }

    /// Admission control for a parsed request: on now, answered now, or
    /// held for the tick.
    fn admit(&mut self, facts: decide::Facts, now: u64) -> Action {
        let shared = Rc::clone(&self.shared);
        let cfg = &shared.config.admission;
        let room = shared.headroom(self.id, &facts, now);
        let verdict = match shared.held.try_borrow() {
            Ok(q) => admit::arrive(cfg, self.objective, room, &q, |p: &Parked| {
                p.facts.model == facts.model
            }),
            Err(_) => Verdict::Admit,
        };
        let key = facts.affinity.key();
        match verdict {
            Verdict::Admit => {
                shared.count_admission(self.objective, AdmissionCounter::Admitted);
                self.decide(Ok(facts), now)
            }
            Verdict::Refuse(why) => {
                shared.refuse(self.id, self.objective, why);
                Action::Pause
            }
            Verdict::Hold => {
                let parked = Parked {
                    facts,
                    objective: self.objective,
                };
                let pushed = match shared.held.try_borrow_mut() {
                    Ok(mut q) => q.push(
                        u64::from(self.id),
                        self.objective.priority,
                        key,
                        now,
                        parked,
                    ),
                    Err(_) => Err((Refusal::QueueFull, parked)),
                };
                match pushed {
                    Ok(displaced) => {
                        shared.count_admission(self.objective, AdmissionCounter::Queued);
                        self.held = true;
                        log::debug!(
                            "[{}] kvroute: fleet saturated; request held (priority {})",
                            self.id,
                            self.objective.priority
                        );
                        if let Some(d) = displaced {
                            shared.refuse_held(d, Refusal::Displaced, now);
                            // Back to this stream's context.
                            let _ = hostcalls::set_effective_context(self.id);
                        }
                        Action::Pause
                    }
                    Err((why, _)) => {
                        shared.refuse(self.id, self.objective, why);
                        Action::Pause
                    }
                }
            }
        }
    }

    /// Takes over the decision the tick made for this held stream, or,
    /// when it is still held, nothing.
    fn adopt(&mut self) {
        if !self.held {
            return;
        }
        let sent = self
            .shared
            .sent_on
            .try_borrow_mut()
            .ok()
            .and_then(|mut m| m.remove(&self.id));
        if let Some(d) = sent {
            self.held = false;
            self.keep(d);
        }
    }

    /// The client left: a request still held leaves the queue.
    fn leave_queue(&mut self) {
        if !self.held {
            return;
        }
        self.held = false;
        let shared = Rc::clone(&self.shared);
        let gone = shared
            .held
            .try_borrow_mut()
            .ok()
            .and_then(|mut q| q.remove(u64::from(self.id)));
        if let Some(h) = gone {
            shared
                .metrics
                .record_wait(now_ms().saturating_sub(h.since_ms));
            shared.count_admission(h.item.objective, AdmissionCounter::Abandoned);
            log::debug!("[{}] kvroute: held request's client left", self.id);
        }
    }

    fn decide_buffered(&mut self) -> Action {
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let now = now_ms();
        self.shared
            .tally
            .count(Counter::BodyBytes, body.len() as u64);
        let mut facts = match self.endpoint {
            Some(ep) => decide::analyze(&self.shared.config, ep, self.session.as_deref(), &body),
            None => Err(Unparsed::NotInference),
        };
        if let Ok(f) = facts.as_mut() {
            let prior = self.shared.priors.try_borrow_mut().ok().and_then(|mut c| {
                c.get(
                    &HostSharedData,
                    &self.shared.config.shared_data_prefix,
                    &f.model,
                    now,
                )
            });
            decide::apply_prior_value(f, prior);
            self.model = Some(f.model.clone());
        }
        match facts {
            Ok(f) if self.shared.config.admission.enabled => self.admit(f, now),
            other => self.decide(other, now),
        }
    }

    /// Compares the answer's cached tokens with what the decision expected
    /// (see kvroute_core::answers), counting in the worker's tally.
    fn learn(&self, exp: &Expectation, learned: &usage::Learned) {
        let shared = &self.shared;
        let Ok(mut cache) = shared.index.try_borrow_mut() else {
            return;
        };
        let verdict = answers::learn(
            &shared.config,
            &HostSharedData,
            &shared.tally,
            &mut cache,
            exp,
            learned,
            now_ms(),
        );
        if let Some(v) = verdict.filter(|v| v.short) {
            log::debug!(
                "[{}] kvroute: {} had {} of {} expected cached tokens; {} index entries dropped",
                self.id,
                exp.replica,
                v.cached,
                v.expected,
                v.dropped
            );
        }
    }

    fn release(&mut self, prefill_only: bool) {
        let Some(charge) = self.pending else { return };
        if prefill_only && charge.prefill == 0 {
            return; // released already (every later body chunk comes here)
        }
        let (now, later) = if prefill_only {
            (
                Charge {
                    memory: 0,
                    ..charge
                },
                Some(Charge {
                    prefill: 0,
                    ..charge
                }),
            )
        } else {
            (charge, None)
        };
        decide::release(
            &self.shared.config,
            &HostSharedData,
            &self.shared.tally,
            now,
        );
        self.pending = later;
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = &self.shared.config;
        // Clients never steer the destination: every request that goes on
        // leaves `decide`, which replaces every copy a client sent (Envoy's
        // replace removes them all) or, where it names no replica, removes
        // them.
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        if matches!(
            path.split('?').next(),
            Some(INGEST_PATH | ingest::LOAD_PATH)
        ) {
            // Snapshots are only taken, and the load only served, on the
            // loopback ingest listener.
            json_reply(404, Outcome::NotFound.body().as_deref());
            return Action::Pause;
        }
        self.endpoint = Endpoint::from_request(&method, &path);
        if self.endpoint.is_none() {
            return self.decide(Err(Unparsed::NotInference), now_ms());
        }
        self.session = cfg.session_headers.iter().find_map(|h| header(h));
        if cfg.admission.enabled {
            let named = header(&cfg.admission.objective_header);
            self.objective = Objective::of(&cfg.admission, named.as_deref());
        }
        if end_of_stream {
            return self.decide(Err(Unparsed::Empty), now_ms());
        }
        // A body declared over the cap is never parsed: decide now and let it
        // stream, rather than hold a first piece (see declared_over_cap).
        if decide::declared_over_cap(header("content-length").as_deref(), cfg.max_body_bytes) {
            return self.decide(Err(Unparsed::TooLarge), now_ms());
        }
        // Hold the headers until the body is in.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decision.is_some() {
            return Action::Continue;
        }
        if self.held {
            return Action::Pause;
        }
        self.body_size = body_size;
        if body_size > self.shared.config.max_body_bytes {
            self.shared
                .tally
                .count(Counter::BodyBytes, body_size as u64);
            return self.decide(Err(Unparsed::TooLarge), now_ms());
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide_buffered()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.decision.is_some() {
            return Action::Continue;
        }
        if self.held {
            return Action::Pause;
        }
        self.decide_buffered()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.adopt();
        // Not yet the prefill's end: vLLM and SGLang send a stream's headers
        // as soon as they take the request; its first body chunk comes with
        // the first token (on_http_response_body).
        if end_of_stream {
            self.release(true);
        }
        // A sample of the responses teaches the output-length prior, and
        // every answer to a decision that expected a prefix hit says how
        // much was cached (each read is host calls; see
        // answers::read_answer).
        if self.model.is_some()
            && answers::read_answer(self.id, self.expectation.as_ref(), self.probe.as_ref())
            && map_value(MapType::HttpResponseHeaders, ":status").is_some_and(|s| s == "200")
        {
            let ct = map_value(MapType::HttpResponseHeaders, "content-type");
            self.tracker = Tracker::for_content_type(ct.as_deref());
        }
        let from_primary = self.expectation.as_ref().is_some_and(|exp| {
            // After a retry the answer comes from a fallback, and says
            // nothing of the primary's cache. (Unknown: taken as the primary.)
            upstream_address().is_none_or(|a| a == exp.replica)
        });
        if !from_primary || matches!(self.tracker, Tracker::Off) {
            // Not read: the block hashes need not wait for the answer.
            self.expectation = None;
        }
        // Likewise a fallback's answer says nothing of the primary's rate.
        let primary = self.decision.as_ref().and_then(|d| d.targets.first());
        let answered_by_primary = match (upstream_address(), primary) {
            (Some(a), Some(p)) => a == *p,
            _ => true,
        };
        if !answered_by_primary || matches!(self.tracker, Tracker::Off) {
            self.probe = None;
        }
        if self.shared.config.explain_header {
            if let Some(d) = &self.decision {
                let value = decide::explain(d);
                let _ = hostcalls::set_map_value(
                    MapType::HttpResponseHeaders,
                    EXPLAIN_HEADER,
                    Some(&value),
                );
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // The first body byte: the prompt has been prefilled.
        if body_size > 0 || end_of_stream {
            self.release(true);
        }
        if body_size > 0 {
            if let Some(p) = self.probe.as_mut() {
                p.first_byte(now_ms());
            }
        }
        if matches!(self.tracker, Tracker::Off) {
            return Action::Continue;
        }
        // The chunk streams on; the filter only reads a copy of it.
        if let Ok(Some(chunk)) = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size) {
            self.tracker.feed(&chunk);
        }
        if end_of_stream {
            let learned = self.tracker.finish();
            self.tracker = Tracker::Off;
            if let (true, Some(tokens), Some(model)) = (
                usage::observed(self.id),
                learned.output_tokens,
                self.model.as_deref(),
            ) {
                usage::observe(
                    &HostSharedData,
                    &self.shared.config.shared_data_prefix,
                    model,
                    tokens,
                );
            }
            if let Some(exp) = self.expectation.take() {
                self.learn(&exp, &learned);
            }
            if let Some(p) = self.probe.take() {
                let cfg = &self.shared.config;
                let key = &cfg.fleet.rates_key;
                rates::learn(&HostSharedData, &self.shared.tally, key, &p, &learned);
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.adopt();
        self.leave_queue();
        self.release(false);
    }
}

/// One request on the ingest listener, answered locally, never forwarded:
/// a snapshot push, or a collector reading this gateway's in-flight load
/// (`GET /v1/fleet/load`, the same bearer token).
struct Ingest {
    id: u32,
    shared: Rc<Shared>,
    done: bool,
}

impl Ingest {
    fn answer(&mut self, outcome: Outcome) -> Action {
        if let Some(c) = outcome.counter() {
            self.shared.metrics.count(c, 1);
        }
        match &outcome {
            Outcome::Accepted { seq } => {
                log::debug!("[{}] kvroute: ingest accepted seq {seq}", self.id)
            }
            Outcome::TookOver {
                seq,
                from,
                silent_ms,
            } => log::info!(
                "[{}] kvroute: ingest accepted seq {seq}; this collector took the snapshot over from {from:?}, silent for {silent_ms} ms",
                self.id
            ),
            Outcome::Conflict { lease_ms, .. } => {
                let now = now_ms();
                let last = self.shared.conflict_logged_ms.get();
                if last == 0 || now.saturating_sub(last) >= (*lease_ms).max(1000) {
                    self.shared.conflict_logged_ms.set(now);
                    log::warn!(
                        "[{}] kvroute: ingest refused with 409: {} (kvroute_ingest_conflicts_total counts every refused push)",
                        self.id,
                        outcome.body().unwrap_or_default()
                    );
                }
            }
            other => log::warn!(
                "[{}] kvroute: ingest refused with {}: {}",
                self.id,
                other.status(),
                other.body().unwrap_or_default()
            ),
        }
        json_reply(outcome.status(), outcome.body().as_deref());
        self.done = true;
        Action::Pause
    }

    /// This gateway's load table by address: the hosts of the stored
    /// snapshot and the configured ones.
    fn answer_load(&mut self, with_placed: bool, with_last_blocks: bool) -> Action {
        let cfg = &self.shared.config;
        let table = load::read(&HostSharedData, &cfg.load_key);
        let (view, _) = self.shared.fleet.borrow_mut().refresh(cfg, &HostSharedData);
        let mut known = vec![&cfg.hosts];
        if let Some(v) = view.as_deref() {
            known.push(&v.set);
        }
        let mut report = LoadReport::of(&table, &known, now_ms(), cfg.fleet.arrival_window_ms);
        if with_placed {
            let placed = placed::report(&HostSharedData, &cfg.fleet.placed_key, &known, now_ms());
            report.placed = Some(placed);
        }
        // The ingest listener has its own config: it reports the ring,
        // empty when the router shares none (`fleet.shareLastBlocks`
        // off), and the collector gives any gateway whose report has the
        // field the others' (the router ignores them when sharing is off).
        if with_last_blocks {
            let key = &cfg.fleet.last_blocks_key;
            let last = placed::report_last(&HostSharedData, key, &known, now_ms());
            report.last_blocks = Some(last);
        }
        let body = report.to_json();
        json_reply(200, std::str::from_utf8(&body).ok());
        self.done = true;
        Action::Pause
    }

    fn limit(&self) -> usize {
        self.shared
            .config
            .ingest
            .as_ref()
            .map_or(0, |i| i.max_bytes)
    }
}

impl Context for Ingest {}

impl HttpContext for Ingest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        let ask = match ingest::route(&method, &path) {
            Ok(ask) => ask,
            Err(o) => return self.answer(o),
        };
        let authorized = self
            .shared
            .config
            .ingest
            .as_ref()
            .is_some_and(|c| ingest::authorized(c, header("authorization").as_deref()));
        if !authorized {
            return self.answer(Outcome::Unauthorized);
        }
        if ask == Ask::Load {
            return self.answer_load(
                ingest::wants_placed(&path),
                ingest::wants_last_blocks(&path),
            );
        }
        let declared = header("content-length").and_then(|v| v.trim().parse::<usize>().ok());
        if declared.is_some_and(|n| n > self.limit()) {
            return self.answer(Outcome::TooLarge {
                limit: self.limit(),
            });
        }
        if end_of_stream {
            return self.answer(Outcome::Invalid("empty body".into()));
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.done {
            return Action::Pause;
        }
        if body_size > self.limit() {
            return self.answer(Outcome::TooLarge {
                limit: self.limit(),
            });
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let outcome = ingest::store(&self.shared.config, &HostSharedData, &body, now_ms());
        self.answer(outcome)
    }
}

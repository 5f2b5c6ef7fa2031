//! The collector loop: engine set from discovery, one worker per engine,
//! the fleet state, and the snapshots handed to the pushers.
//!
//! Threads: discovery (only when engine names need resolving), gateway
//! discovery (only with `--gateway-service`), one scrape worker per engine,
//! one pusher per gateway, the metrics endpoint, and this loop, which alone
//! owns the fleet state and the pushers (the others send it [`Event`]s; no
//! shared locks on the hot path).
//!
//! Gateways are the configured addresses plus every address each gateway
//! service resolves to. A gateway that appears gets a pusher at once (and
//! the next snapshot); one that goes away has its pusher stopped and its
//! load and metrics dropped. With two gateways possible or more, every
//! pusher shares one load board (push.rs). Peers (`--peer-gateways`, and
//! every address a peer service resolves to but this collector's own
//! gateway) get a thread that reads their load onto the board and pushes
//! nothing. A gateway alone on the board (a service or peer service that
//! names only it) is told that no other gateway has load
//! (`peerPendingTokens` 0, [`crate::push::LoadBoard::others`]).
//!
//! When a snapshot is built:
//!
//! - the first once every engine has been scraped once, or after `timeout`
//!   plus a margin, whichever comes first (so a gateway never sees a fleet of
//!   "not scraped yet" engines when the answers were milliseconds away);
//! - then every `push-interval`;
//! - and at once whenever an engine's readiness changes or the engine set
//!   changes (events that arrive together make one snapshot).
//!
//! `seq = max(previous seq + 1, now in Unix ms)`: increasing within a run,
//! and across restarts as long as the clock does not step back by more than
//! the restart took.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use kvroute_core::fleet::{HostState, Snapshot, MAX_HOSTS, SNAPSHOT_VERSION};
use log::{error, info, warn};

use crate::config::{Gateway, Settings};
use crate::discovery::{self, Discovery, DnsDiscovery, Resolver};
use crate::engines::EngineMetrics;
use crate::metrics::{Metrics, MetricsServer};
use crate::now_ms;
use crate::push::{LoadBoard, Payload, Peers, Pusher};
use crate::scrape::{self, Report, Scrape, Worker};

/// What the loop hears about.
#[derive(Debug)]
pub enum Event {
    /// The current engine set, from discovery.
    Engines(Vec<SocketAddr>),
    /// The gateways the gateway services resolve to now.
    Gateways(Vec<Gateway>),
    /// One scrape's outcome, from an engine worker.
    Scraped(Box<Report>),
}

/// `seq` generator: `max(previous + 1, now_ms)`.
#[derive(Debug, Default, Clone, Copy)]
pub struct SeqGen {
    last: u64,
}

impl SeqGen {
    pub fn next(&mut self, now_ms: u64) -> u64 {
        let seq = self.last.saturating_add(1).max(now_ms);
        self.last = seq;
        seq
    }
}

/// What the collector knows about one engine.
#[derive(Debug, Default, Clone)]
pub struct EngineState {
    /// At least one scrape came back.
    pub reported: bool,
    pub ready: bool,
    /// Last good `/metrics`, and when it was read (0: never).
    pub last_good: Option<EngineMetrics>,
    pub scraped_at_ms: u64,
    /// Current failure cause and `/health` status, to log only changes.
    failure: Option<&'static str>,
    health: Option<u16>,
}

impl EngineState {
    /// Takes in one scrape; returns whether readiness changed.
    pub fn apply(&mut self, s: &Scrape) -> bool {
        let was_ready = self.ready;
        self.reported = true;
        if let Some(m) = &s.metrics {
            self.last_good = Some(m.clone());
            self.scraped_at_ms = s.finished_ms;
        }
        self.ready = s.ready();
        let addr = s.addr;
        let cause = s.failure.as_ref().map(|f| f.cause);
        if cause != self.failure {
            match &s.failure {
                Some(f) => warn!(
                    "engine {addr}: scrape failed ({}): {}; reported not ready, backing off",
                    f.cause, f.detail
                ),
                None => info!("engine {addr}: scraping again"),
            }
            self.failure = cause;
        }
        if s.health_status != self.health && s.health_status.is_some() {
            if let Some(status) = s.health_status.filter(|st| *st != 200) {
                info!("engine {addr}: /health answered {status}: not ready");
            }
            self.health = s.health_status;
        }
        if self.ready != was_ready && self.ready {
            info!("engine {addr}: ready");
        }
        self.ready != was_ready
    }

    /// The snapshot entry, at `taken_ms`.
    pub fn host_state(&self, addr: SocketAddr, taken_ms: u64) -> HostState {
        let m = self.last_good.as_ref();
        HostState {
            address: addr.to_string(),
            ready: self.ready,
            draining: false,
            models: m.map(|m| m.models.clone()).unwrap_or_default(),
            kv_utilization: m
                .and_then(|m| m.kv_utilization)
                .filter(|v| v.is_finite())
                .map_or(0.0, |v| v.clamp(0.0, 1.0)),
            waiting: m.and_then(|m| m.waiting).unwrap_or(0),
            running: m.and_then(|m| m.running).unwrap_or(0),
            kv_capacity_tokens: m.and_then(|m| m.kv_capacity_tokens),
            block_size: m.and_then(|m| m.block_size).filter(|b| *b > 0),
            // The clock may have stepped back since; the snapshot's
            // invariant (scraped <= taken) holds regardless.
            scraped_at_ms: self.scraped_at_ms.min(taken_ms),
            engine: m.and_then(|m| m.engine).map(|k| k.as_str().to_owned()),
            peer_pending_tokens: None,
            peer_arrivals_per_s: None,
            prefill_tokens_per_s: None,
        }
    }
}

/// Builds a snapshot of `engines`, sorted by address, at most
/// [`MAX_HOSTS`] of them.
pub fn build_snapshot<'a>(
    collector: &str,
    seq: u64,
    taken_ms: u64,
    engines: impl IntoIterator<Item = (&'a SocketAddr, &'a EngineState)>,
) -> Snapshot {
    let mut hosts: Vec<HostState> = engines
        .into_iter()
        .map(|(addr, st)| st.host_state(*addr, taken_ms))
        .collect();
    hosts.sort_by(|a, b| a.address.cmp(&b.address));
    hosts.truncate(MAX_HOSTS);
    Snapshot {
        placed: Vec::new(),
        last_blocks: Vec::new(),
        version: SNAPSHOT_VERSION,
        seq,
        collector: collector.to_owned(),
        taken_at_ms: taken_ms,
        hosts,
    }
}

/// Why the collector could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartError(pub String);

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartError {}

/// A running collector.
pub struct Running {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
    metrics: Arc<Metrics>,
    metrics_server: Option<MetricsServer>,
}

impl Running {
    /// Where the metrics endpoint listens, if enabled.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(MetricsServer::addr)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Stops every thread and waits for them (bounded by the timeouts: an
    /// in-flight scrape or push finishes first). Dropping does the same.
    pub fn stop(self) {}

    /// Runs until the process ends.
    pub fn join(mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.metrics_server.take();
    }
}

/// Starts the collector with the system resolver.
pub fn start(settings: Settings) -> Result<Running, StartError> {
    start_with(settings, discovery::system_resolver())
}

/// Starts the collector with a given resolver (tests use a fake DNS).
pub fn start_with(settings: Settings, resolver: Resolver) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let metrics_server = match settings.metrics_addr {
        Some(addr) => Some(
            MetricsServer::start(addr, Arc::clone(&metrics))
                .map_err(|e| StartError(format!("metrics-addr {addr}: cannot listen: {e}")))?,
        ),
        None => None,
    };
    let token = settings
        .token
        .clone()
        .ok_or_else(|| StartError("no ingest token".into()))?;
    // With several gateways, each one's snapshot carries the others'
    // pending prefill (push.rs).
    let board = (settings.gateways.len() > 1
        || !settings.gateway_services.is_empty()
        || !settings.peer_gateways.is_empty()
        || !settings.peer_services.is_empty())
    .then(|| Arc::new(LoadBoard::new()));
    let mut pushers = Pushers {
        map: BTreeMap::new(),
        token,
        timeout: settings.push_timeout,
        metrics: Arc::clone(&metrics),
        board,
        retired: Vec::new(),
    };
    let own_ports: Vec<u16> = settings.gateways.iter().filter_map(Gateway::port).collect();
    // A static peer that is this machine's own gateway (one list of every
    // replica, given to each) is left out, as from a peer service.
    let mut settings = settings;
    settings
        .peer_gateways
        .retain(|g| !g.addr().is_some_and(|a| is_own_gateway(a, &own_ports)));
    for gw in one_per_endpoint(
        settings
            .gateways
            .iter()
            .chain(&settings.peer_gateways)
            .cloned(),
    ) {
        pushers
            .add(gw)
            .map_err(|e| StartError(format!("cannot start a push thread: {e}")))?;
    }
    // Engine and gateway discovery share the resolver.
    let resolver = Arc::new(Mutex::new(resolver));
    let shared = |r: &Arc<Mutex<Resolver>>| -> Resolver {
        let r = Arc::clone(r);
        Box::new(move |host, port| (r.lock().unwrap_or_else(|p| p.into_inner()))(host, port))
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let gateway_thread =
        if settings.gateway_services.is_empty() && settings.peer_services.is_empty() {
            None
        } else {
            let own_ports = own_ports.clone();
            let mut services: Vec<_> = settings
                .gateway_services
                .iter()
                .map(|svc| (svc, false))
                .chain(settings.peer_services.iter().map(|svc| (svc, true)))
                .map(|(svc, peer)| {
                    let d = DnsDiscovery::new(
                        vec![(svc.host.clone(), svc.port)],
                        shared(&resolver),
                        Some(Arc::clone(&metrics)),
                    )
                    .naming(if peer { "peer gateway" } else { "gateway" });
                    (svc.clone(), peer, d)
                })
                .collect();
            let look = move || -> Vec<Gateway> {
                let mut out: Vec<Gateway> = Vec::new();
                for (svc, peer, d) in &mut services {
                    for addr in d.engines() {
                        if *peer && is_own_gateway(addr, &own_ports) {
                            continue;
                        }
                        // Repeats are dropped where the list is applied
                        // (`Pushers::set`, one thread per endpoint).
                        let gw = svc.gateway(addr);
                        out.push(if *peer { gw.as_peer() } else { gw });
                    }
                }
                out
            };
            Some(spawn_discovery(
                "gateway discovery",
                look,
                Event::Gateways,
                &tx,
                &stop,
                settings.dns_refresh,
            )?)
        };
    let (mut disco, dynamic) = discovery::for_targets(
        &settings.engines,
        shared(&resolver),
        Some(Arc::clone(&metrics)),
    );
    let discovery_thread = if dynamic {
        Some(spawn_discovery(
            "discovery",
            move || disco.engines(),
            Event::Engines,
            &tx,
            &stop,
            settings.dns_refresh,
        )?)
    } else {
        let _ = tx.send(Event::Engines(disco.engines()));
        None
    };
    let loop_metrics = Arc::clone(&metrics);
    let loop_stop = Arc::clone(&stop);
    let handle = thread::Builder::new()
        .name("collector".into())
        .spawn(move || {
            let mut state = Loop {
                settings,
                tx,
                metrics: loop_metrics,
                engines: BTreeMap::new(),
                workers: BTreeMap::new(),
                seq: SeqGen::default(),
                pushers,
                latest: None,
                first_engines_at: None,
                pushed_once: false,
                warned_too_many: false,
            };
            state.run(&rx, &loop_stop);
            state.shutdown();
            for d in [discovery_thread, gateway_thread].into_iter().flatten() {
                let _ = d.join();
            }
        })
        .map_err(|e| StartError(format!("cannot start the collector thread: {e}")))?;
    Ok(Running {
        stop,
        handle: Some(handle),
        metrics,
        metrics_server,
    })
}

/// A thread running [`discovery_loop`].
fn spawn_discovery<T: PartialEq + Clone + 'static>(
    name: &str,
    look: impl FnMut() -> T + Send + 'static,
    event: fn(T) -> Event,
    tx: &Sender<Event>,
    stop: &Arc<AtomicBool>,
    every: Duration,
) -> Result<thread::JoinHandle<()>, StartError> {
    let (tx, stop) = (tx.clone(), Arc::clone(stop));
    thread::Builder::new()
        .name(name.into())
        .spawn(move || discovery_loop(look, event, &tx, &stop, every))
        .map_err(|e| StartError(format!("cannot start the {name} thread: {e}")))
}

/// Looks every `every` and sends what it finds when it changed.
fn discovery_loop<T: PartialEq + Clone>(
    mut look: impl FnMut() -> T,
    event: fn(T) -> Event,
    tx: &Sender<Event>,
    stop: &AtomicBool,
    every: Duration,
) {
    let mut last: Option<T> = None;
    loop {
        let found = look();
        if last.as_ref() != Some(&found) {
            if tx.send(event(found.clone())).is_err() {
                return;
            }
            last = Some(found);
        }
        let until = Instant::now() + every;
        while Instant::now() < until {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            thread::sleep(
                Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())),
            );
        }
    }
}

struct Loop {
    settings: Settings,
    tx: Sender<Event>,
    metrics: Arc<Metrics>,
    engines: BTreeMap<SocketAddr, EngineState>,
    workers: BTreeMap<SocketAddr, Worker>,
    seq: SeqGen,
    pushers: Pushers,
    /// The newest snapshot, for a gateway that appears between pushes.
    latest: Option<Payload>,
    first_engines_at: Option<Instant>,
    pushed_once: bool,
    warned_too_many: bool,
}

impl Loop {
    fn run(&mut self, rx: &Receiver<Event>, stop: &AtomicBool) {
        let mut next_push = Instant::now();
        let mut push_now = false;
        // Wake at least this often to notice a stop.
        let tick = Duration::from_millis(50);
        while !stop.load(Ordering::SeqCst) {
            // Before the first push, poll gently for the gate to open.
            let wait = if self.pushed_once {
                next_push
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), tick)
            } else {
                Duration::from_millis(10)
            };
            match rx.recv_timeout(wait) {
                Ok(ev) => push_now |= self.handle(ev),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            // Everything already queued goes into the same snapshot.
            while let Ok(ev) = rx.try_recv() {
                push_now |= self.handle(ev);
            }
            let now = Instant::now();
            if !self.may_push(now) {
                continue;
            }
            if push_now || now >= next_push || !self.pushed_once {
                self.publish();
                next_push = now + self.settings.push_interval;
                push_now = false;
            }
        }
    }

    /// Whether the first snapshot may go out yet.
    fn may_push(&self, now: Instant) -> bool {
        if self.pushed_once {
            return true;
        }
        let Some(t0) = self.first_engines_at else {
            return false;
        };
        self.engines.values().all(|e| e.reported)
            || now >= t0 + self.settings.timeout * 2 + Duration::from_millis(100)
    }

    /// Returns whether a snapshot should go out now.
    fn handle(&mut self, ev: Event) -> bool {
        match ev {
            Event::Engines(list) => self.set_engines(list),
            Event::Gateways(list) => {
                // Gateways pushed to first: an address both pushed to and
                // named as a peer is pushed to.
                let (peers, pushed): (Vec<Gateway>, Vec<Gateway>) =
                    list.into_iter().partition(|g| g.peer);
                let s = &self.settings;
                let wanted = s
                    .gateways
                    .iter()
                    .cloned()
                    .chain(pushed)
                    .chain(s.peer_gateways.iter().cloned())
                    .chain(peers);
                self.pushers.set(wanted, self.latest.as_ref());
                false
            }
            Event::Scraped(report) => {
                let s = &report.scrape;
                let key = s.addr.to_string();
                self.metrics.scrape(
                    &key,
                    s.duration.as_secs_f64(),
                    s.failure.as_ref().map(|f| f.cause),
                );
                if s.health_status.is_some_and(|st| st != 200) {
                    self.metrics.health_not_ok(&key);
                }
                match self.engines.get_mut(&s.addr) {
                    Some(st) => st.apply(s),
                    None => false, // removed meanwhile
                }
            }
        }
    }

    fn set_engines(&mut self, list: Vec<SocketAddr>) -> bool {
        if list.len() > MAX_HOSTS && !self.warned_too_many {
            warn!(
                "{} engines discovered; a snapshot holds at most {MAX_HOSTS}: the rest are left out",
                list.len()
            );
            self.warned_too_many = true;
        }
        let wanted: std::collections::BTreeSet<SocketAddr> = list.into_iter().collect();
        let mut changed = false;
        let gone: Vec<SocketAddr> = self
            .engines
            .keys()
            .filter(|a| !wanted.contains(a))
            .copied()
            .collect();
        for addr in gone {
            info!("engine {addr}: removed");
            self.engines.remove(&addr);
            if let Some(mut w) = self.workers.remove(&addr) {
                w.stop(); // it ends after its current scrape; not joined here
            }
            self.metrics.forget_engine(&addr.to_string());
            changed = true;
        }
        for addr in wanted {
            if self.engines.contains_key(&addr) {
                continue;
            }
            let s = &self.settings;
            match Worker::spawn(addr, s.interval, s.timeout, s.max_backoff, self.tx.clone()) {
                Ok(w) => {
                    info!("engine {addr}: added");
                    self.workers.insert(addr, w);
                    self.engines.insert(addr, EngineState::default());
                    changed = true;
                }
                Err(e) => error!("engine {addr}: cannot start a scrape thread: {e}"),
            }
        }
        if self.first_engines_at.is_none() {
            self.first_engines_at = Some(Instant::now());
        }
        changed
    }

    fn publish(&mut self) {
        let taken = now_ms();
        let seq = self.seq.next(taken);
        let snap = build_snapshot(&self.settings.collector_id, seq, taken, self.engines.iter());
        if let Err(e) = snap.validate() {
            // Cannot happen with the bounds above; refuse to send garbage.
            error!("built an invalid snapshot, not pushed: {e}");
            return;
        }
        let ready = snap.hosts.iter().filter(|h| h.ready).count();
        self.metrics.engines(self.engines.len(), ready);
        self.metrics.snapshot_seq(seq);
        let payload = Payload {
            seq,
            body: Arc::new(snap.to_json()),
            snapshot: Arc::new(snap),
        };
        for (p, _) in self.pushers.map.values() {
            p.offer(payload.clone());
        }
        self.latest = Some(payload);
        self.pushed_once = true;
    }

    fn shutdown(&mut self) {
        // Signal every worker first, then wait: the wait is one scrape at
        // most, not one per engine.
        let mut workers: Vec<Worker> = std::mem::take(&mut self.workers).into_values().collect();
        for w in &mut workers {
            w.stop();
        }
        // Likewise the pushers: each may be in a push up to its timeout.
        let pushers: Vec<Pusher> = std::mem::take(&mut self.pushers.map)
            .into_values()
            .map(|(p, _)| p)
            .collect();
        for p in &pushers {
            p.signal_stop();
        }
        for p in pushers {
            p.join();
        }
        self.pushers.reap(true);
        for w in workers {
            w.join();
        }
    }
}

/// The pushers by gateway base URL, and what a new one needs.
struct Pushers {
    /// Each gateway's thread, and whether the gateway is a peer (read,
    /// never pushed to).
    map: BTreeMap<String, (Pusher, bool)>,
    token: crate::config::Secret,
    timeout: Duration,
    metrics: Arc<Metrics>,
    board: Option<Arc<LoadBoard>>,
    /// Threads stopped and not yet joined (each ends after its push in
    /// flight); joined once ended.
    retired: Vec<std::thread::JoinHandle<()>>,
}

/// How a gateway is named in log lines.
fn role_name(peer: bool) -> &'static str {
    if peer {
        "peer gateway"
    } else {
        "gateway"
    }
}

/// `gateways` less the entries whose endpoint an earlier one already
/// names (`http://a:1` and `http://a:1/v1/fleet/snapshot` are one gateway).
fn one_per_endpoint(gateways: impl IntoIterator<Item = Gateway>) -> Vec<Gateway> {
    let mut seen = BTreeSet::new();
    gateways
        .into_iter()
        .filter(|g| seen.insert(g.load_url.clone()))
        .collect()
}

/// Whether `addr`, a peer service's address, is this collector's own
/// gateway: an address of this machine (it can be bound here; in a pod,
/// the pod's IP) on the port of one of the gateways it pushes to.
fn is_own_gateway(addr: SocketAddr, own_ports: &[u16]) -> bool {
    own_ports.contains(&addr.port())
        && std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0)).is_ok()
}

impl Pushers {
    /// Joins the stopped threads that have ended (all of them, waiting,
    /// with `wait`).
    fn reap(&mut self, wait: bool) {
        let (ended, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired)
            .into_iter()
            .partition(|h| wait || h.is_finished());
        self.retired = running;
        for h in ended {
            let _ = h.join();
        }
    }

    /// Updates the gauges: gateways pushed to, and peers.
    fn count(&self) {
        let peers = self.map.values().filter(|(_, peer)| *peer).count();
        self.metrics.gateways(self.map.len() - peers, peers);
    }

    /// A pusher for `gw` unless it has one; whether it is new.
    fn add(&mut self, gw: Gateway) -> std::io::Result<bool> {
        if self.map.contains_key(&gw.base) {
            return Ok(false);
        }
        let base = gw.base.clone();
        let peers = self.board.as_ref().map(|b| Peers {
            board: Arc::clone(b),
        });
        let peer = gw.peer;
        let p = Pusher::spawn(
            gw,
            self.token.clone(),
            self.timeout,
            Arc::clone(&self.metrics),
            peers,
        )?;
        self.map.insert(base, (p, peer));
        self.count();
        Ok(true)
    }

    /// Makes the pushers those of `wanted`: new gateways get a pusher (and
    /// `latest`, if any), gone ones lose theirs (which then drops their
    /// metric series), and one whose role changed (pushed to, or a peer)
    /// gets a new thread in its new role, keeping its series. One thread
    /// per endpoint: of entries that reach the same one (written
    /// differently), the first wins, so list the gateways pushed to first.
    fn set(&mut self, wanted: impl IntoIterator<Item = Gateway>, latest: Option<&Payload>) {
        self.reap(false);
        let wanted = one_per_endpoint(wanted);
        let role: BTreeMap<&str, bool> = wanted.iter().map(|g| (g.base.as_str(), g.peer)).collect();
        let gone: Vec<String> = self
            .map
            .iter()
            .filter(|(b, (_, peer))| role.get(b.as_str()) != Some(peer))
            .map(|(b, _)| b)
            .cloned()
            .collect();
        for base in gone {
            let Some((p, peer)) = self.map.remove(&base) else {
                continue;
            };
            let changed = role.contains_key(base.as_str());
            self.retired.extend(p.stop(!changed));
            if let Some(b) = &self.board {
                b.leave(&base);
            }
            if changed {
                info!("{} {base}: now a {}", role_name(peer), role_name(!peer));
            } else {
                info!("{} {base}: removed", role_name(peer));
            }
        }
        self.count();
        for gw in wanted {
            let base = gw.base.clone();
            match self.add(gw) {
                Ok(false) => {}
                Ok(true) => {
                    let Some((p, peer)) = self.map.get(&base) else {
                        continue;
                    };
                    info!("{} {base}: added", role_name(*peer));
                    if let Some(payload) = latest {
                        p.offer(payload.clone());
                    }
                }
                Err(e) => error!("gateway {base}: cannot start a push thread: {e}"),
            }
        }
    }
}

/// `--once`: resolves, scrapes every engine once (concurrently), and returns
/// the snapshot.
pub fn collect_once(settings: &Settings) -> Snapshot {
    let (mut disco, _) =
        discovery::for_targets(&settings.engines, discovery::system_resolver(), None);
    let addrs = disco.engines();
    let agent = scrape::agent(settings.timeout);
    let mut engines: BTreeMap<SocketAddr, EngineState> = BTreeMap::new();
    // At most 64 threads at once.
    for chunk in addrs.chunks(64) {
        let results: Vec<Scrape> = thread::scope(|sc| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&a| {
                    let agent = agent.clone();
                    sc.spawn(move || scrape::scrape(&agent, a))
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        for s in results {
            engines.entry(s.addr).or_default().apply(&s);
        }
    }
    let taken = now_ms();
    build_snapshot(
        &settings.collector_id,
        SeqGen::default().next(taken),
        taken,
        engines.iter(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::EngineKind;
    use crate::scrape::Failure;

    #[test]
    fn seq_is_monotonic_and_follows_the_clock() {
        let mut g = SeqGen::default();
        assert_eq!(g.next(1000), 1000);
        assert_eq!(g.next(1000), 1001); // same ms
        assert_eq!(g.next(900), 1002); // clock stepped back
        assert_eq!(g.next(5000), 5000); // clock ahead again
        let mut restarted = SeqGen::default();
        assert!(restarted.next(5001) > 5000);
        assert_eq!(SeqGen::default().next(0), 1); // never 0
    }

    /// A peer service's address is this collector's own gateway when it is
    /// local and on a port it pushes to; an address of no interface here
    /// (TEST-NET-1) or another port is a peer.
    #[test]
    fn own_gateway_is_a_local_address_on_an_own_port() {
        let own = |a: &str| is_own_gateway(a.parse().unwrap(), &[10001]);
        assert!(own("127.0.0.1:10001"));
        assert!(!own("127.0.0.1:10002"));
        assert!(!own("192.0.2.1:10001"));
    }

    /// Entries that reach one endpoint keep the first; roles are kept.
    #[test]
    fn one_thread_per_endpoint() {
        let gw = |u: &str| Gateway::parse(u).unwrap();
        let kept = one_per_endpoint([
            gw("http://127.0.0.1:10001"),
            gw("http://127.0.0.1:10001/v1/fleet/snapshot").as_peer(),
            gw("http://10.0.0.2:10001").as_peer(),
        ]);
        let bases: Vec<(&str, bool)> = kept.iter().map(|g| (g.base.as_str(), g.peer)).collect();
        assert_eq!(
            bases,
            [
                ("http://127.0.0.1:10001", false),
                ("http://10.0.0.2:10001", true)
            ]
        );
    }

    /// A gateway that turns from pushed to into a peer keeps its metric
    /// series (its new thread records under the same name); one that goes
    /// away loses them once its thread has ended.
    #[test]
    fn a_role_change_keeps_the_gateways_series() {
        let metrics = Arc::new(Metrics::new());
        let mut p = Pushers {
            map: BTreeMap::new(),
            token: Settings::new(Vec::new(), Vec::new(), Some("t"))
                .token
                .unwrap(),
            timeout: Duration::from_millis(200),
            metrics: Arc::clone(&metrics),
            board: None,
            retired: Vec::new(),
        };
        // Port 9 on loopback: nothing is pushed (no snapshot is offered).
        let gw = Gateway::parse("http://127.0.0.1:9").unwrap();
        let base = gw.base.clone();
        let has_series = || metrics.render().contains(&base);
        p.set([gw.clone()], None);
        metrics.push(&base, "204", 0.001, Some(1));
        assert!(has_series());
        p.set([gw.clone().as_peer()], None);
        assert_eq!(p.map.get(&base).map(|(_, peer)| *peer), Some(true));
        p.reap(true);
        assert!(has_series(), "the role change dropped the series");
        p.set([], None);
        p.reap(true);
        assert!(!has_series(), "a gateway that went away kept its series");
        assert!(p.map.is_empty() && p.retired.is_empty());
    }

    fn scrape(addr: &str, health: Option<u16>, metrics: Option<EngineMetrics>, at: u64) -> Scrape {
        Scrape {
            addr: addr.parse().unwrap(),
            health_status: health,
            failure: if health.is_none() || metrics.is_none() {
                Some(Failure {
                    cause: "timeout",
                    detail: "t".into(),
                })
            } else {
                None
            },
            metrics,
            finished_ms: at,
            duration: Duration::from_millis(1),
        }
    }

    #[test]
    fn failed_scrapes_keep_last_good_metrics_and_age() {
        let m = EngineMetrics {
            engine: Some(EngineKind::Vllm),
            models: vec!["m".into()],
            waiting: Some(1),
            running: Some(2),
            kv_utilization: Some(0.5),
            kv_capacity_tokens: Some(1000),
            block_size: Some(16),
        };
        let mut st = EngineState::default();
        assert!(st.apply(&scrape("10.0.0.1:80", Some(200), Some(m.clone()), 100)));
        assert!(st.ready);
        assert!(!st.apply(&scrape("10.0.0.1:80", Some(200), Some(m.clone()), 200)));
        // Timeout: not ready, old metrics, old scrapedAtMs.
        assert!(st.apply(&scrape("10.0.0.1:80", None, None, 300)));
        let h = st.host_state("10.0.0.1:80".parse().unwrap(), 400);
        assert!(!h.ready);
        assert_eq!(h.scraped_at_ms, 200);
        assert_eq!((h.waiting, h.running, h.kv_utilization), (1, 2, 0.5));
        assert_eq!(h.engine.as_deref(), Some("vllm"));
        // 503 with good metrics: not ready, fresh metrics.
        assert!(!st.apply(&scrape("10.0.0.1:80", Some(503), Some(m), 500)));
        assert_eq!(st.scraped_at_ms, 500);
        assert!(!st.ready);
    }

    #[test]
    fn snapshots_are_sorted_valid_and_clamped() {
        let mut engines = BTreeMap::new();
        let fresh = EngineState {
            reported: true,
            ready: true,
            scraped_at_ms: 2_000, // later than taken: clock stepped back
            ..EngineState::default()
        };
        engines.insert("10.0.0.2:80".parse().unwrap(), fresh);
        engines.insert("[::1]:80".parse().unwrap(), EngineState::default());
        engines.insert("10.0.0.10:80".parse().unwrap(), EngineState::default());
        let s = build_snapshot("c", 7, 1_000, engines.iter());
        s.validate().unwrap();
        let addrs: Vec<&str> = s.hosts.iter().map(|h| h.address.as_str()).collect();
        assert_eq!(addrs, vec!["10.0.0.10:80", "10.0.0.2:80", "[::1]:80"]);
        assert_eq!(s.hosts[1].scraped_at_ms, 1_000);
        assert_eq!(Snapshot::from_json(&s.to_json()), Ok(s));
    }
}

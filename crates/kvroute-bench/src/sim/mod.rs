//! The fleet simulation: routers in front of simulated engines, in virtual
//! time (`kvroute-bench simulate`, `make sim`).
//!
//! ```text
//!   workload (any family, any Mooncake-format trace)
//!        | open loop: sessions start at their own times, turns follow answers
//!        v
//!   gateway 0..K-1  (chosen per request, seeded; or per session)
//!        |  router: kvroute-core's request path, or a modelled peer
//!        v
//!   engines 0..N-1  (kvroute-sim's Scheduler: the same step function the
//!        |           real-time engine server drives)
//!        '--> modelled collector: scrapes every interval, pushes after a delay
//! ```
//!
//! # Time
//!
//! Nothing here reads a clock on the modelled path. Events (an arrival, an
//! engine step ending, a scrape, a push landing, a sample) sit in one queue
//! ordered by modelled time, then by the order they were queued, so the same
//! seed and inputs give the same run, byte for byte. An engine steps back to
//! back while it has work and idles otherwise, exactly as the real-time
//! server's scheduler thread does, but a step takes no real time: the router
//! costs nothing in modelled latency, however slow the host. (The real-time
//! bench turns host contention into modelled latency; see
//! `docs/simulator.md`.)
//!
//! # Engines
//!
//! [`kvroute_sim::engine::sched::Scheduler`]: the paged KV cache with
//! prefix caching and LRU eviction, continuous batching with chunked
//! prefill, preemption and the step-cost model. There is no second engine
//! model: the simulation calls `submit` and `step` where the server's
//! connection and scheduler threads do. Its answers are the engine's
//! generated words, so a next turn carries the history the real client
//! would send.
//!
//! Most steps only decode. When the next steps of an engine can be known
//! in advance (every running sequence decoding, nothing waiting, the
//! blocks there; `Scheduler::decode_run`), they are one event, ending when
//! the first sequence finishes, and are computed lazily: when the run
//! ends, or, when something looks at the engine first (a request routed
//! to it, a scrape, a sample, a router reading its cache), as far as the
//! steps that had started by then (`Scheduler::decode`); the rest are
//! taken again with the new request. That is the same run as one step at
//! a time, byte for byte (`--single-steps` does the latter; a test
//! compares the two), with a fraction of the events.
//!
//! # Gateways and routers
//!
//! A [`routers::Router`] holds the state of K gateway instances. kvroute's
//! ([`routers::Kvroute`]) runs kvroute-core's request path per gateway
//! against its own in-memory shared data: `analyze` of the same JSON body
//! the real client sends, the output-length prior, the snapshot decode
//! (`FleetCache`), `route` with the prefix index and the load table, the
//! release of the prompt part at the first token and of the rest at the
//! end, `usage::observe` on one response in four, and `rates::learn` on
//! the answers whose decisions left a prefill-rate probe, stamped at the
//! first token (`fleet.learnPrefillRates`). The modelled
//! collector turns each engine's figures into the fleet snapshot the real
//! collector pushes, and `ingest::store` takes it in. The peers are models
//! of their documented algorithms and say so in their names.
//!
//! # What is measured
//!
//! The same [`RunSummary`] as the real-time bench (see [`crate::summary`]):
//! the headline hit rate counts prompt tokens cached at each request's
//! first admission; the ceilings and the no-queue TTFT floor are computed on
//! the same requests. The native CPU time of kvroute's decisions is measured
//! around its request path and reported apart from the summary, so that the
//! summary stays deterministic.

pub mod routers;

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::io::IsTerminal;
use std::rc::Rc;
use std::time::Instant;

use serde::Serialize;
use xxhash_rust::xxh64::xxh64;

use kvroute_sim::engine::sched::{
    Decodes, NewRequest, Reading, Scheduler, SeqEvent, StepOutput, Summary,
};
use kvroute_sim::engine::{
    block_hashes, chat_prompt, generated_text, EngineConfig, BLOCK_BYTES, BLOCK_TOKENS,
    BYTES_PER_TOKEN,
};

use crate::ceiling::Blocks;
use crate::engines::{EngineReading, Sample};
use crate::rng::Rng;
use crate::summary::{Done, ObjectiveTally, RunInfo, RunSummary, Tally};
use crate::workload::{Session, Workload};

use routers::{Admission, Request, Router, Ticket};

/// The filter's tick period (src/lib.rs `TICK`), on which a gateway sends
/// held requests on.
const GATEWAY_TICK_S: f64 = 0.1;

/// How requests are spread over the gateway instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Spread {
    /// Each request to a gateway drawn at random (seeded): a Service that
    /// spreads connections, one request per connection.
    Request,
    /// Every request of a session to one gateway (a client that keeps its
    /// connection).
    Session,
}

/// Who scrapes the engines for the gateways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collectors {
    /// One collector pushes every snapshot to every gateway.
    Shared,
    /// One collector per gateway (the sidecar layout), each on its own
    /// phase of the interval.
    PerGateway,
}

/// How to simulate.
#[derive(Debug, Clone)]
pub struct Options {
    pub engines: usize,
    pub gateways: usize,
    pub spread: Spread,
    pub collectors: Collectors,
    pub engine: EngineConfig,
    /// The last this many engines model an A100 80GB
    /// ([`EngineConfig::a100_80gb`]) instead of `engine`: a fleet of two
    /// GPU generations. The no-queue floor stays `engine`'s.
    pub a100_engines: usize,
    pub model: String,
    /// Seeds the gateway spread, the engines' text and the peers' draws.
    pub seed: u64,
    /// Send the session key as `x-session-id` (as the real bench does).
    pub session_header: bool,
    /// Send each conversation as one user message
    /// ([`crate::replay::sent_history`]).
    pub flat_prompt: bool,
    /// Engine timeline sampling interval, modelled seconds (at least the
    /// workload's span / 1000, so that a long run keeps ~1000 samples).
    pub sample_s: f64,
    /// Print progress to stderr.
    pub progress: bool,
    /// Keep a [`Line`] per answered request in [`Outcome::records`].
    pub records: bool,
    /// Step every engine one step at a time, never in decode runs (the
    /// same run, slower: for checking that runs change nothing).
    pub single_steps: bool,
}

/// One answered request of a simulated run (`simulate --records`), in
/// completion order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Line {
    pub session: usize,
    /// The turn's position in its session, from 0.
    pub turn: usize,
    pub gateway: usize,
    pub engine: usize,
    /// Modelled seconds from the start of the run to the send.
    pub sent_s: f64,
    pub ttft_ms: f64,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub prompt_tokens: u64,
    /// Prompt tokens the engine found cached at first admission.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// kvroute's decision reason; absent for the peers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// kvroute's affinity key, in hex; absent for the peers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// kvroute: the prompt's cached part the decision expected on its
    /// primary, in engine tokens (scaled as its answer is,
    /// [`kvroute_core::answers::Expectation::scale`]); absent when it expected
    /// no hit, and for the peers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_cached_tokens: Option<u64>,
}

/// A run's summary, and what is measured outside it.
pub struct Outcome {
    pub summary: RunSummary,
    /// Native CPU time of each kvroute decision, ns (empty for peers).
    pub decision_ns: Vec<u64>,
    /// The router's own counters (kvroute's `kvroute_*`; empty for peers).
    pub counters: std::collections::BTreeMap<String, u64>,
    /// Per objective, the counts behind `summary.objectives`.
    pub classes: BTreeMap<String, ObjectiveTally>,
    /// Wall-clock seconds the simulation took.
    pub wall_s: f64,
    /// Events processed.
    pub events: u64,
    pub steps: u64,
    /// Every answered request, when [`Options::records`] asked for them.
    pub records: Vec<Line>,
}

/// The engines' addresses in snapshots and destination headers. Nothing
/// is sent to them: they only name the replicas.
pub fn engine_address(i: usize) -> String {
    format!("127.1.{}.{}:8000", i / 256, i % 256)
}

#[derive(Debug)]
enum Kind {
    /// The next turn of a session is sent.
    Arrive { session: usize },
    /// An engine that was idle looks for work.
    Wake { engine: usize },
    /// An engine's step, or run of decode steps, ends: its tokens come
    /// out (the output waits in [`Engine`], so that events stay small in
    /// the heap). Stale when the engine's `gen` moved on (a run cut short).
    StepDone { engine: usize, gen: u64 },
    /// A collector scrapes every engine.
    Scrape { collector: usize },
    /// A collector's readings reach a gateway.
    Deliver {
        gateway: usize,
        readings: Rc<Vec<Reading>>,
        taken_s: f64,
    },
    /// The engine timeline is sampled.
    Sample,
    /// A gateway that holds requests looks at its queue (the filter's
    /// 100 ms tick).
    Tick { gateway: usize },
}

struct Event {
    t: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    /// Reversed, so that the max-heap pops the earliest (then first queued).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .t
            .total_cmp(&self.t)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

struct Queue {
    heap: BinaryHeap<Event>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, t: f64, kind: Kind) {
        self.seq += 1;
        self.heap.push(Event {
            t,
            seq: self.seq,
            kind,
        });
    }
}

/// A session's progress.
struct Live {
    next_turn: usize,
    history: Vec<(&'static str, String)>,
    gateway: Option<usize>,
}

/// A request on an engine.
struct Flight {
    session: usize,
    turn: usize,
    gateway: usize,
    ticket: Ticket,
    sent_s: f64,
    first_s: Option<f64>,
    last_s: f64,
    itl_ms: Vec<f64>,
    answer: Vec<u8>,
}

/// The longest run of decode steps taken as one event.
const MAX_RUN: usize = 4096;

struct Engine {
    sched: Scheduler,
    /// A step is in flight (its output is taken when it ends, and the
    /// engine steps on until it has no work).
    stepping: bool,
    /// The output of the single step in flight.
    step: Option<StepOutput>,
    /// A run of decode-only steps in flight, not computed yet: when it
    /// started (its steps' ends are in `ends`). It is computed when it
    /// ends, or as far as it got when something looks at the engine.
    run: Option<f64>,
    ends: Vec<f64>,
    /// The computed part of the run, delivered when its last step ends.
    decodes: Option<Decodes>,
    /// Bumped when a run is cut short, so that its first end event is stale.
    gen: u64,
    /// Steps taken, one by one or in runs.
    steps: u64,
    /// When the step in flight ends (valid while `stepping`, and after
    /// [`Engine::settle`] for a run).
    busy_until: f64,
}

impl Engine {
    fn new(sched: Scheduler) -> Self {
        Self {
            sched,
            stepping: false,
            step: None,
            run: None,
            ends: Vec::new(),
            decodes: None,
            gen: 0,
            steps: 0,
            busy_until: 0.0,
        }
    }

    /// Starts the next step at `now` if there is work (its end time), or a
    /// run of decode-only steps (the end of its last); else the engine
    /// stops stepping.
    fn start_step(&mut self, now: f64, single: bool) -> Option<f64> {
        if !single {
            self.sched.decode_run(now, MAX_RUN, &mut self.ends);
            if let (true, Some(&end)) = (self.ends.len() > 1, self.ends.last()) {
                self.stepping = true;
                self.busy_until = self.ends.first().copied().unwrap_or(end);
                self.run = Some(now);
                return Some(end);
            }
        }
        let Some(out) = self.sched.step(now) else {
            self.stepping = false;
            return None;
        };
        let end = out.end();
        self.stepping = true;
        self.busy_until = end;
        self.steps += 1;
        self.step = Some(out);
        Some(end)
    }

    /// Brings the engine to modelled time `t` before something looks at it
    /// or gives it a request: the steps of its run that started before `t`
    /// are computed (with single steps they would have been), and the rest
    /// are dropped, to be taken again with what `t` brings. Returns the new
    /// end of the step in flight when the run was cut short (the old end's
    /// event is then stale).
    fn settle(&mut self, t: f64) -> Option<f64> {
        let start = self.run.take()?;
        let n = self.ends.len();
        let before = self.ends.get(..n.saturating_sub(1)).unwrap_or_default();
        let started = 1 + before.partition_point(|&e| e < t);
        let d = self.sched.decode(start, started);
        self.steps += d.ends.len() as u64;
        let end = d.ends.last().copied();
        self.busy_until = end.unwrap_or(self.busy_until);
        let cut = d.ends.len() < n;
        self.decodes = Some(d);
        if cut {
            self.gen += 1;
            end
        } else {
            None
        }
    }
}

/// [`Engine::settle`], queueing the new end of a run cut short.
fn settle(engines: &mut [Engine], q: &mut Queue, engine: usize, t: f64) {
    if let Some(e) = engines.get_mut(engine) {
        if let Some(end) = e.settle(t) {
            q.push(end, Kind::StepDone { engine, gen: e.gen });
        }
    }
}

/// [`settle`] for every engine (a scrape, a sample, a router that reads
/// the engines' caches).
fn settle_all(engines: &mut [Engine], q: &mut Queue, t: f64) {
    for engine in 0..engines.len() {
        settle(engines, q, engine, t);
    }
}

/// Each engine's configuration: `engine`, the last `a100_engines` an A100's.
pub fn engine_configs(opts: &Options) -> Vec<EngineConfig> {
    opts.engine.fleet(opts.engines.max(1), opts.a100_engines)
}

/// Each engine's prefill rate ([`EngineConfig::prefill_tokens_per_s`]), for
/// [`routers::Setup::prefill_rates`].
pub fn prefill_rates(opts: &Options) -> Vec<f64> {
    engine_configs(opts)
        .iter()
        .map(EngineConfig::prefill_tokens_per_s)
        .collect()
}

/// Runs `workload` through `router` on a fresh fleet.
pub fn run(workload: &Workload, router: &mut dyn Router, opts: &Options) -> Outcome {
    let wall = Instant::now();
    let n = opts.engines.max(1);
    let k = opts.gateways.max(1);
    let mut engines: Vec<Engine> = engine_configs(opts)
        .into_iter()
        .map(|cfg| Engine::new(Scheduler::new(cfg, opts.seed)))
        .collect();
    let fleet_blocks = engines
        .iter()
        .map(|e| e.sched.config().kv_blocks as u64)
        .sum();
    let mut tally = Tally::new(&opts.engine, fleet_blocks, n);
    let mut records = Vec::new();
    let mut q = Queue {
        heap: BinaryHeap::new(),
        seq: 0,
    };
    let sessions: &[Session] = &workload.sessions;
    let mut live: Vec<Option<Live>> = sessions.iter().map(|_| None).collect();
    let mut open = 0usize;
    for (i, s) in sessions.iter().enumerate() {
        if !s.turns.is_empty() {
            q.push(s.start_ms / 1000.0, Kind::Arrive { session: i });
            open += 1;
        }
    }
    let first_s = sessions
        .iter()
        .map(|s| s.start_ms / 1000.0)
        .fold(f64::INFINITY, f64::min);
    let first_s = if first_s.is_finite() { first_s } else { 0.0 };
    let interval = router.scrape_interval_s();
    let collectors = match opts.collectors {
        Collectors::Shared => 1,
        Collectors::PerGateway => k,
    };
    if let Some(iv) = interval {
        for c in 0..collectors {
            // Sidecar collectors start at different moments of the interval.
            let phase = iv * c as f64 / collectors as f64;
            q.push(first_s + phase, Kind::Scrape { collector: c });
        }
    }
    q.push(first_s, Kind::Sample);
    let mut rng = Rng::new(opts.seed ^ 0x7370_7265_6164);
    let mut flights: HashMap<(usize, u64), Flight> = HashMap::new();
    // Admission control: requests held by a gateway, by handle.
    let mut held: HashMap<u64, Waiting> = HashMap::new();
    let mut next_handle = 0u64;
    let mut ticking = vec![false; k];
    let mut classes: BTreeMap<String, ObjectiveTally> = BTreeMap::new();
    let mut samples = Vec::new();
    let mut last_answer_s = first_s;
    let total = workload.requests();
    let mut sent = 0usize;
    let mut events = 0u64;
    let mut last_print = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let label = router.name();
    let sample_s = opts
        .sample_s
        .max(workload.description.span_s / 1000.0)
        .max(0.01);

    // The run's state, borrowed for one event's work.
    macro_rules! world {
        () => {
            World {
                engines: &mut engines,
                tally: &mut tally,
                flights: &mut flights,
                q: &mut q,
                live: &mut live,
                open: &mut open,
                classes: &mut classes,
                sessions,
                opts,
                records: &mut records,
                last_answer_s: &mut last_answer_s,
            }
        };
    }

    while let Some(ev) = q.heap.pop() {
        events += 1;
        let now = ev.t;
        if opts.progress && last_print.elapsed().as_secs_f64() >= if tty { 0.5 } else { 10.0 } {
            last_print = Instant::now();
            let line = format!(
                "  {label}: {sent}/{total} sent, {} in flight, {:.0} s modelled, {:.1} s wall",
                flights.len(),
                now - first_s,
                wall.elapsed().as_secs_f64()
            );
            if tty {
                eprint!("\r{line}   ");
            } else {
                eprintln!("{line}");
            }
        }
        match ev.kind {
            Kind::Arrive { session } => {
                let Some(s) = sessions.get(session) else {
                    continue;
                };
                let Some(slot) = live.get_mut(session) else {
                    continue;
                };
                let state = slot.get_or_insert_with(|| Live {
                    next_turn: 0,
                    history: s
                        .system
                        .as_ref()
                        .map(|t| vec![("system", t.render(opts.seed))])
                        .unwrap_or_default(),
                    gateway: None,
                });
                let Some(turn) = s.turns.get(state.next_turn) else {
                    continue;
                };
                state.next_turn += 1;
                sent += 1;
                state.history.push(("user", turn.user.render(opts.seed)));
                let gateway = match opts.spread {
                    Spread::Request => rng.below(k as u64) as usize,
                    Spread::Session => *state.gateway.get_or_insert_with(|| {
                        (xxh64(&session.to_le_bytes(), opts.seed) % k as u64) as usize
                    }),
                };
                let max_tokens = (turn.max_tokens as usize).max(1);
                let sent = crate::replay::sent_history(&state.history, opts.flat_prompt);
                let body = crate::replay::chat_body(
                    &opts.model,
                    &sent,
                    u32::try_from(max_tokens).unwrap_or(u32::MAX),
                )
                .unwrap_or_default();
                let prompt = chat_prompt(&sent);
                let class = classes.entry(objective_of(s)).or_default();
                class.requests += 1;
                next_handle += 1;
                let req = Request {
                    body: &body,
                    session: s.key.as_deref().filter(|_| opts.session_header),
                    messages: &sent,
                    prompt: &prompt,
                    model: &opts.model,
                    prompt_tokens: prompt.len().div_ceil(BYTES_PER_TOKEN),
                    max_tokens,
                    objective: s.objective.as_deref(),
                };
                let admission = router.admit(gateway, &req, next_handle, now);
                let mut world = world!();
                match admission {
                    Admission::Go => {
                        world.dispatch(router, session, gateway, Some((body, prompt)), now, now);
                    }
                    Admission::Refuse(status) => world.shed(session, status, now),
                    Admission::Hold { displaced } => {
                        held.insert(
                            next_handle,
                            Waiting {
                                session,
                                arrived_s: now,
                            },
                        );
                        for (h, status) in displaced {
                            if let Some(w) = held.remove(&h) {
                                world.shed(w.session, status, now);
                            }
                        }
                        if let Some(t) = ticking.get_mut(gateway).filter(|t| !**t) {
                            *t = true;
                            q.push(now + GATEWAY_TICK_S, Kind::Tick { gateway });
                        }
                    }
                }
            }
            Kind::Tick { gateway } => {
                let mut world = world!();
                loop {
                    let mut went = false;
                    for (h, status) in router.tick(gateway, now) {
                        let Some(w) = held.remove(&h) else {
                            continue;
                        };
                        match status {
                            None => {
                                went = true;
                                world.dispatch(router, w.session, gateway, None, w.arrived_s, now);
                            }
                            Some(status) => world.shed(w.session, status, now),
                        }
                    }
                    if !went {
                        break;
                    }
                }
                if router.holds(gateway) > 0 {
                    q.push(now + GATEWAY_TICK_S, Kind::Tick { gateway });
                } else if let Some(t) = ticking.get_mut(gateway) {
                    *t = false;
                }
            }
            Kind::Wake { engine } => {
                if let Some(e) = engines.get_mut(engine).filter(|e| !e.stepping) {
                    if let Some(end) = e.start_step(now, opts.single_steps) {
                        q.push(end, Kind::StepDone { engine, gen: e.gen });
                    }
                }
            }
            Kind::StepDone { engine, gen } => {
                let Some(e) = engines.get_mut(engine).filter(|e| e.gen == gen) else {
                    continue;
                };
                // A run nothing looked at is computed now, in full.
                e.settle(now);
                let (step, decodes) = (e.step.take(), e.decodes.take());
                let mut world = world!();
                for ev in step.map(|o| o.events).unwrap_or_default() {
                    match ev {
                        SeqEvent::Token { id, word, done, .. } => {
                            world.tokens(router, engine, id, &word, &[now], done.as_ref());
                        }
                        SeqEvent::Failed { id } => world.failed(router, engine, id, now),
                    }
                }
                if let Some(d) = decodes {
                    for seq in &d.seqs {
                        world.tokens(
                            router,
                            engine,
                            seq.id,
                            &seq.text,
                            &d.ends,
                            seq.done.as_ref(),
                        );
                    }
                }
                if let Some(e) = engines.get_mut(engine) {
                    if let Some(end) = e.start_step(now, opts.single_steps) {
                        q.push(end, Kind::StepDone { engine, gen: e.gen });
                    }
                }
            }
            Kind::Scrape { collector } => {
                if open == 0 {
                    continue;
                }
                settle_all(&mut engines, &mut q, now);
                let readings = Rc::new(
                    engines
                        .iter()
                        .map(|e| e.sched.reading())
                        .collect::<Vec<_>>(),
                );
                let delay = router.scrape_delay_s();
                for gateway in 0..k {
                    if collectors == 1 || gateway == collector {
                        q.push(
                            now + delay,
                            Kind::Deliver {
                                gateway,
                                readings: Rc::clone(&readings),
                                taken_s: now,
                            },
                        );
                    }
                }
                if let Some(iv) = interval {
                    q.push(now + iv, Kind::Scrape { collector });
                }
            }
            Kind::Deliver {
                gateway,
                readings,
                taken_s,
            } => router.on_readings(gateway, &readings, taken_s, now),
            Kind::Sample => {
                settle_all(&mut engines, &mut q, now);
                samples.push(Sample {
                    t_s: now - first_s,
                    engines: engines
                        .iter()
                        .map(|e| Some(engine_reading(&e.sched.reading())))
                        .collect(),
                });
                if open > 0 || !flights.is_empty() {
                    q.push(now + sample_s, Kind::Sample);
                }
            }
        }
    }
    if opts.progress && tty {
        eprintln!();
    }
    let setup = router.setup();
    let mut summary = tally.finish(
        RunInfo {
            router: &label,
            setup: &setup,
            workload: &workload.description,
            time_scale: 0.0,
            gateways: k,
        },
        samples,
        last_answer_s - first_s,
    );
    if sessions.iter().any(|s| s.objective.is_some()) {
        summary.objectives = classes
            .iter()
            .map(|(n, t)| (n.clone(), t.figures(summary.duration_s)))
            .collect();
    }
    Outcome {
        classes,
        summary,
        decision_ns: router.decision_ns(),
        counters: router.counters(),
        wall_s: wall.elapsed().as_secs_f64(),
        events,
        steps: engines.iter().map(|e| e.steps).sum(),
        records,
    }
}

/// A request a gateway holds (admission control).
struct Waiting {
    session: usize,
    /// When the client sent it: its TTFT counts from here.
    arrived_s: f64,
}

fn objective_of(s: &Session) -> String {
    s.objective
        .clone()
        .unwrap_or_else(|| kvroute_core::admit::DEFAULT_OBJECTIVE.to_owned())
}

/// The run's state a turn's dispatch touches.
struct World<'a> {
    engines: &'a mut [Engine],
    tally: &'a mut Tally,
    flights: &'a mut HashMap<(usize, u64), Flight>,
    q: &'a mut Queue,
    live: &'a mut [Option<Live>],
    open: &'a mut usize,
    classes: &'a mut BTreeMap<String, ObjectiveTally>,
    sessions: &'a [Session],
    opts: &'a Options,
    records: &'a mut Vec<Line>,
    last_answer_s: &'a mut f64,
}

impl World<'_> {
    /// Routes the session's current turn (its user message is the last of
    /// its history) through gateway `gateway` and submits it to the chosen
    /// engine. `built`: its body and prompt, when already rendered.
    fn dispatch(
        &mut self,
        router: &mut dyn Router,
        session: usize,
        gateway: usize,
        built: Option<(Vec<u8>, Vec<u8>)>,
        sent_s: f64,
        now: f64,
    ) {
        let opts = self.opts;
        let n = self.engines.len();
        let (Some(s), Some(Some(state))) = (self.sessions.get(session), self.live.get(session))
        else {
            return;
        };
        let Some((at, turn)) = state
            .next_turn
            .checked_sub(1)
            .and_then(|i| Some((i, s.turns.get(i)?)))
        else {
            return;
        };
        let max_tokens = (turn.max_tokens as usize).max(1);
        let sent = crate::replay::sent_history(&state.history, opts.flat_prompt);
        let (body, prompt) = built.unwrap_or_else(|| {
            let body = crate::replay::chat_body(
                &opts.model,
                &sent,
                u32::try_from(max_tokens).unwrap_or(u32::MAX),
            )
            .unwrap_or_default();
            (body, chat_prompt(&sent))
        });
        let prompt_tokens = prompt.len().div_ceil(BYTES_PER_TOKEN);
        let req = Request {
            body: &body,
            session: s.key.as_deref().filter(|_| opts.session_header),
            messages: &sent,
            prompt: &prompt,
            model: &opts.model,
            prompt_tokens,
            max_tokens,
            objective: s.objective.as_deref(),
        };
        if router.reads_engines() {
            settle_all(self.engines, self.q, now);
            let busy: Vec<f64> = self
                .engines
                .iter()
                .map(|e| {
                    if e.stepping {
                        e.busy_until.max(now)
                    } else {
                        now
                    }
                })
                .collect();
            router.engines_free_at(&busy);
        }
        let routed = router.route(gateway, &req, now, &engines_view(self.engines));
        let outcome = routed.and_then(|ticket| {
            settle(self.engines, self.q, ticket.engine, now);
            let e = self
                .engines
                .get_mut(ticket.engine)
                .ok_or_else(|| format!("router named engine {} of {n}", ticket.engine))?;
            let id = e
                .sched
                .submit(
                    NewRequest {
                        model: opts.model.clone(),
                        prompt: prompt.clone(),
                        max_tokens,
                    },
                    now,
                )
                .map_err(|r| format!("engine: refused: {r:?}"))?;
            Ok((ticket, id))
        });
        match outcome {
            Ok((ticket, id)) => {
                // The ceilings see prompt and answer at send time (the
                // answer is a function of the prompt).
                let answer = generated_text(opts.seed, &prompt, max_tokens);
                let mut all = prompt;
                all.extend_from_slice(answer.as_bytes());
                self.tally.sent(&Blocks {
                    hashes: block_hashes(&opts.model, &all),
                    prompt_blocks: prompt_tokens * BYTES_PER_TOKEN / BLOCK_BYTES,
                    prompt_tokens: prompt_tokens as u64,
                });
                let engine = ticket.engine;
                self.flights.insert(
                    (engine, id),
                    Flight {
                        session,
                        turn: at,
                        gateway,
                        ticket,
                        sent_s,
                        first_s: None,
                        last_s: now,
                        itl_ms: Vec::new(),
                        answer: Vec::with_capacity(max_tokens * BYTES_PER_TOKEN),
                    },
                );
                if self.engines.get(engine).is_some_and(|e| !e.stepping) {
                    self.q.push(now, Kind::Wake { engine });
                }
            }
            Err(why) => {
                self.tally.failed(&why);
                self.classes.entry(objective_of(s)).or_default().failed += 1;
                self.give_up(session, now);
            }
        }
    }

    /// Tokens of request `id` on `engine` came out: `words`, 4 bytes each,
    /// the `j`th at `times[j]`; `done` when the last was its last.
    fn tokens(
        &mut self,
        router: &mut dyn Router,
        engine: usize,
        id: u64,
        words: &[u8],
        times: &[f64],
        done: Option<&Summary>,
    ) {
        let Some(f) = self.flights.get_mut(&(engine, id)) else {
            return;
        };
        let mut now = f.last_s;
        for (word, &t) in words.chunks_exact(BYTES_PER_TOKEN).zip(times) {
            now = t;
            f.answer.extend_from_slice(word);
            match f.first_s {
                None => {
                    f.first_s = Some(now);
                    router.first_token(f.gateway, &f.ticket, now);
                }
                Some(_) => f.itl_ms.push(1000.0 * (now - f.last_s)),
            }
            f.last_s = now;
        }
        let Some(summary) = done else {
            return;
        };
        let Some(f) = self.flights.remove(&(engine, id)) else {
            return;
        };
        router.finished(f.gateway, &f.ticket, summary, now);
        let ttft_ms = 1000.0 * (f.first_s.unwrap_or(now) - f.sent_s);
        if let Some(s) = self.sessions.get(f.session) {
            let c = self.classes.entry(objective_of(s)).or_default();
            c.completed += 1;
            c.output_tokens += summary.completion_tokens as u64;
            c.ttft_ms.push(ttft_ms);
        }
        if self.opts.records {
            self.records.push(Line {
                session: f.session,
                turn: f.turn,
                gateway: f.gateway,
                engine,
                sent_s: f.sent_s,
                ttft_ms,
                queue_ms: 1000.0 * summary.queue_s,
                prefill_ms: 1000.0 * summary.prefill_s,
                prompt_tokens: summary.prompt_tokens as u64,
                cached_tokens: summary.cached_tokens as u64,
                completion_tokens: summary.completion_tokens as u64,
                reason: f.ticket.reason,
                key: f.ticket.key.map(|k| format!("{k:016x}")),
                expected_cached_tokens: f.ticket.expectation.as_ref().map(|e| {
                    let scale = e.scale(Some(summary.prompt_tokens as u64));
                    (e.expected_cached as f64 * scale).round() as u64
                }),
            });
        }
        self.tally.completed(
            &Done {
                ttft_ms,
                e2e_ms: 1000.0 * (now - f.sent_s),
                queue_ms: Some(1000.0 * summary.queue_s),
                prefill_ms: Some(1000.0 * summary.prefill_s),
                prompt_tokens: Some(summary.prompt_tokens as u64),
                cached_tokens: Some(summary.cached_tokens as u64),
                completion_tokens: summary.completion_tokens as u64,
                engine: Some(engine as u64),
                gateway: f.gateway,
                session: f.session,
            },
            &f.itl_ms,
        );
        *self.last_answer_s = self.last_answer_s.max(now);
        if let Some(Some(state)) = self.live.get_mut(f.session) {
            let text = String::from_utf8_lossy(&f.answer).into_owned();
            state.history.push(("assistant", text));
        }
        next_turn(self.q, self.sessions, self.live, f.session, now, self.open);
    }

    /// The engine could not serve request `id`.
    fn failed(&mut self, router: &mut dyn Router, engine: usize, id: u64, now: f64) {
        let Some(f) = self.flights.remove(&(engine, id)) else {
            return;
        };
        router.finished_failed(f.gateway, &f.ticket, now);
        if let Some(s) = self.sessions.get(f.session) {
            self.classes.entry(objective_of(s)).or_default().failed += 1;
        }
        self.tally.failed("engine: failed");
        if let Some(Some(state)) = self.live.get_mut(f.session) {
            state.history.pop();
        }
        next_turn(self.q, self.sessions, self.live, f.session, now, self.open);
    }

    /// The gateway answered the session's current turn itself (admission
    /// control): the client goes on to its next turn without an answer.
    fn shed(&mut self, session: usize, status: u16, now: f64) {
        self.tally.failed(&format!(
            "status {status}: shed by the gateway's admission control"
        ));
        if let Some(s) = self.sessions.get(session) {
            self.classes.entry(objective_of(s)).or_default().shed += 1;
        }
        self.give_up(session, now);
    }

    /// The current turn got no answer: it leaves the history.
    fn give_up(&mut self, session: usize, now: f64) {
        if let Some(Some(state)) = self.live.get_mut(session) {
            state.history.pop();
        }
        next_turn(self.q, self.sessions, self.live, session, now, self.open);
    }
}

/// Queues the session's next turn after its think time, or closes it.
fn next_turn(
    q: &mut Queue,
    sessions: &[Session],
    live: &mut [Option<Live>],
    session: usize,
    now: f64,
    open: &mut usize,
) {
    let Some(Some(state)) = live.get_mut(session) else {
        return;
    };
    match sessions
        .get(session)
        .and_then(|s| s.turns.get(state.next_turn))
    {
        Some(turn) => q.push(now + turn.think_ms / 1000.0, Kind::Arrive { session }),
        None => {
            // Done: its history is no longer needed.
            if let Some(slot) = live.get_mut(session) {
                *slot = None;
            }
            *open = open.saturating_sub(1);
        }
    }
}

fn engines_view(engines: &[Engine]) -> Vec<&Scheduler> {
    engines.iter().map(|e| &e.sched).collect()
}

fn engine_reading(r: &Reading) -> EngineReading {
    EngineReading {
        kv: r.kv_usage,
        running: r.running as f64,
        waiting: r.waiting as f64,
        cache_queries: r.prefix_queries as f64,
        cache_hits: r.prefix_hits as f64,
        preemptions: r.preemptions as f64,
        kv_blocks: r.kv_blocks as f64,
        block_size: BLOCK_TOKENS as f64,
        lag_s: 0.0,
    }
}

/// What a run cost to simulate, and kvroute's decision CPU (native, wall
/// clock around its request path inside the simulation).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Timing {
    pub router: String,
    pub requests: u64,
    pub wall_s: f64,
    pub events: u64,
    pub steps: u64,
    /// Decisions timed (kvroute only).
    pub decisions: usize,
    pub decision_mean_us: f64,
    pub decision_p50_us: f64,
    pub decision_p99_us: f64,
    pub counters: std::collections::BTreeMap<String, u64>,
    /// The process's peak resident memory so far (VmHWM), MiB.
    pub peak_rss_mib: f64,
}

/// The process's peak resident set (Linux `VmHWM`), MiB; 0 elsewhere.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// The [`Timing`] of a run.
pub fn timing(o: &Outcome) -> Timing {
    let mut ns = o.decision_ns.clone();
    ns.sort_unstable();
    let at = |q: f64| {
        ns.get(((ns.len() as f64 * q) as usize).min(ns.len().saturating_sub(1)))
            .map_or(0.0, |&v| v as f64 / 1000.0)
    };
    Timing {
        router: o.summary.router.clone(),
        requests: o.summary.requests,
        wall_s: o.wall_s,
        events: o.events,
        steps: o.steps,
        decisions: ns.len(),
        decision_mean_us: if ns.is_empty() {
            0.0
        } else {
            ns.iter().sum::<u64>() as f64 / ns.len() as f64 / 1000.0
        },
        decision_p50_us: at(0.5),
        decision_p99_us: at(0.99),
        counters: o.counters.clone(),
        peak_rss_mib: peak_rss_mib(),
    }
}

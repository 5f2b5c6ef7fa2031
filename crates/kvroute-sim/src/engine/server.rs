//! Engines on sockets: one scheduler thread per engine, one thread per
//! connection, a routing table of small handlers, and the fault switches.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::config::EngineConfig;
use super::fault::{FaultKind, FaultSpec};
use super::metrics;
use super::sched::{NewRequest, Reject, Scheduler, SeqEvent, Summary};
use super::{chat_prompt, BLOCK_TOKENS};
use crate::http::{
    self, write_chunk, write_response, BodyError, Conn, Head, IDLE_TIMEOUT, LAST_CHUNK,
};
use crate::null::DEFAULT_MODEL;

/// Largest request body accepted (413 above).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Output tokens when a request names none.
const DEFAULT_MAX_TOKENS: usize = 16;
/// When the scheduler is this far (modelled seconds) behind the clock, it
/// stops chaining steps back to back and restarts from the clock.
const MAX_LAG_S: f64 = 0.05;

/// Where and what a fleet of engines serves.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Address every engine binds.
    pub host: IpAddr,
    /// First engine's port; engine `i` listens on `base_port + i` (0: free
    /// ports).
    pub base_port: u16,
    /// How many engines.
    pub engines: usize,
    /// Served model names; the first one labels the metrics.
    pub models: Vec<String>,
    /// Scheduler limits and step-time constants of every engine.
    pub engine: EngineConfig,
    /// The last this many engines model an A100 80GB instead
    /// ([`EngineConfig::a100_80gb`], with `engine`'s KV capacity): a fleet
    /// of two GPU generations.
    pub a100_engines: usize,
    /// Modelled seconds per real second.
    pub time_scale: f64,
    /// Seed of the generated text.
    pub seed: u64,
    /// `/health` answers 503 for this long (real time) after start.
    pub startup_delay: Duration,
    /// Scheduled faults.
    pub faults: Vec<FaultSpec>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 8001,
            engines: 4,
            models: vec![DEFAULT_MODEL.to_owned()],
            engine: EngineConfig::default(),
            a100_engines: 0,
            time_scale: 1.0,
            seed: 1,
            startup_delay: Duration::ZERO,
            faults: Vec::new(),
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl FleetConfig {
    fn validate(&self) -> io::Result<()> {
        if self.engines == 0 {
            return Err(invalid("engines = 0: must be at least 1".to_owned()));
        }
        if self.models.is_empty() || self.models.iter().any(String::is_empty) {
            return Err(invalid("model: at least one non-empty name".to_owned()));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(invalid(format!(
                "time_scale = {}: must be a finite number > 0",
                self.time_scale
            )));
        }
        self.engine.validate().map_err(|e| invalid(e.0))?;
        if self.a100_engines > self.engines {
            return Err(invalid(format!(
                "a100_engines = {}: more than the {} engines",
                self.a100_engines, self.engines
            )));
        }
        for f in &self.faults {
            if f.engine >= self.engines {
                return Err(invalid(format!(
                    "fault engine={}: only {} engines",
                    f.engine, self.engines
                )));
            }
        }
        Ok(())
    }
}

/// Modelled time: real time since start times the scale.
#[derive(Debug)]
struct Clock {
    start: Instant,
    scale: f64,
}

impl Clock {
    /// Modelled seconds since start.
    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.scale
    }

    /// The real instant at modelled time `t`.
    fn instant_at(&self, t: f64) -> Instant {
        // A year stands in for "never" when t is out of range.
        let never = Duration::from_secs(365 * 24 * 3600);
        let real = Duration::try_from_secs_f64((t / self.scale).max(0.0)).unwrap_or(never);
        self.start
            .checked_add(real)
            .or_else(|| Instant::now().checked_add(never))
            .unwrap_or(self.start)
    }

    /// Real time that `dt` modelled seconds take.
    fn real(&self, dt: f64) -> Duration {
        Duration::try_from_secs_f64((dt / self.scale).max(0.0)).unwrap_or(Duration::MAX / 4)
    }
}

fn micros(t: f64) -> u64 {
    // Saturating float-to-int cast; t is modelled seconds >= 0.
    (t * 1e6) as u64
}

/// What the scheduler thread sends a request's connection thread.
enum Msg {
    Token {
        word: [u8; 4],
        done: Option<Summary>,
    },
    Failed,
}

struct Core {
    sched: Scheduler,
    senders: HashMap<u64, Sender<Msg>>,
    /// Latest arrival (modelled seconds).
    last_arrival: f64,
}

/// One engine, shared by its scheduler, acceptor and connection threads.
struct Engine {
    index: usize,
    addr: SocketAddr,
    models: Vec<String>,
    clock: Arc<Clock>,
    started: Instant,
    startup_delay: Duration,
    core: Mutex<Core>,
    wake: Condvar,
    dead: AtomicBool,
    /// Modelled microseconds until which the engine stalls / errors.
    stall_until: AtomicU64,
    error_until: AtomicU64,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    /// Modelled microseconds the scheduler fell behind the clock while it
    /// had work (the machine could not keep up with the time scale).
    lag_us: AtomicU64,
}

impl Engine {
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn model(&self) -> &str {
        self.models.first().map_or(DEFAULT_MODEL, String::as_str)
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    fn erroring(&self) -> bool {
        self.error_until.load(Ordering::SeqCst) > micros(self.clock.now())
    }

    fn starting(&self) -> bool {
        self.started.elapsed() < self.startup_delay
    }

    /// Applies a fault now, for `for_s` modelled seconds.
    fn apply(&self, kind: FaultKind, for_s: f64) {
        let until = micros(self.clock.now() + for_s.max(0.0));
        match kind {
            FaultKind::Die => self.die(),
            FaultKind::Stall => {
                self.stall_until.fetch_max(until, Ordering::SeqCst);
                self.wake.notify_all();
            }
            FaultKind::Error => {
                self.error_until.fetch_max(until, Ordering::SeqCst);
            }
        }
    }

    /// Stops listening, cuts every connection and ends the scheduler.
    fn die(&self) {
        self.dead.store(true, Ordering::SeqCst);
        self.lock().senders.clear();
        self.wake.notify_all();
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(PoisonError::into_inner));
        for (_, c) in conns {
            let _ = c.shutdown(Shutdown::Both);
        }
        // Wake the blocking accept so the listener is dropped.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }

    /// Blocks while a stall is on (no answers during a stall).
    fn wait_while_stalled(&self) {
        loop {
            let now = self.clock.now();
            let until = self.stall_until.load(Ordering::SeqCst) as f64 / 1e6;
            if until <= now || self.is_dead() {
                return;
            }
            thread::sleep(self.clock.real(until - now).min(Duration::from_millis(20)));
        }
    }
}

/// Running engines; [`EngineFleet::shutdown`] stops them.
pub struct EngineFleet {
    addrs: Vec<SocketAddr>,
    engines: Vec<Arc<Engine>>,
    threads: Vec<JoinHandle<()>>,
}

impl EngineFleet {
    /// Binds every engine (all or nothing) and starts serving.
    pub fn start(cfg: &FleetConfig) -> io::Result<Self> {
        cfg.validate()?;
        let mut listeners = Vec::with_capacity(cfg.engines);
        for i in 0..cfg.engines {
            let port = if cfg.base_port == 0 {
                0
            } else {
                u16::try_from(usize::from(cfg.base_port) + i).map_err(|_| {
                    invalid(format!(
                        "base port {} + {} engines exceeds 65535",
                        cfg.base_port, cfg.engines
                    ))
                })?
            };
            let addr = SocketAddr::new(cfg.host, port);
            let listener = TcpListener::bind(addr)
                .map_err(|e| io::Error::new(e.kind(), format!("bind {addr}: {e}")))?;
            listeners.push(listener);
        }
        let configs = cfg.engine.fleet(cfg.engines, cfg.a100_engines);
        let clock = Arc::new(Clock {
            start: Instant::now(),
            scale: cfg.time_scale,
        });
        let mut fleet = Self {
            addrs: Vec::with_capacity(cfg.engines),
            engines: Vec::with_capacity(cfg.engines),
            threads: Vec::new(),
        };
        for (index, listener) in listeners.into_iter().enumerate() {
            let addr = listener.local_addr()?;
            let engine = Arc::new(Engine {
                index,
                addr,
                models: cfg.models.clone(),
                clock: Arc::clone(&clock),
                started: clock.start,
                startup_delay: cfg.startup_delay,
                core: Mutex::new(Core {
                    sched: Scheduler::new(
                        configs
                            .get(index)
                            .cloned()
                            .unwrap_or_else(|| cfg.engine.clone()),
                        cfg.seed,
                    ),
                    senders: HashMap::new(),
                    last_arrival: 0.0,
                }),
                wake: Condvar::new(),
                dead: AtomicBool::new(false),
                stall_until: AtomicU64::new(0),
                error_until: AtomicU64::new(0),
                conns: Mutex::new(HashMap::new()),
                next_conn: AtomicU64::new(0),
                lag_us: AtomicU64::new(0),
            });
            let e = Arc::clone(&engine);
            fleet.threads.push(
                thread::Builder::new()
                    .name(format!("engine-{index}-sched"))
                    .spawn(move || run_scheduler(&e))?,
            );
            let e = Arc::clone(&engine);
            fleet.threads.push(
                thread::Builder::new()
                    .name(format!("engine-{index}-accept"))
                    .spawn(move || accept_loop(&listener, &e))?,
            );
            fleet.addrs.push(addr);
            fleet.engines.push(engine);
        }
        if !cfg.faults.is_empty() {
            let mut faults = cfg.faults.clone();
            faults.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
            let engines = fleet.engines.clone();
            // Detached: it ends after the last fault.
            thread::Builder::new()
                .name("engine-faults".to_owned())
                .spawn(move || {
                    for f in faults {
                        let at = clock.instant_at(f.at_s);
                        let wait = at.saturating_duration_since(Instant::now());
                        thread::sleep(wait);
                        if let Some(e) = engines.get(f.engine) {
                            e.apply(f.kind, f.for_s);
                        }
                    }
                })?;
        }
        Ok(fleet)
    }

    /// The engines' addresses, in index order.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Blocks while the engines serve: until the process is stopped (an
    /// engine that dies by a fault does not end it).
    pub fn join(self) {
        for h in self.threads {
            let _ = h.join();
        }
        loop {
            thread::park();
        }
    }

    /// Stops every engine and waits for their threads.
    pub fn shutdown(self) {
        for e in &self.engines {
            e.die();
        }
        for h in self.threads {
            let _ = h.join();
        }
    }
}

fn run_scheduler(e: &Engine) {
    let mut vend = 0.0f64;
    // Whether the last step left work behind (so a late start is lag, not idling).
    let mut pending = false;
    loop {
        let out = {
            let mut core = e.lock();
            loop {
                if e.is_dead() {
                    return;
                }
                let now = e.clock.now();
                let stall = e.stall_until.load(Ordering::SeqCst) as f64 / 1e6;
                if stall > now {
                    let wait = e.clock.real(stall - now).min(Duration::from_millis(50));
                    core = e
                        .wake
                        .wait_timeout(core, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    continue;
                }
                if core.sched.has_work() {
                    break;
                }
                core = e.wake.wait(core).unwrap_or_else(PoisonError::into_inner);
            }
            let now = e.clock.now();
            // Back to back while busy (so real sleep overheads do not add
            // up), from the clock after idling or when falling behind.
            let start = if now - vend > MAX_LAG_S {
                if pending {
                    let late = ((now - vend) * 1e6) as u64;
                    e.lag_us.fetch_add(late, Ordering::Relaxed);
                }
                now
            } else {
                vend.max(core.last_arrival.min(now))
            };
            let out = core.sched.step(start);
            pending = core.sched.has_work();
            out
        };
        let Some(out) = out else {
            continue;
        };
        vend = out.end();
        let wait = e
            .clock
            .instant_at(vend)
            .saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            thread::sleep(wait);
        }
        let mut core = e.lock();
        let mut gone = Vec::new();
        for ev in out.events {
            let (id, msg, last) = match ev {
                SeqEvent::Token { id, word, done, .. } => {
                    (id, Msg::Token { word, done }, done.is_some())
                }
                SeqEvent::Failed { id } => (id, Msg::Failed, true),
            };
            let sent = core.senders.get(&id).map(|tx| tx.send(msg).is_ok());
            if sent == Some(false) && !last {
                gone.push(id);
            }
            if last || sent == Some(false) {
                core.senders.remove(&id);
            }
        }
        for id in gone {
            core.sched.abort(id);
        }
    }
}

fn accept_loop(listener: &TcpListener, e: &Arc<Engine>) {
    let shared = Arc::clone(e);
    http::accept_loop(
        listener,
        "engine-conn",
        512 * 1024,
        || e.is_dead(),
        move |stream| {
            let _ = serve(stream, &shared);
        },
    );
}

fn serve(stream: TcpStream, e: &Engine) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    let peer = stream.peer_addr()?;
    let id = e.next_conn.fetch_add(1, Ordering::Relaxed);
    e.conns
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(id, stream.try_clone()?);
    if e.is_dead() {
        let _ = stream.shutdown(Shutdown::Both);
    }
    let result = serve_requests(Conn::new(stream), e, peer);
    if let Some(s) = e
        .conns
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&id)
    {
        let _ = s.shutdown(Shutdown::Both);
    }
    result
}

fn serve_requests(mut conn: Conn, e: &Engine, peer: SocketAddr) -> io::Result<()> {
    let mut out = Vec::with_capacity(4096);
    while let Some(head) = conn.head()? {
        e.wait_while_stalled();
        if e.is_dead() {
            return Ok(());
        }
        let body = match conn.read_body(&head, MAX_BODY_BYTES) {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                out.clear();
                let body = error_json(
                    &format!("request body over {MAX_BODY_BYTES} bytes"),
                    "BadRequestError",
                    413,
                );
                write_response(
                    &mut out,
                    "413 Payload Too Large",
                    "application/json",
                    body.as_bytes(),
                    false,
                    false,
                );
                conn.stream.write_all(&out)?;
                return Ok(());
            }
            Err(BodyError::Io(err)) => return Err(err),
        };
        let req = Request {
            head: &head,
            body: &body,
            peer,
        };
        let keep = head.keep_alive;
        let head_only = head.method == "HEAD";
        let reply = match find_route(&head) {
            Ok(Action::Simple(f)) => f(e, &req),
            Ok(Action::Local(f)) if req.peer.ip().is_loopback() => f(e, &req),
            Ok(Action::Local(_)) => Reply::error("loopback only", "ForbiddenError", 403),
            Ok(Action::Completion { chat }) => {
                match completion(&mut conn, e, &req, chat)? {
                    Some(reply) => reply,
                    // Streamed: already written.
                    None => {
                        if !keep {
                            return Ok(());
                        }
                        continue;
                    }
                }
            }
            Err(reply) => reply,
        };
        out.clear();
        write_response(
            &mut out,
            reply.status,
            reply.ctype,
            &reply.body,
            keep,
            head_only,
        );
        conn.stream.write_all(&out)?;
        if reply.then_die {
            e.die();
            return Ok(());
        }
        if !keep {
            break;
        }
    }
    Ok(())
}

/// One parsed request, as handlers see it.
struct Request<'a> {
    head: &'a Head,
    body: &'a [u8],
    peer: SocketAddr,
}

/// A whole (non-streamed) answer.
struct Reply {
    status: &'static str,
    ctype: &'static str,
    body: Vec<u8>,
    /// Die once this is written (`/_sim/fault` with kind die).
    then_die: bool,
}

impl Reply {
    fn json(status: &'static str, v: &Value) -> Self {
        Self {
            status,
            ctype: "application/json",
            body: v.to_string().into_bytes(),
            then_die: false,
        }
    }

    fn ok_json(v: &Value) -> Self {
        Self::json("200 OK", v)
    }

    fn text(status: &'static str, body: &str) -> Self {
        Self {
            status,
            ctype: "text/plain; charset=utf-8",
            body: body.as_bytes().to_vec(),
            then_die: false,
        }
    }

    /// An OpenAI/vLLM-style error object.
    fn error(message: &str, kind: &str, code: u16) -> Self {
        Self {
            status: status_line(code),
            ctype: "application/json",
            body: error_json(message, kind, code).into_bytes(),
            then_die: false,
        }
    }
}

fn status_line(code: u16) -> &'static str {
    match code {
        400 => "400 Bad Request",
        403 => "403 Forbidden",
        404 => "404 Not Found",
        405 => "405 Method Not Allowed",
        413 => "413 Payload Too Large",
        503 => "503 Service Unavailable",
        _ => "500 Internal Server Error",
    }
}

fn error_json(message: &str, kind: &str, code: u16) -> String {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}}).to_string()
}

type Handler = fn(&Engine, &Request<'_>) -> Reply;

#[derive(Clone, Copy)]
enum Action {
    /// A small whole answer.
    Simple(Handler),
    /// Like Simple, for loopback peers only (test controls).
    Local(Handler),
    /// A completion, maybe streamed.
    Completion { chat: bool },
}

struct Route {
    method: &'static str,
    path: &'static str,
    action: Action,
}

/// Every endpoint. Peer routers poll several of these; to add one, add a
/// row and a small handler.
const ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/chat/completions",
        action: Action::Completion { chat: true },
    },
    Route {
        method: "POST",
        path: "/v1/completions",
        action: Action::Completion { chat: false },
    },
    Route {
        method: "GET",
        path: "/v1/models",
        action: Action::Simple(models),
    },
    Route {
        method: "GET",
        path: "/health",
        action: Action::Simple(health),
    },
    Route {
        method: "GET",
        path: "/health_generate",
        action: Action::Simple(health),
    },
    Route {
        method: "GET",
        path: "/metrics",
        action: Action::Simple(metrics_text),
    },
    // vllm-router's cache_aware policy renders every request on every
    // worker (falling back to /tokenize) and matches on the token ids.
    Route {
        method: "POST",
        path: "/v1/chat/completions/render",
        action: Action::Simple(render_chat),
    },
    Route {
        method: "POST",
        path: "/v1/completions/render",
        action: Action::Simple(render_completion),
    },
    Route {
        method: "POST",
        path: "/tokenize",
        action: Action::Simple(tokenize),
    },
    // sglang-router asks /server_info and /model_info first.
    Route {
        method: "GET",
        path: "/model_info",
        action: Action::Simple(model_info),
    },
    Route {
        method: "GET",
        path: "/server_info",
        action: Action::Simple(server_info),
    },
    Route {
        method: "GET",
        path: "/get_model_info",
        action: Action::Simple(model_info),
    },
    Route {
        method: "GET",
        path: "/get_server_info",
        action: Action::Simple(server_info),
    },
    Route {
        method: "GET",
        path: "/get_load",
        action: Action::Simple(get_load),
    },
    Route {
        method: "GET",
        path: "/v1/loads",
        action: Action::Simple(loads),
    },
    Route {
        method: "POST",
        path: "/flush_cache",
        action: Action::Simple(flush_cache),
    },
    Route {
        method: "GET",
        path: "/version",
        action: Action::Simple(version),
    },
    Route {
        method: "POST",
        path: "/_sim/fault",
        action: Action::Local(sim_fault),
    },
    Route {
        method: "POST",
        path: "/_sim/reset",
        action: Action::Local(sim_reset),
    },
];

fn find_route(head: &Head) -> Result<Action, Reply> {
    let path = head.route_path();
    let method = if head.method == "HEAD" {
        "GET"
    } else {
        head.method.as_str()
    };
    let mut known = false;
    for r in ROUTES {
        if r.path == path {
            if r.method == method {
                return Ok(r.action);
            }
            known = true;
        }
    }
    Err(if known {
        Reply::error("Method Not Allowed", "MethodNotAllowedError", 405)
    } else {
        Reply::error("Not Found", "NotFoundError", 404)
    })
}

fn models(e: &Engine, _: &Request<'_>) -> Reply {
    let max_len = e.lock().sched.max_seq_tokens();
    let data: Vec<Value> = e
        .models
        .iter()
        .map(|m| {
            json!({"id": m, "object": "model", "created": 0, "owned_by": "kvroute-sim",
                   "root": m, "parent": null, "max_model_len": max_len})
        })
        .collect();
    Reply::ok_json(&json!({"object": "list", "data": data}))
}

fn health(e: &Engine, _: &Request<'_>) -> Reply {
    if e.starting() || e.erroring() {
        Reply::text("503 Service Unavailable", "")
    } else {
        Reply::text("200 OK", "")
    }
}

fn metrics_text(e: &Engine, _: &Request<'_>) -> Reply {
    let text = {
        let core = e.lock();
        let mut text = metrics::render(e.model(), &core.sched.gauges(), core.sched.stats());
        let lag = e.lag_us.load(Ordering::Relaxed) as f64 / 1e6;
        text.push_str(&format!(
            "# HELP kvroute_sim_lag_seconds_total Modelled seconds the scheduler fell behind the clock while busy (the host could not keep up with --time-scale).\n\
             # TYPE kvroute_sim_lag_seconds_total counter\n\
             kvroute_sim_lag_seconds_total {lag}\n"
        ));
        text
    };
    Reply {
        status: "200 OK",
        ctype: "text/plain; version=0.0.4; charset=utf-8",
        body: text.into_bytes(),
        then_die: false,
    }
}

// No `model_path` or `tokenizer_path` here or in `server_info`: given one,
// sglang-router tries to download that tokenizer from the Hugging Face hub.
fn model_info(e: &Engine, _: &Request<'_>) -> Reply {
    Reply::ok_json(&json!({
        "served_model_name": e.model(), "is_generation": true
    }))
}

/// Token ids of a prompt: one per 4 bytes (the simulator's tokenizer),
/// the bytes read as a little-endian number folded into a Llama-3-sized
/// vocabulary (128,256 ids, from the model's config.json).
fn token_ids(prompt: &[u8]) -> Vec<u32> {
    prompt
        .chunks(super::prompt::BYTES_PER_TOKEN)
        .map(|c| {
            let mut b = [0u8; 4];
            for (d, s) in b.iter_mut().zip(c) {
                *d = *s;
            }
            u32::from_le_bytes(b) % 128_256
        })
        .collect()
}

fn render(e: &Engine, req: &Request<'_>, chat: bool) -> Reply {
    match parse_ask(e, req.body, chat) {
        Ok(ask) => {
            Reply::ok_json(&json!({"model": ask.model, "token_ids": token_ids(&ask.prompt)}))
        }
        Err(r) => r,
    }
}

fn render_chat(e: &Engine, req: &Request<'_>) -> Reply {
    render(e, req, true)
}

fn render_completion(e: &Engine, req: &Request<'_>) -> Reply {
    render(e, req, false)
}

/// vLLM's `/tokenize`: `messages` (chat) or `prompt`.
fn tokenize(e: &Engine, req: &Request<'_>) -> Reply {
    let chat = serde_json::from_slice::<Value>(req.body)
        .ok()
        .is_some_and(|v| v.get("messages").is_some());
    match parse_ask(e, req.body, chat) {
        Ok(ask) => {
            let tokens = token_ids(&ask.prompt);
            let max_len = e.lock().sched.max_seq_tokens();
            Reply::ok_json(
                &json!({"count": tokens.len(), "max_model_len": max_len, "tokens": tokens}),
            )
        }
        Err(r) => r,
    }
}

fn server_info(e: &Engine, _: &Request<'_>) -> Reply {
    let core = e.lock();
    let c = core.sched.config();
    Reply::ok_json(&json!({
        "served_model_name": e.model(),
        "tp_size": 1,
        "max_total_num_tokens": c.kv_blocks * BLOCK_TOKENS,
        "page_size": BLOCK_TOKENS,
        "max_running_requests": c.max_num_seqs,
        "chunked_prefill_size": c.max_num_batched_tokens,
        "context_length": core.sched.max_seq_tokens(),
        "dp_size": 1,
        "version": version_string(),
    }))
}

/// SGLang's legacy `/get_load` shape: one object per data-parallel rank.
fn get_load(e: &Engine, _: &Request<'_>) -> Reply {
    let core = e.lock();
    let (running, waiting) = core.sched.counts();
    Reply::ok_json(&json!([{
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": core.sched.token_load(),
    }]))
}

/// SGLang's `/v1/loads`: an aggregate and per-rank loads.
fn loads(e: &Engine, _: &Request<'_>) -> Reply {
    let core = e.lock();
    let (running, waiting) = core.sched.counts();
    let tokens = core.sched.token_load();
    Reply::ok_json(&json!({
        "aggregate": {"total_tokens": tokens, "num_running_reqs": running,
                      "num_waiting_reqs": waiting},
        "loads": [{"dp_rank": 0, "num_total_tokens": tokens, "num_running_reqs": running,
                   "num_waiting_reqs": waiting}],
    }))
}

fn flush_cache(e: &Engine, _: &Request<'_>) -> Reply {
    e.lock().sched.flush_cache();
    Reply::text("200 OK", "Cache flushed.\n")
}

fn version_string() -> String {
    format!("kvroute-sim {}", env!("CARGO_PKG_VERSION"))
}

fn version(_: &Engine, _: &Request<'_>) -> Reply {
    Reply::ok_json(&json!({"version": version_string()}))
}

/// `POST /_sim/fault {"kind": "die"|"stall"|"error", "for_s": seconds}`.
fn sim_fault(e: &Engine, req: &Request<'_>) -> Reply {
    let Ok(v) = serde_json::from_slice::<Value>(req.body) else {
        return Reply::error("body: not JSON", "BadRequestError", 400);
    };
    let Some(kind) = v
        .get("kind")
        .and_then(Value::as_str)
        .and_then(FaultKind::parse)
    else {
        return Reply::error("kind: one of die, stall, error", "BadRequestError", 400);
    };
    let for_s = match v.get("for_s") {
        None | Some(Value::Null) => 0.0,
        Some(x) => match x.as_f64() {
            Some(s) if s.is_finite() && s >= 0.0 => s,
            _ => return Reply::error("for_s: a number >= 0", "BadRequestError", 400),
        },
    };
    if kind == FaultKind::Die {
        let mut r = Reply::ok_json(&json!({"applied": "die"}));
        r.then_die = true;
        return r;
    }
    e.apply(kind, for_s);
    let name = if kind == FaultKind::Stall {
        "stall"
    } else {
        "error"
    };
    Reply::ok_json(&json!({"applied": name, "for_s": for_s}))
}

fn sim_reset(e: &Engine, _: &Request<'_>) -> Reply {
    e.lock().sched.reset();
    e.lag_us.store(0, Ordering::Relaxed);
    Reply::ok_json(&json!({"reset": true}))
}

/// What a completion request asks for.
struct Ask {
    model: String,
    prompt: Vec<u8>,
    max_tokens: usize,
    stream: bool,
}

/// Text of a message's `content`: a string, null, or an array of parts
/// whose `text` fields are concatenated.
fn content_text(v: Option<&Value>) -> Result<String, String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect()),
        Some(_) => Err("content: a string or an array of parts".to_owned()),
    }
}

fn parse_ask(e: &Engine, body: &[u8], chat: bool) -> Result<Ask, Reply> {
    let bad = |m: String| Reply::error(&m, "BadRequestError", 400);
    let v: Value =
        serde_json::from_slice(body).map_err(|err| bad(format!("invalid JSON: {err}")))?;
    if !v.is_object() {
        return Err(bad("body: a JSON object".to_owned()));
    }
    let model = match v.get("model") {
        None | Some(Value::Null) => e.model().to_owned(),
        Some(Value::String(m)) => {
            if !e.models.iter().any(|s| s == m) {
                return Err(Reply::error(
                    &format!("The model `{m}` does not exist."),
                    "NotFoundError",
                    404,
                ));
            }
            m.clone()
        }
        Some(_) => return Err(bad("model: a string".to_owned())),
    };
    let prompt = if chat {
        let msgs = v
            .get("messages")
            .and_then(Value::as_array)
            .filter(|m| !m.is_empty())
            .ok_or_else(|| bad("messages: a non-empty array is required".to_owned()))?;
        let mut pairs = Vec::with_capacity(msgs.len());
        for m in msgs {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("messages[].role: a string is required".to_owned()))?;
            pairs.push((
                role.to_owned(),
                content_text(m.get("content")).map_err(bad)?,
            ));
        }
        chat_prompt(&pairs)
    } else {
        match v.get("prompt") {
            Some(Value::String(s)) => s.as_bytes().to_vec(),
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
                .iter()
                .filter_map(Value::as_str)
                .collect::<String>()
                .into_bytes(),
            _ => return Err(bad("prompt: a string or an array of strings".to_owned())),
        }
    };
    let max_tokens = match v
        .get("max_completion_tokens")
        .filter(|x| !x.is_null())
        .or_else(|| v.get("max_tokens").filter(|x| !x.is_null()))
    {
        None => DEFAULT_MAX_TOKENS,
        Some(x) => match x.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) if n >= 1 => n,
            _ => return Err(bad("max_tokens: an integer >= 1".to_owned())),
        },
    };
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("stream: a boolean".to_owned())),
    };
    Ok(Ask {
        model,
        prompt,
        max_tokens,
        stream,
    })
}

fn reject_reply(r: &Reject) -> Reply {
    match r {
        Reject::EmptyPrompt => Reply::error("The prompt is empty.", "BadRequestError", 400),
        Reject::TooLong {
            prompt_tokens,
            max_tokens,
            limit,
        } => Reply::error(
            &format!(
                "This engine holds at most {limit} tokens per request. However, you \
                 requested {} tokens ({prompt_tokens} in the messages, {max_tokens} in the \
                 completion). Please reduce the length of the messages or completion.",
                prompt_tokens + max_tokens
            ),
            "BadRequestError",
            400,
        ),
    }
}

/// Queues a request; its tokens arrive on the receiver.
fn submit(e: &Engine, ask: &Ask) -> Result<Receiver<Msg>, Reply> {
    let (tx, rx) = mpsc::channel();
    {
        let mut core = e.lock();
        if e.is_dead() {
            return Err(Reply::error(
                "engine stopped",
                "ServiceUnavailableError",
                503,
            ));
        }
        let now = e.clock.now();
        let req = NewRequest {
            model: ask.model.clone(),
            prompt: ask.prompt.clone(),
            max_tokens: ask.max_tokens,
        };
        let id = core.sched.submit(req, now).map_err(|r| reject_reply(&r))?;
        core.senders.insert(id, tx);
        core.last_arrival = core.last_arrival.max(now);
    }
    e.wake.notify_all();
    Ok(rx)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `usage` and the `kvroute_sim` extension of a finished request.
fn usage_fields(e: &Engine, s: &Summary) -> (Value, Value) {
    let usage = json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    });
    let ext = json!({
        "engine": e.index,
        "queue_ms": s.queue_s * 1e3,
        "prefill_ms": s.prefill_s * 1e3,
        "e2e_ms": s.e2e_s * 1e3,
        "cached_tokens": s.cached_tokens,
        "preempted": s.preempted,
    });
    (usage, ext)
}

/// Serves a completion. Returns the whole reply, or None when it was
/// streamed onto the connection already.
fn completion(
    conn: &mut Conn,
    e: &Engine,
    req: &Request<'_>,
    chat: bool,
) -> io::Result<Option<Reply>> {
    if e.erroring() {
        return Ok(Some(Reply::error(
            "simulated engine error",
            "ServiceUnavailableError",
            503,
        )));
    }
    let ask = match parse_ask(e, req.body, chat) {
        Ok(a) => a,
        Err(r) => return Ok(Some(r)),
    };
    let rx = match submit(e, &ask) {
        Ok(rx) => rx,
        Err(r) => return Ok(Some(r)),
    };
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let (id, object) = if chat {
        (format!("chatcmpl-kvsim-{}-{n}", e.index), "chat.completion")
    } else {
        (format!("cmpl-kvsim-{}-{n}", e.index), "text_completion")
    };
    let created = unix_now();
    if !ask.stream {
        let mut text = String::with_capacity(ask.max_tokens * 4);
        let summary = loop {
            match rx.recv() {
                Ok(Msg::Token { word, done }) => {
                    text.extend(word.iter().map(|&b| char::from(b)));
                    if let Some(s) = done {
                        break s;
                    }
                }
                Ok(Msg::Failed) => {
                    return Ok(Some(Reply::error(
                        "the engine could not schedule the request",
                        "InternalServerError",
                        500,
                    )))
                }
                Err(_) => return Err(io::Error::other("engine stopped")),
            }
        };
        let (usage, ext) = usage_fields(e, &summary);
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
        };
        return Ok(Some(Reply::ok_json(&json!({
            "id": id, "object": object, "created": created, "model": ask.model,
            "choices": [choice], "usage": usage, "kvroute_sim": ext,
        }))));
    }
    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut out = Vec::with_capacity(1024);
    out.extend_from_slice(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
          transfer-encoding: chunked\r\n",
    );
    out.extend_from_slice(if req.head.keep_alive {
        b"connection: keep-alive\r\n\r\n"
    } else {
        b"connection: close\r\n\r\n"
    });
    let event = |out: &mut Vec<u8>, v: &Value| {
        let data = format!("data: {v}\n\n");
        write_chunk(out, data.as_bytes());
    };
    // The headers go out now, as vLLM's do; the role chunk (chat) goes with
    // the first token, as vLLM sends it once the engine has produced one.
    conn.stream.write_all(&out)?;
    let mut role = chat;
    loop {
        let first = rx.recv().map_err(|_| io::Error::other("engine stopped"))?;
        out.clear();
        if std::mem::take(&mut role) {
            event(
                &mut out,
                &json!({"id": id, "object": chunk_object, "created": created, "model": ask.model,
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": null, "finish_reason": null}]}),
            );
        }
        let mut finished = None;
        // One event per token; tokens already waiting go out in one write.
        for msg in std::iter::once(first).chain(rx.try_iter()) {
            match msg {
                Msg::Token { word, done } => {
                    let text: String = word.iter().map(|&b| char::from(b)).collect();
                    let finish = if done.is_some() {
                        Value::from("length")
                    } else {
                        Value::Null
                    };
                    let choice = if chat {
                        json!({"index": 0, "delta": {"content": text}, "logprobs": null,
                               "finish_reason": finish})
                    } else {
                        json!({"index": 0, "text": text, "logprobs": null,
                               "finish_reason": finish})
                    };
                    event(
                        &mut out,
                        &json!({"id": id, "object": chunk_object, "created": created,
                                "model": ask.model, "choices": [choice]}),
                    );
                    if done.is_some() {
                        finished = done;
                    }
                }
                Msg::Failed => {
                    event(
                        &mut out,
                        &serde_json::from_str::<Value>(&error_json(
                            "the engine could not schedule the request",
                            "InternalServerError",
                            500,
                        ))
                        .unwrap_or(Value::Null),
                    );
                    out.extend_from_slice(&done_and_end());
                    conn.stream.write_all(&out)?;
                    return Ok(None);
                }
            }
        }
        if let Some(s) = finished {
            let (usage, ext) = usage_fields(e, &s);
            event(
                &mut out,
                &json!({"id": id, "object": chunk_object, "created": created,
                        "model": ask.model, "choices": [], "usage": usage,
                        "kvroute_sim": ext}),
            );
            out.extend_from_slice(&done_and_end());
            conn.stream.write_all(&out)?;
            return Ok(None);
        }
        conn.stream.write_all(&out)?;
    }
}

/// `data: [DONE]` and the end of the chunked body.
fn done_and_end() -> Vec<u8> {
    let mut out = Vec::with_capacity(32);
    write_chunk(&mut out, b"data: [DONE]\n\n");
    out.extend_from_slice(LAST_CHUNK);
    out
}

//! The null engine: answers every request at once.
//!
//! Each engine is one loopback listener. Every accepted connection gets its
//! own thread and is kept alive (HTTP/1.1), so a gateway's connection pool
//! reuses it. Per request the full body is read and discarded (by
//! `content-length` or chunked), then:
//!
//! | request | answer |
//! |---|---|
//! | `POST /v1/chat/completions` | 200, a `chat.completion` with `usage` |
//! | `POST /v1/completions` | 200, a `text_completion` with `usage` |
//! | `GET /health` | 200, empty |
//! | `GET /metrics` | 200, vLLM-style gauges of an idle engine |
//! | `GET /v1/models` | 200, the one model |
//! | anything else | 404 (405 for a known path with another method) |
//!
//! `prompt_tokens` is the body size divided by four, a rough token count;
//! `completion_tokens` is always 1.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// The model every engine serves unless told otherwise.
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// Largest request head (request line plus headers) accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most headers parsed in one request head.
const MAX_HEADERS: usize = 64;
/// A connection idle for this long between requests is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest line in a chunked body (size line or trailer).
const MAX_LINE_BYTES: usize = 8 * 1024;

/// Where and what the null engines serve.
#[derive(Debug, Clone)]
pub struct NullConfig {
    /// Address every engine binds.
    pub host: IpAddr,
    /// First engine's port; engine `i` listens on `base_port + i`. With 0,
    /// every engine takes a free port of its own.
    pub base_port: u16,
    /// How many engines.
    pub engines: usize,
    /// Model name in answers and in the metrics' `model_name` label.
    pub model: String,
}

impl Default for NullConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 8001,
            engines: 4,
            model: DEFAULT_MODEL.to_owned(),
        }
    }
}

/// What every connection thread of one engine shares.
struct Engine {
    model: String,
    /// Completion requests answered.
    served: AtomicU64,
    /// Completion requests in progress (always about 0: answered at once).
    running: AtomicU64,
    stop: AtomicBool,
}

/// Running null engines; [`NullFleet::shutdown`] stops their accept loops.
pub struct NullFleet {
    addrs: Vec<SocketAddr>,
    engines: Vec<Arc<Engine>>,
    acceptors: Vec<JoinHandle<()>>,
}

impl NullFleet {
    /// Binds every engine (all or nothing) and starts serving.
    pub fn start(cfg: &NullConfig) -> io::Result<Self> {
        if cfg.engines == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "engines must be at least 1",
            ));
        }
        let mut listeners = Vec::with_capacity(cfg.engines);
        for i in 0..cfg.engines {
            let port = if cfg.base_port == 0 {
                0
            } else {
                u16::try_from(usize::from(cfg.base_port) + i).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "base port {} + {} engines exceeds 65535",
                            cfg.base_port, cfg.engines
                        ),
                    )
                })?
            };
            let addr = SocketAddr::new(cfg.host, port);
            let listener = TcpListener::bind(addr)
                .map_err(|e| io::Error::new(e.kind(), format!("bind {addr}: {e}")))?;
            listeners.push(listener);
        }
        let mut fleet = Self {
            addrs: Vec::with_capacity(cfg.engines),
            engines: Vec::with_capacity(cfg.engines),
            acceptors: Vec::with_capacity(cfg.engines),
        };
        for listener in listeners {
            let addr = listener.local_addr()?;
            let engine = Arc::new(Engine {
                model: cfg.model.clone(),
                served: AtomicU64::new(0),
                running: AtomicU64::new(0),
                stop: AtomicBool::new(false),
            });
            let shared = Arc::clone(&engine);
            let handle = thread::Builder::new()
                .name(format!("null-{}", addr.port()))
                .spawn(move || accept_loop(&listener, &shared))?;
            fleet.addrs.push(addr);
            fleet.engines.push(engine);
            fleet.acceptors.push(handle);
        }
        Ok(fleet)
    }

    /// The engines' addresses, in port order.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Completion requests answered, per engine.
    pub fn served(&self) -> Vec<u64> {
        self.engines
            .iter()
            .map(|e| e.served.load(Ordering::Relaxed))
            .collect()
    }

    /// Blocks while the engines serve (until [`NullFleet::shutdown`] from
    /// elsewhere, or the process is stopped).
    pub fn join(self) {
        for h in self.acceptors {
            let _ = h.join();
        }
    }

    /// Stops accepting. Open connections end when their client closes them.
    pub fn shutdown(self) {
        for (engine, addr) in self.engines.iter().zip(&self.addrs) {
            engine.stop.store(true, Ordering::SeqCst);
            // Wake the blocking accept.
            let _ = TcpStream::connect_timeout(addr, Duration::from_secs(1));
        }
        self.join();
    }
}

fn accept_loop(listener: &TcpListener, engine: &Arc<Engine>) {
    for conn in listener.incoming() {
        if engine.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else {
            // EMFILE and the like: back off instead of spinning.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let shared = Arc::clone(engine);
        let spawned = thread::Builder::new()
            .name("null-conn".to_owned())
            .stack_size(256 * 1024)
            .spawn(move || {
                let _ = serve(stream, &shared);
            });
        if spawned.is_err() {
            thread::sleep(Duration::from_millis(10));
        }
    }
}

/// One request head, as far as the null engine cares.
struct Head {
    method: String,
    path: String,
    content_length: Option<u64>,
    chunked: bool,
    keep_alive: bool,
}

/// A connection with its own read buffer (requests may be pipelined).
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl Conn {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            buf: vec![0; 16 * 1024],
            pos: 0,
            end: 0,
        }
    }

    fn buffered(&self) -> &[u8] {
        self.buf.get(self.pos..self.end).unwrap_or_default()
    }

    /// Reads more bytes after the buffered ones; Ok(0) at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.pos > 0 {
            self.buf.copy_within(self.pos..self.end, 0);
            self.end -= self.pos;
            self.pos = 0;
        }
        if self.end == self.buf.len() {
            let grown = (self.buf.len() * 2).min(MAX_HEAD_BYTES + MAX_LINE_BYTES);
            if grown <= self.buf.len() {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
            }
            self.buf.resize(grown, 0);
        }
        let spare = self.buf.get_mut(self.end..).unwrap_or_default();
        let n = self.stream.read(spare)?;
        self.end += n;
        Ok(n)
    }

    /// The next request head; None when the client closed cleanly between
    /// requests.
    fn head(&mut self) -> io::Result<Option<Head>> {
        loop {
            if self.pos < self.end {
                let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
                let mut req = httparse::Request::new(&mut headers);
                match req.parse(self.buffered()) {
                    Ok(httparse::Status::Complete(used)) => {
                        let head = to_head(&req)?;
                        self.pos += used;
                        return Ok(Some(head));
                    }
                    Ok(httparse::Status::Partial) => {
                        if self.end - self.pos > MAX_HEAD_BYTES {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "request head too large",
                            ));
                        }
                    }
                    Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
                }
            }
            if self.fill()? == 0 {
                return if self.pos == self.end {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }

    /// Reads and drops `n` body bytes.
    fn skip(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.pos == self.end {
                self.pos = 0;
                self.end = 0;
                let cap = self.buf.len();
                let want = usize::try_from(n).unwrap_or(cap).min(cap);
                let dst = self.buf.get_mut(..want).unwrap_or_default();
                let got = self.stream.read(dst)?;
                if got == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                self.end = got;
            }
            let avail = (self.end - self.pos) as u64;
            let take = avail.min(n);
            // take <= avail, which fits in usize.
            self.pos += usize::try_from(take).unwrap_or(0);
            n -= take;
        }
        Ok(())
    }

    /// One CRLF- (or LF-) terminated line, without its terminator.
    fn line(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if let Some(i) = self.buffered().iter().position(|&b| b == b'\n') {
                let raw = self.buffered().get(..i).unwrap_or_default();
                let line = raw.strip_suffix(b"\r").unwrap_or(raw).to_vec();
                self.pos += i + 1;
                return Ok(line);
            }
            if self.end - self.pos > MAX_LINE_BYTES {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
            }
            if self.fill()? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// Reads and drops a chunked body (trailers included); returns its size.
    fn skip_chunked(&mut self) -> io::Result<u64> {
        let mut total = 0u64;
        loop {
            let line = self.line()?;
            let size_part = line.split(|&b| b == b';').next().unwrap_or_default();
            let text = std::str::from_utf8(size_part)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let size = u64::from_str_radix(text.trim(), 16)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.line()?.is_empty() {}
                return Ok(total);
            }
            self.skip(size)?;
            total = total.saturating_add(size);
            if !self.line()?.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "chunk not followed by CRLF",
                ));
            }
        }
    }
}

fn to_head(req: &httparse::Request<'_, '_>) -> io::Result<Head> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_owned());
    let mut head = Head {
        method: req.method.unwrap_or_default().to_owned(),
        path: req.path.unwrap_or_default().to_owned(),
        content_length: None,
        chunked: false,
        // HTTP/1.1 defaults to keep-alive, 1.0 to close.
        keep_alive: req.version == Some(1),
    };
    for h in req.headers.iter() {
        let value = std::str::from_utf8(h.value).map_err(|_| bad("header not UTF-8"))?;
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = value
                .trim()
                .parse::<u64>()
                .map_err(|_| bad("bad content-length"))?;
            head.content_length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("chunked"));
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in value.split(',') {
                let token = token.trim();
                if token.eq_ignore_ascii_case("close") {
                    head.keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    head.keep_alive = true;
                }
            }
        }
    }
    Ok(head)
}

fn serve(stream: TcpStream, engine: &Engine) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    let mut conn = Conn::new(stream);
    let mut out = Vec::with_capacity(1024);
    while let Some(head) = conn.head()? {
        let body_bytes = if head.chunked {
            conn.skip_chunked()?
        } else {
            let n = head.content_length.unwrap_or(0);
            conn.skip(n)?;
            n
        };
        out.clear();
        respond(&mut out, &head, body_bytes, engine);
        conn.stream.write_all(&out)?;
        if !head.keep_alive {
            break;
        }
    }
    let _ = conn.stream.shutdown(Shutdown::Both);
    Ok(())
}

/// Writes the whole response for one request into `out`.
fn respond(out: &mut Vec<u8>, head: &Head, body_bytes: u64, engine: &Engine) {
    let path = head.path.split('?').next().unwrap_or_default();
    let post = head.method == "POST";
    let get = head.method == "GET" || head.method == "HEAD";
    let (status, ctype, body) = match path {
        "/v1/chat/completions" | "/v1/completions" if post => {
            engine.running.fetch_add(1, Ordering::Relaxed);
            let body = completion(path == "/v1/chat/completions", &engine.model, body_bytes);
            engine.running.fetch_sub(1, Ordering::Relaxed);
            engine.served.fetch_add(1, Ordering::Relaxed);
            ("200 OK", "application/json", body)
        }
        "/health" if get => ("200 OK", "text/plain", String::new()),
        "/metrics" if get => ("200 OK", "text/plain; version=0.0.4", metrics(engine)),
        "/v1/models" if get => (
            "200 OK",
            "application/json",
            format!(
                r#"{{"object":"list","data":[{{"id":{},"object":"model","owned_by":"kvroute-sim"}}]}}"#,
                json_string(&engine.model)
            ),
        ),
        "/v1/chat/completions" | "/v1/completions" | "/health" | "/metrics" | "/v1/models" => (
            "405 Method Not Allowed",
            "application/json",
            r#"{"error":"method not allowed"}"#.to_owned(),
        ),
        _ => (
            "404 Not Found",
            "application/json",
            r#"{"error":"not found"}"#.to_owned(),
        ),
    };
    let connection = if head.keep_alive {
        "keep-alive"
    } else {
        "close"
    };
    let _ = write!(
        out,
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n",
        body.len()
    );
    if head.method != "HEAD" {
        out.extend_from_slice(body.as_bytes());
    }
}

/// The fixed OpenAI-style answer.
fn completion(chat: bool, model: &str, body_bytes: u64) -> String {
    let prompt = (body_bytes / 4).max(1);
    let usage = format!(
        r#""usage":{{"prompt_tokens":{prompt},"completion_tokens":1,"total_tokens":{}}}"#,
        prompt + 1
    );
    let model = json_string(model);
    if chat {
        format!(
            r#"{{"id":"chatcmpl-null","object":"chat.completion","created":0,"model":{model},"choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],{usage}}}"#
        )
    } else {
        format!(
            r#"{{"id":"cmpl-null","object":"text_completion","created":0,"model":{model},"choices":[{{"index":0,"text":"ok","finish_reason":"stop"}}],{usage}}}"#
        )
    }
}

/// vLLM (v1) metrics of an idle engine, as the collector scrapes them.
fn metrics(engine: &Engine) -> String {
    let m = format!(r#"engine="0",model_name={}"#, json_string(&engine.model));
    let running = engine.running.load(Ordering::Relaxed);
    let served = engine.served.load(Ordering::Relaxed);
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{m}}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{m}}} 0.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{m}}} 0.0\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"8192\"}} 1.0\n\
         # HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{m},finished_reason=\"stop\"}} {served}.0\n"
    )
}

/// `s` as a JSON string literal (also valid as a Prometheus label value
/// for the names used here).
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn completion_is_json_with_usage() {
        let chat = completion(true, "m\"x", 4000);
        assert!(chat.contains(r#""model":"m\"x""#));
        assert!(chat.contains(r#""prompt_tokens":1000,"completion_tokens":1,"total_tokens":1001"#));
        assert!(completion(false, "m", 0).contains(r#""object":"text_completion""#));
    }
}

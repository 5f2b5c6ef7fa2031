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
//! | `POST /v1/chat/completions/render`, `/v1/completions/render`, `/tokenize` | 200, one token id per 4 body bytes (for vllm-router's `cache_aware`) |
//! | anything else | 404 (405 for a known path with another method) |
//!
//! `prompt_tokens` is the body size divided by four, a rough token count;
//! `completion_tokens` is always 1.

use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::http::{self, json_string, Conn, Head, IDLE_TIMEOUT};

/// The model every engine serves unless told otherwise.
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

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
    let shared = Arc::clone(engine);
    http::accept_loop(
        listener,
        "null-conn",
        256 * 1024,
        || engine.stop.load(Ordering::SeqCst),
        move |stream| {
            let _ = serve(stream, &shared);
        },
    );
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
        // vllm-router's cache_aware policy renders every request on every
        // worker before it routes. The null engine keeps no body, so the
        // ids are a fixed sequence of the right length (one per 4 bytes):
        // the router pays for the round trips and the payload, as with vLLM.
        "/v1/chat/completions/render" | "/v1/completions/render" | "/tokenize" if post => {
            let n = (body_bytes / 4).max(1);
            let mut ids = String::with_capacity(usize::try_from(n).unwrap_or(0).saturating_mul(7));
            for i in 0..n {
                if i > 0 {
                    ids.push(',');
                }
                ids.push_str(&(i % 128_256).to_string());
            }
            let body = if path == "/tokenize" {
                format!(r#"{{"count":{n},"max_model_len":131072,"tokens":[{ids}]}}"#)
            } else {
                format!(
                    r#"{{"model":{},"token_ids":[{ids}]}}"#,
                    json_string(&engine.model)
                )
            };
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

//! Scraping one engine: `GET /health`, then `GET /metrics`, each phase of
//! each request bounded by the timeout; and the per-engine worker thread that
//! repeats it.
//!
//! Outcome of one scrape:
//!
//! - `/health` unreachable (timeout, refused, reset): a failure; `/metrics`
//!   is not tried.
//! - `/health` answered: its status is kept (200 is ready, anything else,
//!   such as 503 while weights load, is not); then `/metrics` must answer 200
//!   with exposition text, else the scrape is a failure (`metrics_status`,
//!   `parse`, ...).
//! - An engine is **ready** when the scrape did not fail and `/health` said
//!   200. A failed scrape keeps the engine's last good metrics and their
//!   `scrapedAtMs`.
//!
//! Each engine has its own thread and HTTP agent (so its connections are
//! kept alive between scrapes, and a slow engine never delays another).
//! After `n` consecutive failures the next scrape waits
//! `min(interval * 2^n, max_backoff)`; while that lasts the engine is
//! reported not ready.

use std::io;
use std::net::SocketAddr;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use crate::engines::{self, EngineMetrics};
use crate::now_ms;

/// Largest `/metrics` body read (vLLM with many models and LoRA adapters
/// stays far below).
pub const MAX_METRICS_BYTES: u64 = 8 << 20;
const MAX_HEALTH_BYTES: u64 = 64 << 10;

/// Why a scrape failed: a metric label and a human detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub cause: &'static str,
    pub detail: String,
}

/// The outcome of one scrape of one engine.
#[derive(Debug, Clone)]
pub struct Scrape {
    pub addr: SocketAddr,
    /// `/health` status, if it answered.
    pub health_status: Option<u16>,
    /// Parsed `/metrics`, if the scrape succeeded.
    pub metrics: Option<EngineMetrics>,
    pub failure: Option<Failure>,
    /// Collector clock, Unix ms, when the scrape finished.
    pub finished_ms: u64,
    pub duration: Duration,
}

impl Scrape {
    pub fn ready(&self) -> bool {
        self.failure.is_none() && self.health_status == Some(200)
    }
}

/// An HTTP agent for one engine: statuses are answers, not errors; no
/// proxy from the environment (engines are addressed directly); no
/// redirects.
///
/// The timeout bounds each phase of a request (connect, send, response
/// headers, body) rather than the whole request: with a global or per-call
/// budget, ureq runs even an IP literal's "resolution" on a freshly spawned
/// thread, on every request, which at 64 engines x 8 requests/s was most of
/// the collector's CPU time. A stalled engine is still cut off after
/// `timeout`.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(timeout))
        .timeout_send_request(Some(timeout))
        .timeout_recv_response(Some(timeout))
        .timeout_recv_body(Some(timeout))
        .proxy(None)
        .max_redirects(0)
        .user_agent(concat!("kvroute-collector/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// Maps a transport error to a metric label.
pub fn classify(e: &ureq::Error) -> &'static str {
    match e {
        ureq::Error::Timeout(_) => "timeout",
        ureq::Error::Io(io) => match io.kind() {
            io::ErrorKind::ConnectionRefused => "refused",
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timeout",
            _ => "io",
        },
        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => "connect",
        ureq::Error::BodyExceedsLimit(_) => "too_large",
        ureq::Error::Protocol(_)
        | ureq::Error::LargeResponseHeader(..)
        | ureq::Error::Http(_)
        | ureq::Error::BadUri(_) => "protocol",
        _ => "other",
    }
}

fn failure(e: &ureq::Error, what: &str) -> Failure {
    Failure {
        cause: classify(e),
        detail: format!("{what}: {e}"),
    }
}

/// Scrapes `addr` once.
pub fn scrape(agent: &ureq::Agent, addr: SocketAddr) -> Scrape {
    let started = Instant::now();
    let mut out = Scrape {
        addr,
        health_status: None,
        metrics: None,
        failure: None,
        finished_ms: 0,
        duration: Duration::ZERO,
    };
    match agent.get(format!("http://{addr}/health")).call() {
        Err(e) => out.failure = Some(failure(&e, "GET /health")),
        Ok(mut resp) => {
            out.health_status = Some(resp.status().as_u16());
            // Drain (bounded) so the connection can be reused.
            let _ = resp
                .body_mut()
                .with_config()
                .limit(MAX_HEALTH_BYTES)
                .read_to_vec();
            match fetch_metrics(agent, addr) {
                Ok(m) => out.metrics = Some(m),
                Err(f) => out.failure = Some(f),
            }
        }
    }
    out.duration = started.elapsed();
    out.finished_ms = now_ms();
    out
}

fn fetch_metrics(agent: &ureq::Agent, addr: SocketAddr) -> Result<EngineMetrics, Failure> {
    let mut resp = agent
        .get(format!("http://{addr}/metrics"))
        .call()
        .map_err(|e| failure(&e, "GET /metrics"))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_METRICS_BYTES)
        .read_to_vec()
        .map_err(|e| failure(&e, "reading /metrics"))?;
    if status != 200 {
        return Err(Failure {
            cause: "metrics_status",
            detail: format!("GET /metrics answered {status}"),
        });
    }
    let text = String::from_utf8(body).map_err(|_| Failure {
        cause: "not_utf8",
        detail: "/metrics body is not UTF-8".into(),
    })?;
    engines::interpret(&text).map_err(|e| Failure {
        cause: "parse",
        detail: format!("/metrics is not Prometheus exposition text ({e})"),
    })
}

/// Delay before the next scrape after `failures` consecutive failures.
pub fn next_delay(interval: Duration, max_backoff: Duration, failures: u32) -> Duration {
    if failures == 0 {
        return interval;
    }
    // 2^n, with n capped so the multiplication cannot overflow.
    let factor = 1u32 << failures.min(16);
    interval
        .saturating_mul(factor)
        .min(max_backoff)
        .max(interval)
}

/// A message from an engine worker.
#[derive(Debug)]
pub struct Report {
    pub scrape: Scrape,
    /// Consecutive failures so far (0: healthy).
    pub failures: u32,
}

/// A running engine worker; dropping it (or [`Worker::stop`]) ends it after
/// its current scrape.
#[derive(Debug)]
pub struct Worker {
    stop: Option<Sender<()>>,
    handle: Option<thread::JoinHandle<()>>,
}

impl Worker {
    /// Starts scraping `addr` every `interval`, sending each outcome to `tx`.
    pub fn spawn(
        addr: SocketAddr,
        interval: Duration,
        timeout: Duration,
        max_backoff: Duration,
        tx: Sender<crate::collector::Event>,
    ) -> io::Result<Worker> {
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let handle = thread::Builder::new()
            .name(format!("scrape {addr}"))
            .stack_size(256 << 10)
            .spawn(move || {
                let agent = agent(timeout);
                let mut failures: u32 = 0;
                loop {
                    let started = Instant::now();
                    let scrape = scrape(&agent, addr);
                    failures = if scrape.failure.is_some() {
                        failures.saturating_add(1)
                    } else {
                        0
                    };
                    let report = Report { scrape, failures };
                    if tx
                        .send(crate::collector::Event::Scraped(Box::new(report)))
                        .is_err()
                    {
                        return;
                    }
                    // Keep the cadence: the scrape's own time counts.
                    let wait = next_delay(interval, max_backoff, failures)
                        .saturating_sub(started.elapsed());
                    match stop_rx.recv_timeout(wait) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                }
            })?;
        Ok(Worker {
            stop: Some(stop_tx),
            handle: Some(handle),
        })
    }

    /// Asks the worker to end (it finishes its current scrape first).
    pub fn stop(&mut self) {
        self.stop.take();
    }

    /// Stops and waits for the thread.
    pub fn join(mut self) {
        self.stop();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let i = Duration::from_millis(250);
        let cap = Duration::from_secs(5);
        let d: Vec<u64> = (0..8)
            .map(|n| next_delay(i, cap, n).as_millis() as u64)
            .collect();
        assert_eq!(d, vec![250, 500, 1000, 2000, 4000, 5000, 5000, 5000]);
        assert_eq!(next_delay(i, cap, u32::MAX), cap);
        // A cap below the interval never shortens the interval.
        assert_eq!(next_delay(i, Duration::from_millis(1), 3), i);
    }

    #[test]
    fn refused_and_timeout_are_classified() {
        // A port with nothing listening: bind, note the port, close.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let s = scrape(&agent(Duration::from_millis(500)), addr);
        assert_eq!(
            s.failure.as_ref().map(|f| f.cause),
            Some("refused"),
            "{s:?}"
        );
        assert!(!s.ready());
        assert_eq!(s.health_status, None);

        // A listener that accepts and never answers.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t0 = Instant::now();
        let s = scrape(&agent(Duration::from_millis(100)), addr);
        assert_eq!(
            s.failure.as_ref().map(|f| f.cause),
            Some("timeout"),
            "{s:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(2));
        drop(l);
    }
}

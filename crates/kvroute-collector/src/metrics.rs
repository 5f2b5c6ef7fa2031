//! The collector's own metrics, in Prometheus text format, served on
//! `metrics-addr` (default `127.0.0.1:9102`) at `/metrics`.
//!
//! | metric | type | labels | meaning |
//! |---|---|---|---|
//! | `kvroute_collector_scrape_duration_seconds` | histogram | | one engine scrape (`/health` + `/metrics`) |
//! | `kvroute_collector_scrapes_total` | counter | `engine` | scrapes attempted |
//! | `kvroute_collector_scrape_failures_total` | counter | `engine`, `cause` | failed scrapes: `timeout`, `refused`, `connect`, `io`, `protocol`, `too_large`, `metrics_status`, `parse`, `not_utf8`, `other`; plus `health_status` (`/health` answered, but not 200) |
//! | `kvroute_collector_engines_discovered` | gauge | | engines known |
//! | `kvroute_collector_engines_ready` | gauge | | engines reported ready |
//! | `kvroute_collector_gateways` | gauge | | gateways pushed to: the configured ones plus those the gateway services resolve to |
//! | `kvroute_collector_peer_gateways` | gauge | | peer gateways whose load is read and never pushed to (`--peer-gateways`, `--peer-gateway-service`) |
//! | `kvroute_collector_pushes_total` | counter | `gateway`, `status` | push results: the HTTP status (`204`, `401`, `409`, ...) or the transport failure (`timeout`, `refused`, ...) |
//! | `kvroute_collector_push_duration_seconds` | histogram | | one push |
//! | `kvroute_collector_last_push_timestamp_seconds` | gauge | `gateway` | last push the gateway accepted (2xx), Unix time |
//! | `kvroute_collector_load_reads_total` | counter | `gateway`, `result` | reads of a gateway's in-flight load (`GET /v1/fleet/load`, with two gateways or more, a gateway service, or peers): `ok`, the HTTP status, `invalid`, or the transport failure |
//! | `kvroute_collector_snapshot_seq` | gauge | | `seq` of the latest snapshot built |
//! | `kvroute_collector_dns_failures_total` | counter | `name` | failed lookups of an engine name or a gateway service |
//!
//! Engine series are removed when discovery drops the engine, and gateway
//! series when a gateway service stops resolving to the gateway, so label
//! cardinality follows the fleet.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use log::{debug, warn};

/// Histogram bucket bounds, seconds: 1 ms to 2.5 s.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bound, c) in BUCKETS.iter().zip(self.counts.iter_mut()) {
            if seconds <= *bound {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, c) in BUCKETS.iter().zip(self.counts.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    scrape_seconds: Histogram,
    scrapes: BTreeMap<String, u64>,
    scrape_failures: BTreeMap<(String, &'static str), u64>,
    engines_discovered: usize,
    engines_ready: usize,
    gateways: usize,
    peer_gateways: usize,
    pushes: BTreeMap<(String, String), u64>,
    push_seconds: Histogram,
    last_push_ok_ms: BTreeMap<String, u64>,
    load_reads: BTreeMap<(String, String), u64>,
    snapshot_seq: u64,
    dns_failures: BTreeMap<String, u64>,
}

/// Thread-safe metric store. Writers: the collector loop, the pushers and
/// discovery; reader: the metrics endpoint.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave these counters in a
        // state worse than slightly off; keep serving them.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn scrape(&self, engine: &str, seconds: f64, failure: Option<&'static str>) {
        let mut m = self.lock();
        m.scrape_seconds.observe(seconds);
        *m.scrapes.entry(engine.to_owned()).or_default() += 1;
        if let Some(cause) = failure {
            *m.scrape_failures
                .entry((engine.to_owned(), cause))
                .or_default() += 1;
        }
    }

    /// Counts a `/health` answer other than 200 (the scrape itself worked).
    pub fn health_not_ok(&self, engine: &str) {
        *self
            .lock()
            .scrape_failures
            .entry((engine.to_owned(), "health_status"))
            .or_default() += 1;
    }

    pub fn forget_engine(&self, engine: &str) {
        let mut m = self.lock();
        m.scrapes.remove(engine);
        m.scrape_failures.retain(|(e, _), _| e != engine);
    }

    /// Drops a gateway's series (it went away).
    pub fn forget_gateway(&self, gateway: &str) {
        let mut m = self.lock();
        m.pushes.retain(|(g, _), _| g != gateway);
        m.last_push_ok_ms.remove(gateway);
        m.load_reads.retain(|(g, _), _| g != gateway);
    }

    /// Gateways pushed to, and peers read only.
    pub fn gateways(&self, pushed: usize, peers: usize) {
        let mut m = self.lock();
        m.gateways = pushed;
        m.peer_gateways = peers;
    }

    pub fn engines(&self, discovered: usize, ready: usize) {
        let mut m = self.lock();
        m.engines_discovered = discovered;
        m.engines_ready = ready;
    }

    pub fn push(&self, gateway: &str, status: &str, seconds: f64, accepted_at_ms: Option<u64>) {
        let mut m = self.lock();
        *m.pushes
            .entry((gateway.to_owned(), status.to_owned()))
            .or_default() += 1;
        m.push_seconds.observe(seconds);
        if let Some(ms) = accepted_at_ms {
            m.last_push_ok_ms.insert(gateway.to_owned(), ms);
        }
    }

    pub fn load_read(&self, gateway: &str, result: &str) {
        *self
            .lock()
            .load_reads
            .entry((gateway.to_owned(), result.to_owned()))
            .or_default() += 1;
    }

    pub fn snapshot_seq(&self, seq: u64) {
        self.lock().snapshot_seq = seq;
    }

    pub fn dns_failure(&self, name: &str) {
        *self.lock().dns_failures.entry(name.to_owned()).or_default() += 1;
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let m = self.lock();
        let mut out = String::with_capacity(4096);
        m.scrape_seconds.render(
            &mut out,
            "kvroute_collector_scrape_duration_seconds",
            "Time to scrape one engine (/health and /metrics).",
        );
        header(
            &mut out,
            "kvroute_collector_scrapes_total",
            "counter",
            "Engine scrapes attempted.",
        );
        for (engine, n) in &m.scrapes {
            let _ = writeln!(
                out,
                "kvroute_collector_scrapes_total{{engine=\"{}\"}} {n}",
                esc(engine)
            );
        }
        header(
            &mut out,
            "kvroute_collector_scrape_failures_total",
            "counter",
            "Failed engine scrapes by cause (health_status: /health answered but not 200).",
        );
        for ((engine, cause), n) in &m.scrape_failures {
            let _ = writeln!(
                out,
                "kvroute_collector_scrape_failures_total{{engine=\"{}\",cause=\"{cause}\"}} {n}",
                esc(engine)
            );
        }
        header(
            &mut out,
            "kvroute_collector_engines_discovered",
            "gauge",
            "Engines known to the collector.",
        );
        let _ = writeln!(
            out,
            "kvroute_collector_engines_discovered {}",
            m.engines_discovered
        );
        header(
            &mut out,
            "kvroute_collector_engines_ready",
            "gauge",
            "Engines reported ready.",
        );
        let _ = writeln!(out, "kvroute_collector_engines_ready {}", m.engines_ready);
        header(
            &mut out,
            "kvroute_collector_gateways",
            "gauge",
            "Gateways pushed to (configured plus resolved).",
        );
        let _ = writeln!(out, "kvroute_collector_gateways {}", m.gateways);
        header(
            &mut out,
            "kvroute_collector_peer_gateways",
            "gauge",
            "Peer gateways whose in-flight load is read, never pushed to.",
        );
        let _ = writeln!(out, "kvroute_collector_peer_gateways {}", m.peer_gateways);
        per_gateway(
            &mut out,
            "kvroute_collector_pushes_total",
            "Snapshot pushes by gateway and HTTP status (or transport failure).",
            "status",
            &m.pushes,
        );
        m.push_seconds.render(
            &mut out,
            "kvroute_collector_push_duration_seconds",
            "Time to push one snapshot to one gateway.",
        );
        header(
            &mut out,
            "kvroute_collector_last_push_timestamp_seconds",
            "gauge",
            "Unix time of the last push the gateway accepted.",
        );
        for (gw, ms) in &m.last_push_ok_ms {
            let _ = writeln!(
                out,
                "kvroute_collector_last_push_timestamp_seconds{{gateway=\"{}\"}} {:.3}",
                esc(gw),
                *ms as f64 / 1000.0
            );
        }
        per_gateway(
            &mut out,
            "kvroute_collector_load_reads_total",
            "Reads of a gateway's in-flight load by result.",
            "result",
            &m.load_reads,
        );
        header(
            &mut out,
            "kvroute_collector_snapshot_seq",
            "gauge",
            "seq of the latest snapshot built.",
        );
        let _ = writeln!(out, "kvroute_collector_snapshot_seq {}", m.snapshot_seq);
        header(
            &mut out,
            "kvroute_collector_dns_failures_total",
            "counter",
            "Failed DNS lookups of an engine name.",
        );
        for (name, n) in &m.dns_failures {
            let _ = writeln!(
                out,
                "kvroute_collector_dns_failures_total{{name=\"{}\"}} {n}",
                esc(name)
            );
        }
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A counter keyed by gateway and one more label.
fn per_gateway(
    out: &mut String,
    name: &str,
    help: &str,
    label: &str,
    values: &BTreeMap<(String, String), u64>,
) {
    header(out, name, "counter", help);
    for ((gw, value), n) in values {
        let _ = writeln!(
            out,
            "{name}{{gateway=\"{}\",{label}=\"{}\"}} {n}",
            esc(gw),
            esc(value)
        );
    }
}

/// Escapes a label value.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The running metrics endpoint.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    handle: Option<thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `addr` and serves `GET /metrics` from a thread.
    pub fn start(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<MetricsServer, String> {
        let server = tiny_http::Server::http(addr).map_err(|e| e.to_string())?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| "not an IP listener".to_owned())?;
        let server = Arc::new(server);
        let srv = Arc::clone(&server);
        let handle = thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                for request in srv.incoming_requests() {
                    let path = request.url().split('?').next().unwrap_or("");
                    let result = if path == "/metrics" {
                        let header = tiny_http::Header::from_bytes(
                            &b"Content-Type"[..],
                            &b"text/plain; version=0.0.4; charset=utf-8"[..],
                        );
                        let mut resp = tiny_http::Response::from_string(metrics.render());
                        if let Ok(h) = header {
                            resp.add_header(h);
                        }
                        request.respond(resp)
                    } else {
                        request.respond(
                            tiny_http::Response::from_string("not found: try /metrics\n")
                                .with_status_code(404),
                        )
                    };
                    if let Err(e) = result {
                        debug!("metrics endpoint: {e}");
                    }
                }
            })
            .map_err(|e| format!("cannot start the metrics thread: {e}"))?;
        Ok(MetricsServer {
            server,
            addr: bound,
            handle: Some(handle),
        })
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(h) = self.handle.take() {
            // The serving thread ends once unblocked; do not hang forever on
            // a client that keeps a response open.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !h.is_finished() && std::time::Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            } else {
                warn!("metrics endpoint did not stop in time");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_valid_exposition_text() {
        let m = Metrics::new();
        m.scrape("10.0.0.1:80", 0.003, None);
        m.scrape("10.0.0.1:80", 0.3, Some("timeout"));
        m.health_not_ok("10.0.0.2:80");
        m.engines(2, 1);
        m.push(
            "http://127.0.0.1:10001",
            "204",
            0.002,
            Some(1_764_400_000_123),
        );
        m.push("http://127.0.0.1:10001", "401", 0.002, None);
        m.snapshot_seq(42);
        m.dns_failure("svc:80");
        let text = m.render();
        for want in [
            "kvroute_collector_scrape_duration_seconds_bucket{le=\"0.005\"} 1",
            "kvroute_collector_scrape_duration_seconds_count 2",
            "kvroute_collector_scrapes_total{engine=\"10.0.0.1:80\"} 2",
            "kvroute_collector_scrape_failures_total{engine=\"10.0.0.1:80\",cause=\"timeout\"} 1",
            "kvroute_collector_scrape_failures_total{engine=\"10.0.0.2:80\",cause=\"health_status\"} 1",
            "kvroute_collector_engines_discovered 2",
            "kvroute_collector_engines_ready 1",
            "kvroute_collector_pushes_total{gateway=\"http://127.0.0.1:10001\",status=\"204\"} 1",
            "kvroute_collector_pushes_total{gateway=\"http://127.0.0.1:10001\",status=\"401\"} 1",
            "kvroute_collector_last_push_timestamp_seconds{gateway=\"http://127.0.0.1:10001\"} 1764400000.123",
            "kvroute_collector_snapshot_seq 42",
            "kvroute_collector_dns_failures_total{name=\"svc:80\"} 1",
        ] {
            assert!(text.contains(want), "missing {want}\n{text}");
        }
        // Our own reader accepts it, every line of it.
        let parsed = crate::expo::parse(&text, |_| true).unwrap();
        assert_eq!(parsed.bad_lines, 0);
        m.forget_engine("10.0.0.1:80");
        assert!(!m.render().contains("engine=\"10.0.0.1:80\""));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}

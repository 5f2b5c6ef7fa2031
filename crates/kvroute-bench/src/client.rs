//! One streamed chat completion: send, read the SSE stream, time it.
//!
//! Times are measured on this machine's clock and multiplied by the
//! simulation's time scale, so every figure is in the engines' modelled
//! time (what a user of the simulated GPUs would have seen).

use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

/// A finished request, whatever happened to it.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// HTTP status (0 when no answer came).
    pub status: u16,
    /// Why the request failed (`None`: a complete stream).
    pub error: Option<String>,
    /// Time to the first content token, modelled ms.
    pub ttft_ms: Option<f64>,
    /// Gaps between content chunks after the first, modelled ms.
    pub itl_ms: Vec<f64>,
    /// Send to end of stream, modelled ms.
    pub e2e_ms: f64,
    /// The generated text, as streamed.
    pub text: String,
    pub usage: Usage,
    /// The replica the router named, from kvroute's `x-kvroute-decision`
    /// response header (`host=`), when the router sends one.
    pub decided_host: Option<String>,
}

/// What the final chunk reported (`usage` and the simulator's extension).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The simulated engine that served it.
    pub engine: Option<u64>,
    pub queue_ms: Option<f64>,
    pub prefill_ms: Option<f64>,
    pub preempted: Option<u64>,
}

/// kvroute's explain header (`"explainHeader": true`).
pub const DECISION_HEADER: &str = "x-kvroute-decision";

/// The `host=` field of an `x-kvroute-decision` value
/// (`reason=session; host=127.0.0.1:8003; key=...`).
pub fn decision_host(value: &str) -> Option<String> {
    value
        .split(';')
        .filter_map(|part| part.trim().split_once('='))
        .find(|(k, _)| k.trim() == "host")
        .map(|(_, v)| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Largest error body kept for the report.
const MAX_ERROR_TEXT: usize = 200;
/// Longest SSE line accepted (a chunk is a few hundred bytes).
const MAX_LINE: usize = 1 << 20;

/// An HTTP client for replays: statuses are answers, no proxy, many idle
/// connections kept (one per in-flight request at peak).
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .timeout_send_request(Some(timeout))
        .timeout_recv_response(Some(timeout))
        .timeout_recv_body(Some(timeout))
        .proxy(None)
        .max_redirects(0)
        .max_idle_connections(4096)
        .max_idle_connections_per_host(4096)
        .user_agent(concat!("kvroute-bench/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// Sends `body` to `url` and reads the answer to its end.
pub fn chat(
    agent: &ureq::Agent,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
    time_scale: f64,
) -> Outcome {
    let started = Instant::now();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0 * time_scale;
    let mut out = Outcome::default();
    let mut req = agent.post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = match req.send(&body[..]) {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("transport: {e}"));
            out.e2e_ms = ms(started.elapsed());
            return out;
        }
    };
    out.status = resp.status().as_u16();
    out.decided_host = resp
        .headers()
        .get(DECISION_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(decision_host);
    let mut reader = BufReader::new(resp.body_mut().as_reader());
    if out.status != 200 {
        let mut text = String::new();
        let _ = (&mut reader).take(4096).read_to_string(&mut text);
        let snippet: String = text.chars().take(MAX_ERROR_TEXT).collect();
        out.error = Some(format!("status {}: {}", out.status, snippet.trim()));
        out.e2e_ms = ms(started.elapsed());
        return out;
    }
    let mut last: Option<Instant> = None;
    let mut done = false;
    let mut line = Vec::new();
    loop {
        line.clear();
        match read_line(&mut reader, &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                out.error = Some(format!("stream: {e}"));
                break;
            }
        }
        let Some(data) = line.strip_prefix(b"data:") else {
            continue;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            done = true;
            break;
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(data) else {
            out.error = Some("stream: a chunk is not JSON".to_owned());
            break;
        };
        if let Some(err) = chunk.get("error") {
            out.error = Some(format!("stream error: {}", truncate(&err.to_string())));
            break;
        }
        let content = chunk
            .pointer("/choices/0/delta/content")
            .or_else(|| chunk.pointer("/choices/0/text"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !content.is_empty() {
            let now = Instant::now();
            match last {
                None => out.ttft_ms = Some(ms(now - started)),
                Some(prev) => out.itl_ms.push(ms(now - prev)),
            }
            last = Some(now);
            out.text.push_str(content);
        }
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            out.usage.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64);
            out.usage.completion_tokens = u.get("completion_tokens").and_then(Value::as_u64);
            out.usage.cached_tokens = u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64);
        }
        if let Some(sim) = chunk.get("kvroute_sim").filter(|u| !u.is_null()) {
            out.usage.engine = sim.get("engine").and_then(Value::as_u64);
            out.usage.queue_ms = sim.get("queue_ms").and_then(Value::as_f64);
            out.usage.prefill_ms = sim.get("prefill_ms").and_then(Value::as_f64);
            out.usage.preempted = sim.get("preempted").and_then(Value::as_u64);
        }
    }
    if out.error.is_none() && !done {
        out.error = Some("stream ended before [DONE]".to_owned());
    }
    if out.error.is_none() && out.ttft_ms.is_none() {
        out.error = Some("stream carried no content".to_owned());
    }
    out.e2e_ms = ms(started.elapsed());
    out
}

/// Reads one line, bounded by [`MAX_LINE`].
fn read_line<R: BufRead>(r: &mut R, line: &mut Vec<u8>) -> std::io::Result<usize> {
    let n = r.take(MAX_LINE as u64).read_until(b'\n', line)?;
    if n == MAX_LINE && line.last() != Some(&b'\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "SSE line too long",
        ));
    }
    Ok(n)
}

fn truncate(s: &str) -> String {
    s.chars().take(MAX_ERROR_TEXT).collect()
}

/// The error's class for the report's error table: the part before the
/// first colon (`status 503`, `transport`, `stream`).
pub fn error_class(e: &str) -> String {
    e.split(':').next().unwrap_or(e).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_host_reads_the_host_field() {
        assert_eq!(
            decision_host("reason=session; host=127.0.0.1:8003; key=38cfa3225de32298").as_deref(),
            Some("127.0.0.1:8003")
        );
        assert_eq!(
            decision_host("host=10.0.0.1:80").as_deref(),
            Some("10.0.0.1:80")
        );
        assert_eq!(decision_host("reason=no-hosts"), None);
        assert_eq!(decision_host("reason=x; host="), None);
        assert_eq!(decision_host(""), None);
    }

    #[test]
    fn error_class_is_the_part_before_the_colon() {
        assert_eq!(error_class("status 503: engine down"), "status 503");
        assert_eq!(error_class("transport: connection refused"), "transport");
        assert_eq!(
            error_class("stream ended before [DONE]"),
            "stream ended before [DONE]"
        );
    }
}

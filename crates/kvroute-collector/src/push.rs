//! Pushing snapshots to one gateway: `POST <base>/v1/fleet/snapshot` with
//! `Authorization: Bearer <token>` and the snapshot JSON.
//!
//! Each gateway has its own thread and a one-slot mailbox: the collector loop
//! drops the newest snapshot in, the thread sends whatever is newest when it
//! is free. A slow or dead gateway therefore never delays another gateway or
//! the scraping, and never receives a backlog of stale snapshots; the `seq`s
//! it sees are increasing.
//!
//! Answers: 2xx accepted (the ingest answers 204); 401 bad token; 413 too
//! large; 400 invalid (body `{"error": "..."}`); 409 `seq` older than the
//! stored snapshot, or another collector owns the gateway's snapshot. Every
//! result is counted by gateway and status; a change of result is logged
//! once, with the status and the gateway's error text,
//! so a refusing gateway does not fill the log four times a second. Nothing
//! stops the pushing.

use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use log::{info, warn};

use crate::config::{Gateway, Secret};
use crate::metrics::Metrics;
use crate::now_ms;
use crate::scrape::classify;

/// A snapshot ready to send: its `seq` (for messages) and its JSON.
#[derive(Debug, Clone)]
pub struct Payload {
    pub seq: u64,
    pub body: Arc<Vec<u8>>,
}

#[derive(Debug, Default)]
struct Mailbox {
    latest: Option<Payload>,
    stop: bool,
}

#[derive(Debug, Default)]
struct Slot {
    mailbox: Mutex<Mailbox>,
    wake: Condvar,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Mailbox> {
        self.mailbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The pushing thread of one gateway.
#[derive(Debug)]
pub struct Pusher {
    slot: Arc<Slot>,
    handle: Option<thread::JoinHandle<()>>,
}

impl Pusher {
    pub fn spawn(
        gateway: Gateway,
        token: Secret,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> io::Result<Pusher> {
        let slot = Arc::new(Slot::default());
        let mine = Arc::clone(&slot);
        let handle = thread::Builder::new()
            .name(format!("push {}", gateway.base))
            .spawn(move || run(&gateway, &token, timeout, &metrics, &mine))?;
        Ok(Pusher {
            slot,
            handle: Some(handle),
        })
    }

    /// Replaces any snapshot not yet sent with this one.
    pub fn offer(&self, payload: Payload) {
        self.slot.lock().latest = Some(payload);
        self.slot.wake.notify_one();
    }

    /// Stops after the push in flight, if any; waits for the thread.
    pub fn join(mut self) {
        self.slot.lock().stop = true;
        self.slot.wake.notify_one();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The result of one push, as counted and compared for logging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An HTTP status and the gateway's error text (empty on success).
    Answered { status: u16, text: String },
    /// A transport failure: its label and message.
    Failed {
        cause: &'static str,
        message: String,
    },
}

impl Outcome {
    pub fn accepted(&self) -> bool {
        matches!(self, Outcome::Answered { status, .. } if (200..300).contains(status))
    }

    /// The metric label: the status code, or the transport cause.
    pub fn label(&self) -> String {
        match self {
            Outcome::Answered { status, .. } => status.to_string(),
            Outcome::Failed { cause, .. } => (*cause).to_owned(),
        }
    }
}

fn run(gateway: &Gateway, token: &Secret, timeout: Duration, metrics: &Metrics, slot: &Slot) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .proxy(None)
        .max_redirects(0)
        .user_agent(concat!("kvroute-collector/", env!("CARGO_PKG_VERSION")))
        .build()
        .into();
    let auth = format!("Bearer {}", token.expose());
    let mut last_label: Option<String> = None;
    loop {
        let payload = {
            let mut mb = slot.lock();
            loop {
                if mb.stop {
                    return;
                }
                if let Some(p) = mb.latest.take() {
                    break p;
                }
                mb = slot.wake.wait(mb).unwrap_or_else(|p| p.into_inner());
            }
        };
        let started = Instant::now();
        let outcome = post(&agent, &gateway.push_url, &auth, &payload.body);
        let label = outcome.label();
        metrics.push(
            &gateway.base,
            &label,
            started.elapsed().as_secs_f64(),
            outcome.accepted().then(now_ms),
        );
        if last_label.as_deref() != Some(label.as_str()) {
            log_change(gateway, &payload, &outcome, last_label.is_none());
            last_label = Some(label);
        }
    }
}

/// Sends one snapshot.
pub fn post(agent: &ureq::Agent, url: &str, auth: &str, body: &[u8]) -> Outcome {
    let result = agent
        .post(url)
        .header("Authorization", auth)
        .header("Content-Type", "application/json")
        .send(body);
    match result {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            let raw = resp
                .body_mut()
                .with_config()
                .limit(16 << 10)
                .lossy_utf8(true)
                .read_to_string()
                .unwrap_or_default();
            Outcome::Answered {
                status,
                text: error_text(&raw),
            }
        }
        Err(e) => Outcome::Failed {
            cause: classify(&e),
            message: e.to_string(),
        },
    }
}

/// The `error` of a `{"error": "..."}` body, else the body; one line, at
/// most 300 characters.
fn error_text(raw: &str) -> String {
    let text = serde_json::from_str::<serde_json::Value>(raw)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
        .unwrap_or_else(|| raw.to_owned());
    let one_line: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(300)
        .collect();
    one_line
}

fn log_change(gateway: &Gateway, payload: &Payload, outcome: &Outcome, first: bool) {
    let gw = &gateway.base;
    match outcome {
        o if o.accepted() => {
            if first {
                info!(
                    "gateway {gw}: pushing snapshots (first push accepted, seq {})",
                    payload.seq
                );
            } else {
                info!("gateway {gw}: pushes accepted again (seq {})", payload.seq);
            }
        }
        Outcome::Answered { status, text } => {
            let hint = match status {
                401 => " (check the ingest token: it must match the gateway's)".to_owned(),
                413 => format!(
                    " (the {}-byte snapshot is over the gateway's size limit)",
                    payload.body.len()
                ),
                400 => " (the gateway found the snapshot invalid)".to_owned(),
                409 if text.contains("owns this gateway's snapshot") => {
                    " (another collector pushes to this gateway and owns its snapshot: this one takes over only when that one stops; give each gateway one collector, or run this one as a standby)".to_owned()
                }
                409 => format!(
                    " (seq {} is older than the gateway's stored snapshot: another collector pushes later seqs, or this host's clock stepped back)",
                    payload.seq
                ),
                _ => String::new(),
            };
            let text = if text.is_empty() {
                "(no body)"
            } else {
                text.as_str()
            };
            warn!("gateway {gw}: push refused with {status}: {text}{hint}; will keep pushing");
        }
        Outcome::Failed { cause, message } => {
            warn!("gateway {gw}: push failed ({cause}): {message}; will keep pushing");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_prefers_the_json_error() {
        assert_eq!(
            error_text("{\"error\": \"seq: 5 is older than 7\"}"),
            "seq: 5 is older than 7"
        );
        assert_eq!(error_text("plain\ntext\n"), "plain text");
        assert_eq!(error_text(&"x".repeat(1000)).len(), 300);
        assert_eq!(error_text(""), "");
    }

    #[test]
    fn outcome_labels() {
        let ok = Outcome::Answered {
            status: 204,
            text: String::new(),
        };
        assert!(ok.accepted());
        assert_eq!(ok.label(), "204");
        let no = Outcome::Answered {
            status: 409,
            text: "old".into(),
        };
        assert!(!no.accepted());
        let down = Outcome::Failed {
            cause: "refused",
            message: "x".into(),
        };
        assert_eq!(down.label(), "refused");
        assert!(!down.accepted());
    }
}

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
//!
//! **Several gateways.** A collector that pushes to two gateways or more,
//! or to a gateway service (one collector for all gateway replicas), also
//! reads each gateway's
//! in-flight load just before pushing to it (`GET <base>/v1/fleet/load`,
//! the same token; [`kvroute_core::load::LoadReport`]), waits briefly for
//! the other gateways' reads of the same round ([`LoadBoard`]), and sets
//! every host's `peerPendingTokens` to the sum of the *other* gateways'
//! pending prefill there, from reads younger than [`LOAD_MAX_AGE_MS`]. The
//! gateway adds that to its own live figure, drained at its prefill rate
//! from the host's scrape time (docs/fleet-state.md, "Several gateways").
//! A gateway whose load cannot be read counts as unknown, not idle: with no
//! other gateway's load known, the field is left out. Results are counted
//! in `kvroute_collector_load_reads_total`; a change of result is logged.
//! Gateways found through `--gateway-service` join the board when their
//! address appears and leave it when it goes.
//!
//! The same read asks for the gateway's recent placements
//! (`?placed=1`, [`kvroute_core::placed`]): each gateway whose own report
//! carries the field gets the *other* gateways' placements from reads
//! younger than [`LOAD_MAX_AGE_MS`], aged to the push, one per key, in its
//! snapshot's `placed`; a gateway whose report has no such field (an
//! older filter, which would refuse it) gets none. Likewise the gateways'
//! recent requests' last blocks (`&lastBlocks=1`,
//! [`kvroute_core::placed::report_last`]): a gateway whose report carries
//! `lastBlocks` gets the others' in its snapshot's `lastBlocks`, one per
//! block and replica, so that a conversation's next turn finds its
//! previous turn's replica on whichever gateway it arrives.
//!
//! **Peers** (`--peer-gateways`, `--peer-gateway-service`): gateways that
//! another collector pushes to, as in the sidecar layout where each gateway
//! pod has its own collector. A peer gets a thread like a pushed gateway,
//! which reads its load at each round and joins the board, but never
//! pushes to it; so a sidecar's snapshots carry the other replicas'
//! pending prefill as a shared collector's do. Each sidecar reads its own
//! gateway and every other replica: N gateway pods make N x N small GETs
//! per push interval, N x (N - 1) of them across pods.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use kvroute_core::fleet::{Snapshot, MAX_ARRIVALS_PER_S};
use kvroute_core::ingest;
use kvroute_core::load::LoadReport;
use kvroute_core::placed::{self, LastBlock, Placement};
use log::{info, warn};

use crate::config::{Gateway, Secret};
use crate::metrics::Metrics;
use crate::now_ms;
use crate::scrape::classify;

/// A snapshot ready to send: its `seq` (for messages), the snapshot and
/// its JSON.
#[derive(Debug, Clone)]
pub struct Payload {
    pub seq: u64,
    pub snapshot: Arc<Snapshot>,
    pub body: Arc<Vec<u8>>,
}

/// A gateway's load read older than this is not used (its gateway stopped
/// answering): eight push intervals of 250 ms, the router's default
/// `staleAfterMs`.
pub const LOAD_MAX_AGE_MS: u64 = 2000;

/// Largest load answer read (a full fleet of [`kvroute_core::fleet::MAX_HOSTS`]
/// hosts is about 400 KiB).
const LOAD_MAX_BYTES: u64 = 1 << 20;

/// How long a pusher waits for the other pushers' reads of the same round
/// before it sums what it has.
const READ_WAIT: Duration = Duration::from_millis(25);

#[derive(Debug, Clone, Default)]
struct Read {
    /// When this gateway's last read ended (answered or failed).
    tried_ms: u64,
    /// The last good read and when it was made; `None` after a failure.
    load: Option<(u64, LoadReport)>,
}

/// The gateways' in-flight loads, one slot per gateway (by its base URL).
/// Every pusher is handed a new snapshot at the same moment; each reads its
/// own gateway's load, waits up to [`READ_WAIT`] for the others' reads of
/// that round, and sums the others' into the snapshot it sends. So the
/// figures a gateway gets are about as old as the snapshot itself.
/// Gateways found by a service name join and leave as it resolves.
#[derive(Debug, Default)]
pub struct LoadBoard {
    slots: Mutex<BTreeMap<String, Read>>,
    changed: Condvar,
}

impl LoadBoard {
    pub fn new() -> LoadBoard {
        LoadBoard::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Read>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A gateway's slot, empty until its first read.
    pub fn join(&self, gateway: &str) {
        self.lock().entry(gateway.to_owned()).or_default();
    }

    /// Drops a gateway's slot: its load no longer counts, and rounds no
    /// longer wait for it.
    pub fn leave(&self, gateway: &str) {
        self.lock().remove(gateway);
        self.changed.notify_all();
    }

    /// A gateway's load, asked for at `now_ms`: the report, or `None` (the
    /// read failed). Ignored for a gateway that has left.
    pub fn set(&self, gateway: &str, now_ms: u64, load: Option<LoadReport>) {
        if let Some(slot) = self.lock().get_mut(gateway) {
            slot.tried_ms = now_ms;
            slot.load = load.map(|r| (now_ms, r));
        }
        self.changed.notify_all();
    }

    /// Waits until every gateway's load was asked for at or after
    /// `since_ms`, at most `limit`.
    pub fn wait_round(&self, since_ms: u64, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut slots = self.lock();
        while slots.values().any(|s| s.tried_ms < since_ms) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            slots = match self.changed.wait_timeout(slots, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// The other gateways' pending prefill by address, summed over reads
    /// younger than [`LOAD_MAX_AGE_MS`]; `None` when no other gateway's
    /// load is known.
    ///
    /// A board exists only where the collector was given the gateways (a
    /// gateway service, peers, or a list of several), so a board on which
    /// `me` is alone knows there is no other gateway: none has load
    /// (an empty sum, not `None`), and the gateway's snapshots say so
    /// (`peerPendingTokens` 0), which its router reads as a fleet whose
    /// gateways all learn where a request went (`sharedOnlyHomeShare`).
    /// A lone sidecar, given only its own gateway, has no board.
    pub fn others(&self, me: &str, now_ms: u64) -> Option<HashMap<String, PeerLoad>> {
        let slots = self.lock();
        if slots.contains_key(me) && slots.len() == 1 {
            return Some(HashMap::new());
        }
        let mut sum: Option<HashMap<String, PeerLoad>> = None;
        for (gateway, slot) in slots.iter() {
            let Some((read_ms, report)) = &slot.load else {
                continue;
            };
            if gateway == me || now_ms.saturating_sub(*read_ms) > LOAD_MAX_AGE_MS {
                continue;
            }
            let sum = sum.get_or_insert_with(HashMap::new);
            for h in &report.hosts {
                let v = sum.entry(h.address.clone()).or_default();
                v.pending = v.pending.saturating_add(h.prefill_pending_tokens);
                v.arrivals_per_s += h.arrivals_per_s.unwrap_or(0.0);
            }
        }
        sum
    }
}

impl LoadBoard {
    /// Whether `me`'s last load report said it counts arrivals (and so
    /// reads `peerArrivalsPerS`; an older gateway rejects a snapshot that
    /// has the field).
    pub fn counts_arrivals(&self, me: &str) -> bool {
        let slots = self.lock();
        slots
            .get(me)
            .and_then(|s| s.load.as_ref())
            .is_some_and(|(_, r)| r.arrival_window_ms.is_some())
    }

    /// The other gateways' recent placements ([`placed`]), their
    /// ages counted to `now_ms`, for a gateway whose own last report had
    /// the field (it reads them); `None` for one that does not.
    pub fn placed_for(&self, me: &str, now_ms: u64) -> Option<Vec<Placement>> {
        let all = self.of_others(
            me,
            now_ms,
            |r| r.placed.as_deref(),
            |p, since| Placement {
                age_ms: p.age_ms.saturating_add(since),
                ..p.clone()
            },
        )?;
        Some(placed::merge(all))
    }

    /// The other gateways' recent requests' last blocks
    /// ([`placed::report_last`]), aged to `now_ms`, for a gateway whose own
    /// last report had the field; `None` for one that does not.
    pub fn last_blocks_for(&self, me: &str, now_ms: u64) -> Option<Vec<LastBlock>> {
        let all = self.of_others(
            me,
            now_ms,
            |r| r.last_blocks.as_deref(),
            |b, since| LastBlock {
                age_ms: b.age_ms.saturating_add(since),
                ..b.clone()
            },
        )?;
        Some(placed::merge_last(all))
    }

    /// A list field (`field`) of the other gateways' reads younger than
    /// [`LOAD_MAX_AGE_MS`], each item aged by `aged` to `now_ms` (given
    /// the ms since its read), for a gateway whose own last report had the
    /// field; `None` for one that does not.
    fn of_others<T>(
        &self,
        me: &str,
        now_ms: u64,
        field: impl Fn(&LoadReport) -> Option<&[T]>,
        aged: impl Fn(&T, u64) -> T,
    ) -> Option<Vec<T>> {
        let slots = self.lock();
        let mine = slots.get(me)?.load.as_ref()?;
        field(&mine.1)?;
        let others = slots.iter().filter(|(g, _)| g.as_str() != me);
        let young = others
            .filter_map(|(_, s)| s.load.as_ref())
            .filter(|(read_ms, _)| now_ms.saturating_sub(*read_ms) <= LOAD_MAX_AGE_MS);
        let mut out = Vec::new();
        for (read_ms, r) in young {
            let since = now_ms.saturating_sub(*read_ms);
            out.extend(field(r).unwrap_or_default().iter().map(|x| aged(x, since)));
        }
        Some(out)
    }
}

/// The other gateways' figures for one replica, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerLoad {
    /// Prefill tokens pending.
    pub pending: u64,
    /// Requests per second sent lately.
    pub arrivals_per_s: f64,
}

/// `snap` with every host's `peerPendingTokens` from `others` (0 where no
/// other gateway has any), and `peerArrivalsPerS` likewise for a gateway
/// that reads it (`arrivals`), bounded as the snapshot's check requires.
pub fn with_peers(snap: &Snapshot, others: &HashMap<String, PeerLoad>, arrivals: bool) -> Snapshot {
    let mut out = snap.clone();
    for h in &mut out.hosts {
        let peer = others.get(&h.address).copied().unwrap_or_default();
        h.peer_pending_tokens = Some(peer.pending);
        let rate = peer.arrivals_per_s;
        h.peer_arrivals_per_s = arrivals.then(|| {
            if rate.is_finite() {
                rate.clamp(0.0, MAX_ARRIVALS_PER_S)
            } else {
                MAX_ARRIVALS_PER_S
            }
        });
    }
    out
}

/// What one pusher shares with the others: the board (where its gateway
/// has joined).
#[derive(Debug, Clone)]
pub struct Peers {
    pub board: Arc<LoadBoard>,
}

#[derive(Debug, Default)]
struct Mailbox {
    latest: Option<Payload>,
    stop: bool,
    /// On stopping, drop the gateway's metric series (it went away).
    forget: bool,
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
    /// `peers`: with two gateways or more, the shared load board; the
    /// gateway joins it here (and leaves it if the thread cannot start).
    pub fn spawn(
        gateway: Gateway,
        token: Secret,
        timeout: Duration,
        metrics: Arc<Metrics>,
        peers: Option<Peers>,
    ) -> io::Result<Pusher> {
        let board = peers
            .as_ref()
            .map(|p| (Arc::clone(&p.board), gateway.base.clone()));
        if let Some((b, base)) = &board {
            b.join(base);
        }
        let slot = Arc::new(Slot::default());
        let mine = Arc::clone(&slot);
        let spawned = thread::Builder::new()
            .name(format!("push {}", gateway.base))
            .spawn(move || {
                run(&gateway, &token, timeout, &metrics, &mine, peers.as_ref());
                // Last, so that nothing this thread records outlives it.
                if mine.lock().forget {
                    metrics.forget_gateway(&gateway.base);
                }
            });
        let handle = match spawned {
            Ok(h) => h,
            Err(e) => {
                // No thread will read this gateway's load: rounds must not
                // wait for it.
                if let Some((b, base)) = &board {
                    b.leave(base);
                }
                return Err(e);
            }
        };
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
        self.signal_stop();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }

    /// Stops after the push in flight, if any, without waiting (its last
    /// push may take the whole push timeout): the thread, to join when it
    /// has ended. `forget`: then drop the gateway's metric series (it went
    /// away; not when it only changed roles, since its new thread records
    /// under the same name and may already have).
    pub fn stop(mut self, forget: bool) -> Option<thread::JoinHandle<()>> {
        self.slot.lock().forget = forget;
        self.signal_stop();
        self.handle.take()
    }

    /// Asks the thread to stop after the push in flight (then `join`).
    pub fn signal_stop(&self) {
        self.slot.lock().stop = true;
        self.slot.wake.notify_one();
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

fn run(
    gateway: &Gateway,
    token: &Secret,
    timeout: Duration,
    metrics: &Metrics,
    slot: &Slot,
    peers: Option<&Peers>,
) {
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
    let mut last_load: Option<String> = None;
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
        let body = match peers {
            Some(p) => {
                let url = format!(
                    "{}?{}&{}",
                    gateway.load_url,
                    ingest::LOAD_PLACED_QUERY,
                    ingest::LOAD_LAST_BLOCKS_QUERY
                );
                let (read, label) = read_load(&agent, &url, &auth);
                if slot.lock().stop {
                    return; // the gateway went away meanwhile
                }
                metrics.load_read(&gateway.base, &label);
                p.board.set(&gateway.base, now_ms(), read);
                if last_load.as_deref() != Some(label.as_str()) {
                    if label == "ok" {
                        info!("gateway {}: reading its in-flight load", gateway.base);
                    } else if gateway.peer {
                        warn!(
                            "peer gateway {}: cannot read its in-flight load ({label}); the gateways pushed to get none of it",
                            gateway.base
                        );
                    } else {
                        warn!(
                            "gateway {}: cannot read its in-flight load ({label}); the other gateways get none of it",
                            gateway.base
                        );
                    }
                    last_load = Some(label);
                }
                if gateway.peer {
                    // Read only: another collector pushes to it.
                    continue;
                }
                p.board.wait_round(payload.snapshot.taken_at_ms, READ_WAIT);
                let now = now_ms();
                let placed = p.board.placed_for(&gateway.base, now);
                let last = p.board.last_blocks_for(&gateway.base, now);
                match (p.board.others(&gateway.base, now), placed, last) {
                    (None, None, None) => Arc::clone(&payload.body),
                    (others, placed, last) => {
                        let mut snap = match others {
                            Some(others) => with_peers(
                                &payload.snapshot,
                                &others,
                                p.board.counts_arrivals(&gateway.base),
                            ),
                            None => (*payload.snapshot).clone(),
                        };
                        snap.placed = placed.unwrap_or_default();
                        snap.last_blocks = last.unwrap_or_default();
                        Arc::new(snap.to_json())
                    }
                }
            }
            None => Arc::clone(&payload.body),
        };
        if gateway.peer {
            continue; // no board: nothing to read it for
        }
        let started = Instant::now();
        let outcome = post(&agent, &gateway.push_url, &auth, &body);
        if slot.lock().stop {
            // The gateway went away meanwhile: its series are gone.
            return;
        }
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

/// Reads a gateway's in-flight load: the report, and the result's label.
pub fn read_load(agent: &ureq::Agent, url: &str, auth: &str) -> (Option<LoadReport>, String) {
    match agent.get(url).header("Authorization", auth).call() {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            if status != 200 {
                return (None, status.to_string());
            }
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(LOAD_MAX_BYTES)
                .read_to_vec();
            match bytes
                .map_err(|e| e.to_string())
                .and_then(|b| LoadReport::from_json(&b))
            {
                Ok(r) => (Some(r), "ok".to_owned()),
                Err(_) => (None, "invalid".to_owned()),
            }
        }
        Err(e) => (None, classify(&e).to_owned()),
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

    fn report(entries: &[(&str, u64)]) -> LoadReport {
        LoadReport {
            hosts: entries
                .iter()
                .map(|&(a, p)| kvroute_core::load::HostLoad {
                    address: a.to_owned(),
                    prefill_pending_tokens: p,
                    memory_tokens: p,
                    // A quarter of a request a second per pending token.
                    arrivals_per_s: Some(p as f64 / 4.0),
                })
                .collect(),
            placed: None,
            last_blocks: None,
            arrival_window_ms: Some(10_000),
        }
    }

    fn placing(key: u64, address: &str, age_ms: u64) -> LoadReport {
        LoadReport {
            placed: Some(vec![Placement {
                key: format!("{key:016x}"),
                address: address.to_owned(),
                age_ms,
            }]),
            ..report(&[])
        }
    }

    /// A gateway gets the other gateways' placements, aged to the push,
    /// only when its own report carries the field (it reads them).
    #[test]
    fn the_board_hands_each_gateway_the_others_placements() {
        let b = LoadBoard::new();
        for g in ["g0", "g1", "g2"] {
            b.join(g);
        }
        b.set("g0", 10_000, Some(placing(1, "a:1", 100)));
        b.set("g1", 10_000, Some(report(&[])));
        b.set("g2", 10_100, Some(placing(2, "b:1", 0)));
        // g1's own report has no `placed`: an older gateway, none for it.
        assert_eq!(b.placed_for("g1", 10_200), None);
        let p = b.placed_for("g0", 10_200).unwrap();
        assert_eq!(p.len(), 1, "not its own");
        assert_eq!((p[0].key.as_str(), p[0].age_ms), ("0000000000000002", 100));
        let p = b.placed_for("g2", 10_200).unwrap();
        assert_eq!((p[0].address.as_str(), p[0].age_ms), ("a:1", 300));
        // Reads older than LOAD_MAX_AGE_MS no longer count.
        assert_eq!(
            b.placed_for("g2", 10_000 + LOAD_MAX_AGE_MS + 1),
            Some(vec![])
        );
        // Nothing read for a gateway yet: none.
        b.join("g3");
        assert_eq!(b.placed_for("g3", 10_200), None);
    }

    /// Last blocks likewise: the others', aged to the push, one per block
    /// and replica, only to a gateway whose own report carries the field.
    #[test]
    fn the_board_hands_each_gateway_the_others_last_blocks() {
        let last = |block: u64, address: &str, age_ms: u64| LastBlock {
            block: format!("{block:016x}"),
            blocks: 9,
            address: address.to_owned(),
            age_ms,
        };
        let with = |blocks: Vec<LastBlock>| LoadReport {
            last_blocks: Some(blocks),
            ..report(&[])
        };
        let b = LoadBoard::new();
        for g in ["g0", "g1", "g2"] {
            b.join(g);
        }
        b.set(
            "g0",
            10_000,
            Some(with(vec![last(1, "a:1", 100), last(2, "a:1", 50)])),
        );
        b.set("g1", 10_000, Some(report(&[])));
        b.set("g2", 10_100, Some(with(vec![last(1, "a:1", 20)])));
        assert_eq!(b.last_blocks_for("g1", 10_200), None, "no field, none");
        let got = |g: &str| {
            let v = b.last_blocks_for(g, 10_200).unwrap();
            v.iter()
                .map(|x| (x.block_value().unwrap(), x.age_ms))
                .collect::<Vec<_>>()
        };
        assert_eq!(got("g0"), [(1, 120)], "not its own");
        assert_eq!(got("g2"), [(2, 250), (1, 300)]);
        let late = 10_000 + LOAD_MAX_AGE_MS + 1;
        assert_eq!(b.last_blocks_for("g0", late).map(|v| v.len()), Some(1));
        assert_eq!(b.last_blocks_for("g2", late), Some(vec![]));
    }

    #[test]
    fn the_board_sums_the_other_gateways_fresh_reads() {
        let b = LoadBoard::new();
        b.join("g0");
        assert_eq!(
            b.others("g0", 10_000),
            Some(HashMap::new()),
            "alone on the board: no other gateway has load"
        );
        assert_eq!(b.others("g9", 10_000), None, "not on the board");
        for g in ["g1", "g2"] {
            b.join(g);
        }
        assert_eq!(b.others("g0", 10_000), None, "nothing read yet");
        b.set("g0", 10_000, Some(report(&[("a:1", 100)])));
        assert_eq!(b.others("g0", 10_000), None, "only its own");
        b.set("g1", 10_000, Some(report(&[("a:1", 5), ("b:1", 7)])));
        b.set("g2", 9_000, Some(report(&[("a:1", 1)])));
        let o = b.others("g0", 10_000).unwrap();
        assert_eq!((o["a:1"].pending, o["b:1"].pending), (6, 7));
        assert_eq!(
            (o["a:1"].arrivals_per_s, o["b:1"].arrivals_per_s),
            (1.5, 1.75)
        );
        let o = b.others("g1", 10_000).unwrap();
        assert_eq!((o["a:1"].pending, o.get("b:1")), (101, None));
        // Each read says the gateway counts arrivals; g1 gets the others'.
        assert!(b.counts_arrivals("g1"));
        let snap = Snapshot::from_json(
            br#"{"version":1,"seq":1,"collector":"c","takenAtMs":0,"hosts":[{"address":"10.0.0.1:1","ready":true,"scrapedAtMs":0}]}"#,
        )
        .unwrap();
        let peers = HashMap::from([(
            "10.0.0.1:1".to_owned(),
            PeerLoad {
                pending: 4,
                arrivals_per_s: 0.5,
            },
        )]);
        let h = &with_peers(&snap, &peers, true).hosts[0];
        assert_eq!(
            (h.peer_pending_tokens, h.peer_arrivals_per_s),
            (Some(4), Some(0.5))
        );
        // A gateway that did not say so (an older one) gets no rate: its
        // snapshot check would reject the field.
        let h = &with_peers(&snap, &peers, false).hosts[0];
        assert_eq!(
            (h.peer_pending_tokens, h.peer_arrivals_per_s),
            (Some(4), None)
        );
        // Gateway 2's read ages out; a failed read clears gateway 1's.
        let o = b.others("g0", 11_500).unwrap();
        assert_eq!(o["a:1"].pending, 5);
        b.set("g1", 11_500, None);
        assert_eq!(b.others("g0", 11_500), None);
        b.set("g7", 11_500, None); // no such slot: ignored
        assert_eq!(b.others("g0", 11_500), None);
        // A gateway that left no longer counts.
        b.set("g1", 12_000, Some(report(&[("a:1", 3)])));
        assert_eq!(b.others("g0", 12_000).unwrap()["a:1"].pending, 3);
        b.leave("g1");
        assert_eq!(b.others("g0", 12_000), None);
        b.leave("g2");
        assert_eq!(b.others("g0", 12_000), Some(HashMap::new()), "alone again");
    }

    #[test]
    fn a_round_waits_for_every_gateways_read_and_no_longer() {
        let b = Arc::new(LoadBoard::new());
        b.join("g0");
        b.join("g1");
        b.set("g0", 5_000, None);
        // Gateway 1 was asked before 5000: the wait runs to its limit.
        b.set("g1", 4_000, None);
        let t = Instant::now();
        b.wait_round(5_000, Duration::from_millis(30));
        assert!(t.elapsed() >= Duration::from_millis(30));
        // Another thread's read ends the wait.
        let other = Arc::clone(&b);
        let h = thread::spawn(move || other.set("g1", 5_001, Some(report(&[]))));
        b.wait_round(5_000, Duration::from_secs(30));
        h.join().unwrap();
        assert_eq!(b.others("g0", 5_001), Some(HashMap::new()));
        // So does a gateway leaving.
        b.join("g2");
        let other = Arc::clone(&b);
        let h = thread::spawn(move || other.leave("g2"));
        b.wait_round(5_000, Duration::from_secs(30));
        h.join().unwrap();
    }

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

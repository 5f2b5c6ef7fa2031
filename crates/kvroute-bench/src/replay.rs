//! The open-loop replay: every session starts at its own time, whatever
//! the router is doing, and its turns follow one another with think time.
//!
//! One thread per live session; the dispatcher sleeps until the next
//! session is due. Finished requests flow back over a channel to the
//! caller's thread, which drives the progress display.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use kvroute_sim::engine::{block_hashes, chat_prompt, BLOCK_TOKENS, BYTES_PER_TOKEN};

use crate::ceiling::Blocks;
use crate::client::{self, Outcome};
use crate::engines::{Sample, Sampler};
use crate::workload::{Session, Workload};

/// How to replay.
#[derive(Debug, Clone)]
pub struct Options {
    /// Base URL of the router (`http://127.0.0.1:10000`).
    pub target: String,
    /// Base URLs of the engines, for the sampler.
    pub engines: Vec<String>,
    pub model: String,
    /// Modelled seconds per real second (the simulator's `--time-scale`).
    pub time_scale: f64,
    /// Header that carries the session key (none: not sent).
    pub session_header: Option<String>,
    /// Send each conversation as one user message ([`sent_history`]).
    pub flat_prompt: bool,
    /// Per-request limit, modelled seconds.
    pub timeout_s: f64,
    /// Engine sampling interval, real time.
    pub sample_every: Duration,
    pub seed: u64,
    /// Label of the progress bar.
    pub label: String,
}

/// The header a session's objective is sent in (kvroute's
/// `admission.objectiveHeader` default, GIE's name).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// One finished request.
#[derive(Debug, Clone)]
pub struct Record {
    /// Position in send order.
    pub seq: u64,
    pub session: usize,
    pub turn: usize,
    /// The objective the request named (its session's), if any.
    pub objective: Option<String>,
    /// Modelled seconds from the start of the replay to the send.
    pub sent_s: f64,
    /// Wall-clock time of the send, Unix ms (to line requests up with
    /// events outside the replay, such as injected faults).
    pub sent_unix_ms: u64,
    pub outcome: Outcome,
    /// Block hashes for the ceilings (empty when the request failed).
    pub blocks: Blocks,
}

/// Everything a replay produced.
pub struct Replay {
    pub records: Vec<Record>,
    pub samples: Vec<Sample>,
    /// Modelled seconds from the first send to the last answer.
    pub duration_s: f64,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    messages: Vec<Message<'a>>,
    max_tokens: u32,
    stream: bool,
    stream_options: StreamOptions,
}

/// The streamed chat request the client sends for `history` ((role,
/// content) pairs), usage included: the real-time client and the fleet
/// simulation send the same bytes.
pub fn chat_body(
    model: &str,
    history: &[(&'static str, String)],
    max_tokens: u32,
) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&ChatRequest {
        model,
        messages: history
            .iter()
            .map(|(role, content)| Message { role, content })
            .collect(),
        max_tokens,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
    })
}

/// The messages a request sends for `history`: the history itself, or with
/// `flat` one user message holding every message's text in order, joined by
/// a blank line, as a client sends a conversation through a bare prompt
/// (`/v1/completions`, a template rendered client-side, a trace replay). Each
/// turn's text is then a byte prefix of the next turn's, and only the bytes
/// say where a shared system prompt ends and a conversation begins.
pub fn sent_history<'a>(
    history: &'a [(&'static str, String)],
    flat: bool,
) -> std::borrow::Cow<'a, [(&'static str, String)]> {
    if !flat {
        return std::borrow::Cow::Borrowed(history);
    }
    let text = history
        .iter()
        .map(|(_, c)| c.as_str())
        .collect::<Vec<_>>()
        .join("\n\n");
    std::borrow::Cow::Owned(vec![("user", text)])
}

/// What a session thread needs.
struct Shared {
    opts: Options,
    agent: ureq::Agent,
    url: String,
    seq: AtomicU64,
    started: Instant,
}

/// Replays `workload`; blocks until every request has an outcome.
pub fn run(workload: &Workload, opts: Options) -> Replay {
    let total = workload.requests();
    let bar = progress(total as u64, &opts.label);
    let timeout = Duration::from_secs_f64((opts.timeout_s / opts.time_scale).max(1.0));
    let started = Instant::now();
    let sampler = Sampler::start(
        opts.engines.clone(),
        opts.sample_every,
        opts.time_scale,
        started,
    );
    let shared = Arc::new(Shared {
        url: format!("{}/v1/chat/completions", opts.target.trim_end_matches('/')),
        agent: client::agent(timeout),
        opts,
        seq: AtomicU64::new(0),
        started,
    });
    let (tx, rx) = mpsc::channel::<Record>();
    let sessions = workload.sessions.clone();
    let dispatcher_shared = Arc::clone(&shared);
    let dispatcher = thread::Builder::new()
        .name("dispatch".to_owned())
        .spawn(move || {
            let shared = dispatcher_shared;
            let mut handles = Vec::new();
            for (i, session) in sessions.into_iter().enumerate() {
                let due = Duration::from_secs_f64(
                    (session.start_ms / 1000.0 / shared.opts.time_scale).max(0.0),
                );
                if let Some(wait) = due.checked_sub(shared.started.elapsed()) {
                    thread::sleep(wait);
                }
                let turns = session.turns.len();
                let s = Arc::clone(&shared);
                let session_tx = tx.clone();
                let objective = session.objective.clone();
                let spawned = thread::Builder::new()
                    .name("session".to_owned())
                    .stack_size(512 * 1024)
                    .spawn(move || run_session(&s, i, &session, &session_tx));
                match spawned {
                    Ok(h) => handles.push(h),
                    Err(e) => {
                        // Out of threads: report every turn as failed, never drop it.
                        for turn in 0..turns {
                            let why = format!("client: cannot start a thread: {e}");
                            let _ = tx.send(failed(&shared, i, turn, objective.clone(), why));
                        }
                    }
                }
                handles.retain(|h| !h.is_finished());
            }
            for h in handles {
                let _ = h.join();
            }
        });
    let mut records = Vec::with_capacity(total);
    let mut errors = 0u64;
    let mut last_line = Instant::now();
    let tty = std::io::stderr().is_terminal();
    if dispatcher.is_ok() {
        for r in rx.iter() {
            if r.outcome.error.is_some() {
                errors += 1;
            }
            records.push(r);
            bar.set_position(records.len() as u64);
            bar.set_message(format!("{errors} errors"));
            if !tty && (last_line.elapsed() > Duration::from_secs(15) || records.len() == total) {
                eprintln!(
                    "  {}: {}/{} requests, {} errors",
                    shared.opts.label,
                    records.len(),
                    total,
                    errors
                );
                last_line = Instant::now();
            }
        }
    } else {
        drop(rx);
    }
    if let Ok(h) = dispatcher {
        let _ = h.join();
    }
    bar.finish_and_clear();
    let duration_s = started.elapsed().as_secs_f64() * shared.opts.time_scale;
    let samples = sampler.finish();
    records.sort_by_key(|r| r.seq);
    Replay {
        records,
        samples,
        duration_s,
    }
}

/// Wall-clock now, Unix ms (0 if the clock is before 1970).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn progress(total: u64, label: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "  {prefix:>14} [{bar:32}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
    )
    .map(|s| s.progress_chars("=> "));
    if let Ok(style) = style {
        bar.set_style(style);
    }
    bar.set_prefix(label.to_owned());
    bar
}

fn failed(
    s: &Shared,
    session: usize,
    turn: usize,
    objective: Option<String>,
    why: String,
) -> Record {
    Record {
        seq: s.seq.fetch_add(1, Ordering::Relaxed),
        session,
        turn,
        objective,
        sent_s: s.started.elapsed().as_secs_f64() * s.opts.time_scale,
        sent_unix_ms: unix_ms(),
        outcome: Outcome {
            error: Some(why),
            ..Outcome::default()
        },
        blocks: Blocks {
            hashes: Vec::new(),
            prompt_blocks: 0,
            prompt_tokens: 0,
        },
    }
}

fn run_session(s: &Shared, index: usize, session: &Session, tx: &mpsc::Sender<Record>) {
    let seed = s.opts.seed;
    let system = session.system.as_ref().map(|t| t.render(seed));
    // (role, content) of the history so far.
    let mut history: Vec<(&'static str, String)> = Vec::new();
    if let Some(sys) = system {
        history.push(("system", sys));
    }
    let mut headers: Vec<(String, String)> = match (&s.opts.session_header, &session.key) {
        (Some(h), Some(k)) => vec![(h.clone(), k.clone())],
        _ => Vec::new(),
    };
    if let Some(o) = &session.objective {
        headers.push((OBJECTIVE_HEADER.to_owned(), o.clone()));
    }
    for (turn_no, turn) in session.turns.iter().enumerate() {
        if turn.think_ms > 0.0 {
            thread::sleep(Duration::from_secs_f64(
                turn.think_ms / 1000.0 / s.opts.time_scale,
            ));
        }
        history.push(("user", turn.user.render(seed)));
        let sent = sent_history(&history, s.opts.flat_prompt);
        let body = chat_body(&s.opts.model, &sent, turn.max_tokens);
        let prompt = chat_prompt(&sent);
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(failed(
                    s,
                    index,
                    turn_no,
                    session.objective.clone(),
                    format!("client: cannot encode the request: {e}"),
                ));
                continue;
            }
        };
        let seq = s.seq.fetch_add(1, Ordering::Relaxed);
        let sent_s = s.started.elapsed().as_secs_f64() * s.opts.time_scale;
        let sent_unix_ms = unix_ms();
        let hdrs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let outcome = client::chat(&s.agent, &s.url, &hdrs, body, s.opts.time_scale);
        let blocks = if outcome.error.is_none() {
            let prompt_blocks = prompt.len() / (BLOCK_TOKENS * BYTES_PER_TOKEN);
            let prompt_tokens = prompt.len().div_ceil(BYTES_PER_TOKEN) as u64;
            let mut all = prompt;
            all.extend_from_slice(outcome.text.as_bytes());
            Blocks {
                hashes: block_hashes(&s.opts.model, &all),
                prompt_blocks,
                prompt_tokens,
            }
        } else {
            Blocks {
                hashes: Vec::new(),
                prompt_blocks: 0,
                prompt_tokens: 0,
            }
        };
        if outcome.error.is_none() {
            history.push(("assistant", outcome.text.clone()));
        }
        let record = Record {
            seq,
            session: index,
            turn: turn_no,
            objective: session.objective.clone(),
            sent_s,
            sent_unix_ms,
            outcome,
            blocks,
        };
        if tx.send(record).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flat_conversation_is_one_message_whose_turns_extend_each_other() {
        let mut history = vec![("system", "be brief".to_owned()), ("user", "hi".to_owned())];
        assert_eq!(sent_history(&history, false).as_ref(), history.as_slice());
        let one = sent_history(&history, true).into_owned();
        assert_eq!(one, vec![("user", "be brief\n\nhi".to_owned())]);
        history.push(("assistant", "hello".to_owned()));
        history.push(("user", "more".to_owned()));
        let two = sent_history(&history, true).into_owned();
        assert_eq!(
            two,
            vec![("user", "be brief\n\nhi\n\nhello\n\nmore".to_owned())]
        );
        // The engine's prompt of turn 1, less its closing template, opens
        // turn 2's: a flat conversation is cached across turns.
        let (p1, p2) = (chat_prompt(&one), chat_prompt(&two));
        let common = p1.iter().zip(&p2).take_while(|(a, b)| a == b).count();
        assert!(common >= p1.len() - 16, "{common} of {}", p1.len());
    }
}

//! Workloads: what is sent, when, and under which session key.
//!
//! A workload is a list of [`Session`]s. A session starts at its own time
//! (open loop: arrivals never wait for answers) and sends its turns one
//! after another; each later turn carries the whole history, including the
//! engine's previous answers, so multi-turn prefixes grow the way real chat
//! does. A single-turn session is a plain request.
//!
//! Three sources:
//!
//! - [`from_mooncake`]: any trace in the Mooncake format, one JSON object a
//!   line with `timestamp` (ms), `input_length`, `output_length` (tokens)
//!   and `hash_ids` (one per 512-token block). Each hash id becomes a
//!   deterministic pseudo-text block of 512 tokens, so equal ids give
//!   byte-identical prefixes;
//! - [`sessions`]: multi-turn chat sessions with shared system prompts,
//!   growing history, heavy-tailed lengths and think time;
//! - [`groups`]: G groups with a long common prefix each and U users per
//!   group asking short questions.
//!
//! Tokens are bytes / 4, the convention of the router and the simulator.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh64::xxh64;

use crate::rng::Rng;

/// Tokens per hash id in the Mooncake format.
pub const TRACE_BLOCK_TOKENS: usize = 512;
/// Tokens left for the chat template when a trace prompt is cut to fit.
const CONTEXT_SLACK: usize = 64;
/// Bytes per token (the router's and the simulator's convention).
pub const BYTES_PER_TOKEN: usize = 4;

/// Text of a message, built when it is sent (a trace can hold gigabytes of
/// prompt text; only the ids are kept).
#[derive(Debug, Clone, PartialEq)]
pub enum Text {
    /// Pseudo-text blocks for trace hash ids, cut to `bytes`; `salt` makes
    /// the unshared tail (past the ids) unique to the request.
    Blocks {
        ids: Vec<u64>,
        bytes: usize,
        salt: u64,
    },
    /// `bytes` of pseudo-text drawn from `key`.
    Words { key: u64, bytes: usize },
}

impl Text {
    /// The text's length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Blocks { bytes, .. } | Self::Words { bytes, .. } => *bytes,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The text itself: ASCII words, `len()` bytes.
    pub fn render(&self, seed: u64) -> String {
        let mut out = String::with_capacity(self.len());
        match self {
            Self::Blocks { ids, bytes, salt } => {
                let block = TRACE_BLOCK_TOKENS * BYTES_PER_TOKEN;
                for id in ids {
                    if out.len() >= *bytes {
                        break;
                    }
                    let take = block.min(bytes - out.len());
                    words(&mut out, xxh64(&id.to_le_bytes(), seed), take);
                }
                if out.len() < *bytes {
                    let rest = bytes - out.len();
                    words(
                        &mut out,
                        xxh64(&salt.to_le_bytes(), seed ^ 0x7461_696c),
                        rest,
                    );
                }
            }
            Self::Words { key, bytes } => words(&mut out, xxh64(&key.to_le_bytes(), seed), *bytes),
        }
        out
    }
}

/// Appends exactly `n` bytes of lowercase three-letter words (and spaces)
/// drawn from `key`.
fn words(out: &mut String, key: u64, n: usize) {
    let start = out.len();
    let mut counter = 0u64;
    while out.len() - start < n {
        let mut x = xxh64(&counter.to_le_bytes(), key);
        counter += 1;
        for _ in 0..8 {
            if out.len() - start >= n {
                break;
            }
            let in_word = (out.len() - start) % 4;
            if in_word == 3 {
                out.push(' ');
            } else {
                out.push(char::from(b'a' + (x % 26) as u8));
                x /= 26;
            }
        }
    }
}

/// One turn: the user's message and how many tokens to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub user: Text,
    pub max_tokens: u32,
    /// Think time before this turn is sent (after the previous answer), ms.
    pub think_ms: f64,
}

/// A conversation (one turn for a plain request).
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// When the first turn is sent, ms from the start of the workload.
    pub start_ms: f64,
    /// Sent as the session header when present.
    pub key: Option<String>,
    /// Sent as the objective header (`x-gateway-inference-objective`)
    /// when present.
    pub objective: Option<String>,
    pub system: Option<Text>,
    pub turns: Vec<Turn>,
}

/// The sheddable objective of [`assign_objectives`].
pub const BATCH: &str = "batch";
/// The protected objective of [`assign_objectives`].
pub const INTERACTIVE: &str = "interactive";

/// Gives every session an objective by a seeded coin: [`BATCH`] for a
/// `sheddable` share of them, [`INTERACTIVE`] for the rest (kvroute's
/// admission control reads them from the objective header).
pub fn assign_objectives(wl: &mut Workload, sheddable: f64, seed: u64) {
    let mut coin = crate::rng::Rng::new(seed ^ 0x6f62_6a65_6374);
    for s in &mut wl.sessions {
        let batch = coin.unit() < sheddable;
        s.objective = Some(if batch { BATCH } else { INTERACTIVE }.to_owned());
    }
    wl.description.summary = format!(
        "{}; {:.0} % of sessions `{BATCH}` (sheddable), the rest `{INTERACTIVE}`",
        wl.description.summary,
        100.0 * sheddable
    );
}

/// What was generated, for the report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Description {
    /// `trace`, `sessions` or `groups`.
    pub kind: String,
    /// One line a reader understands.
    pub summary: String,
    pub sessions: usize,
    pub requests: usize,
    /// Workload time span (first to last arrival), seconds.
    pub span_s: f64,
    pub mean_input_tokens: f64,
    pub mean_output_tokens: f64,
}

/// A workload ready to replay.
#[derive(Debug, Clone)]
pub struct Workload {
    pub sessions: Vec<Session>,
    pub description: Description,
}

impl Workload {
    /// A workload of `sessions` (sorted by start), described as `kind`.
    pub fn new(kind: &str, summary: String, mut sessions: Vec<Session>) -> Self {
        sessions.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        let requests = sessions.iter().map(|s| s.turns.len()).sum::<usize>();
        let first = sessions.first().map_or(0.0, |s| s.start_ms);
        let last = sessions.last().map_or(0.0, |s| s.start_ms);
        // Inputs of first turns only (later turns add history at run time).
        let n = sessions.len().max(1) as f64;
        let input = sessions
            .iter()
            .map(|s| {
                let sys = s.system.as_ref().map_or(0, Text::len);
                let user = s.turns.first().map_or(0, |t| t.user.len());
                (sys + user) as f64 / BYTES_PER_TOKEN as f64
            })
            .sum::<f64>()
            / n;
        let output = sessions
            .iter()
            .flat_map(|s| s.turns.iter().map(|t| f64::from(t.max_tokens)))
            .sum::<f64>()
            / requests.max(1) as f64;
        Self {
            description: Description {
                kind: kind.to_owned(),
                summary,
                sessions: sessions.len(),
                requests,
                span_s: (last - first) / 1000.0,
                mean_input_tokens: input,
                mean_output_tokens: output,
            },
            sessions,
        }
    }

    pub fn requests(&self) -> usize {
        self.description.requests
    }
}

/// Which session key trace requests carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceKey {
    /// None: routers see only the body.
    None,
    /// The first hash id: requests that open with the same 512-token block
    /// (a system prompt, a shared document) share a key.
    FirstBlock,
}

/// Which part of a trace to replay.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceOptions {
    /// Window of trace time, seconds: `[start, end)`.
    pub start_s: f64,
    pub end_s: f64,
    /// Arrival-rate multiplier: 2 sends the window twice as fast.
    pub rate: f64,
    /// At most this many requests (the first ones in the window).
    pub max_requests: Option<usize>,
    pub key: TraceKey,
    /// The served model's context (prompt + answer), tokens: longer trace
    /// requests (recorded on a longer-context model) are cut to fit, from
    /// the end, so their shared prefixes stay intact. 0: no limit.
    pub max_context: usize,
}

#[derive(Debug, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Why a trace cannot be used.
#[derive(Debug)]
pub struct TraceError(pub String);

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TraceError {}

/// Reads a Mooncake-format trace and keeps the requests of the window.
///
/// Lines that are blank are skipped; any other line that is not a valid
/// request is an error naming the line, since a silently thinned trace would
/// make every figure wrong.
pub fn from_mooncake(path: &Path, opts: &TraceOptions) -> Result<Workload, TraceError> {
    if !(opts.rate.is_finite() && opts.rate > 0.0) {
        return Err(TraceError(format!(
            "rate {}: must be a positive number",
            opts.rate
        )));
    }
    if opts.end_s.is_nan() || opts.start_s.is_nan() || opts.end_s <= opts.start_s {
        return Err(TraceError(format!(
            "window {}..{} s is empty",
            opts.start_s, opts.end_s
        )));
    }
    let file = File::open(path).map_err(|e| TraceError(format!("{}: {e}", path.display())))?;
    let mut sessions = Vec::new();
    let mut cut = 0usize;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line =
            line.map_err(|e| TraceError(format!("{}: line {}: {e}", path.display(), i + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceLine = serde_json::from_str(&line).map_err(|e| {
            TraceError(format!(
                "{}: line {}: not a Mooncake request: {e}",
                path.display(),
                i + 1
            ))
        })?;
        let t_s = r.timestamp / 1000.0;
        if !t_s.is_finite() || t_s < opts.start_s || t_s >= opts.end_s {
            continue;
        }
        if opts.max_requests.is_some_and(|m| sessions.len() >= m) {
            break;
        }
        let output = usize::try_from(r.output_length)
            .unwrap_or(usize::MAX)
            .max(1);
        let mut input = usize::try_from(r.input_length).unwrap_or(usize::MAX).max(1);
        if opts.max_context > 0
            && input.saturating_add(output).saturating_add(CONTEXT_SLACK) > opts.max_context
        {
            input = opts
                .max_context
                .saturating_sub(output + CONTEXT_SLACK)
                .max(1);
            cut += 1;
        }
        let key = match opts.key {
            TraceKey::None => None,
            TraceKey::FirstBlock => r.hash_ids.first().map(|h| format!("block-{h}")),
        };
        let salt = i as u64;
        sessions.push(Session {
            start_ms: (r.timestamp - opts.start_s * 1000.0) / opts.rate,
            key,
            objective: None,
            system: None,
            turns: vec![Turn {
                user: Text::Blocks {
                    ids: r.hash_ids,
                    bytes: input.saturating_mul(BYTES_PER_TOKEN),
                    salt,
                },
                max_tokens: u32::try_from(output).unwrap_or(u32::MAX),
                think_ms: 0.0,
            }],
        });
    }
    if sessions.is_empty() {
        return Err(TraceError(format!(
            "{}: no request in the window {}..{} s",
            path.display(),
            opts.start_s,
            opts.end_s
        )));
    }
    let summary = format!(
        "Mooncake trace {}: window {}..{} s at {}x rate{}{}",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        ),
        opts.start_s,
        opts.end_s,
        opts.rate,
        opts.max_requests
            .map_or(String::new(), |m| format!(", at most {m} requests")),
        if cut > 0 {
            format!(
                ", {cut} prompts cut to the {}-token context",
                opts.max_context
            )
        } else {
            String::new()
        },
    );
    Ok(Workload::new("trace", summary, sessions))
}

/// Multi-turn chat sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionOptions {
    pub sessions: usize,
    /// New sessions per second (Poisson).
    pub rate: f64,
    /// Shared system prompts (picked Zipf-like: a few are popular).
    pub system_prompts: usize,
    pub system_tokens: usize,
    /// Mean turns per session (geometric, at least 1, at most 4x the mean).
    pub mean_turns: f64,
    /// Median user-message tokens (log-normal, sigma 1).
    pub user_tokens: f64,
    /// Median answer tokens (log-normal, sigma 0.8).
    pub output_tokens: f64,
    /// Mean think time between turns, seconds (exponential).
    pub think_s: f64,
    pub seed: u64,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            sessions: 200,
            rate: 2.0,
            system_prompts: 8,
            system_tokens: 2048,
            mean_turns: 4.0,
            user_tokens: 200.0,
            output_tokens: 200.0,
            think_s: 10.0,
            seed: 1,
        }
    }
}

/// Caps a drawn length to a sane range.
fn tokens(x: f64, max: usize) -> usize {
    (x.round() as usize).clamp(1, max)
}

pub fn sessions(o: &SessionOptions) -> Workload {
    let mut rng = Rng::new(o.seed);
    let mut t = 0.0;
    let mut out = Vec::with_capacity(o.sessions);
    let p_end = 1.0 / o.mean_turns.max(1.0);
    let max_turns = (o.mean_turns * 4.0).ceil().max(1.0) as usize;
    for s in 0..o.sessions {
        t += rng.exp(1000.0 / o.rate.max(1e-9));
        let sys = rng.zipf(o.system_prompts.max(1), 1.1) as u64;
        let mut turns = Vec::new();
        loop {
            let user_key = rng.next_u64();
            turns.push(Turn {
                user: Text::Words {
                    key: user_key,
                    bytes: tokens(rng.lognormal(o.user_tokens, 1.0), 16_384) * BYTES_PER_TOKEN,
                },
                max_tokens: tokens(rng.lognormal(o.output_tokens, 0.8), 4096) as u32,
                think_ms: if turns.is_empty() {
                    0.0
                } else {
                    rng.exp(o.think_s * 1000.0)
                },
            });
            if turns.len() >= max_turns || rng.unit() < p_end {
                break;
            }
        }
        out.push(Session {
            start_ms: t,
            key: Some(format!("session-{s}")),
            objective: None,
            system: Some(Text::Words {
                key: 0x5359_5354_0000_0000 | sys,
                bytes: o.system_tokens * BYTES_PER_TOKEN,
            }),
            turns,
        });
    }
    let summary = format!(
        "{} chat sessions at {}/s, {} system prompts of {} tokens, ~{} turns, user ~{} tokens, answers ~{} tokens, think ~{} s",
        o.sessions, o.rate, o.system_prompts, o.system_tokens, o.mean_turns, o.user_tokens, o.output_tokens, o.think_s
    );
    Workload::new("sessions", summary, out)
}

/// Shared-prefix groups.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOptions {
    pub groups: usize,
    pub users: usize,
    pub prefix_tokens: usize,
    /// Median question tokens (log-normal, sigma 0.5).
    pub question_tokens: f64,
    /// Median answer tokens (log-normal, sigma 0.5).
    pub output_tokens: f64,
    pub requests: usize,
    /// Requests per second (Poisson).
    pub rate: f64,
    pub seed: u64,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            groups: 16,
            users: 8,
            prefix_tokens: 6144,
            question_tokens: 64.0,
            output_tokens: 128.0,
            requests: 600,
            rate: 4.0,
            seed: 1,
        }
    }
}

pub fn groups(o: &GroupOptions) -> Workload {
    let mut rng = Rng::new(o.seed ^ 0x6772_6f75_7073);
    let mut t = 0.0;
    let mut out = Vec::with_capacity(o.requests);
    for _ in 0..o.requests {
        t += rng.exp(1000.0 / o.rate.max(1e-9));
        let g = rng.below(o.groups.max(1) as u64);
        let u = rng.below(o.users.max(1) as u64);
        out.push(Session {
            start_ms: t,
            key: Some(format!("group-{g}-user-{u}")),
            objective: None,
            system: Some(Text::Words {
                key: 0x4752_5000_0000_0000 | g,
                bytes: o.prefix_tokens * BYTES_PER_TOKEN,
            }),
            turns: vec![Turn {
                user: Text::Words {
                    key: rng.next_u64(),
                    bytes: tokens(rng.lognormal(o.question_tokens, 0.5), 4096) * BYTES_PER_TOKEN,
                },
                max_tokens: tokens(rng.lognormal(o.output_tokens, 0.5), 4096) as u32,
                think_ms: 0.0,
            }],
        });
    }
    let summary = format!(
        "{} groups x {} users, {}-token shared prefix, questions ~{} tokens, answers ~{} tokens, {} requests at {}/s",
        o.groups, o.users, o.prefix_tokens, o.question_tokens, o.output_tokens, o.requests, o.rate
    );
    Workload::new("groups", summary, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn equal_ids_give_identical_prefixes() {
        let a = Text::Blocks {
            ids: vec![1, 2, 3],
            bytes: 3 * 2048,
            salt: 10,
        }
        .render(5);
        let b = Text::Blocks {
            ids: vec![1, 2, 9],
            bytes: 2 * 2048 + 100,
            salt: 11,
        }
        .render(5);
        assert_eq!(a.len(), 3 * 2048);
        assert_eq!(b.len(), 2 * 2048 + 100);
        assert_eq!(a[..4096], b[..4096]);
        assert_ne!(a[4096..4196], b[4096..]);
        assert!(a.is_ascii());
        // Past the ids, the tail is the request's own.
        let c = Text::Blocks {
            ids: vec![1],
            bytes: 3000,
            salt: 1,
        }
        .render(5);
        let d = Text::Blocks {
            ids: vec![1],
            bytes: 3000,
            salt: 2,
        }
        .render(5);
        assert_eq!(c[..2048], d[..2048]);
        assert_ne!(c[2048..], d[2048..]);
    }

    fn trace_file(lines: &[&str]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvroute-bench-test-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let p = dir.join(format!("t{}.jsonl", xxh64(lines.concat().as_bytes(), 0)));
        let mut f = File::create(&p).unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
        p
    }

    fn opts() -> TraceOptions {
        TraceOptions {
            start_s: 0.0,
            end_s: 1e9,
            rate: 1.0,
            max_requests: None,
            key: TraceKey::FirstBlock,
            max_context: 0,
        }
    }

    #[test]
    fn trace_window_rate_and_cap() {
        let p = trace_file(&[
            r#"{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}"#,
            "",
            r#"{"timestamp": 2000, "input_length": 100, "output_length": 5, "hash_ids": [1]}"#,
            r#"{"timestamp": 4000, "input_length": 100, "output_length": 5, "hash_ids": [3]}"#,
        ]);
        let w = from_mooncake(&p, &opts()).unwrap();
        assert_eq!(w.requests(), 3);
        assert_eq!(w.sessions[0].key.as_deref(), Some("block-1"));
        assert_eq!(w.sessions[0].turns[0].user.len(), 600 * 4);
        let w = from_mooncake(
            &p,
            &TraceOptions {
                start_s: 1.0,
                end_s: 5.0,
                rate: 2.0,
                ..opts()
            },
        )
        .unwrap();
        assert_eq!(w.requests(), 2);
        assert_eq!(w.sessions[0].start_ms, 500.0);
        assert_eq!(w.sessions[1].start_ms, 1500.0);
        let w = from_mooncake(
            &p,
            &TraceOptions {
                max_requests: Some(1),
                ..opts()
            },
        )
        .unwrap();
        assert_eq!(w.requests(), 1);
    }

    #[test]
    fn bad_traces_are_refused_with_the_line() {
        let p = trace_file(&[
            r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1]}"#,
            "{nope",
        ]);
        let e = from_mooncake(&p, &opts()).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        let p = trace_file(&[
            r#"{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": []}"#,
        ]);
        assert!(from_mooncake(&p, &opts()).is_err());
        let p = trace_file(&[
            r#"{"timestamp": 9000000, "input_length": 6, "output_length": 1, "hash_ids": [1]}"#,
        ]);
        let e = from_mooncake(
            &p,
            &TraceOptions {
                end_s: 10.0,
                ..opts()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no request"), "{e}");
        assert!(from_mooncake(
            &p,
            &TraceOptions {
                rate: 0.0,
                ..opts()
            }
        )
        .is_err());
        assert!(from_mooncake(Path::new("/nonexistent/trace.jsonl"), &opts()).is_err());
    }

    #[test]
    fn generators_are_seeded_and_shaped() {
        let a = sessions(&SessionOptions::default());
        let b = sessions(&SessionOptions::default());
        assert_eq!(a.sessions, b.sessions);
        assert_eq!(a.sessions.len(), 200);
        assert!(a.requests() > 400, "multi-turn: {}", a.requests());
        // Shared system prompts: far fewer distinct than sessions.
        let distinct: std::collections::HashSet<_> = a
            .sessions
            .iter()
            .map(|s| format!("{:?}", s.system))
            .collect();
        assert!(distinct.len() <= 8);
        let g = groups(&GroupOptions::default());
        assert_eq!(g.requests(), 600);
        let keys: std::collections::HashSet<_> = g.sessions.iter().map(|s| s.key.clone()).collect();
        assert!(keys.len() <= 16 * 8);
        assert!(g
            .sessions
            .windows(2)
            .all(|w| w[0].start_ms <= w[1].start_ms));
    }
}

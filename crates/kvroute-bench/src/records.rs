//! Per-request records as JSON lines (`kvroute-bench replay --records`).
//!
//! The run summary reduces a replay to percentiles; fault and soak runs
//! (`scripts/faults.py`, `scripts/soak.py`) need every request on a clock
//! they share with the events they inject: when it was sent (wall clock,
//! Unix ms), how it ended, which replica the router named and which engine
//! answered. One JSON object per line, in send order.

use std::io::{self, Write};

use serde::{Deserialize, Serialize};

use crate::client::error_class;
use crate::replay::Record;

/// One request, flat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Line {
    pub seq: u64,
    pub session: usize,
    pub turn: usize,
    /// The objective the request named, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    /// Wall-clock send time, Unix ms.
    pub sent_unix_ms: u64,
    /// Modelled seconds from the start of the replay to the send.
    pub sent_s: f64,
    /// HTTP status (0: no answer).
    pub status: u16,
    /// `None`: a complete stream.
    pub error: Option<String>,
    /// The error's class (`status 503`, `transport`, `stream`, ...).
    pub error_class: Option<String>,
    /// Modelled ms.
    pub ttft_ms: Option<f64>,
    /// Modelled ms, send to end (or to the failure).
    pub e2e_ms: f64,
    /// The simulated engine that answered (its index in its own process).
    pub engine: Option<u64>,
    /// The replica the router named first (`x-kvroute-decision` host).
    pub decided_host: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

impl From<&Record> for Line {
    fn from(r: &Record) -> Self {
        let o = &r.outcome;
        Line {
            seq: r.seq,
            session: r.session,
            turn: r.turn,
            objective: r.objective.clone(),
            sent_unix_ms: r.sent_unix_ms,
            sent_s: r.sent_s,
            status: o.status,
            error: o.error.clone(),
            error_class: o.error.as_deref().map(error_class),
            ttft_ms: o.ttft_ms,
            e2e_ms: o.e2e_ms,
            engine: o.usage.engine,
            decided_host: o.decided_host.clone(),
            prompt_tokens: o.usage.prompt_tokens,
            cached_tokens: o.usage.cached_tokens,
            completion_tokens: o.usage.completion_tokens,
        }
    }
}

/// Writes one JSON line per record, in the given order.
pub fn write<W: Write>(records: &[Record], mut w: W) -> io::Result<()> {
    for r in records {
        serde_json::to_writer(&mut w, &Line::from(r))?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ceiling::Blocks;
    use crate::client::{Outcome, Usage};

    fn record(seq: u64, error: Option<&str>) -> Record {
        Record {
            seq,
            session: 3,
            turn: 1,
            objective: None,
            sent_s: 12.5,
            sent_unix_ms: 1_700_000_000_123,
            outcome: Outcome {
                status: if error.is_some() { 503 } else { 200 },
                error: error.map(str::to_owned),
                ttft_ms: error.is_none().then_some(42.0),
                e2e_ms: 900.0,
                usage: Usage {
                    prompt_tokens: Some(100),
                    cached_tokens: Some(64),
                    engine: error.is_none().then_some(2),
                    ..Usage::default()
                },
                decided_host: Some("127.0.0.1:8003".to_owned()),
                ..Outcome::default()
            },
            blocks: Blocks {
                hashes: Vec::new(),
                prompt_blocks: 0,
                prompt_tokens: 0,
            },
        }
    }

    #[test]
    fn one_json_object_per_record_in_order() {
        let recs = [record(0, None), record(1, Some("status 503: engine down"))];
        let mut out = Vec::new();
        write(&recs, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<Line> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].seq, 0);
        assert_eq!(lines[0].engine, Some(2));
        assert_eq!(lines[0].error_class, None);
        assert_eq!(lines[0].cached_tokens, Some(64));
        assert_eq!(lines[0].sent_unix_ms, 1_700_000_000_123);
        assert_eq!(lines[1].status, 503);
        assert_eq!(lines[1].error_class.as_deref(), Some("status 503"));
        assert_eq!(lines[1].decided_host.as_deref(), Some("127.0.0.1:8003"));
        assert_eq!(lines[1], Line::from(&recs[1]));
    }
}

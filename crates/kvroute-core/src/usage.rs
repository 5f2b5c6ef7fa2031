//! Learning from answers' `usage`: completion tokens for a per-model
//! output-length prior in shared data, and the prompt tokens the engine
//! found cached, for [`crate::answers`].
//!
//! Output length is unknown at routing time; `max_tokens` is only an upper
//! bound, and clients often ask for far more than they get. The filter reads
//! an answer as it streams past (never holding it back), with one parser
//! for both shapes, [`Tracker`]:
//! - JSON responses: parsed at the end of the body (bodies over
//!   [`MAX_JSON_BYTES`] are not learned from);
//! - server-sent events: each `data:` line is parsed as it completes (lines
//!   over `MAX_LINE` (64 KiB) are cut and teach nothing), so a figure in a
//!   late chunk (`stream_options.include_usage`) is found whatever the
//!   chunking; the events that carry choices are counted too.
//!
//! From `usage` ([`Learned`]): output tokens (`completion_tokens`, or
//! Anthropic's `output_tokens`; for a stream without usage, one token per
//! choices event, as vLLM and SGLang stream), the cached prompt tokens
//! (`prompt_tokens_details.cached_tokens` of OpenAI, vLLM and SGLang,
//! `input_tokens_details.cached_tokens` of OpenAI's responses API,
//! `cache_read_input_tokens` of Anthropic, found in a stream's
//! `message_start` event) and the prompt's size. A figure that is missing,
//! `null` or not a non-negative integer reads as absent; it never fails the
//! rest of the answer.
//!
//! Which answers are read: one in [`OBSERVE_EVERY`] for the prior, and
//! every answer whose decision expected a prefix hit
//! ([`crate::answers::read_answer`]).
//!
//! The prior is an exponentially weighted mean per model, in one of
//! [`PRIOR_SLOTS`] shared-data keys chosen by the model's hash (so arbitrary
//! model names cannot grow shared data); all workers update it with
//! compare-and-swap. When a request asks for more than
//! [`FAR_MORE`] x the prior mean, the cost estimate uses [`MARGIN`] x the mean
//! instead of `max_tokens`.

use serde::Deserialize;
use serde_json::Value;
use xxhash_rust::xxh64::xxh64;

use crate::host::{SetError, SharedData};

/// Largest JSON response body copied for learning.
pub const MAX_JSON_BYTES: usize = 256 << 10;
/// Longest SSE line carried across chunks.
const MAX_LINE: usize = 64 << 10;
/// Shared-data keys of the prior.
pub const PRIOR_SLOTS: u64 = 256;
/// Weight of a new observation in the mean.
const ALPHA: f64 = 0.05;
/// Observations before the prior is used.
pub const MIN_SAMPLES: u64 = 20;
/// "Far more than it typically gets".
pub const FAR_MORE: f64 = 4.0;
/// Estimate used then, as a multiple of the mean (answers vary).
pub const MARGIN: f64 = 2.0;
/// One response in this many is read to learn the output length. Reading
/// a response costs a host call per body chunk plus two for the update; the
/// prior is a slow-moving mean, so a sample of the traffic learns it as well
/// (after `MIN_SAMPLES` x `OBSERVE_EVERY` responses of a model).
pub const OBSERVE_EVERY: u32 = 4;
/// How long a gateway worker reuses a prior it read, in ms.
pub const PRIOR_CACHE_MS: u64 = 1000;
/// Models whose priors a worker keeps at once (more: the cache starts over).
const PRIOR_CACHE_MODELS: usize = 32;

/// Whether the response of the stream with this id is read for the prior.
pub fn observed(stream_id: u32) -> bool {
    stream_id % OBSERVE_EVERY == 0
}

/// A worker's copy of recently read priors, so the request path reads the
/// shared value at most once per model per [`PRIOR_CACHE_MS`].
#[derive(Debug, Default)]
pub struct PriorCache {
    entries: Vec<(String, Option<Prior>, u64)>,
}

impl PriorCache {
    /// The prior of `model`, read again from `store` when the copy is older
    /// than [`PRIOR_CACHE_MS`] at `now_ms`.
    pub fn get(
        &mut self,
        store: &dyn SharedData,
        prefix: &str,
        model: &str,
        now_ms: u64,
    ) -> Option<Prior> {
        if let Some((_, prior, at)) = self.entries.iter().find(|(m, _, _)| m == model) {
            if now_ms.saturating_sub(*at) < PRIOR_CACHE_MS {
                return *prior;
            }
        }
        let prior = read(store, prefix, model);
        match self.entries.iter_mut().find(|(m, _, _)| m == model) {
            Some(e) => *e = (model.to_owned(), prior, now_ms),
            None => {
                if self.entries.len() >= PRIOR_CACHE_MODELS {
                    self.entries.clear();
                }
                self.entries.push((model.to_owned(), prior, now_ms));
            }
        }
        prior
    }
}

/// One JSON document of an answer: a whole JSON body, or one SSE event.
#[derive(Deserialize)]
struct Event {
    /// Read field by field (see [`Learned::read_usage`]), so that one odd
    /// field costs only itself.
    #[serde(default)]
    usage: Option<Value>,
    /// Anthropic's stream opens with `message_start`, whose message carries
    /// the prompt's usage.
    #[serde(default)]
    message: Option<Value>,
    #[serde(default)]
    choices: Option<serde::de::IgnoredAny>,
}

/// What an answer's usage said, as far as it was found. A figure that is
/// missing, `null`, negative, fractional or not a number reads as `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Learned {
    /// Output tokens: `completion_tokens` (OpenAI, vLLM, SGLang) or
    /// `output_tokens` (Anthropic, OpenAI responses); for a stream without
    /// usage, the data events that carried choices.
    pub output_tokens: Option<u64>,
    /// Prompt tokens the engine found in its prefix cache:
    /// `prompt_tokens_details.cached_tokens` (OpenAI, vLLM, SGLang),
    /// `input_tokens_details.cached_tokens` (OpenAI responses) or
    /// `cache_read_input_tokens` (Anthropic).
    pub cached_tokens: Option<u64>,
    /// The prompt by the engine's count, cached part included:
    /// `prompt_tokens`, else `input_tokens` (plus Anthropic's
    /// `cache_read_input_tokens` and `cache_creation_input_tokens`, which
    /// its `input_tokens` leaves out).
    pub prompt_tokens: Option<u64>,
}

fn count(v: Option<&Value>) -> Option<u64> {
    v.and_then(Value::as_u64)
}

impl Learned {
    /// Takes the figures a `usage` object gives (a later one overrides an
    /// earlier one: a stream's last usage is its final count). `output`:
    /// whether its output count is final (not Anthropic's `message_start`,
    /// whose `output_tokens` is a placeholder).
    fn read_usage(&mut self, u: &Value, output: bool) {
        if output {
            if let Some(t) = count(u.get("completion_tokens")).or(count(u.get("output_tokens"))) {
                self.output_tokens = Some(t);
            }
        }
        let cache_read = count(u.get("cache_read_input_tokens"));
        let cached = count(u.pointer("/prompt_tokens_details/cached_tokens"))
            .or(cache_read)
            .or(count(u.pointer("/input_tokens_details/cached_tokens")));
        if let Some(c) = cached {
            self.cached_tokens = Some(c);
        }
        let creation = count(u.get("cache_creation_input_tokens"));
        let prompt = count(u.get("prompt_tokens")).or_else(|| {
            let input = count(u.get("input_tokens"))?;
            Some(
                input
                    .saturating_add(cache_read.unwrap_or(0))
                    .saturating_add(creation.unwrap_or(0)),
            )
        });
        if let Some(p) = prompt {
            self.prompt_tokens = Some(p);
        }
    }

    /// Takes what one parsed document says; whether it carried choices.
    fn read_event(&mut self, ev: &Event) -> bool {
        if let Some(u) = &ev.usage {
            self.read_usage(u, true);
        }
        if let Some(u) = ev.message.as_ref().and_then(|m| m.get("usage")) {
            self.read_usage(u, false);
        }
        ev.choices.is_some()
    }
}

/// Reads an answer's usage as its body streams past.
#[derive(Debug)]
pub enum Tracker {
    Json {
        body: Vec<u8>,
        overflow: bool,
    },
    Sse {
        line: Vec<u8>,
        events: u64,
        learned: Learned,
    },
    Off,
}

impl Tracker {
    /// Picks the reader for a response content type.
    pub fn for_content_type(content_type: Option<&str>) -> Tracker {
        let ct = content_type.unwrap_or("").to_ascii_lowercase();
        if ct.starts_with("text/event-stream") {
            Tracker::Sse {
                line: Vec::new(),
                events: 0,
                learned: Learned::default(),
            }
        } else if ct.starts_with("application/json") {
            Tracker::Json {
                body: Vec::new(),
                overflow: false,
            }
        } else {
            Tracker::Off
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        match self {
            Tracker::Json { body, overflow } => {
                if body.len() + chunk.len() > MAX_JSON_BYTES {
                    *overflow = true;
                    body.clear();
                    body.shrink_to_fit();
                } else if !*overflow {
                    body.extend_from_slice(chunk);
                }
            }
            Tracker::Sse {
                line,
                events,
                learned,
            } => {
                for &b in chunk {
                    if b == b'\n' {
                        sse_line(line, events, learned);
                        line.clear();
                    } else if line.len() < MAX_LINE {
                        line.push(b);
                    }
                }
            }
            Tracker::Off => {}
        }
    }

    /// What the answer taught, once its body has ended.
    pub fn finish(&mut self) -> Learned {
        match self {
            Tracker::Json { body, overflow } => {
                let mut learned = Learned::default();
                if !*overflow {
                    if let Ok(ev) = serde_json::from_slice::<Event>(body) {
                        learned.read_event(&ev);
                    }
                }
                learned
            }
            Tracker::Sse {
                line,
                events,
                learned,
            } => {
                sse_line(line, events, learned);
                line.clear();
                let mut out = *learned;
                if out.output_tokens.is_none() && *events > 0 {
                    out.output_tokens = Some(*events);
                }
                out
            }
            Tracker::Off => Learned::default(),
        }
    }
}

/// One SSE line. A line cut at [`MAX_LINE`] is not JSON and teaches nothing.
fn sse_line(line: &[u8], events: &mut u64, learned: &mut Learned) {
    let Some(data) = line.strip_prefix(b"data:") else {
        return;
    };
    let data = data.trim_ascii();
    if data.is_empty() || data == b"[DONE]" {
        return;
    }
    if let Ok(ev) = serde_json::from_slice::<Event>(data) {
        if learned.read_event(&ev) {
            *events += 1;
        }
    }
}

/// The per-model output-length prior.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prior {
    pub model: u64,
    pub mean: f64,
    pub samples: u64,
}

impl Prior {
    fn encode(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        out[..8].copy_from_slice(&self.model.to_le_bytes());
        out[8..16].copy_from_slice(&self.mean.to_bits().to_le_bytes());
        out[16..].copy_from_slice(&self.samples.to_le_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Prior> {
        if b.len() != 24 {
            return None;
        }
        let word = |r: std::ops::Range<usize>| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?))
        };
        let mean = f64::from_bits(word(8..16)?);
        mean.is_finite().then_some(Prior {
            model: word(0..8)?,
            mean,
            samples: word(16..24)?,
        })
    }

    /// The output-token estimate for a request asking for `asked`.
    pub fn estimate(&self, asked: u64) -> u64 {
        if self.samples < MIN_SAMPLES || (asked as f64) <= FAR_MORE * self.mean {
            asked
        } else {
            ((MARGIN * self.mean).ceil() as u64).clamp(1, asked)
        }
    }
}

fn model_hash(model: &str) -> u64 {
    xxh64(model.as_bytes(), 0x6f75_7470_7574)
}

fn key(prefix: &str, model: u64) -> String {
    format!("{prefix}.olen.{:x}", model % PRIOR_SLOTS)
}

/// The prior for `model`, if one has been learned.
pub fn read(store: &dyn SharedData, prefix: &str, model: &str) -> Option<Prior> {
    let m = model_hash(model);
    let (v, _) = store.get(&key(prefix, m)).ok()?;
    Prior::decode(&v?).filter(|p| p.model == m)
}

/// Folds one observation into the prior (bounded retries; losing one
/// observation to contention is harmless).
pub fn observe(store: &dyn SharedData, prefix: &str, model: &str, tokens: u64) {
    let m = model_hash(model);
    let k = key(prefix, m);
    for _ in 0..4 {
        let Ok((v, cas)) = store.get(&k) else { return };
        // Another model in the same slot: the newer one takes it over.
        let old = v
            .as_deref()
            .and_then(Prior::decode)
            .filter(|p| p.model == m);
        let next = match old {
            Some(p) => Prior {
                model: m,
                // Plain mean until the EWMA window fills, then EWMA.
                mean: if p.samples < (1.0 / ALPHA) as u64 {
                    p.mean + (tokens as f64 - p.mean) / (p.samples + 1) as f64
                } else {
                    p.mean + ALPHA * (tokens as f64 - p.mean)
                },
                samples: p.samples.saturating_add(1),
            },
            None => Prior {
                model: m,
                mean: tokens as f64,
                samples: 1,
            },
        };
        match store.set(&k, &next.encode(), cas) {
            Err(SetError::CasMismatch) => continue,
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prior_cache_reads_once_per_interval_and_is_bounded() {
        let store = MemorySharedData::default();
        let mut cache = PriorCache::default();
        assert_eq!(cache.get(&store, "kv", "m", 0), None);
        for _ in 0..MIN_SAMPLES {
            observe(&store, "kv", "m", 100);
        }
        // Still the copy read at 0 ms...
        assert_eq!(cache.get(&store, "kv", "m", PRIOR_CACHE_MS - 1), None);
        // ...then the learned prior.
        let p = cache.get(&store, "kv", "m", PRIOR_CACHE_MS).unwrap();
        assert_eq!(p.samples, MIN_SAMPLES);
        for k in 0..3 * PRIOR_CACHE_MODELS {
            let _ = cache.get(&store, "kv", &format!("model-{k}"), 0);
        }
        assert!(cache.entries.len() <= PRIOR_CACHE_MODELS);
        assert_eq!((0..4 * OBSERVE_EVERY).filter(|&i| observed(i)).count(), 4);
    }
    use crate::host::MemorySharedData;

    fn read_all(content_type: &str, body: &[u8], chunk: usize) -> Learned {
        let mut t = Tracker::for_content_type(Some(content_type));
        for c in body.chunks(chunk.max(1)) {
            t.feed(c);
        }
        t.finish()
    }

    #[test]
    fn json_usage() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":42}}"#;
        let l = read_all("application/json; charset=utf-8", body, 30);
        assert_eq!(l.output_tokens, Some(42));
        assert_eq!(l.prompt_tokens, Some(5));
        assert_eq!(l.cached_tokens, None, "no details: no cached figure");
        let l = read_all(
            "application/json",
            br#"{"usage":{"input_tokens":3,"output_tokens":7}}"#,
            64,
        );
        assert_eq!(l.output_tokens, Some(7), "Anthropic usage");
        assert_eq!(
            read_all("application/json", b"{broken", 64),
            Learned::default()
        );
        let mut t = Tracker::for_content_type(Some("application/json"));
        t.feed(&vec![b' '; MAX_JSON_BYTES + 1]);
        assert_eq!(t.finish(), Learned::default());
        assert!(matches!(
            Tracker::for_content_type(Some("text/plain")),
            Tracker::Off
        ));
    }

    #[test]
    fn json_cached_tokens_openai_vllm_sglang_anthropic() {
        let openai = br#"{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1200,"completion_tokens":9,"total_tokens":1209,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
        for chunk in [1, 7, 4096] {
            assert_eq!(
                read_all("application/json", openai, chunk),
                Learned {
                    output_tokens: Some(9),
                    cached_tokens: Some(1024),
                    prompt_tokens: Some(1200)
                },
                "split into {chunk}-byte chunks"
            );
        }
        // Anthropic: input_tokens leaves the cache reads and writes out.
        let anthropic = br#"{"type":"message","content":[],"usage":{"input_tokens":20,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,"output_tokens":15}}"#;
        assert_eq!(
            read_all("application/json", anthropic, 16),
            Learned {
                output_tokens: Some(15),
                cached_tokens: Some(2000),
                prompt_tokens: Some(2120)
            }
        );
        // OpenAI responses API.
        let responses = br#"{"usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":256},"output_tokens":4}}"#;
        let l = read_all("application/json", responses, 64);
        assert_eq!((l.cached_tokens, l.prompt_tokens), (Some(256), Some(300)));
    }

    #[test]
    fn missing_or_garbage_cached_figures_read_as_none() {
        for usage in [
            r#"{"prompt_tokens":10,"completion_tokens":3}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":null}}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":"512"}}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":-1}}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":1.5}}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":99999999999999999999999}}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":[1,2]}"#,
            r#"{"prompt_tokens":10,"completion_tokens":3,"cache_read_input_tokens":{}}"#,
        ] {
            let body = format!(r#"{{"choices":[],"usage":{usage}}}"#);
            let l = read_all("application/json", body.as_bytes(), 5);
            assert_eq!(l.cached_tokens, None, "{usage}");
            // The other figures are still read.
            assert_eq!(
                (l.output_tokens, l.prompt_tokens),
                (Some(3), Some(10)),
                "{usage}"
            );
        }
        for body in [
            r#"{"usage":"lots"}"#,
            r#"{"usage":null}"#,
            r#"{"usage":[]}"#,
            r#"{"message":"hi","usage":7}"#,
            r#"[]"#,
            "",
            "\u{0}\u{1}",
        ] {
            assert_eq!(
                read_all("application/json", body.as_bytes(), 3),
                Learned::default(),
                "{body:?}"
            );
        }
    }

    #[test]
    fn sse_counts_events_or_reads_final_usage() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n";
        let l = read_all("text/event-stream", stream.as_bytes(), 7);
        assert_eq!(l.output_tokens, Some(3));
        assert_eq!(l.cached_tokens, None);
        let with_usage =
            format!("{stream}data: {{\"choices\":[],\"usage\":{{\"completion_tokens\":9}}}}\n\n");
        assert_eq!(
            read_all("text/event-stream", with_usage.as_bytes(), 1 << 20).output_tokens,
            Some(9)
        );
        assert_eq!(
            read_all("text/event-stream", b"data: not json\n\n: comment\n", 4),
            Learned::default()
        );
    }

    #[test]
    fn sse_late_usage_chunk_split_across_body_chunks() {
        // vLLM with stream_options.include_usage: usage null on the token
        // events, then one event with empty choices and the usage.
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"},\"finish_reason\":\"length\"}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":700,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":640}}}\n\n",
            "data: [DONE]\n\n",
        );
        let want = Learned {
            output_tokens: Some(2),
            cached_tokens: Some(640),
            prompt_tokens: Some(700),
        };
        for chunk in [1, 2, 3, 5, 13, 64, 4096] {
            assert_eq!(
                read_all("text/event-stream", stream.as_bytes(), chunk),
                want,
                "{chunk}-byte chunks"
            );
        }
        // CRLF line ends, and a stream cut before its last newline.
        let crlf = stream.replace('\n', "\r\n");
        assert_eq!(read_all("text/event-stream", crlf.as_bytes(), 9), want);
        let cut = stream.trim_end_matches("data: [DONE]\n\n").trim_end();
        assert_eq!(read_all("text/event-stream", cut.as_bytes(), 11), want);
        // A usage line longer than MAX_LINE is cut, not parsed: no figure.
        let long = format!(
            "data: {{\"choices\":[],\"pad\":\"{}\",\"usage\":{{\"prompt_tokens_details\":{{\"cached_tokens\":5}}}}}}\n\n",
            "x".repeat(MAX_LINE)
        );
        assert_eq!(
            read_all("text/event-stream", long.as_bytes(), 1000).cached_tokens,
            None
        );
    }

    #[test]
    fn sse_anthropic_cache_read_in_message_start() {
        let stream = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":4000,\"output_tokens\":1}}}\n\n",
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":37}}\n\n",
            "event: message_stop\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        for chunk in [1, 10, 4096] {
            assert_eq!(
                read_all("text/event-stream", stream.as_bytes(), chunk),
                Learned {
                    // message_start's output_tokens (1) is a placeholder.
                    output_tokens: Some(37),
                    cached_tokens: Some(4000),
                    prompt_tokens: Some(4012)
                }
            );
        }
    }

    #[test]
    fn prior_learns_and_caps_far_larger_asks() {
        let s = MemorySharedData::default();
        assert_eq!(read(&s, "p", "m"), None);
        for _ in 0..30 {
            observe(&s, "p", "m", 100);
        }
        let p = read(&s, "p", "m").unwrap();
        assert!((p.mean - 100.0).abs() < 1e-9, "{p:?}");
        assert_eq!(p.samples, 30);
        assert_eq!(p.estimate(300), 300, "within 4x: the client's figure");
        assert_eq!(p.estimate(4096), 200, "far more: 2x the mean");
        assert_eq!(read(&s, "p", "other"), None);
        let young = Prior { samples: 3, ..p };
        assert_eq!(young.estimate(4096), 4096);
    }

    #[test]
    fn prior_keys_are_bounded() {
        let s = MemorySharedData::default();
        for i in 0..2000 {
            observe(&s, "p", &format!("model-{i}"), 10);
        }
        assert!(s.len() as u64 <= PRIOR_SLOTS);
    }
}

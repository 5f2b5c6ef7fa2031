//! Learning how long answers are: completion tokens from responses, and a
//! per-model prior in shared data.
//!
//! Output length is unknown at routing time; `max_tokens` is only an upper
//! bound, and clients often ask for far more than they get. The filter reads
//! each response as it streams past (never holding it back):
//! - JSON responses: `usage.completion_tokens`, parsed at the end of the
//!   body (bodies over [`MAX_JSON_BYTES`] are not learned from);
//! - server-sent events: `usage.completion_tokens` of the chunk that carries
//!   it (`stream_options.include_usage`), otherwise the number of data
//!   events that carry choices, one token each as vLLM and SGLang stream.
//!
//! The prior is an exponentially weighted mean per model, in one of
//! [`PRIOR_SLOTS`] shared-data keys chosen by the model's hash (so arbitrary
//! model names cannot grow shared data); all workers update it with
//! compare-and-swap. When a request asks for more than
//! [`FAR_MORE`] x the prior mean, the cost estimate uses [`MARGIN`] x the mean
//! instead of `max_tokens`.

use serde::Deserialize;
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

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    choices: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    completion_tokens: Option<u64>,
    /// Anthropic's name.
    #[serde(default)]
    output_tokens: Option<u64>,
}

impl Usage {
    fn tokens(&self) -> Option<u64> {
        self.completion_tokens.or(self.output_tokens)
    }
}

/// Reads completion tokens from a response body as it streams past.
#[derive(Debug)]
pub enum Tracker {
    Json {
        body: Vec<u8>,
        overflow: bool,
    },
    Sse {
        line: Vec<u8>,
        events: u64,
        usage: Option<u64>,
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
                usage: None,
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
                usage,
            } => {
                for &b in chunk {
                    if b == b'\n' {
                        sse_line(line, events, usage);
                        line.clear();
                    } else if line.len() < MAX_LINE {
                        line.push(b);
                    }
                }
            }
            Tracker::Off => {}
        }
    }

    /// Completion tokens, once the body has ended.
    pub fn finish(&mut self) -> Option<u64> {
        match self {
            Tracker::Json { body, overflow } => {
                if *overflow {
                    return None;
                }
                let parsed: WithUsage = serde_json::from_slice(body).ok()?;
                parsed.usage.and_then(|u| u.tokens())
            }
            Tracker::Sse {
                line,
                events,
                usage,
            } => {
                sse_line(line, events, usage);
                line.clear();
                usage.or((*events > 0).then_some(*events))
            }
            Tracker::Off => None,
        }
    }
}

fn sse_line(line: &[u8], events: &mut u64, usage: &mut Option<u64>) {
    let Some(data) = line.strip_prefix(b"data:") else {
        return;
    };
    let data = data.trim_ascii();
    if data.is_empty() || data == b"[DONE]" {
        return;
    }
    if let Ok(ev) = serde_json::from_slice::<WithUsage>(data) {
        if let Some(t) = ev.usage.and_then(|u| u.tokens()) {
            *usage = Some(t);
        }
        if ev.choices.is_some() {
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

    #[test]
    fn json_usage() {
        let mut t = Tracker::for_content_type(Some("application/json; charset=utf-8"));
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":42}}"#;
        let (a, b) = body.split_at(30);
        t.feed(a);
        t.feed(b);
        assert_eq!(t.finish(), Some(42));
        let mut t = Tracker::for_content_type(Some("application/json"));
        t.feed(br#"{"usage":{"input_tokens":3,"output_tokens":7}}"#);
        assert_eq!(t.finish(), Some(7), "Anthropic usage");
        let mut t = Tracker::for_content_type(Some("application/json"));
        t.feed(b"{broken");
        assert_eq!(t.finish(), None);
        let mut t = Tracker::for_content_type(Some("application/json"));
        t.feed(&vec![b' '; MAX_JSON_BYTES + 1]);
        assert_eq!(t.finish(), None);
        assert!(matches!(
            Tracker::for_content_type(Some("text/plain")),
            Tracker::Off
        ));
    }

    #[test]
    fn sse_counts_events_or_reads_final_usage() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: {\"choices\":[{\"delta\":{}}]}\n\ndata: [DONE]\n\n";
        let mut t = Tracker::for_content_type(Some("text/event-stream"));
        for chunk in stream.as_bytes().chunks(7) {
            t.feed(chunk);
        }
        assert_eq!(t.finish(), Some(3));
        let with_usage =
            format!("{stream}data: {{\"choices\":[],\"usage\":{{\"completion_tokens\":9}}}}\n\n");
        let mut t = Tracker::for_content_type(Some("text/event-stream"));
        t.feed(with_usage.as_bytes());
        assert_eq!(t.finish(), Some(9));
        let mut t = Tracker::for_content_type(Some("text/event-stream"));
        t.feed(b"data: not json\n\n: comment\n");
        assert_eq!(t.finish(), None);
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

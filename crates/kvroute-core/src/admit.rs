//! Admission control: what a gateway does with a request when the fleet
//! has no room for it.
//!
//! Off unless `admission.enabled`. Then every parsed request is judged on
//! arrival ([`arrive`]):
//!
//! - its **priority** comes from the objective it names in the objective
//!   header (`x-gateway-inference-objective`, as in the Gateway API
//!   Inference Extension): the `priority` the config gives that objective.
//!   A request that names none, or one the config does not know, gets the
//!   default objective, priority 0; so a client can choose among the
//!   operator's objectives but never invent a higher one. Below 0 is
//!   *sheddable*;
//! - the fleet is **saturated** for it when no replica that may take it
//!   has headroom by the placement's own figures
//!   ([`crate::decide::headroom`]): the prefill pending ahead of it (the
//!   larger of the engine's queue and what this gateway sent) within
//!   `maxPendingS` at its rate (the snapshot's or the one learned from its
//!   answers, else `prefillTokensPerS`), and its predicted KV use with
//!   the request within `maxMemory` of capacity. A replica without current
//!   engine data always has headroom: nothing is held on missing data;
//! - a request **goes on** when the fleet has headroom for it and no held
//!   request of its priority or higher for the same model waits (it does
//!   not overtake them; another model's saturation does not hold it). Else
//!   a sheddable request gets a 429 with `Retry-After` at once, and any
//!   other is **held** in the worker's [`Queue`].
//!
//! The queue serves the highest priority first. Within a priority it is
//! fair across affinity keys (a session, else a prefix): each key's
//! requests get consecutive virtual-time tags (start-time fair queueing
//! with equal weights), so a client with many requests held interleaves
//! with the others instead of going first, and requests of distinct keys
//! leave in arrival order. Bounds, each with a clear answer:
//!
//! - `maxQueue` held requests: a higher-priority arrival displaces the
//!   held request that would leave last, when its priority is lower (it
//!   gets a 503); an arrival that displaces none gets one itself;
//! - `maxQueuedPerKey` per affinity key: one client cannot fill the queue
//!   (without a session the key is the prompt prefix, shared by every
//!   client that sends that prefix);
//! - `maxWaitMs` in the queue: then a 503.
//!
//! (Sheddable requests are never held, so these answers are 503.) On every
//! tick (100 ms) the filter walks the queue in order and sends on each
//! held request whose model now has room by [`crate::decide::headroom`]
//! (a fresh snapshot, or the gateway's own dispatches reaching their
//! first byte), each charged before the next is judged; a model without
//! room keeps its requests, in order, and does not block another model's.
//! A client that disconnects while held leaves the queue.
//!
//! What a client can and cannot do: it can name any configured objective,
//! so where clients must not choose their priority the operator sets or
//! strips the header in front of kvroute (a route's
//! `request_headers_to_remove`, or an auth filter that sets it); it cannot
//! name a priority that is not configured. Requests kvroute does not parse
//! (fallback) are not subject to admission.
//! The queue is per worker (per VM): Envoy's workers and gateway replicas
//! hold their own, and the fleet figures they judge by are shared.

use std::collections::{BTreeMap, HashMap};

use crate::config::AdmissionConfig;

/// The objective of a request that names no configured one.
pub const DEFAULT_OBJECTIVE: &str = "default";

/// Longest objective header value looked up (a longer one names no
/// configured objective: they are at most 63 bytes).
const MAX_HEADER: usize = 64;

/// A request's objective: a configured one (its index in
/// [`AdmissionConfig::objectives`]) or the default (none, priority 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Objective {
    pub index: Option<usize>,
    pub priority: i32,
}

impl Objective {
    /// The objective a header value names; absent, unknown or malformed
    /// values get the default (priority 0).
    pub fn of(cfg: &AdmissionConfig, header: Option<&str>) -> Objective {
        let found = header
            .map(str::trim)
            .filter(|h| !h.is_empty() && h.len() <= MAX_HEADER)
            .and_then(|h| cfg.objectives.iter().position(|(n, _)| n == h));
        match found.and_then(|i| cfg.objectives.get(i).map(|(_, p)| (i, *p))) {
            Some((i, priority)) => Objective {
                index: Some(i),
                priority,
            },
            None => Objective::default(),
        }
    }

    pub fn sheddable(self) -> bool {
        self.priority < 0
    }

    pub fn name(self, cfg: &AdmissionConfig) -> &str {
        self.index
            .and_then(|i| cfg.objectives.get(i))
            .map_or(DEFAULT_OBJECTIVE, |(n, _)| n.as_str())
    }

    /// Its position among the metric series: 0 for the default, then
    /// the configured objectives in order.
    pub fn slot(self) -> usize {
        self.index.map_or(0, |i| i + 1)
    }
}

/// What to do with a request on arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Route it now.
    Admit,
    /// Hold it in the queue ([`Queue::push`] may still refuse it).
    Hold,
    /// Answer it now.
    Refuse(Refusal),
}

/// Why a request is answered by the gateway instead of a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Sheddable, and the fleet is saturated.
    Saturated,
    /// The queue is full of requests of its priority or higher.
    QueueFull,
    /// Its affinity key has `maxQueuedPerKey` requests held.
    KeyFull,
    /// It waited `maxWaitMs`.
    Timeout,
    /// A higher-priority request took its place in a full queue.
    Displaced,
}

impl Refusal {
    /// 429 for a sheddable request (it may come back later), else 503.
    pub fn status(self, objective: Objective) -> u32 {
        if objective.sheddable() {
            429
        } else {
            503
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Refusal::Saturated => "saturated",
            Refusal::QueueFull => "queue_full",
            Refusal::KeyFull => "key_queue_full",
            Refusal::Timeout => "queue_timeout",
            Refusal::Displaced => "displaced",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Refusal::Saturated => "every replica that serves this model is saturated and this request's objective is sheddable",
            Refusal::QueueFull => "every replica that serves this model is saturated and the gateway's queue is full",
            Refusal::KeyFull => "every replica that serves this model is saturated and the gateway already holds the most requests it holds for this session (or, without one, this prompt prefix)",
            Refusal::Timeout => "the replicas that serve this model stayed saturated for as long as the gateway holds a request",
            Refusal::Displaced => "every replica that serves this model is saturated and a higher-priority request took this one's place in the gateway's queue",
        }
    }

    /// The JSON error body.
    pub fn body(self, cfg: &AdmissionConfig, objective: Objective) -> String {
        serde_json::json!({"error": {
            "message": format!("kvroute: {}; retry after {} s", self.message(), cfg.retry_after_s),
            "type": self.kind(),
            "objective": objective.name(cfg),
        }})
        .to_string()
    }
}

/// The verdict for a parsed request on arrival: `headroom` is whether the
/// replicas that may take it have room for it
/// ([`crate::decide::headroom`]); `competes` tells the held requests it
/// would overtake (those for the same replicas: the filter and the
/// simulation compare models) from the others.
pub fn arrive<T>(
    cfg: &AdmissionConfig,
    objective: Objective,
    headroom: bool,
    queue: &Queue<T>,
    competes: impl Fn(&T) -> bool,
) -> Verdict {
    if !cfg.enabled || (headroom && !queue.holds_at_or_above(objective.priority, competes)) {
        Verdict::Admit
    } else if objective.sheddable() {
        Verdict::Refuse(Refusal::Saturated)
    } else {
        Verdict::Hold
    }
}

/// A held request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held<T> {
    /// The caller's handle (the filter's context id).
    pub handle: u64,
    pub priority: i32,
    /// The fairness key (the request's affinity key).
    pub key: u64,
    pub since_ms: u64,
    pub item: T,
}

/// Order in the queue: highest priority, then smallest virtual-time tag,
/// then arrival.
type Place = (i64, u64, u64);

/// One key's requests held at one priority.
#[derive(Debug, Default, Clone, Copy)]
struct Tagged {
    held: usize,
    last_tag: u64,
}

/// The worker's held requests, bounded in length, per key and in wait.
#[derive(Debug)]
pub struct Queue<T> {
    order: BTreeMap<Place, Held<T>>,
    places: HashMap<u64, Place>,
    /// Requests held per key (all priorities).
    keys: HashMap<u64, usize>,
    /// Per (priority, key): requests held and the last tag handed out.
    /// Tags are per priority, as the clocks are: a key's held premium
    /// request says nothing of where its default one goes.
    tags: HashMap<(i32, u64), Tagged>,
    /// Per priority: the tag of the request served last.
    clock: HashMap<i32, u64>,
    seq: u64,
    max_len: usize,
    max_per_key: usize,
    max_wait_ms: u64,
}

impl<T> Queue<T> {
    pub fn new(cfg: &AdmissionConfig) -> Queue<T> {
        Queue {
            order: BTreeMap::new(),
            places: HashMap::new(),
            keys: HashMap::new(),
            tags: HashMap::new(),
            clock: HashMap::new(),
            seq: 0,
            max_len: cfg.max_queue.max(1),
            max_per_key: cfg.max_queued_per_key.max(1),
            max_wait_ms: cfg.max_wait_ms,
        }
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Whether a request of this priority or higher for which `which`
    /// holds is held.
    pub fn holds_at_or_above(&self, priority: i32, which: impl Fn(&T) -> bool) -> bool {
        self.order
            .values()
            .take_while(|h| h.priority >= priority)
            .any(|h| which(&h.item))
    }

    /// The held requests in the order they go.
    pub fn iter(&self) -> impl Iterator<Item = &Held<T>> {
        self.order.values()
    }

    /// Holds a request. A full queue makes room by displacing the request
    /// that would leave last when its priority is below this one's (it is
    /// returned, to be answered); else the request comes back with the
    /// refusal. A handle already held is refused as `QueueFull` (the
    /// caller holds a request once).
    #[allow(clippy::type_complexity)]
    pub fn push(
        &mut self,
        handle: u64,
        priority: i32,
        key: u64,
        now_ms: u64,
        item: T,
    ) -> Result<Option<Held<T>>, (Refusal, T)> {
        if self.places.contains_key(&handle) {
            return Err((Refusal::QueueFull, item));
        }
        if self.keys.get(&key).is_some_and(|&n| n >= self.max_per_key) {
            return Err((Refusal::KeyFull, item));
        }
        let mut displaced = None;
        if self.order.len() >= self.max_len {
            let lowest = self.order.keys().next_back().copied();
            match lowest {
                Some(place) if -place.0 < i64::from(priority) => {
                    displaced = self.take(place);
                }
                _ => return Err((Refusal::QueueFull, item)),
            }
        }
        let clock = self.clock.get(&priority).copied().unwrap_or(0);
        let state = self.tags.entry((priority, key)).or_default();
        let tag = clock.max(state.last_tag).saturating_add(1);
        state.last_tag = tag;
        state.held += 1;
        *self.keys.entry(key).or_insert(0) += 1;
        self.seq += 1;
        let place = (-i64::from(priority), tag, self.seq);
        self.places.insert(handle, place);
        self.order.insert(
            place,
            Held {
                handle,
                priority,
                key,
                since_ms: now_ms,
                item,
            },
        );
        Ok(displaced)
    }

    /// The request that goes next.
    pub fn front(&self) -> Option<&Held<T>> {
        self.order.values().next()
    }

    /// Takes the request that goes next.
    pub fn pop(&mut self) -> Option<Held<T>> {
        let handle = self.front()?.handle;
        self.serve(handle)
    }

    /// Takes a held request out to send it on (not necessarily the first:
    /// the one before it may wait for another model's replicas); its
    /// priority's clock moves to its tag.
    pub fn serve(&mut self, handle: u64) -> Option<Held<T>> {
        let place = *self.places.get(&handle)?;
        let held = self.take(place)?;
        let clock = self.clock.entry(held.priority).or_insert(0);
        *clock = (*clock).max(place.1);
        Some(held)
    }

    /// Takes a held request out (its client left).
    pub fn remove(&mut self, handle: u64) -> Option<Held<T>> {
        let place = *self.places.get(&handle)?;
        self.take(place)
    }

    /// Takes out every request held `maxWaitMs` or longer.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Held<T>> {
        let late: Vec<Place> = self
            .order
            .iter()
            .filter(|(_, h)| now_ms.saturating_sub(h.since_ms) >= self.max_wait_ms)
            .map(|(p, _)| *p)
            .collect();
        late.into_iter().filter_map(|p| self.take(p)).collect()
    }

    fn take(&mut self, place: Place) -> Option<Held<T>> {
        let held = self.order.remove(&place)?;
        self.places.remove(&held.handle);
        if let Some(n) = self.keys.get_mut(&held.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.keys.remove(&held.key);
            }
        }
        let tagged = (held.priority, held.key);
        if let Some(t) = self.tags.get_mut(&tagged) {
            t.held = t.held.saturating_sub(1);
            if t.held == 0 {
                self.tags.remove(&tagged);
            }
        }
        Some(held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn cfg(extra: &str) -> AdmissionConfig {
        let json = format!(
            r#"{{"hosts":["127.0.0.1:8001"],
                "objectives":{{"premium":{{"priority":10}},"batch":{{"priority":-1}}}},
                "admission":{{"enabled":true{extra}}}}}"#
        );
        Config::from_json(json.as_bytes()).unwrap().admission
    }

    #[test]
    fn objectives_come_from_the_config_only() {
        let c = cfg("");
        assert_eq!(Objective::of(&c, Some("premium")).priority, 10);
        assert_eq!(Objective::of(&c, Some(" batch ")).priority, -1);
        assert!(Objective::of(&c, Some("batch")).sheddable());
        for unknown in [
            None,
            Some(""),
            Some("Premium"),
            Some("gold"),
            Some("default"),
        ] {
            let o = Objective::of(&c, unknown);
            assert_eq!(o, Objective::default(), "{unknown:?}");
            assert_eq!(o.name(&c), DEFAULT_OBJECTIVE);
            assert_eq!(o.slot(), 0);
        }
        let huge = "premium".repeat(10_000);
        assert_eq!(Objective::of(&c, Some(&huge)), Objective::default());
        assert_eq!(Objective::of(&c, Some("premium")).name(&c), "premium");
    }

    #[test]
    fn arrivals_wait_behind_held_requests_of_their_priority_and_model() {
        let c = cfg("");
        let mut q: Queue<&str> = Queue::new(&c);
        let default = Objective::default();
        let premium = Objective::of(&c, Some("premium"));
        let batch = Objective::of(&c, Some("batch"));
        let llama = |m: &&str| *m == "llama";
        assert_eq!(arrive(&c, default, true, &q, llama), Verdict::Admit);
        assert_eq!(arrive(&c, default, false, &q, llama), Verdict::Hold);
        assert_eq!(
            arrive(&c, batch, false, &q, llama),
            Verdict::Refuse(Refusal::Saturated)
        );
        q.push(1, 0, 7, 0, "llama").unwrap();
        // Headroom now, but a request of its priority for its model waits
        // first.
        assert_eq!(arrive(&c, default, true, &q, llama), Verdict::Hold);
        assert_eq!(
            arrive(&c, batch, true, &q, llama),
            Verdict::Refuse(Refusal::Saturated)
        );
        assert_eq!(arrive(&c, premium, true, &q, llama), Verdict::Admit);
        // Another model's held request does not hold it.
        let qwen = |m: &&str| *m == "qwen";
        assert_eq!(arrive(&c, default, true, &q, qwen), Verdict::Admit);
        assert_eq!(arrive(&c, batch, true, &q, qwen), Verdict::Admit);
        // Admission off: everything goes on.
        let off = AdmissionConfig {
            enabled: false,
            ..c.clone()
        };
        assert_eq!(arrive(&off, batch, false, &q, llama), Verdict::Admit);
    }

    #[test]
    fn a_key_s_tags_are_per_priority() {
        let c = cfg("");
        let mut q = Queue::new(&c);
        // Premium traffic moves the priority-10 clock far ahead.
        for h in 0..50 {
            q.push(h, 10, 1000 + h, 0, h).unwrap();
            q.pop().unwrap();
        }
        // Key 7 has a premium request held; its default request must not
        // inherit the premium tag and go behind every later default one.
        q.push(100, 10, 7, 0, 100).unwrap();
        q.push(101, 0, 7, 0, 101).unwrap();
        q.push(102, 0, 8, 0, 102).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|h| h.item)).collect();
        assert_eq!(order, vec![100, 101, 102]);
        assert!(q.tags.is_empty() && q.keys.is_empty() && q.places.is_empty());
    }

    #[test]
    fn highest_priority_first_then_arrival_order() {
        let c = cfg("");
        let mut q = Queue::new(&c);
        for (h, p) in [(1, 0), (2, 10), (3, 0), (4, -1), (5, 10)] {
            q.push(h, p, 100 + h, h, h).unwrap();
        }
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|h| h.item)).collect();
        assert_eq!(order, vec![2, 5, 1, 3, 4]);
        assert!(q.is_empty());
    }

    #[test]
    fn one_key_interleaves_with_the_others() {
        let c = cfg("");
        let mut q = Queue::new(&c);
        // Key 1 sends five requests, then keys 2 and 3 one each.
        for h in 0..5 {
            q.push(h, 0, 1, h, h).unwrap();
        }
        q.push(10, 0, 2, 10, 10).unwrap();
        q.push(11, 0, 3, 11, 11).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|h| h.item)).collect();
        assert_eq!(order, vec![0, 10, 11, 1, 2, 3, 4]);
        // A key that comes back after being served does not jump ahead of
        // the tags already handed out.
        for h in 0..3 {
            q.push(h, 0, 1, h, h).unwrap();
        }
        assert_eq!(q.pop().map(|h| h.item), Some(0));
        q.push(20, 0, 2, 20, 20).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|h| h.item)).collect();
        assert_eq!(order, vec![1, 20, 2]);
    }

    #[test]
    fn bounds_answer_with_their_refusal() {
        let c = cfg(r#","maxQueue":3,"maxQueuedPerKey":2,"maxWaitMs":500"#);
        let mut q = Queue::new(&c);
        q.push(1, 0, 1, 0, 'a').unwrap();
        q.push(2, 0, 1, 0, 'b').unwrap();
        assert_eq!(q.push(3, 0, 1, 0, 'c'), Err((Refusal::KeyFull, 'c')));
        assert_eq!(q.push(2, 0, 9, 0, 'x'), Err((Refusal::QueueFull, 'x')));
        q.push(4, -1, 2, 100, 'd').unwrap();
        // Full: an equal priority is refused, a higher one displaces the
        // newest of the lowest priority.
        assert_eq!(q.push(5, -1, 3, 0, 'e'), Err((Refusal::QueueFull, 'e')));
        let displaced = q.push(6, 10, 3, 200, 'f').unwrap().unwrap();
        assert_eq!(displaced.item, 'd');
        assert_eq!(q.push(7, 0, 4, 0, 'g'), Err((Refusal::QueueFull, 'g')));
        assert_eq!(q.len(), 3);
        // Waits: the two held since 0 expire at 500, the later one not.
        assert!(q.expire(499).is_empty());
        let late: Vec<char> = q.expire(500).into_iter().map(|h| h.item).collect();
        assert_eq!(late, vec!['a', 'b']);
        assert_eq!(q.front().map(|h| h.item), Some('f'));
        // A client that leaves frees its place and its key's.
        assert_eq!(q.remove(6).map(|h| h.item), Some('f'));
        assert_eq!(q.remove(6), None);
        assert!(q.is_empty());
        q.push(8, 0, 1, 0, 'h').unwrap();
        q.push(9, 0, 1, 0, 'i').unwrap();
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn refusals_say_why_in_json() {
        let c = cfg("");
        let batch = Objective::of(&c, Some("batch"));
        assert_eq!(Refusal::Saturated.status(batch), 429);
        assert_eq!(Refusal::Timeout.status(Objective::default()), 503);
        let body: serde_json::Value =
            serde_json::from_str(&Refusal::QueueFull.body(&c, batch)).unwrap();
        assert_eq!(body["error"]["type"], "queue_full");
        assert_eq!(body["error"]["objective"], "batch");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("retry after 1 s"));
    }

    #[test]
    fn bad_admission_configs_name_the_field() {
        for (json, field) in [
            (r#""objectives":{"a.b":{"priority":1}}"#, "objectives"),
            (r#""objectives":{"default":{"priority":1}}"#, "objectives"),
            (r#""objectives":{"a":{"priority":1,"x":2}}"#, "objectives.a"),
            (r#""admission":{"maxQueue":0}"#, "admission.maxQueue"),
            (
                r#""admission":{"maxQueue":4,"maxQueuedPerKey":5}"#,
                "admission.maxQueuedPerKey",
            ),
            (r#""admission":{"maxWaitMs":0}"#, "admission.maxWaitMs"),
            (r#""admission":{"maxPendingS":-1}"#, "admission.maxPendingS"),
            (r#""admission":{"maxMemory":1.5}"#, "admission.maxMemory"),
            (
                r#""admission":{"objectiveHeader":"X-Bad"}"#,
                "admission.objectiveHeader",
            ),
        ] {
            let e =
                Config::from_json(format!(r#"{{"hosts":["127.0.0.1:8001"],{json}}}"#).as_bytes())
                    .unwrap_err();
            assert!(e.field.starts_with(field), "{json}: {e}");
        }
    }
}

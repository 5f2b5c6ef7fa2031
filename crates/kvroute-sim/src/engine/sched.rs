//! Continuous batching, one step at a time, over the [`KvCache`].
//!
//! Every step has a budget of `max_num_batched_tokens` tokens:
//!
//! 1. every running sequence that is decoding (exactly one token left to
//!    compute) takes one token, oldest admission first;
//! 2. running sequences still in prefill (prompt, or prompt plus output
//!    after a preemption) take chunks of what is left of the budget;
//! 3. waiting sequences are admitted first come first served while the
//!    budget lasts, `max_num_seqs` is not reached and their next chunk's
//!    blocks can be had. On admission the longest run of leading cached
//!    full blocks is a hit, capped by [`cacheable_hit_blocks`]. A waiting
//!    sequence that does not fit waits (nothing behind it jumps the queue).
//!
//! A sequence whose computed tokens reach its length samples one token in
//! that step: the first output token comes out of the step that finishes
//! the prefill. Full blocks are registered under their chained hash as soon
//! as they are computed, output blocks included, and stay cached after the
//! sequence ends. The last sampled token's KV is never computed, so a block
//! it completes is not cached.
//!
//! When a running sequence needs a block and none is free or evictable,
//! the most recently admitted running sequence is preempted (recompute, as
//! in vLLM V1): its blocks are released (hashed ones stay cached), and it
//! goes back to the front of the waiting queue with its output so far, to
//! be recomputed (partly from the cache) when it is admitted again.
//!
//! A driver that knows nothing will arrive may take a run of decode-only
//! steps at once ([`Scheduler::decode_run`], [`Scheduler::decode`]): the
//! same per-sequence code as [`Scheduler::step`], without the scheduling
//! passes and one output per step. The fleet simulation does; the
//! real-time server steps one at a time.
//!
//! Times are modelled seconds, passed in; nothing here reads a clock.

use std::collections::VecDeque;

use super::config::EngineConfig;
use super::kv::{BlockId, KvCache};
use super::metrics::{Gauges, Stats};
use super::prompt::{
    cacheable_hit_blocks, extend_hashes, generated_word, model_seed, text_key, tokens_of,
    BLOCK_TOKENS,
};

/// One engine's figures at one moment, as its `/metrics` page reports
/// them (gauges now, counters since start or the last reset).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    pub running: usize,
    pub waiting: usize,
    /// Blocks in use by running requests / capacity (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Capacity in blocks (`num_gpu_blocks`).
    pub kv_blocks: usize,
    /// Prompt tokens looked up at every admission, re-admissions included.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
}

/// A request as the scheduler takes it.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Model name; seeds the block hash chain.
    pub model: String,
    /// Prompt bytes (see [`super::chat_prompt`]).
    pub prompt: Vec<u8>,
    /// Output tokens to generate (all of them, as if ignore_eos).
    pub max_tokens: usize,
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// The prompt has no tokens.
    EmptyPrompt,
    /// Prompt plus output exceed what one sequence may hold.
    TooLong {
        prompt_tokens: usize,
        max_tokens: usize,
        /// The most tokens one sequence may hold here.
        limit: usize,
    },
}

/// How a finished request went (modelled seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Arrival until first scheduled.
    pub queue_s: f64,
    /// First scheduled until first token.
    pub prefill_s: f64,
    /// Arrival until the last token.
    pub e2e_s: f64,
    /// Times the request was preempted.
    pub preempted: u32,
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// Output token `index` (4 bytes of text); `done` on the last one.
    Token {
        id: u64,
        index: usize,
        word: [u8; 4],
        done: Option<Summary>,
    },
    /// The request cannot be served (defensive: admission found no way).
    Failed { id: u64 },
}

/// What [`Scheduler::decode`] computed: decode-only steps, one token for
/// every running sequence in each.
#[derive(Debug, Clone, PartialEq)]
pub struct Decodes {
    /// When the first step started.
    pub start: f64,
    /// When each step ended (its tokens came out).
    pub ends: Vec<f64>,
    /// Each running sequence's tokens, in admission order.
    pub seqs: Vec<Decoded>,
}

/// One sequence's tokens from a run of decode-only steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub id: u64,
    /// Index of its first token here; the next ones follow, one per step.
    pub first: usize,
    /// Their text, [`super::prompt::BYTES_PER_TOKEN`] bytes each.
    pub text: Vec<u8>,
    /// Its summary, when the last step gave its last token.
    pub done: Option<Summary>,
}

/// One step: when, how long, and what came out.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub start: f64,
    pub duration: f64,
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    pub events: Vec<SeqEvent>,
}

impl StepOutput {
    /// When the step's tokens come out.
    pub fn end(&self) -> f64 {
        self.start + self.duration
    }
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    seed: u64,
    prompt_tokens: usize,
    max_tokens: usize,
    key: u64,
    /// Prompt bytes, then every generated word.
    stream: Vec<u8>,
    /// Chained hashes of the full blocks of `stream`.
    hashes: Vec<u64>,
    generated: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Leading blocks registered in (or taken from) the prefix cache.
    registered: usize,
    arrival: f64,
    first_scheduled: Option<f64>,
    first_token: Option<f64>,
    last_token: f64,
    cached_tokens: Option<usize>,
    preempted: u32,
    /// Tokens scheduled in the current step.
    now: usize,
    /// Scheduled as a decode in the current step.
    decoding: bool,
}

impl Seq {
    fn len(&self) -> usize {
        self.prompt_tokens + self.generated
    }
}

fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_TOKENS)
}

/// One engine's scheduler state. A clone runs on alone: the fleet
/// simulation's oracle steps copies forward to see where a request's first
/// token would come soonest.
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: EngineConfig,
    seed: u64,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    /// In admission order (the last is the first to be preempted).
    running: Vec<Seq>,
    next_id: u64,
    budget: usize,
    stats: Stats,
    /// Scratch lists of a step, kept to spare an allocation per step.
    contexts: Vec<usize>,
    finished: Vec<usize>,
}

impl Scheduler {
    /// An idle scheduler; `seed` keys the generated text.
    pub fn new(cfg: EngineConfig, seed: u64) -> Self {
        let kv = KvCache::new(cfg.kv_blocks);
        Self {
            cfg,
            seed,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            budget: 0,
            stats: Stats::default(),
            contexts: Vec::new(),
            finished: Vec::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The most tokens (prompt plus output) one sequence may hold.
    pub fn max_seq_tokens(&self) -> usize {
        self.cfg
            .max_model_len
            .min(self.kv.capacity().saturating_mul(BLOCK_TOKENS))
    }

    /// Checks that a request could ever run, without queueing it.
    pub fn check(&self, prompt_bytes: usize, max_tokens: usize) -> Result<(), Reject> {
        let prompt_tokens = tokens_of(prompt_bytes);
        if prompt_tokens == 0 {
            return Err(Reject::EmptyPrompt);
        }
        let limit = self.max_seq_tokens();
        if prompt_tokens.saturating_add(max_tokens) > limit {
            return Err(Reject::TooLong {
                prompt_tokens,
                max_tokens,
                limit,
            });
        }
        Ok(())
    }

    /// Queues a request that arrived at `now`; returns its id.
    pub fn submit(&mut self, req: NewRequest, now: f64) -> Result<u64, Reject> {
        self.check(req.prompt.len(), req.max_tokens)?;
        let id = self.next_id;
        self.next_id += 1;
        let seed = model_seed(&req.model);
        let mut hashes = Vec::new();
        extend_hashes(seed, &req.prompt, &mut hashes);
        self.waiting.push_back(Seq {
            id,
            seed,
            prompt_tokens: tokens_of(req.prompt.len()),
            max_tokens: req.max_tokens.max(1),
            key: text_key(self.seed, &req.prompt),
            stream: req.prompt,
            hashes,
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            registered: 0,
            arrival: now,
            first_scheduled: None,
            first_token: None,
            last_token: now,
            cached_tokens: None,
            preempted: 0,
            now: 0,
            decoding: false,
        });
        Ok(id)
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Drops a request (its client went away); its blocks are released.
    pub fn abort(&mut self, id: u64) {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.kv.release(&s.blocks);
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.kv.release(&s.blocks);
            }
        }
    }

    /// Empties the prefix cache (blocks in use stay in use).
    pub fn flush_cache(&mut self) {
        self.kv.flush();
    }

    /// Empties the prefix cache and zeroes every counter and histogram.
    pub fn reset(&mut self) {
        self.kv.flush();
        self.stats = Stats::default();
    }

    pub(crate) fn stats(&self) -> &Stats {
        &self.stats
    }

    pub(crate) fn gauges(&self) -> Gauges {
        let cap = self.kv.capacity();
        Gauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_usage: if cap == 0 {
                0.0
            } else {
                self.kv.in_use() as f64 / cap as f64
            },
            num_gpu_blocks: cap,
        }
    }

    /// What a scrape of this engine reads (the figures of `/metrics`), for
    /// a driver that does not go through HTTP: the fleet simulation's
    /// modelled collector and engine sampler.
    pub fn reading(&self) -> Reading {
        let g = self.gauges();
        Reading {
            running: g.running,
            waiting: g.waiting,
            kv_usage: g.kv_usage,
            kv_blocks: g.num_gpu_blocks,
            prefix_queries: self.stats.prefix_queries,
            prefix_hits: self.stats.prefix_hits,
            preemptions: self.stats.preemptions,
        }
    }

    /// Leading blocks of `hashes` (this engine's chained block hashes, see
    /// [`super::block_hashes`]) held in the prefix cache now: what a router
    /// fed by the engine's KV events knows.
    pub fn cached_prefix_blocks(&self, hashes: &[u64]) -> usize {
        self.kv.match_prefix(hashes).len()
    }

    /// Running and waiting requests.
    pub fn counts(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// Tokens the engine holds or owes: the length of every running and
    /// waiting sequence.
    pub fn token_load(&self) -> usize {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .map(Seq::len)
            .sum()
    }

    /// Blocks in use by running sequences.
    pub fn blocks_in_use(&self) -> usize {
        self.kv.in_use()
    }

    /// Preempts the most recently admitted running sequence.
    fn preempt_last(&mut self) {
        let Some(mut s) = self.running.pop() else {
            return;
        };
        self.budget += s.now;
        self.kv.release(&s.blocks);
        s.blocks.clear();
        s.computed = 0;
        s.registered = 0;
        s.now = 0;
        s.decoding = false;
        s.preempted += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
    }

    /// Gives running sequence `i` blocks for `n` more tokens, preempting
    /// from the back as needed. False when `i` itself was preempted.
    fn ensure_blocks(&mut self, i: usize, n: usize) -> bool {
        loop {
            let Some(s) = self.running.get(i) else {
                return false;
            };
            let need = blocks_for(s.computed + n).saturating_sub(s.blocks.len());
            if need == 0 {
                return true;
            }
            match self.kv.allocate() {
                Some(b) => {
                    if let Some(s) = self.running.get_mut(i) {
                        s.blocks.push(b);
                    }
                }
                None => {
                    let last = self.running.len().saturating_sub(1);
                    self.preempt_last();
                    if last == i {
                        return false;
                    }
                }
            }
        }
    }

    /// Runs one step starting at modelled time `now`; None when idle.
    pub fn step(&mut self, now: f64) -> Option<StepOutput> {
        if !self.has_work() {
            return None;
        }
        self.budget = self.cfg.max_num_batched_tokens;
        for s in &mut self.running {
            s.now = 0;
            s.decoding = false;
        }
        // 1. Decodes.
        let mut i = 0;
        while i < self.running.len() && self.budget > 0 {
            let decode = self
                .running
                .get(i)
                .is_some_and(|s| s.len() - s.computed == 1);
            if decode {
                if !self.ensure_blocks(i, 1) {
                    break;
                }
                if let Some(s) = self.running.get_mut(i) {
                    s.now = 1;
                    s.decoding = true;
                }
                self.budget -= 1;
            }
            i += 1;
        }
        // 2. Running prefills (chunked).
        let mut i = 0;
        while i < self.running.len() && self.budget > 0 {
            let left =
                self.running
                    .get(i)
                    .map_or(0, |s| if s.decoding { 0 } else { s.len() - s.computed });
            if left > 0 {
                let n = left.min(self.budget);
                if !self.ensure_blocks(i, n) {
                    break;
                }
                if let Some(s) = self.running.get_mut(i) {
                    s.now = n;
                }
                self.budget -= n;
            }
            i += 1;
        }
        // 3. Admissions, first come first served.
        while self.budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            if !self.admit_front(now) {
                break;
            }
        }
        self.execute(now)
    }

    /// Admits the first waiting sequence if its next chunk fits.
    fn admit_front(&mut self, now: f64) -> bool {
        let Some(s) = self.waiting.front() else {
            return false;
        };
        let mut hit = self.kv.match_prefix(&s.hashes);
        hit.truncate(cacheable_hit_blocks(s.len(), hit.len()));
        let computed = hit.len() * BLOCK_TOKENS;
        let n = (s.len() - computed).min(self.budget);
        let new_blocks = blocks_for(computed + n) - hit.len();
        let available = self.kv.available() - self.kv.evictable_among(&hit);
        if new_blocks > available {
            return false;
        }
        let Some(mut s) = self.waiting.pop_front() else {
            return false;
        };
        self.kv.touch(&hit);
        self.stats.prefix_queries += s.len() as u64;
        self.stats.prefix_hits += computed as u64;
        s.cached_tokens.get_or_insert(computed);
        s.first_scheduled.get_or_insert(now);
        s.registered = hit.len();
        s.blocks = hit;
        s.computed = computed;
        for _ in 0..new_blocks {
            // Cannot fail: counted as available above.
            if let Some(b) = self.kv.allocate() {
                s.blocks.push(b);
            }
        }
        s.now = n;
        s.decoding = false;
        self.budget -= n;
        self.running.push(s);
        true
    }

    /// Computes the scheduled tokens, samples, and finishes sequences.
    fn execute(&mut self, now: f64) -> Option<StepOutput> {
        let mut prefill_tokens = 0;
        let mut contexts = std::mem::take(&mut self.contexts);
        contexts.clear();
        for s in &self.running {
            if s.decoding {
                contexts.push(s.len());
            } else {
                prefill_tokens += s.now;
            }
        }
        let mut events = Vec::with_capacity(self.running.len());
        if prefill_tokens == 0 && contexts.is_empty() {
            // Nothing could be scheduled. With the submission check this
            // cannot happen; fail the head of the queue rather than spin.
            if let Some(s) = self.waiting.pop_front() {
                self.kv.release(&s.blocks);
                events.push(SeqEvent::Failed { id: s.id });
            }
            return Some(StepOutput {
                start: now,
                duration: 0.0,
                prefill_tokens: 0,
                decode_seqs: 0,
                events,
            });
        }
        let duration = self.cfg.step_time_us(prefill_tokens, &contexts) / 1e6;
        let decode_seqs = contexts.len();
        self.contexts = contexts;
        let end = now + duration;
        let mut finished = std::mem::take(&mut self.finished);
        finished.clear();
        for (i, s) in self.running.iter_mut().enumerate() {
            if s.now == 0 {
                continue;
            }
            let Some((index, word, done)) = compute(&mut self.kv, &mut self.stats, s, end) else {
                continue;
            };
            if done.is_some() {
                finished.push(i);
            }
            events.push(SeqEvent::Token {
                id: s.id,
                index,
                word,
                done,
            });
        }
        self.finished = finished;
        self.retire(end);
        Some(StepOutput {
            start: now,
            duration,
            prefill_tokens,
            decode_seqs,
            events,
        })
    }

    /// Removes the sequences a step that ended at `end` finished (listed in
    /// `self.finished`), releasing their blocks.
    fn retire(&mut self, end: f64) {
        let finished = std::mem::take(&mut self.finished);
        for &i in finished.iter().rev() {
            let s = self.running.remove(i);
            self.kv.release(&s.blocks);
            self.stats.success += 1;
            self.stats.e2e.observe(end - s.arrival);
        }
        self.finished = finished;
    }

    /// Whether the next step would only decode: every running sequence
    /// decoding, the budget for all of them, nothing waiting to be admitted
    /// (blocks aside).
    fn only_decodes(&self) -> bool {
        self.waiting.is_empty()
            && self.running.len() <= self.cfg.max_num_batched_tokens
            && self.running.iter().all(|s| s.len() - s.computed == 1)
    }

    /// The next steps from `now` that only decode, as far as nothing could
    /// change them, into `ends` (when each would end; empty when the next
    /// step is not one). Such a step has every running sequence decoding,
    /// the budget for all of them, nothing waiting, and the blocks it needs
    /// free or evictable; the run stops at `max` steps, before a step that
    /// would be short of a block, and after the first step that finishes a
    /// sequence. A request submitted meanwhile does not change the steps
    /// started before it (it waits for the next one), so a driver may take
    /// the first few of them with [`Self::decode`] and go on with
    /// [`Self::step`]: the same as stepping one at a time, at a fraction of
    /// the cost.
    pub fn decode_run(&mut self, now: f64, max: usize, ends: &mut Vec<f64>) {
        ends.clear();
        if self.running.is_empty() || !self.only_decodes() {
            return;
        }
        let mut contexts = std::mem::take(&mut self.contexts);
        contexts.clear();
        contexts.extend(self.running.iter().map(Seq::len));
        let left = self
            .running
            .iter()
            .map(|s| s.max_tokens.saturating_sub(s.generated))
            .min()
            .unwrap_or(0)
            .min(max);
        let mut free = self.kv.available();
        let mut t = now;
        for _ in 0..left {
            // Step j computes each sequence's token at position len + j - 1.
            let need = self
                .running
                .iter()
                .zip(&contexts)
                .filter(|(s, &len)| blocks_for(len) > s.blocks.len().max(blocks_for(len - 1)))
                .count();
            if need > free {
                break;
            }
            free -= need;
            let end = t + self.cfg.step_time_us(0, &contexts) / 1e6;
            ends.push(end);
            t = end;
            for c in &mut contexts {
                *c += 1;
            }
        }
        self.contexts = contexts;
    }

    /// Takes `steps` decode-only steps from `now` (no more than
    /// [`Self::decode_run`] offered from the same state) and returns what
    /// came out, by sequence. Stops early, with fewer ends, if a step would
    /// not be a decode-only step after all.
    pub fn decode(&mut self, now: f64, steps: usize) -> Decodes {
        let mut out = Decodes {
            start: now,
            ends: Vec::with_capacity(steps),
            seqs: self
                .running
                .iter()
                .map(|s| Decoded {
                    id: s.id,
                    first: s.generated,
                    text: Vec::with_capacity(steps * 4),
                    done: None,
                })
                .collect(),
        };
        let mut t = now;
        for _ in 0..steps {
            let b = self.running.len();
            let ok = b == out.seqs.len() && self.only_decodes();
            let need = self
                .running
                .iter()
                .filter(|s| blocks_for(s.computed + 1) > s.blocks.len())
                .count();
            if !ok || need > self.kv.available() {
                break;
            }
            let mut contexts = std::mem::take(&mut self.contexts);
            contexts.clear();
            for i in 0..b {
                // Cannot preempt: the blocks are there (counted above).
                self.ensure_blocks(i, 1);
            }
            for s in &mut self.running {
                s.now = 1;
                s.decoding = true;
                contexts.push(s.len());
            }
            let end = t + self.cfg.step_time_us(0, &contexts) / 1e6;
            self.contexts = contexts;
            let mut finished = std::mem::take(&mut self.finished);
            finished.clear();
            for (i, (s, d)) in self.running.iter_mut().zip(&mut out.seqs).enumerate() {
                if let Some((_, word, done)) = compute(&mut self.kv, &mut self.stats, s, end) {
                    d.text.extend_from_slice(&word);
                    if done.is_some() {
                        finished.push(i);
                        d.done = done;
                    }
                }
            }
            self.finished = finished;
            out.ends.push(end);
            t = end;
            if !self.finished.is_empty() {
                self.retire(end);
                break;
            }
        }
        out
    }
}

/// Computes the tokens scheduled for `s` in a step that ends at `end`;
/// when that completes it, samples its next token: the token's index, its
/// text, and the request's summary when it was the last.
fn compute(
    kv: &mut KvCache,
    stats: &mut Stats,
    s: &mut Seq,
    end: f64,
) -> Option<(usize, [u8; 4], Option<Summary>)> {
    s.computed += s.now;
    register(kv, s);
    if s.computed < s.len() {
        return None;
    }
    let index = s.generated;
    let word = generated_word(s.key, index as u64);
    s.stream.extend_from_slice(&word);
    s.generated += 1;
    extend_hashes(s.seed, &s.stream, &mut s.hashes);
    stats.generation_tokens += 1;
    if s.first_token.is_none() {
        s.first_token = Some(end);
        stats.ttft.observe(end - s.arrival);
        stats.prompt_tokens += s.prompt_tokens as u64;
    } else {
        stats.itl.observe(end - s.last_token);
    }
    s.last_token = end;
    let done = (s.generated >= s.max_tokens).then(|| {
        let first_scheduled = s.first_scheduled.unwrap_or(s.arrival);
        Summary {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.generated,
            cached_tokens: s.cached_tokens.unwrap_or(0),
            queue_s: (first_scheduled - s.arrival).max(0.0),
            prefill_s: (s.first_token.unwrap_or(end) - first_scheduled).max(0.0),
            e2e_s: (end - s.arrival).max(0.0),
            preempted: s.preempted,
        }
    });
    Some((index, word, done))
}

/// Registers every block of `s` that is now full and computed.
fn register(kv: &mut KvCache, s: &mut Seq) {
    let full = s.hashes.len().min(s.computed / BLOCK_TOKENS);
    for k in s.registered..full {
        if let (Some(&b), Some(&h)) = (s.blocks.get(k), s.hashes.get(k)) {
            kv.register(b, h);
        }
    }
    s.registered = s.registered.max(full);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
    use super::super::prompt::{block_hashes, chat_prompt, generated_text, BLOCK_BYTES};
    use super::*;
    use std::collections::HashMap;

    fn cfg(kv_blocks: usize, budget: usize) -> EngineConfig {
        EngineConfig {
            kv_blocks,
            max_num_batched_tokens: budget,
            ..EngineConfig::default()
        }
    }

    fn req(prompt: &[u8], max_tokens: usize) -> NewRequest {
        NewRequest {
            model: "m".to_owned(),
            prompt: prompt.to_vec(),
            max_tokens,
        }
    }

    /// Distinct prompt bytes: `blocks` full blocks plus `extra` bytes.
    fn prompt(tag: u8, blocks: usize, extra: usize) -> Vec<u8> {
        (0..blocks * BLOCK_BYTES + extra)
            .map(|i| tag.wrapping_add((i % 251) as u8))
            .collect()
    }

    /// Steps until idle; returns summaries and texts by id, and the steps.
    fn run(
        s: &mut Scheduler,
        mut now: f64,
    ) -> (HashMap<u64, Summary>, HashMap<u64, String>, Vec<StepOutput>) {
        let mut done = HashMap::new();
        let mut text: HashMap<u64, String> = HashMap::new();
        let mut steps = Vec::new();
        for _ in 0..100_000 {
            let Some(out) = s.step(now) else {
                return (done, text, steps);
            };
            now = out.end();
            for e in &out.events {
                match e {
                    SeqEvent::Token {
                        id, word, done: d, ..
                    } => {
                        text.entry(*id)
                            .or_default()
                            .push_str(std::str::from_utf8(word).unwrap());
                        if let Some(d) = d {
                            done.insert(*id, *d);
                        }
                    }
                    SeqEvent::Failed { id } => panic!("request {id} failed"),
                }
            }
            steps.push(out);
        }
        panic!("did not finish");
    }

    #[test]
    fn repeated_prompt_hits_the_cache() {
        let mut s = Scheduler::new(cfg(100, 8192), 1);
        let p = prompt(1, 4, 10); // 4 full blocks + 10 bytes
        let a = s.submit(req(&p, 4), 0.0).unwrap();
        let (done, _, _) = run(&mut s, 0.0);
        assert_eq!(done[&a].cached_tokens, 0);
        let b = s.submit(req(&p, 4), 1.0).unwrap();
        let (done, _, _) = run(&mut s, 1.0);
        assert_eq!(done[&b].cached_tokens, 4 * BLOCK_TOKENS);
        assert_eq!(s.stats().prefix_hits, 64);
        assert_eq!(s.stats().prefix_queries, 2 * tokens_of(p.len()) as u64);
        assert_eq!(s.stats().success, 2);
        assert_eq!(s.gauges().running, 0);
        assert!(s.gauges().kv_usage.abs() < 1e-12);
    }

    #[test]
    fn full_hit_still_computes_one_token() {
        let mut s = Scheduler::new(cfg(100, 8192), 1);
        let p = prompt(2, 2, 0); // exactly 32 tokens, 2 full blocks
        s.submit(req(&p, 1), 0.0).unwrap();
        run(&mut s, 0.0);
        let b = s.submit(req(&p, 1), 1.0).unwrap();
        let (done, _, steps) = run(&mut s, 1.0);
        // Both blocks are cached, but only one may be used.
        assert_eq!(done[&b].cached_tokens, 16);
        assert_eq!(steps[0].prefill_tokens, 16);
    }

    #[test]
    fn lru_evicts_oldest_prefix_under_pressure() {
        // 6 blocks: each request uses 3 (2 prompt blocks + a partial one).
        let mut s = Scheduler::new(cfg(6, 8192), 1);
        let (pa, pb, pc) = (prompt(1, 2, 4), prompt(2, 2, 4), prompt(3, 2, 4));
        for (p, t) in [(&pa, 0.0), (&pb, 1.0)] {
            s.submit(req(p, 1), t).unwrap();
            run(&mut s, t);
        }
        // Touch a again so that b is the least recently used.
        let a2 = s.submit(req(&pa, 1), 2.0).unwrap();
        let (d, _, _) = run(&mut s, 2.0);
        assert_eq!(d[&a2].cached_tokens, 32);
        // c needs 3 blocks: one free, then b's (tail first).
        s.submit(req(&pc, 1), 3.0).unwrap();
        run(&mut s, 3.0);
        let a3 = s.submit(req(&pa, 1), 4.0).unwrap();
        let (d, _, _) = run(&mut s, 4.0);
        assert_eq!(d[&a3].cached_tokens, 32);
        let b2 = s.submit(req(&pb, 1), 5.0).unwrap();
        let (d, _, _) = run(&mut s, 5.0);
        // b's tail block went first; its head might survive, but not all.
        assert!(d[&b2].cached_tokens < 32);
    }

    #[test]
    fn generated_tokens_are_cached_for_the_next_turn() {
        let mut s = Scheduler::new(cfg(1000, 8192), 7);
        let first = chat_prompt(&[("user", "tell me a long story please")]);
        let a = s.submit(req(&first, 40), 0.0).unwrap();
        let (_, text, _) = run(&mut s, 0.0);
        let answer = &text[&a];
        assert_eq!(*answer, generated_text(7, &first, 40));
        let second = chat_prompt(&[
            ("user", "tell me a long story please"),
            ("assistant", answer.as_str()),
            ("user", "go on"),
        ]);
        let mut seen = first.clone();
        seen.extend_from_slice(answer.as_bytes());
        // Blocks fully computed last turn: all of prompt + answer except
        // the last token, whose KV was never computed.
        let computed_bytes = seen.len() - 4;
        let expect_blocks = computed_bytes / BLOCK_BYTES;
        assert!(
            expect_blocks * BLOCK_BYTES > first.len(),
            "answer fills a block"
        );
        assert_eq!(
            block_hashes("m", &seen)[..expect_blocks],
            block_hashes("m", &second)[..expect_blocks]
        );
        let b = s.submit(req(&second, 4), 1.0).unwrap();
        let (d, _, _) = run(&mut s, 1.0);
        assert_eq!(d[&b].cached_tokens, expect_blocks * BLOCK_TOKENS);
    }

    #[test]
    fn preempts_newest_when_kv_runs_out_and_both_finish() {
        // 8 blocks = 128 tokens. Two requests of 48 prompt tokens each that
        // grow by 40 tokens: together they need 11 blocks.
        let mut s = Scheduler::new(cfg(8, 8192), 1);
        let a = s.submit(req(&prompt(1, 3, 0), 40), 0.0).unwrap();
        let b = s.submit(req(&prompt(2, 3, 0), 40), 0.0).unwrap();
        let (d, text, _) = run(&mut s, 0.0);
        assert!(s.stats().preemptions >= 1);
        assert_eq!(d[&a].preempted, 0);
        assert!(d[&b].preempted >= 1);
        assert_eq!(d[&b].completion_tokens, 40);
        // Recomputation does not change the answer.
        assert_eq!(text[&b], generated_text(1, &prompt(2, 3, 0), 40));
        assert_eq!(s.blocks_in_use(), 0);
        // A request that can never fit is refused up front.
        assert!(matches!(
            s.check(8 * BLOCK_BYTES, 1),
            Err(Reject::TooLong { limit: 128, .. })
        ));
        assert_eq!(s.check(0, 1), Err(Reject::EmptyPrompt));
    }

    #[test]
    fn chunked_prefill_respects_the_budget() {
        let mut s = Scheduler::new(cfg(1000, 100), 1);
        // One decoding request, then a long prompt arrives.
        s.submit(req(&prompt(1, 1, 0), 50), 0.0).unwrap();
        let out = s.step(0.0).unwrap();
        assert_eq!(out.prefill_tokens, 16);
        let long = s.submit(req(&prompt(2, 20, 0), 2), 0.0).unwrap(); // 320 tokens
        let mut t = out.end();
        let mut chunks = Vec::new();
        loop {
            let out = s.step(t).unwrap();
            t = out.end();
            assert!(out.prefill_tokens + out.decode_seqs <= 100);
            assert_eq!(out.decode_seqs, 1, "the decode keeps going");
            chunks.push(out.prefill_tokens);
            let first = out
                .events
                .iter()
                .any(|e| matches!(e, SeqEvent::Token { id, index: 0, .. } if *id == long));
            if first {
                break;
            }
        }
        assert_eq!(chunks, vec![99, 99, 99, 23]);
        // Step time follows the formula.
        let c = EngineConfig::default();
        let out = s.step(t).unwrap();
        let expect = c.step_time_us(0, &[16 + 5, 320 + 1]) / 1e6;
        assert!((out.duration - expect).abs() < 1e-12);
    }

    #[test]
    fn a_decode_run_is_the_steps_it_replaces() {
        // Three sequences of 35 prompt tokens (3 blocks each) on 20 blocks:
        // they cross block boundaries together, so the run stops before
        // the step that would need 3 blocks with 2 left, long before any
        // of them finishes.
        let build = || {
            let mut s = Scheduler::new(cfg(20, 8192), 1);
            for (tag, max) in [(1, 100), (2, 120), (3, 140)] {
                s.submit(req(&prompt(tag, 2, 10), max), 0.0).unwrap();
            }
            let first = s.step(0.0).unwrap();
            assert_eq!(first.events.len(), 3, "one step prefills all three");
            (s, first.end())
        };
        let ((mut a, t0), (mut b, _)) = (build(), build());
        let mut ends = Vec::new();
        a.decode_run(t0, usize::MAX, &mut ends);
        // Lengths 36.. : blocks at 49, 65 and 81 take 9 of the 11 free.
        assert_eq!(ends.len(), 96 - 36 + 1, "{}", ends.len());
        // Take all but the last five (as when a request arrives).
        let k = ends.len() - 5;
        let d = a.decode(t0, k);
        assert_eq!(d.ends, ends[..k]);
        let mut text: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut t = t0;
        for &end in &ends[..k] {
            let out = b.step(t).unwrap();
            assert_eq!(out.end(), end);
            for e in out.events {
                if let SeqEvent::Token { id, word, done, .. } = e {
                    assert!(done.is_none());
                    text.entry(id).or_default().extend_from_slice(&word);
                }
            }
            t = end;
        }
        assert_eq!(d.seqs.len(), 3);
        for seq in &d.seqs {
            assert_eq!(seq.first, 1);
            assert_eq!(seq.text, text[&seq.id]);
            assert!(seq.done.is_none());
        }
        assert_eq!(a.reading(), b.reading());
        // From here both go one step at a time, preempting alike.
        let mut steps = 0;
        loop {
            let (x, y) = (a.step(t), b.step(t));
            assert_eq!(x, y);
            let Some(out) = x else { break };
            t = out.end();
            steps += 1;
        }
        assert!(steps > 100);
        assert!(a.stats().preemptions > 0);
        assert_eq!(a.reading(), b.reading());
        // A run stops after the step that finishes a sequence.
        let mut s = Scheduler::new(cfg(1000, 8192), 1);
        s.submit(req(&prompt(1, 1, 0), 5), 0.0).unwrap();
        s.submit(req(&prompt(2, 1, 0), 9), 0.0).unwrap();
        let t = s.step(0.0).unwrap().end();
        s.decode_run(t, usize::MAX, &mut ends);
        assert_eq!(ends.len(), 4);
        let d = s.decode(t, 4);
        assert_eq!(d.seqs[0].done.unwrap().completion_tokens, 5);
        assert!(d.seqs[1].done.is_none());
        assert_eq!(s.counts(), (1, 0));
        // Nothing runs while a request waits.
        s.submit(req(&prompt(3, 1, 0), 5), 1.0).unwrap();
        s.decode_run(1.0, usize::MAX, &mut ends);
        assert!(ends.is_empty());
    }

    #[test]
    fn max_num_seqs_limits_admission() {
        let mut s = Scheduler::new(
            EngineConfig {
                max_num_seqs: 2,
                ..cfg(1000, 8192)
            },
            1,
        );
        for i in 0..3 {
            s.submit(req(&prompt(i, 1, 0), 3), 0.0).unwrap();
        }
        s.step(0.0).unwrap();
        assert_eq!(s.counts(), (2, 1));
        assert_eq!(s.token_load(), 3 * 16 + 2);
    }
}

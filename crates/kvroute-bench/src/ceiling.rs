//! Hit-rate ceilings: what a perfect router could get on the same requests.
//!
//! Both replay the requests in the order they were sent, against one cache
//! of 16-token blocks hashed exactly as the engines hash them:
//!
//! - **unbounded**: one engine with infinite KV. Nothing can beat it: it
//!   also sees every block, prompt and answer, the moment a request is sent.
//! - **fleet LRU**: one LRU cache holding the fleet's total KV capacity in
//!   blocks. A fleet whose caches are partitioned across replicas cannot
//!   reasonably beat it; a router's hit rate is reported as a fraction of it.
//!
//! A request's hit is the leading run of its prompt blocks already cached,
//! under the engines' own rule (at least one prompt token is computed).
//! Its prompt and answer blocks are then cached (and refreshed in LRU order).

use std::collections::VecDeque;

use kvroute_sim::engine::{BlockMap, BlockSet};

use serde::{Deserialize, Serialize};

/// One request as the ceilings see it.
#[derive(Debug, Clone)]
pub struct Blocks {
    /// Chained hashes of the full blocks of prompt + answer.
    pub hashes: Vec<u64>,
    /// How many of them lie wholly inside the prompt.
    pub prompt_blocks: usize,
    pub prompt_tokens: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Prompt tokens of the requests counted.
    pub prompt_tokens: u64,
    pub unbounded_hit_rate: f64,
    pub lru_hit_rate: f64,
    /// Capacity of the LRU, blocks (the fleet's total).
    pub lru_blocks: u64,
}

/// An LRU set of block hashes: the last touch of each hash, and the
/// touches in order; an entry of the queue whose hash was touched again
/// later is stale and skipped (amortised O(1) a touch, where a sorted map
/// was a quarter of a long simulation's time).
struct Lru {
    capacity: usize,
    tick: u64,
    at: BlockMap<u64>,
    order: VecDeque<(u64, u64)>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            tick: 0,
            at: BlockMap::default(),
            order: VecDeque::new(),
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.at.contains_key(&h)
    }

    fn touch(&mut self, h: u64) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        self.at.insert(h, self.tick);
        self.order.push_back((self.tick, h));
        while self.at.len() > self.capacity {
            let Some((t, victim)) = self.order.pop_front() else {
                break;
            };
            if self.at.get(&victim) == Some(&t) {
                self.at.remove(&victim);
            }
        }
        // Drop stale entries once they outnumber the live ones.
        if self.order.len() > 2 * self.at.len() + 1024 {
            let at = &self.at;
            self.order.retain(|(t, h)| at.get(h) == Some(t));
        }
    }
}

/// Leading blocks of `prompt` found by `has`.
fn leading(prompt: &[u64], has: impl Fn(u64) -> bool) -> usize {
    prompt.iter().take_while(|h| has(**h)).count()
}

/// Both ceilings, fed one request at a time in send order (so that a long
/// run need not keep every request's hashes).
pub struct Ceiling {
    seen: BlockSet,
    lru: Lru,
    fleet_blocks: u64,
    queries: u64,
    unbounded: u64,
    bounded: u64,
}

impl Ceiling {
    /// Ceilings for a fleet of `fleet_blocks` blocks in all.
    pub fn new(fleet_blocks: u64) -> Self {
        Self {
            seen: BlockSet::default(),
            lru: Lru::new(usize::try_from(fleet_blocks).unwrap_or(usize::MAX)),
            fleet_blocks,
            queries: 0,
            unbounded: 0,
            bounded: 0,
        }
    }

    /// Adds the next request; returns its prompt tokens cached with an
    /// unbounded cache (every block sent before it): what the no-queue TTFT
    /// floor assumes is cached.
    ///
    /// The floor once assumed the fleet LRU's cache instead. On workloads
    /// where KV memory binds, whether a long conversation's prefix is still
    /// in a fleet-sized LRU flips with small changes in send order, and a
    /// closed-loop workload's send order depends on the router: on the chat
    /// family (16 replicas) the LRU floor's p95 ranged from 25 ms to 196 ms
    /// across routers, so a router with the lower TTFT p95 could show the
    /// higher p95/floor. The unbounded cache makes the floor a lower bound
    /// no router can beat, nearly the same for every router.
    pub fn add(&mut self, r: &Blocks) -> u64 {
        let block_tokens = kvroute_sim::engine::BLOCK_TOKENS as u64;
        let prompt = r
            .hashes
            .get(..r.prompt_blocks.min(r.hashes.len()))
            .unwrap_or(&[]);
        let hit = |matched: usize| {
            kvroute_sim::engine::cacheable_hit_blocks(
                usize::try_from(r.prompt_tokens).unwrap_or(usize::MAX),
                matched,
            ) as u64
                * block_tokens
        };
        self.queries += r.prompt_tokens;
        let unbounded_hit = hit(leading(prompt, |h| self.seen.contains(&h)));
        self.unbounded += unbounded_hit;
        self.bounded += hit(leading(prompt, |h| self.lru.contains(h)));
        for &h in &r.hashes {
            self.seen.insert(h);
            self.lru.touch(h);
        }
        unbounded_hit
    }

    pub fn finish(&self) -> Ceilings {
        let rate = |hits: u64| {
            if self.queries == 0 {
                0.0
            } else {
                hits as f64 / self.queries as f64
            }
        };
        Ceilings {
            prompt_tokens: self.queries,
            unbounded_hit_rate: rate(self.unbounded),
            lru_hit_rate: rate(self.bounded),
            lru_blocks: self.fleet_blocks,
        }
    }
}

/// Both ceilings for `requests` in send order, with a fleet of
/// `fleet_blocks` blocks in all.
pub fn ceilings<'a>(requests: impl IntoIterator<Item = &'a Blocks>, fleet_blocks: u64) -> Ceilings {
    let mut c = Ceiling::new(fleet_blocks);
    for r in requests {
        c.add(r);
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(hashes: &[u64], prompt_blocks: usize) -> Blocks {
        Blocks {
            hashes: hashes.to_vec(),
            prompt_blocks,
            prompt_tokens: prompt_blocks as u64 * 16 + 5,
        }
    }

    #[test]
    fn repeats_hit_and_lru_forgets() {
        let rs = [
            req(&[1, 2, 3], 3),
            req(&[1, 2, 3], 3),
            req(&[4, 5, 6], 3),
            req(&[1, 2, 3], 3),
        ];
        let c = ceilings(&rs, 1000);
        // Second and fourth requests hit 3 blocks each (48 of 53 tokens).
        assert_eq!(c.prompt_tokens, 4 * 53);
        assert!((c.unbounded_hit_rate - 96.0 / 212.0).abs() < 1e-12);
        assert_eq!(c.lru_hit_rate, c.unbounded_hit_rate);
        // A cache of 3 blocks forgets 1,2,3 when 4,5,6 arrive.
        let small = ceilings(&rs, 3);
        assert!((small.lru_hit_rate - 48.0 / 212.0).abs() < 1e-12);
        assert!(small.lru_hit_rate <= small.unbounded_hit_rate);
    }

    #[test]
    fn answers_are_cached_for_the_next_turn_and_one_token_is_computed() {
        // Turn 2's prompt is turn 1's prompt + answer (blocks 1,2,3,4).
        let rs = [
            req(&[1, 2, 3, 4], 2),
            Blocks {
                hashes: vec![1, 2, 3, 4],
                prompt_blocks: 4,
                prompt_tokens: 64,
            },
        ];
        let c = ceilings(&rs, 100);
        // 64-token prompt fully cached: 48 tokens counted (the last block recomputed).
        assert!((c.unbounded_hit_rate - 48.0 / (37.0 + 64.0)).abs() < 1e-12);
    }
}

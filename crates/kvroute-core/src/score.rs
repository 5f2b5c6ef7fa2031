//! Scoring candidates: the request's predicted cost on each replica,
//! inside bounded load on KV memory. Every parsed request is placed so,
//! with a fleet snapshot or without one ([`crate::decide`]).
//!
//! Each candidate replica (with a snapshot: ready, not draining, serving
//! the request's model; without one: every configured host) gets a
//! predicted cost in seconds, a decision under uncertainty:
//!
//! ```text
//! cost = (pending + uncached * (1 + w)) / rate
//!      + memorySeconds * max(0, (use - memoryKnee) / (1 - memoryKnee))^2
//!      + arrivalDelayWeight * arrivals * p^2 / 2
//! w    = recomputeWeight * min(1, use / recomputeFullKv)   (0 for a cold request)
//! p    = uncached / rate
//! ```
//!
//! - `rate`: the replica's prefill rate, the snapshot's `prefillTokensPerS`
//!   for it where given (a fleet of two GPU generations, docs/fleet-state.md),
//!   else the one learned from its answers where it is well below the
//!   fastest replica's ([`crate::rates`]), else the configured
//!   `prefillTokensPerS`;
//! - `pending`: prefill ahead of the request, the larger of the engine's
//!   view (waiting requests x `waitingRequestTokens`) and the gateway's own
//!   (prompt tokens it sent there with no first response body byte yet). The gateway's
//!   figure moves with every dispatch, so a burst cannot pile onto the
//!   replica that looked idle in the last snapshot. Without engine data (no
//!   snapshot, or the replica's data is stale), the gateway's own alone;
//! - `uncached`: the request's prompt tokens less those expected cached
//!   there: the prefix index's match ([`crate::index`]), and on the key's
//!   *home* replica at least `homeCachedShare` of the prompt;
//! - `use`: predicted KV use as a share of capacity: the replica's memory
//!   ([`crate::decide`]: the engine's KV in use plus the prefill pending on
//!   it, or the gateway's memory held when larger) plus this request's
//!   prompt and expected output. Only where the snapshot gives the
//!   capacity; the term rises steeply as a replica nears it, where the
//!   engine would preempt or hold the request waiting for memory. Without
//!   a capacity, the engine's KV utilisation; without engine data, 0 (no
//!   memory term: bounded load alone guards memory);
//! - `w`: what a prefix computed there costs beyond the request's own
//!   wait. A second copy of a prefix takes memory that holds other cached
//!   prefixes, and its prefill delays the requests behind it; both matter
//!   only where memory is in demand, so the weight grows with the
//!   replica's predicted use up to `recomputeFullKv` (at 0, the whole
//!   weight everywhere). Without engine data nothing is known of the
//!   replica's memory: the whole weight. On the fleet simulation's
//!   Mooncake trace (KV use about 10 %) a whole weight held requests at
//!   busy homes and cost TTFT p95; on the chat family (about 50 %) the
//!   weight is what keeps conversations home (docs/fleet-state.md). A
//!   *cold* request (the prefix index knows none of its blocks, it
//!   continues no conversation, no gateway has said where its key went)
//!   computes nothing a second time anywhere: its weight is 0, and its
//!   home's credit (`coldHomeShare`) is an assumption about where the
//!   key's later requests go, not a cache it would duplicate;
//! - `arrivals`: the replica's recent arrival rate, in requests per
//!   second, of requests that continue a conversation: those sent there
//!   by this gateway, decayed over `arrivalWindowMs`
//!   ([`crate::load::LoadTable::arrival_rate`]), plus the other gateways'
//!   (`peerArrivalsPerS`, from a collector that reads several gateways).
//!   Such a request is bound to the replica that holds its history, and
//!   waits behind any prefill running there (an engine runs the prefill
//!   chunks of admitted requests before it admits new ones): during `p`
//!   seconds of prefill, `arrivals x p` of them arrive and wait `p / 2` on
//!   average. A request that starts a conversation is free to go where no
//!   prefill is pending, so it is not counted. A long new prompt then goes
//!   where few conversations return. In the fleet simulation's agent
//!   family (long-lived tool loops; docs/fleet-state.md, "Arrivals behind
//!   a prefill"), without this term every slow request beyond the
//!   unavoidable first turns was a turn waiting behind another loop's
//!   first prompt on its replica.
//!
//! Locality therefore yields when a warm replica's predicted cost exceeds a
//! cold one's (its queue outweighs the prefill the cache saves), not at a
//! fixed threshold. Candidates are ordered by cost rounded to a multiple of
//! `costQuantumMs` (metric noise does not reshuffle the order), then by the
//! request's rendezvous rank (equal replicas split keys consistently, as in
//! [`crate::picker`]).
//!
//! # The same choice on every gateway
//!
//! A key's home is the rendezvous top of its affinity key among the
//! replicas with headroom *by the snapshot* (KV below `kvPressure`, fewer
//! than `queuePressure` waiting; a replica without engine data has
//! headroom, so without a snapshot the home is the rendezvous top over the
//! configured hosts): a function of the request and the snapshot (or the
//! host list) only, which every gateway shares. A request that continues a
//! conversation (the body holds a turn the model produced) keeps its home
//! among all the candidates, pressed or not: its history is there, and the
//! cost's queue and memory terms move it when they must. (Fleet
//! simulation, chat family, 4 gateways: TTFT p95 253 -> 226 ms; no change
//! on the other families, docs/fleet-state.md.) Assuming the home holds the
//! key's prefix makes every gateway send a conversation there even when its
//! own prefix index has never seen it; per-gateway state (the index, the
//! gateway's own pending prefill and memory) only moves a request off its
//! home when the predicted costs differ by more than the cache saves.
//!
//! # Bounded load
//!
//! The bounded-load walk of [`crate::picker`] then runs over this order on
//! each replica's memory (with a snapshot, the larger of the engine's and
//! the gateway's figure; without engine data, the gateway's memory held):
//! a replica is admissible while its memory is at most `(1 + epsilon)`
//! times the average, or while its predicted use stays under
//! `memoryFloor` of its capacity (`loadFloorTokens` where the
//! capacity is unknown). With engine data it is a safety net: the cost
//! already spreads load. Without, it is what spills a hot key: the home's
//! pending prefill is only the part its prefix index does not hold, so its
//! cost stays low while its memory grows.
//!
//! A request that continues a conversation is not spilled at any price:
//! where the first replica's cost carries the memory term (fresh engine
//! data with its KV capacity), bounded load moves the request only when
//! the replica it would go to is predicted to cost at most
//! `spillCostRatio` times as much plus `spillMarginMs` ([`SpillGuard`]);
//! otherwise it stays, and that replica is its first fallback. The memory
//! term already moves a conversation off a home that is truly full; a
//! spill to a cold replica computes its whole history again there, and
//! the other gateways, which did not see the spill, send the next turn
//! home. Fleet simulation, agent family (60k-token contexts, KV memory
//! binds), seeds 1-6: TTFT p95 median 1242 -> 1031 ms at one gateway,
//! 1463 -> 1212 at four (docs/fleet-state.md).

use std::cmp::Ordering;

use crate::picker::{rank, Bounds, Pick};

/// One replica that may take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Position in the routing universe (the snapshot's host list, or
    /// the configured hosts without a snapshot).
    pub index: usize,
    pub id: u64,
    /// Higher is better: the negated predicted cost, in seconds.
    pub score: f64,
    /// No headroom by the snapshot (it cannot be a home); kept for
    /// explanations.
    pub pressured: bool,
    /// KV memory in tokens, for bounded load.
    pub load: u64,
    /// At or below this load the replica always admits.
    pub floor: u64,
    /// Its cost carries the memory term (fresh engine data with the KV
    /// capacity): a [`SpillGuard`] may keep a request on it.
    pub memory_costed: bool,
}

/// When bounded load may not move a request off the first replica of its
/// order (a [`Candidate::memory_costed`] one): when the first admissible
/// replica's predicted cost exceeds `ratio` times the first's plus
/// `margin_s`, the request stays on the first (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpillGuard {
    pub ratio: f64,
    pub margin_s: f64,
}

impl SpillGuard {
    /// Whether the guard keeps the request on `first` rather than spill it
    /// to `to`.
    fn keeps(&self, first: &Candidate, to: &Candidate) -> bool {
        first.memory_costed && -to.score > self.ratio * -first.score + self.margin_s
    }
}

fn bucket(score: f64, quantum: f64) -> f64 {
    let b = if quantum > 0.0 {
        (score / quantum).round()
    } else {
        score
    };
    // -0.0 and 0.0 are one bucket.
    b + 0.0
}

/// A candidate's place in the preference order: higher cost bucket (that
/// is, lower cost) first, then higher rendezvous rank, then position.
#[derive(Debug, Clone, Copy)]
struct Place {
    bucket: f64,
    rank: u64,
    k: usize,
}

impl PartialEq for Place {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Place {}
impl PartialOrd for Place {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Place {
    /// Greater is earlier in the order (a max-heap pops the first).
    fn cmp(&self, other: &Self) -> Ordering {
        self.bucket
            .total_cmp(&other.bucket)
            .then_with(|| self.rank.cmp(&other.rank))
            .then_with(|| other.k.cmp(&self.k))
    }
}

fn places(cands: &[Candidate], key: u64, quantum: f64) -> Vec<Place> {
    cands
        .iter()
        .enumerate()
        .map(|(k, c)| Place {
            bucket: bucket(c.score, quantum),
            rank: rank(key, c.id),
            k,
        })
        .collect()
}

/// Candidates' positions in preference order, fully sorted: the reference
/// the lazy walk of [`pick_scored`] is tested against.
#[cfg(test)]
fn order(cands: &[Candidate], key: u64, quantum: f64) -> Vec<usize> {
    let mut all = places(cands, key, quantum);
    all.sort_unstable_by(|a, b| b.cmp(a));
    all.into_iter().map(|p| p.k).collect()
}

/// Bounded-load pick over scored candidates. Indices in the result are the
/// candidates' `index` fields; `spilled` means the first in order was not
/// admissible and the request went elsewhere. With a `guard`, a spill that
/// would cost too much more than the first replica (see [`SpillGuard`]) is
/// refused: the first stays the primary, and the replica it would have
/// spilled to is its first fallback.
///
/// The order is walked lazily (a heap built in linear time, popped until
/// the primary and its fallbacks are found), since a pick needs the first
/// few places only: a full sort of 1,024 candidates was most of a
/// decision's cost once the load table was sorted. The result is that of
/// the walk over the fully sorted order (a test holds them equal).
pub fn pick_scored(
    cands: &[Candidate],
    key: u64,
    cost: u64,
    quantum: f64,
    bounds: Bounds,
    guard: Option<SpillGuard>,
) -> Option<Pick> {
    let load = |k: usize| cands.get(k).map_or(0, |c| c.load);
    let total = cands.iter().map(|c| c.load).fold(0u64, u64::saturating_add);
    let cap = bounds.cap(total, cost, cands.len());
    // The admission test of crate::picker (the request's own cost only in
    // the average; see its module doc why), with each replica's own floor.
    let floor = |k: usize| cands.get(k).map_or(0, |c| c.floor);
    let admissible = |k: usize| (load(k) as f64) <= cap || load(k) <= floor(k);
    let mut heap = std::collections::BinaryHeap::from(places(cands, key, quantum));
    // The order's prefix walked so far: it ends with the primary and
    // `fallbacks` admissible replicas after it, or it is the whole order.
    let mut walked: Vec<usize> = Vec::new();
    let mut primary = None;
    let mut admissible_others = 0;
    while primary.is_none() || admissible_others < bounds.fallbacks {
        let Some(next) = heap.pop() else { break };
        let k = next.k;
        walked.push(k);
        if !admissible(k) {
            continue;
        }
        if primary.is_none() {
            let first = walked.first().and_then(|&f| cands.get(f).map(|c| (f, c)));
            match (first, cands.get(k), guard) {
                (Some((f, fc)), Some(to), Some(g)) if f != k && g.keeps(fc, to) => {
                    primary = Some(f);
                    admissible_others += 1;
                }
                _ => primary = Some(k),
            }
        } else {
            admissible_others += 1;
        }
    }
    let first = *walked.first()?;
    // None admissible (float rounding only): the least loaded, the first
    // of them in the order; the whole order has been walked.
    let primary = primary
        .or_else(|| walked.iter().copied().min_by_key(|&k| load(k)))
        .unwrap_or(first);
    let rest = walked.iter().copied().filter(|&k| k != primary);
    let fallbacks: Vec<usize> = rest
        .clone()
        .filter(|&k| admissible(k))
        .chain(rest.filter(|&k| !admissible(k)))
        .take(bounds.fallbacks)
        .filter_map(|k| cands.get(k).map(|c| c.index))
        .collect();
    Some(Pick {
        primary: cands.get(primary)?.index,
        fallbacks,
        spilled: primary != first,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cand(index: usize, score: f64, pressured: bool, load: u64) -> Candidate {
        Candidate {
            index,
            id: index as u64 * 7919 + 1,
            score,
            pressured,
            load,
            floor: 0,
            memory_costed: true,
        }
    }

    const B: Bounds = Bounds {
        epsilon: 0.25,
        floor: 0,
        fallbacks: 2,
    };

    #[test]
    fn higher_score_wins() {
        let c = [
            cand(0, -0.5, false, 0),
            cand(1, 2.0, false, 0),
            cand(2, 1.0, true, 0),
        ];
        let p = pick_scored(&c, 1, 10, 0.05, B, None).unwrap();
        assert_eq!(p.primary, 1);
        assert_eq!(p.fallbacks, vec![2, 0]);
        assert!(!p.spilled);
    }

    #[test]
    fn equal_buckets_fall_back_to_rendezvous_rank() {
        let c: Vec<Candidate> = (0..8)
            .map(|i| cand(i, 0.0 - (i as f64) * 0.001, false, 0))
            .collect();
        let mut seen = std::collections::HashSet::new();
        for key in 0..64 {
            seen.insert(pick_scored(&c, key, 1, 0.05, B, None).unwrap().primary);
        }
        assert!(seen.len() >= 6, "keys spread over equal replicas: {seen:?}");
    }

    #[test]
    fn bounded_load_spills_off_the_best_score() {
        let c = [
            cand(0, 3.0, false, 50_000),
            cand(1, 0.0, false, 0),
            cand(2, 0.0, false, 1000),
        ];
        let p = pick_scored(&c, 5, 1000, 0.05, B, None).unwrap();
        assert_ne!(p.primary, 0);
        assert!(p.spilled);
        // Under its own floor it admits whatever the average.
        let mut floored = c;
        floored[0].floor = 60_000;
        let p = pick_scored(&floored, 5, 1000, 0.05, B, None).unwrap();
        assert_eq!(p.primary, 0);
        assert!(!p.spilled);
    }

    /// A guarded first replica keeps the request when the spill would cost
    /// more than the ratio times its cost plus the margin; a cheap spill
    /// still happens, and a replica whose cost has no memory term is not
    /// guarded.
    #[test]
    fn a_guarded_spill_happens_only_when_it_is_cheap() {
        let g = Some(SpillGuard {
            ratio: 2.0,
            margin_s: 0.1,
        });
        // Over the bound at 2.3 s; the empty replicas cost 15.7 and 16 s.
        let c = [
            cand(0, -2.3, false, 300_000),
            cand(1, -15.7, false, 0),
            cand(2, -16.0, false, 0),
        ];
        let p = pick_scored(&c, 5, 1000, 0.002, B, g).unwrap();
        assert_eq!((p.primary, p.spilled), (0, false));
        assert_eq!(p.fallbacks, vec![1, 2], "the spill target comes next");
        assert!(pick_scored(&c, 5, 1000, 0.002, B, None).unwrap().spilled);
        let mut bare = c;
        bare[0].memory_costed = false;
        assert_eq!(pick_scored(&bare, 5, 1000, 0.002, B, g).unwrap().primary, 1);
        // At 4.6 s (2 x 2.3) the spill is within the ratio: it happens.
        let mut cheap = c;
        cheap[1].score = -4.6;
        let p = pick_scored(&cheap, 5, 1000, 0.002, B, g).unwrap();
        assert_eq!((p.primary, p.spilled), (1, true));
    }

    #[test]
    fn empty_candidates_give_none() {
        assert!(pick_scored(&[], 1, 1, 0.05, B, None).is_none());
    }

    /// The walk over the whole sorted order, as the pick was first written.
    fn pick_sorted(
        cands: &[Candidate],
        key: u64,
        cost: u64,
        quantum: f64,
        bounds: Bounds,
        guard: Option<SpillGuard>,
    ) -> Option<Pick> {
        let ord = order(cands, key, quantum);
        let first = *ord.first()?;
        let load = |k: usize| cands[k].load;
        let total = cands.iter().map(|c| c.load).fold(0u64, u64::saturating_add);
        let cap = bounds.cap(total, cost, cands.len());
        let admissible = |k: usize| (load(k) as f64) <= cap || load(k) <= cands[k].floor;
        let primary = ord
            .iter()
            .copied()
            .find(|&k| admissible(k))
            .map(|k| match guard {
                Some(g) if g.keeps(&cands[first], &cands[k]) => first,
                _ => k,
            })
            .or_else(|| ord.iter().copied().min_by_key(|&k| load(k)))
            .unwrap_or(first);
        let rest = ord.iter().copied().filter(|&k| k != primary);
        let fallbacks = rest
            .clone()
            .filter(|&k| admissible(k))
            .chain(rest.filter(|&k| !admissible(k)))
            .take(bounds.fallbacks)
            .map(|k| cands[k].index)
            .collect();
        Some(Pick {
            primary: cands[primary].index,
            fallbacks,
            spilled: primary != first,
        })
    }

    proptest! {
        /// Equal scores (one bucket), uneven loads, floors and fallback
        /// counts: the lazy walk picks exactly what the sorted walk does.
        #[test]
        fn the_lazy_walk_is_the_sorted_walk(
            cands in prop::collection::vec((0u8..6, 0u64..20_000, 0u64..8_000, any::<bool>()), 1..60),
            key in any::<u64>(),
            cost in 0u64..20_000,
            epsilon in 0.0f64..1.0,
            fallbacks in 0usize..6,
            guard in prop::option::of((1.0f64..3.0, 0.0f64..0.2)),
        ) {
            let c: Vec<Candidate> = cands
                .iter()
                .enumerate()
                .map(|(i, &(s, load, floor, memory_costed))| Candidate {
                    index: i * 2 + 1,
                    id: i as u64 * 7919 + 3,
                    score: -f64::from(s) * 0.05,
                    pressured: false,
                    load,
                    floor,
                    memory_costed,
                })
                .collect();
            let b = Bounds { epsilon, floor: 0, fallbacks };
            let g = guard.map(|(ratio, margin_s)| SpillGuard { ratio, margin_s });
            prop_assert_eq!(pick_scored(&c, key, cost, 0.05, b, g), pick_sorted(&c, key, cost, 0.05, b, g));
        }

        #[test]
        fn fallbacks_distinct_and_order_total(scores in prop::collection::vec((-5.0f64..5.0, any::<bool>(), 0u64..10_000), 1..40), key in any::<u64>()) {
            let c: Vec<Candidate> = scores.iter().enumerate().map(|(i, &(s, p, l))| cand(i * 3, s, p, l)).collect();
            let p = pick_scored(&c, key, 500, 0.05, Bounds { epsilon: 0.25, floor: 0, fallbacks: 4 }, None).unwrap();
            let mut all = p.fallbacks.clone();
            all.push(p.primary);
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            prop_assert_eq!(all.len(), n);
            prop_assert_eq!(p.fallbacks.len(), 4.min(c.len() - 1));
            // Deterministic.
            prop_assert_eq!(pick_scored(&c, key, 500, 0.05, Bounds { epsilon: 0.25, floor: 0, fallbacks: 4 }, None), Some(p));
        }
    }
}

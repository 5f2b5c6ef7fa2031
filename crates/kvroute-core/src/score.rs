//! Scoring candidates with fleet state, inside bounded load.
//!
//! With a fleet snapshot, each candidate replica (ready, not draining,
//! serving the request's model) gets
//!
//! ```text
//! score = w_prefix * hit - w_kv * kv - w_queue * min(queued / queueNorm, 1)
//! ```
//!
//! - `hit`: the fraction of the request's prefix blocks the gateway's prefix
//!   index says were sent to this replica ([`crate::index`]);
//! - `kv`: the replica's KV-cache utilisation from the snapshot;
//! - `queued`: queued tokens, the larger of the engine's view (waiting
//!   requests x `waitingRequestTokens`) and the gateway's own (prompt tokens
//!   it sent there that have not been answered yet). The gateway's figure
//!   moves with every dispatch, so a burst cannot pile onto the replica that
//!   looked idle in the last snapshot (the herding problem of stale data);
//!   the engine's figure covers what other gateways sent.
//!
//! A replica past a pressure threshold (`kv >= kvPressure` or `waiting >=
//! queuePressure`) loses its locality bonus (`hit` counts as 0), so its
//! conversations compete for a replica like new ones. Candidates are ordered
//! by score rounded to a multiple of `scoreQuantum` (so metric noise does
//! not reshuffle the order), then by the request's rendezvous rank (so equal
//! replicas split keys consistently, as in [`crate::picker`]).
//!
//! The KV weight defaults to 0. The snapshot's KV figure is up to a scrape
//! interval old and nothing corrects it between snapshots, so a KV term in
//! the order sends every new conversation to the replica that looked
//! emptiest until the next snapshot. In the `score_sweep` toy (8
//! replicas, the Mooncake trace at 12x), any KV weight from 0.25 up raised
//! TTFT p95 from about 6.6 s to about 42 s; on the realistic simulated
//! fleet (docs/fleet-state.md) a KV weight of 1 did not help either. Ordering pressured replicas
//! last, or penalising them, did the same to a lesser degree. The queue
//! term does not herd, because the gateway's own share of it moves with
//! every dispatch. KV still acts through the pressure threshold. The
//! bounded-load walk of [`crate::picker`] then runs over this order, on each
//! replica's load: the larger of the gateway's in-flight tokens and the
//! snapshot's KV tokens in use (`kv x kvCapacityTokens`, where reported).
//!
//! With the default weights (prefix 3, kv 0, queue 2), a full prefix hit
//! outweighs a full queue term. A conversation therefore stays on its
//! replica until that replica is pressured or over its bounded load, while
//! new conversations (hit 0 everywhere) go to the shortest queues.

use std::cmp::Ordering;

use crate::picker::{rank, Bounds, Pick};

/// One replica that may take the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Position in the routing universe (the snapshot's host list).
    pub index: usize,
    pub id: u64,
    pub score: f64,
    /// Past a pressure threshold (its locality bonus is already dropped
    /// from `score`); kept for explanations.
    pub pressured: bool,
    /// Tokens in flight or in use, for bounded load.
    pub load: u64,
}

fn bucket(score: f64, quantum: f64) -> f64 {
    if quantum > 0.0 {
        (score / quantum).round()
    } else {
        score
    }
}

/// Candidates' positions in preference order.
pub fn order(cands: &[Candidate], key: u64, quantum: f64) -> Vec<usize> {
    let mut keyed: Vec<(f64, u64, usize)> = cands
        .iter()
        .enumerate()
        .map(|(k, c)| (bucket(c.score, quantum), rank(key, c.id), k))
        .collect();
    keyed.sort_unstable_by(|a, b| {
        b.0.partial_cmp(&a.0)
            .unwrap_or(Ordering::Equal)
            .then_with(|| b.1.cmp(&a.1))
            .then_with(|| a.2.cmp(&b.2))
    });
    keyed.into_iter().map(|(_, _, k)| k).collect()
}

/// Bounded-load pick over scored candidates. Indices in the result are the
/// candidates' `index` fields; `spilled` means the first in order was not
/// admissible.
pub fn pick_scored(
    cands: &[Candidate],
    key: u64,
    cost: u64,
    quantum: f64,
    bounds: Bounds,
) -> Option<Pick> {
    let ord = order(cands, key, quantum);
    let first = *ord.first()?;
    let load = |k: usize| cands.get(k).map_or(0, |c| c.load);
    let total = cands.iter().map(|c| c.load).fold(0u64, u64::saturating_add);
    let cap = bounds.cap(total, cost, cands.len());
    // The admission test of picker::pick (the request's own cost only in
    // the average; see there why). The least-loaded fallback only covers
    // float rounding.
    let admissible = |k: usize| (load(k) as f64) <= cap;
    let primary = ord
        .iter()
        .copied()
        .find(|&k| admissible(k))
        .or_else(|| ord.iter().copied().min_by_key(|&k| load(k)))
        .unwrap_or(first);
    let rest = ord.iter().copied().filter(|&k| k != primary);
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
        let p = pick_scored(&c, 1, 10, 0.05, B).unwrap();
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
            seen.insert(pick_scored(&c, key, 1, 0.05, B).unwrap().primary);
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
        let p = pick_scored(&c, 5, 1000, 0.05, B).unwrap();
        assert_ne!(p.primary, 0);
        assert!(p.spilled);
    }

    #[test]
    fn empty_candidates_give_none() {
        assert!(pick_scored(&[], 1, 1, 0.05, B).is_none());
    }

    proptest! {
        #[test]
        fn fallbacks_distinct_and_order_total(scores in prop::collection::vec((-5.0f64..5.0, any::<bool>(), 0u64..10_000), 1..40), key in any::<u64>()) {
            let c: Vec<Candidate> = scores.iter().enumerate().map(|(i, &(s, p, l))| cand(i * 3, s, p, l)).collect();
            let p = pick_scored(&c, key, 500, 0.05, Bounds { epsilon: 0.25, floor: 0, fallbacks: 4 }).unwrap();
            let mut all = p.fallbacks.clone();
            all.push(p.primary);
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            prop_assert_eq!(all.len(), n);
            prop_assert_eq!(p.fallbacks.len(), 4.min(c.len() - 1));
            // Deterministic.
            prop_assert_eq!(pick_scored(&c, key, 500, 0.05, Bounds { epsilon: 0.25, floor: 0, fallbacks: 4 }), Some(p));
        }
    }
}

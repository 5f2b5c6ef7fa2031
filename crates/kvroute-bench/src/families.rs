//! The workload suite: named families of generated workloads, each sized
//! for a fleet of `replicas` engines.
//!
//! Every family is a seeded generator with the parameters below. Arrival
//! rates and tenant counts grow with `replicas`, so one family loads 4 or
//! 1,024 engines alike (the same load per replica). The rates were chosen
//! on the simulated engine (Llama-3.1-8B on one H100, 400k tokens of KV,
//! see `docs/simulator.md`) so that round robin runs loaded but not
//! collapsed at 16 replicas (`docs/simulation.md` has the figures).
//!
//! | family | what | per replica |
//! |---|---|---|
//! | `chat` | multi-turn chat with long answers: 10-16 turns, answers 300-1000 tokens, user turns ~150 tokens, think ~4 s, 8 shared 2k-token system prompts; KV memory binds | 0.3 new sessions/s |
//! | `groups` | shared-prefix groups: 4 groups of 6k-token documents, 8 users each, short questions and answers | 6 requests/s |
//! | `mix` | the heterogeneous mix: 200-in/50-out requests (90 %) and 30,000-in/2,000-out requests (10 %), interleaved, no shared prefix | 1.5 requests/s |
//! | `agent` | agent loops: one context starting at 46k-70k tokens, each turn adding a 1k-4k token tool result and a ~80-token answer, turns ~1 s apart, until 120k tokens | 0.015 new loops/s |
//! | `bursts` | chat sessions of 1-7 turns (answers 100-400 tokens, 8 shared 1k-token system prompts) arriving on/off: 30 s at 3x the mean rate, then 60 s of nothing | 2 new sessions/s on average |
//! | `ramp` | the same sessions, the rate ramping linearly from 0.25x to 1.75x the mean over the run | 2 new sessions/s on average |
//! | `tenants` | many tenants: 200 distinct system prompts per replica (~2k tokens), Zipf popularity (s = 1), 1-3 turns of short questions | 4 new sessions/s |
//! | `documents` | long-context conversations: a 1k-token system prompt (4 shared), then a document of its own (lognormal, median 10k tokens, 2k-32k) with the first question, 3-8 follow-ups of ~200 tokens, answers ~350 tokens (lognormal), think ~8 s; contexts of 10k-40k tokens, so KV memory binds | 0.2 new sessions/s |
//!
//! Plus any Mooncake-format trace ([`crate::workload::from_mooncake`]).

use crate::rng::Rng;
use crate::workload::{Session, Text, Turn, Workload, BYTES_PER_TOKEN};

/// The generated families, in report order.
pub const FAMILIES: &[&str] = &[
    "chat",
    "groups",
    "mix",
    "agent",
    "bursts",
    "ramp",
    "tenants",
    "documents",
];

/// How to generate a family.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyOptions {
    /// The fleet the load is sized for.
    pub replicas: usize,
    /// Arrivals stop after this many modelled seconds.
    pub duration_s: f64,
    /// Multiplies every arrival rate (1: the family's calibrated load).
    pub load: f64,
    pub seed: u64,
}

/// Zipf over `0..n` with exponent `s`, by a cumulative table.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let mut cdf = Vec::with_capacity(n.max(1));
        for i in 1..=n.max(1) {
            total += (i as f64).powf(-s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        Self { cdf }
    }

    fn draw(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf
            .partition_point(|&c| c < u)
            .min(self.cdf.len().saturating_sub(1))
    }
}

fn words(key: u64, tokens: usize) -> Text {
    Text::Words {
        key,
        bytes: tokens.max(1) * BYTES_PER_TOKEN,
    }
}

fn clamp(x: f64, lo: usize, hi: usize) -> usize {
    (x.round().max(0.0) as usize).clamp(lo, hi)
}

/// Arrival times (ms) of a Poisson process of `rate` per second, shaped by
/// `factor(t_s)` (the instantaneous rate multiplier, at most `peak`), by
/// thinning.
fn arrivals(
    rng: &mut Rng,
    rate: f64,
    duration_s: f64,
    peak: f64,
    factor: impl Fn(f64) -> f64,
) -> Vec<f64> {
    let mut out = Vec::new();
    if !(rate > 0.0 && peak > 0.0) {
        return out;
    }
    let mut t = 0.0;
    loop {
        t += rng.exp(1.0 / (rate * peak));
        if t >= duration_s {
            return out;
        }
        if rng.unit() * peak < factor(t) {
            out.push(t * 1000.0);
        }
    }
}

/// Generates family `name`.
pub fn generate(name: &str, o: &FamilyOptions) -> Result<Workload, String> {
    if !(o.duration_s > 0.0 && o.load > 0.0 && o.replicas > 0) {
        return Err(format!(
            "family {name}: replicas {}, duration {} s and load {} must be positive",
            o.replicas, o.duration_s, o.load
        ));
    }
    let r = o.replicas as f64;
    let mut rng = Rng::new(o.seed ^ xxhash_rust::xxh64::xxh64(name.as_bytes(), 0));
    let flat = |_: f64| 1.0;
    let sessions = match name {
        "chat" => {
            let starts = arrivals(&mut rng, 0.3 * r * o.load, o.duration_s, 1.0, flat);
            chat_sessions(
                &mut rng,
                &starts,
                8,
                2048,
                (10, 16),
                150.0,
                (300, 1000),
                4.0,
                "chat",
            )
        }
        "groups" => {
            let groups = (4.0 * r).ceil() as usize;
            let starts = arrivals(&mut rng, 6.0 * r * o.load, o.duration_s, 1.0, flat);
            starts
                .into_iter()
                .map(|t| {
                    let g = rng.below(groups as u64);
                    let u = rng.below(8);
                    Session {
                        start_ms: t,
                        key: Some(format!("group-{g}-user-{u}")),
                        objective: None,
                        system: Some(words(0x4752_5000_0000_0000 | g, 6144)),
                        turns: vec![Turn {
                            user: words(rng.next_u64(), clamp(rng.lognormal(64.0, 0.5), 8, 1024)),
                            max_tokens: clamp(rng.lognormal(128.0, 0.5), 8, 1024) as u32,
                            think_ms: 0.0,
                        }],
                    }
                })
                .collect()
        }
        "mix" => {
            let starts = arrivals(&mut rng, 1.5 * r * o.load, o.duration_s, 1.0, flat);
            starts
                .into_iter()
                .map(|t| {
                    let long = rng.unit() < 0.1;
                    let (input, output) = if long {
                        (30_000.0, 2000.0)
                    } else {
                        (200.0, 50.0)
                    };
                    Session {
                        start_ms: t,
                        key: None,
                        objective: None,
                        system: None,
                        turns: vec![Turn {
                            user: words(
                                rng.next_u64(),
                                clamp(rng.lognormal(input, 0.2), 16, 60_000),
                            ),
                            max_tokens: clamp(rng.lognormal(output, 0.2), 8, 4000) as u32,
                            think_ms: 0.0,
                        }],
                    }
                })
                .collect()
        }
        "agent" => {
            let starts = arrivals(&mut rng, 0.015 * r * o.load, o.duration_s, 1.0, flat);
            let tools = Zipf::new((2.0 * r).ceil() as usize, 1.0);
            starts
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let tool = tools.draw(&mut rng) as u64;
                    let system = 4096;
                    let first = 46_000 + rng.below(24_000) as usize - system;
                    let mut total = system + first;
                    let mut turns = Vec::new();
                    let mut user = first;
                    while turns.len() < 40 {
                        let out = clamp(rng.lognormal(80.0, 0.6), 8, 400).min(120_000 - total);
                        turns.push(Turn {
                            user: words(rng.next_u64(), user),
                            max_tokens: out as u32,
                            think_ms: if turns.is_empty() {
                                0.0
                            } else {
                                rng.exp(1000.0)
                            },
                        });
                        total += out;
                        user = 1000 + rng.below(3000) as usize;
                        if total + user > 120_000 {
                            break;
                        }
                        total += user;
                    }
                    Session {
                        start_ms: t,
                        key: Some(format!("agent-{i}")),
                        objective: None,
                        system: Some(words(0x544f_4f4c_0000_0000 | tool, system)),
                        turns,
                    }
                })
                .collect()
        }
        "bursts" => {
            // 30 s on at 3x, 60 s off: the mean rate is the family's rate.
            let starts = arrivals(&mut rng, 2.0 * r * o.load, o.duration_s, 3.0, |t| {
                if t % 90.0 < 30.0 {
                    3.0
                } else {
                    0.0
                }
            });
            chat_sessions(
                &mut rng,
                &starts,
                8,
                1024,
                (1, 7),
                150.0,
                (100, 400),
                3.0,
                "burst",
            )
        }
        "ramp" => {
            let d = o.duration_s;
            let starts = arrivals(&mut rng, 2.0 * r * o.load, d, 1.75, |t| 0.25 + 1.5 * t / d);
            chat_sessions(
                &mut rng,
                &starts,
                8,
                1024,
                (1, 7),
                150.0,
                (100, 400),
                3.0,
                "ramp",
            )
        }
        "tenants" => {
            let n = (200.0 * r).ceil() as usize;
            let popularity = Zipf::new(n, 1.0);
            let starts = arrivals(&mut rng, 4.0 * r * o.load, o.duration_s, 1.0, flat);
            starts
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let tenant = popularity.draw(&mut rng) as u64;
                    // Each tenant's prompt has its own length, a function of the tenant.
                    let mut tr = Rng::new(tenant ^ o.seed);
                    let system = clamp(tr.lognormal(2000.0, 0.4), 256, 8192);
                    let turns = 1 + rng.below(3) as usize;
                    Session {
                        start_ms: t,
                        key: Some(format!("tenant-{tenant}-session-{i}")),
                        objective: None,
                        system: Some(words(0x5445_4e00_0000_0000 | tenant, system)),
                        turns: (0..turns)
                            .map(|k| Turn {
                                user: words(
                                    rng.next_u64(),
                                    clamp(rng.lognormal(150.0, 0.6), 8, 2048),
                                ),
                                max_tokens: clamp(rng.lognormal(150.0, 0.5), 8, 1024) as u32,
                                think_ms: if k == 0 { 0.0 } else { rng.exp(5000.0) },
                            })
                            .collect(),
                    }
                })
                .collect()
        }
        "documents" => {
            let starts = arrivals(&mut rng, 0.2 * r * o.load, o.duration_s, 1.0, flat);
            let systems = Zipf::new(4, 1.1);
            starts
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let sys = systems.draw(&mut rng) as u64;
                    let document = clamp(rng.lognormal(10_000.0, 0.5), 2048, 32_768);
                    let n = 4 + rng.below(6) as usize;
                    Session {
                        start_ms: t,
                        key: Some(format!("documents-{i}")),
                        objective: None,
                        system: Some(words(0x444f_4353_0000_0000 | sys, 1024)),
                        turns: (0..n)
                            .map(|k| {
                                let asked = clamp(rng.lognormal(200.0, 0.6), 8, 2048);
                                Turn {
                                    user: words(
                                        rng.next_u64(),
                                        if k == 0 { document + asked } else { asked },
                                    ),
                                    max_tokens: clamp(rng.lognormal(350.0, 0.5), 16, 2048) as u32,
                                    think_ms: if k == 0 { 0.0 } else { rng.exp(8000.0) },
                                }
                            })
                            .collect(),
                    }
                })
                .collect()
        }
        other => {
            return Err(format!(
                "unknown family {other:?}; known: {}",
                FAMILIES.join(", ")
            ))
        }
    };
    let summary = format!(
        "family {name} sized for {} replicas, {} s of arrivals at {}x its calibrated load, seed {}",
        o.replicas, o.duration_s, o.load, o.seed
    );
    Ok(Workload::new(name, summary, sessions))
}

/// Multi-turn chat sessions starting at `starts` (ms): `systems` shared
/// system prompts of `system_tokens` (Zipf s = 1.1), turns uniform in
/// `turns`, user messages log-normal around `user_tokens`, answers uniform
/// in `answer`, think time exponential with mean `think_s`.
#[allow(clippy::too_many_arguments)]
fn chat_sessions(
    rng: &mut Rng,
    starts: &[f64],
    systems: usize,
    system_tokens: usize,
    turns: (usize, usize),
    user_tokens: f64,
    answer: (usize, usize),
    think_s: f64,
    tag: &str,
) -> Vec<Session> {
    let popularity = Zipf::new(systems, 1.1);
    starts
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let sys = popularity.draw(rng) as u64;
            let n = turns.0 + rng.below((turns.1 - turns.0 + 1) as u64) as usize;
            Session {
                start_ms: t,
                key: Some(format!("{tag}-{i}")),
                objective: None,
                system: Some(words(0x5359_5354_0000_0000 | sys, system_tokens)),
                turns: (0..n)
                    .map(|k| Turn {
                        user: words(
                            rng.next_u64(),
                            clamp(rng.lognormal(user_tokens, 0.7), 8, 4096),
                        ),
                        max_tokens: (answer.0
                            + rng.below((answer.1 - answer.0 + 1) as u64) as usize)
                            as u32,
                        think_ms: if k == 0 {
                            0.0
                        } else {
                            rng.exp(think_s * 1000.0)
                        },
                    })
                    .collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(replicas: usize) -> FamilyOptions {
        FamilyOptions {
            replicas,
            duration_s: 300.0,
            load: 1.0,
            seed: 7,
        }
    }

    #[test]
    fn every_family_is_seeded_and_scales_with_the_fleet() {
        for f in FAMILIES {
            let a = generate(f, &opts(4)).unwrap();
            let b = generate(f, &opts(4)).unwrap();
            assert_eq!(a.sessions, b.sessions, "{f}: same seed, same workload");
            assert!(a.requests() > 0, "{f}");
            let big = generate(f, &opts(16)).unwrap();
            let ratio = big.requests() as f64 / a.requests() as f64;
            assert!(
                (2.5..6.0).contains(&ratio),
                "{f}: 4x the replicas gave {ratio}x the requests"
            );
            assert!(a
                .sessions
                .windows(2)
                .all(|w| w[0].start_ms <= w[1].start_ms));
            assert!(a.sessions.iter().all(|s| s.start_ms < 300_000.0));
        }
        assert!(generate("nope", &opts(4)).is_err());
        assert!(generate(
            "chat",
            &FamilyOptions {
                load: 0.0,
                ..opts(4)
            }
        )
        .is_err());
    }

    #[test]
    fn families_have_their_shapes() {
        let chat = generate("chat", &opts(8)).unwrap();
        assert!(chat
            .sessions
            .iter()
            .all(|s| (10..=16).contains(&s.turns.len())));
        assert!(chat
            .sessions
            .iter()
            .flat_map(|s| &s.turns)
            .all(|t| (300..=1000).contains(&t.max_tokens)));
        let agent = generate("agent", &opts(16)).unwrap();
        for s in &agent.sessions {
            let total: usize = s.system.as_ref().map_or(0, Text::len) / 4
                + s.turns
                    .iter()
                    .map(|t| t.user.len() / 4 + t.max_tokens as usize)
                    .sum::<usize>();
            assert!((46_000..=120_000).contains(&total), "agent context {total}");
        }
        let mix = generate("mix", &opts(16)).unwrap();
        let long = mix
            .sessions
            .iter()
            .filter(|s| s.turns[0].max_tokens > 1000)
            .count();
        let share = long as f64 / mix.sessions.len() as f64;
        assert!((0.05..0.15).contains(&share), "long share {share}");
        // Bursts: nothing starts in the off part of a cycle.
        let bursts = generate("bursts", &opts(16)).unwrap();
        assert!(bursts
            .sessions
            .iter()
            .all(|s| (s.start_ms / 1000.0) % 90.0 < 30.0));
        // Ramp: more arrivals in the second half.
        let ramp = generate("ramp", &opts(16)).unwrap();
        let late = ramp
            .sessions
            .iter()
            .filter(|s| s.start_ms > 150_000.0)
            .count();
        assert!(late * 2 > ramp.sessions.len());
        let tenants = generate("tenants", &opts(16)).unwrap();
        let distinct: std::collections::HashSet<_> = tenants
            .sessions
            .iter()
            .map(|s| format!("{:?}", s.system))
            .collect();
        assert!(distinct.len() > 300, "{} tenants seen", distinct.len());
        // Documents: each session's first turn carries its own document.
        let documents = generate("documents", &opts(16)).unwrap();
        for s in &documents.sessions {
            assert!((4..=9).contains(&s.turns.len()));
            let first = s.turns[0].user.len() / 4;
            assert!((2048..=32_768 + 2048).contains(&first), "document {first}");
            assert!(s.turns[1..].iter().all(|t| t.user.len() / 4 <= 2048));
        }
        let firsts: std::collections::HashSet<_> = documents
            .sessions
            .iter()
            .map(|s| format!("{:?}", s.turns[0].user))
            .collect();
        assert_eq!(firsts.len(), documents.sessions.len(), "one document each");
    }
}

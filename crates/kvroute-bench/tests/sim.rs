//! The fleet simulation: deterministic, complete, and measuring what it
//! says (small fleets, a few modelled seconds, so it runs in debug builds).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use kvroute_bench::families::{self, FamilyOptions};
use kvroute_bench::report::{self, Report};
use kvroute_bench::sim::{self, routers, Collectors, Options, Spread};
use kvroute_bench::summary::RunSummary;
use kvroute_bench::workload::Workload;
use kvroute_sim::engine::EngineConfig;

fn options(engines: usize, gateways: usize) -> Options {
    Options {
        engines,
        gateways,
        spread: Spread::Request,
        collectors: Collectors::Shared,
        engine: EngineConfig::default(),
        model: "m".to_owned(),
        seed: 3,
        session_header: true,
        flat_prompt: false,
        sample_s: 0.5,
        progress: false,
        records: false,
        single_steps: false,
        a100_engines: 0,
    }
}

/// The chat family sized for 4 replicas, 20 s of arrivals, seed 3.
fn chat_on_4() -> Workload {
    families::generate(
        "chat",
        &FamilyOptions {
            replicas: 4,
            duration_s: 20.0,
            load: 1.0,
            seed: 3,
        },
    )
    .unwrap()
}

fn run(family: &str, router: &str, o: &Options, duration_s: f64) -> RunSummary {
    let wl = families::generate(
        family,
        &FamilyOptions {
            replicas: o.engines,
            duration_s,
            load: 1.0,
            seed: o.seed,
        },
    )
    .unwrap();
    let mut r =
        routers::build(router, &routers::Setup::new(o.engines, o.gateways, o.seed)).unwrap();
    sim::run(&wl, r.as_mut(), o).summary
}

/// A fleet of two GPU generations: the engines named A100 prefill slower,
/// and round robin, which ignores it, waits longer than on H100s alone.
#[test]
fn a100_engines_prefill_slower() {
    let wl = families::generate(
        "documents",
        &FamilyOptions {
            replicas: 4,
            duration_s: 20.0,
            load: 0.5,
            seed: 3,
        },
    )
    .unwrap();
    let go = |a100_engines: usize| {
        let o = Options {
            records: true,
            a100_engines,
            ..options(4, 1)
        };
        let mut r = routers::build("round-robin", &routers::Setup::new(4, 1, 3)).unwrap();
        sim::run(&wl, r.as_mut(), &o)
    };
    let (h100, mixed) = (go(0), go(2));
    // Prefill milliseconds per computed token, on the first two engines and
    // on the last two (the A100s in the mixed run).
    let per_token = |out: &sim::Outcome, engines: std::ops::Range<usize>| {
        let (ms, tokens) = out
            .records
            .iter()
            .filter(|l| engines.contains(&l.engine))
            .fold((0.0, 0u64), |(ms, t), l| {
                (ms + l.prefill_ms, t + l.prompt_tokens - l.cached_tokens)
            });
        assert!(tokens > 0, "engines {engines:?} computed no prompt");
        ms / tokens as f64
    };
    let fast = per_token(&mixed, 0..2);
    let slow = per_token(&mixed, 2..4);
    assert!(slow > 2.0 * fast, "A100 {slow} ms/token, H100 {fast}");
    // The H100s of the mixed fleet run as the all-H100 fleet's do.
    let all = per_token(&h100, 0..4);
    assert!(fast < 1.5 * all && all < 1.5 * fast, "{fast} against {all}");
    assert!(mixed.summary.ttft_ms.p95 > h100.summary.ttft_ms.p95);
    assert_eq!(mixed.summary.requests, h100.summary.requests);
}

/// kvroute learns from its answers which engines prefill slower
/// (kvroute_core::rates) and gives them less of the prompt work; with
/// `learnPrefillRates` off it takes no sample and prices them as the
/// others.
#[test]
fn kvroute_learns_which_replicas_prefill_slower() {
    let wl = families::generate(
        "tenants",
        &FamilyOptions {
            replicas: 4,
            duration_s: 60.0,
            load: 0.5,
            seed: 3,
        },
    )
    .unwrap();
    let o = Options {
        records: true,
        a100_engines: 2,
        ..options(4, 1)
    };
    let go = |learn: bool| {
        let setup = routers::Setup {
            kvroute_config: serde_json::json!({"fleet": {"learnPrefillRates": learn}}),
            ..routers::Setup::new(4, 1, 3)
        };
        let mut r = routers::build("kvroute", &setup).unwrap();
        sim::run(&wl, r.as_mut(), &o)
    };
    let (on, off) = (go(true), go(false));
    let samples = |out: &sim::Outcome| {
        sim::timing(out)
            .counters
            .get("kvroute_prefill_rate_samples_total")
            .copied()
            .unwrap_or(0)
    };
    assert!(samples(&on) >= 20, "{} samples", samples(&on));
    assert_eq!(samples(&off), 0);
    // The share of the computed prompt tokens the A100s (engines 2 and 3)
    // prefilled.
    let slow_share = |out: &sim::Outcome| {
        let (slow, all) = out.records.iter().fold((0u64, 0u64), |(s, a), l| {
            let t = l.prompt_tokens - l.cached_tokens;
            (s + if l.engine >= 2 { t } else { 0 }, a + t)
        });
        slow as f64 / all.max(1) as f64
    };
    let (learned, priced_alike) = (slow_share(&on), slow_share(&off));
    println!("A100s' share of the prefill: {priced_alike:.3} priced alike, {learned:.3} learned; {} samples", samples(&on));
    assert!(
        learned < 0.8 * priced_alike,
        "{learned} against {priced_alike}"
    );
    assert_eq!(on.summary.requests, off.summary.requests);
    assert_eq!(on.summary.errors, 0);
}

#[test]
fn same_seed_same_report_bytes() {
    let o = options(4, 2);
    let report = || {
        let runs = routers::ALL
            .iter()
            .map(|name| run("chat", name, &o, 20.0))
            .collect();
        serde_json::to_vec(&Report {
            setup: vec![],
            runs,
        })
        .unwrap()
    };
    let (a, b) = (report(), report());
    assert!(a == b, "two runs with the same seed differ");
    // And another seed gives another run (the check can fail).
    let other = run(
        "chat",
        "round-robin",
        &Options {
            seed: 4,
            ..o.clone()
        },
        20.0,
    );
    let first: Report = serde_json::from_slice(&a).unwrap();
    assert_ne!(
        first.runs[0].ttft_quantiles_ms, other.ttft_quantiles_ms,
        "seed 4 gave the same TTFTs as seed 3"
    );
}

#[test]
fn every_router_completes_every_request_and_the_figures_hold() {
    let o = options(4, 2);
    let runs: Vec<RunSummary> = routers::ALL
        .iter()
        .map(|name| run("groups", name, &o, 15.0))
        .collect();
    let r = Report {
        setup: vec![],
        runs,
    };
    let bad = report::check_runs(&r);
    assert!(bad.is_empty(), "{bad:?}");
    let by = |n: &str| r.runs.iter().find(|x| x.router.starts_with(n)).unwrap();
    for run in &r.runs {
        assert!(
            run.requests > 50,
            "{}: {} requests",
            run.router,
            run.requests
        );
        assert_eq!(run.gateways, 2);
        assert_eq!(run.per_gateway_requests.iter().sum::<u64>(), run.completed);
        assert!(run.per_gateway_requests.iter().all(|&n| n > 0));
        // The floor is a floor.
        assert!(
            run.ttft_floor_ms.p50 <= run.ttft_ms.p50 + 1e-9,
            "{}",
            run.router
        );
        if run.router != "kvroute" {
            assert!(run.router.ends_with("(modelled)"), "{}", run.router);
        }
    }
    // Shared-prefix groups: the cache-aware routers find the prefix that
    // round robin scatters.
    let rr = by("round-robin").hit_rate;
    for n in ["kvroute", "sglang", "llm-d", "dynamo"] {
        assert!(
            by(n).hit_rate > rr,
            "{n}: {} vs round robin {rr}",
            by(n).hit_rate
        );
    }
}

/// `simulate --records`: one line per answered request, agreeing with the
/// run's summary (count, hit rate, conversation split); kvroute's lines
/// carry its reason and expected hit (adding up to its counter), a peer's
/// neither; without the option, no lines.
#[test]
fn the_records_agree_with_the_summary() {
    let wl = chat_on_4();
    let run = |router: &str, records: bool| {
        let o = Options {
            records,
            ..options(4, 2)
        };
        let mut r = routers::build(router, &routers::Setup::new(4, 2, 3)).unwrap();
        sim::run(&wl, r.as_mut(), &o)
    };
    for router in ["kvroute", "round-robin"] {
        let out = run(router, true);
        let (s, lines) = (&out.summary, &out.records);
        assert_eq!(lines.len() as u64, s.requests, "{router}");
        let prompt: u64 = lines.iter().map(|l| l.prompt_tokens).sum();
        let cached: u64 = lines.iter().map(|l| l.cached_tokens).sum();
        let hit = cached as f64 / prompt as f64;
        assert!(
            (hit - s.hit_rate).abs() < 1e-9,
            "{router}: {hit} vs {}",
            s.hit_rate
        );
        // Share of requests on their conversation's most used engine.
        let mut per: std::collections::HashMap<(usize, usize), u64> = Default::default();
        for l in lines {
            *per.entry((l.session, l.engine)).or_default() += 1;
            assert!(l.engine < 4 && l.gateway < 2, "{l:?}");
            assert!(l.ttft_ms >= l.queue_ms, "{l:?}");
            assert_eq!(l.reason.is_some(), router == "kvroute", "{l:?}");
        }
        let mut top: std::collections::HashMap<usize, u64> = Default::default();
        for (&(session, _), &n) in &per {
            let t = top.entry(session).or_default();
            *t = (*t).max(n);
        }
        let split = top.values().sum::<u64>() as f64 / lines.len() as f64;
        assert!((split - s.conversation_split).abs() < 1e-9, "{router}");
        // Every turn of a session once.
        let mut turns: Vec<(usize, usize)> = lines.iter().map(|l| (l.session, l.turn)).collect();
        turns.sort_unstable();
        turns.dedup();
        assert_eq!(turns.len(), lines.len(), "{router}");
        // kvroute's expected hits add up to its answers' counter (the
        // same engine tokens); a peer's lines have none.
        let expected: u64 = lines.iter().filter_map(|l| l.expected_cached_tokens).sum();
        let counted = out
            .counters
            .get("kvroute_prefix_expected_tokens_total")
            .copied()
            .unwrap_or(0);
        assert_eq!(expected, counted, "{router}");
        assert_eq!(expected > 0, router == "kvroute", "{router}");
    }
    assert!(run("kvroute", false).records.is_empty());
}

#[test]
fn kvroute_reads_the_fleet_snapshot_the_collector_pushes() {
    // With the modelled collector pushing every 250 ms, kvroute decides on
    // fleet state: only the decisions before the first push (and none
    // after) are degraded. With one push only, at the start, the snapshot
    // goes stale after staleAfterMs (2 s) and the decisions after that are.
    let o = options(4, 2);
    let wl = chat_on_4();
    let run = |collector_s: f64| {
        let setup = routers::Setup {
            collector_s,
            ..routers::Setup::new(4, 2, 3)
        };
        let mut r = routers::build("kvroute", &setup).unwrap();
        sim::run(&wl, r.as_mut(), &o)
    };
    let count = |o: &sim::Outcome, name: &str| o.counters.get(name).copied().unwrap_or(0);
    let live = run(0.25);
    let decisions = live.summary.requests;
    assert!(decisions > 100);
    // Every request is parsed and keyed: by its session, or by a rare
    // system prompt its sessions share (prefixAffinityShare), or spilled.
    assert_eq!(
        count(&live, "kvroute_decisions_session_total")
            + count(&live, "kvroute_decisions_prefix_total")
            + count(&live, "kvroute_decisions_spill_total"),
        decisions,
        "{:?}",
        live.counters
    );
    assert!(
        count(&live, "kvroute_decisions_degraded_total") * 20 < decisions,
        "{:?}",
        live.counters
    );
    let stale = run(1e6);
    assert!(
        count(&stale, "kvroute_decisions_degraded_total") * 2 > decisions,
        "{:?}",
        stale.counters
    );
    assert_eq!(live.decision_ns.len() as u64, decisions);
}

#[test]
fn admission_sheds_the_sheddable_and_protects_the_rest_under_overload() {
    // The overload experiment, small: the mix family at 2.5x its load on 4
    // engines for 40 modelled seconds, half the sessions sheddable.
    let o = kvroute_bench::overload::Options {
        family: "mix".to_owned(),
        replicas: 4,
        duration_s: 40.0,
        load: 2.5,
        sheddable: 0.5,
        seed: 3,
        kvroute_config: serde_json::json!({}),
        engine: EngineConfig::default(),
        progress: false,
    };
    let r = kvroute_bench::overload::run(&o).unwrap();
    assert_eq!(r.runs.len(), 3);
    let class = |run: usize, name: &str| {
        r.runs[run]
            .classes
            .iter()
            .find(|c| c.objective == name)
            .cloned()
            .unwrap()
    };
    // Nothing is lost: every request completed, was shed, or failed.
    for (i, run) in r.runs.iter().enumerate() {
        let total: u64 = run.classes.iter().map(|c| c.requests).sum();
        let accounted: u64 = run
            .classes
            .iter()
            .map(|c| c.completed + c.shed + c.failed)
            .sum();
        assert_eq!(total, accounted, "run {i}: {run:?}");
        assert_eq!(total as usize, r.requests, "run {i}");
    }
    // Without admission nobody is shed; with it the sheddable class is,
    // and the counters say so by objective.
    for name in [
        kvroute_bench::overload::BATCH,
        kvroute_bench::overload::INTERACTIVE,
    ] {
        assert_eq!(class(0, name).shed, 0);
        assert_eq!(class(1, name).shed, 0);
    }
    let batch = class(2, kvroute_bench::overload::BATCH);
    assert!(batch.shed > 0, "{batch:?}");
    let shed_counter = r.runs[2]
        .counters
        .get("kvroute_admission_shed_total{objective=batch}")
        .copied()
        .unwrap_or(0);
    assert_eq!(shed_counter, batch.shed, "{:?}", r.runs[2].counters);
    assert!(r.runs[1].counters.is_empty(), "{:?}", r.runs[1].counters);
    // The protected class waits less at the tail (modelled time, a
    // deterministic run).
    assert!(
        class(2, kvroute_bench::overload::INTERACTIVE).ttft_p95_ms
            < class(1, kvroute_bench::overload::INTERACTIVE).ttft_p95_ms,
        "{r:?}"
    );
}

/// The oracles that share one load table or one prefix index between
/// gateways, and kvroute whose gateways read no other gateway, are
/// kvroute itself at one gateway; at several they see the other gateways'
/// dispatches otherwise (exactly, or not at all), so they decide
/// otherwise on a loaded fleet (the index on a family whose prompts are
/// reused: the mix's are not).
#[test]
fn the_gateway_layouts_are_kvroute_at_one_gateway() {
    for (name, family) in [
        (routers::ORACLE_SHARED_LOAD, "mix"),
        (routers::ORACLE_SHARED_INDEX, "chat"),
        (routers::ALONE, "mix"),
    ] {
        gateways_share_load(name, family);
    }
}

fn gateways_share_load(name: &str, family: &str) {
    let one = options(4, 1);
    let (k, o) = (
        run(family, "kvroute", &one, 30.0),
        run(family, name, &one, 30.0),
    );
    assert_eq!(o.router, name);
    assert_eq!(k.ttft_ms, o.ttft_ms, "one gateway: the same decisions");
    assert_eq!(k.per_engine_requests, o.per_engine_requests);
    let four = options(4, 4);
    let (k, o) = (
        run(family, "kvroute", &four, 30.0),
        run(family, name, &four, 30.0),
    );
    assert_eq!(k.requests, o.requests);
    assert_ne!(
        k.per_engine_requests, o.per_engine_requests,
        "four gateways: {name} changes the placement"
    );
    assert!(!routers::ALL.contains(&name), "not in the default list");
}

/// The oracle of the present sends a request where its first token comes
/// soonest, by stepping copies of the engines: to the engine that holds
/// its prompt when both are idle, away from it behind a long queue, and
/// by what the engines hold, not by their position.
#[test]
fn the_first_token_oracle_weighs_a_cached_prompt_against_a_queue() {
    use kvroute_sim::engine::sched::{NewRequest, Scheduler};
    let text = |seed: usize, tokens: usize| {
        let words: String = (0..tokens)
            .map(|i| format!("w{:03} ", (i * 7 + seed) % 997))
            .collect();
        kvroute_sim::engine::chat_prompt(&[("user", words)])
    };
    let new = |prompt: &[u8]| NewRequest {
        model: "m".to_owned(),
        prompt: prompt.to_vec(),
        max_tokens: 4,
    };
    let prompt = text(0, 4000);
    let mut warm = Scheduler::new(EngineConfig::default(), 3);
    warm.submit(new(&prompt), 0.0).unwrap();
    let mut now = 0.0;
    while let Some(out) = warm.step(now) {
        now = out.end();
    }
    let cold = Scheduler::new(EngineConfig::default(), 3);
    let mut oracle =
        routers::build(routers::ORACLE_FIRST_TOKEN, &routers::Setup::new(2, 1, 3)).unwrap();
    assert!(oracle.reads_engines());
    let req = routers::Request {
        body: b"{}",
        session: None,
        messages: &[],
        prompt: &prompt,
        model: "m",
        prompt_tokens: prompt.len().div_ceil(4),
        max_tokens: 4,
        objective: None,
    };
    let mut pick = |engines: &[&Scheduler]| {
        oracle.engines_free_at(&[now, now]);
        oracle.route(0, &req, now, engines).unwrap().engine
    };
    assert_eq!(pick(&[&warm, &cold]), 0, "idle: the cached prompt wins");
    assert_eq!(pick(&[&cold, &warm]), 1, "by content, not position");
    for seed in 1..=8 {
        warm.submit(new(&text(seed, 8000)), now).unwrap();
    }
    assert_eq!(
        pick(&[&warm, &cold]),
        1,
        "64k tokens queued cost more than 4k cached"
    );
}

/// The suite over two seeds: one run per seed of every router, the tables
/// at the median, and the scoreboard with a ratio per seed that matches the
/// runs.
#[test]
fn the_suite_runs_every_seed_and_scores_kvroute_per_seed() {
    use kvroute_bench::suite::{self, SuiteOptions};
    let out = std::env::temp_dir().join(format!("kvroute-suite-seeds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = SuiteOptions {
        out: out.clone(),
        docs: None,
        trace: None,
        replicas: 4,
        gateways: vec![1, 2],
        duration_s: 10.0,
        routers: vec!["round-robin".to_owned(), "kvroute".to_owned()],
        scale: vec![],
        scale_family: "chat".to_owned(),
        scale_routers: vec![],
        scale_duration_s: 0.0,
        seeds: vec![1, 2],
        jobs: 2,
        command: "test".to_owned(),
        resume: false,
        rerun: vec![],
        only: vec!["groups".to_owned()],
        kvroute_config: serde_json::json!({}),
        session_header: true,
        flat_prompt: false,
        load: 1.0,
        a100_share: 0.0,
    };
    let rows = suite::run(&o).unwrap();
    // 1 workload x 2 K x 2 seeds x 2 routers.
    assert_eq!(rows.len(), 8);
    for seed in [1, 2] {
        assert_eq!(rows.iter().filter(|r| r.seed == seed).count(), 4);
        assert!(out
            .join(format!("groups-n4-k2-s{seed}/report.json"))
            .exists());
    }
    // The seeds generate different workloads.
    let requests = |seed| rows.iter().find(|r| r.seed == seed).unwrap().requests;
    assert_ne!(requests(1), requests(2));
    let md = std::fs::read_to_string(out.join("simulation.md")).unwrap();
    assert!(md.contains("median over the seeds"), "{md}");
    // The scoreboard's row for K = 1: kvroute's p95 over round robin's, per
    // seed, as the runs give them.
    let p95 = |seed, router: &str| {
        rows.iter()
            .find(|r| r.seed == seed && r.gateways == 1 && r.router.starts_with(router))
            .unwrap()
            .ttft_p95_ms
    };
    let per_seed = format!(
        "{:.2}, {:.2}",
        p95(1, "kvroute") / p95(1, "round-robin"),
        p95(2, "kvroute") / p95(2, "round-robin")
    );
    let line = md
        .lines()
        .find(|l| l.starts_with("| groups | 1 |") && l.contains("round-robin"))
        .expect("a scoreboard row for groups at K = 1");
    assert!(line.contains(&per_seed), "{line} lacks {per_seed}");
    // One run at a time gives the same modelled figures, in the same order.
    let alone = suite::run(&SuiteOptions {
        out: out.join("alone"),
        jobs: 1,
        ..o.clone()
    })
    .unwrap();
    let modelled = |r: &suite::Row| {
        (
            r.workload.clone(),
            r.gateways,
            r.seed,
            r.router.clone(),
            r.requests,
            r.ttft_p95_ms.to_bits(),
            r.hit_rate.to_bits(),
        )
    };
    assert_eq!(
        rows.iter().map(modelled).collect::<Vec<_>>(),
        alone.iter().map(modelled).collect::<Vec<_>>()
    );
    // `--resume --rerun kvroute` with another kvroute config: round robin's
    // stored runs are kept (their figures and wall times as stored),
    // kvroute's all made again, and the page says which is which.
    let rerun = suite::run(&SuiteOptions {
        resume: true,
        rerun: vec!["kvroute".to_owned()],
        kvroute_config: serde_json::json!({"fleet": {"memoryKnee": 0.1}}),
        ..o.clone()
    })
    .unwrap();
    assert_eq!(rerun.len(), rows.len());
    let of = |rows: &[suite::Row], router: &str| -> Vec<suite::Row> {
        rows.iter()
            .filter(|r| r.router.starts_with(router))
            .cloned()
            .collect()
    };
    let (kept, made) = (of(&rerun, "round-robin"), of(&rerun, "kvroute"));
    assert_eq!((kept.len(), made.len()), (4, 4));
    assert!(kept.iter().all(|r| r.reused) && made.iter().all(|r| !r.reused));
    let stored = of(&rows, "round-robin");
    assert_eq!(
        kept.iter()
            .map(|r| (modelled(r), r.wall_s.to_bits()))
            .collect::<Vec<_>>(),
        stored
            .iter()
            .map(|r| (modelled(r), r.wall_s.to_bits()))
            .collect::<Vec<_>>()
    );
    let md = std::fs::read_to_string(out.join("simulation.md")).unwrap();
    assert!(
        md.contains("Runs made for this page: kvroute. Runs kept from the reports")
            && md.contains("(`--resume`): round-robin (modelled);"),
        "{md}"
    );
    // A router to run again that the suite does not run is refused.
    let typo = suite::run(&SuiteOptions {
        resume: true,
        rerun: vec!["kvrote".to_owned()],
        ..o.clone()
    });
    assert!(typo.unwrap_err().contains("kvrote"));
    let _ = std::fs::remove_dir_all(&out);
}

/// The engines take runs of decode-only steps as one event, computed when
/// they end or when something looks at the engine: the same run as one
/// step at a time, byte for byte (summary and records), for a router that
/// reads the engines' caches (dynamo) and ones that do not, on a workload
/// where KV memory binds (preemptions) and one where it does not.
#[test]
fn decode_runs_change_nothing() {
    // (engines, KV blocks each, routers): the chat family sized for 4
    // replicas, on 4 engines, then on 2 small ones that preempt.
    let cases = [
        (4, 25_000, &["kvroute", "dynamo", "least-request"][..]),
        (2, 3_000, &["round-robin", "kvroute"][..]),
    ];
    let wl = chat_on_4();
    let mut preempted = false;
    for (engines, kv_blocks, names) in cases {
        let mut o = Options {
            records: true,
            ..options(engines, 2)
        };
        o.engine.kv_blocks = kv_blocks;
        for name in names {
            let go = |single_steps: bool| {
                let mut r = routers::build(name, &routers::Setup::new(engines, 2, o.seed)).unwrap();
                sim::run(
                    &wl,
                    r.as_mut(),
                    &Options {
                        single_steps,
                        ..o.clone()
                    },
                )
            };
            let (runs, single) = (go(false), go(true));
            let what = format!("{engines} engines, {name}");
            assert_eq!(
                serde_json::to_string(&runs.summary).unwrap(),
                serde_json::to_string(&single.summary).unwrap(),
                "{what}"
            );
            assert_eq!(runs.records, single.records, "{what}");
            assert_eq!(runs.steps, single.steps, "{what}");
            // The runs were taken (the comparison can fail).
            assert!(
                runs.events < single.events,
                "{what}: {} events with runs, {} without",
                runs.events,
                single.events
            );
            assert!(runs.summary.completed > 20, "{what}");
            preempted |= runs.summary.preemptions > 0.0;
        }
    }
    assert!(preempted, "no case ran short of KV memory");
}

/// A chat request as the simulation hands it to a router: `turns` are the
/// messages after a shared system prompt.
struct Chat {
    body: Vec<u8>,
    messages: Vec<(&'static str, String)>,
    prompt: Vec<u8>,
}

impl Chat {
    fn new(turns: &[(&'static str, String)]) -> Chat {
        let system = "You are a careful assistant. ".repeat(300);
        let messages: Vec<(&'static str, String)> = std::iter::once(("system", system))
            .chain(turns.iter().cloned())
            .collect();
        // The bytes the simulation sends and the engine's template.
        let body = kvroute_bench::replay::chat_body("m", &messages, 16).unwrap();
        let prompt = kvroute_sim::engine::chat_prompt(&messages);
        Chat {
            body,
            messages,
            prompt,
        }
    }

    fn request<'a>(&'a self, session: &'a str) -> routers::Request<'a> {
        routers::Request {
            body: &self.body,
            session: Some(session),
            messages: &self.messages,
            prompt: &self.prompt,
            model: "m",
            prompt_tokens: self.prompt.len() / 4,
            max_tokens: 16,
            objective: None,
        }
    }
}

/// A gateway that gets no request still takes in the other gateways'
/// placements, as the filter's tick decodes each pushed snapshot: a
/// conversation that gateway 0 started off its key's busy home (its first
/// prompt shares a system prompt with the request that keeps the home
/// busy, so the index knows part of it there) continues where it started
/// when its next turn reaches gateway 1 after a quiet spell longer than a
/// placement stays in the pushed snapshots (`placed::REPORT_MS`).
#[test]
fn a_quiet_gateway_learns_where_the_other_gateways_placed_keys() {
    use kvroute_sim::engine::sched::Reading;
    let setup = routers::Setup::new(4, 2, 3);
    let idle = vec![
        Reading {
            kv_blocks: 10_000,
            ..Reading::default()
        };
        4
    ];
    let first = |text: &str| Chat::new(&[("user", text.to_owned())]);
    // Two sessions whose keys have the same home: a fresh gateway sends
    // a session's first request there.
    let home = |session: &str| {
        let mut r = routers::build("kvroute", &setup).unwrap();
        r.on_readings(0, &idle, 0.0, 0.0);
        let c = first("hello");
        r.route(0, &c.request(session), 0.1, &[]).unwrap().engine
    };
    let names: Vec<String> = (0..64).map(|i| format!("session-{i}")).collect();
    let (a, b) = names
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            let b = names.get(i + 1..)?.iter().find(|b| home(b) == home(a))?;
            Some((a.clone(), b.clone()))
        })
        .expect("two of 64 sessions share a home on 4 replicas");
    let h = home(&a);

    let mut r = routers::build("kvroute", &setup).unwrap();
    r.on_readings(0, &idle, 0.0, 0.0);
    r.on_readings(1, &idle, 0.0, 0.0);
    // A's long first prompt keeps the home busy; B's goes elsewhere.
    let long = first(&"a long document to read ".repeat(8000));
    let ta = r.route(0, &long.request(&a), 0.3, &[]).unwrap();
    assert_eq!(ta.engine, h);
    let opening = "please help with this ".repeat(100);
    let fb = first(&opening);
    let tb = r.route(0, &fb.request(&b), 0.31, &[]).unwrap();
    assert_ne!(tb.engine, h, "B's first request leaves the busy home");
    r.finished_failed(0, &ta, 0.4);
    r.finished_failed(0, &tb, 0.4);
    // Pushes every 250 ms for 7 s; no request reaches gateway 1.
    for k in 2..30 {
        let t = f64::from(k) * 0.25;
        r.on_readings(0, &idle, t, t);
        r.on_readings(1, &idle, t, t);
    }
    let next = Chat::new(&[
        ("user", opening),
        ("assistant", "Sure.".to_owned()),
        ("user", "Go on.".to_owned()),
    ]);
    let t = r.route(1, &next.request(&b), 7.6, &[]).unwrap();
    assert_eq!(
        t.engine, tb.engine,
        "gateway 1 sends B's next turn where B started ({:?})",
        t.reason
    );
}

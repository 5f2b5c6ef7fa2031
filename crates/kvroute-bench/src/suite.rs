//! The simulation suite (`kvroute-bench suite`, `make sim`): every workload
//! family and the Mooncake trace through kvroute and every modelled peer at
//! one fleet size and K = 1 and 4 gateways, then a fleet-size series, and
//! `docs/simulation.md` with its tables and plots.
//!
//! With several seeds (`--seed 1,2,3`) every family is generated and every
//! run made once per seed; the tables give the median over the seeds, and
//! a scoreboard puts kvroute against the best modelled peer seed by seed.
//! One seed can mislead: on the agent family a handful of requests decide
//! whether TTFT p95 falls on the warm turns or on the cold first turns, and
//! p95 moves several-fold between seeds for kvroute and consistent hashing
//! alike (docs/fleet-state.md).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use kvroute_sim::engine::EngineConfig;

use crate::families::{self, FamilyOptions};
use crate::plot;
use crate::report::{self, Report};
use crate::sim::{self, routers, Collectors, Options, Spread, Timing};
use crate::summary::RunSummary;
use crate::workload::{self, TraceKey, TraceOptions, Workload};

/// What to run.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub out: PathBuf,
    /// Where to write the Markdown (None: only `out`).
    pub docs: Option<PathBuf>,
    pub trace: Option<PathBuf>,
    pub replicas: usize,
    pub gateways: Vec<usize>,
    /// Seconds of arrivals per family.
    pub duration_s: f64,
    pub routers: Vec<String>,
    /// Fleet sizes of the scale series (empty: none).
    pub scale: Vec<usize>,
    pub scale_family: String,
    pub scale_routers: Vec<String>,
    pub scale_duration_s: f64,
    /// The seeds of the fleet-size section (at least one; the scale series
    /// runs with the first).
    pub seeds: Vec<u64>,
    /// Runs of the fleet-size section made at once, one thread each. The
    /// modelled figures do not depend on it; the wall-time and decision-CPU
    /// columns do (the scale series always runs alone, one run at a time).
    pub jobs: usize,
    /// The line that reproduces the run, for the docs.
    pub command: String,
    /// Reuse a run whose report.json (and timing.json) is already in `out`.
    pub resume: bool,
    /// With `resume`: these routers run again, every other router's
    /// stored run is kept (empty: a stored report is reused whole).
    /// `kvroute` stands for every kvroute variant (`kvroute-known-rates`,
    /// the oracles: kvroute-core's code and `kvroute_config`).
    pub rerun: Vec<String>,
    /// Workloads to run, by name ("mooncake" and the families; empty: all).
    pub only: Vec<String>,
    /// kvroute's plugin JSON without `hosts` (`{}`: its defaults).
    pub kvroute_config: serde_json::Value,
    /// Send each session's key as the session header (false: no request
    /// carries one, as from most OpenAI-style clients).
    pub session_header: bool,
    /// Send each conversation as one user message
    /// ([`crate::replay::sent_history`]).
    pub flat_prompt: bool,
    /// Multiplies every workload's calibrated arrival rate (1: the suite's).
    pub load: f64,
    /// The share of each fleet's engines that model an A100 80GB
    /// ([`Options::a100_engines`], rounded; 0: all H100).
    pub a100_share: f64,
}

/// One run's row in the suite's tables.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub workload: String,
    pub replicas: usize,
    pub gateways: usize,
    pub seed: u64,
    pub router: String,
    pub requests: u64,
    pub errors: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub ttft_p99_ms: f64,
    pub p95_over_floor: f64,
    pub p99_over_floor: f64,
    pub hit_rate: f64,
    pub lru_ceiling: f64,
    pub unbounded_ceiling: f64,
    pub queue_p95_ms: f64,
    pub preemptions: f64,
    pub kv_spread: f64,
    pub wall_s: f64,
    pub decision_mean_us: f64,
    pub decision_p99_us: f64,
    /// Kept from a stored report (`--resume`), not run for this suite.
    #[serde(skip)]
    pub reused: bool,
}

impl Row {
    fn new(workload: &str, replicas: usize, seed: u64, s: &RunSummary, t: &Timing) -> Self {
        Self {
            workload: workload.to_owned(),
            replicas,
            gateways: s.gateways,
            seed,
            router: s.router.clone(),
            requests: s.requests,
            errors: s.errors,
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p95_ms: s.ttft_ms.p95,
            ttft_p99_ms: s.ttft_ms.p99,
            p95_over_floor: s.ttft_p95_over_floor,
            p99_over_floor: s.ttft_p99_over_floor,
            hit_rate: s.hit_rate,
            lru_ceiling: s.ceilings.lru_hit_rate,
            unbounded_ceiling: s.ceilings.unbounded_hit_rate,
            queue_p95_ms: s.queue_ms.p95,
            preemptions: s.preemptions,
            kv_spread: s.kv_spread_mean,
            wall_s: t.wall_s,
            decision_mean_us: t.decision_mean_us,
            decision_p99_us: t.decision_p99_us,
            reused: false,
        }
    }
}

fn options(replicas: usize, gateways: usize, seed: u64, o: &SuiteOptions) -> Options {
    Options {
        engines: replicas,
        gateways,
        spread: Spread::Request,
        collectors: Collectors::Shared,
        engine: EngineConfig::default(),
        a100_engines: (replicas as f64 * o.a100_share).round() as usize,
        model: "meta-llama/Llama-3.1-8B-Instruct".to_owned(),
        seed,
        session_header: o.session_header,
        flat_prompt: o.flat_prompt,
        sample_s: 0.5,
        progress: false,
        records: false,
        single_steps: false,
    }
}

/// The Mooncake trace sized for `replicas`: the real bench's 1.5x on 4
/// engines, the rate scaled with the fleet.
fn trace_workload(path: &Path, replicas: usize, load: f64) -> Result<Workload, String> {
    workload::from_mooncake(
        path,
        &TraceOptions {
            start_s: 0.0,
            end_s: f64::INFINITY,
            rate: 1.5 * replicas as f64 / 4.0 * load,
            max_requests: None,
            key: TraceKey::FirstBlock,
            max_context: 131_072,
        },
    )
    .map_err(|e| e.to_string())
}

/// The report and timings stored under `dir` by an earlier run, if any.
/// Without timing.json (an older run) the wall and CPU columns read 0.
fn stored(dir: &Path) -> Result<Option<(Report, Vec<Timing>)>, String> {
    let Ok(report) = std::fs::read(dir.join("report.json")) else {
        return Ok(None);
    };
    let report: Report = serde_json::from_slice(&report).map_err(|e| e.to_string())?;
    let timing: Vec<Timing> = std::fs::read(dir.join("timing.json"))
        .ok()
        .and_then(|t| serde_json::from_slice(&t).ok())
        .unwrap_or_default();
    Ok(Some((report, timing)))
}

/// Runs `routers` on `wl`; writes the report under `dir`; returns the rows.
/// With `resume`, a report stored under `dir` is reused: whole when
/// `rerun` is empty, else every router's stored run but those in `rerun`,
/// which run again.
#[allow(clippy::too_many_arguments)]
fn compare(
    name: &str,
    wl: &Workload,
    routers_: &[String],
    o: &Options,
    dir: &Path,
    keep_samples: bool,
    resume: bool,
    rerun: &[String],
    kvroute_config: &serde_json::Value,
) -> Result<Vec<Row>, String> {
    let mut runs = Vec::new();
    let mut rows = Vec::new();
    let kept = if resume { stored(dir)? } else { None };
    if let (Some((report, timing)), true) = (&kept, rerun.is_empty()) {
        eprintln!("  {name}: reusing {}", dir.display());
        return Ok(report
            .runs
            .iter()
            .enumerate()
            .map(|(i, s)| Row {
                reused: true,
                ..Row::new(
                    name,
                    o.engines,
                    o.seed,
                    s,
                    &timing.get(i).cloned().unwrap_or_default(),
                )
            })
            .collect());
    }
    let mut timings = Vec::new();
    for r in routers_ {
        let started = Instant::now();
        let setup = routers::Setup {
            kvroute_config: kvroute_config.clone(),
            prefill_rates: sim::prefill_rates(o),
            ..routers::Setup::new(o.engines, o.gateways, o.seed)
        };
        let mut router = routers::build(r, &setup)?;
        // A stored run of a router that is not run again (matched by the
        // name the report gives it), made on this workload (its request
        // count) at this K; else the router runs.
        let reused =
            kept.as_ref()
                .filter(|_| !runs_again(rerun, r))
                .and_then(|(report, timing)| {
                    let i = report.runs.iter().position(|s| {
                        s.router == router.name()
                            && s.requests == wl.requests() as u64
                            && s.gateways == o.gateways
                    })?;
                    let s = report.runs.get(i)?.clone();
                    Some((s, timing.get(i).cloned().unwrap_or_default()))
                });
        if let Some((s, t)) = reused {
            rows.push(Row {
                reused: true,
                ..Row::new(name, o.engines, o.seed, &s, &t)
            });
            runs.push(s);
            timings.push(t);
            continue;
        }
        let out = sim::run(wl, router.as_mut(), o);
        let t = sim::timing(&out);
        let s = out.summary;
        eprintln!(
            "  {name} N={} K={} {:<28} TTFT p95 {:>7.0} ms ({:>5.1}x floor), hit {:>5.1} % (LRU {:>5.1} %), {} requests, {:.1} s",
            o.engines,
            o.gateways,
            s.router,
            s.ttft_ms.p95,
            s.ttft_p95_over_floor,
            100.0 * s.hit_rate,
            100.0 * s.ceilings.lru_hit_rate,
            s.requests,
            started.elapsed().as_secs_f64()
        );
        rows.push(Row::new(name, o.engines, o.seed, &s, &t));
        runs.push(s);
        timings.push(t);
    }
    let mut r = Report {
        setup: vec![format!(
            "Fleet simulation: {name}, {} replicas, {} gateway(s) per router, requests spread per request.",
            o.engines, o.gateways
        )],
        runs,
    };
    let bad = report::check_runs(&r);
    if !bad.is_empty() {
        return Err(format!("{name}: checks failed: {}", bad.join("; ")));
    }
    if !keep_samples {
        // Large fleets: the timeline stays out of report.json (its KV
        // spread is in the summary).
        for run in &mut r.runs {
            run.samples.clear();
        }
    }
    report::write(&r, dir)?;
    let json = serde_json::to_vec_pretty(&timings).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("timing.json"), json).map_err(|e| format!("timing.json: {e}"))?;
    Ok(rows)
}

/// Whether `router` runs again under `--rerun` `rerun`: named, or a
/// kvroute variant when `kvroute` is named (they all run kvroute-core).
fn runs_again(rerun: &[String], router: &str) -> bool {
    rerun.iter().any(|r| r == router)
        || (router.starts_with("kvroute") && rerun.iter().any(|r| r == "kvroute"))
}

/// Runs the suite; returns every row.
pub fn run(o: &SuiteOptions) -> Result<Vec<Row>, String> {
    let started = Instant::now();
    let Some(&first_seed) = o.seeds.first() else {
        return Err("--seed: give at least one seed".to_owned());
    };
    if !(o.load > 0.0 && o.load.is_finite() && (0.0..=1.0).contains(&o.a100_share)) {
        return Err(format!(
            "--load {} must be positive and --a100-share {} within 0..1",
            o.load, o.a100_share
        ));
    }
    if let Some(bad) = o
        .rerun
        .iter()
        .find(|r| !o.routers.contains(r) && !o.scale_routers.contains(r))
    {
        return Err(format!(
            "--rerun: {bad:?} is not one of the suite's routers ({}; scale series: {})",
            o.routers.join(", "),
            o.scale_routers.join(", ")
        ));
    }
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let mut rows = Vec::new();
    if let Some(bad) = o
        .only
        .iter()
        .find(|w| *w != "mooncake" && !families::FAMILIES.contains(&w.as_str()))
    {
        return Err(format!(
            "--only: no workload {bad:?} (mooncake, {})",
            families::FAMILIES.join(", ")
        ));
    }
    let wanted = |name: &str| o.only.is_empty() || o.only.iter().any(|w| w == name);
    let trace = match o.trace.as_ref().filter(|_| wanted("mooncake")) {
        Some(t) => Some(trace_workload(t, o.replicas, o.load)?),
        None => None,
    };
    // Every family for every seed first (the families are generated again
    // for each seed; the trace is the trace, and the seed still moves its
    // gateway spread and workers), then the runs as one list of items that
    // `jobs` threads take in turn. Rows come back in the list's order
    // whatever the threads did.
    let mut generated: Vec<(u64, &str, Workload)> = Vec::new();
    for &seed in &o.seeds {
        for f in families::FAMILIES.iter().filter(|f| wanted(f)) {
            let wl = families::generate(
                f,
                &FamilyOptions {
                    replicas: o.replicas,
                    duration_s: o.duration_s,
                    load: o.load,
                    seed,
                },
            )?;
            generated.push((seed, f, wl));
        }
    }
    let mut items: Vec<(u64, &str, &Workload, usize)> = Vec::new();
    for &seed in &o.seeds {
        let of_seed = trace.iter().map(|t| ("mooncake", t)).chain(
            generated
                .iter()
                .filter(|(s, _, _)| *s == seed)
                .map(|(_, n, w)| (*n, w)),
        );
        for (name, wl) in of_seed {
            for &k in &o.gateways {
                items.push((seed, name, wl, k));
            }
        }
    }
    let total = items.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let item_rows = |i: usize| -> Result<Vec<Row>, String> {
        let Some(&(seed, name, wl, k)) = items.get(i) else {
            return Ok(Vec::new());
        };
        eprintln!(
            "suite [{}/{total}] {name}: {} requests, {} replicas, K = {k}, seed {seed} ({:.0} s so far)",
            i + 1,
            wl.requests(),
            o.replicas,
            started.elapsed().as_secs_f64()
        );
        // One seed keeps the directory names of a single run.
        let dir = if o.seeds.len() > 1 {
            o.out.join(format!("{name}-n{}-k{k}-s{seed}", o.replicas))
        } else {
            o.out.join(format!("{name}-n{}-k{k}", o.replicas))
        };
        compare(
            name,
            wl,
            &o.routers,
            &options(o.replicas, k, seed, o),
            &dir,
            true,
            o.resume,
            &o.rerun,
            &o.kvroute_config,
        )
    };
    let worker = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= total {
                return done;
            }
            let r = item_rows(i);
            let failed = r.is_err();
            done.push((i, r));
            if failed {
                // Stop taking items; the others finish theirs.
                next.store(total, std::sync::atomic::Ordering::Relaxed);
                return done;
            }
        }
    };
    let jobs = o.jobs.clamp(1, total.max(1));
    let mut results: Vec<(usize, Result<Vec<Row>, String>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..jobs).map(|_| sc.spawn(worker)).collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join().unwrap_or_else(|_| {
                    vec![(usize::MAX, Err("a suite thread panicked".to_owned()))]
                })
            })
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    for (_, r) in results {
        rows.extend(r?);
    }
    for &n in &o.scale {
        let wl = families::generate(
            &o.scale_family,
            &FamilyOptions {
                replicas: n,
                duration_s: o.scale_duration_s,
                load: o.load,
                seed: first_seed,
            },
        )?;
        eprintln!(
            "suite scale: {} at {n} replicas, {} requests ({:.0} s so far)",
            o.scale_family,
            wl.requests(),
            started.elapsed().as_secs_f64()
        );
        let dir = o.out.join(format!("scale-{}-n{n}", o.scale_family));
        let name = format!("scale:{}", o.scale_family);
        rows.extend(compare(
            &name,
            &wl,
            &o.scale_routers,
            &options(n, 1, first_seed, o),
            &dir,
            n <= 64,
            o.resume,
            &o.rerun,
            &o.kvroute_config,
        )?);
    }
    let json = serde_json::to_vec_pretty(&rows).map_err(|e| e.to_string())?;
    std::fs::write(o.out.join("suite.json"), json).map_err(|e| format!("suite.json: {e}"))?;
    plots(o, &rows)?;
    let md = markdown(o, &rows, started.elapsed().as_secs_f64());
    std::fs::write(o.out.join("simulation.md"), &md).map_err(|e| format!("simulation.md: {e}"))?;
    if let Some(d) = &o.docs {
        std::fs::write(d, &md).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    Ok(rows)
}

/// The median of `v` (the mean of the middle two for an even count; NaN
/// when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v.get(n / 2).copied().unwrap_or(f64::NAN),
        _ => {
            let a = v.get(n / 2 - 1).copied().unwrap_or(f64::NAN);
            let b = v.get(n / 2).copied().unwrap_or(f64::NAN);
            (a + b) / 2.0
        }
    }
}

/// One router on one workload at one K, over the seeds: the medians the
/// tables and plots show.
#[derive(Debug, Clone)]
struct Cell<'a> {
    runs: Vec<&'a Row>,
    p95_ms: f64,
    p95_over_floor: f64,
    hit_rate: f64,
    lru_ceiling: f64,
}

impl Cell<'_> {
    fn hit_of_lru(&self) -> f64 {
        share_of_lru(self.hit_rate, self.lru_ceiling)
    }
}

/// A hit rate as a share of the LRU ceiling (0 where the ceiling is 0:
/// nothing could be cached).
fn share_of_lru(hit_rate: f64, lru_ceiling: f64) -> f64 {
    if lru_ceiling > 0.0 {
        hit_rate / lru_ceiling
    } else {
        0.0
    }
}

/// The fleet-size section's runs of `router` on workload `w` at K = `k`,
/// over every seed (None when there are none).
fn cell<'a>(
    o: &SuiteOptions,
    rows: &'a [Row],
    w: &str,
    k: usize,
    router: &str,
) -> Option<Cell<'a>> {
    let runs: Vec<&Row> = rows
        .iter()
        .filter(|x| {
            x.workload == w
                && x.gateways == k
                && x.replicas == o.replicas
                && routers::canonical(&x.router) == router
        })
        .collect();
    if runs.is_empty() {
        return None;
    }
    let of = |f: fn(&Row) -> f64| median(runs.iter().map(|x| f(x)).collect());
    Some(Cell {
        p95_ms: of(|x| x.ttft_p95_ms),
        p95_over_floor: of(|x| x.p95_over_floor),
        hit_rate: of(|x| x.hit_rate),
        lru_ceiling: of(|x| x.lru_ceiling),
        runs,
    })
}

/// The workloads of the fleet-size section, in run order.
fn workload_names(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter(|r| !r.workload.starts_with("scale:"))
        .map(|r| r.workload.clone())
        .fold(Vec::new(), |mut v, w| {
            if !v.contains(&w) {
                v.push(w);
            }
            v
        })
}

fn plots(o: &SuiteOptions, rows: &[Row]) -> Result<(), String> {
    let names = workload_names(rows);
    let routers_: Vec<String> = o.routers.clone();
    for &k in &o.gateways {
        let series: Vec<(String, Vec<f64>)> = routers_
            .iter()
            .map(|r| {
                (
                    r.clone(),
                    names
                        .iter()
                        .map(|w| cell(o, rows, w, k, r).map_or(0.0, |c| c.p95_over_floor))
                        .collect(),
                )
            })
            .collect();
        plot::bars(
            &o.out.join(format!("p95-over-floor-k{k}.svg")),
            &format!("TTFT p95 / no-queue floor per workload, {} replicas, K = {k} (lower is better, log scale)", o.replicas),
            &names,
            &series,
            "p95 / floor",
            true,
        )
        .map_err(|e| format!("plot: {e}"))?;
    }
    // Hit rate at each K, as a share of the LRU ceiling.
    let ks: Vec<String> = o.gateways.iter().map(|k| format!("K={k}")).collect();
    let series: Vec<(String, Vec<f64>)> = routers_
        .iter()
        .map(|r| {
            let v = o
                .gateways
                .iter()
                .map(|&k| {
                    let hits: Vec<f64> = names
                        .iter()
                        .filter_map(|w| cell(o, rows, w, k, r))
                        .map(|c| c.hit_of_lru())
                        .collect();
                    hits.iter().sum::<f64>() / hits.len().max(1) as f64
                })
                .collect();
            (r.clone(), v)
        })
        .collect();
    plot::bars(
        &o.out.join("hit-vs-gateways.svg"),
        "Hit rate / LRU ceiling, mean over workloads, against gateway instances K",
        &ks,
        &series,
        "hit rate / ceiling",
        false,
    )
    .map_err(|e| format!("plot: {e}"))?;
    if !o.scale.is_empty() {
        let xs: Vec<f64> = o.scale.iter().map(|&n| n as f64).collect();
        let scale_name = format!("scale:{}", o.scale_family);
        let of = |r: &str, f: &dyn Fn(&Row) -> f64| -> Vec<f64> {
            o.scale
                .iter()
                .map(|&n| {
                    rows.iter()
                        .find(|x| {
                            x.workload == scale_name
                                && x.replicas == n
                                && routers::canonical(&x.router) == r
                        })
                        .map_or(f64::NAN, f)
                })
                .collect()
        };
        for (file, title, y, f) in [
            (
                "scale-hit.svg",
                "Hit rate / LRU ceiling against fleet size",
                "hit rate / ceiling",
                (&|x: &Row| share_of_lru(x.hit_rate, x.lru_ceiling)) as &dyn Fn(&Row) -> f64,
            ),
            (
                "scale-p95.svg",
                "TTFT p95 / no-queue floor against fleet size",
                "p95 / floor",
                &|x: &Row| x.p95_over_floor,
            ),
        ] {
            let series: Vec<(String, Vec<f64>)> = o
                .scale_routers
                .iter()
                .map(|r| (r.clone(), of(r, f)))
                .collect();
            plot::lines(
                &o.out.join(file),
                title,
                &xs,
                &series,
                "replicas (log scale)",
                y,
            )
            .map_err(|e| format!("plot: {e}"))?;
        }
    }
    Ok(())
}

fn markdown(o: &SuiteOptions, rows: &[Row], wall_s: f64) -> String {
    // The plots are in `out`, which sits next to the Markdown.
    let plots = o.out.file_name().map_or_else(
        || "simulation".to_owned(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut s = String::from("# Fleet simulation results\n\n");
    let _ = writeln!(
        s,
        "Generated by `{}` ({:.0} s of wall time on this machine). Every figure is modelled time in the \
         virtual-time fleet simulation (`kvroute-bench simulate`, see [simulator.md](simulator.md)): \
         kvroute-sim's engine model (Llama-3.1-8B on one H100 per replica), kvroute-core's request path \
         per gateway instance, and the peers as models of their documented algorithms (names marked \
         *(modelled)*; constants and sources in `crates/kvroute-bench/src/sim/routers.rs`). Same seed, same \
         numbers.\n",
        o.command, wall_s
    );
    // Which routers ran for this page and which were kept from a stored
    // report (`--resume`).
    let mut ran: Vec<&str> = Vec::new();
    let mut kept: Vec<&str> = Vec::new();
    for r in rows {
        let list = if r.reused { &mut kept } else { &mut ran };
        if !list.contains(&r.router.as_str()) {
            list.push(&r.router);
        }
    }
    if !kept.is_empty() {
        let _ = writeln!(
            s,
            "Runs made for this page: {}. Runs kept from the reports stored in `{}` by an earlier \
             generation (`--resume`): {}; their wall-time and decision-CPU columns are from that \
             generation. A router's modelled run depends only on the workload, the engine model and \
             its own code.\n",
            if ran.is_empty() { "none".to_owned() } else { ran.join(", ") },
            plots,
            kept.join(", ")
        );
    }
    if o.seeds.len() > 1 {
        let seeds: Vec<String> = o.seeds.iter().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "Every workload ran once per seed ({}): a family is generated again for each, and the seed \
             also draws each request's gateway instance. The tables give the **median over the seeds**; \
             every run is in the last table.\n",
            seeds.join(", ")
        );
    }
    let _ = writeln!(
        s,
        "- hit rate: prompt tokens cached at each request's first admission / prompt tokens; \
         *of LRU* divides it by the pooled fleet-LRU ceiling;\n\
         - p95/floor: TTFT p95 over the no-queue floor's p95 (each request alone on an idle engine holding \
         every prefix sent before it): 1.0 is unbeatable;\n\
         - requests are spread over the K gateway instances at random per request; one collector pushes \
         every 250 ms to every gateway.\n"
    );
    if o.a100_share > 0.0 {
        let _ = writeln!(
            s,
            "A fleet of two GPU generations (`--a100-share {}`): that share of each fleet's engines model \
             Llama-3.1-8B on an A100 80GB (prefill about 0.3x the H100's; constants and sources in \
             `EngineConfig::a100_80gb`, crates/kvroute-sim/src/engine/config.rs). The no-queue floor is the \
             H100's.\n",
            o.a100_share
        );
    }
    if o.load != 1.0 {
        let _ = writeln!(
            s,
            "Every workload's arrival rate is {}x the suite's calibrated rate (`--load`).\n",
            o.load
        );
    }
    if o.flat_prompt {
        let _ = writeln!(
            s,
            "Every request sends its conversation as one user message (`--flat-prompt`: the texts of its \
             system prompt, questions and answers joined), as a bare prompt: only the bytes say where a \
             shared system prompt ends (kvroute learns it, docs/fleet-state.md, \"Bare prompts\").\n"
        );
    }
    if !o.session_header {
        let _ = writeln!(
            s,
            "No request carries a session header (`--no-session-header`): kvroute keys each conversation \
             by its text up to its first question, the Mooncake trace's requests have no key, and the \
             ring-hash models pick at random.\n"
        );
    }
    let names = workload_names(rows);
    let _ = writeln!(
        s,
        "## TTFT p95 / floor per workload ({} replicas)\n",
        o.replicas
    );
    for &k in &o.gateways {
        let _ = writeln!(
            s,
            "K = {k} gateway instance(s); the best router per column in bold.\n"
        );
        let _ = write!(s, "| router |");
        for w in &names {
            let _ = write!(s, " {w} |");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|{}", "---|".repeat(names.len()));
        for r in &o.routers {
            let _ = write!(s, "| {r} |");
            for w in &names {
                let best = o
                    .routers
                    .iter()
                    .filter_map(|r| cell(o, rows, w, k, r))
                    .map(|c| c.p95_over_floor)
                    .fold(f64::MAX, f64::min);
                match cell(o, rows, w, k, r) {
                    Some(x) if x.p95_over_floor == best => {
                        let _ = write!(s, " **{:.1}x** ({:.0} ms) |", x.p95_over_floor, x.p95_ms);
                    }
                    Some(x) => {
                        let _ = write!(s, " {:.1}x ({:.0} ms) |", x.p95_over_floor, x.p95_ms);
                    }
                    None => {
                        let _ = write!(s, " - |");
                    }
                }
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "\n![p95 over the floor, K = {k}]({plots}/p95-over-floor-k{k}.svg)\n"
        );
    }
    let _ = writeln!(s, "## Hit rate per workload ({} replicas)\n", o.replicas);
    for &k in &o.gateways {
        let _ = writeln!(s, "K = {k}: hit rate (share of the LRU ceiling).\n");
        let _ = write!(s, "| router |");
        for w in &names {
            let _ = write!(s, " {w} |");
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "|---|{}", "---|".repeat(names.len()));
        for r in &o.routers {
            let _ = write!(s, "| {r} |");
            for w in &names {
                match cell(o, rows, w, k, r) {
                    Some(x) => {
                        let _ = write!(
                            s,
                            " {:.1} % ({:.0} %) |",
                            100.0 * x.hit_rate,
                            100.0 * x.hit_of_lru()
                        );
                    }
                    None => {
                        let _ = write!(s, " - |");
                    }
                }
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "![hit rate against K]({plots}/hit-vs-gateways.svg)\n");
    scoreboard(&mut s, o, rows, &names);
    let _ = writeln!(s, "## Every run\n");
    let _ = writeln!(
        s,
        "| workload | N | K | seed | router | requests | TTFT p50 / p95 / p99 ms | p95 / p99 over floor | hit rate | LRU / unbounded ceiling | queue p95 ms | preemptions | KV spread |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for x in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.1}x / {:.1}x | {:.1} % | {:.1} % / {:.1} % | {:.0} | {:.0} | {:.3} |",
            x.workload,
            x.replicas,
            x.gateways,
            x.seed,
            x.router,
            x.requests,
            x.ttft_p50_ms,
            x.ttft_p95_ms,
            x.ttft_p99_ms,
            x.p95_over_floor,
            x.p99_over_floor,
            100.0 * x.hit_rate,
            100.0 * x.lru_ceiling,
            100.0 * x.unbounded_ceiling,
            x.queue_p95_ms,
            x.preemptions,
            x.kv_spread
        );
    }
    if !o.scale.is_empty() {
        let _ = writeln!(
            s,
            "\n## Fleet size ({} family, {} s of arrivals, load per replica constant)\n",
            o.scale_family, o.scale_duration_s
        );
        let _ = writeln!(
            s,
            "kvroute's decision CPU is the native wall time of its request path (analyze, prior, snapshot \
             refresh, route) inside the simulation, on this shared 2-core machine: a benchmark figure, \
             noisy, not modelled time.\n"
        );
        let _ = writeln!(s, "| N | router | requests | hit rate / LRU ceiling | TTFT p95 / floor | KV spread | kvroute decision mean / p99 µs | wall s |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        for x in rows.iter().filter(|x| x.workload.starts_with("scale:")) {
            let share = share_of_lru(x.hit_rate, x.lru_ceiling);
            let cpu = if x.decision_mean_us > 0.0 {
                format!("{:.1} / {:.1}", x.decision_mean_us, x.decision_p99_us)
            } else {
                "-".to_owned()
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} % ({:.1} % of {:.1} %) | {:.1}x | {:.3} | {} | {:.1} |",
                x.replicas,
                x.router,
                x.requests,
                100.0 * share,
                100.0 * x.hit_rate,
                100.0 * x.lru_ceiling,
                x.p95_over_floor,
                x.kv_spread,
                cpu,
                x.wall_s
            );
        }
        let _ = writeln!(s, "\n![hit rate against fleet size]({plots}/scale-hit.svg)\n\n![p95 against fleet size]({plots}/scale-p95.svg)\n");
    }
    s
}

/// kvroute against the best modelled peer, per workload and K: the ratios
/// the placement policy's targets are written in (docs/fleet-state.md). The best peer is the one with the
/// lowest median p95 (for the hit rate, the highest median); per seed, the
/// ratio is against that seed's best peer. Nothing when kvroute or every
/// peer is missing. The peers are the modelled routers of
/// [`routers::ALL`]; references that are not routers (the oracles) are not.
fn scoreboard(s: &mut String, o: &SuiteOptions, rows: &[Row], names: &[String]) {
    const OURS: &str = "kvroute";
    let peers: Vec<&String> = o
        .routers
        .iter()
        .filter(|r| *r != OURS && routers::ALL.contains(&r.as_str()))
        .collect();
    if peers.is_empty() || !o.routers.iter().any(|r| r == OURS) {
        return;
    }
    let _ = writeln!(
        s,
        "## kvroute against the best modelled peer ({} replicas)\n",
        o.replicas
    );
    let _ = writeln!(
        s,
        "TTFT p95 over the best modelled peer's (lowest median p95; per seed, that seed's best peer), \
         and hit rate over the best peer's (highest median hit rate); at K > 1 also over kvroute's own \
         hit rate at K = {}. Below 1.0 on p95 and above 100 % on hit rate, kvroute is ahead.\n",
        o.gateways.first().copied().unwrap_or(1)
    );
    let _ = writeln!(
        s,
        "| workload | K | kvroute p95 ms | best peer (p95 ms) | p95 ratio | per seed | kvroute hit | best peer hit | hit ratio | hit vs own K = {} |",
        o.gateways.first().copied().unwrap_or(1)
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for w in names {
        for &k in &o.gateways {
            let Some(ours) = cell(o, rows, w, k, OURS) else {
                continue;
            };
            let cells: Vec<(&String, Cell<'_>)> = peers
                .iter()
                .filter_map(|p| cell(o, rows, w, k, p).map(|c| (*p, c)))
                .collect();
            let Some((fast_name, fast)) = cells
                .iter()
                .min_by(|a, b| a.1.p95_ms.total_cmp(&b.1.p95_ms))
            else {
                continue;
            };
            let Some((hit_name, hit)) = cells
                .iter()
                .max_by(|a, b| a.1.hit_rate.total_cmp(&b.1.hit_rate))
            else {
                continue;
            };
            // Per seed: kvroute's p95 over the best peer's of the same seed.
            let per_seed: Vec<String> = ours
                .runs
                .iter()
                .filter_map(|x| {
                    let best = cells
                        .iter()
                        .flat_map(|(_, c)| c.runs.iter())
                        .filter(|p| p.seed == x.seed)
                        .map(|p| p.ttft_p95_ms)
                        .fold(f64::INFINITY, f64::min);
                    (best.is_finite() && best > 0.0).then(|| format!("{:.2}", x.ttft_p95_ms / best))
                })
                .collect();
            let ratio = |a: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.2}x", a / b)
                } else {
                    "-".to_owned()
                }
            };
            let share = |a: f64, b: f64| {
                if b > 0.0 {
                    format!("{:.0} %", 100.0 * a / b)
                } else {
                    "-".to_owned()
                }
            };
            let own = match o.gateways.first() {
                Some(&k1) if k1 != k => cell(o, rows, w, k1, OURS)
                    .map_or("-".to_owned(), |c| share(ours.hit_rate, c.hit_rate)),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                s,
                "| {w} | {k} | {:.0} | {} ({:.0}) | {} | {} | {:.1} % | {} ({:.1} %) | {} | {own} |",
                ours.p95_ms,
                fast_name,
                fast.p95_ms,
                ratio(ours.p95_ms, fast.p95_ms),
                per_seed.join(", "),
                100.0 * ours.hit_rate,
                hit_name,
                100.0 * hit.hit_rate,
                share(ours.hit_rate, hit.hit_rate),
            );
        }
    }
    let _ = writeln!(s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}

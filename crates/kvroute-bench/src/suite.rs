//! The simulation suite (`kvroute-bench suite`, `make sim`): every workload
//! family and the Mooncake trace through kvroute and every modelled peer at
//! one fleet size and K = 1 and 4 gateways, then a fleet-size series, and
//! `docs/simulation.md` with its tables and plots.

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
    pub seed: u64,
    /// The line that reproduces the run, for the docs.
    pub command: String,
    /// Reuse a run whose report.json (and timing.json) is already in `out`.
    pub resume: bool,
    /// Workloads to run, by name ("mooncake" and the families; empty: all).
    pub only: Vec<String>,
    /// kvroute's plugin JSON without `hosts` (`{}`: its defaults).
    pub kvroute_config: serde_json::Value,
}

/// One run's row in the suite's tables.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub workload: String,
    pub replicas: usize,
    pub gateways: usize,
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
}

impl Row {
    fn new(workload: &str, replicas: usize, s: &RunSummary, t: &Timing) -> Self {
        Self {
            workload: workload.to_owned(),
            replicas,
            gateways: s.gateways,
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
        }
    }
}

fn options(replicas: usize, gateways: usize, seed: u64) -> Options {
    Options {
        engines: replicas,
        gateways,
        spread: Spread::Request,
        collectors: Collectors::Shared,
        engine: EngineConfig::default(),
        model: "meta-llama/Llama-3.1-8B-Instruct".to_owned(),
        seed,
        session_header: true,
        sample_s: 0.5,
        progress: false,
    }
}

/// The Mooncake trace sized for `replicas`: the real bench's 1.5x on 4
/// engines, the rate scaled with the fleet.
fn trace_workload(path: &Path, replicas: usize) -> Result<Workload, String> {
    workload::from_mooncake(
        path,
        &TraceOptions {
            start_s: 0.0,
            end_s: f64::INFINITY,
            rate: 1.5 * replicas as f64 / 4.0,
            max_requests: None,
            key: TraceKey::FirstBlock,
            max_context: 131_072,
        },
    )
    .map_err(|e| e.to_string())
}

/// Runs `routers` on `wl`; writes the report under `dir`; returns the rows.
#[allow(clippy::too_many_arguments)]
fn compare(
    name: &str,
    wl: &Workload,
    routers_: &[String],
    o: &Options,
    dir: &Path,
    keep_samples: bool,
    resume: bool,
    kvroute_config: &serde_json::Value,
) -> Result<Vec<Row>, String> {
    let mut runs = Vec::new();
    let mut rows = Vec::new();
    if resume {
        if let Ok(report) = std::fs::read(dir.join("report.json")) {
            let report: Report = serde_json::from_slice(&report).map_err(|e| e.to_string())?;
            // Without timing.json (an older run) the wall and CPU columns
            // read 0.
            let timing: Vec<Timing> = std::fs::read(dir.join("timing.json"))
                .ok()
                .and_then(|t| serde_json::from_slice(&t).ok())
                .unwrap_or_default();
            eprintln!("  {name}: reusing {}", dir.display());
            return Ok(report
                .runs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    Row::new(
                        name,
                        o.engines,
                        s,
                        &timing.get(i).cloned().unwrap_or_default(),
                    )
                })
                .collect());
        }
    }
    let mut timings = Vec::new();
    for r in routers_ {
        let started = Instant::now();
        let setup = routers::Setup {
            kvroute_config: kvroute_config.clone(),
            ..routers::Setup::new(o.engines, o.gateways, o.seed)
        };
        let mut router = routers::build(r, &setup)?;
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
        rows.push(Row::new(name, o.engines, &s, &t));
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

/// Runs the suite; returns every row.
pub fn run(o: &SuiteOptions) -> Result<Vec<Row>, String> {
    let started = Instant::now();
    std::fs::create_dir_all(&o.out).map_err(|e| format!("{}: {e}", o.out.display()))?;
    let mut rows = Vec::new();
    let mut workloads: Vec<(String, Workload)> = Vec::new();
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
    if let Some(t) = o.trace.as_ref().filter(|_| wanted("mooncake")) {
        workloads.push(("mooncake".to_owned(), trace_workload(t, o.replicas)?));
    }
    for f in families::FAMILIES.iter().filter(|f| wanted(f)) {
        let wl = families::generate(
            f,
            &FamilyOptions {
                replicas: o.replicas,
                duration_s: o.duration_s,
                load: 1.0,
                seed: o.seed,
            },
        )?;
        workloads.push(((*f).to_owned(), wl));
    }
    let total = workloads.len() * o.gateways.len();
    let mut done = 0;
    for (name, wl) in &workloads {
        for &k in &o.gateways {
            done += 1;
            eprintln!(
                "suite [{done}/{total}] {name}: {} requests, {} replicas, K = {k} ({:.0} s so far)",
                wl.requests(),
                o.replicas,
                started.elapsed().as_secs_f64()
            );
            let dir = o.out.join(format!("{name}-n{}-k{k}", o.replicas));
            rows.extend(compare(
                name,
                wl,
                &o.routers,
                &options(o.replicas, k, o.seed),
                &dir,
                true,
                o.resume,
                &o.kvroute_config,
            )?);
        }
    }
    for &n in &o.scale {
        let wl = families::generate(
            &o.scale_family,
            &FamilyOptions {
                replicas: n,
                duration_s: o.scale_duration_s,
                load: 1.0,
                seed: o.seed,
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
            &options(n, 1, o.seed),
            &dir,
            n <= 64,
            o.resume,
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

fn plots(o: &SuiteOptions, rows: &[Row]) -> Result<(), String> {
    let names: Vec<String> = rows
        .iter()
        .filter(|r| !r.workload.starts_with("scale:"))
        .map(|r| r.workload.clone())
        .fold(Vec::new(), |mut v, w| {
            if !v.contains(&w) {
                v.push(w);
            }
            v
        });
    let routers_: Vec<String> = o.routers.clone();
    let find = |w: &str, k: usize, r: &str| {
        rows.iter().find(|x| {
            x.workload == w
                && x.gateways == k
                && x.replicas == o.replicas
                && routers::canonical(&x.router) == r
        })
    };
    for &k in &o.gateways {
        let series: Vec<(String, Vec<f64>)> = routers_
            .iter()
            .map(|r| {
                (
                    r.clone(),
                    names
                        .iter()
                        .map(|w| find(w, k, r).map_or(0.0, |x| x.p95_over_floor))
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
                        .filter_map(|w| find(w, k, r))
                        .map(|x| {
                            if x.lru_ceiling > 0.0 {
                                x.hit_rate / x.lru_ceiling
                            } else {
                                0.0
                            }
                        })
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
                (&|x: &Row| {
                    if x.lru_ceiling > 0.0 {
                        x.hit_rate / x.lru_ceiling
                    } else {
                        0.0
                    }
                }) as &dyn Fn(&Row) -> f64,
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
    let _ = writeln!(
        s,
        "- hit rate: prompt tokens cached at each request's first admission / prompt tokens; \
         *of LRU* divides it by the pooled fleet-LRU ceiling;\n\
         - p95/floor: TTFT p95 over the no-queue floor's p95 (each request alone on an idle engine holding \
         every prefix sent before it): 1.0 is unbeatable;\n\
         - requests are spread over the K gateway instances at random per request; one collector pushes \
         every 250 ms to every gateway.\n"
    );
    let names: Vec<String> = rows
        .iter()
        .filter(|r| !r.workload.starts_with("scale:"))
        .map(|r| r.workload.clone())
        .fold(Vec::new(), |mut v, w| {
            if !v.contains(&w) {
                v.push(w);
            }
            v
        });
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
                let col: Vec<&Row> = rows
                    .iter()
                    .filter(|x| &x.workload == w && x.gateways == k && x.replicas == o.replicas)
                    .collect();
                let best = col
                    .iter()
                    .map(|x| x.p95_over_floor)
                    .fold(f64::MAX, f64::min);
                match col
                    .iter()
                    .find(|x| routers::canonical(&x.router) == r.as_str())
                {
                    Some(x) if x.p95_over_floor == best => {
                        let _ = write!(
                            s,
                            " **{:.1}x** ({:.0} ms) |",
                            x.p95_over_floor, x.ttft_p95_ms
                        );
                    }
                    Some(x) => {
                        let _ = write!(s, " {:.1}x ({:.0} ms) |", x.p95_over_floor, x.ttft_p95_ms);
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
            "\n![p95 over the floor, K = {k}](simulation/p95-over-floor-k{k}.svg)\n"
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
                match rows.iter().find(|x| {
                    &x.workload == w
                        && x.gateways == k
                        && x.replicas == o.replicas
                        && routers::canonical(&x.router) == r.as_str()
                }) {
                    Some(x) => {
                        let share = if x.lru_ceiling > 0.0 {
                            x.hit_rate / x.lru_ceiling
                        } else {
                            0.0
                        };
                        let _ =
                            write!(s, " {:.1} % ({:.0} %) |", 100.0 * x.hit_rate, 100.0 * share);
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
    let _ = writeln!(s, "![hit rate against K](simulation/hit-vs-gateways.svg)\n");
    let _ = writeln!(s, "## Every run\n");
    let _ = writeln!(
        s,
        "| workload | N | K | router | requests | TTFT p50 / p95 / p99 ms | p95 / p99 over floor | hit rate | LRU / unbounded ceiling | queue p95 ms | preemptions | KV spread |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for x in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.1}x / {:.1}x | {:.1} % | {:.1} % / {:.1} % | {:.0} | {:.0} | {:.3} |",
            x.workload,
            x.replicas,
            x.gateways,
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
            let share = if x.lru_ceiling > 0.0 {
                x.hit_rate / x.lru_ceiling
            } else {
                0.0
            };
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
        let _ = writeln!(s, "\n![hit rate against fleet size](simulation/scale-hit.svg)\n\n![p95 against fleet size](simulation/scale-p95.svg)\n");
    }
    s
}

//! The comparison: `report.json`, a Markdown table, SVG plots, and the
//! consistency checks `make bench-smoke` runs.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::summary::RunSummary;

/// The whole comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Free text: how the fleet and the run were set up.
    pub setup: Vec<String>,
    pub runs: Vec<RunSummary>,
}

/// The router whose hit rate kvroute must beat in the smoke check.
pub const BASELINE: &str = "envoy-round-robin";
pub const KVROUTE: &str = "kvroute";
/// Simulator lag (fraction of the run) above which the report warns.
pub const LAG_WARNING: f64 = 0.02;

fn pct(x: f64) -> String {
    format!("{:.1} %", 100.0 * x)
}

/// The Markdown table (and the ceilings under it).
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| router | gateways | TTFT p50 / p95 / p99 (ms) | p95 / p99 over the floor | ITL p50 / p99 (ms) | E2E p50 (ms) | req/s | output tok/s | errors | hit rate | of LRU ceiling | conversation split | KV spread | preemptions |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for run in &r.runs {
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} / {:.0} / {:.0} | {:.1}x / {:.1}x | {:.1} / {:.1} | {:.0} | {:.2} | {:.0} | {} | {} | {} | {} | {:.3} | {:.0} |",
            run.router,
            run.gateways,
            run.ttft_ms.p50,
            run.ttft_ms.p95,
            run.ttft_ms.p99,
            run.ttft_p95_over_floor,
            run.ttft_p99_over_floor,
            run.itl_ms.p50,
            run.itl_ms.p99,
            run.e2e_ms.p50,
            run.requests_per_s,
            run.output_tokens_per_s,
            run.errors,
            pct(run.hit_rate),
            pct(run.hit_fraction_of_lru),
            pct(run.conversation_split),
            run.kv_spread_mean,
            run.preemptions,
        );
    }
    let _ = writeln!(
        s,
        "\nWhere the time goes (engine-reported queue wait and prefill, modelled ms), and the split of requests over the engines:\n"
    );
    let _ = writeln!(
        s,
        "| router | queue p50 / p99 | prefill p50 / p99 | E2E p50 / p99 | ITL p99 | requests per engine | hit rate with re-admissions (engine counters) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for run in &r.runs {
        let split: Vec<String> = run.per_engine_requests.iter().map(u64::to_string).collect();
        let _ = writeln!(
            s,
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.1} | {} | {} |",
            run.router,
            run.queue_ms.p50,
            run.queue_ms.p99,
            run.prefill_ms.p50,
            run.prefill_ms.p99,
            run.e2e_ms.p50,
            run.e2e_ms.p99,
            run.itl_ms.p99,
            split.join(" / "),
            pct(run.hit_rate_with_readmissions),
        );
    }
    if let Some(first) = r.runs.first() {
        let c = &first.ceilings;
        let _ = writeln!(
            s,
            "\nCeilings on the same requests in the same order: one engine with an unbounded cache {}; \
             one LRU cache holding the fleet's {} blocks {}.",
            pct(c.unbounded_hit_rate),
            c.lru_blocks,
            pct(c.lru_hit_rate)
        );
        let f = &first.ttft_floor_ms;
        let _ = writeln!(
            s,
            "\nHit rate: prompt tokens cached at each request's first admission (the answers' `cached_tokens`) / prompt tokens. \
             The no-queue TTFT floor (each request alone on an idle engine holding every prefix sent before it): \
             p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms.",
            f.p50, f.p95, f.p99
        );
        let _ = writeln!(
            s,
            "\nWorkload: {} ({} requests).",
            first.workload.summary, first.workload.requests
        );
    }
    if r.runs.iter().any(|run| !run.objectives.is_empty()) {
        let _ = writeln!(
            s,
            "\nBy objective (admission control; TTFT from the client's send, time held in the gateway included; \
             goodput: output tokens of completed requests per second of the run):\n\n\
             | router | gateways | objective | requests | completed | shed by the gateway | other errors | TTFT p50 / p95 / p99 (ms) | goodput (tok/s) |\n\
             |---|---|---|---|---|---|---|---|---|"
        );
        for run in &r.runs {
            for (name, o) in &run.objectives {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.0} |",
                    run.router,
                    run.gateways,
                    name,
                    o.requests,
                    o.completed,
                    o.shed,
                    o.failed,
                    o.ttft_ms.p50,
                    o.ttft_ms.p95,
                    o.ttft_ms.p99,
                    o.goodput_tokens_per_s
                );
            }
        }
    }
    let lagging: Vec<String> = r
        .runs
        .iter()
        .filter(|run| run.sim_lag_fraction > LAG_WARNING)
        .map(|run| format!("{} ({})", run.router, pct(run.sim_lag_fraction)))
        .collect();
    if !lagging.is_empty() {
        let _ = writeln!(
            s,
            "\n**Warning:** the simulator fell behind its clock in {}: this machine could not keep up with the \
             time scale, so those figures are distorted. Rerun with a lower `--time-scale`.",
            lagging.join(", ")
        );
    }
    for run in &r.runs {
        if run.errors > 0 {
            let _ = writeln!(s, "\n{} errors: {:?}", run.router, run.errors_by_class);
        }
    }
    s
}

/// Writes report.json, report.md, ttft-cdf.svg and kv-utilisation.svg.
pub fn write(r: &Report, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = serde_json::to_vec_pretty(r).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("report.json"), json).map_err(|e| format!("report.json: {e}"))?;
    let mut md = String::from("# kvroute routing benchmark\n\n");
    for line in &r.setup {
        let _ = writeln!(md, "- {line}");
    }
    md.push('\n');
    md.push_str(&markdown(r));
    md.push_str("\n![TTFT CDF](ttft-cdf.svg)\n\n![KV utilisation](kv-utilisation.svg)\n");
    std::fs::write(dir.join("report.md"), md).map_err(|e| format!("report.md: {e}"))?;
    crate::plot::ttft_cdf(&r.runs, &dir.join("ttft-cdf.svg"))
        .map_err(|e| format!("ttft-cdf.svg: {e}"))?;
    crate::plot::kv_timeline(&r.runs, &dir.join("kv-utilisation.svg"))
        .map_err(|e| format!("kv-utilisation.svg: {e}"))?;
    Ok(())
}

/// The harness's own consistency checks, and that kvroute beats round
/// robin on hit rate; each failure is one line.
pub fn check(r: &Report) -> Vec<String> {
    let mut bad = check_runs(r);
    let find = |n: &str| r.runs.iter().find(|x| x.router == n);
    match (find(KVROUTE), find(BASELINE)) {
        (Some(k), Some(b)) if k.hit_rate <= b.hit_rate => bad.push(format!(
            "{KVROUTE} hit rate {} does not beat {BASELINE}'s {}",
            pct(k.hit_rate),
            pct(b.hit_rate)
        )),
        (Some(_), Some(_)) => {}
        _ => bad.push(format!(
            "the comparison needs both {KVROUTE} and {BASELINE}"
        )),
    }
    bad
}

/// The consistency checks of every run alone.
pub fn check_runs(r: &Report) -> Vec<String> {
    let mut bad = Vec::new();
    if r.runs.is_empty() {
        bad.push("no router ran".to_owned());
    }
    for run in &r.runs {
        let name = &run.router;
        if run.requests != run.workload.requests as u64 {
            bad.push(format!(
                "{name}: {} of {} requests have an outcome",
                run.requests, run.workload.requests
            ));
        }
        if run.errors > 0 || run.completed != run.requests {
            bad.push(format!(
                "{name}: {} errors ({:?}), e.g. {:?}",
                run.errors,
                run.errors_by_class,
                run.error_examples.first()
            ));
        }
        let c = &run.ceilings;
        if !(0.0..=1.0).contains(&c.unbounded_hit_rate)
            || c.lru_hit_rate > c.unbounded_hit_rate + 1e-9
        {
            bad.push(format!(
                "{name}: ceilings inconsistent (unbounded {}, LRU {})",
                c.unbounded_hit_rate, c.lru_hit_rate
            ));
        }
        // Counted at first admission, no router can beat one engine with
        // an unbounded cache that saw every earlier block.
        if !(0.0..=c.unbounded_hit_rate + 1e-9).contains(&run.hit_rate) {
            bad.push(format!(
                "{name}: hit rate {} outside [0, unbounded ceiling {}]",
                run.hit_rate, c.unbounded_hit_rate
            ));
        }
        if !(0.0..=1.0).contains(&run.hit_rate_with_readmissions) {
            bad.push(format!(
                "{name}: hit rate with re-admissions {}",
                run.hit_rate_with_readmissions
            ));
        }
        // Nothing is faster than the request alone on an idle engine
        // holding the ceiling's cache (the ceiling is an upper bound, so
        // allow a little where a router beat the LRU ceiling's cache).
        if run.ttft_floor_ms.count != run.completed
            || run.ttft_floor_ms.p50 > run.ttft_ms.p50 * 1.5 + 1.0
        {
            bad.push(format!(
                "{name}: TTFT floor {:?} inconsistent with TTFT {:?}",
                run.ttft_floor_ms, run.ttft_ms
            ));
        }
        for (what, p) in [
            ("TTFT", run.ttft_ms),
            ("ITL", run.itl_ms),
            ("E2E", run.e2e_ms),
        ] {
            if p.count == 0 || !(p.p50 <= p.p95 && p.p95 <= p.p99 && p.p99 <= p.max + 1e-9) {
                bad.push(format!(
                    "{name}: {what} percentiles missing or out of order: {p:?}"
                ));
            }
        }
        if !(0.0..=1.0).contains(&run.kv_spread_mean) || run.samples.is_empty() {
            bad.push(format!(
                "{name}: KV spread {} from {} samples",
                run.kv_spread_mean,
                run.samples.len()
            ));
        }
        let quantiles = run.ttft_quantiles_ms.len() as u64;
        if quantiles != run.completed.min(crate::summary::TTFT_QUANTILES as u64)
            || run
                .ttft_quantiles_ms
                .windows(2)
                .any(|w| w.first() > w.last())
        {
            bad.push(format!(
                "{name}: {quantiles} TTFT quantiles (not sorted, or not min(1000, completed)) for {} requests",
                run.completed
            ));
        }
        let served: u64 = run.per_engine_requests.iter().sum();
        if served != run.completed {
            bad.push(format!(
                "{name}: engines report {served} answers for {} completed requests",
                run.completed
            ));
        }
    }
    bad
}

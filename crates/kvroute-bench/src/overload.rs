//! The overload experiment (`kvroute-bench overload`, `make sim-overload`):
//! admission control in the fleet simulation.
//!
//! One family of the suite, at a multiple of its calibrated load, with
//! each session given an objective by a seeded coin: `batch` (priority -1,
//! sheddable) for a share of them, `interactive` (priority 1) for the
//! rest. The same workload runs through:
//!
//! - round robin (modelled), to show the load is an overload: the
//!   engines' waiting queues by quarter of the arrival window;
//! - kvroute with both objectives configured and admission off;
//! - kvroute with admission on (`admission.enabled`, the defaults
//!   otherwise, unless `--kvroute-config` says more).
//!
//! Per objective: requests, completed, shed by the gateway, TTFT p50 and
//! p95 of completed requests (from the client's send, so time held in the
//! gateway counts), output tokens of completed requests, and goodput:
//! those tokens per second from the first arrival to the last answer (the
//! rate at which the fleet does useful work; without admission a run
//! serves every request, late, so its total is larger and its run
//! longer). The headline ratios compare the two kvroute runs: the
//! `interactive` TTFT p95 with admission over without, and total goodput
//! with over without.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::families::{self, FamilyOptions};
use crate::sim::{self, routers};
use crate::summary::ObjectiveFigures;
use crate::workload::Workload;

pub use crate::workload::{BATCH, INTERACTIVE};

/// How to run the experiment.
#[derive(Debug, Clone)]
pub struct Options {
    pub family: String,
    pub replicas: usize,
    pub duration_s: f64,
    pub load: f64,
    /// Share of sessions that are `batch`.
    pub sheddable: f64,
    pub seed: u64,
    /// kvroute plugin JSON merged under both kvroute runs (without
    /// `hosts`, `objectives` and `admission.enabled`, which the runs set).
    pub kvroute_config: serde_json::Value,
    pub engine: kvroute_sim::engine::EngineConfig,
    pub progress: bool,
}

/// One objective's figures in one run.
#[derive(Debug, Clone, Serialize)]
pub struct Class {
    pub objective: String,
    pub requests: u64,
    pub completed: u64,
    pub shed: u64,
    pub failed: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub output_tokens: u64,
    pub goodput_tokens_per_s: f64,
}

/// One run.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub label: String,
    pub classes: Vec<Class>,
    /// Output tokens of every completed request.
    pub output_tokens: u64,
    pub goodput_tokens_per_s: f64,
    pub duration_s: f64,
    pub preemptions: f64,
    /// Mean waiting requests per engine in each quarter of the arrival
    /// window.
    pub waiting_by_quarter: [f64; 4],
    /// kvroute's admission counters (empty for the peer).
    pub counters: BTreeMap<String, u64>,
}

/// The experiment's result.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub workload: String,
    pub requests: usize,
    pub runs: Vec<Run>,
    /// `interactive` TTFT p95 with admission / without.
    pub interactive_p95_ratio: f64,
    /// Total goodput with admission / without.
    pub goodput_ratio: f64,
}

/// The family with objectives assigned per session.
pub fn workload(o: &Options) -> Result<Workload, String> {
    let mut wl = families::generate(
        &o.family,
        &FamilyOptions {
            replicas: o.replicas,
            duration_s: o.duration_s,
            load: o.load,
            seed: o.seed,
        },
    )?;
    crate::workload::assign_objectives(&mut wl, o.sheddable, o.seed);
    Ok(wl)
}

fn kvroute_config(base: &serde_json::Value, enabled: bool) -> serde_json::Value {
    let mut m = base.as_object().cloned().unwrap_or_default();
    m.insert(
        "objectives".to_owned(),
        serde_json::json!({INTERACTIVE: {"priority": 1}, BATCH: {"priority": -1}}),
    );
    let mut admission = m
        .get("admission")
        .and_then(|a| a.as_object().cloned())
        .unwrap_or_default();
    admission.insert("enabled".to_owned(), serde_json::json!(enabled));
    m.insert("admission".to_owned(), serde_json::Value::Object(admission));
    serde_json::Value::Object(m)
}

fn class(name: &str, f: &ObjectiveFigures) -> Class {
    Class {
        objective: name.to_owned(),
        requests: f.requests,
        completed: f.completed,
        shed: f.shed,
        failed: f.failed,
        ttft_p50_ms: f.ttft_ms.p50,
        ttft_p95_ms: f.ttft_ms.p95,
        output_tokens: f.output_tokens,
        goodput_tokens_per_s: f.goodput_tokens_per_s,
    }
}

/// Runs the experiment.
pub fn run(o: &Options) -> Result<Report, String> {
    if !(o.sheddable >= 0.0 && o.sheddable <= 1.0) {
        return Err(format!(
            "--sheddable {} must be between 0 and 1",
            o.sheddable
        ));
    }
    let wl = workload(o)?;
    let opts = sim::Options {
        engines: o.replicas,
        gateways: 1,
        spread: sim::Spread::Request,
        collectors: sim::Collectors::Shared,
        engine: o.engine.clone(),
        model: "meta-llama/Llama-3.1-8B-Instruct".to_owned(),
        seed: o.seed,
        session_header: true,
        flat_prompt: false,
        sample_s: 1.0,
        progress: o.progress,
        records: false,
        single_steps: false,
        a100_engines: 0,
    };
    let plan = [
        ("round-robin (modelled)", "round-robin", None),
        ("kvroute, admission off", "kvroute", Some(false)),
        ("kvroute, admission on", "kvroute", Some(true)),
    ];
    let mut runs = Vec::new();
    for (label, name, admission) in plan {
        let setup = routers::Setup {
            engines: o.replicas,
            gateways: 1,
            workers: 1,
            seed: o.seed,
            kvroute_config: admission.map_or(serde_json::Value::Null, |on| {
                kvroute_config(&o.kvroute_config, on)
            }),
            collector_s: 0.25,
            gateway_clock_scale: 1.0,
            headers_at_submit: false,
            prefill_rates: Vec::new(),
        };
        let mut router = routers::build(name, &setup)?;
        let out = sim::run(&wl, router.as_mut(), &opts);
        let s = &out.summary;
        let duration = s.duration_s;
        let classes: Vec<Class> = s.objectives.iter().map(|(n, f)| class(n, f)).collect();
        let span = wl.description.span_s.max(1e-9);
        let mut quarters = [0.0; 4];
        let mut counts = [0usize; 4];
        for sample in &s.samples {
            let q = ((sample.t_s / span) * 4.0).floor();
            if !(0.0..4.0).contains(&q) {
                continue;
            }
            let q = q as usize;
            let waiting: Vec<f64> = sample.engines.iter().flatten().map(|e| e.waiting).collect();
            if let (Some(sum), Some(c)) = (quarters.get_mut(q), counts.get_mut(q)) {
                *sum += waiting.iter().sum::<f64>() / waiting.len().max(1) as f64;
                *c += 1;
            }
        }
        for (sum, c) in quarters.iter_mut().zip(counts) {
            *sum /= c.max(1) as f64;
        }
        let run = Run {
            label: label.to_owned(),
            output_tokens: classes.iter().map(|c| c.output_tokens).sum(),
            goodput_tokens_per_s: classes.iter().map(|c| c.output_tokens).sum::<u64>() as f64
                / duration.max(1e-9),
            classes,
            duration_s: duration,
            preemptions: s.preemptions,
            waiting_by_quarter: quarters,
            counters: out
                .counters
                .into_iter()
                .filter(|(k, _)| k.starts_with("kvroute_admission"))
                .collect(),
        };
        if o.progress {
            eprintln!("{}", lines(&run).join("\n"));
        }
        runs.push(run);
    }
    let p95 = |r: Option<&Run>| {
        r.and_then(|r| r.classes.iter().find(|c| c.objective == INTERACTIVE))
            .map_or(f64::NAN, |c| c.ttft_p95_ms)
    };
    let (off, on) = (runs.get(1), runs.get(2));
    let goodput = |r: Option<&Run>| r.map_or(f64::NAN, |r| r.goodput_tokens_per_s);
    Ok(Report {
        workload: wl.description.summary.clone(),
        requests: wl.requests(),
        interactive_p95_ratio: p95(on) / p95(off),
        goodput_ratio: goodput(on) / goodput(off),
        runs,
    })
}

fn lines(r: &Run) -> Vec<String> {
    let mut out = vec![format!(
        "  {}: goodput {:.0} output tokens/s over {:.0} s, {:.0} preemptions, waiting per engine by quarter {:.1} / {:.1} / {:.1} / {:.1}",
        r.label,
        r.goodput_tokens_per_s,
        r.duration_s,
        r.preemptions,
        r.waiting_by_quarter[0],
        r.waiting_by_quarter[1],
        r.waiting_by_quarter[2],
        r.waiting_by_quarter[3]
    )];
    for c in &r.classes {
        out.push(format!(
            "    {}: {} requests, {} completed, {} shed, TTFT p50 {:.0} / p95 {:.0} ms, goodput {:.0} tokens/s",
            c.objective, c.requests, c.completed, c.shed, c.ttft_p50_ms, c.ttft_p95_ms, c.goodput_tokens_per_s
        ));
    }
    out
}

/// The report as Markdown.
pub fn markdown(r: &Report) -> String {
    let mut md = format!(
        "Workload: {} ({} requests).\n\n\
         | run | objective | requests | completed | shed | TTFT p50 / p95 (ms) | output tokens | goodput (output tokens/s) |\n\
         |---|---|---|---|---|---|---|---|\n",
        r.workload, r.requests
    );
    for run in &r.runs {
        for c in &run.classes {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {:.0} / {:.0} | {} | {:.0} |\n",
                run.label,
                c.objective,
                c.requests,
                c.completed,
                c.shed,
                c.ttft_p50_ms,
                c.ttft_p95_ms,
                c.output_tokens,
                c.goodput_tokens_per_s
            ));
        }
        md.push_str(&format!(
            "| {} | all | | | | | {} | {:.0} |\n",
            run.label, run.output_tokens, run.goodput_tokens_per_s
        ));
    }
    md.push_str("\n| run | waiting per engine, by quarter of the arrivals | preemptions | run length (s) |\n|---|---|---|---|\n");
    for run in &r.runs {
        let w = run.waiting_by_quarter;
        md.push_str(&format!(
            "| {} | {:.1} / {:.1} / {:.1} / {:.1} | {:.0} | {:.0} |\n",
            run.label, w[0], w[1], w[2], w[3], run.preemptions, run.duration_s
        ));
    }
    md.push_str(&format!(
        "\n`{INTERACTIVE}` TTFT p95 with admission / without: **{:.2}x**; total goodput with / without: **{:.3}x**.\n",
        r.interactive_p95_ratio, r.goodput_ratio
    ));
    md
}

/// Writes overload.json and overload.md into `dir`.
pub fn write(dir: &Path, r: &Report) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let json = serde_json::to_string_pretty(r).map_err(|e| e.to_string())?;
    let p = dir.join("overload.json");
    std::fs::write(&p, json).map_err(|e| format!("{}: {e}", p.display()))?;
    let p = dir.join("overload.md");
    std::fs::write(&p, markdown(r)).map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(())
}

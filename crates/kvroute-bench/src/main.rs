//! `kvroute-bench`: replay a workload through one router, or build the
//! comparison report from several runs. See `scripts/bench.py` (`make bench`)
//! for the whole comparison.
//!
//! ```text
//! kvroute-bench describe --trace T --window 0:300 --rate 2
//! kvroute-bench replay --router kvroute --target http://127.0.0.1:10000 \
//!     --engines http://127.0.0.1:8001,http://127.0.0.1:8002 --time-scale 10 \
//!     --trace T --window 0:300 --rate 2 --out runs/kvroute.json
//! kvroute-bench report --out bench/results --check runs/*.json
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use kvroute_bench::families::{self, FamilyOptions};
use kvroute_bench::records;
use kvroute_bench::replay::{self, Options};
use kvroute_bench::report::{self, Report};
use kvroute_bench::sim::{self, routers, Collectors, Spread};
use kvroute_bench::summary::{RunInfo, RunSummary};
use kvroute_bench::workload::{
    self, GroupOptions, SessionOptions, TraceKey, TraceOptions, Workload,
};

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    version,
    about = "Routing-quality benchmark on the simulated fleet"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print what a workload holds, without sending anything.
    Describe(WorkloadArgs),
    /// Replay a workload through one router; write its run summary (JSON).
    Replay(Box<ReplayArgs>),
    /// Build report.json, report.md and the SVG plots from run summaries.
    Report(ReportArgs),
    /// Run a workload through routers in the fleet simulation (virtual
    /// time); write report.json, report.md, the plots and timing.json.
    Simulate(Box<SimulateArgs>),
    /// The simulation suite: every family and the trace through every
    /// router at one fleet size and K gateways, then a fleet-size series;
    /// writes the reports, suite.json, plots and simulation.md.
    Suite(SuiteArgs),
    /// Admission control under overload in the fleet simulation: one
    /// family with a sheddable and a protected objective, through round
    /// robin and kvroute with admission off and on; writes overload.json
    /// and overload.md.
    Overload(Box<OverloadArgs>),
}

#[derive(Debug, Args)]
struct OverloadArgs {
    /// Directory for overload.json and overload.md.
    #[arg(long)]
    out: PathBuf,
    /// The family (chat, groups, mix, agent, bursts, ramp, tenants).
    #[arg(long, default_value = "bursts")]
    family: String,
    /// Simulated engines (the family is sized for them).
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// Seconds of arrivals (modelled).
    #[arg(long, default_value_t = 300.0)]
    duration: f64,
    /// Multiplies the family's calibrated arrival rate.
    #[arg(long, default_value_t = 2.0)]
    load: f64,
    /// Share of sessions whose objective is `batch` (sheddable).
    #[arg(long, default_value_t = 0.5)]
    sheddable: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// kvroute plugin config merged under both kvroute runs (JSON object;
    /// e.g. '{"admission":{"maxPendingS":0.5}}').
    #[arg(long, default_value = "{}")]
    kvroute_config: String,
    #[command(flatten)]
    engine: EngineArgs,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Args)]
struct SuiteArgs {
    /// Directory for the per-run reports, suite.json, the plots and simulation.md.
    #[arg(long)]
    out: PathBuf,
    /// Also write the Markdown here (e.g. docs/simulation.md; its plots are
    /// referenced as <name of --out>/*.svg, so put --out next to it).
    #[arg(long)]
    docs: Option<PathBuf>,
    /// A Mooncake-format trace to include (its rate scaled to the fleet).
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    replicas: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    gateways: Vec<usize>,
    /// Seconds of arrivals per family.
    #[arg(long, default_value_t = 300.0)]
    duration: f64,
    /// Routers (default: all).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Fleet sizes of the scale series (empty: none).
    #[arg(long, value_delimiter = ',')]
    scale: Vec<usize>,
    #[arg(long, default_value = "chat")]
    scale_family: String,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-request,llm-d,kvroute"
    )]
    scale_routers: Vec<String>,
    #[arg(long, default_value_t = 120.0)]
    scale_duration: f64,
    /// Reuse the runs whose report.json and timing.json are already under --out.
    #[arg(long)]
    resume: bool,
    /// With --resume: run these routers again and keep every other
    /// router's stored run (e.g. `--rerun kvroute` after a change to
    /// kvroute only; the peers' modelled runs do not depend on it). The
    /// Markdown says which routers ran again.
    #[arg(long, value_delimiter = ',', requires = "resume")]
    rerun: Vec<String>,
    /// Send no session header: the setting of most OpenAI-style clients
    /// (kvroute keys each conversation by its text to the first question).
    #[arg(long)]
    no_session_header: bool,
    /// Send each conversation as one user message (its messages' texts
    /// joined), as through a bare prompt: only the bytes say where a shared
    /// system prompt ends.
    #[arg(long)]
    flat_prompt: bool,
    /// Seeds of the fleet-size section: with several (`1,2,3`) every run is
    /// made once per seed and the tables give the median.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    seed: Vec<u64>,
    /// Runs made at once, one thread each (the scale series always runs one
    /// at a time); the modelled figures are the same at any value, the
    /// wall-time columns are not.
    #[arg(long, default_value_t = 1)]
    jobs: usize,
    /// Only these workloads ("mooncake" and family names; default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// kvroute's plugin JSON without `hosts`, e.g. '{"fleet":{"memoryKnee":0.7}}'.
    #[arg(long, default_value = "{}")]
    kvroute_config: String,
    /// Multiplies every workload's calibrated arrival rate.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// This share of each fleet's engines model an A100 80GB instead of an
    /// H100 (a fleet of two GPU generations; prefill about 0.3x).
    #[arg(long, default_value_t = 0.0)]
    a100_share: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SpreadArg {
    Request,
    Session,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CollectorsArg {
    Shared,
    PerGateway,
}

/// The simulated engines' configuration (the same flags as kvroute-sim).
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// KV-cache capacity per engine, in blocks of 16 tokens.
    #[arg(long)]
    kv_blocks: Option<usize>,
    #[arg(long)]
    max_num_seqs: Option<usize>,
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    #[arg(long)]
    step_fixed_us: Option<f64>,
    #[arg(long)]
    prefill_token_us: Option<f64>,
    #[arg(long)]
    decode_seq_us: Option<f64>,
    #[arg(long)]
    context_token_us: Option<f64>,
}

impl EngineArgs {
    fn config(&self) -> Result<kvroute_sim::engine::EngineConfig, String> {
        let d = kvroute_sim::engine::EngineConfig::default();
        let c = kvroute_sim::engine::EngineConfig {
            kv_blocks: self.kv_blocks.unwrap_or(d.kv_blocks),
            max_num_seqs: self.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_num_batched_tokens: self
                .max_num_batched_tokens
                .unwrap_or(d.max_num_batched_tokens),
            max_model_len: d.max_model_len,
            step_fixed_us: self.step_fixed_us.unwrap_or(d.step_fixed_us),
            prefill_token_us: self.prefill_token_us.unwrap_or(d.prefill_token_us),
            decode_seq_us: self.decode_seq_us.unwrap_or(d.decode_seq_us),
            context_token_us: self.context_token_us.unwrap_or(d.context_token_us),
        };
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

#[derive(Debug, Args)]
struct SimulateArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Routers, comma-separated, in report order (default: all). At K > 1
    /// `kvroute`'s gateways get the others' pending prefill and key
    /// placements from their collector, as the real collector gives them.
    /// Not in the default list: `kvroute-alone`, gateways that read no
    /// other gateway (sidecars without peers), `kvroute-known-rates`,
    /// snapshots that carry each replica's true prefill rate (an upper
    /// bound: no collector measures it yet), and
    /// `kvroute-oracle-shared-load` and `kvroute-oracle-shared-index`,
    /// kvroute whose gateways share one in-flight load table or one prefix
    /// index, upper bounds; `oracle-first-token`, each
    /// request to the engine where its first token comes soonest, by
    /// stepping a copy of every engine (perfect knowledge of the present).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// Simulated engines.
    #[arg(long, default_value_t = 16)]
    engines: usize,
    /// Gateway instances each router runs as.
    #[arg(long, default_value_t = 1)]
    gateways: usize,
    /// How requests are spread over the gateways.
    #[arg(long, value_enum, default_value = "request")]
    spread: SpreadArg,
    /// kvroute releases the prompt part of its charge when the engine
    /// admits the request, not with the first token: what the filter did
    /// while it released at the response headers (vLLM and kvroute-sim
    /// send a stream's headers on admission). Reproduces measurements made
    /// before it waited for the first body byte.
    #[arg(long)]
    headers_at_submit: bool,
    /// Envoy worker threads per gateway (kvroute: shared data per gateway,
    /// caches per worker; round robin: a position per worker).
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// One collector for all gateways, or one per gateway.
    #[arg(long, value_enum, default_value = "shared")]
    collectors: CollectorsArg,
    /// kvroute's collector interval, modelled ms (kvroute-collector's default).
    #[arg(long, default_value_t = 250.0)]
    collector_ms: f64,
    /// kvroute's gateway clock runs this many times slower than modelled
    /// time (the real-time bench's time scale, to compare with it: its
    /// gateways' timers are in real time). 1: production.
    #[arg(long, default_value_t = 1.0)]
    gateway_clock_scale: f64,
    /// kvroute plugin config overrides (JSON object; `hosts` is the fleet).
    #[arg(long, default_value = "{}")]
    kvroute_config: String,
    /// Model name sent in requests.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// Send no session header.
    #[arg(long)]
    no_session_header: bool,
    /// Send each conversation as one user message (its messages' texts
    /// joined), as through a bare prompt: only the bytes say where a shared
    /// system prompt ends.
    #[arg(long)]
    flat_prompt: bool,
    /// Engine timeline sampling interval, modelled ms.
    #[arg(long, default_value_t = 500.0)]
    sample_ms: f64,
    /// Directory for report.json, report.md, the plots and timing.json.
    #[arg(long)]
    out: PathBuf,
    /// Fail (exit 1) if the report's consistency checks fail.
    #[arg(long)]
    check: bool,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    /// Leave the engine timeline out of report.json (large fleets).
    #[arg(long)]
    no_samples: bool,
    /// Also write records-<router>.jsonl: one JSON line per answered
    /// request (session, turn, gateway, engine, TTFT, queue, prefill,
    /// cached tokens, kvroute's reason and key), in completion order.
    #[arg(long)]
    records: bool,
    /// Step the engines one step at a time, never in runs of decode steps
    /// (the same report, slower; for checking the runs).
    #[arg(long)]
    single_steps: bool,
    /// The last this many engines model an A100 80GB instead of an H100
    /// (a fleet of two GPU generations; prefill about 0.3x). The engine
    /// flags above set the others.
    #[arg(long, default_value_t = 0)]
    a100_engines: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// A Mooncake-format trace (--trace).
    Trace,
    /// Generated multi-turn chat sessions.
    Sessions,
    /// Generated shared-prefix groups.
    Groups,
    /// A family of the workload suite (--family; see `families`).
    Family,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum KeyArg {
    None,
    FirstBlock,
}

#[derive(Debug, Args)]
struct WorkloadArgs {
    #[arg(long, value_enum, default_value = "trace")]
    workload: Kind,
    /// Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace window, seconds of trace time: START:END.
    #[arg(long, default_value = "0:inf", value_parser = parse_window)]
    window: (f64, f64),
    /// Arrival-rate multiplier for the trace (2: twice as fast).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// At most this many trace requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Session key of trace requests: none, or the first hash id (requests opening with the same block share a key).
    #[arg(long, value_enum, default_value = "first-block")]
    trace_key: KeyArg,
    /// The served model's context in tokens: longer trace prompts are cut to fit (0: no limit).
    #[arg(long, default_value_t = 131_072)]
    max_context: usize,
    /// Seed of the generators and of the pseudo-text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    // Sessions.
    #[arg(long, default_value_t = SessionOptions::default().sessions)]
    sessions: usize,
    /// New sessions per second.
    #[arg(long, default_value_t = SessionOptions::default().rate)]
    session_rate: f64,
    #[arg(long, default_value_t = SessionOptions::default().system_prompts)]
    system_prompts: usize,
    #[arg(long, default_value_t = SessionOptions::default().system_tokens)]
    system_tokens: usize,
    #[arg(long, default_value_t = SessionOptions::default().mean_turns)]
    turns: f64,
    #[arg(long, default_value_t = SessionOptions::default().user_tokens)]
    user_tokens: f64,
    #[arg(long, default_value_t = SessionOptions::default().output_tokens)]
    output_tokens: f64,
    #[arg(long, default_value_t = SessionOptions::default().think_s)]
    think_s: f64,
    // Groups.
    #[arg(long, default_value_t = GroupOptions::default().groups)]
    groups: usize,
    #[arg(long, default_value_t = GroupOptions::default().users)]
    users: usize,
    #[arg(long, default_value_t = GroupOptions::default().prefix_tokens)]
    prefix_tokens: usize,
    #[arg(long, default_value_t = GroupOptions::default().question_tokens)]
    question_tokens: f64,
    #[arg(long, default_value_t = GroupOptions::default().requests)]
    group_requests: usize,
    /// Group requests per second.
    #[arg(long, default_value_t = GroupOptions::default().rate)]
    group_rate: f64,
    // Families.
    /// The family (chat, groups, mix, agent, bursts, ramp, tenants).
    #[arg(long, default_value = "chat")]
    family: String,
    /// The fleet size the family's load is sized for.
    #[arg(long, default_value_t = 4)]
    family_replicas: usize,
    /// Seconds of the family's arrivals (modelled).
    #[arg(long, default_value_t = 600.0)]
    duration: f64,
    /// Multiplies the family's calibrated arrival rate.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    /// Give each session an objective (sent as `x-gateway-inference-objective`):
    /// `batch` for this share of them (seeded), `interactive` for the rest.
    #[arg(long)]
    sheddable: Option<f64>,
}

fn parse_window(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or("expected START:END in seconds, e.g. 0:300")?;
    let start: f64 = a
        .trim()
        .parse()
        .map_err(|_| format!("window start {a:?} is not a number"))?;
    let end: f64 = b
        .trim()
        .parse()
        .map_err(|_| format!("window end {b:?} is not a number"))?;
    if !(start >= 0.0 && end > start) {
        return Err(format!(
            "window {start}:{end} must satisfy 0 <= START < END"
        ));
    }
    Ok((start, end))
}

impl WorkloadArgs {
    fn build(&self) -> Result<Workload, String> {
        let mut wl = self.build_sessions()?;
        if let Some(share) = self.sheddable {
            if !(0.0..=1.0).contains(&share) {
                return Err(format!("--sheddable {share} must be between 0 and 1"));
            }
            workload::assign_objectives(&mut wl, share, self.seed);
        }
        Ok(wl)
    }

    fn build_sessions(&self) -> Result<Workload, String> {
        match self.workload {
            Kind::Trace => {
                let path = self
                    .trace
                    .as_ref()
                    .ok_or("--workload trace needs --trace FILE")?;
                workload::from_mooncake(
                    path,
                    &TraceOptions {
                        start_s: self.window.0,
                        end_s: self.window.1,
                        rate: self.rate,
                        max_requests: self.max_requests,
                        max_context: self.max_context,
                        key: match self.trace_key {
                            KeyArg::None => TraceKey::None,
                            KeyArg::FirstBlock => TraceKey::FirstBlock,
                        },
                    },
                )
                .map_err(|e| e.to_string())
            }
            Kind::Sessions => {
                if !(self.session_rate > 0.0 && self.turns >= 1.0) {
                    return Err("--session-rate must be > 0 and --turns >= 1".to_owned());
                }
                Ok(workload::sessions(&SessionOptions {
                    sessions: self.sessions,
                    rate: self.session_rate,
                    system_prompts: self.system_prompts,
                    system_tokens: self.system_tokens,
                    mean_turns: self.turns,
                    user_tokens: self.user_tokens,
                    output_tokens: self.output_tokens,
                    think_s: self.think_s,
                    seed: self.seed,
                }))
            }
            Kind::Groups => {
                if self.group_rate.is_nan()
                    || self.group_rate <= 0.0
                    || self.groups == 0
                    || self.users == 0
                {
                    return Err(
                        "--group-rate must be > 0, --groups and --users at least 1".to_owned()
                    );
                }
                Ok(workload::groups(&GroupOptions {
                    groups: self.groups,
                    users: self.users,
                    prefix_tokens: self.prefix_tokens,
                    question_tokens: self.question_tokens,
                    output_tokens: self.output_tokens,
                    requests: self.group_requests,
                    rate: self.group_rate,
                    seed: self.seed,
                }))
            }
            Kind::Family => families::generate(
                &self.family,
                &FamilyOptions {
                    replicas: self.family_replicas,
                    duration_s: self.duration,
                    load: self.load,
                    seed: self.seed,
                },
            ),
        }
    }
}

#[derive(Debug, Args)]
struct ReplayArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Name of the router under test (in the report).
    #[arg(long)]
    router: String,
    /// One line on how the router was configured (in the report).
    #[arg(long, default_value = "")]
    setup: String,
    /// Independent instances of the router behind --target (in the report;
    /// the front that spreads requests over them is the caller's).
    #[arg(long, default_value_t = 1)]
    gateways: usize,
    /// Base URL of the router.
    #[arg(long)]
    target: String,
    /// Base URLs of the engines, comma-separated (sampled for KV, cache and preemption figures).
    #[arg(long, value_delimiter = ',', required = true)]
    engines: Vec<String>,
    /// Model name sent in requests.
    #[arg(long, default_value = "meta-llama/Llama-3.1-8B-Instruct")]
    model: String,
    /// The simulator's --time-scale (modelled seconds per real second).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Header carrying the session key; empty to send none.
    #[arg(long, default_value = "x-session-id")]
    session_header: String,
    /// Send each conversation as one user message (its messages' texts
    /// joined), as through a bare prompt: only the bytes say where a shared
    /// system prompt ends.
    #[arg(long)]
    flat_prompt: bool,
    /// Per-request time limit, modelled seconds.
    #[arg(long, default_value_t = 1800.0)]
    timeout_s: f64,
    /// Engine sampling interval, real milliseconds.
    #[arg(long, default_value_t = 100)]
    sample_ms: u64,
    /// Where to write the run summary (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Also write every request as a JSON line here (send time in Unix ms,
    /// status, error, TTFT, engine, the router's named host, cached tokens).
    #[arg(long)]
    records: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ReportArgs {
    /// Directory for report.json, report.md and the plots.
    #[arg(long)]
    out: PathBuf,
    /// A line of setup description for the report (repeatable).
    #[arg(long = "setup")]
    setup: Vec<String>,
    /// Fail (exit 1) if the harness's consistency checks fail.
    #[arg(long)]
    check: bool,
    /// Run summaries, in the order the report lists them.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let result = match cli.command {
        Command::Describe(w) => describe(&w),
        Command::Replay(r) => run_replay(&r),
        Command::Report(r) => run_report(&r),
        Command::Simulate(s) => run_simulate(&s),
        Command::Suite(s) => run_suite(&s),
        Command::Overload(o) => run_overload(&o),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvroute-bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn describe(w: &WorkloadArgs) -> Result<ExitCode, String> {
    let wl = w.build()?;
    let json = serde_json::to_string_pretty(&wl.description).map_err(|e| e.to_string())?;
    println!("{json}");
    Ok(ExitCode::SUCCESS)
}

fn run_replay(a: &ReplayArgs) -> Result<ExitCode, String> {
    if !(a.time_scale.is_finite() && a.time_scale > 0.0) {
        return Err(format!(
            "--time-scale {}: must be a positive number",
            a.time_scale
        ));
    }
    let wl = a.workload.build()?;
    let opts = Options {
        target: a.target.clone(),
        engines: a.engines.clone(),
        model: a.model.clone(),
        time_scale: a.time_scale,
        session_header: (!a.session_header.is_empty()).then(|| a.session_header.clone()),
        flat_prompt: a.flat_prompt,
        timeout_s: a.timeout_s,
        sample_every: Duration::from_millis(a.sample_ms.max(10)),
        seed: a.workload.seed,
        label: a.router.clone(),
    };
    let replayed = replay::run(&wl, opts);
    if let Some(path) = &a.records {
        let file = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        records::write(&replayed.records, std::io::BufWriter::new(file))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let summary = RunSummary::new(
        RunInfo {
            router: &a.router,
            setup: &a.setup,
            workload: &wl.description,
            time_scale: a.time_scale,
            gateways: a.gateways.max(1),
        },
        &replayed,
    );
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let json = serde_json::to_vec(&summary).map_err(|e| e.to_string())?;
    std::fs::write(&a.out, json).map_err(|e| format!("{}: {e}", a.out.display()))?;
    println!(
        "{}: {} requests, {} errors, TTFT p50 {:.0} ms p95 {:.0} ms p99 {:.0} ms ({:.1}x the no-queue floor at p95), hit rate {:.1} % at first admission (LRU ceiling {:.1} %), KV spread {:.3}, simulator lag {:.1} %",
        summary.router,
        summary.requests,
        summary.errors,
        summary.ttft_ms.p50,
        summary.ttft_ms.p95,
        summary.ttft_ms.p99,
        summary.ttft_p95_over_floor,
        100.0 * summary.hit_rate,
        100.0 * summary.ceilings.lru_hit_rate,
        summary.kv_spread_mean,
        100.0 * summary.sim_lag_fraction
    );
    Ok(ExitCode::SUCCESS)
}

fn run_overload(a: &OverloadArgs) -> Result<ExitCode, String> {
    let config: serde_json::Value = serde_json::from_str(&a.kvroute_config)
        .map_err(|e| format!("--kvroute-config: not JSON: {e}"))?;
    if !config.is_object() {
        return Err("--kvroute-config: must be a JSON object".to_owned());
    }
    if a.engines == 0 {
        return Err("--engines must be positive".to_owned());
    }
    let o = kvroute_bench::overload::Options {
        family: a.family.clone(),
        replicas: a.engines,
        duration_s: a.duration,
        load: a.load,
        sheddable: a.sheddable,
        seed: a.seed,
        kvroute_config: config,
        engine: a.engine.config()?,
        progress: !a.quiet,
    };
    eprintln!(
        "overload: family {} at {}x its load on {} engines, {} s of arrivals, {:.0} % sheddable",
        a.family,
        a.load,
        a.engines,
        a.duration,
        100.0 * a.sheddable
    );
    let report = kvroute_bench::overload::run(&o)?;
    kvroute_bench::overload::write(&a.out, &report)?;
    println!("{}", kvroute_bench::overload::markdown(&report));
    eprintln!("wrote {}/overload.json and overload.md", a.out.display());
    Ok(ExitCode::SUCCESS)
}

fn run_simulate(a: &SimulateArgs) -> Result<ExitCode, String> {
    let wl = a.workload.build()?;
    let engine = a.engine.config()?;
    let config: serde_json::Value = serde_json::from_str(&a.kvroute_config)
        .map_err(|e| format!("--kvroute-config: not JSON: {e}"))?;
    if a.a100_engines > a.engines {
        return Err(format!(
            "--a100-engines {} is more than --engines {}",
            a.a100_engines, a.engines
        ));
    }
    if !(a.collector_ms > 0.0 && a.sample_ms > 0.0 && a.engines > 0 && a.gateways > 0) {
        return Err(
            "--engines, --gateways, --collector-ms and --sample-ms must be positive".to_owned(),
        );
    }
    let names: Vec<String> = if a.routers.is_empty() {
        routers::ALL.iter().map(|s| (*s).to_owned()).collect()
    } else {
        a.routers.clone()
    };
    let opts = sim::Options {
        engines: a.engines,
        gateways: a.gateways,
        spread: match a.spread {
            SpreadArg::Request => Spread::Request,
            SpreadArg::Session => Spread::Session,
        },
        collectors: match a.collectors {
            CollectorsArg::Shared => Collectors::Shared,
            CollectorsArg::PerGateway => Collectors::PerGateway,
        },
        engine,
        model: a.model.clone(),
        seed: a.workload.seed,
        session_header: !a.no_session_header,
        flat_prompt: a.flat_prompt,
        sample_s: a.sample_ms / 1000.0,
        progress: !a.quiet,
        records: a.records,
        single_steps: a.single_steps,
        a100_engines: a.a100_engines,
    };
    eprintln!(
        "simulate: {} ({} requests) on {} engines, {} gateway(s), routers {}",
        wl.description.summary,
        wl.requests(),
        a.engines,
        a.gateways,
        names.join(",")
    );
    let mut runs = Vec::new();
    let mut timing = Vec::new();
    for name in &names {
        let mut router = routers::build(
            name,
            &routers::Setup {
                engines: a.engines,
                gateways: a.gateways,
                workers: a.workers,
                seed: a.workload.seed,
                kvroute_config: config.clone(),
                collector_s: a.collector_ms / 1000.0,
                gateway_clock_scale: a.gateway_clock_scale,
                headers_at_submit: a.headers_at_submit,
                prefill_rates: sim::prefill_rates(&opts),
            },
        )?;
        let out = sim::run(&wl, router.as_mut(), &opts);
        let s = &out.summary;
        eprintln!(
            "  {}: TTFT p50 {:.0} / p95 {:.0} / p99 {:.0} ms ({:.1}x the floor at p95), hit rate {:.1} % (LRU ceiling {:.1} %), {:.0} preemptions, {:.1} s wall",
            s.router, s.ttft_ms.p50, s.ttft_ms.p95, s.ttft_ms.p99, s.ttft_p95_over_floor,
            100.0 * s.hit_rate, 100.0 * s.ceilings.lru_hit_rate, s.preemptions, out.wall_s
        );
        let t = sim::timing(&out);
        eprintln!(
            "    {} events, {} engine steps, peak memory {:.0} MiB{}",
            t.events,
            t.steps,
            t.peak_rss_mib,
            if t.decisions > 0 {
                format!(
                    ", decision CPU mean {:.1} µs, p99 {:.1} µs (native, wall clock)",
                    t.decision_mean_us, t.decision_p99_us
                )
            } else {
                String::new()
            }
        );
        timing.push(t);
        if a.records {
            write_sim_records(&a.out, name, &out.records)?;
        }
        let mut summary = out.summary;
        if a.no_samples {
            summary.samples.clear();
        }
        runs.push(summary);
    }
    let r = Report {
        setup: vec![
            format!(
                "Fleet simulation in virtual time: {} x kvroute-sim engine model ({} KV blocks each{}), {} gateway instance(s) per router, requests spread per {:?}, {:?} collector(s).",
                a.engines,
                opts.engine.kv_blocks,
                if a.a100_engines > 0 {
                    format!("; the last {} model an A100 80GB, the others an H100", a.a100_engines)
                } else {
                    String::new()
                },
                a.gateways,
                opts.spread,
                opts.collectors
            ),
            "Peers marked (modelled) are models of their documented algorithms (sources in crates/kvroute-bench/src/sim/routers.rs); kvroute runs kvroute-core's request path.".to_owned(),
        ],
        runs,
    };
    report::write(&r, &a.out)?;
    let json = serde_json::to_vec_pretty(&timing).map_err(|e| e.to_string())?;
    std::fs::write(a.out.join("timing.json"), json).map_err(|e| format!("timing.json: {e}"))?;
    print!("{}", report::markdown(&r));
    if a.check {
        let bad = report::check_runs(&r);
        if !bad.is_empty() {
            for b in &bad {
                eprintln!("check failed: {b}");
            }
            return Ok(ExitCode::FAILURE);
        }
        println!("checks passed: every router completed every request, figures consistent");
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `records-<router>.jsonl` in `dir` (the router's name with
/// anything but letters, digits and `-` as `-`).
fn write_sim_records(
    dir: &std::path::Path,
    router: &str,
    lines: &[sim::Line],
) -> Result<(), String> {
    let name: String = router
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("records-{}.jsonl", name.trim_matches('-')));
    let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for l in lines {
        serde_json::to_writer(&mut w, l).map_err(|e| format!("{}: {e}", path.display()))?;
        w.write_all(b"\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    w.flush().map_err(|e| format!("{}: {e}", path.display()))
}

fn run_suite(a: &SuiteArgs) -> Result<ExitCode, String> {
    let all = || {
        routers::ALL
            .iter()
            .map(|s| (*s).to_owned())
            .collect::<Vec<_>>()
    };
    let command = std::env::args()
        .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
        .collect::<Vec<_>>()
        .join(" ");
    let o = kvroute_bench::suite::SuiteOptions {
        out: a.out.clone(),
        docs: a.docs.clone(),
        trace: a.trace.clone(),
        replicas: a.replicas,
        gateways: a.gateways.clone(),
        duration_s: a.duration,
        routers: if a.routers.is_empty() {
            all()
        } else {
            a.routers.clone()
        },
        scale: a.scale.clone(),
        scale_family: a.scale_family.clone(),
        scale_routers: a.scale_routers.clone(),
        scale_duration_s: a.scale_duration,
        seeds: a.seed.clone(),
        jobs: a.jobs,
        command,
        resume: a.resume,
        rerun: a.rerun.clone(),
        only: a.only.clone(),
        kvroute_config: serde_json::from_str(&a.kvroute_config)
            .map_err(|e| format!("--kvroute-config: not JSON: {e}"))?,
        session_header: !a.no_session_header,
        flat_prompt: a.flat_prompt,
        load: a.load,
        a100_share: a.a100_share,
    };
    let rows = kvroute_bench::suite::run(&o)?;
    println!(
        "suite: {} runs; wrote {}/simulation.md, suite.json, the plots{}",
        rows.len(),
        a.out.display(),
        a.docs
            .as_ref()
            .map_or(String::new(), |d| format!(" and {}", d.display()))
    );
    Ok(ExitCode::SUCCESS)
}

fn run_report(a: &ReportArgs) -> Result<ExitCode, String> {
    let mut runs = Vec::new();
    for p in &a.runs {
        let bytes = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
        let run: RunSummary = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{}: not a run summary: {e}", p.display()))?;
        runs.push(run);
    }
    let r = Report {
        setup: a.setup.clone(),
        runs,
    };
    report::write(&r, &a.out)?;
    print!("{}", report::markdown(&r));
    println!(
        "\nwrote {}/report.{{json,md}}, ttft-cdf.svg, kv-utilisation.svg",
        a.out.display()
    );
    if a.check {
        let bad = report::check(&r);
        if !bad.is_empty() {
            for b in &bad {
                eprintln!("check failed: {b}");
            }
            return Ok(ExitCode::FAILURE);
        }
        println!("checks passed: every router completed, figures consistent, kvroute beats round robin on hit rate");
    }
    Ok(ExitCode::SUCCESS)
}

//! `kvroute-sim`: simulated inference engines for kvroute's benchmarks.
//!
//! ```text
//! kvroute-sim [--mode engine] --engines 4 --base-port 8001 [--time-scale 10] \
//!     [--kv-blocks N] [--max-num-seqs N] [--max-num-batched-tokens N] \
//!     [--step-fixed-us US] [--prefill-token-us US] [--decode-seq-us US] \
//!     [--context-token-us US] [--seed N] [--startup-delay-ms MS] \
//!     [--model NAME]... [--fault engine=1,kind=die,at=30s]...
//! kvroute-sim --mode null --engines 4 --base-port 8001
//! ```
//!
//! `engine` (the default) simulates vLLM-like engines: a paged KV cache
//! with prefix caching, continuous batching and a step-time model (see the
//! library's `engine` module). `null` answers every completion at once.
//!
//! Prints one line per engine address (`engine N on ADDR`, or `null engine
//! on ADDR`), then `ready`, and serves until it is stopped (SIGTERM /
//! SIGINT).

use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use kvroute_sim::engine::{EngineConfig, EngineFleet, FaultSpec, FleetConfig};
use kvroute_sim::null::{NullConfig, NullFleet, DEFAULT_MODEL};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// vLLM-like engines: KV cache, batching, modelled step times.
    Engine,
    /// Answer every completion at once with a small fixed body.
    Null,
}

/// Simulated inference engines on consecutive ports.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version)]
struct Cli {
    /// What the engines do with a request.
    #[arg(long, value_enum, default_value = "engine")]
    mode: Mode,
    /// How many engines.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=4096))]
    engines: u16,
    /// First engine's port; engine i listens on base-port + i (0: free ports).
    #[arg(long, default_value_t = 8001)]
    base_port: u16,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Model name served; repeat to serve several names (the first labels
    /// the metrics). Default: meta-llama/Llama-3.1-8B-Instruct.
    #[arg(long = "model")]
    models: Vec<String>,
    /// KV-cache capacity per engine, in blocks of 16 tokens.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// Most requests running at once per engine.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Most tokens computed in one step.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Fixed cost of a step, modelled microseconds.
    #[arg(long)]
    step_fixed_us: Option<f64>,
    /// Cost per prefill token, modelled microseconds.
    #[arg(long)]
    prefill_token_us: Option<f64>,
    /// Cost per decoding sequence in a step, modelled microseconds.
    #[arg(long)]
    decode_seq_us: Option<f64>,
    /// Cost per context token of a decoding sequence, modelled microseconds.
    #[arg(long)]
    context_token_us: Option<f64>,
    /// The last this many engines model an A100 80GB (prefill about 0.3x
    /// the H100's; the flags above set the others): a fleet of two GPU
    /// generations.
    #[arg(long, default_value_t = 0)]
    a100_engines: u16,
    /// Modelled seconds per real second (10: everything runs 10x faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the generated text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// /health answers 503 for this long (real milliseconds) after start.
    #[arg(long, default_value_t = 0)]
    startup_delay_ms: u64,
    /// A fault, e.g. engine=1,kind=die,at=30s | engine=2,kind=stall,at=10s,for=5s
    /// | engine=0,kind=error,at=5s,for=10s (modelled time from start).
    #[arg(long = "fault")]
    faults: Vec<FaultSpec>,
}

fn print_ready<I: IntoIterator<Item = String>>(lines: I) {
    let mut out = std::io::stdout().lock();
    for l in lines {
        let _ = writeln!(out, "{l}");
    }
    let _ = writeln!(out, "ready");
    let _ = out.flush();
}

fn engine_config(cli: &Cli) -> EngineConfig {
    let d = EngineConfig::default();
    EngineConfig {
        kv_blocks: cli.kv_blocks.unwrap_or(d.kv_blocks),
        max_num_seqs: cli.max_num_seqs.unwrap_or(d.max_num_seqs),
        max_num_batched_tokens: cli
            .max_num_batched_tokens
            .unwrap_or(d.max_num_batched_tokens),
        step_fixed_us: cli.step_fixed_us.unwrap_or(d.step_fixed_us),
        prefill_token_us: cli.prefill_token_us.unwrap_or(d.prefill_token_us),
        decode_seq_us: cli.decode_seq_us.unwrap_or(d.decode_seq_us),
        context_token_us: cli.context_token_us.unwrap_or(d.context_token_us),
        ..d
    }
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
    let models = if cli.models.is_empty() {
        vec![DEFAULT_MODEL.to_owned()]
    } else {
        cli.models.clone()
    };
    match cli.mode {
        Mode::Engine => {
            let cfg = FleetConfig {
                host: cli.host,
                base_port: cli.base_port,
                engines: usize::from(cli.engines),
                models,
                engine: engine_config(&cli),
                a100_engines: usize::from(cli.a100_engines),
                time_scale: cli.time_scale,
                seed: cli.seed,
                startup_delay: Duration::from_millis(cli.startup_delay_ms),
                faults: cli.faults.clone(),
            };
            let fleet = match EngineFleet::start(&cfg) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("kvroute-sim: {e}");
                    return ExitCode::FAILURE;
                }
            };
            print_ready(
                fleet
                    .addrs()
                    .iter()
                    .enumerate()
                    .map(|(i, a)| format!("engine {i} on {a}")),
            );
            fleet.join();
            ExitCode::SUCCESS
        }
        Mode::Null => {
            let cfg = NullConfig {
                host: cli.host,
                base_port: cli.base_port,
                engines: usize::from(cli.engines),
                model: models.into_iter().next().unwrap_or_default(),
            };
            let fleet = match NullFleet::start(&cfg) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("kvroute-sim: {e}");
                    return ExitCode::FAILURE;
                }
            };
            print_ready(fleet.addrs().iter().map(|a| format!("null engine on {a}")));
            fleet.join();
            ExitCode::SUCCESS
        }
    }
}

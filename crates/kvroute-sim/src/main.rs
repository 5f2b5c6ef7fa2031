//! `kvroute-sim`: simulated inference engines for kvroute's benchmarks.
//!
//! ```text
//! kvroute-sim --mode null --engines 4 --base-port 8001
//! ```
//!
//! Prints one line per engine address, then `ready`, and serves until it is
//! stopped (SIGTERM / SIGINT).

use std::io::Write;
use std::net::IpAddr;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use kvroute_sim::null::{NullConfig, NullFleet, DEFAULT_MODEL};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Answer every completion at once with a small fixed body.
    Null,
}

/// Simulated inference engines on consecutive ports.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version)]
struct Cli {
    /// What the engines do with a request.
    #[arg(long, value_enum, default_value = "null")]
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
    /// Model name served (answers and the metrics' model_name label).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
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
    match cli.mode {
        Mode::Null => {
            let cfg = NullConfig {
                host: cli.host,
                base_port: cli.base_port,
                engines: usize::from(cli.engines),
                model: cli.model,
            };
            let fleet = match NullFleet::start(&cfg) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("kvroute-sim: {e}");
                    return ExitCode::FAILURE;
                }
            };
            {
                let mut out = std::io::stdout().lock();
                for a in fleet.addrs() {
                    let _ = writeln!(out, "null engine on {a}");
                }
                let _ = writeln!(out, "ready");
                let _ = out.flush();
            }
            fleet.join();
            ExitCode::SUCCESS
        }
    }
}

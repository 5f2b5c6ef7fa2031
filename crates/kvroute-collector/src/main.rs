//! `kvroute-collector`: see the library documentation and README.md.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use kvroute_collector::config::{Cli, Settings, EXIT_CONFIG, TOKEN_ENV};
use log::info;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // --help and --version print to stdout and succeed; usage errors
            // print to stderr and exit 2.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging();
    let settings = match Settings::resolve(&cli, std::env::var(TOKEN_ENV).ok()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvroute-collector: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if settings.once {
        let snap = kvroute_collector::collect_once(&settings);
        let json = serde_json::to_string_pretty(&snap).unwrap_or_default();
        let mut out = std::io::stdout().lock();
        return if writeln!(out, "{json}").is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let engines: Vec<String> = settings.engines.iter().map(ToString::to_string).collect();
    let gateways: Vec<String> = settings
        .gateways
        .iter()
        .map(|g| g.base.clone())
        .chain(
            settings
                .gateway_services
                .iter()
                .map(|s| format!("{} (service)", s.base)),
        )
        .chain(
            settings
                .peer_gateways
                .iter()
                .map(|g| format!("{} (peer)", g.base)),
        )
        .chain(
            settings
                .peer_services
                .iter()
                .map(|s| format!("{} (peer service)", s.base)),
        )
        .collect();
    info!(
        "kvroute-collector {} as {:?}: engines [{}], gateways [{}], interval {:?}, timeout {:?}, metrics on {}",
        env!("CARGO_PKG_VERSION"),
        settings.collector_id,
        engines.join(", "),
        gateways.join(", "),
        settings.interval,
        settings.timeout,
        settings
            .metrics_addr
            .map_or_else(|| "off".to_owned(), |a| a.to_string()),
    );
    match kvroute_collector::start(settings) {
        Ok(running) => {
            running.join();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvroute-collector: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// `RUST_LOG` (default `info`) to stderr, one line per record with a UTC
/// timestamp.
fn init_logging() {
    let env = env_logger::Env::default().default_filter_or("info");
    env_logger::Builder::from_env(env)
        .format(|buf, record| {
            writeln!(buf, "{} {:<5} {}", utc_now(), record.level(), record.args())
        })
        .init();
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` without a date crate.
fn utc_now() -> String {
    let ms = kvroute_collector::now_ms();
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

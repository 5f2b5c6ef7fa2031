//! The built binary: help, exit codes and messages, `--once`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicU16;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvroute_core::fleet::Snapshot;

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the binary with `args` (no inherited token), killing it by PID if it
/// outlives `limit`.
fn run(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute-collector"));
    cmd.args(args)
        .env_remove("KVROUTE_INGEST_TOKEN")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let end = Instant::now() + limit;
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Out {
        code,
        stdout,
        stderr,
    }
}

const LIMIT: Duration = Duration::from_secs(10);

/// Arguments, environment, and what stderr must contain.
type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, Vec<&'a str>);

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-collector-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn help_lists_the_flags() {
    let out = run(&["--help"], &[], LIMIT);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    for flag in [
        "--config",
        "--engines",
        "--gateways",
        "--token-file",
        "--interval",
        "--timeout",
        "--dns-refresh",
        "--collector-id",
        "--metrics-addr",
        "--once",
        "KVROUTE_INGEST_TOKEN",
    ] {
        assert!(
            out.stdout.contains(flag),
            "--help lacks {flag}:\n{}",
            out.stdout
        );
    }
    let out = run(&["--version"], &[], LIMIT);
    assert_eq!(out.code, Some(0));
    assert!(out.stdout.starts_with("kvroute-collector "));
}

#[test]
fn configuration_problems_exit_2_with_a_message() {
    let unknown = temp_file(
        "unknown.toml",
        "engines = [\"127.0.0.1:8001\"]\nengine-timeout = \"1s\"\n",
    );
    let secret = temp_file("secret-token", "hunter2 with spaces\n");
    let unknown_s = unknown.to_str().unwrap();
    let secret_s = secret.to_str().unwrap();
    let gw = ["--gateways", "http://127.0.0.1:10001"];
    let cases: Vec<Case<'_>> = vec![
        (
            vec!["--config", unknown_s],
            vec![],
            vec!["line 2", "unknown field `engine-timeout`"],
        ),
        (
            vec!["--config", "/nonexistent/collector.toml"],
            vec![],
            vec!["/nonexistent/collector.toml"],
        ),
        (
            gw.to_vec(),
            vec![("KVROUTE_INGEST_TOKEN", "t")],
            vec!["no engines"],
        ),
        (
            vec!["--engines", "127.0.0.1"],
            vec![],
            vec!["--engines[0] = \"127.0.0.1\": expected host:port"],
        ),
        (
            vec!["--engines", "127.0.0.1:8001"],
            vec![],
            vec!["no gateways"],
        ),
        (
            [&["--engines", "127.0.0.1:8001"][..], &gw[..]].concat(),
            vec![],
            vec!["no ingest token"],
        ),
        (
            [
                &["--engines", "127.0.0.1:8001", "--token-file", secret_s][..],
                &gw[..],
            ]
            .concat(),
            vec![],
            vec!["contains a space"],
        ),
        (
            vec!["--engines", "127.0.0.1:8001", "--once", "--interval", "5"],
            vec![],
            vec!["--interval", "no unit"],
        ),
        (vec!["--no-such-flag"], vec![], vec!["--no-such-flag"]),
    ];
    for (args, env, wants) in cases {
        let out = run(&args, &env, LIMIT);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        for w in wants {
            assert!(
                out.stderr.contains(w),
                "{args:?}: {w:?} not in {}",
                out.stderr
            );
        }
        assert!(
            !out.stderr.contains("hunter2"),
            "the token leaked: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("panicked"));
    }
    if let Some(dir) = unknown.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn busy_metrics_address_exits_2() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = run(
        &[
            "--engines",
            "127.0.0.1:8001",
            "--gateways",
            "http://127.0.0.1:10001",
            "--metrics-addr",
            &addr,
        ],
        &[("KVROUTE_INGEST_TOKEN", "t")],
        LIMIT,
    );
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("metrics-addr {addr}: cannot listen")),
        "{}",
        out.stderr
    );
}

#[test]
fn once_prints_one_snapshot() {
    let ready = Arc::new(AtomicU16::new(200));
    let e = engine(VLLM_METRICS, ready);
    let dead = dead_addr();
    let engines = format!("{},{dead}", e.addr);
    let out = run(
        &[
            "--engines",
            &engines,
            "--once",
            "--collector-id",
            "once-test",
        ],
        &[],
        LIMIT,
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let snap = Snapshot::from_json(out.stdout.as_bytes()).unwrap();
    assert_eq!(snap.collector, "once-test");
    assert_eq!(snap.hosts.len(), 2);
    let live = snap
        .hosts
        .iter()
        .find(|h| h.address == e.addr.to_string())
        .unwrap();
    assert!(live.ready);
    assert_eq!(live.kv_utilization, 0.42);
    let gone = snap
        .hosts
        .iter()
        .find(|h| h.address == dead.to_string())
        .unwrap();
    assert!(!gone.ready);
    // The failure is logged to stderr, not mixed into the JSON.
    assert!(out.stderr.contains("refused"), "{}", out.stderr);
}

#[test]
fn runs_until_killed_and_logs_refusals_once() {
    let ready = Arc::new(AtomicU16::new(200));
    let e = engine(VLLM_METRICS, ready.clone());
    let garbage = engine(GARBAGE, ready);
    let engines = format!("{},{}", e.addr, garbage.addr);
    // A gateway that always refuses the token.
    let gw = FakeServer::start(Arc::new(|_: &Request| {
        Response::new(401, "{\"error\": \"invalid token\"}")
    }));
    let gw_url = format!("http://{}", gw.addr);
    let out = run(
        &[
            "--engines",
            &engines,
            "--gateways",
            &gw_url,
            "--interval",
            "20ms",
            "--max-backoff",
            "40ms",
            "--metrics-addr",
            "off",
        ],
        &[("KVROUTE_INGEST_TOKEN", "wrong-token")],
        Duration::from_millis(1500),
    );
    // Still running when killed: a refusing gateway never stops it.
    assert_eq!(out.code, None, "exited early: {}", out.stderr);
    let refusals = out
        .stderr
        .matches("push refused with 401: invalid token")
        .count();
    assert_eq!(refusals, 1, "{}", out.stderr);
    // The garbage engine fails every scrape; that is logged once too.
    let parse_failures = out.stderr.matches("scrape failed (parse)").count();
    assert_eq!(parse_failures, 1, "{}", out.stderr);
    assert!(garbage.paths().iter().filter(|p| *p == "/metrics").count() > 5);
    assert!(gw.requests.lock().unwrap().len() > 10, "pushes kept coming");
    assert!(!out.stderr.contains("wrong-token"), "the token leaked");
}

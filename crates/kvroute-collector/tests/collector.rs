//! The collector loop against loopback engines and a recording gateway.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvroute_collector::config::{Gateway, Settings};
use kvroute_collector::discovery::{Resolver, Target};
use kvroute_core::fleet::{HostState, Snapshot};

const TOKEN: &str = "it-token-123";

/// A gateway that records every push and answers `status` (with a JSON
/// error body unless 204).
fn gateway(status: Arc<AtomicU16>) -> FakeServer {
    FakeServer::start(Arc::new(move |r: &Request| {
        let st = status.load(Ordering::SeqCst);
        if r.path != "/v1/fleet/snapshot" || r.method != "POST" {
            return Response::new(404, "");
        }
        if st == 204 {
            Response::new(204, "")
        } else {
            Response::new(st, format!("{{\"error\": \"refused with {st}\"}}"))
        }
    }))
}

fn pushes(gw: &FakeServer) -> Vec<(Request, Snapshot)> {
    gw.requests
        .lock()
        .unwrap()
        .iter()
        .map(|r| {
            let snap = Snapshot::from_json(&r.body)
                .unwrap_or_else(|e| panic!("invalid snapshot pushed: {e}"));
            (r.clone(), snap)
        })
        .collect()
}

fn host(s: &Snapshot, addr: SocketAddr) -> &HostState {
    let a = addr.to_string();
    s.hosts.iter().find(|h| h.address == a).unwrap()
}

fn settings(engines: Vec<Target>, gw: &FakeServer) -> Settings {
    let mut s = Settings::new(
        engines,
        vec![Gateway::parse(&format!("http://{}", gw.addr)).unwrap()],
        Some(TOKEN),
    );
    s.interval = Duration::from_millis(50);
    // Long: every push after the first in this test is event-driven.
    s.push_interval = Duration::from_secs(30);
    s.timeout = Duration::from_millis(200);
    s.max_backoff = Duration::from_millis(400);
    s.collector_id = "it-collector".into();
    s.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    s
}

/// Waits for a push after `since` that satisfies `cond`; returns it.
fn next_push(
    gw: &FakeServer,
    since: usize,
    what: &str,
    cond: impl Fn(&Snapshot) -> bool,
) -> (usize, Snapshot) {
    let mut found = None;
    let ok = wait_until(Duration::from_secs(5), || {
        let all = pushes(gw);
        found = all
            .iter()
            .enumerate()
            .skip(since)
            .find(|(_, (_, s))| cond(s))
            .map(|(i, (_, s))| (i, s.clone()));
        found.is_some()
    });
    assert!(
        ok,
        "no push with {what} (pushes: {:#?})",
        pushes(gw).into_iter().map(|p| p.1).collect::<Vec<_>>()
    );
    found.unwrap()
}

fn metric_line_present(addr: SocketAddr, line: &str) -> bool {
    wait_until(Duration::from_secs(3), || {
        http_get(addr, "/metrics").contains(line)
    })
}

#[test]
fn scrapes_engines_and_pushes_snapshots_through_refusals() {
    let a_health = Arc::new(AtomicU16::new(200));
    let b_health = Arc::new(AtomicU16::new(503));
    let ok = Arc::new(AtomicU16::new(200));
    let a = engine(VLLM_METRICS, a_health.clone());
    let b = engine(SGLANG_METRICS, b_health.clone());
    let c = engine(GARBAGE, ok.clone());
    let d = dead_addr();
    let gw_status = Arc::new(AtomicU16::new(204));
    let gw = gateway(gw_status.clone());

    let targets = [a.addr, b.addr, c.addr, d].map(Target::Addr).to_vec();
    let started = Instant::now();
    let running = kvroute_collector::start(settings(targets.clone(), &gw)).unwrap();
    let metrics_addr = running.metrics_addr().unwrap();

    // 1. The first snapshot, once every engine has answered.
    let (i1, first) = next_push(&gw, 0, "4 hosts", |s| s.hosts.len() == 4);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "first push took {:?}",
        started.elapsed()
    );
    let (req, _) = &pushes(&gw)[i1];
    assert_eq!(
        req.header("authorization"),
        Some(format!("Bearer {TOKEN}").as_str())
    );
    assert_eq!(req.header("content-type"), Some("application/json"));
    assert_eq!(first.version, 1);
    assert_eq!(first.collector, "it-collector");

    let ha = host(&first, a.addr);
    assert!(ha.ready);
    assert_eq!(ha.engine.as_deref(), Some("vllm"));
    assert_eq!((ha.waiting, ha.running, ha.kv_utilization), (3, 17, 0.42));
    assert_eq!(
        ha.models,
        vec!["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"]
    );
    assert_eq!(
        (ha.kv_capacity_tokens, ha.block_size),
        (Some(456_000), Some(16))
    );
    assert!(ha.scraped_at_ms > 0 && ha.scraped_at_ms <= first.taken_at_ms);

    let hb = host(&first, b.addr);
    assert!(!hb.ready, "503 on /health is not ready");
    assert_eq!(hb.engine.as_deref(), Some("sglang"));
    assert_eq!((hb.waiting, hb.running, hb.kv_utilization), (2, 9, 0.28));
    assert_eq!(hb.models, vec!["Qwen/Qwen3-8B"]);
    assert_eq!(
        (hb.kv_capacity_tokens, hb.block_size),
        (Some(200_000), Some(1))
    );
    assert!(
        hb.scraped_at_ms > 0,
        "metrics of a loading engine are still read"
    );

    let hc = host(&first, c.addr);
    assert!(!hc.ready, "garbage /metrics is a failed scrape");
    assert_eq!((hc.scraped_at_ms, hc.engine.as_deref()), (0, None));
    let hd = host(&first, d);
    assert!(!hd.ready);
    assert_eq!(hd.scraped_at_ms, 0);

    // Both endpoints of each live engine were scraped.
    for e in [&a, &b, &c] {
        let paths = e.paths();
        assert!(paths.iter().any(|p| p == "/health") && paths.iter().any(|p| p == "/metrics"));
    }

    // 2. A readiness change is pushed at once (the push interval is 30 s).
    let flip = Instant::now();
    b_health.store(200, Ordering::SeqCst);
    let (i2, second) = next_push(&gw, i1 + 1, "B ready", |s| host(s, b.addr).ready);
    assert!(
        flip.elapsed() < Duration::from_secs(2),
        "readiness push took {:?}",
        flip.elapsed()
    );
    assert!(second.seq > first.seq);

    // 3. Refusals are counted and survived; each later readiness change
    // still produces a push.
    let mut last = i2;
    for (status, engine_health, ready_after, addr) in [
        (401, &a_health, false, a.addr),
        (409, &a_health, true, a.addr),
        (400, &b_health, false, b.addr),
        (413, &b_health, true, b.addr),
    ] {
        gw_status.store(status, Ordering::SeqCst);
        engine_health.store(if ready_after { 200 } else { 503 }, Ordering::SeqCst);
        let (i, _) = next_push(&gw, last + 1, &format!("{addr} ready={ready_after}"), |s| {
            host(s, addr).ready == ready_after
        });
        last = i;
        let gw_label = format!("gateway=\"http://{}\"", gw.addr);
        assert!(
            metric_line_present(
                metrics_addr,
                &format!("kvroute_collector_pushes_total{{{gw_label},status=\"{status}\"}}")
            ),
            "push result {status} not counted"
        );
    }
    gw_status.store(204, Ordering::SeqCst);
    a_health.store(503, Ordering::SeqCst);
    let (_, last_snap) = next_push(&gw, last + 1, "A not ready", |s| !host(s, a.addr).ready);

    // 4. Own metrics.
    let text = http_get(metrics_addr, "/metrics");
    for want in [
        format!(
            "kvroute_collector_scrape_failures_total{{engine=\"{}\",cause=\"parse\"}}",
            c.addr
        ),
        format!("kvroute_collector_scrape_failures_total{{engine=\"{d}\",cause=\"refused\"}}"),
        format!("kvroute_collector_scrapes_total{{engine=\"{}\"}}", a.addr),
        "kvroute_collector_engines_discovered 4".to_owned(),
        "kvroute_collector_scrape_duration_seconds_count".to_owned(),
        format!(
            "kvroute_collector_last_push_timestamp_seconds{{gateway=\"http://{}\"}}",
            gw.addr
        ),
    ] {
        assert!(text.contains(&want), "missing {want} in\n{text}");
    }
    assert!(http_get(metrics_addr, "/nope").starts_with("HTTP/1.1 404"));

    // Every push was a valid snapshot, with increasing seq.
    let all = pushes(&gw);
    assert!(all.windows(2).all(|w| w[1].1.seq > w[0].1.seq));
    // The dead engine backs off: fewer attempts than a live one.
    let count = |addr: SocketAddr| -> u64 {
        let key = format!("kvroute_collector_scrapes_total{{engine=\"{addr}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap()
    };
    assert!(
        count(d) < count(a.addr),
        "{} vs {}",
        count(d),
        count(a.addr)
    );

    // 5. Stopping is prompt; a restarted collector continues the seq.
    let t = Instant::now();
    running.stop();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        t.elapsed()
    );
    let n_before = pushes(&gw).len();
    let again = kvroute_collector::start(settings(targets, &gw)).unwrap();
    let (_, restarted) = next_push(&gw, n_before, "restart", |_| true);
    assert!(
        restarted.seq > last_snap.seq,
        "{} <= {}",
        restarted.seq,
        last_snap.seq
    );
    again.stop();
}

#[test]
fn dns_names_follow_their_records() {
    let ok = Arc::new(AtomicU16::new(200));
    let a = engine(VLLM_METRICS, ok.clone());
    let b = engine(SGLANG_METRICS, ok.clone());
    let gw = gateway(Arc::new(AtomicU16::new(204)));
    let records = Arc::new(Mutex::new(vec![a.addr]));
    let answer = records.clone();
    let resolver: Resolver = Box::new(move |host, port| {
        assert_eq!(host, "engines.test");
        Ok(answer
            .lock()
            .unwrap()
            .iter()
            .map(|x| SocketAddr::new(x.ip(), if port == 1 { x.port() } else { port }))
            .collect())
    });
    let target = Target::Name {
        host: "engines.test".into(),
        port: 1, // the fake resolver keeps each record's own port
    };
    let mut s = settings(vec![target], &gw);
    s.dns_refresh = Duration::from_millis(100);
    let running = kvroute_collector::start_with(s, resolver).unwrap();

    next_push(&gw, 0, "A only", |s| {
        s.hosts.len() == 1 && s.hosts[0].address == a.addr.to_string() && s.hosts[0].ready
    });
    *records.lock().unwrap() = vec![a.addr, b.addr];
    next_push(&gw, 0, "A and B", |s| s.hosts.len() == 2);
    *records.lock().unwrap() = vec![b.addr];
    let (_, s) = next_push(&gw, 0, "B only", |s| {
        s.hosts.len() == 1 && s.hosts[0].address == b.addr.to_string()
    });
    assert_eq!(s.hosts[0].engine.as_deref(), Some("sglang"));
    running.stop();
}

/// A gateway that accepts every push and answers `GET /v1/fleet/load` with
/// `load` (a JSON body), or with 404 while `load` is empty (a gateway
/// that does not serve it).
fn gateway_with_load(load: Arc<Mutex<String>>) -> FakeServer {
    FakeServer::start(Arc::new(move |r: &Request| {
        let path = r.path.split('?').next().unwrap_or_default();
        match (r.method.as_str(), path) {
            ("POST", "/v1/fleet/snapshot") => Response::new(204, ""),
            ("GET", "/v1/fleet/load") => {
                let body = load.lock().unwrap().clone();
                if body.is_empty() {
                    Response::new(404, "{\"error\": \"not found\"}")
                } else {
                    Response::new(200, body)
                }
            }
            _ => Response::new(404, ""),
        }
    }))
}

/// A gateway's load report: `prefill` tokens pending on `address`, twice
/// that held, and a thousandth of it in recent arrivals per second.
fn load_body(address: SocketAddr, prefill: u64) -> String {
    format!(
        r#"{{"hosts":[{{"address":"{address}","prefillPendingTokens":{prefill},"memoryTokens":{},"arrivalsPerS":{}}}],"arrivalWindowMs":10000}}"#,
        prefill * 2,
        prefill as f64 / 1000.0
    )
}

/// The snapshots pushed to a gateway that also serves its load.
fn posted(gw: &FakeServer) -> Vec<Snapshot> {
    gw.requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.method == "POST")
        .map(|r| Snapshot::from_json(&r.body).unwrap())
        .collect()
}

/// With two gateways, each one's snapshot carries the other's pending
/// prefill per replica; a gateway whose load cannot be read gives none.
#[test]
fn several_gateways_get_each_others_pending_prefill() {
    let ok = Arc::new(AtomicU16::new(200));
    let (e1, e2) = (
        engine(VLLM_METRICS, ok.clone()),
        engine(VLLM_METRICS, ok.clone()),
    );
    let (load_a, load_b) = (
        Arc::new(Mutex::new(load_body(e1.addr, 3000))),
        Arc::new(Mutex::new(String::new())),
    );
    let (gw_a, gw_b) = (
        gateway_with_load(load_a.clone()),
        gateway_with_load(load_b.clone()),
    );
    let mut s = settings(vec![Target::Addr(e1.addr), Target::Addr(e2.addr)], &gw_a);
    s.gateways
        .push(Gateway::parse(&format!("http://{}", gw_b.addr)).unwrap());
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start(s).unwrap();
    let metrics_addr = running.metrics_addr().unwrap();

    let snapshots = posted;
    let peer = |s: &Snapshot, addr: SocketAddr| host(s, addr).peer_pending_tokens;
    // B hears A's load; A, whose peer answers 404, hears nothing.
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_b)
            .iter()
            .any(|s| s.hosts.len() == 2 && peer(s, e1.addr) == Some(3000))),
        "no push to B with A's 3000 tokens: {:?}",
        snapshots(&gw_b)
    );
    let b_last = snapshots(&gw_b).pop().unwrap();
    assert_eq!(
        peer(&b_last, e2.addr),
        Some(0),
        "a replica A has nothing on"
    );
    // B has not said it counts arrivals (its load cannot be read): it
    // gets no peer rate, as an older gateway, whose snapshot check would
    // reject the field.
    let arrivals = |s: &Snapshot, addr| host(s, addr).peer_arrivals_per_s;
    assert_eq!(
        (arrivals(&b_last, e1.addr), arrivals(&b_last, e2.addr)),
        (None, None)
    );
    assert!(snapshots(&gw_a)
        .iter()
        .all(|s| s.hosts.iter().all(|h| h.peer_pending_tokens.is_none())));
    assert!(metric_line_present(
        metrics_addr,
        &format!(
            "kvroute_collector_load_reads_total{{gateway=\"http://{}\",result=\"404\"}}",
            gw_b.addr
        )
    ));

    // B starts serving its load: A hears it.
    *load_b.lock().unwrap() = load_body(e2.addr, 700);
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_a).iter().any(
            |s| peer(s, e2.addr) == Some(700) && peer(s, e1.addr) == Some(0)
        )),
        "no push to A with B's 700 tokens"
    );
    // B's report says it counts arrivals: B now gets A's, 3 a second on
    // e1 and none on e2.
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_b)
            .iter()
            .any(|s| s.hosts.len() == 2
                && (arrivals(s, e1.addr), arrivals(s, e2.addr))
                    == (Some(3.0), Some(0.0)))),
        "no push to B with A's arrivals"
    );
    // A answers garbage: counted, and B's snapshots lose the field once
    // A's last good read has aged out.
    *load_a.lock().unwrap() = "{\"hosts\": 5}".to_owned();
    assert!(metric_line_present(
        metrics_addr,
        &format!(
            "kvroute_collector_load_reads_total{{gateway=\"http://{}\",result=\"invalid\"}}",
            gw_a.addr
        )
    ));
    let since = snapshots(&gw_b).len();
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_b)
            .iter()
            .skip(since)
            .any(|s| s.hosts.iter().all(|h| h.peer_pending_tokens.is_none()))),
        "B still hears A's load after A's reads failed"
    );
    running.stop();
}

/// Key memory across gateways: the collector asks each gateway's load for
/// its placements (`?placed=1`) and gives each gateway whose report has
/// the field the *other* gateways' placements; a gateway whose report has
/// none (an older filter) gets snapshots without the field. The same read
/// asks for the gateways' last blocks (`&lastBlocks=1`), handed over
/// likewise.
#[test]
fn placements_reach_the_other_gateways() {
    let ok = Arc::new(AtomicU16::new(200));
    let e1 = engine(VLLM_METRICS, ok.clone());
    let placed = |key: &str| {
        format!(
            r#"{{"hosts":[],"placed":[{{"key":"{key}","address":"{0}","ageMs":40}}],"lastBlocks":[{{"block":"{key}","blocks":9,"address":"{0}","ageMs":30}}]}}"#,
            e1.addr
        )
    };
    let load_a = Arc::new(Mutex::new(placed("00000000000000aa")));
    let load_b = Arc::new(Mutex::new(placed("00000000000000bb")));
    let load_c = Arc::new(Mutex::new(r#"{"hosts":[]}"#.to_owned()));
    let gw_a = gateway_with_load(load_a);
    let gw_b = gateway_with_load(load_b);
    let gw_c = gateway_with_load(load_c);
    let mut s = settings(vec![Target::Addr(e1.addr)], &gw_a);
    for gw in [&gw_b, &gw_c] {
        s.gateways
            .push(Gateway::parse(&format!("http://{}", gw.addr)).unwrap());
    }
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start(s).unwrap();
    let keys = |s: &Snapshot| s.placed.iter().map(|p| p.key.clone()).collect::<Vec<_>>();
    assert!(
        wait_until(Duration::from_secs(5), || posted(&gw_a)
            .iter()
            .any(|s| keys(s) == ["00000000000000bb"])),
        "A never got B's placement: {:?}",
        posted(&gw_a).iter().map(keys).collect::<Vec<_>>()
    );
    assert!(
        wait_until(Duration::from_secs(5), || posted(&gw_b)
            .iter()
            .any(|s| keys(s) == ["00000000000000aa"])),
        "B never got A's placement"
    );
    let to_b = posted(&gw_b);
    let p = to_b.iter().flat_map(|s| &s.placed).next().unwrap();
    assert_eq!(p.address, e1.addr.to_string());
    assert!(p.age_ms >= 40, "aged to the push: {}", p.age_ms);
    let last = to_b.iter().flat_map(|s| &s.last_blocks).next().unwrap();
    assert_eq!((last.block.as_str(), last.blocks), ("00000000000000aa", 9));
    assert!(last.age_ms >= 30, "aged to the push: {}", last.age_ms);
    assert!(
        gw_a.paths()
            .iter()
            .any(|p| p == "/v1/fleet/load?placed=1&lastBlocks=1"),
        "{:?}",
        gw_a.paths()
    );
    // C's pusher is a thread of its own: wait for its first snapshot too
    // (asserted without waiting, this failed once on a loaded machine).
    assert!(
        wait_until(Duration::from_secs(5), || !posted(&gw_c).is_empty()),
        "C got no snapshot"
    );
    assert!(posted(&gw_c)
        .iter()
        .all(|s| s.placed.is_empty() && s.last_blocks.is_empty()));
    running.stop();
}

/// `--gateway-service`: every address the name resolves to is a gateway
/// (a headless Service over the gateway pods). Gateways that appear get
/// snapshots with the others' pending prefill; one that goes away gets no
/// more pushes, and its load and its metric series are dropped.
#[test]
fn a_gateway_service_pushes_to_each_address_it_resolves_to() {
    let ok = Arc::new(AtomicU16::new(200));
    let (e1, e2) = (
        engine(VLLM_METRICS, ok.clone()),
        engine(VLLM_METRICS, ok.clone()),
    );
    let (gw_a, gw_b) = (
        gateway_with_load(Arc::new(Mutex::new(load_body(e1.addr, 3000)))),
        gateway_with_load(Arc::new(Mutex::new(load_body(e2.addr, 700)))),
    );
    let records = Arc::new(Mutex::new(vec![gw_a.addr]));
    let answer = records.clone();
    let resolver: Resolver = Box::new(move |host, port| {
        if host != "gateways.test" {
            return Err(std::io::Error::other(format!("unexpected lookup {host}")));
        }
        // Port 1 in the URL: each record keeps its own port.
        Ok(answer
            .lock()
            .unwrap()
            .iter()
            .map(|x| SocketAddr::new(x.ip(), if port == 1 { x.port() } else { port }))
            .collect())
    });
    let mut s = settings(vec![Target::Addr(e1.addr), Target::Addr(e2.addr)], &gw_a);
    s.gateways.clear();
    s.gateway_services =
        vec![kvroute_collector::config::GatewayService::parse("http://gateways.test:1").unwrap()];
    s.dns_refresh = Duration::from_millis(100);
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start_with(s, resolver).unwrap();
    let metrics_addr = running.metrics_addr().unwrap();
    let snapshots = posted;
    let peer = |s: &Snapshot, addr: SocketAddr| host(s, addr).peer_pending_tokens;

    // A alone: pushed to, and told that no other gateway has load (the
    // service names every gateway, and only A).
    assert!(wait_until(Duration::from_secs(5), || snapshots(&gw_a)
        .len()
        >= 2));
    assert!(snapshots(&gw_a)
        .iter()
        .all(|s| s.hosts.iter().all(|h| h.peer_pending_tokens == Some(0))));
    assert!(snapshots(&gw_b).is_empty());
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_gateways 1"
    ));

    // B appears: each hears the other.
    records.lock().unwrap().push(gw_b.addr);
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_b)
            .iter()
            .any(|s| s.hosts.len() == 2 && peer(s, e1.addr) == Some(3000))),
        "no push to B with A's 3000 tokens"
    );
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_a).iter().any(
            |s| peer(s, e2.addr) == Some(700) && peer(s, e1.addr) == Some(0)
        )),
        "no push to A with B's 700 tokens"
    );
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_gateways 2"
    ));
    let a_series = format!("gateway=\"http://{}\"", gw_a.addr);
    assert!(metric_line_present(metrics_addr, &a_series));

    // A goes away: no more pushes to it; B's snapshots lose A's load; A's
    // series go.
    *records.lock().unwrap() = vec![gw_b.addr];
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_gateways 1"
    ));
    let a_pushes = snapshots(&gw_a).len();
    let b_since = snapshots(&gw_b).len();
    assert!(
        wait_until(Duration::from_secs(5), || snapshots(&gw_b).len()
            >= b_since + 4),
        "B gets no pushes after A left"
    );
    assert!(
        snapshots(&gw_a).len() <= a_pushes + 1,
        "A still pushed to after it left"
    );
    assert!(snapshots(&gw_b)
        .iter()
        .skip(b_since + 1)
        .all(|s| s.hosts.iter().all(|h| h.peer_pending_tokens == Some(0))));
    assert!(
        wait_until(Duration::from_secs(5), || !http_get(
            metrics_addr,
            "/metrics"
        )
        .contains(&a_series)),
        "A's series are still exported"
    );
    running.stop();
}

/// The sidecar layout: a collector pushes to its own gateway only and
/// names the replicas by a peer service. The service resolves to every
/// replica, its own gateway included (this machine's address on the port
/// of the gateway it pushes to), which is left out: its snapshots carry
/// the other replica's pending prefill, not its own gateway's again, and
/// nothing is pushed to the peer. A static peer is read the same way.
#[test]
fn a_sidecar_reads_its_peers_load_and_pushes_only_to_its_own_gateway() {
    let ok = Arc::new(AtomicU16::new(200));
    let (e1, e2) = (
        engine(VLLM_METRICS, ok.clone()),
        engine(VLLM_METRICS, ok.clone()),
    );
    let (gw_own, gw_peer, gw_static) = (
        gateway_with_load(Arc::new(Mutex::new(load_body(e1.addr, 3000)))),
        gateway_with_load(Arc::new(Mutex::new(load_body(e2.addr, 700)))),
        gateway_with_load(Arc::new(Mutex::new(load_body(e1.addr, 50)))),
    );
    let records = vec![gw_own.addr, gw_peer.addr];
    let resolver: Resolver = Box::new(move |host, _port| {
        if host != "replicas.test" {
            return Err(std::io::Error::other(format!("unexpected lookup {host}")));
        }
        // Each replica on its own loopback port, as the bench runs them.
        Ok(records.clone())
    });
    let mut s = settings(vec![Target::Addr(e1.addr), Target::Addr(e2.addr)], &gw_own);
    // Its own gateway written with the ingest path: not the base the
    // service gives the same gateway (in a pod, 127.0.0.1 and the pod's
    // IP differ altogether; `is_own_gateway`'s unit test covers that).
    s.gateways =
        vec![Gateway::parse(&format!("http://{}/v1/fleet/snapshot", gw_own.addr)).unwrap()];
    s.peer_services =
        vec![kvroute_collector::config::GatewayService::parse("http://replicas.test:1").unwrap()];
    s.dns_refresh = Duration::from_millis(100);
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start_with(s, resolver).unwrap();
    let metrics_addr = running.metrics_addr().unwrap();
    let peer = |s: &Snapshot, addr: SocketAddr| host(s, addr).peer_pending_tokens;

    assert!(
        wait_until(Duration::from_secs(5), || posted(&gw_own).iter().any(|s| s
            .hosts
            .len()
            == 2
            && peer(s, e2.addr) == Some(700))),
        "no push with the peer's 700 tokens: {:?}",
        posted(&gw_own)
    );
    // Its own gateway's 3000 tokens on e1 are not counted as a peer's.
    let last = posted(&gw_own).pop().unwrap();
    assert_eq!(
        peer(&last, e1.addr),
        Some(0),
        "own load counted as a peer's"
    );
    assert!(posted(&gw_peer).is_empty(), "a peer was pushed to");
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_gateways 1"
    ));
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_peer_gateways 1"
    ));
    assert!(metric_line_present(
        metrics_addr,
        &format!(
            "kvroute_collector_load_reads_total{{gateway=\"http://{}\",result=\"ok\"}}",
            gw_peer.addr
        )
    ));
    running.stop();

    // A static peer: read, never pushed to. One list of every replica,
    // its own gateway included (written with the ingest path here): its
    // own is left out, so e1 carries the peer's 50 tokens, not 3050.
    let mut s = settings(vec![Target::Addr(e1.addr), Target::Addr(e2.addr)], &gw_own);
    s.peer_gateways = [
        format!("http://{}", gw_static.addr),
        format!("http://{}/v1/fleet/snapshot", gw_own.addr),
    ]
    .iter()
    .map(|u| Gateway::parse(u).unwrap().as_peer())
    .collect();
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start(s).unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || posted(&gw_own).iter().any(
            |s| peer(s, e1.addr) == Some(50) && peer(s, e2.addr) == Some(0)
        )),
        "no push with the static peer's 50 tokens"
    );
    assert!(posted(&gw_static).is_empty(), "a static peer was pushed to");
    running.stop();

    // A peer that a gateway service comes to name is pushed to from then on.
    let records = Arc::new(Mutex::new(vec![gw_own.addr]));
    let answer = records.clone();
    let resolver: Resolver = Box::new(move |_host, _port| Ok(answer.lock().unwrap().clone()));
    let mut s = settings(vec![Target::Addr(e1.addr), Target::Addr(e2.addr)], &gw_own);
    s.gateways.clear();
    s.gateway_services =
        vec![kvroute_collector::config::GatewayService::parse("http://gateways.test:1").unwrap()];
    s.peer_gateways = vec![Gateway::parse(&format!("http://{}", gw_static.addr))
        .unwrap()
        .as_peer()];
    s.dns_refresh = Duration::from_millis(100);
    s.push_interval = Duration::from_millis(50);
    let running = kvroute_collector::start_with(s, resolver).unwrap();
    let metrics_addr = running.metrics_addr().unwrap();
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_peer_gateways 1"
    ));
    assert!(posted(&gw_static).is_empty(), "a peer was pushed to");
    records.lock().unwrap().push(gw_static.addr);
    assert!(
        wait_until(Duration::from_secs(5), || !posted(&gw_static).is_empty()),
        "a peer the service names is not pushed to"
    );
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_peer_gateways 0"
    ));
    assert!(metric_line_present(
        metrics_addr,
        "kvroute_collector_gateways 2"
    ));
    running.stop();
}

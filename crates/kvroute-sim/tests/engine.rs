//! The realistic engine over real loopback sockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvroute_sim::engine::{
    block_hashes, cacheable_hit_blocks, chat_prompt, generated_text, tokens_of, EngineConfig,
    EngineFleet, FleetConfig, BLOCK_TOKENS,
};
use serde_json::Value;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    BufReader::new(s)
}

/// One response: (status, headers lower-cased, body), by content-length or
/// chunked.
fn read_response(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap();
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if header("transfer-encoding").as_deref() == Some("chunked") {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            assert_eq!(&chunk[n..], b"\r\n");
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let len: usize = header("content-length").unwrap().parse().unwrap();
        body.resize(len, 0);
        r.read_exact(&mut body).unwrap();
    }
    (status, headers, body)
}

fn request(
    c: &mut BufReader<TcpStream>,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let wire = format!(
        "{method} {path} HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    c.get_mut().write_all(wire.as_bytes()).unwrap();
    read_response(c)
}

fn json(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap()
}

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in metrics"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn serves_chat_streams_metrics_and_errors() {
    let fleet = EngineFleet::start(&FleetConfig {
        base_port: 0,
        engines: 2,
        time_scale: 1000.0,
        startup_delay: Duration::from_millis(800),
        ..FleetConfig::default()
    })
    .unwrap();
    let addrs = fleet.addrs().to_vec();
    assert_eq!(addrs.len(), 2);
    let mut c0 = connect(addrs[0]);
    let mut c1 = connect(addrs[1]);

    // Starting up: not healthy yet (the delay is real time).
    let (status, _, _) = request(&mut c0, "GET", "/health", "");
    assert_eq!(status, 503);

    let user = "Summarise the history of the printing press. ".repeat(8);
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": 8,
    })
    .to_string();
    let prompt = chat_prompt(&[("user", user.as_str())]);
    let prompt_tokens = tokens_of(prompt.len());
    let answer = generated_text(1, &prompt, 8);

    // Non-streamed, twice on engine 0: the second is a prefix-cache hit.
    let (status, _, first) = request(&mut c0, "POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    let first = json(&first);
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["choices"][0]["message"]["content"], answer.as_str());
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(first["usage"]["completion_tokens"], 8);
    assert_eq!(first["usage"]["total_tokens"], prompt_tokens + 8);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["kvroute_sim"]["engine"], 0);
    assert!(first["kvroute_sim"]["prefill_ms"].as_f64().unwrap() > 0.0);

    let (status, _, second) = request(&mut c0, "POST", "/v1/chat/completions", &body);
    assert_eq!(status, 200);
    let second = json(&second);
    let expect_cached =
        cacheable_hit_blocks(prompt_tokens, block_hashes(MODEL, &prompt).len()) * BLOCK_TOKENS;
    assert!(expect_cached > 0);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        expect_cached
    );
    assert_eq!(second["kvroute_sim"]["cached_tokens"], expect_cached);
    assert_eq!(second["choices"][0]["message"]["content"], answer.as_str());

    // Streamed on engine 1: same answer, SSE framing, usage at the end.
    let stream_body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": 8,
        "stream": true,
    })
    .to_string();
    let (status, headers, raw) = request(&mut c1, "POST", "/v1/chat/completions", &stream_body);
    assert_eq!(status, 200);
    assert!(headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")));
    let raw = String::from_utf8(raw).unwrap();
    assert!(raw.ends_with("data: [DONE]\n\n"));
    let events: Vec<&str> = raw.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, answer);
    let token_chunks = chunks
        .iter()
        .filter(|c| c["object"] == "chat.completion.chunk" && !c["choices"][0].is_null())
        .count();
    assert_eq!(token_chunks, 1 + 8);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], 8);
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(last["kvroute_sim"]["engine"], 1);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );

    // The connection is still usable after a stream (keep-alive).
    let (status, _, metrics) = request(&mut c0, "GET", "/metrics", "");
    assert_eq!(status, 200);
    let metrics = String::from_utf8(metrics).unwrap();
    let labels = format!("{{engine=\"0\",model_name=\"{MODEL}\"");
    assert_eq!(
        metric(&metrics, &format!("vllm:request_success_total{labels}")),
        2.0
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:prefix_cache_hits_total{labels}")),
        expect_cached as f64
    );
    assert_eq!(
        metric(
            &metrics,
            &format!("vllm:prefix_cache_queries_total{labels}")
        ),
        2.0 * prompt_tokens as f64
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:generation_tokens_total{labels}")),
        16.0
    );
    assert_eq!(
        metric(&metrics, &format!("vllm:num_requests_running{labels}")),
        0.0
    );
    assert_eq!(
        metric(
            &metrics,
            &format!("vllm:time_to_first_token_seconds_count{labels}")
        ),
        2.0
    );
    assert!(metrics.contains("num_gpu_blocks=\"25000\""));

    // Errors.
    let (status, _, err) = request(
        &mut c0,
        "POST",
        "/v1/chat/completions",
        r#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!(status, 404);
    let err = json(&err);
    assert_eq!(err["error"]["message"], "The model `nope` does not exist.");
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["code"], 404);
    let (status, _, _) = request(&mut c0, "POST", "/v1/chat/completions", "{not json");
    assert_eq!(status, 400);
    let (status, _, _) = request(&mut c0, "POST", "/v1/chat/completions", r#"{"model":"x"}"#);
    assert_eq!(status, 404);
    let (status, _, _) = request(
        &mut c0,
        "POST",
        "/v1/chat/completions",
        r#"{"max_tokens":3}"#,
    );
    assert_eq!(status, 400);

    // Plain completions.
    let (status, _, done) = request(
        &mut c0,
        "POST",
        "/v1/completions",
        r#"{"prompt":"once upon a time","max_tokens":3}"#,
    );
    assert_eq!(status, 200);
    let done = json(&done);
    assert_eq!(done["object"], "text_completion");
    assert_eq!(
        done["choices"][0]["text"],
        generated_text(1, b"once upon a time", 3).as_str()
    );

    let (status, _, models) = request(&mut c1, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(json(&models)["data"][0]["id"], MODEL);
    let (status, _, load) = request(&mut c1, "GET", "/get_load", "");
    assert_eq!(status, 200);
    assert_eq!(json(&load)[0]["num_reqs"], 0);

    // Healthy once the startup delay is over.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, _) = request(&mut c0, "GET", "/health", "");
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never became healthy");
        std::thread::sleep(Duration::from_millis(50));
    }

    // An error fault on engine 1: completions and health answer 503.
    let (status, _, _) = request(
        &mut c1,
        "POST",
        "/_sim/fault",
        r#"{"kind":"error","for_s":1000000}"#,
    );
    assert_eq!(status, 200);
    let (status, _, _) = request(&mut c1, "POST", "/v1/chat/completions", &body);
    assert_eq!(status, 503);
    let (status, _, _) = request(&mut c1, "GET", "/health", "");
    assert_eq!(status, 503);
    let (status, _, _) = request(&mut c0, "GET", "/health", "");
    assert_eq!(status, 200);

    // Reset zeroes the counters.
    let (status, _, _) = request(&mut c0, "POST", "/_sim/reset", "");
    assert_eq!(status, 200);
    let (_, _, metrics) = request(&mut c0, "GET", "/metrics", "");
    let metrics = String::from_utf8(metrics).unwrap();
    assert_eq!(
        metric(&metrics, &format!("vllm:request_success_total{labels}")),
        0.0
    );

    fleet.shutdown();
}

/// `a100_engines`: the last engines model an A100 (its batch defaults show
/// in `/server_info`); more than the fleet is refused.
#[test]
fn the_last_engines_model_an_a100() {
    let fleet = EngineFleet::start(&FleetConfig {
        base_port: 0,
        engines: 3,
        a100_engines: 1,
        time_scale: 1000.0,
        ..FleetConfig::default()
    })
    .unwrap();
    let chunk = |addr: SocketAddr| {
        let (status, _, body) = request(&mut connect(addr), "GET", "/server_info", "");
        assert_eq!(status, 200);
        json(&body)["chunked_prefill_size"].as_u64().unwrap()
    };
    let sizes: Vec<u64> = fleet.addrs().iter().map(|&a| chunk(a)).collect();
    let (h100, a100) = (EngineConfig::default(), EngineConfig::a100_80gb());
    assert_eq!(
        sizes,
        [
            h100.max_num_batched_tokens as u64,
            h100.max_num_batched_tokens as u64,
            a100.max_num_batched_tokens as u64
        ]
    );
    assert_ne!(h100.max_num_batched_tokens, a100.max_num_batched_tokens);
    fleet.shutdown();
    let err = EngineFleet::start(&FleetConfig {
        base_port: 0,
        engines: 2,
        a100_engines: 3,
        ..FleetConfig::default()
    })
    .err()
    .unwrap();
    assert!(err.to_string().contains("a100_engines"), "{err}");
}

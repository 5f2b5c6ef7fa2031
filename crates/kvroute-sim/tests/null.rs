//! The null engines over real loopback sockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvroute_sim::null::{NullConfig, NullFleet};

fn fleet(engines: usize) -> NullFleet {
    NullFleet::start(&NullConfig {
        base_port: 0,
        engines,
        ..NullConfig::default()
    })
    .unwrap()
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    BufReader::new(s)
}

/// One response: (status, headers lower-cased, body).
fn read_response(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>, String) {
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
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .unwrap()
        .1
        .parse()
        .unwrap();
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    (status, headers, String::from_utf8(body).unwrap())
}

#[test]
fn answers_completions_with_keep_alive_and_chunked_bodies() {
    let f = fleet(2);
    let addrs = f.addrs().to_vec();
    assert_eq!(addrs.len(), 2);
    assert_ne!(addrs[0].port(), addrs[1].port());

    let mut c = connect(addrs[1]);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(40_000)
    );
    // Content-Length body, then a chunked one, then a completions request,
    // all on one connection (the second is pipelined behind the first).
    let mut wire = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    wire.push_str(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    for part in body.as_bytes().chunks(7000) {
        wire.push_str(&format!(
            "{:x};ext=1\r\n{}\r\n",
            part.len(),
            std::str::from_utf8(part).unwrap()
        ));
    }
    wire.push_str("0\r\nx-trailer: 1\r\n\r\n");
    c.get_mut().write_all(wire.as_bytes()).unwrap();
    for _ in 0..2 {
        let (status, headers, text) = read_response(&mut c);
        assert_eq!(status, 200);
        assert!(headers.contains(&("connection".to_owned(), "keep-alive".to_owned())));
        assert!(text.contains(r#""object":"chat.completion""#), "{text}");
        let prompt = body.len() / 4;
        assert!(
            text.contains(&format!(r#""prompt_tokens":{prompt}"#)),
            "{text}"
        );
    }
    c.get_mut()
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
        .unwrap();
    let (status, _, text) = read_response(&mut c);
    assert_eq!(status, 200);
    assert!(text.contains(r#""object":"text_completion""#), "{text}");
    // connection: close was honoured.
    let mut rest = Vec::new();
    assert_eq!(c.read_to_end(&mut rest).unwrap(), 0);

    assert_eq!(f.served(), vec![0, 3]);
    f.shutdown();
}

#[test]
fn health_metrics_and_unknown_paths() {
    let f = fleet(1);
    let mut c = connect(f.addrs()[0]);
    c.get_mut()
        .write_all(b"GET /health HTTP/1.1\r\nhost: a\r\n\r\nGET /metrics HTTP/1.1\r\nhost: a\r\n\r\nGET /nope HTTP/1.1\r\nhost: a\r\n\r\nGET /v1/chat/completions HTTP/1.1\r\nhost: a\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut c).0, 200);
    let (status, _, metrics) = read_response(&mut c);
    assert_eq!(status, 200);
    assert!(metrics.contains(
        r#"vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0"#
    ));
    assert!(metrics.contains("vllm:kv_cache_usage_perc{"));
    assert!(metrics.contains("vllm:num_requests_waiting{"));
    assert_eq!(read_response(&mut c).0, 404);
    assert_eq!(read_response(&mut c).0, 405);
    f.shutdown();
}

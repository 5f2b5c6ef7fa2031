//! kvroute-noop: the "Envoy + an empty Wasm filter" contender of the gateway
//! overhead benchmark (scripts/bench_overhead.py).
//!
//! It does what kvroute must do before any routing work, and nothing else:
//! pause in the header callback (Envoy needs
//! `allow_on_headers_stop_iteration: true`), let Envoy buffer the request
//! body, and continue at the end of the stream. The difference between it and
//! plain Envoy is the cost of the Wasm VM plus body buffering; the difference
//! between it and kvroute is kvroute's own work.
//!
//! For measuring what a host call costs, its configuration may be
//! `probe:N:BYTES`: then each request, at the end of its body, also makes N
//! `get_shared_data` calls on a value of BYTES bytes (stored at start-up),
//! the kind of call kvroute's load table and prefix index make. Any other
//! configuration (kvroute's JSON included) means no probe calls.

use std::cell::Cell;
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

/// Shared-data key of the probe value.
const PROBE_KEY: &str = "kvroute-noop.probe";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { probes: 0, route: None })
    });
}}

struct Root {
    /// `get_shared_data` calls per request (0: a pure no-op).
    probes: u32,
    /// The "minimal" router, when configured.
    route: Option<Rc<Route>>,
}

/// `route:HEADER:ADDR,...`: set HEADER to each address in turn.
struct Route {
    header: String,
    addresses: Vec<String>,
    next: Cell<usize>,
}

impl Route {
    fn parse(config: &[u8]) -> Option<Route> {
        let text = std::str::from_utf8(config).ok()?;
        let (header, list) = text.trim().strip_prefix("route:")?.split_once(':')?;
        let addresses: Vec<String> = list
            .split(',')
            .filter(|a| !a.is_empty())
            .map(str::to_owned)
            .collect();
        if header.is_empty() || addresses.is_empty() {
            return None;
        }
        Some(Route {
            header: header.to_owned(),
            addresses,
            next: Cell::new(0),
        })
    }

    /// Reads what a router must read, and names the next address. (A host
    /// call is an import: the compiler cannot drop the copies.)
    fn apply(&self, body_size: usize) {
        let _body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size);
        let _path = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ":path");
        let turn = self.next.get();
        self.next.set(turn.wrapping_add(1));
        if let Some(addr) = self.addresses.get(turn % self.addresses.len()) {
            let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &self.header, Some(addr));
        }
    }
}

impl Context for Root {}

/// `probe:N:BYTES` as (N, BYTES); anything else is no probe.
fn parse_probe(config: &[u8]) -> Option<(u32, usize)> {
    let text = std::str::from_utf8(config).ok()?;
    let mut parts = text.trim().strip_prefix("probe:")?.split(':');
    let n = parts.next()?.parse().ok()?;
    let bytes = parts.next()?.parse().ok()?;
    Some((n, bytes))
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        if let Some((n, bytes)) = parse_probe(&config) {
            if hostcalls::set_shared_data(PROBE_KEY, Some(&vec![7u8; bytes]), None).is_ok() {
                self.probes = n;
            }
        }
        self.route = Route::parse(&config).map(Rc::new);
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            probes: self.probes,
            route: self.route.clone(),
        }))
    }
}

struct Stream {
    probes: u32,
    route: Option<Rc<Route>>,
}

impl Stream {
    fn probe(&self) {
        for _ in 0..self.probes {
            let _ = hostcalls::get_shared_data(PROBE_KEY);
        }
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            // Hold the headers until the whole body is buffered.
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.probe();
            if let Some(route) = &self.route {
                route.apply(body_size);
            }
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_config_names_header_and_addresses() {
        let r = Route::parse(b"route:x-dest:10.0.0.1:8000,10.0.0.2:8000\n");
        let r = r.as_ref().map(|r| (r.header.as_str(), r.addresses.clone()));
        assert_eq!(
            r,
            Some((
                "x-dest",
                vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()]
            ))
        );
    }

    #[test]
    fn other_configs_are_not_a_route() {
        for bad in [
            &b"route:x-dest:"[..],
            b"route::10.0.0.1:80",
            b"probe:3:64",
            b"{}",
            b"\xff",
        ] {
            assert!(Route::parse(bad).is_none(), "{bad:?}");
        }
        assert_eq!(parse_probe(b"probe:3:64"), Some((3, 64)));
    }
}

//! kvroute-noop: the "Envoy + an empty Wasm filter" contender of the gateway
//! overhead benchmark (scripts/bench_overhead.py).
//!
//! It does what kvroute must do before any routing work, and nothing else:
//! pause in the header callback (Envoy needs
//! `allow_on_headers_stop_iteration: true`), let Envoy buffer the request
//! body, and continue at the end of the stream. The difference between it and
//! plain Envoy is the cost of the Wasm VM plus body buffering; the difference
//! between it and kvroute is kvroute's own work.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream))
    }
}

struct Stream;

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

    fn on_http_request_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        Action::Continue
    }
}

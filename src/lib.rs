//! kvroute, the proxy-wasm filter: glue between Envoy and kvroute-core.
//!
//! Per request: remove any client copy of the destination header; if the
//! request is an inference API call, buffer its body (returning Pause from
//! the header callback, which needs `allow_on_headers_stop_iteration`), then
//! analyse, pick and charge in kvroute-core, set the destination header
//! (`primary,fallback,...`) and continue. Envoy's `override_host` load
//! balancing policy routes to the first address and walks the rest on
//! retries. The charge is released in two steps: the prompt part at the
//! first response byte, the rest when the stream ends.
//!
//! Nothing here panics: host calls go through `proxy_wasm::hostcalls`, whose
//! errors are mapped or skipped, and every malformed input is a fallback
//! decision plus a counter.

mod host;

use std::rc::Rc;

use kvroute_core::decide::{self, Decision, Unparsed};
use kvroute_core::host::Counter;
use kvroute_core::host::Metrics;
use kvroute_core::load::Charge;
use kvroute_core::{Config, Endpoint};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};

use crate::host::{HostMetrics, HostSharedData};

/// Response header that explains the decision, when enabled.
const EXPLAIN_HEADER: &str = "x-kvroute-decision";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// What every stream of this VM shares: the compiled config and metric ids.
struct Shared {
    config: Config,
    metrics: HostMetrics,
}

#[derive(Default)]
struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(b)) => b,
            Ok(None) => {
                log::error!("kvroute: invalid plugin configuration: config: missing (set the filter's configuration to kvroute JSON)");
                return false;
            }
            Err(e) => {
                log::error!("kvroute: cannot read plugin configuration: {e:?}");
                return false;
            }
        };
        match Config::from_json(&bytes) {
            Ok(config) => {
                log::info!(
                    "kvroute: configured {} hosts, header {}, {} fallbacks, epsilon {}",
                    config.hosts.len(),
                    config.destination_header,
                    config.fallbacks,
                    config.epsilon
                );
                self.shared = Some(Rc::new(Shared {
                    config,
                    metrics: HostMetrics::define(),
                }));
                true
            }
            Err(e) => {
                log::error!("kvroute: invalid plugin configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Stream {
            id: context_id,
            shared,
            endpoint: None,
            session: None,
            body_size: 0,
            decision: None,
            pending: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream.
struct Stream {
    id: u32,
    shared: Rc<Shared>,
    endpoint: Option<Endpoint>,
    session: Option<String>,
    body_size: usize,
    decision: Option<Decision>,
    /// What is still charged to the chosen host.
    pending: Option<Charge>,
}

fn header(name: &str) -> Option<String> {
    // A header that is not valid UTF-8 reads as an error: treat it as absent.
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

impl Stream {
    /// Decides once, sets the destination header, and returns the action.
    fn decide(&mut self, facts: Result<decide::Facts, Unparsed>) -> Action {
        let cfg = &self.shared.config;
        let d = decide::route(
            cfg,
            &HostSharedData,
            &self.shared.metrics,
            facts.as_ref().map_err(|u| *u),
            u64::from(self.id),
        );
        log::debug!(
            "[{}] kvroute decision reason={} key={:?} primary={:?} unparsed={:?}",
            self.id,
            d.reason.as_str(),
            d.key,
            d.pick
                .as_ref()
                .and_then(|p| cfg.hosts.get(p.primary))
                .map(|h| &h.addr),
            facts.as_ref().err()
        );
        self.pending = d.charge;
        let action = match &d.pick {
            Some(pick) => {
                let value = decide::destination(cfg, pick);
                if let Err(e) = hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    &cfg.destination_header,
                    Some(&value),
                ) {
                    log::warn!(
                        "[{}] kvroute: cannot set destination header: {e:?}",
                        self.id
                    );
                }
                Action::Continue
            }
            None => {
                let body =
                    br#"{"error":{"message":"kvroute: no replica available","type":"no_hosts"}}"#;
                let _ = hostcalls::send_http_response(
                    503,
                    vec![("content-type", "application/json")],
                    Some(body),
                );
                Action::Pause
            }
        };
        self.decision = Some(d);
        action
    }

    fn decide_buffered(&mut self) -> Action {
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        self.shared
            .metrics
            .count(Counter::BodyBytes, body.len() as u64);
        let facts = match self.endpoint {
            Some(ep) => decide::analyze(&self.shared.config, ep, self.session.as_deref(), &body),
            None => Err(Unparsed::NotInference),
        };
        self.decide(facts)
    }

    fn release(&mut self, prefill_only: bool) {
        let Some(charge) = self.pending else { return };
        let now = if prefill_only {
            Charge {
                decode: 0,
                ..charge
            }
        } else {
            charge
        };
        decide::release(
            &self.shared.config,
            &HostSharedData,
            &self.shared.metrics,
            now,
        );
        self.pending = if prefill_only {
            Some(Charge {
                prefill: 0,
                ..charge
            })
        } else {
            None
        };
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let cfg = &self.shared.config;
        // Clients never steer the destination: drop every copy they sent.
        if let Err(e) =
            hostcalls::remove_map_value(MapType::HttpRequestHeaders, &cfg.destination_header)
        {
            log::warn!(
                "[{}] kvroute: cannot remove client destination header: {e:?}",
                self.id
            );
        }
        let method = header(":method").unwrap_or_default();
        let path = header(":path").unwrap_or_default();
        self.endpoint = Endpoint::from_request(&method, &path);
        if self.endpoint.is_none() {
            return self.decide(Err(Unparsed::NotInference));
        }
        self.session = cfg.session_headers.iter().find_map(|h| header(h));
        if end_of_stream {
            return self.decide(Err(Unparsed::Empty));
        }
        // Hold the headers until the body is in.
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decision.is_some() {
            return Action::Continue;
        }
        self.body_size = body_size;
        if body_size > self.shared.config.max_body_bytes {
            self.shared
                .metrics
                .count(Counter::BodyBytes, body_size as u64);
            return self.decide(Err(Unparsed::TooLarge));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide_buffered()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.decision.is_some() {
            return Action::Continue;
        }
        self.decide_buffered()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // First response byte: the prompt has been prefilled.
        self.release(true);
        if self.shared.config.explain_header {
            if let Some(d) = &self.decision {
                let value = decide::explain(&self.shared.config, d);
                let _ = hostcalls::set_map_value(
                    MapType::HttpResponseHeaders,
                    EXPLAIN_HEADER,
                    Some(&value),
                );
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release(false);
    }
}

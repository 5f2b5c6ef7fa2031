//! Which engines exist: the [`Discovery`] trait and its implementations.
//!
//! An engine is one `ip:port`; the snapshot always names engines that way,
//! because that is what the gateway's destination header and Envoy's
//! `override_host` policy route to.
//!
//! - [`StaticDiscovery`]: `ip:port` entries from the configuration.
//! - [`DnsDiscovery`]: `name:port` entries, resolved again every
//!   `dns-refresh`. Each address a name resolves to is one engine, so a
//!   Kubernetes headless Service (`vllm.ns.svc.cluster.local:8000`), whose A
//!   records are its ready pods' IPs, becomes the list of its pods. When a
//!   lookup fails, the name keeps its last good addresses (a resolver hiccup
//!   must not empty the fleet); their scrapes then say whether they are alive.
//! - [`Union`]: several sources, deduplicated.
//!
//! # Plugging in EndpointSlice discovery
//!
//! DNS sees only ready pods and learns of changes at the next refresh. A
//! Kubernetes-native source would watch the `EndpointSlice`s of the engines'
//! Service (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`) and
//! return every endpoint address with the Service's target port, including
//! endpoints whose `conditions.ready` is false (the collector's own `/health`
//! probe decides readiness, and seeing a pod that is still loading weights is
//! useful). It is one more `impl Discovery`: its `engines()` returns the
//! addresses of the latest watched state (a watch thread updates a shared
//! `Vec<SocketAddr>`; `engines()` clones it), and the collector loop needs no
//! change. It is left out of this crate on purpose: it needs an API-server
//! client (TLS, service-account token, RBAC to list/watch `endpointslices`),
//! which would multiply the dependency tree of a sidecar that otherwise
//! speaks plain HTTP on loopback or the pod network.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use log::{info, warn};

use crate::metrics::Metrics;

/// A source of engine addresses. Called from the discovery thread every
/// `dns-refresh`; may block (a DNS lookup).
pub trait Discovery: Send {
    /// The current set of engines.
    fn engines(&mut self) -> Vec<SocketAddr>;
}

/// One configured engine entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// An `ip:port`.
    Addr(SocketAddr),
    /// A `name:port` to resolve.
    Name { host: String, port: u16 },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Addr(a) => write!(f, "{a}"),
            Target::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl Target {
    /// Parses `ip:port`, `[ipv6]:port` or `name:port`; the error says why not.
    pub fn parse(s: &str) -> Result<Target, String> {
        let s = s.trim();
        if s.contains("://") {
            return Err("give host:port without a scheme".into());
        }
        if let Ok(addr) = s.parse::<SocketAddr>() {
            if addr.port() == 0 {
                return Err("port 0 is not a port an engine listens on".into());
            }
            return Ok(Target::Addr(addr));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or("expected host:port, e.g. 10.0.0.11:8000 or vllm.default.svc:8000")?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("port {port:?} is not a number from 1 to 65535"))?;
        if port == 0 {
            return Err("port 0 is not a port an engine listens on".into());
        }
        if host.is_empty() {
            return Err("the host is empty".into());
        }
        if host.starts_with('[') || host.contains(':') {
            return Err("not a valid IPv6 address (write it as [addr]:port)".into());
        }
        if host.parse::<std::net::Ipv4Addr>().is_err()
            && host
                .split('.')
                .all(|l| l.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(format!("{host:?} is not a valid IPv4 address"));
        }
        let ok = host.len() <= 253
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            });
        if !ok {
            return Err(format!("{host:?} is not a valid host name"));
        }
        Ok(Target::Name {
            host: host.to_owned(),
            port,
        })
    }
}

/// A fixed list of addresses.
#[derive(Debug, Clone)]
pub struct StaticDiscovery(pub Vec<SocketAddr>);

impl Discovery for StaticDiscovery {
    fn engines(&mut self) -> Vec<SocketAddr> {
        self.0.clone()
    }
}

/// Resolves a name and port to addresses.
pub type Resolver = Box<dyn FnMut(&str, u16) -> io::Result<Vec<SocketAddr>> + Send>;

/// The system resolver (`getaddrinfo`).
pub fn system_resolver() -> Resolver {
    Box::new(|host, port| Ok((host, port).to_socket_addrs()?.collect()))
}

/// `name:port` entries, resolved on every call.
pub struct DnsDiscovery {
    names: Vec<(String, u16)>,
    resolve: Resolver,
    /// Last good answer per name, and whether the last lookup failed.
    last: HashMap<(String, u16), (Vec<SocketAddr>, bool)>,
    metrics: Option<Arc<Metrics>>,
    /// What an address is, in log lines: "engine" or "gateway".
    what: &'static str,
}

impl DnsDiscovery {
    pub fn new(
        names: Vec<(String, u16)>,
        resolve: Resolver,
        metrics: Option<Arc<Metrics>>,
    ) -> DnsDiscovery {
        DnsDiscovery {
            names,
            resolve,
            last: HashMap::new(),
            metrics,
            what: "engine",
        }
    }

    /// The same, logging its addresses as `what` (e.g. "gateway").
    pub fn naming(mut self, what: &'static str) -> DnsDiscovery {
        self.what = what;
        self
    }
}

impl Discovery for DnsDiscovery {
    fn engines(&mut self) -> Vec<SocketAddr> {
        let mut out = Vec::new();
        for (host, port) in &self.names {
            let key = (host.clone(), *port);
            let result = (self.resolve)(host, *port).and_then(|addrs| {
                if addrs.is_empty() {
                    Err(io::Error::other("no addresses"))
                } else {
                    Ok(addrs)
                }
            });
            let entry = self.last.entry(key).or_insert_with(|| (Vec::new(), false));
            match result {
                Ok(mut addrs) => {
                    addrs.sort();
                    addrs.dedup();
                    if entry.1 || entry.0 != addrs {
                        info!(
                            "dns {host}:{port}: {} {}(s): {}",
                            addrs.len(),
                            self.what,
                            join(&addrs)
                        );
                    }
                    *entry = (addrs, false);
                }
                Err(e) => {
                    if !entry.1 {
                        warn!(
                            "dns {host}:{port}: lookup failed ({e}); keeping {} last known address(es)",
                            entry.0.len()
                        );
                    }
                    entry.1 = true;
                    if let Some(m) = &self.metrics {
                        m.dns_failure(&format!("{host}:{port}"));
                    }
                }
            }
            out.extend(entry.0.iter().copied());
        }
        out
    }
}

/// Several sources as one, deduplicated and sorted.
pub struct Union(pub Vec<Box<dyn Discovery>>);

impl Discovery for Union {
    fn engines(&mut self) -> Vec<SocketAddr> {
        let all: BTreeSet<SocketAddr> = self.0.iter_mut().flat_map(|d| d.engines()).collect();
        all.into_iter().collect()
    }
}

/// The discovery for configured targets: addresses as they are, names by DNS.
/// The second value says whether anything needs re-resolving.
pub fn for_targets(
    targets: &[Target],
    resolve: Resolver,
    metrics: Option<Arc<Metrics>>,
) -> (Union, bool) {
    let mut addrs = Vec::new();
    let mut names = Vec::new();
    for t in targets {
        match t {
            Target::Addr(a) => addrs.push(*a),
            Target::Name { host, port } => names.push((host.clone(), *port)),
        }
    }
    let dynamic = !names.is_empty();
    let mut parts: Vec<Box<dyn Discovery>> = vec![Box::new(StaticDiscovery(addrs))];
    if dynamic {
        parts.push(Box::new(DnsDiscovery::new(names, resolve, metrics)));
    }
    (Union(parts), dynamic)
}

fn join(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn parses_targets() {
        assert_eq!(
            Target::parse("10.0.0.1:8000"),
            Ok(Target::Addr(a("10.0.0.1:8000")))
        );
        assert_eq!(
            Target::parse(" [::1]:8000 "),
            Ok(Target::Addr(a("[::1]:8000")))
        );
        assert_eq!(
            Target::parse("vllm.default.svc.cluster.local:8000"),
            Ok(Target::Name {
                host: "vllm.default.svc.cluster.local".into(),
                port: 8000
            })
        );
        for (bad, why) in [
            ("10.0.0.1", "expected host:port"),
            ("http://10.0.0.1:80", "without a scheme"),
            ("10.0.0.1:0", "port 0"),
            ("host:99999", "not a number from 1 to 65535"),
            ("host:", "not a number"),
            (":80", "host is empty"),
            ("::1:80", "IPv6"),
            ("10.0.0.256:80", "not a valid IPv4 address"),
            ("bad host:80", "not a valid host name"),
            ("a..b:80", "not a valid host name"),
        ] {
            let err = Target::parse(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn dns_keeps_last_good_answer_and_unions_dedup() {
        let answers = Arc::new(Mutex::new(vec![
            Ok(vec![a("10.0.0.2:80"), a("10.0.0.1:80"), a("10.0.0.1:80")]),
            Err(io::Error::other("SERVFAIL")),
            Ok(vec![]),
            Ok(vec![a("10.0.0.3:80")]),
        ]));
        let feed = Arc::clone(&answers);
        let resolver: Resolver = Box::new(move |host, port| {
            assert_eq!((host, port), ("svc", 80));
            feed.lock().unwrap().remove(0)
        });
        let metrics = Arc::new(Metrics::new());
        let targets = vec![
            Target::Addr(a("10.0.0.1:80")),
            Target::Name {
                host: "svc".into(),
                port: 80,
            },
        ];
        let (mut d, dynamic) = for_targets(&targets, resolver, Some(Arc::clone(&metrics)));
        assert!(dynamic);
        assert_eq!(d.engines(), vec![a("10.0.0.1:80"), a("10.0.0.2:80")]);
        // Failure and empty answers keep the last good set.
        assert_eq!(d.engines(), vec![a("10.0.0.1:80"), a("10.0.0.2:80")]);
        assert_eq!(d.engines(), vec![a("10.0.0.1:80"), a("10.0.0.2:80")]);
        assert_eq!(d.engines(), vec![a("10.0.0.1:80"), a("10.0.0.3:80")]);
        assert!(metrics
            .render()
            .contains("kvroute_collector_dns_failures_total{name=\"svc:80\"} 2"));
    }

    #[test]
    fn system_resolver_resolves_localhost() {
        let mut r = system_resolver();
        let addrs = r("localhost", 8000).unwrap();
        assert!(addrs
            .iter()
            .all(|x| x.ip().is_loopback() && x.port() == 8000));
        assert!(!addrs.is_empty());
    }
}

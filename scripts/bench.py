#!/usr/bin/env python3
"""Routing-quality benchmark: the same workload through each router in turn,
on a fresh simulated fleet each time, then one report.

    .venv/bin/python scripts/bench.py                      (`make bench`)
    .venv/bin/python scripts/bench.py --smoke --check      (`make bench-smoke`)
    .venv/bin/python scripts/bench.py --trace other.jsonl --window 0:600 --rate 1.5

For every router:
  1. start kvroute-sim --mode engine (N engines on free loopback ports);
  2. start the router in front of them and wait until it answers;
  3. kvroute-bench replay: open-loop, streamed, engines sampled;
  4. stop the router and the fleet (by PID).
Then kvroute-bench report writes report.json, report.md and the SVG plots to
--out (bench/results by default).

Routers (--routers, comma-separated, in this order by default):
  envoy-round-robin     Envoy 1.40 ROUND_ROBIN
  envoy-least-request   Envoy LEAST_REQUEST (power of two choices, Envoy's default)
  envoy-ring-hash       Envoy RING_HASH on the session header, hash_balance_factor 125
  sglang-cache-aware    sglang-router, policy cache_aware, its defaults
  vllm-cache-aware      vllm-router, policy cache_aware
  vllm-consistent-hash  vllm-router, policy consistent_hash
  vllm-sticky-least-loaded  vllm-router, policy sticky_least_loaded
  kvroute               Envoy + the kvroute filter + kvroute-collector (fleet state)
With --gateways K[,K...], every router runs as K independent instances
(kvroute: K Envoys, each with its own shared data and its own collector,
which pushes to its own gateway only and reads the other K - 1 gateways'
in-flight load for its snapshots (--peer-gateways), the sidecar layout of
the shipped manifests; with --collector sidecar-alone the collectors do not
read each other's gateways; with --collector shared one collector pushes to
all K and carries each gateway's pending prefill to the others; Envoy's
policies: K Envoys; the peers: K processes)
behind one front Envoy that spreads each request round
robin over them, as a Kubernetes Service would (no retries at the front).
The same front stands in front of K = 1, so every figure pays the same hop.

The gateway runs on wall time and the fleet on modelled time, time scale
times faster. kvroute's knobs in seconds and tokens per second are therefore
scaled so that they mean the same modelled quantity (TIME_KNOBS): its cost
order is unchanged, and the other gateways' pending prefill drains at the
engines' real pace.
The report's "conversation split" column is the share of each session's
requests served by its most frequent engine.

Peers are run from their own virtualenv (.venv-peers, from the pinned
bench/requirements-peers.txt, installed by `make bench-tools`); a peer that is not installed is skipped with a note,
unless --require-peers.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

import harness  # noqa: E402

REPO = harness.REPO_ROOT
SIM = REPO / "target" / "release" / "kvroute-sim"
BENCH = REPO / "target" / "release" / "kvroute-bench"
DEFAULT_TRACE = REPO / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SESSION_HEADER = "x-session-id"
# Same slack as kvroute's bounded load (epsilon 0.25): a host takes at most
# 1.25x the average before the ring walks on.
RING_HASH_BALANCE = 125

ALL_ROUTERS = [
    "envoy-round-robin",
    "envoy-least-request",
    "envoy-ring-hash",
    "sglang-cache-aware",
    "vllm-cache-aware",
    "vllm-consistent-hash",
    "vllm-sticky-least-loaded",
    "kvroute",
]

PEERS_VENV = REPO / ".venv-peers"


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------ the fleet


class Fleet:
    """kvroute-sim --mode engine on free ports; addresses read from its stdout."""

    def __init__(self, engines: int, time_scale: float, seed: int, workdir: Path, extra: list[str],
                 base_port: int = 0):
        self.cmd = [
            str(SIM), "--mode", "engine", "--engines", str(engines), "--base-port", str(base_port),
            "--time-scale", str(time_scale), "--seed", str(seed), "--model", MODEL, *extra,
        ]
        self.engines = engines
        self.time_scale = time_scale
        self.log_path = workdir / "sim.log"
        self.proc: subprocess.Popen | None = None
        self.addresses: list[str] = []

    def start(self, timeout: float = 20.0) -> "Fleet":
        err = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                         text=True, cwd=str(REPO))
        finally:
            err.close()
        lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line.strip())
                if line.strip() == "ready":
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or "ready" not in lines:
            self.stop()
            raise BenchError(f"simulator did not start: {' | '.join(lines)} {self.log_text()}")
        self.addresses = [l.rsplit(" ", 1)[-1] for l in lines if " on " in l]
        if len(self.addresses) != self.engines:
            self.stop()
            raise BenchError(f"simulator printed {len(self.addresses)} addresses for {self.engines} engines: {lines}")
        return self

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.addresses]

    def stop(self) -> None:
        harness.stop_process(self.proc)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


# ------------------------------------------------------------------ routers


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, what: str = "router") -> None:
    """Until a GET of url answers 200."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = str(r.status)
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = str(exc)
        time.sleep(0.2)
    raise BenchError(f"{what} not answering {url} after {timeout:.0f} s (last: {last})")


def wait_workers(url: str, n: int, what: str, timeout: float = 60.0) -> None:
    """Until a peer router's GET /workers lists all n workers."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                body = json.loads(r.read() or b"{}")
                total = body.get("total", len(body.get("workers", []))) if isinstance(body, dict) else len(body)
                if total >= n:
                    return
                last = f"{total} workers"
        except Exception as exc:  # noqa: BLE001
            last = str(exc)
        time.sleep(0.2)
    raise BenchError(f"{what} does not list {n} workers after {timeout:.0f} s (last: {last})")


def probe_chat(url: str, timeout: float = 60.0) -> None:
    """One tiny chat completion through the router: it routes end to end."""
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "warm-up probe"}]}).encode()
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", SESSION_HEADER: "probe"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except Exception as exc:  # noqa: BLE001
            last = str(exc)
        time.sleep(0.3)
    raise BenchError(f"router at {url} does not complete a chat request: {last}")


@dataclass
class Router:
    name: str
    setup: str
    url: str = ""
    procs: list = field(default_factory=list)
    envoy: harness.Envoy | None = None
    collector: harness.Collector | None = None
    ingest_url: str = ""
    ingest_token: str = ""

    def stop(self) -> None:
        if self.collector is not None:
            self.collector.stop()
        if self.envoy is not None:
            self.envoy.stop()
        for p in self.procs:
            harness.stop_process(p)


# The fixed layout of the local stack (DESIGN.md), for `make demo`.
LOCAL = {"engines": 8001, "gateway": 10000, "admin": 9901, "ingest": 10001, "collector": 9102}


def router_ports(local: bool) -> tuple[int, int, int]:
    """(gateway, admin, ingest): the local stack's, or free ones."""
    if local:
        harness.require_free_ports([LOCAL["gateway"], LOCAL["admin"], LOCAL["ingest"]])
        return LOCAL["gateway"], LOCAL["admin"], LOCAL["ingest"]
    gw, admin, ingest = harness.free_ports(3)
    return gw, admin, ingest


def envoy_plain(name: str, fleet: Fleet, workdir: Path, local: bool = False) -> Router:
    """Envoy with the same listener and cluster as kvroute's, no Wasm, and the
    cluster's LB policy replaced."""
    gw, admin, _ = router_ports(local)
    cfg = harness.build_envoy_config(gateway_port=gw, admin_port=admin, endpoints=fleet.addresses, wasm=None)
    cluster = [c for c in cfg["static_resources"]["clusters"] if c["name"] == harness.CLUSTER_NAME][0]
    cluster.pop("load_balancing_policy", None)
    if name == "envoy-round-robin":
        cluster["lb_policy"] = "ROUND_ROBIN"
        setup = "Envoy 1.40, lb_policy ROUND_ROBIN"
    elif name == "envoy-least-request":
        cluster["lb_policy"] = "LEAST_REQUEST"
        setup = "Envoy 1.40, lb_policy LEAST_REQUEST (2 choices, Envoy's default)"
    else:
        cluster["lb_policy"] = "RING_HASH"
        cluster["ring_hash_lb_config"] = {"minimum_ring_size": 1024}
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": RING_HASH_BALANCE}}
        listener = [l for l in cfg["static_resources"]["listeners"] if l["name"] == harness.LISTENER_NAME][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        route["hash_policy"] = [{"header": {"header_name": SESSION_HEADER}}]
        setup = (f"Envoy 1.40, lb_policy RING_HASH on header {SESSION_HEADER}, "
                 f"hash_balance_factor {RING_HASH_BALANCE} (bounded load, counts requests)")
    envoy = harness.Envoy(cfg, workdir, concurrency=2, log_level="warning").start()
    return Router(name=name, setup=setup, url=envoy.gateway_url, envoy=envoy)


# kvroute's fleet knobs that are rates or durations of the engines' work,
# at their defaults (crates/kvroute-core/src/config.rs, `defaults`), and how
# each scales with the time scale s: a rate in modelled tokens per second is
# s times as many per wall second; a cost or a wait in modelled seconds is
# 1/s of a wall second. Ratios between them, hence every decision, stay.
TIME_KNOBS = {
    ("fleet", "prefillTokensPerS"): (30_000, 1),
    ("fleet", "memorySeconds"): (1.0, -1),
    ("fleet", "costQuantumMs"): (2.0, -1),
    ("admission", "maxPendingS"): (1.0, -1),
}


def time_scaled(overrides: dict | None, time_scale: float) -> dict:
    """The plugin overrides with TIME_KNOBS scaled to the fleet's time scale
    (a knob the overrides set is taken as modelled and scaled the same way)."""
    out = copy.deepcopy(overrides or {})
    for (section, key), (default, power) in TIME_KNOBS.items():
        value = out.get(section, {}).get(key, default)
        scaled = value * time_scale ** power
        out.setdefault(section, {})[key] = round(scaled) if key == "prefillTokensPerS" else scaled
    return out


def kvroute_router(fleet: Fleet, workdir: Path, collector_ms: int, local: bool = False,
                   name: str = "kvroute", overrides: dict | None = None, instance: int = 0,
                   with_collector: bool = True) -> Router:
    """Envoy + kvroute in front of the fleet; with its own collector unless
    with_collector is false (the caller then starts one for several)."""
    gw, admin, ingest = router_ports(local)
    plugin = harness.plugin_config_for(fleet.addresses,
                                       {"explainHeader": False, **time_scaled(overrides, fleet.time_scale)})
    cfg = harness.build_envoy_config(gateway_port=gw, admin_port=admin, endpoints=fleet.addresses,
                                     plugin_config=plugin, ingest_port=ingest)
    envoy = harness.Envoy(cfg, workdir, concurrency=2, log_level="warning").start()
    token = harness.embedded_ingest_config(cfg)["ingest"]["token"]
    ingest_url = f"http://127.0.0.1:{ingest}"
    collector = None
    if with_collector:
        collector = harness.Collector(engines=fleet.addresses, gateways=[ingest_url], token=token,
                                      workdir=workdir, interval_ms=collector_ms,
                                      collector_id=f"kvroute-bench-{instance}",
                                      metrics_port=LOCAL["collector"] if local else None, log_level="warn").start()
    settings = f"plugin config overrides {json.dumps(overrides)}" if overrides else "plugin defaults"
    setup = (f"Envoy 1.40 + kvroute ({settings}, rates and durations scaled to the time scale; fleet state from "
             f"kvroute-collector scraping every {collector_ms} ms real time)")
    return Router(name=name, setup=setup, url=envoy.gateway_url, envoy=envoy, collector=collector,
                  ingest_url=ingest_url, ingest_token=token)


def peer_binary(name: str) -> Path | None:
    p = PEERS_VENV / "bin" / name
    return p if p.is_file() and os.access(p, os.X_OK) else None


def peer_router(name: str, fleet: Fleet, workdir: Path) -> Router:
    port, metrics = harness.free_ports(2)
    urls = fleet.urls
    if name == "sglang-cache-aware":
        py = peer_binary("python")
        if py is None or not (PEERS_VENV / ".installed").is_file():
            raise BenchError("sglang-router is not installed (make bench-tools)")
        cmd = [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "cache_aware",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics), "--log-level", "warn"]
        setup = "sglang-router 0.3.2, --policy cache_aware, other options at their defaults"
    else:
        exe = peer_binary("vllm-router")
        if exe is None:
            raise BenchError("vllm-router is not installed (make bench-tools)")
        policy = {"vllm-cache-aware": "cache_aware", "vllm-consistent-hash": "consistent_hash",
                  "vllm-sticky-least-loaded": "sticky_least_loaded"}[name]
        cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
               "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
               "--log-level", "warning", "--worker-startup-check-interval", "1"]
        setup = f"vllm-router 0.1.17, --policy {policy}, other options at their defaults"
    logf = open(workdir / f"{name}.log", "wb")
    try:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(workdir))
    finally:
        logf.close()
    router = Router(name=name, setup=setup, url=f"http://127.0.0.1:{port}", procs=[proc])
    try:
        harness.wait_for_port(port, 60, proc)
    except harness.HarnessError as exc:
        router.stop()
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-1500:]
        raise BenchError(f"{name} did not start: {exc}\n{tail}") from exc
    return router


def is_kvroute(name: str, args) -> bool:
    return name == "kvroute" or name in args.variants


def start_router(name: str, fleet: Fleet, workdir: Path, args, instance: int = 0,
                 with_collector: bool = True) -> Router:
    if name.startswith("envoy-"):
        return envoy_plain(name, fleet, workdir, args.local_stack)
    if is_kvroute(name, args):
        return kvroute_router(fleet, workdir, args.collector_ms, args.local_stack, name, args.variants.get(name),
                              instance=instance, with_collector=with_collector)
    return peer_router(name, fleet, workdir)


def front_envoy(instances: list[Router], workdir: Path, retry_connect_failures: bool = False) -> harness.Envoy:
    """A plain Envoy spreading each request round robin over the router
    instances, with no retries: what a Kubernetes Service in front of K
    gateway pods does (per request here; kube-proxy spreads connections).
    retry_connect_failures: retry, once and on another instance, a request
    whose connection was refused (it never reached a gateway), as a load
    balancer that health-checks its targets would avoid a dead one."""
    gw, admin = harness.free_ports(2)
    targets = [r.url.removeprefix("http://").rstrip("/") for r in instances]
    cfg = harness.build_envoy_config(gateway_port=gw, admin_port=admin, endpoints=targets, wasm=None)
    cluster = [c for c in cfg["static_resources"]["clusters"] if c["name"] == harness.CLUSTER_NAME][0]
    cluster.pop("load_balancing_policy", None)
    cluster["lb_policy"] = "ROUND_ROBIN"
    listener = [l for l in cfg["static_resources"]["listeners"] if l["name"] == harness.LISTENER_NAME][0]
    route = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
        "routes"][0]["route"]
    route.pop("retry_policy", None)
    if retry_connect_failures:
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream", "num_retries": 1,
            "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        }
    workdir.mkdir(parents=True, exist_ok=True)
    return harness.Envoy(cfg, workdir, concurrency=2, log_level="warning").start()


@dataclass
class Deployment:
    """What one run replays against: one router, or K instances behind a front."""

    url: str
    setup: str
    instances: list[Router]
    front: harness.Envoy | None = None
    collector: harness.Collector | None = None

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
        if self.collector is not None:
            self.collector.stop()
        for r in self.instances:
            r.stop()


def deploy(name: str, fleet: Fleet, workdir: Path, args, gateways: int | None) -> Deployment:
    if gateways is None:
        r = start_router(name, fleet, workdir, args)
        return Deployment(url=r.url, setup=r.setup, instances=[r])
    instances: list[Router] = []
    shared = args.collector == "shared" and is_kvroute(name, args)
    # Sidecars that read the other replicas' load: each collector needs
    # the others' ingest URLs, so they start once every instance is up.
    peers = args.collector == "sidecar" and is_kvroute(name, args) and gateways > 1
    collector = None
    try:
        for i in range(gateways):
            wd = workdir / f"gateway-{i}"
            wd.mkdir(parents=True, exist_ok=True)
            instances.append(start_router(name, fleet, wd, args, instance=i,
                                          with_collector=not (shared or peers)))
        if peers:
            for i, r in enumerate(instances):
                others = [o.ingest_url for o in instances if o is not r]
                r.collector = harness.Collector(
                    engines=fleet.addresses, gateways=[r.ingest_url], token=r.ingest_token,
                    workdir=workdir / f"gateway-{i}", interval_ms=args.collector_ms,
                    collector_id=f"kvroute-bench-{i}", log_level="warn",
                    extra_args=["--peer-gateways", ",".join(others)]).start()
        if shared:
            collector = harness.Collector(
                engines=fleet.addresses, gateways=[r.ingest_url for r in instances],
                token=instances[0].ingest_token, workdir=workdir / "collector", interval_ms=args.collector_ms,
                collector_id="kvroute-bench-shared", log_level="warn").start()
        for r in instances:
            if r.procs:
                wait_workers(r.url, len(fleet.addresses), name)
        front = front_envoy(instances, workdir / "front")
    except BaseException:
        if collector is not None:
            collector.stop()
        for r in instances:
            r.stop()
        raise
    each = instances[0].setup
    if peers:
        each = each.replace("fleet state from kvroute-collector",
                            "fleet state from its own kvroute-collector, which also reads the other "
                            f"{gateways - 1} gateways' pending prefill")
    if shared:
        each = each.replace("fleet state from kvroute-collector",
                            f"fleet state from one kvroute-collector for all {gateways} (with their pending prefill)")
    setup = (f"{gateways} independent instance(s) behind a round-robin front Envoy (per request, no retries); "
             f"each: {each}")
    return Deployment(url=front.gateway_url, setup=setup, instances=instances, front=front, collector=collector)


# ------------------------------------------------------------------ main


def workload_args(args) -> list[str]:
    if args.workload == "trace":
        return ["--workload", "trace", "--trace", str(args.trace), "--window", args.window, "--rate", str(args.rate),
                "--trace-key", args.trace_key, "--seed", str(args.seed),
                *(["--max-requests", str(args.max_requests)] if args.max_requests else [])]
    return ["--workload", args.workload, "--seed", str(args.seed), *args.workload_arg]


def parse_args(argv):
    p = argparse.ArgumentParser(description="kvroute routing benchmark on the simulated fleet")
    p.add_argument("--routers", default=",".join(ALL_ROUTERS), help="comma-separated, in report order")
    p.add_argument("--workload", choices=["trace", "sessions", "groups", "family"], default="trace",
                   help="family: a family of the simulation's workload suite, e.g. "
                        "--workload family --workload-arg=--family=groups --workload-arg=--family-replicas=4")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace (JSON lines)")
    # The default: the whole trace at 1.5x. Round robin is clearly loaded
    # there (TTFT p99 about 14 s against about 4 s at 1x on the shared
    # trace) but not collapsed (every request completes, no sustained
    # queue growth); at 2x its queues grow for the whole run.
    p.add_argument("--window", default="0:inf", help="trace window START:END, seconds (default: all of it)")
    p.add_argument("--rate", type=float, default=1.5, help="arrival-rate multiplier (default 1.5)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--trace-key", choices=["none", "first-block"], default="first-block")
    p.add_argument("--workload-arg", action="append", default=[],
                   help="extra kvroute-bench workload flag (repeatable), e.g. --workload-arg=--sessions=100")
    p.add_argument("--no-session-header", action="store_true",
                   help="send no session header (most OpenAI clients send none): kvroute keys each conversation by "
                        "its text to the first question, ring hashing picks at random")
    p.add_argument("--flat-prompt", action="store_true",
                   help="send each conversation as one user message (its texts joined), as a bare prompt: only the "
                        "bytes say where a shared system prompt ends")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=10.0, help="modelled seconds per real second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--collector-ms", type=int, default=50, help="kvroute-collector scrape interval, real ms")
    p.add_argument("--sim-arg", action="append", default=[], help="extra kvroute-sim flag (repeatable)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--smoke", action="store_true",
                   help="a small run that checks the harness (trace window 600:700 at 1x, time scale 20; "
                        "generated shared-prefix groups when the trace is missing)")
    p.add_argument("--check", action="store_true", help="fail unless the report's consistency checks pass")
    p.add_argument("--require-peers", action="store_true", help="fail instead of skipping a peer not installed")
    p.add_argument("--keep", action="store_true", help="keep the per-router logs and configs")
    p.add_argument("--kvroute-variant", action="append", default=[], metavar="NAME=JSON",
                   help="an extra router: kvroute with these plugin config overrides (merged one level deep), "
                        "reported as kvroute-NAME, e.g. 'kv1={\"fleet\": {\"wKv\": 1}}' (repeatable)")
    p.add_argument("--gateways", default=None, metavar="K[,K...]",
                   help="run K independent instances of every router behind a round-robin front Envoy "
                        "(like a Service), once per K, e.g. 1,3; without it each router runs once, no front")
    p.add_argument("--collector", choices=["sidecar", "sidecar-alone", "shared"], default="sidecar",
                   help="with --gateways: kvroute's K instances each with its own collector that also reads "
                        "the other instances' in-flight load (sidecar, the shipped manifests' layout: "
                        "--peer-gateways), each with its own collector alone (sidecar-alone), or one collector "
                        "for all of them (shared)")
    p.add_argument("--local-stack", action="store_true",
                   help="use the local stack's fixed ports (engines 8001.., gateway 10000, admin 9901, "
                        "ingest 10001, collector metrics 9102) instead of free ones")
    args = p.parse_args(argv)
    args.gateway_counts = [None]
    if args.gateways is not None:
        try:
            args.gateway_counts = [int(k) for k in args.gateways.split(",") if k.strip()]
        except ValueError:
            p.error(f"--gateways {args.gateways!r}: expected K[,K...], e.g. 1,3")
        if not args.gateway_counts or any(k < 1 or k > 8 for k in args.gateway_counts):
            p.error(f"--gateways {args.gateways!r}: each K from 1 to 8")
        if args.local_stack:
            p.error("--gateways cannot be used with --local-stack (its ports are fixed)")
    args.variants = {}
    for v in args.kvroute_variant:
        label, _, text = v.partition("=")
        try:
            overrides = json.loads(text)
        except ValueError as exc:
            p.error(f"--kvroute-variant {v!r}: not NAME=JSON ({exc})")
        if not label or not isinstance(overrides, dict):
            p.error(f"--kvroute-variant {v!r}: expected NAME=JSON-object")
        args.variants[f"kvroute-{label}"] = overrides
    if args.smoke:
        args.window, args.rate, args.time_scale = "600:700", 1.0, 20.0
        if args.workload == "trace" and not args.trace.is_file():
            # A checkout without the shared trace still checks the harness,
            # on generated shared-prefix groups.
            print(f"bench: {args.trace} not found; smoke run on generated shared-prefix groups", flush=True)
            args.workload = "groups"
            args.workload_arg = ["--group-requests=300", "--group-rate=5"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()] + list(args.variants)
    unknown = [r for r in routers if r not in ALL_ROUTERS and r not in args.variants]
    if unknown:
        print(f"bench: unknown router(s) {unknown}; known: {', '.join(ALL_ROUTERS)}", file=sys.stderr)
        return 2
    for binary in (SIM, BENCH):
        if not binary.is_file():
            print(f"bench: {binary} is missing (cargo build --release -p kvroute-sim -p kvroute-bench)",
                  file=sys.stderr)
            return 2
    if "kvroute" in routers and not harness.wasm_available():
        print(f"bench: {harness.WASM_MISSING_REASON}", file=sys.stderr)
        return 2
    if args.workload == "trace" and not args.trace.is_file():
        print(f"bench: trace {args.trace} not found (--trace FILE)", file=sys.stderr)
        return 2
    wl = workload_args(args)
    described = subprocess.run([str(BENCH), "describe", *wl], capture_output=True, text=True)
    if described.returncode != 0:
        print(f"bench: {described.stderr.strip()}", file=sys.stderr)
        return 2
    desc = json.loads(described.stdout)
    log(f"workload: {desc['summary']}: {desc['requests']} requests over {desc['span_s']:.0f} s, "
        f"mean input {desc['mean_input_tokens']:.0f} tokens, mean output {desc['mean_output_tokens']:.0f}")
    log(f"fleet: {args.engines} simulated engines (kvroute-sim --mode engine, time scale {args.time_scale}x"
        + (f", {' '.join(args.sim_arg)}" if args.sim_arg else "") + ")")
    harness.install_sigterm_as_interrupt()
    work = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    run_files: list[Path] = []
    skipped: list[str] = []
    failed: list[str] = []
    runs = [(name, k) for k in args.gateway_counts for name in routers]
    try:
        for name, k in runs:
            label = name if k is None else f"{name}-k{k}"
            if any(s.startswith(f"{name}:") for s in skipped):
                continue
            wd = work / label
            wd.mkdir()
            fleet = Fleet(args.engines, args.time_scale, args.seed, wd, args.sim_arg,
                          base_port=LOCAL["engines"] if args.local_stack else 0).start()
            router = None
            try:
                try:
                    router = deploy(name, fleet, wd, args, k)
                except BenchError as exc:
                    if "not installed" in str(exc) and not args.require_peers:
                        log(f"- {name}: skipped ({exc})")
                        skipped.append(f"{name}: {exc}")
                        continue
                    raise
                if k is None and router.instances[0].procs:
                    wait_workers(router.url, len(fleet.addresses), name)
                probe_chat(router.url)
                # The probe left a trace in one engine's cache and counters:
                # start every router from the same clean fleet.
                for u in fleet.urls:
                    urllib.request.urlopen(urllib.request.Request(u + "/_sim/reset", method="POST"), timeout=5).read()
                out = runs_dir / f"{label}.json"
                log(f"- {label}: {router.setup}")
                t0 = time.monotonic()
                rc = subprocess.run([
                    str(BENCH), "replay", *wl, "--router", label, "--setup", router.setup, "--target", router.url,
                    "--gateways", str(k or 1),
                    "--engines", ",".join(fleet.urls), "--model", MODEL, "--time-scale", str(args.time_scale),
                    "--session-header", "" if args.no_session_header else SESSION_HEADER, "--out", str(out),
                    *(["--flat-prompt"] if args.flat_prompt else []),
                ]).returncode
                if rc != 0:
                    raise BenchError(f"kvroute-bench replay exited with {rc}")
                log(f"  ({time.monotonic() - t0:.0f} s real)")
                for i, inst in enumerate(router.instances):
                    if inst.envoy is None:
                        continue
                    # Envoy's own view of the run (kvroute_* decision counters, upstream stats).
                    stats = runs_dir / (f"{label}.envoy-stats.txt" if k is None else f"{label}.gateway-{i}.envoy-stats.txt")
                    try:
                        stats.write_text(inst.envoy.prometheus())
                    except OSError:
                        pass
                run_files.append(out)
            except (BenchError, harness.HarnessError) as exc:
                log(f"- {label}: FAILED: {exc}")
                failed.append(label)
            finally:
                if router is not None:
                    router.stop()
                fleet.stop()
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if args.keep or failed:
            log(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if not run_files:
        print("bench: no router completed", file=sys.stderr)
        return 1
    setup = [
        f"Workload: {desc['summary']} ({desc['requests']} requests, mean input {desc['mean_input_tokens']:.0f} tokens, "
        f"mean output {desc['mean_output_tokens']:.0f} tokens).",
        f"Fleet: {args.engines} x kvroute-sim engine (Llama-3.1-8B on one H100 model, see docs/simulator.md"
        + (f"; with {' '.join(args.sim_arg)}, the no-queue floor still the H100's" if args.sim_arg else "")
        + f"), time scale {args.time_scale}x; every figure is modelled time.",
        "Each router runs alone on a freshly started fleet; requests stream (SSE) open-loop at the workload's times.",
        *[f"Skipped: {s}" for s in skipped],
        *[f"Failed: {f} (see the log above)" for f in failed],
    ]
    cmd = [str(BENCH), "report", "--out", str(args.out), *sum((["--setup", s] for s in setup), []),
           *(["--check"] if args.check else []), *map(str, run_files)]
    rc = subprocess.run(cmd).returncode
    if failed and args.check:
        print(f"bench: routers failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())

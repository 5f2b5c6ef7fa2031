#!/usr/bin/env python3
"""Fault campaign: Envoy + kvroute + kvroute-collector in front of a simulated
fleet under steady open-loop load, one fault per run (issue 6, "Faults").

    .venv/bin/python scripts/faults.py                    (`make faults`)
    .venv/bin/python scripts/faults.py --faults die,stall --out target/faults

Every run starts a fresh stack on free 127.0.0.1 ports (kvroute-sim
--mode engine, 4 engines; Envoy 1.40 with kvroute, explainHeader on; the
collector at its shipped defaults: scrape every 250 ms, 200 ms timeout),
replays a generated chat-session workload with `kvroute-bench replay
--records` (every request as a JSON line: wall-clock send time, status,
error, TTFT, the host kvroute named in `x-kvroute-decision`, the engine
that answered, cached tokens), injects the fault at --fault-at seconds (real
time) and lifts it --fault-for seconds later, then stops every process by
its PID. A monitor thread samples the collector's and Envoy's metrics every
250 ms.

The faults (--faults, comma-separated, this order by default):
  die        engine 1 of 4 dies (POST /_sim/fault kind=die: stops listening,
             cuts its connections) and stays dead
  stall      engine 1 hangs (kind=stall) for --fault-for, then goes on
  error      engine 1 answers 503 to completions and /health for --fault-for
  collector  the collector is killed (SIGKILL), restarted --fault-for later
  conflict   a second collector that does not list engine 1 pushes for
             --fault-for alongside the first; meanwhile snapshots with an old
             seq saying every engine is unready are pushed (must be refused)
  reload     Envoy hot restart (--restart-epoch 1, same config) under load
  join       a 5th engine, in the Envoy cluster, the plugin's hosts and the
             collector's list from the start, is started at --fault-at with
             /health 503 for --fault-for (warming up), then ready
  gateway    two gateways (Envoy + kvroute, each with its own collector)
             behind a round-robin front Envoy that retries only refused
             connections; gateway A gets SIGKILL at --fault-at and is
             started again (empty shared data) --fault-for later

Per fault: requests sent vs answered, errors by class (and whether they
were in flight at the fault), how routing adapted (the fault's own
figures: last request named to a dead engine, detection by the collector,
...), hit rate (answers' cached_tokens / prompt_tokens) and TTFT p95 before,
during and after. Writes --out/faults.json, faults.md and one SVG per fault
(requests per named host per second, errors per second, TTFT p95; the fault
window shaded). TTFT and hit rate are modelled time (the simulator runs
--time-scale x faster than real time); fault times and adaptation times are
real seconds, the clock the collector and the filter run on.

Waits while /tmp/kvroute-quiet exists (another job is measuring CPU-sensitive
figures on this machine), before each run.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import math
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

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench  # noqa: E402  (Fleet, wait/probe helpers: one definition, scripts/bench.py)
import harness  # noqa: E402
from bench_overhead import proc_status_kb  # noqa: E402

SIM = bench.SIM
BENCH = bench.BENCH
# Pinned copies of the binaries for a whole campaign (pin_binaries): the
# tree may be rebuilt while it runs.
PINNED: dict[str, Path] = {}
MODEL = bench.MODEL
QUIET_FILE = Path("/tmp/kvroute-quiet")
ALL_FAULTS = ["die", "stall", "error", "collector", "conflict", "reload", "join", "gateway"]
VICTIM = 1  # the engine that dies, stalls or errs

# The engines: the simulator's H100 model with every step cost x4 (a GPU
# with a quarter of the bandwidth and compute), at time scale 1, so that
# modelled time is real time (the collector and the filter's staleness run
# on the real clock) and 50-70 % of the fleet's capacity is a request rate
# this 2-core machine carries through Envoy with room to spare.
SIM_ARGS = ["--step-fixed-us", "24000", "--prefill-token-us", "128", "--decode-seq-us", "120",
            "--context-token-us", "0.194"]
# Load: requests per modelled second (workload_args); chosen with
# --calibrate (see docs/reliability.md, "Faults").
DEFAULT_RATE = 12.0


def log(msg: str) -> None:
    print(msg, flush=True)


def pin_binaries(work: Path) -> dict:
    """Copies the simulator, the replayer, the collector and the Wasm module
    into work/bin and uses those copies from then on; returns their sha256."""

    d = work / "bin"
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for key, src in (("sim", SIM), ("bench", BENCH), ("collector", harness.collector_binary()),
                     ("wasm", harness.WASM_PATH)):
        dst = d / Path(src).name
        shutil.copy2(src, dst)
        PINNED[key] = dst
        out[Path(src).name] = hashlib.sha256(dst.read_bytes()).hexdigest()[:16]
    return out


def binary(key: str) -> Path:
    return PINNED.get(key) or {"sim": SIM, "bench": BENCH, "collector": harness.collector_binary(),
                               "wasm": harness.WASM_PATH}[key]


def wait_quiet(poll_s: float = 20.0) -> None:
    """While /tmp/kvroute-quiet exists, wait (another job is measuring)."""
    said = False
    while QUIET_FILE.exists():
        if not said:
            log(f"  {QUIET_FILE} exists: waiting (polling every {poll_s:.0f} s)")
            said = True
        time.sleep(poll_s)
    if said:
        log(f"  {QUIET_FILE} gone: going on")


def post_json(url: str, body: dict, timeout: float = 5.0) -> str:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def engine_fault(address: str, kind: str, for_s: float = 0.0) -> str:
    """POST /_sim/fault to one simulated engine (for_s in modelled seconds)."""
    try:
        return post_json(f"http://{address}/_sim/fault", {"kind": kind, "for_s": for_s})
    except OSError as exc:  # a dying engine may cut the answer
        return f"({exc})"


# ------------------------------------------------------------------ the stack


class HotEnvoy(harness.Envoy):
    """An Envoy that can be hot-restarted: epoch 0 picks a free base id and
    writes it to a file; the next epoch uses it with --restart-epoch."""

    def __init__(self, config: dict, workdir: Path, *, epoch: int = 0, base_id_path: Path,
                 base_id: int | None = None, **kw):
        super().__init__(config, workdir, **kw)
        self.epoch = epoch
        self.base_id_path = base_id_path
        self.base_id = base_id
        # The old epoch drains its listeners for drain_s, then exits at
        # parent_shutdown_s, cutting what is still streaming: longer than
        # the longest answer here (E2E p99 under a minute at this load).
        self.drain_s = 10
        self.parent_shutdown_s = 90

    def command(self) -> list[str]:
        cmd = [harness.envoy_binary(), "-c", str(self.config_path), "--concurrency", str(self.concurrency),
               "-l", self.log_level, "--drain-time-s", str(self.drain_s),
               "--parent-shutdown-time-s", str(self.parent_shutdown_s)]
        if self.epoch == 0:
            return cmd + ["--use-dynamic-base-id", "--base-id-path", str(self.base_id_path)]
        return cmd + ["--base-id", str(self.base_id), "--restart-epoch", str(self.epoch)]


def wait_epoch_live(envoy: HotEnvoy, timeout: float) -> float | None:
    """Wall time when the admin port (shared by the epochs) answers from this
    epoch with state LIVE; None on timeout or exit."""
    deadline = time.time() + timeout
    while time.time() < deadline and envoy.running():
        try:
            info = json.loads(envoy.admin("/server_info", timeout=1.0))
            if (int(info.get("command_line_options", {}).get("restart_epoch", -1)) == envoy.epoch
                    and info.get("state") == "LIVE"):
                return time.time()
        except (harness.HarnessError, OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


@dataclass
class Stack:
    """kvroute-sim fleet + Envoy with kvroute + kvroute-collector, free ports."""

    work: Path
    time_scale: float
    seed: int
    engines: int = 4
    extra_hosts: list[str] = field(default_factory=list)  # configured, started later
    collector_ms: int = 250
    sim_args: list[str] = field(default_factory=lambda: list(SIM_ARGS))
    fleet: bench.Fleet | None = None
    envoy: HotEnvoy | None = None
    old_envoys: list = field(default_factory=list)
    collectors: list = field(default_factory=list)
    procs: list = field(default_factory=list)  # other processes started for a fault
    hosts: list[str] = field(default_factory=list)
    token: str = ""
    ingest_url: str = ""
    cfg: dict | None = None
    # The gateway fault: a second gateway and the front that spreads over both.
    gateways: int = 1
    second: harness.Envoy | None = None
    front: harness.Envoy | None = None

    def start(self) -> "Stack":
        self.work.mkdir(parents=True, exist_ok=True)
        self.fleet = bench.Fleet(self.engines, self.time_scale, self.seed, self.work, self.sim_args)
        self.fleet.cmd[0] = str(binary("sim"))
        self.fleet.start()
        self.hosts = self.fleet.addresses + self.extra_hosts
        gw, admin, ingest = harness.free_ports(3)
        plugin = harness.plugin_config_for(self.hosts, {"explainHeader": True})
        self.cfg = harness.build_envoy_config(gateway_port=gw, admin_port=admin, endpoints=self.hosts,
                                              plugin_config=plugin, ingest_port=ingest, wasm=binary("wasm"))
        self.envoy = HotEnvoy(self.cfg, self.work / "envoy-0", base_id_path=self.work / "base-id",
                              concurrency=2, log_level="warning").start()
        self.token = harness.embedded_ingest_config(self.cfg)["ingest"]["token"]
        self.ingest_url = f"http://{harness.LOCALHOST}:{ingest}"
        self.start_collector("faults-a", self.hosts)
        if self.gateways == 2:
            gw2, admin2, ingest2 = harness.free_ports(3)
            cfg2 = harness.build_envoy_config(gateway_port=gw2, admin_port=admin2, endpoints=self.hosts,
                                              plugin_config=plugin, ingest_port=ingest2, wasm=binary("wasm"))
            self.second = harness.Envoy(cfg2, self.work / "envoy-b", concurrency=2, log_level="warning").start()
            (port,) = harness.free_ports(1)
            self.collectors.append(harness.Collector(
                engines=self.hosts, gateways=[f"http://{harness.LOCALHOST}:{ingest2}"], token=self.token,
                binary=binary("collector"), workdir=self.work / "faults-b-gw", interval_ms=self.collector_ms,
                collector_id="faults-b-gw", metrics_port=port, log_level="info").start())
            gateways = [bench.Router(name="a", setup="", url=self.envoy.gateway_url),
                        bench.Router(name="b", setup="", url=self.second.gateway_url)]
            self.front = bench.front_envoy(gateways, self.work / "front", retry_connect_failures=True)
        return self

    def restart_gateway(self) -> HotEnvoy:
        """Gateway A again, as a new process (a replaced pod: empty shared data)."""
        assert self.cfg is not None
        self.old_envoys.append(self.envoy)
        self.envoy = HotEnvoy(self.cfg, self.work / f"envoy-a{len(self.old_envoys)}",
                              base_id_path=self.work / f"base-id-{len(self.old_envoys)}", concurrency=2,
                              log_level="warning").start()
        return self.envoy

    def start_collector(self, cid: str, engines: list[str]) -> harness.Collector:
        (port,) = harness.free_ports(1)
        c = harness.Collector(engines=engines, gateways=[self.ingest_url], token=self.token, binary=binary("collector"),
                              workdir=self.work / cid, interval_ms=self.collector_ms, collector_id=cid,
                              metrics_port=port, log_level="info").start()
        self.collectors.append(c)
        return c

    @property
    def collector(self) -> harness.Collector:
        """The first collector (the fleet's own)."""
        return self.collectors[0]

    @property
    def gateway_url(self) -> str:
        if self.front is not None:
            return self.front.gateway_url
        assert self.envoy is not None
        return self.envoy.gateway_url

    def hot_restart(self) -> HotEnvoy:
        """Starts the next Envoy epoch with the same config; the old one
        drains (10 s) and exits (90 s)."""
        assert self.envoy is not None and self.cfg is not None
        base_id = int(self.envoy.base_id_path.read_text().strip())
        epoch = self.envoy.epoch + 1
        new = HotEnvoy(self.cfg, self.work / f"envoy-{epoch}", epoch=epoch, base_id_path=self.envoy.base_id_path,
                       base_id=base_id, concurrency=2, log_level="warning")
        new.spawn()
        self.old_envoys.append(self.envoy)
        self.envoy = new
        return new

    def stop(self) -> None:
        for c in self.collectors:
            c.stop()
        if self.envoy is not None:
            self.envoy.stop()
        for e in self.old_envoys:
            e.stop()
        for p in self.procs:
            harness.stop_process(p)
        for e in (self.front, self.second):
            if e is not None:
                e.stop()
        if self.fleet is not None:
            self.fleet.stop()


def start_engine(port: int, time_scale: float, seed: int, startup_delay_ms: int, workdir: Path,
                 sim_args: list[str]) -> subprocess.Popen:
    """One more simulated engine (its own kvroute-sim process) on `port`."""
    logf = open(workdir / f"engine-{port}.log", "wb")
    try:
        proc = subprocess.Popen(
            [str(binary("sim")), "--mode", "engine", "--engines", "1", "--base-port", str(port), "--time-scale",
             str(time_scale), "--seed", str(seed), "--model", MODEL, "--startup-delay-ms", str(startup_delay_ms),
             *sim_args],
            stdout=subprocess.DEVNULL, stderr=logf, stdin=subprocess.DEVNULL, cwd=str(REPO_ROOT))
    finally:
        logf.close()
    harness.wait_for_port(port, 20, proc)
    return proc


# ------------------------------------------------------------------ monitoring


def prom_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Samples of the named families (labels kept in the key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(names):
            continue
        key, _, value = line.rpartition(" ")
        if key.endswith("{}"):
            key = key[:-2]
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


ENVOY_FAMILIES = ("kvroute_", "envoy_cluster_upstream_rq_retry{envoy_cluster_name=\"inference\"}",
                  "envoy_cluster_upstream_cx_connect_fail{envoy_cluster_name=\"inference\"}",
                  "envoy_cluster_upstream_rq_timeout{envoy_cluster_name=\"inference\"}",
                  "envoy_cluster_upstream_rq_xx{envoy_response_code_class=\"5\",envoy_cluster_name=\"inference\"}")
COLLECTOR_FAMILIES = ("kvroute_collector_engines_ready", "kvroute_collector_pushes_total",
                      "kvroute_collector_scrape_failures_total")


def pushes_ok(collector_metrics: dict[str, float]) -> float:
    """Pushes a collector's gateways accepted (2xx, summed over gateways)."""
    return sum(v for k, v in collector_metrics.items()
               if k.startswith("kvroute_collector_pushes_total") and 'status="2' in k)


class Monitor:
    """Samples Envoy's kvroute_* and cluster stats, every collector's own
    metrics, and the RSS of Envoy and the collectors, every `every_s`."""

    def __init__(self, stack: Stack, every_s: float = 0.25, memory: bool = False):
        self.stack = stack
        self.every_s = every_s
        self.memory = memory
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> dict:
        s: dict = {"t": time.time()}
        envoy = self.stack.envoy
        try:
            s["envoy"] = prom_values(envoy.prometheus(), ENVOY_FAMILIES)
            s["envoy_live"] = True
        except (harness.HarnessError, OSError):
            s["envoy"] = {}
            s["envoy_live"] = False
        s["collectors"] = {}
        for c in self.stack.collectors:
            if not c.running():
                continue
            try:
                _, body = harness.http_get(c.metrics_url, timeout=1.0)
                s["collectors"][c.collector_id] = prom_values(body, COLLECTOR_FAMILIES)
            except OSError:
                pass
        if self.memory:
            s["envoy_rss_kb"] = proc_status_kb(envoy.proc.pid, "VmRSS") if envoy.running() else None
            c = self.stack.collector
            s["collector_rss_kb"] = proc_status_kb(c.proc.pid, "VmRSS") if c.running() else None
            try:
                mem = json.loads(envoy.admin("/memory"))
                s["envoy_allocated"] = int(mem.get("allocated", 0))
                s["envoy_heap"] = int(mem.get("heap_size", 0))
            except (harness.HarnessError, OSError, ValueError):
                pass
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.samples.append(self.sample())
            except Exception as exc:  # noqa: BLE001 - a monitor must not die mid-run
                self.samples.append({"t": time.time(), "error": str(exc)})
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))

    def first_time(self, pred, after: float) -> float | None:
        """Wall time of the first sample after `after` for which pred(sample) holds."""
        for s in self.samples:
            if s["t"] >= after and "error" not in s:
                try:
                    if pred(s):
                        return s["t"]
                except (KeyError, TypeError):
                    continue
        return None

    def envoy_delta(self, key: str, t0: float | None = None, t1: float | None = None) -> float:
        vals = [s["envoy"].get(key) for s in self.samples if s.get("envoy")
                and (t0 is None or s["t"] >= t0) and (t1 is None or s["t"] <= t1)]
        vals = [v for v in vals if v is not None]
        return (vals[-1] - vals[0]) if len(vals) >= 2 else 0.0


# ------------------------------------------------------------------ the load


def workload_args(rate: float, span_s: float, seed: int) -> list[str]:
    """Requests arriving (Poisson) at `rate` per modelled second for span_s
    modelled seconds: kvroute-bench's shared-prefix groups (16 groups x 8
    users, a 6144-token prefix per group, ~64-token questions, ~128-token
    answers; session key group-G-user-U). Stationary from the first second,
    so a fault, not a ramp, is what changes between phases."""
    requests = max(1, int(rate * span_s))
    return ["--workload", "groups", "--seed", str(seed), f"--group-requests={requests}", f"--group-rate={rate}"]


class Replay:
    """kvroute-bench replay in the background, with per-request records."""

    def __init__(self, stack: Stack, wl: list[str], out: Path, name: str, time_scale: float,
                 engine_urls: list[str]):
        self.out = out
        self.records_path = out.with_suffix(".records.jsonl")
        self.cmd = [str(binary("bench")), "replay", *wl, "--router", name, "--target", stack.gateway_url,
                    "--engines", ",".join(engine_urls), "--model", MODEL, "--time-scale", str(time_scale),
                    "--session-header", bench.SESSION_HEADER, "--out", str(out),
                    "--records", str(self.records_path), "--sample-ms", "500"]
        self.log_path = out.with_suffix(".log")
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> "Replay":
        logf = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(REPO_ROOT))
        finally:
            logf.close()
        self.started = time.time()
        return self

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            harness.stop_process(self.proc)
            return -1

    def records(self) -> list[dict]:
        with open(self.records_path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def summary(self) -> dict:
        return json.loads(self.out.read_text())


# ------------------------------------------------------------------ analysis


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def phase_figures(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["error"] is None]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    return {
        "sent": len(recs),
        "answered": len(ok),
        "errors": len(recs) - len(ok),
        "hit_rate": (cached / prompt) if prompt else None,
        "ttft_p50_ms": pct(ttft, 0.50),
        "ttft_p95_ms": pct(ttft, 0.95),
    }


def by_class(recs: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        if r["error"] is not None:
            out[r["error_class"]] = out.get(r["error_class"], 0) + 1
    return dict(sorted(out.items()))


def sent_s(r: dict) -> float:
    return r["sent_unix_ms"] / 1000.0


def named(recs: list[dict], host: str) -> list[dict]:
    return [r for r in recs if r.get("decided_host") == host]


# ------------------------------------------------------------------ SVG


PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def svg_plot(path: Path, title: str, recs: list[dict], t0: float, t_end: float, window: tuple[float, float],
             hosts: list[str], notes: list[tuple[float, str]]) -> None:
    """Two panels over real time since the replay started: requests per
    second by the host kvroute named (one line per host) and failed
    requests per second (red bars); TTFT p95 (modelled ms) per 5 s bin. The
    fault window is shaded; notes are vertical markers."""
    W, H, L, R = 900, 520, 70, 170
    top1, h1, top2, h2 = 40, 250, 330, 150
    span = max(1.0, t_end - t0)
    secs = int(math.ceil(span))
    per_host = {h: [0] * secs for h in hosts}
    other = [0] * secs
    errs = [0] * secs
    for r in recs:
        i = int(sent_s(r) - t0)
        if not 0 <= i < secs:
            continue
        h = r.get("decided_host")
        if h in per_host:
            per_host[h][i] += 1
        else:
            other[i] += 1
        if r["error"] is not None:
            errs[i] += 1
    ymax1 = max([1] + [max(v) for v in per_host.values()] + [max(errs), max(other)])
    ymax1 = int(math.ceil(ymax1 / 5.0) * 5)
    bins = int(math.ceil(span / 5.0))
    p95 = []
    for b in range(bins):
        vals = [r["ttft_ms"] for r in recs if r["error"] is None and r["ttft_ms"] is not None
                and b * 5 <= sent_s(r) - t0 < (b + 1) * 5]
        p95.append(pct(vals, 0.95))
    ymax2 = max([1.0] + [v for v in p95 if v is not None])
    ymax2 = 10 ** math.ceil(math.log10(ymax2)) if ymax2 > 0 else 1
    ymax2 = ymax2 / 2 if max([0.0] + [v for v in p95 if v is not None]) < ymax2 / 2 else ymax2

    def x(t: float) -> float:
        return L + (W - L - R) * (t / span)

    def y1(v: float) -> float:
        return top1 + h1 - h1 * v / ymax1

    def y2(v: float) -> float:
        return top2 + h2 - h2 * min(v, ymax2) / ymax2

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="15" font-weight="bold">{html.escape(title)}</text>']
    wa, wb = window[0] - t0, window[1] - t0
    for top, hh in ((top1, h1), (top2, h2)):
        out.append(f'<rect x="{x(wa):.1f}" y="{top}" width="{max(1.0, x(wb) - x(wa)):.1f}" height="{hh}" '
                   'fill="#f4cccc" opacity="0.6"/>')
        out.append(f'<rect x="{L}" y="{top}" width="{W - L - R}" height="{hh}" fill="none" stroke="#333"/>')
    for t, label in notes:
        xx = x(t - t0)
        out.append(f'<line x1="{xx:.1f}" y1="{top1}" x2="{xx:.1f}" y2="{top2 + h2}" stroke="#999" '
                   'stroke-dasharray="4,3"/>')
        out.append(f'<text x="{xx + 2:.1f}" y="{top1 + 12}" fill="#555" font-size="10">{html.escape(label)}</text>')
    for k in range(0, 6):
        v = ymax1 * k / 5
        out.append(f'<text x="{L - 6}" y="{y1(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v2 = ymax2 * k / 5
        out.append(f'<text x="{L - 6}" y="{y2(v2) + 4:.1f}" text-anchor="end">{v2:g}</text>')
    step = 10 if span <= 120 else 60 if span <= 900 else 300
    t = 0
    while t <= span:
        out.append(f'<text x="{x(t):.1f}" y="{top2 + h2 + 16}" text-anchor="middle">{t:g}</text>')
        out.append(f'<line x1="{x(t):.1f}" y1="{top2 + h2}" x2="{x(t):.1f}" y2="{top2 + h2 + 4}" stroke="#333"/>')
        t += step
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 8}" text-anchor="middle">seconds since the load started '
               '(real time)</text>')
    out.append(f'<text x="14" y="{top1 + h1 / 2}" transform="rotate(-90 14 {top1 + h1 / 2})" '
               'text-anchor="middle">requests/s by named host</text>')
    out.append(f'<text x="14" y="{top2 + h2 / 2}" transform="rotate(-90 14 {top2 + h2 / 2})" '
               'text-anchor="middle">TTFT p95, ms</text>')
    bw = (W - L - R) / secs
    for i, n in enumerate(errs):
        if n:
            out.append(f'<rect x="{x(i):.1f}" y="{y1(n):.1f}" width="{max(1.0, bw - 0.5):.1f}" '
                       f'height="{top1 + h1 - y1(n):.1f}" fill="#c44e52" opacity="0.8"/>')
    series = [(h, per_host[h], PALETTE[i % len(PALETTE)]) for i, h in enumerate(hosts)]
    if any(other):
        series.append(("other/none", other, "#000000"))
    for name, vals, colour in series:
        pts = " ".join(f"{x(i + 0.5):.1f},{y1(v):.1f}" for i, v in enumerate(vals))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.4"/>')
    pts = " ".join(f"{x(b * 5 + 2.5):.1f},{y2(v):.1f}" for b, v in enumerate(p95) if v is not None)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#333" stroke-width="1.6"/>')
    ly = top1 + 10
    for name, _, colour in series:
        out.append(f'<line x1="{W - R + 12}" y1="{ly}" x2="{W - R + 32}" y2="{ly}" stroke="{colour}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{W - R + 36}" y="{ly + 4}" font-size="11">{html.escape(name)}</text>')
        ly += 16
    out.append(f'<rect x="{W - R + 12}" y="{ly - 5}" width="20" height="9" fill="#c44e52"/>')
    out.append(f'<text x="{W - R + 36}" y="{ly + 4}" font-size="11">failed/s</text>')
    ly += 16
    out.append(f'<rect x="{W - R + 12}" y="{ly - 5}" width="20" height="9" fill="#f4cccc"/>')
    out.append(f'<text x="{W - R + 36}" y="{ly + 4}" font-size="11">fault window</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def shipped_retries() -> str:
    """The shipped route's retry policy, as the campaign's Envoy runs it."""
    cfg = harness.load_yaml()
    route = next(d["route"] for d in harness.iter_dicts(cfg) if isinstance(d.get("route"), dict) and "cluster" in d["route"])
    rp = route.get("retry_policy", {})
    codes = rp.get("retriable_status_codes")
    return f"{rp.get('retry_on', 'none')}{f' {codes}' if codes else ''} x{rp.get('num_retries', 1)}"


# ------------------------------------------------------------------ one fault


@dataclass
class Run:
    name: str
    stack: Stack
    monitor: Monitor
    replay: Replay
    fault_at: float = 0.0     # wall time
    fault_end: float = 0.0    # wall time
    events: list = field(default_factory=list)  # (wall time, label)

    def event(self, label: str) -> float:
        t = time.time()
        self.events.append((t, label))
        log(f"    t={t - self.replay.started:5.1f} s: {label}")
        return t


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def inject(run: Run, args) -> dict:
    """Applies the fault at fault_at, lifts it at fault_end; returns notes."""
    st = run.stack
    victim = st.fleet.addresses[VICTIM]
    notes: dict = {}
    sleep_until(run.fault_at)
    if run.name == "die":
        run.event(f"engine {VICTIM} ({victim}) dies: {engine_fault(victim, 'die')}")
        sleep_until(run.fault_end)
    elif run.name == "stall":
        run.event(f"engine {VICTIM} ({victim}) stalls for {args.fault_for:g} s: "
                  f"{engine_fault(victim, 'stall', args.fault_for * args.time_scale)}")
        sleep_until(run.fault_end)
        run.event("stall ends")
    elif run.name == "error":
        run.event(f"engine {VICTIM} ({victim}) answers 503 for {args.fault_for:g} s: "
                  f"{engine_fault(victim, 'error', args.fault_for * args.time_scale)}")
        sleep_until(run.fault_end)
        run.event("errors end")
    elif run.name == "collector":
        code = st.collector.kill()
        run.event(f"collector killed (SIGKILL, exit {code})")
        sleep_until(run.fault_end)
        c = st.collector
        st.collectors[0] = harness.Collector(engines=c.engines, gateways=c.gateways, token=c.token, binary=c.binary,
                                             workdir=c.workdir, interval_ms=c.interval_ms,
                                             collector_id=c.collector_id, metrics_port=c.metrics_port,
                                             log_level="info").start()
        run.event("collector restarted")
    elif run.name == "conflict":
        others = [a for a in st.hosts if a != victim]
        second = st.start_collector("faults-b", others)
        run.event(f"second collector (pid {second.proc.pid}) starts, listing {len(others)} engines "
                  f"(not {victim})")
        # Stale snapshots: an old seq, every engine unready. They must be refused.
        stale = []
        for k in range(5):
            snap = harness.make_snapshot([harness.host_state(a, ready=False, models=[MODEL]) for a in st.hosts],
                                         seq=1000 + k, collector="faults-stale")
            res = harness.push_snapshot(st.ingest_url, snap, token=st.token)
            stale.append(res.status)
            time.sleep(0.5)
        run.event(f"5 stale snapshots (seq 1000..1004, every engine unready) pushed: statuses {stale}")
        notes["stale_push_statuses"] = stale
        sleep_until(run.fault_end)
        second.stop()
        run.event("second collector stopped")
    elif run.name == "reload":
        new = st.hot_restart()
        run.event(f"Envoy hot restart: epoch {new.epoch} (pid {new.proc.pid}) spawned")
        live = wait_epoch_live(new, 30)
        run.event(f"epoch {new.epoch} LIVE (admin /server_info)" if live else f"epoch {new.epoch} NOT live after 30 s")
        notes["new_epoch_live_s"] = round(live - run.fault_at, 2) if live else None
        notes["old_epoch_pid"] = st.old_envoys[-1].proc.pid
        old = st.old_envoys[-1]
        rc = old.wait_exit(max(1.0, run.fault_end - time.time()))
        run.event(f"epoch {old.epoch} exited ({rc})" if rc is not None else f"epoch {old.epoch} still running")
        sleep_until(run.fault_end)
    elif run.name == "gateway":
        code = st.envoy.kill()
        run.event(f"gateway A killed (SIGKILL, exit {code}); gateway B and the front go on")
        sleep_until(run.fault_end)
        new = st.restart_gateway()
        run.event(f"gateway A started again (pid {new.proc.pid}, empty shared data)")
    elif run.name == "join":
        port = int(st.extra_hosts[0].rsplit(":", 1)[1])
        p = start_engine(port, args.time_scale, args.seed, int(args.fault_for * 1000), st.work, st.sim_args)
        st.procs.append(p)
        run.event(f"engine {st.extra_hosts[0]} started, /health 503 for {args.fault_for:g} s (warming up)")
        sleep_until(run.fault_end)
        run.event(f"engine {st.extra_hosts[0]} ready")
    return notes


def analyse(run: Run, recs: list[dict], notes: dict, args) -> dict:
    st, mon = run.stack, run.monitor
    t0 = run.replay.started
    fa, fe = run.fault_at, run.fault_end
    warm = t0 + args.warmup
    end = max((sent_s(r) for r in recs), default=fe)
    before = [r for r in recs if warm <= sent_s(r) < fa]
    during = [r for r in recs if fa <= sent_s(r) < fe]
    after = [r for r in recs if sent_s(r) >= fe + args.settle]
    victim = st.fleet.addresses[VICTIM]
    failed = [r for r in recs if r["error"] is not None]
    # In flight at the fault: sent before it, ended after it.
    in_flight = [r for r in failed if sent_s(r) < fa <= sent_s(r) + r["e2e_ms"] / 1000.0 / args.time_scale]
    out: dict = {
        "fault": run.name,
        "sent": len(recs),
        "answered": sum(1 for r in recs if r["error"] is None),
        "failed": len(failed),
        "failed_in_flight_at_fault": len(in_flight),
        "failed_sent_after_fault": sum(1 for r in failed if sent_s(r) >= fa),
        "errors_by_class": by_class(recs),
        "error_examples": sorted({r["error"] for r in failed})[:5],
        "phases": {"before": phase_figures(before), "during": phase_figures(during), "after": phase_figures(after)},
        "fault_at_s": round(fa - t0, 2),
        "fault_end_s": round(fe - t0, 2),
        "events": [(round(t - t0, 2), label) for t, label in run.events],
        "notes": notes,
        "envoy": {
            "retries": mon.envoy_delta('envoy_cluster_upstream_rq_retry{envoy_cluster_name="inference"}'),
            "connect_failures": mon.envoy_delta('envoy_cluster_upstream_cx_connect_fail{envoy_cluster_name="inference"}'),
            "upstream_timeouts": mon.envoy_delta('envoy_cluster_upstream_rq_timeout{envoy_cluster_name="inference"}'),
            "no_hosts": mon.envoy_delta("kvroute_decisions_no_hosts_total"),
            "degraded": mon.envoy_delta("kvroute_decisions_degraded_total"),
            "ingest_stale": mon.envoy_delta("kvroute_ingest_stale_total"),
            "ingest_conflicts": mon.envoy_delta("kvroute_ingest_conflicts_total"),
            "ingest_accepted": mon.envoy_delta("kvroute_ingest_accepted_total"),
        },
    }
    ad: dict = {}

    def ready_count(s: dict, cid: str = "faults-a") -> float:
        return s["collectors"][cid]["kvroute_collector_engines_ready"]

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - fa, 2)

    if run.name in ("die", "stall", "error"):
        detected = mon.first_time(lambda s: ready_count(s) < len(st.hosts), fa)
        ad["detected_by_collector_s"] = rel(detected)
        win_end = fe if run.name != "die" else end + 1
        named_v = [r for r in named(recs, victim) if fa <= sent_s(r) < win_end]
        ad["named_victim_after_fault"] = len(named_v)
        ad["last_named_victim_s"] = rel(max((sent_s(r) for r in named_v), default=None))
        if detected is not None:
            late = [r for r in named_v if sent_s(r) >= detected]
            ad["named_victim_after_detection"] = len(late)
            ad["failed_named_victim_after_detection"] = sum(1 for r in late if r["error"] is not None)
            # Per second after detection: does it stop, or come back?
            ad["named_victim_after_detection_by_10s"] = [
                sum(1 for r in late if detected + 10 * k <= sent_s(r) < detected + 10 * (k + 1))
                for k in range(int(math.ceil((win_end - detected) / 10)))] if win_end < 1e12 else []
        ad["failed_sent_after_fault_named_victim"] = sum(1 for r in named_v if r["error"] is not None)
        if run.name == "stall":
            slow = [r for r in named_v if r["error"] is None and r["ttft_ms"] is not None]
            ad["named_victim_during_stall_ttft_max_ms"] = max((r["ttft_ms"] for r in slow), default=None)
        if run.name in ("stall", "error"):
            back = mon.first_time(lambda s: ready_count(s) == len(st.hosts), fe)
            ad["ready_again_s"] = rel(back)
            first_back = min((sent_s(r) for r in named(recs, victim) if sent_s(r) >= fe and r["error"] is None),
                             default=None)
            ad["first_served_by_victim_after_recovery_s"] = rel(first_back)
    elif run.name == "collector":
        t_restart = next((t for t, label in run.events if label == "collector restarted"), fe)
        ad["degraded_decisions_during"] = mon.envoy_delta("kvroute_decisions_degraded_total", fa, t_restart)
        first_push = mon.first_time(lambda s: pushes_ok(s["collectors"]["faults-a"]) > 0, t_restart)
        ad["first_push_after_restart_s"] = rel(first_push)
        deg_stop = None
        last_deg = None
        for s in mon.samples:
            if s.get("envoy") and s["t"] >= t_restart:
                v = s["envoy"].get("kvroute_decisions_degraded_total")
                if last_deg is not None and v is not None and v == last_deg and deg_stop is None:
                    deg_stop = s["t"]
                elif v != last_deg:
                    deg_stop = None
                last_deg = v
        ad["degraded_decisions_stop_s"] = rel(deg_stop)
        ad["snapshot_age_max_ms"] = max((s["envoy"].get("kvroute_fleet_snapshot_age_ms", 0) for s in mon.samples
                                         if s.get("envoy")), default=None)
    elif run.name == "conflict":
        share = {}
        for label, rs in (("before", before), ("during", during), ("after", after)):
            n = sum(1 for r in rs if r.get("decided_host") == victim)
            share[label] = round(n / len(rs), 3) if rs else None
        ad["share_named_victim"] = share
        ad["stale_refused"] = out["envoy"]["ingest_stale"]
        ad["second_collector_pushes_ok"] = max((pushes_ok(s["collectors"].get("faults-b", {}))
                                                for s in mon.samples if "collectors" in s), default=0)
    elif run.name == "gateway":
        def split(rs: list[dict]) -> float | None:
            by: dict = {}
            for r in rs:
                if r["error"] is None and r.get("engine") is not None:
                    by.setdefault(r["session"], []).append(r["engine"])
            total = sum(len(v) for v in by.values())
            return round(sum(max(v.count(e) for e in set(v)) for v in by.values()) / total, 3) if total else None
        ad["conversation_split"] = {"before": split(before), "during": split(during), "after": split(after)}
        ad["failed_by_phase"] = {k: sum(1 for r in rs if r["error"] is not None)
                                 for k, rs in (("before", before), ("during", during), ("after", after))}
    elif run.name == "reload":
        ad["note"] = "shared data (fleet snapshot, prefix index, load table) is per process: the new epoch starts empty"
    elif run.name == "join":
        new = st.extra_hosts[0]
        pre = [r for r in named(recs, new) if sent_s(r) < fa]
        ad["named_new_before_started"] = len(pre)
        ad["named_new_before_started_failed"] = sum(1 for r in pre if r["error"] is not None)
        warm_named = [r for r in named(recs, new) if fa <= sent_s(r) < fe]
        ad["named_new_while_warming"] = len(warm_named)
        ready_at = mon.first_time(lambda s: ready_count(s) == len(st.hosts), fa)
        ad["ready_seen_by_collector_s"] = rel(ready_at)
        first = min((sent_s(r) for r in named(recs, new) if sent_s(r) >= fe and r["error"] is None), default=None)
        ad["first_served_by_new_s"] = rel(first)
        n_after = len([r for r in after if r.get("decided_host") == new])
        ad["share_named_new_after"] = round(n_after / len(after), 3) if after else None
    out["adaptation"] = ad
    return out


def run_fault(name: str, args, work: Path, out_dir: Path) -> dict:
    wait_quiet()
    log(f"- {name}: starting a fresh stack")
    wd = work / name
    extra = []
    if name == "join":
        extra = [f"{harness.LOCALHOST}:{harness.free_ports(1)[0]}"]
    stack = Stack(work=wd, time_scale=args.time_scale, seed=args.seed, extra_hosts=extra,
                  gateways=2 if name == "gateway" else 1).start()
    replay = None
    monitor = None
    try:
        bench.probe_chat(stack.gateway_url)
        for u in stack.fleet.urls:
            post_json(u + "/_sim/reset", {})
        span = args.duration * args.time_scale
        wl = workload_args(args.rate, span, args.seed)
        engine_urls = [f"http://{a}" for a in stack.hosts]
        monitor = Monitor(stack).start()
        replay = Replay(stack, wl, out_dir / "runs" / f"{name}.json", f"kvroute-{name}", args.time_scale,
                        engine_urls).start()
        run = Run(name=name, stack=stack, monitor=monitor, replay=replay,
                  fault_at=replay.started + args.fault_at, fault_end=replay.started + args.fault_at + args.fault_for)
        log(f"  load: {' '.join(wl)} (time scale {args.time_scale:g}); fault at {args.fault_at:g} s for "
            f"{args.fault_for:g} s")
        notes = inject(run, args)
        rc = replay.wait(timeout=args.duration + 240)
        run.event(f"replay finished ({rc})")
        monitor.stop()
        if rc != 0:
            log(f"  kvroute-bench replay exited with {rc}; see {replay.log_path}")
        recs = replay.records()
        result = analyse(run, recs, notes, args)
        result["replay_exit"] = rc
        result["envoy_running_at_end"] = stack.envoy.running()
        end = max(sent_s(r) for r in recs) if recs else time.time()
        svg = out_dir / f"fault-{name}.svg"
        svg_plot(svg, f"fault: {name} ({TITLES[name]})", recs, replay.started, end,
                 (run.fault_at, run.fault_end), stack.hosts,
                 [(t, label.split(":")[0][:28]) for t, label in run.events if "replay" not in label])
        result["plot"] = svg.name
        ph = result["phases"]
        log(f"  {result['sent']} sent, {result['answered']} answered, {result['failed']} failed "
            f"{result['errors_by_class']}; hit rate before/during/after "
            f"{fmt_pct(ph['before']['hit_rate'])}/{fmt_pct(ph['during']['hit_rate'])}/"
            f"{fmt_pct(ph['after']['hit_rate'])}; TTFT p95 {fmt_ms(ph['before']['ttft_p95_ms'])}/"
            f"{fmt_ms(ph['during']['ttft_p95_ms'])}/{fmt_ms(ph['after']['ttft_p95_ms'])} ms")
        log(f"  adaptation: {json.dumps(result['adaptation'])}")
        return result
    finally:
        stop_run(monitor, replay, stack)


def stop_run(monitor, replay, stack) -> None:
    """Stops a run's monitor, load generator (by PID) and stack; each may be
    missing if the run failed before starting it."""
    if monitor is not None:
        monitor.stop()
    if replay is not None and replay.proc is not None:
        harness.stop_process(replay.proc)
    stack.stop()


TITLES = {
    "die": f"engine {VICTIM} of 4 dies",
    "stall": f"engine {VICTIM} hangs, then goes on",
    "error": f"engine {VICTIM} answers 503, then recovers",
    "collector": "collector killed, then restarted",
    "conflict": "a second collector without engine 1; stale snapshots",
    "reload": "Envoy hot restart",
    "join": "a 5th engine joins and warms up",
    "gateway": "one of two gateways killed, then replaced",
}


def fmt_pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def adaptation_text(r: dict) -> str:
    a = r["adaptation"]
    n = r["fault"]
    if n == "die":
        return (f"collector saw it unready after {a.get('detected_by_collector_s')} s; "
                f"{a.get('named_victim_after_detection')} requests named it after that "
                f"(last at +{a.get('last_named_victim_s')} s), {a.get('failed_named_victim_after_detection')} of "
                "them failed")
    if n == "stall":
        return (f"unready after {a.get('detected_by_collector_s')} s; {a.get('named_victim_after_detection')} "
                f"named it after that (last +{a.get('last_named_victim_s')} s); worst TTFT of those "
                f"{fmt_ms(a.get('named_victim_during_stall_ttft_max_ms'))} ms; ready again "
                f"+{a.get('ready_again_s')} s, served again +{a.get('first_served_by_victim_after_recovery_s')} s")
    if n == "error":
        return (f"unready after {a.get('detected_by_collector_s')} s; {a.get('named_victim_after_detection')} "
                f"named it after that (last +{a.get('last_named_victim_s')} s); ready again "
                f"+{a.get('ready_again_s')} s, served again +{a.get('first_served_by_victim_after_recovery_s')} s")
    if n == "collector":
        return (f"{a.get('degraded_decisions_during'):.0f} degraded decisions while it was down; first push "
                f"after restart +{a.get('first_push_after_restart_s')} s (from the fault)")
    if n == "conflict":
        return (f"share of requests named to engine 1 before/during/after: {a.get('share_named_victim')}; "
                f"stale pushes answered {r['notes'].get('stale_push_statuses')}; the second collector's pushes "
                f"accepted: {a.get('second_collector_pushes_ok')}, refused as conflicts: "
                f"{r['envoy'].get('ingest_conflicts', 0):.0f}")
    if n == "reload":
        return "; ".join(label for _, label in r["events"] if "epoch" in label)
    if n == "gateway":
        return (f"{r['failed_in_flight_at_fault']} streams in flight on gateway A cut, "
                f"{r['failed_sent_after_fault']} sent after the kill failed; share of each session's requests on "
                f"its most used engine before/during/after: {a.get('conversation_split')}")
    if n == "join":
        return (f"{a.get('named_new_before_started')} requests named it before it started "
                f"({a.get('named_new_before_started_failed')} failed), {a.get('named_new_while_warming')} while "
                f"warming; collector saw it ready +{a.get('ready_seen_by_collector_s')} s, first served "
                f"+{a.get('first_served_by_new_s')} s; share after {a.get('share_named_new_after')}")
    return ""


def markdown(results: list[dict], setup: list[str]) -> str:
    lines = ["# Fault campaign", "", *[f"- {s}" for s in setup], "",
             "| fault | sent | answered | failed (in flight at fault / sent after) | errors by class | "
             "hit rate before / during / after | TTFT p95 ms before / during / after | routing adapts |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ph = r["phases"]
        lines.append(
            f"| {r['fault']} | {r['sent']} | {r['answered']} | {r['failed']} ({r['failed_in_flight_at_fault']} / "
            f"{r['failed_sent_after_fault']}) | "
            f"{', '.join(f'{k}: {v}' for k, v in r['errors_by_class'].items()) or '-'} | "
            f"{fmt_pct(ph['before']['hit_rate'])} / {fmt_pct(ph['during']['hit_rate'])} / "
            f"{fmt_pct(ph['after']['hit_rate'])} | {fmt_ms(ph['before']['ttft_p95_ms'])} / "
            f"{fmt_ms(ph['during']['ttft_p95_ms'])} / {fmt_ms(ph['after']['ttft_p95_ms'])} | "
            f"{adaptation_text(r)} |")
    lines.append("")
    for r in results:
        lines.append(f"![{r['fault']}]({r['plot']})")
    return "\n".join(lines) + "\n"


def calibrate(rates: list[float], args) -> int:
    """Fault-free runs at several session rates on fresh stacks: where the
    fleet's capacity lies (TTFT and queues against the rate)."""
    work = Path(tempfile.mkdtemp(prefix="kvroute-faults-cal-"))
    args.out.mkdir(parents=True, exist_ok=True)
    pin_binaries(work)
    try:
        for rate in rates:
            wait_quiet()
            stack = Stack(work=work / f"r{rate}", time_scale=args.time_scale, seed=args.seed).start()
            try:
                bench.probe_chat(stack.gateway_url)
                for u in stack.fleet.urls:
                    post_json(u + "/_sim/reset", {})
                wl = workload_args(rate, args.duration * args.time_scale, args.seed)
                rp = Replay(stack, wl, args.out / f"calibrate-{rate}.json", f"calibrate-{rate}", args.time_scale,
                            stack.fleet.urls).start()
                rc = rp.wait(args.duration + 240)
                recs = rp.records()
                sm = rp.summary()
                t0 = rp.started + args.warmup
                steady = [r for r in recs if sent_s(r) >= t0]
                f = phase_figures(steady)
                span = max(1.0, max(sent_s(r) for r in steady) - t0) if steady else 1.0
                samples = [s for s in sm["samples"] if s["t_s"] >= args.warmup * args.time_scale]
                readings = [e for s in samples for e in s["engines"] if e]
                kv = sum(e["kv"] for e in readings) / max(1, len(readings))
                waiting = sum(e["waiting"] for e in readings) / max(1, len(readings))
                running = sum(e["running"] for e in readings) / max(1, len(readings))
                log(f"rate {rate:g} req/s: exit {rc}, {len(steady) / span:.1f} req/s real, {f['errors']} errors, "
                    f"TTFT p50 {fmt_ms(f['ttft_p50_ms'])} p95 {fmt_ms(f['ttft_p95_ms'])} ms, E2E p50 "
                    f"{fmt_ms(sm['e2e_ms']['p50'])} ms, hit {fmt_pct(f['hit_rate'])}, per engine: KV {kv:.2f}, "
                    f"running {running:.1f}, waiting {waiting:.1f}, sim lag {100 * sm.get('sim_lag_fraction', 0):.1f} %")
            finally:
                stack.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description="kvroute fault campaign on the simulated fleet")
    p.add_argument("--faults", default=",".join(ALL_FAULTS), help="comma-separated, from: " + ", ".join(ALL_FAULTS))
    p.add_argument("--duration", type=float, default=90.0, help="load per run, real seconds (default 90)")
    p.add_argument("--fault-at", type=float, default=40.0, help="fault time, real seconds into the load")
    p.add_argument("--fault-for", type=float, default=15.0, help="fault length (stall, error, collector down, "
                   "second collector, join warm-up), real seconds")
    p.add_argument("--warmup", type=float, default=25.0, help="real seconds left out of the 'before' phase")
    p.add_argument("--settle", type=float, default=5.0, help="real seconds after the fault left out of 'after'")
    p.add_argument("--time-scale", type=float, default=1.0, help="the simulator's --time-scale (default 1)")
    p.add_argument("--calibrate", default=None, metavar="RATES",
                   help="instead of faults: replay --duration s at each of these session rates "
                        "(comma-separated) on one fault-free stack and print the load figures")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE,
                   help="requests per modelled second (Poisson)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "target" / "faults")
    p.add_argument("--keep", action="store_true", help="keep the logs and configs")
    return p.parse_args(argv)


def git_head() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=str(REPO_ROOT))
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=str(REPO_ROOT)).stdout.strip()
    out = r.stdout.strip() + (" (with uncommitted changes in the tree)" if dirty else "")
    for env in ("KVROUTE_WASM", harness.COLLECTOR_ENV):
        if os.environ.get(env):
            out += f"; {env}={os.environ[env]}"
    return out


def check_binaries() -> str | None:
    for b in (SIM, BENCH):
        if not b.is_file():
            return f"{b} is missing (cargo build --release -p kvroute-sim -p kvroute-bench)"
    if not harness.wasm_available():
        return harness.WASM_MISSING_REASON
    if harness.collector_binary() is None:
        return harness.collector_missing_reason()
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in ALL_FAULTS]
    if bad:
        print(f"faults: unknown fault(s) {bad}; known: {', '.join(ALL_FAULTS)}", file=sys.stderr)
        return 2
    missing = check_binaries()
    if missing:
        print(f"faults: {missing}", file=sys.stderr)
        return 2
    harness.install_sigterm_as_interrupt()
    if args.calibrate:
        return calibrate([float(r) for r in args.calibrate.split(",")], args)
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvroute-faults-"))
    pinned = pin_binaries(work)
    results: list[dict] = []
    failed: list[str] = []
    started = time.monotonic()
    log(f"fault campaign: {', '.join(faults)}; each run {args.duration:g} s of load, fault at {args.fault_at:g} s "
        f"for {args.fault_for:g} s (real time); logs in {work}")
    try:
        for name in faults:
            try:
                results.append(run_fault(name, args, work, args.out))
            except (bench.BenchError, harness.HarnessError, OSError) as exc:
                log(f"- {name}: FAILED: {exc}")
                failed.append(name)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if args.keep or failed:
            log(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    setup = [
        f"Fleet: 4 x kvroute-sim --mode engine, the Llama-3.1-8B-on-H100 model with every step cost x4 "
        f"({' '.join(SIM_ARGS)}), time scale {args.time_scale:g} (modelled time = real time at 1).",
        "Gateway: Envoy 1.40 (--concurrency 2) + kvroute (shipped defaults, explainHeader on), route retries "
        f"{shipped_retries()} (envoy-config/envoy.yaml); kvroute-collector at its defaults "
        "(scrape every 250 ms, 200 ms timeout, 5 s max backoff).",
        f"Load: kvroute-bench replay, generated shared-prefix groups ({args.rate:g} requests/s Poisson, 16 groups "
        "x 8 users, 6144-token prefix per group, ~64-token questions, ~128-token answers, x-session-id "
        f"group-G-user-U), open loop, streamed; {args.duration:g} s real per run; fault at {args.fault_at:g} s "
        f"for {args.fault_for:g} s.",
        f"Phases by send time: before = [{args.warmup:g} s, fault), during = the fault window, after = from "
        f"{args.settle:g} s after the window to the end.",
        f"Wall clock: {time.monotonic() - started:.0f} s for the campaign. Commit {git_head()}; binaries "
        f"(sha256, first 16 hex digits): {', '.join(f'{k} {v}' for k, v in pinned.items())}.",
        *[f"FAILED to run: {f}" for f in failed],
    ]
    (args.out / "faults.json").write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    md = markdown(results, setup)
    (args.out / "faults.md").write_text(md)
    log(md)
    log(f"wrote {args.out}/faults.json, faults.md and fault-*.svg")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

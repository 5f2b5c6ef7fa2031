"""Gateway overhead benchmark: what kvroute costs per request (issue 7).

Contenders, all in front of the same null engines (kvroute-sim --mode null,
which answer at once). The three Envoys are Envoy 1.40 (--concurrency 2) with
the listener, cluster and override_host policy of envoy-config/envoy.yaml:

  1. plain   - Envoy, no Wasm filter (the baseline: ratios are to this one)
  2. noop    - Envoy + bench/noop-filter (pause on headers, buffer the body,
               continue): the cost of the Wasm VM and of body buffering
  2b. minimal - the same module as the least a body-reading router filter
               does: copy the body into the VM, read :path, set the
               destination header (round robin over the engines)
  3. kvroute - Envoy + kvroute with a 64-host fleet snapshot: the 4 real
               engines ready, 60 more addresses not ready, so every request
               is parsed, hashed and scored against 64 hosts
  4. sglang-router - sglang-router --policy cache_aware, its defaults
  5. vllm-router   - vllm-router --policy cache_aware, its defaults (it POSTs
               every request to /v1/chat/completions/render on every worker
               before it routes; the null engines answer that)

The peers run from .venv-peers (`make bench-tools`), launched as
scripts/bench.py launches them; a peer that is not installed is skipped with
a note, unless --require-peers.

Load: wrk with a Lua script that POSTs real-shaped chat-completions bodies
(system prompt + alternating user/assistant turns; 16 variants rotated so
requests do not all share one prefix), at a fixed number of connections.
The contenders run interleaved, setting by setting, in one session.

Per run: requests/s, p50 and p99 latency (wrk --latency), the router's CPU
seconds per 10,000 requests (utime+stime+cutime+cstime from /proc of the
router's process tree: Envoy is one process, a peer's launcher and anything
it forks are summed), the null engines' CPU per 10,000 requests (to show the
upstream is not the bottleneck), and the router's peak RSS (VmHWM, whole
session, summed over its process tree).

Then the memory run (--memory-run N, 1,000,000 by default, 0 to skip): a
fresh kvroute Envoy, alone, serves N requests of 1 KB at 16 connections, and
the Wasm VMs' linear memories are read from /proc/PID/smaps before, every
--memory-every requests, and after (see wasm_memories()).

    .venv/bin/python scripts/bench_overhead.py            # full matrix, 5 s runs
    .venv/bin/python scripts/bench_overhead.py --quick    # a tiny run
    make bench-overhead                                   # full matrix, writes docs/

Everything binds 127.0.0.1; every process started here is stopped by PID.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench as routing_bench  # noqa: E402  (peer launch: one definition, scripts/bench.py)
import harness  # noqa: E402
from harness import Envoy, HarnessError, LOCALHOST  # noqa: E402

SIM = REPO_ROOT / "target" / "release" / "kvroute-sim"
KVROUTE_WASM = REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "kvroute.wasm"
NOOP_WASM = REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "kvroute_noop.wasm"
DOC = REPO_ROOT / "docs" / "benchmarks.md"
SVG = REPO_ROOT / "docs" / "gateway-overhead.svg"
SECTION = "## Gateway overhead"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKEN = "kvroute-bench-token-0123456789"
ENVOYS = ["plain", "noop", "minimal", "kvroute"]
# Our contender name -> scripts/bench.py's router name.
PEERS = {"sglang-router": "sglang-cache-aware", "vllm-router": "vllm-cache-aware"}
PEER_PACKAGES = {"sglang-router": "sglang-router", "vllm-router": "vllm-router"}
ALL_CONTENDERS = ENVOYS + list(PEERS)
COLOURS = {"plain": "#4c72b0", "noop": "#dd8452", "minimal": "#937860", "kvroute": "#55a868",
           "sglang-router": "#c44e52", "vllm-router": "#8172b3"}
FLEET_HOSTS = 64
REAL_ENGINES = 4
VARIANTS = 16
CLK_TCK = os.sysconf("SC_CLK_TCK")

LUA = """
local dir = "%(dir)s"
local n = %(n)d
local reqs = {}
local i = 0
function init(args)
  for k = 1, n do
    local f = assert(io.open(dir .. "/body" .. k .. ".json", "rb"))
    local body = f:read("*a")
    f:close()
    reqs[k] = wrk.format("POST", "/v1/chat/completions",
      {["Content-Type"] = "application/json"}, body)
  end
end
function request()
  i = i %% n + 1
  return reqs[i]
end
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ setup


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("wrk is missing: run as root, or: sudo apt-get install -y wrk")
    log("installing wrk (apt)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, env=env, stdout=subprocess.DEVNULL)
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("wrk still missing after apt-get install")
    return found


def build() -> None:
    cargo = os.environ.get("CARGO", "cargo")
    # One cargo at a time (2 cores): the Wasm modules, then the simulator.
    subprocess.run(
        [cargo, "build", "--release", "--target", "wasm32-wasip1", "-p", "kvroute", "-p", "kvroute-noop"],
        check=True, cwd=REPO_ROOT,
    )
    subprocess.run([cargo, "build", "--release", "-p", "kvroute-sim"], check=True, cwd=REPO_ROOT)


def filler(label: str, nbytes: int) -> str:
    return harness.filler(label, max(nbytes, 1))


def chat_body(size: int, variant: int) -> bytes:
    """A chat body of about `size` bytes: system prompt + alternating turns."""
    turn = max(min(size // 8, 4096), 64)
    system = f"[v{variant:02d}] You are a helpful assistant for the kvroute benchmark. " + filler(
        f"sys{variant}", max(turn // 2, 32)
    )
    messages = [{"role": "system", "content": system}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 256, "temperature": 0}
    k = 0
    while len(json.dumps(body)) < size:
        role = "user" if k % 2 == 0 else "assistant"
        left = size - len(json.dumps(body)) - 40
        messages.append({"role": role, "content": filler(f"t{k}", max(min(turn, left), 16))})
        k += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Continue."})
    return json.dumps(body).encode()


def write_bodies(workdir: Path, size: int) -> Path:
    d = workdir / f"bodies-{size}"
    d.mkdir(parents=True, exist_ok=True)
    for v in range(1, VARIANTS + 1):
        (d / f"body{v}.json").write_bytes(chat_body(size, v))
    script = d / "post.lua"
    script.write_text(LUA % {"dir": str(d), "n": VARIANTS})
    return script


class Sim:
    """kvroute-sim --mode null on consecutive ports."""

    def __init__(self, base_port: int, engines: int, workdir: Path):
        self.base_port = base_port
        self.engines = engines
        self.log_path = workdir / "sim.log"
        self.proc: subprocess.Popen | None = None

    @property
    def addresses(self) -> list[str]:
        return [f"{LOCALHOST}:{self.base_port + i}" for i in range(self.engines)]

    def start(self) -> "Sim":
        harness.require_free_ports(self.base_port + i for i in range(self.engines))
        log_file = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [str(SIM), "--mode", "null", "--engines", str(self.engines), "--base-port", str(self.base_port)],
                stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        finally:
            log_file.close()
        for i in range(self.engines):
            harness.wait_for_port(self.base_port + i, 10.0, self.proc)
        return self

    def stop(self) -> None:
        harness.stop_process(self.proc)


def consecutive_free_ports(n: int) -> int:
    """A base port with n free consecutive loopback ports after it."""
    for base in range(18001, 60000, 97):
        if all(harness.port_is_free(base + i) for i in range(n)):
            return base
    raise HarnessError(f"no {n} consecutive free ports")


def proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        # After the command name: state is field 3 (1-based), so index i here is field i + 3.
        return f.read().rpartition(")")[2].split()


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of one process, in seconds.

    The children's fields hold the time of children it has reaped, so a
    child that exits between two samples is still counted once."""
    fields = proc_stat(pid)
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK


def process_tree(root: int) -> list[int]:
    """root and all its live descendants (from the ppid field in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(proc_stat(int(entry))[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_seconds(root: int) -> float:
    total = 0.0
    for pid in process_tree(root):
        try:
            total += proc_cpu_seconds(pid)
        except OSError:
            pass  # exited between the listing and the read
    return total


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def tree_status_kb(root: int, key: str) -> int:
    """Sum of a /proc status field over the process tree (VmHWM: an upper
    bound of the tree's peak, as the members' peaks need not coincide)."""
    total = 0
    for pid in process_tree(root):
        try:
            total += proc_status_kb(pid, key)
        except OSError:
            pass
    return total


# ------------------------------------------------------------------ Wasm linear memory

WASM_PAGE = 65536


def wasm_initial_pages(path: Path) -> int | None:
    """The minimum of the module's own memory (memory section), in 64 KiB pages."""
    data = path.read_bytes()

    def leb(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value, i

    i = 8  # magic + version
    while i < len(data):
        section, size_at = data[i], i + 1
        size, body = leb(size_at)
        if section == 5:
            count, j = leb(body)
            if count >= 1:
                return leb(j + 1)[0]  # skip the limits flag byte
            return None
        i = body + size
    return None


def smaps_vmas(pid: int) -> list[dict]:
    vmas: list[dict] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$", line)
            if m:
                vmas.append({"lo": int(m.group(1), 16), "hi": int(m.group(2), 16), "perms": m.group(3),
                             "inode": int(m.group(4)), "path": m.group(5).strip(), "rss_kb": 0})
            elif line.startswith("Rss:") and vmas:
                vmas[-1]["rss_kb"] = int(line.split()[1])
    return vmas


def wasm_memories(pid: int, min_pages: int) -> list[dict]:
    """The Wasm linear memories of an Envoy (V8), read from /proc/PID/smaps.

    For a 32-bit Wasm memory, V8 on x86-64 reserves one 8 GiB region of
    address space (the 4 GiB a memory can address, plus guard space, so that
    bounds checks are left to the MMU) and makes its first memory.size bytes
    readable and writable; memory.grow extends that part in place. In smaps
    a memory is therefore an anonymous rw-p mapping, a multiple of 64 KiB
    and at least the module's initial size, immediately followed by an
    anonymous ---p mapping, the two together 4 to 16 GiB. The rw-p size is
    the memory's current size (pages); its Rss is what is resident. Each
    VM (one per worker thread, plus the main thread's) has its own memory.
    """
    vmas = smaps_vmas(pid)
    out = []
    for a, b in zip(vmas, vmas[1:]):
        size = a["hi"] - a["lo"]
        if (a["perms"] == "rw-p" and b["perms"] == "---p" and a["hi"] == b["lo"]
                and a["inode"] == 0 and b["inode"] == 0 and not a["path"] and not b["path"]
                and size % WASM_PAGE == 0 and size >= min_pages * WASM_PAGE
                and 4 << 30 <= size + (b["hi"] - b["lo"]) <= 16 << 30):
            out.append({"addr": hex(a["lo"]), "pages": size // WASM_PAGE, "rss_kb": a["rss_kb"]})
    return out


def memory_sample(envoy: Envoy, min_pages: int, requests: int) -> dict:
    mems = wasm_memories(envoy.proc.pid, min_pages)
    vm_count = None
    try:
        stats = json.loads(envoy.admin("/stats?format=json&filter=wasm_vm_count"))
        vm_count = next((s["value"] for s in stats.get("stats", []) if s.get("name") == "wasm.wasm_vm_count"), None)
    except (HarnessError, OSError, ValueError):
        pass
    return {
        "requests": requests,
        "memories": mems,
        "pages_total": sum(m["pages"] for m in mems),
        "rss_kb_total": sum(m["rss_kb"] for m in mems),
        "envoy_rss_kb": proc_status_kb(envoy.proc.pid, "VmRSS"),
        "wasm_vm_count": vm_count,
    }


def fleet_snapshot(real: list[str], fake: list[str]) -> dict:
    hosts = [harness.host_state(a, ready=True, models=[MODEL], kv=0.1) for a in real]
    hosts += [harness.host_state(a, ready=False, models=[MODEL], kv=0.0) for a in fake]
    return harness.make_snapshot(hosts, collector="kvroute-bench")


# ------------------------------------------------------------------ contenders


class Contender:
    """One router under test: a URL, a root process, and how to stop it."""

    def __init__(self, name: str, url: str, proc: subprocess.Popen, setup: str,
                 envoy: Envoy | None = None, stop=None):
        self.name, self.url, self.proc, self.setup, self.envoy = name, url, proc, setup, envoy
        self._stop = stop
        # Descendants seen under the root: pid -> start time (to never signal a reused pid).
        self.seen: dict[int, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tree(self) -> list[int]:
        pids = process_tree(self.pid)
        for pid in pids:
            if pid != self.pid:
                self.seen.setdefault(pid, _start_time(pid))
        return pids

    def cpu_seconds(self) -> float:
        self.tree()
        return tree_cpu_seconds(self.pid)

    def stop(self) -> None:
        self.tree()
        if self._stop is not None:
            self._stop()
        else:
            harness.stop_process(self.proc)
        # Anything the root forked and left behind: by PID, only those seen
        # under it, and only if it is still the same process.
        for pid, started in sorted(self.seen.items()):
            if started and _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass


def _start_time(pid: int) -> str:
    try:
        return proc_stat(pid)[19]  # field 22, starttime
    except (OSError, IndexError):
        return ""


def start_envoy(name: str, workdir: Path, real: list[str], fake: list[str],
                wasm: Path | None = None) -> Contender:
    """One of ENVOYS; `wasm` replaces the kvroute module (A/B of builds, scripts/ab_wasm.py)."""
    gw, admin, ingest = harness.free_ports(3)
    if name == "plain":
        cfg = harness.build_envoy_config(gateway_port=gw, admin_port=admin, endpoints=real, wasm=None)
    elif name == "noop":
        # The kvroute plugin block with the no-op module; it ignores its
        # configuration. No ingest listener.
        cfg = harness.build_envoy_config(
            gateway_port=gw, admin_port=admin, endpoints=real, wasm=NOOP_WASM,
            plugin_config=harness.plugin_config_for(real),
        )
    elif name == "minimal":
        # The no-op module as a minimal router (bench/noop-filter's `route:`).
        cfg = harness.build_envoy_config(
            gateway_port=gw, admin_port=admin, endpoints=real, wasm=NOOP_WASM,
            plugin_config=f"route:{harness.DESTINATION_HEADER}:{','.join(real)}",
        )
    else:
        plugin = harness.plugin_config_for(
            real + fake,
            # One push per session: keep the snapshot fresh for the whole run.
            {"fleet": {"staleAfterMs": 3_600_000}},
        )
        cfg = harness.build_envoy_config(
            gateway_port=gw, admin_port=admin, endpoints=real, wasm=wasm or KVROUTE_WASM,
            plugin_config=plugin, ingest_port=ingest,
            ingest_config=harness.ingest_config_for(TOKEN, shared_data_prefix=plugin.get("sharedDataPrefix")),
        )
    envoy = Envoy(cfg, workdir / name, concurrency=2, log_level="warn")
    envoy.start()
    log(f"{name}: envoy pid {envoy.proc.pid} on {envoy.gateway_url}")
    if name == "kvroute":
        push = harness.push_snapshot(f"http://{LOCALHOST}:{envoy.ingest_port}", fleet_snapshot(real, fake), TOKEN)
        if push.status != 204:
            envoy.stop()
            raise HarnessError(f"snapshot push: {push!r}")
    return Contender(name, envoy.gateway_url, envoy.proc, "Envoy 1.40 --concurrency 2", envoy=envoy, stop=envoy.stop)


def peer_missing(name: str) -> str | None:
    """Why a peer cannot run here, or None."""
    if name == "sglang-router":
        py = routing_bench.peer_binary("python")
        if py is None or not (routing_bench.PEERS_VENV / ".installed").is_file():
            return "sglang-router is not installed (.venv-peers; make bench-tools)"
        probe = subprocess.run([str(py), "-c", "import sglang_router"], capture_output=True, timeout=60)
        if probe.returncode != 0:
            return "sglang-router does not import in .venv-peers (make bench-tools)"
        return None
    if routing_bench.peer_binary("vllm-router") is None:
        return "vllm-router is not installed (.venv-peers; make bench-tools)"
    return None


def peer_version(name: str) -> str:
    py = routing_bench.peer_binary("python")
    if py is None:
        return "?"
    code = f"import importlib.metadata as m; print(m.version({PEER_PACKAGES[name]!r}))"
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or "?"


def start_peer(name: str, workdir: Path, real: list[str]) -> Contender:
    fleet = SimpleNamespace(urls=[f"http://{a}" for a in real])
    router = routing_bench.peer_router(PEERS[name], fleet, workdir)
    try:
        routing_bench.wait_workers(router.url, len(real), name)
    except routing_bench.BenchError:
        router.stop()
        raise
    setup = f"{name} {peer_version(name)}, --policy cache_aware, other options at their defaults"
    log(f"{name}: pid {router.procs[0].pid} on {router.url}")
    return Contender(name, router.url, router.procs[0], setup, stop=router.stop)


def check_contender(c: Contender, body: bytes) -> str:
    req = urllib.request.Request(
        c.url + "/v1/chat/completions", data=body,
        headers={"content-type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.loads(resp.read())
        decision = resp.headers.get(harness.DECISION_HEADER, "")
    if data.get("object") != "chat.completion":
        raise HarnessError(f"{c.name}: unexpected answer {data!r}")
    return decision


# ------------------------------------------------------------------ runs

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        raise ValueError(f"latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str) -> dict:
    res: dict = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    res["rps"] = float(m.group(1)) if m else 0.0
    m = re.search(r"(\d+) requests in", out)
    res["requests"] = int(m.group(1)) if m else 0
    for pct in ("50", "99"):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", out, re.M)
        res[f"p{pct}"] = _ms(m.group(1)) if m else float("nan")
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    res["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors:(.*)", out)
    res["socket_errors"] = sum(int(x) for x in re.findall(r"\d+", m.group(1))) if m else 0
    return res


def run_wrk(wrk: str, url: str, script: Path, conns: int, seconds: float) -> str:
    threads = 1 if conns == 1 else 2
    cmd = [wrk, f"-t{threads}", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "10s",
           "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if proc.returncode != 0:
        raise HarnessError(f"wrk failed ({proc.returncode}): {proc.stderr[-500:]}")
    return proc.stdout


def measure(wrk: str, c: Contender, sim: Sim, script: Path, conns: int, seconds: float, warmup: float) -> dict:
    url = c.url + "/v1/chat/completions"
    if warmup > 0:
        run_wrk(wrk, url, script, conns, warmup)
    r0, s0 = c.cpu_seconds(), proc_cpu_seconds(sim.proc.pid)
    out = run_wrk(wrk, url, script, conns, seconds)
    r1, s1 = c.cpu_seconds(), proc_cpu_seconds(sim.proc.pid)
    res = parse_wrk(out)
    n = max(res["requests"], 1)
    res["router_cpu_10k"] = (r1 - r0) / n * 10_000
    res["sim_cpu_10k"] = (s1 - s0) / n * 10_000
    res["router_cpu_util"] = (r1 - r0) / seconds
    res["sim_cpu_util"] = (s1 - s0) / seconds
    return res


def memory_run(wrk: str, envoy: Envoy, workdir: Path, total: int, every: int, conns: int = 16,
               served: int = 0) -> list[dict]:
    """Drive `total` 1 KB requests through one kvroute Envoy in wrk runs of
    whole seconds, sized from the last run's rate to end near each multiple
    of `every`; sample the linear memories between runs (nothing in flight).
    `served`: requests the Envoy answered before (the probe)."""
    script = write_bodies(workdir, 1024)
    url = envoy.gateway_url + "/v1/chat/completions"
    min_pages = wasm_initial_pages(KVROUTE_WASM) or 1
    samples = [memory_sample(envoy, min_pages, served)]
    log(f"memory run: {len(samples[0]['memories'])} linear memories at start, "
        f"{samples[0]['pages_total']} pages, {samples[0]['rss_kb_total']} KiB resident")
    done, errors, rate, mark = served, 0, 0.0, every
    while done < total:
        goal = min(mark, total) - done
        seconds = 2.0 if rate <= 0 else min(max(1.0, round(goal / rate)), 120.0)
        res = parse_wrk(run_wrk(wrk, url, script, conns, seconds))
        if res["requests"] == 0:
            raise HarnessError("memory run: wrk completed no requests")
        done += res["requests"]
        errors += res["non2xx"] + res["socket_errors"]
        rate = res["requests"] / max(1.0, round(seconds))
        if done >= mark or done >= total:
            s = memory_sample(envoy, min_pages, done)
            s["errors"] = errors
            samples.append(s)
            log(f"memory run: {done:>9} requests  pages {[m['pages'] for m in s['memories']]}  "
                f"resident KiB {[m['rss_kb'] for m in s['memories']]}  envoy RSS {s['envoy_rss_kb'] / 1024:.0f} MiB  "
                f"errors {errors}")
            while mark <= done:
                mark += every
    return samples


def size_label(size: int) -> str:
    return f"{size // 1024} KB"


# ------------------------------------------------------------------ output


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def median_rows(results: list[dict]) -> list[dict]:
    """One row per setting and contender: the median of each figure over the
    rounds (errors summed), in the order the runs were made."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["size"], r["conns"], r["contender"]), []).append(r)
    rows = []
    for (size, conns, contender), runs in sorted(
            groups.items(), key=lambda kv: (kv[0][0], kv[0][1], ALL_CONTENDERS.index(kv[0][2]))):
        row = {k: statistics.median(r[k] for r in runs)
               for k in ("rps", "p50", "p99", "router_cpu_10k", "sim_cpu_10k")}
        row.update(size=size, conns=conns, contender=contender, rounds=len(runs),
                   non2xx=sum(r["non2xx"] for r in runs), socket_errors=sum(r["socket_errors"] for r in runs))
        rows.append(row)
    return rows


def markdown_table(results: list[dict]) -> str:
    """Medians over the rounds (one round: the runs themselves)."""
    rows = median_rows(results)
    lines = [
        "| body | conns | contender | req/s | vs plain | p50 ms | p50 +ms vs plain | p99 ms | p99 vs plain "
        "| router CPU s / 10k req | vs plain | engines CPU s / 10k req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["size"], r["conns"]): r for r in rows if r["contender"] == "plain"}
    for r in rows:
        b = base.get((r["size"], r["conns"]))
        errors = r["non2xx"] + r["socket_errors"]
        lines.append(
            f"| {size_label(r['size'])} | {r['conns']} | {r['contender']} | {r['rps']:.0f} | "
            f"{ratio(r['rps'], b['rps']) if b else '-'} | {r['p50']:.3f} | "
            f"{(r['p50'] - b['p50']) if b else float('nan'):+.3f} | {r['p99']:.3f} | {ratio(r['p99'], b['p99']) if b else '-'} | "
            f"{r['router_cpu_10k']:.2f} | {ratio(r['router_cpu_10k'], b['router_cpu_10k']) if b else '-'} | "
            f"{r['sim_cpu_10k']:.2f} | {errors} |"
        )
    return "\n".join(lines)


def paired(results: list[dict], size: int, conns: int, other: str = "kvroute") -> list[tuple[dict, dict]]:
    """(plain, other) runs of one setting, round by round."""
    by = {(r["contender"], r.get("round", 1)): r for r in results if (r["size"], r["conns"]) == (size, conns)}
    return [(by[("plain", n)], by[(other, n)]) for (c, n) in sorted(by)
            if c == "plain" and (other, n) in by]


def targets(results: list[dict]) -> list[str]:
    """The issue's targets, on the median over rounds of the paired figures."""
    out = []
    pairs = paired(results, 1024, 64)
    if pairs:
        share = statistics.median(k["rps"] / p["rps"] if p["rps"] else 0.0 for p, k in pairs)
        out.append(
            f"- 1 KB, 64 connections: kvroute at {share:.0%} of plain Envoy's req/s "
            f"(target >= 85%): {'met' if share >= 0.85 else 'NOT met'}."
        )
    for other in ("noop", "minimal"):
        pairs = paired(results, 1024, 64, other)
        if pairs:
            share = statistics.median(k["rps"] / p["rps"] if p["rps"] else 0.0 for p, k in pairs)
            out.append(f"  (same setting, for reference: {other} at {share:.0%})")
    for conns in (1, 16, 64):
        pairs = paired(results, 131072, conns)
        if pairs:
            d = statistics.median(k["p50"] - p["p50"] for p, k in pairs)
            out.append(
                f"- 128 KB, {conns} connection(s): kvroute adds {d:+.3f} ms p50 over plain Envoy "
                f"(target <= 0.3 ms): {'met' if d <= 0.3 else 'NOT met'}."
            )
        refs = []
        for other in ("noop", "minimal"):
            pairs = paired(results, 131072, conns, other)
            if pairs:
                refs.append(f"{other} {statistics.median(k['p50'] - p['p50'] for p, k in pairs):+.3f} ms")
        if refs:
            out.append(f"  (same setting, for reference: {', '.join(refs)})")
    return out


def write_svg(results: list[dict], path: Path) -> None:
    """Two panels of grouped bars: req/s and p50 per setting and contender.

    The scale of a panel stops at 3x the largest Envoy value: a peer far
    beyond it (vllm-router's p50 at 128 KB) would flatten every other bar, so
    its bar is cut at the top and its value written above it."""
    results = median_rows(results)
    settings = sorted({(r["size"], r["conns"]) for r in results})
    by = {(r["size"], r["conns"], r["contender"]): r for r in results}
    contenders = [c for c in ALL_CONTENDERS if any(r["contender"] == c for r in results)]
    panel_w, panel_h, left, top = max(40 * len(contenders) * len(settings), 100 * len(contenders), 480), 220, 70, 56
    width = left + panel_w + 20
    height = top + 2 * (panel_h + 70) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">Gateway overhead: routers in front of '
        f"null engines, Envoy --concurrency 2, 2 vCPU shared</text>",
    ]
    for x, name in enumerate(contenders):
        out.append(f'<rect x="{left + x * 100}" y="28" width="10" height="10" fill="{COLOURS[name]}"/>')
        out.append(f'<text x="{left + 14 + x * 100}" y="37">{name}</text>')
    for p, (key, title) in enumerate([("rps", "requests/s"), ("p50", "p50 latency, ms")]):
        y0 = top + p * (panel_h + 70)
        vmax = max((by[s + (c,)][key] for s in settings for c in contenders if s + (c,) in by), default=1) or 1
        envoy_max = max((by[s + (c,)][key] for s in settings for c in ENVOYS if s + (c,) in by), default=0)
        if envoy_max > 0:
            vmax = min(vmax, 3 * envoy_max)
        out.append(f'<text x="{left}" y="{y0 + 12}" font-weight="bold">{title}</text>')
        base_y = y0 + 20 + panel_h
        out.append(f'<line x1="{left}" y1="{base_y}" x2="{left + panel_w}" y2="{base_y}" stroke="black"/>')
        for t in range(5):
            v = vmax * t / 4
            ty = base_y - panel_h * t / 4
            out.append(f'<line x1="{left - 4}" y1="{ty:.1f}" x2="{left + panel_w}" y2="{ty:.1f}" stroke="#ddd"/>')
            label = f"{v:.0f}" if key == "rps" else f"{v:.2f}"
            out.append(f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end">{label}</text>')
        group_w = panel_w / len(settings)
        bar_w = group_w / (len(contenders) + 1)
        for i, s in enumerate(settings):
            gx = left + i * group_w + bar_w / 2
            for j, c in enumerate(contenders):
                r = by.get(s + (c,))
                if not r:
                    continue
                h = panel_h * min(r[key] / vmax, 1.0)
                out.append(
                    f'<rect x="{gx + j * bar_w:.1f}" y="{base_y - h:.1f}" width="{bar_w - 2:.1f}" '
                    f'height="{h:.1f}" fill="{COLOURS[c]}"><title>{c} {size_label(s[0])} c={s[1]}: '
                    f"{r[key]:.3f}</title></rect>"
                )
                if r[key] > vmax:
                    out.append(
                        f'<text x="{gx + (j + 0.5) * bar_w - 1:.1f}" y="{base_y - h - 3:.1f}" text-anchor="middle" '
                        f'font-size="9">{r[key]:.0f}</text>'
                    )
            out.append(
                f'<text x="{left + (i + 0.5) * group_w:.1f}" y="{base_y + 14}" text-anchor="middle">'
                f"{size_label(s[0])}, c={s[1]}</text>"
            )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def memory_flat(samples: list[dict]) -> tuple[bool | None, str]:
    """Flat after warm-up: from the first sample after requests to the last,
    no memory grew (pages) and the resident total grew by at most 256 KiB
    or 2 %, whichever is larger (page-cache-like noise of a few pages)."""
    if len(samples) < 3:
        return None, "too few samples to tell (raise --memory-run or lower --memory-every)"
    warm, last = samples[1], samples[-1]
    pages_w = [m["pages"] for m in warm["memories"]]
    pages_l = [m["pages"] for m in last["memories"]]
    grew = last["rss_kb_total"] - warm["rss_kb_total"]
    slack = max(256, warm["rss_kb_total"] * 0.02)
    flat = pages_w == pages_l and grew <= slack
    what = (f"from {warm['requests']:,} to {last['requests']:,} requests the memories went from "
            f"{pages_w} to {pages_l} pages and the resident total changed by {grew:+} KiB")
    return flat, what


VERDICT = {True: "Flat", False: "NOT flat", None: "Cannot tell whether flat"}


def memory_section(samples: list[dict], conns: int) -> list[str]:
    total = samples[-1]["requests"]
    first = samples[0]
    flat, what = memory_flat(samples)
    errors = samples[-1].get("errors", 0)
    lines = [
        f"### Wasm linear memory over {total:,} requests",
        "",
        "After the matrix, with the other contenders stopped, a fresh kvroute Envoy (same",
        f"configuration and {FLEET_HOSTS}-host snapshot) served {total:,} requests of 1 KB at {conns} connections",
        "(the first row: after the snapshot push and one probe request),",
        "in wrk runs of whole seconds sized to end near each sample point. Between runs, with",
        "nothing in flight, the script read the Wasm VMs' linear memories from /proc/PID/smaps.",
        "Method: for a 32-bit Wasm memory V8 reserves 8 GiB of address space (the 4 GiB it can",
        "address plus guard space, so bounds checks are left to the MMU) and makes only the first",
        "memory.size bytes readable and writable, growing that part in place. Each linear memory is",
        "therefore an anonymous rw-p mapping, a multiple of 64 KiB and at least the module's initial",
        "size, directly followed by an anonymous ---p mapping, the two 8 GiB together. Its size is",
        "memory.size (in 64 KiB pages below) and its Rss the resident part. Envoy's stats have no",
        "memory gauge for Wasm VMs; `wasm.wasm_vm_count` "
        f"({first.get('wasm_vm_count')}) gave the number of memories to expect, and {len(first['memories'])} were found",
        "(Envoy's base VM on the main thread plus one clone per thread, the main thread and the",
        "2 workers; the router and ingest plugins share them through their common vm_id).",
        "",
        "| requests | memory.size, pages (each) | resident KiB (each) | resident KiB total | Envoy VmRSS MiB |",
        "|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {s['requests']:,} | {' / '.join(str(m['pages']) for m in s['memories'])} | "
            f"{' / '.join(str(m['rss_kb']) for m in s['memories'])} | {s['rss_kb_total']} | "
            f"{s['envoy_rss_kb'] / 1024:.1f} |"
        )
    lines += [
        "",
        f"{VERDICT[flat]} after warm-up: {what}. Errors during the run: {errors}.",
        "",
    ]
    return lines


def doc_section(results: list[dict], command: str, seconds: float, warmup: float, rss: dict, svg: Path,
                setups: dict[str, str], skipped: dict[str, str], memory: list[dict] | None,
                memory_conns: int) -> str:
    date = dt.date.today().isoformat()
    rounds = max((r.get("round", 1) for r in results), default=1)
    contenders = [c for c in ALL_CONTENDERS if any(r["contender"] == c for r in results)]
    peers = [c for c in contenders if c in PEERS]
    rss_line = ", ".join(f"{c} {rss[c] / 1024:.0f} MiB" for c in contenders if c in rss)
    envoys = sum(c in ENVOYS for c in contenders)
    intro = (f"{['No', 'One', 'Two', 'Three', 'Four'][envoys]} Envoy 1.40 process{'es' if envoys != 1 else ''}"
             + {0: "", 1: " and one peer router", 2: " and two peer routers"}[len(peers)])
    parts = [
        SECTION,
        "",
        f"`{command}` (or `make bench-overhead`): scripts/bench_overhead.py.",
        f"{intro} in front of the same four null engines (`kvroute-sim --mode null`: every",
        "request is read in full and answered at once with a small fixed body). The Envoys",
        "(`--concurrency 2`) each have the gateway listener, the `inference` cluster and the",
        "override_host policy of envoy-config/envoy.yaml:",
        "",
        "- **plain**: no Wasm filter (the baseline; every ratio is to it, same setting, same session);",
        "- **noop**: bench/noop-filter, which pauses on the headers, buffers the body and continues:",
        "  the cost of the Wasm VM and of body buffering;",
        "- **minimal**: the same module as the least any body-reading router filter does: it also",
        "  copies the body into the VM, reads `:path` and sets the destination header (round robin",
        "  over the engines), so override_host acts on it as it does for kvroute;",
        f"- **kvroute**: the kvroute filter with a {FLEET_HOSTS}-host fleet snapshot pushed to its ingest",
        f"  listener: the {REAL_ENGINES} real engines ready, {FLEET_HOSTS - REAL_ENGINES} more addresses not ready, so every request",
        f"  is parsed, hashed and scored against {FLEET_HOSTS} hosts (configuration otherwise as in envoy.yaml,",
        "  `explainHeader` on);",
    ]
    if "sglang-router" in peers:
        parts += [
            f"- **sglang-router**: {setups.get('sglang-router', 'sglang-router --policy cache_aware')}",
            "  (its thread counts too), launched as scripts/bench.py launches it;",
        ]
    if "vllm-router" in peers:
        parts += [
            f"- **vllm-router**: {setups.get('vllm-router', 'vllm-router --policy cache_aware')}.",
            "  Its cache_aware policy POSTs each request to `/v1/chat/completions/render` on every",
            "  worker for token ids before it routes; the null engines answer that with one id per",
            "  4 body bytes, so its \"engines CPU\" includes those renders;",
        ]
    parts[-1] = parts[-1][:-1] + "."
    parts += [
        "",
        f"Load: wrk (`-t1` at 1 connection, `-t2` above), {seconds:g} s per run after a {warmup:g} s warm-up,",
        "POSTing real-shaped chat bodies (system prompt plus alternating user/assistant turns,",
        f"{VARIANTS} variants rotated). The contenders run interleaved, setting by setting"
        + (f"; the whole matrix ran {rounds} times, each figure below is the median over the rounds and"
           " each target is judged on the median of the per-round paired figures." if rounds > 1 else "."),
        f"Measured on {date} on the project's CI-class machine (2 vCPU, shared): wrk, the",
        "routers and the engines all share the same 2 cores, so absolute req/s are low",
        "and the ratios are the figures to read. Router CPU is utime+stime (plus the reaped",
        "children's) of the router's process tree from /proc, per 10,000 requests; \"engines CPU\"",
        "is the null engines' own, to show they are not the bottleneck. Peak RSS (VmHWM over the",
        "session, summed over each router's process tree): " + rss_line + ".",
        "",
    ]
    if skipped:
        parts += ["Not run in this session: " + "; ".join(skipped.values()) + ".", ""]
    parts += [
        markdown_table(results),
        "",
        "Targets:",
        "",
        *targets(results),
        "",
        f"![gateway overhead]({svg.name})",
        "",
    ]
    if memory:
        parts += memory_section(memory, memory_conns)
    not_yet = []
    if skipped:
        not_yet.append("the skipped peer router(s) above")
    if not memory:
        not_yet.append("the filter's linear memory after 1M requests")
    parts += [
        "The decision alone in Wasm (V8) against native: `make bench-decide-wasm`",
        "(crates/kvroute-core/examples/decide_timing.rs under Node's WASI, see",
        "[the decision alone](#the-decision-alone-parse--hash--pick-criterion-native)).",
        "",
        "Where the kvroute contender's extra CPU goes: the hand-written sections below.",
        "",
    ]
    if not_yet:
        parts += ["Not measured yet: " + "; ".join(not_yet) + ".", ""]
    return "\n".join(parts)


def update_doc(section: str) -> None:
    text = DOC.read_text()
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(SECTION))
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:start] + section + ("\n" + text[end:] if nxt >= 0 else "")
    DOC.write_text(text)


# ------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0, help="whole seconds per measured run (default 5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="whole seconds of warm-up before each run, 0 for none (default 1)")
    ap.add_argument("--conns", default="1,16,64", help="connection counts (default 1,16,64)")
    ap.add_argument("--sizes", default="1,32,128", help="body sizes in KB (default 1,32,128)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny run: 1 KB and 128 KB at 16 connections, 2 s; memory run of 20,000 requests")
    ap.add_argument("--require-peers", action="store_true",
                    help="fail if a peer router is not installed (default: skip it with a note)")
    ap.add_argument("--memory-run", type=int, default=None, metavar="N",
                    help="requests of 1 KB through a fresh kvroute Envoy while sampling its Wasm linear "
                         "memory (default 1000000, 20000 with --quick; 0 to skip)")
    ap.add_argument("--memory-every", type=int, default=None, metavar="N",
                    help="sample the memory every N requests (default 100000, 5000 with --quick)")
    ap.add_argument("--memory-conns", type=int, default=16, help="connections for the memory run (default 16)")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset to run, e.g. plain,noop,kvroute (default: all; kvroute is always "
                         "started for the memory run)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole interleaved matrix this many times (default 1)")
    ap.add_argument("--no-build", action="store_true", help="use the built binaries as they are")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"write the section into {DOC.relative_to(REPO_ROOT)} and the plot {SVG.relative_to(REPO_ROOT)}")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup, args.conns, args.sizes = 2.0, 1.0, "16", "1,128"
    if args.memory_run is None:
        args.memory_run = 20_000 if args.quick else 1_000_000
    if args.memory_every is None:
        args.memory_every = 5_000 if args.quick else 100_000
    conns = [int(c) for c in args.conns.split(",")]
    sizes = [int(s) * 1024 for s in args.sizes.split(",")]

    wrk = ensure_wrk()
    if not args.no_build:
        build()
    for f in (SIM, KVROUTE_WASM, NOOP_WASM):
        if not f.is_file():
            raise SystemExit(f"missing {f}: build it (or drop --no-build)")
    skipped: dict[str, str] = {}
    for name in PEERS:
        why = peer_missing(name)
        if why and args.require_peers:
            raise SystemExit(f"{name}: {why} (--require-peers)")
        if why:
            skipped[name] = why
            log(f"skipping {name}: {why}")
    names = ENVOYS + [n for n in PEERS if n not in skipped]
    if args.contenders:
        wanted = [n.strip() for n in args.contenders.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in ENVOYS + list(PEERS)]
        if unknown:
            raise SystemExit(f"--contenders: unknown {unknown} (known: {ENVOYS + list(PEERS)})")
        names = [n for n in names if n in wanted or n == "kvroute"]

    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    sim = Sim(consecutive_free_ports(REAL_ENGINES), REAL_ENGINES, workdir)
    contenders: dict[str, Contender] = {}
    results: list[dict] = []
    memory: list[dict] | None = None
    try:
        sim.start()
        real = sim.addresses
        # Never-connected addresses (not ready, not in the cluster).
        fake = [f"127.0.0.2:{20000 + i}" for i in range(FLEET_HOSTS - REAL_ENGINES)]
        probe = chat_body(1024, 1)
        try:
            for name in names:
                contenders[name] = (start_envoy(name, workdir, real, fake) if name in ENVOYS
                                    else start_peer(name, workdir, real))
            for name, c in contenders.items():
                decision = check_contender(c, probe)
                if name == "kvroute":
                    log(f"kvroute decision: {decision}")
            kv = contenders["kvroute"].envoy
            before = kv.kvroute_metrics()
            for rnd, size in ((r, s) for r in range(args.rounds) for s in sizes):
                script = write_bodies(workdir, size)
                for n_conns in conns:
                    for name, c in contenders.items():
                        r = measure(wrk, c, sim, script, n_conns, args.duration, args.warmup)
                        r.update(contender=name, size=size, conns=n_conns, round=rnd + 1)
                        results.append(r)
                        log(
                            f"{size_label(size):>6} c={n_conns:<3} {name:<13} {r['rps']:8.0f} req/s  "
                            f"p50 {r['p50']:.3f} ms  p99 {r['p99']:.3f} ms  "
                            f"router {r['router_cpu_10k']:.2f} s/10k ({r['router_cpu_util']:.2f} cores)  "
                            f"engines {r['sim_cpu_10k']:.2f} s/10k ({r['sim_cpu_util']:.2f} cores)  "
                            f"errors {r['non2xx'] + r['socket_errors']}"
                        )
            after = kv.kvroute_metrics()
            rss = {name: tree_status_kb(c.pid, "VmHWM") for name, c in contenders.items()}
            for name, c in contenders.items():
                if len(c.tree()) > 1 or c.seen:
                    log(f"{name}: process tree {c.tree()} (all seen: {sorted(c.seen)})")
            degraded = {k: after.get(k, 0) - before.get(k, 0) for k in after if "degraded" in k}
            log(f"kvroute degraded decisions during the runs: {degraded}")
        finally:
            for c in contenders.values():
                c.stop()
        if args.memory_run > 0:
            kv = start_envoy("kvroute", workdir / "memory-run", real, fake)
            try:
                check_contender(kv, probe)
                memory = memory_run(wrk, kv.envoy, workdir, args.memory_run, args.memory_every, args.memory_conns,
                                    served=1)
            finally:
                kv.stop()
            flat, what = memory_flat(memory)
            log(f"memory run: {VERDICT[flat]} after warm-up: {what}")
    finally:
        sim.stop()

    command = ".venv/bin/python scripts/bench_overhead.py " + " ".join(sys.argv[1:])
    setups = {name: c.setup for name, c in contenders.items()}
    section = doc_section(results, command.strip(), args.duration, args.warmup, rss, SVG, setups, skipped,
                          memory, args.memory_conns)
    print(section)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rss_kb": rss, "setups": setups,
                                         "skipped": skipped, "memory": memory}, indent=1))
    if args.write_docs:
        write_svg(results, SVG)
        update_doc(section)
        log(f"wrote {DOC.relative_to(REPO_ROOT)} and {SVG.relative_to(REPO_ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

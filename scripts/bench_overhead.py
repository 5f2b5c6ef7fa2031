"""Gateway overhead benchmark: what kvroute costs per request (issue 7, first slice).

Contenders, each an Envoy 1.40 (--concurrency 2) with the listener, cluster
and override_host policy of envoy-config/envoy.yaml, all in front of the same
null engines (kvroute-sim --mode null, which answer at once):

  1. plain   - Envoy, no Wasm filter (the baseline: ratios are to this one)
  2. noop    - Envoy + bench/noop-filter (pause on headers, buffer the body,
               continue): the cost of the Wasm VM and of body buffering
  3. kvroute - Envoy + kvroute with a 64-host fleet snapshot: the 4 real
               engines ready, 60 more addresses not ready, so every request
               is parsed, hashed and scored against 64 hosts

Load: wrk with a Lua script that POSTs real-shaped chat-completions bodies
(system prompt + alternating user/assistant turns; 16 variants rotated so
requests do not all share one prefix), at a fixed number of connections.
The contenders run interleaved, setting by setting, in one session.

Per run: requests/s, p50 and p99 latency (wrk --latency), Envoy CPU seconds
per 10,000 requests (utime+stime of the Envoy process from /proc), the null
engines' CPU per 10,000 requests (to show the upstream is not the
bottleneck), and Envoy's peak RSS (VmHWM, whole session).

    .venv/bin/python scripts/bench_overhead.py            # full matrix, 5 s runs
    .venv/bin/python scripts/bench_overhead.py --quick    # a tiny run
    make bench-overhead                                   # full matrix, writes docs/

Everything binds 127.0.0.1; every process started here is stopped by PID.
Peer routers (sglang-router, vllm-router) are not measured yet.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

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
CONTENDERS = ["plain", "noop", "kvroute"]
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


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14, stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def fleet_snapshot(real: list[str], fake: list[str]) -> dict:
    hosts = [harness.host_state(a, ready=True, models=[MODEL], kv=0.1) for a in real]
    hosts += [harness.host_state(a, ready=False, models=[MODEL], kv=0.0) for a in fake]
    return harness.make_snapshot(hosts, collector="kvroute-bench")


def start_envoys(workdir: Path, real: list[str], fake: list[str]) -> dict[str, Envoy]:
    envoys: dict[str, Envoy] = {}
    for name in CONTENDERS:
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
        else:
            plugin = harness.plugin_config_for(
                real + fake,
                # One push per session: keep the snapshot fresh for the whole run.
                {"fleet": {"staleAfterMs": 3_600_000}},
            )
            cfg = harness.build_envoy_config(
                gateway_port=gw, admin_port=admin, endpoints=real, wasm=KVROUTE_WASM,
                plugin_config=plugin, ingest_port=ingest,
                ingest_config=harness.ingest_config_for(TOKEN, shared_data_prefix=plugin.get("sharedDataPrefix")),
            )
        envoy = Envoy(cfg, workdir / name, concurrency=2, log_level="warn")
        envoys[name] = envoy
        envoy.start()
        log(f"{name}: envoy pid {envoy.proc.pid} on {envoy.gateway_url}")
    return envoys


def check_contender(name: str, envoy: Envoy, body: bytes) -> str:
    req = urllib.request.Request(
        envoy.gateway_url + "/v1/chat/completions", data=body,
        headers={"content-type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.loads(resp.read())
        decision = resp.headers.get(harness.DECISION_HEADER, "")
    if data.get("object") != "chat.completion":
        raise HarnessError(f"{name}: unexpected answer {data!r}")
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


def measure(wrk: str, envoy: Envoy, sim: Sim, script: Path, conns: int, seconds: float, warmup: float) -> dict:
    url = envoy.gateway_url + "/v1/chat/completions"
    if warmup > 0:
        run_wrk(wrk, url, script, conns, warmup)
    e0, s0 = proc_cpu_seconds(envoy.proc.pid), proc_cpu_seconds(sim.proc.pid)
    out = run_wrk(wrk, url, script, conns, seconds)
    e1, s1 = proc_cpu_seconds(envoy.proc.pid), proc_cpu_seconds(sim.proc.pid)
    res = parse_wrk(out)
    n = max(res["requests"], 1)
    res["envoy_cpu_10k"] = (e1 - e0) / n * 10_000
    res["sim_cpu_10k"] = (s1 - s0) / n * 10_000
    res["envoy_cpu_util"] = (e1 - e0) / seconds
    res["sim_cpu_util"] = (s1 - s0) / seconds
    return res


def size_label(size: int) -> str:
    return f"{size // 1024} KB"


# ------------------------------------------------------------------ output


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| body | conns | contender | req/s | vs plain | p50 ms | p50 +ms vs plain | p99 ms | p99 vs plain "
        "| Envoy CPU s / 10k req | vs plain | engines CPU s / 10k req | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["size"], r["conns"]): r for r in results if r["contender"] == "plain"}
    for r in results:
        b = base.get((r["size"], r["conns"]))
        errors = r["non2xx"] + r["socket_errors"]
        lines.append(
            f"| {size_label(r['size'])} | {r['conns']} | {r['contender']} | {r['rps']:.0f} | "
            f"{ratio(r['rps'], b['rps']) if b else '-'} | {r['p50']:.3f} | "
            f"{(r['p50'] - b['p50']):+.3f} | {r['p99']:.3f} | {ratio(r['p99'], b['p99']) if b else '-'} | "
            f"{r['envoy_cpu_10k']:.2f} | {ratio(r['envoy_cpu_10k'], b['envoy_cpu_10k']) if b else '-'} | "
            f"{r['sim_cpu_10k']:.2f} | {errors} |"
        )
    return "\n".join(lines)


def targets(results: list[dict]) -> list[str]:
    out = []
    by = {(r["size"], r["conns"], r["contender"]): r for r in results}
    p, k = by.get((1024, 64, "plain")), by.get((1024, 64, "kvroute"))
    if p and k:
        share = k["rps"] / p["rps"] if p["rps"] else 0.0
        out.append(
            f"- 1 KB, 64 connections: kvroute at {share:.0%} of plain Envoy's req/s "
            f"(target >= 85%): {'met' if share >= 0.85 else 'NOT met'}."
        )
    for conns in (1, 16, 64):
        p, k = by.get((131072, conns, "plain")), by.get((131072, conns, "kvroute"))
        if p and k:
            d = k["p50"] - p["p50"]
            out.append(
                f"- 128 KB, {conns} connection(s): kvroute adds {d:+.3f} ms p50 over plain Envoy "
                f"(target <= 0.3 ms): {'met' if d <= 0.3 else 'NOT met'}."
            )
    return out


def write_svg(results: list[dict], path: Path) -> None:
    """Two panels of grouped bars: req/s and p50 per setting and contender."""
    settings = sorted({(r["size"], r["conns"]) for r in results})
    by = {(r["size"], r["conns"], r["contender"]): r for r in results}
    colours = {"plain": "#4c72b0", "noop": "#dd8452", "kvroute": "#55a868"}
    panel_w, panel_h, left, top = max(120 * len(settings), 360), 220, 70, 40
    width = left + panel_w + 20
    height = top + 2 * (panel_h + 70) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">Gateway overhead: Envoy --concurrency 2, '
        f"null engines, 2 vCPU shared</text>",
    ]
    for x, name in enumerate(CONTENDERS):
        out.append(f'<rect x="{left + 330 + x * 80}" y="24" width="10" height="10" fill="{colours[name]}"/>')
        out.append(f'<text x="{left + 344 + x * 80}" y="33">{name}</text>')
    for p, (key, title) in enumerate([("rps", "requests/s"), ("p50", "p50 latency, ms")]):
        y0 = top + p * (panel_h + 70)
        vmax = max((by[s + (c,)][key] for s in settings for c in CONTENDERS if s + (c,) in by), default=1) or 1
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
        bar_w = group_w / (len(CONTENDERS) + 1)
        for i, s in enumerate(settings):
            gx = left + i * group_w + bar_w / 2
            for j, c in enumerate(CONTENDERS):
                r = by.get(s + (c,))
                if not r:
                    continue
                h = panel_h * r[key] / vmax
                out.append(
                    f'<rect x="{gx + j * bar_w:.1f}" y="{base_y - h:.1f}" width="{bar_w - 2:.1f}" '
                    f'height="{h:.1f}" fill="{colours[c]}"><title>{c} {size_label(s[0])} c={s[1]}: '
                    f"{r[key]:.3f}</title></rect>"
                )
            out.append(
                f'<text x="{left + (i + 0.5) * group_w:.1f}" y="{base_y + 14}" text-anchor="middle">'
                f"{size_label(s[0])}, c={s[1]}</text>"
            )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def doc_section(results: list[dict], command: str, seconds: float, warmup: float, rss: dict, svg: Path) -> str:
    date = dt.date.today().isoformat()
    rss_line = ", ".join(f"{c} {rss[c] / 1024:.0f} MiB" for c in CONTENDERS if c in rss)
    parts = [
        SECTION,
        "",
        f"`{command}` (or `make bench-overhead`): scripts/bench_overhead.py. Three",
        "Envoy 1.40 processes (`--concurrency 2`), each with the gateway listener,",
        "the `inference` cluster and the override_host policy of envoy-config/envoy.yaml,",
        "in front of the same four null engines (`kvroute-sim --mode null`: every",
        "request is read in full and answered at once with a small fixed body):",
        "",
        "- **plain**: no Wasm filter (the baseline; every ratio is to it, same setting, same session);",
        "- **noop**: bench/noop-filter, which pauses on the headers, buffers the body and continues:",
        "  the cost of the Wasm VM and of body buffering;",
        f"- **kvroute**: the kvroute filter with a {FLEET_HOSTS}-host fleet snapshot pushed to its ingest",
        f"  listener: the {REAL_ENGINES} real engines ready, {FLEET_HOSTS - REAL_ENGINES} more addresses not ready, so every request",
        "  is parsed, hashed and scored against 64 hosts (configuration otherwise as in envoy.yaml,",
        "  `explainHeader` on).",
        "",
        f"Load: wrk (`-t1` at 1 connection, `-t2` above), {seconds:g} s per run after a {warmup:g} s warm-up,",
        "POSTing real-shaped chat bodies (system prompt plus alternating user/assistant turns,",
        f"{VARIANTS} variants rotated). The contenders run interleaved, setting by setting.",
        f"Measured on {date} on the project's CI-class machine (2 vCPU, shared): wrk, the",
        "three Envoys and the engines all share the same 2 cores, so absolute req/s are low",
        "and the ratios are the figures to read. CPU is utime+stime of the process from",
        "/proc, per 10,000 requests; \"engines CPU\" is the null engines' own, to show they",
        "are not the bottleneck. Peak RSS (VmHWM over the session): " + rss_line + ".",
        "",
        markdown_table(results),
        "",
        "Targets:",
        "",
        *targets(results),
        "",
        f"![gateway overhead]({svg.name})",
        "",
        "Not measured yet: peer routers (sglang-router, vllm-router); the decision in",
        "Wasm alone (criterion inside V8); the filter's linear memory after 1M requests;",
        "a profile of where the kvroute contender's extra CPU goes.",
        "",
    ]
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
    ap.add_argument("--quick", action="store_true", help="tiny run: 1 KB and 128 KB at 16 connections, 2 s")
    ap.add_argument("--no-build", action="store_true", help="use the built binaries as they are")
    ap.add_argument("--write-docs", action="store_true",
                    help=f"write the section into {DOC.relative_to(REPO_ROOT)} and the plot {SVG.relative_to(REPO_ROOT)}")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup, args.conns, args.sizes = 2.0, 1.0, "16", "1,128"
    conns = [int(c) for c in args.conns.split(",")]
    sizes = [int(s) * 1024 for s in args.sizes.split(",")]

    wrk = ensure_wrk()
    if not args.no_build:
        build()
    for f in (SIM, KVROUTE_WASM, NOOP_WASM):
        if not f.is_file():
            raise SystemExit(f"missing {f}: build it (or drop --no-build)")

    workdir = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    sim = Sim(consecutive_free_ports(REAL_ENGINES), REAL_ENGINES, workdir)
    envoys: dict[str, Envoy] = {}
    results: list[dict] = []
    try:
        sim.start()
        real = sim.addresses
        # Never-connected addresses (not ready, not in the cluster).
        fake = [f"127.0.0.2:{20000 + i}" for i in range(FLEET_HOSTS - REAL_ENGINES)]
        envoys = start_envoys(workdir, real, fake)
        kv = envoys["kvroute"]
        push = harness.push_snapshot(f"http://{LOCALHOST}:{kv.ingest_port}", fleet_snapshot(real, fake), TOKEN)
        if push.status != 204:
            raise HarnessError(f"snapshot push: {push!r}")
        probe = chat_body(1024, 1)
        for name, envoy in envoys.items():
            decision = check_contender(name, envoy, probe)
            if name == "kvroute":
                log(f"kvroute decision: {decision}")
        before = kv.kvroute_metrics()
        for size in sizes:
            script = write_bodies(workdir, size)
            for c in conns:
                for name in CONTENDERS:
                    r = measure(wrk, envoys[name], sim, script, c, args.duration, args.warmup)
                    r.update(contender=name, size=size, conns=c)
                    results.append(r)
                    log(
                        f"{size_label(size):>6} c={c:<3} {name:<8} {r['rps']:8.0f} req/s  p50 {r['p50']:.3f} ms  "
                        f"p99 {r['p99']:.3f} ms  envoy {r['envoy_cpu_10k']:.2f} s/10k ({r['envoy_cpu_util']:.2f} cores)  "
                        f"engines {r['sim_cpu_10k']:.2f} s/10k ({r['sim_cpu_util']:.2f} cores)  "
                        f"errors {r['non2xx'] + r['socket_errors']}"
                    )
        after = kv.kvroute_metrics()
        rss = {name: proc_status_kb(e.proc.pid, "VmHWM") for name, e in envoys.items()}
        degraded = {k: after.get(k, 0) - before.get(k, 0) for k in after if "degraded" in k}
        log(f"kvroute degraded decisions during the runs: {degraded}")
    finally:
        for e in envoys.values():
            e.stop()
        sim.stop()

    command = ".venv/bin/python scripts/bench_overhead.py " + " ".join(sys.argv[1:])
    section = doc_section(results, command.strip(), args.duration, args.warmup, rss, SVG)
    print(section)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "rss_kb": rss}, indent=1))
    if args.write_docs:
        write_svg(results, SVG)
        update_doc(section)
        log(f"wrote {DOC.relative_to(REPO_ROOT)} and {SVG.relative_to(REPO_ROOT)}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

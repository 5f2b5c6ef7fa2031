#!/usr/bin/env python3
"""kvroute demo: bring the local stack up, drive a short workload, report, stop.

    .venv/bin/python scripts/demo.py          (what `make demo` runs)
    .venv/bin/python scripts/demo.py --tour   (the feature tour below, on scripted replicas)
    .venv/bin/python scripts/demo.py --up     (what `make up` runs: scripts/up.py)

By default (about a minute): four simulated engines (kvroute-sim --mode
engine on 127.0.0.1:8001-8004: paged KV cache with prefix caching, continuous
batching, a Llama-3.1-8B-on-H100 step-time model, 20x faster than real time),
then the same small workload (a window of the Mooncake trace in
bench/traces, shipped with the project) through Envoy
round robin and through Envoy + kvroute + kvroute-collector on the local
stack's ports, one after the other, each on a fresh fleet; then a short
comparison: time to first token, prefix-cache hit rate (prompt tokens cached
at first admission, from the answers), KV spread. It is scripts/bench.py (`make bench`) in small.

The tour (--tour): 4 scripted replicas on 127.0.0.1:8001-8004, Envoy with
envoy-config/envoy.yaml (gateway 127.0.0.1:10000, admin 127.0.0.1:9901,
ingest 127.0.0.1:10001) and the kvroute filter from
target/wasm32-wasip1/release/kvroute.wasm, plus kvroute-collector (metrics on
127.0.0.1:9102) scraping the replicas' /metrics and /health every 100 ms, if
it is built (cargo build --release -p kvroute-collector); without it, the
fleet-state part pushes the snapshots from this script instead.

Workload (about 15 s):
  1. 20 conversations x 4 turns with a session header: each stays on one
     replica, and the conversations spread over the fleet;
  2. no session key: requests sharing an 8 KB system prompt co-locate, while
     conversations with different openings spread;
  3. one hot session, 16 concurrent 20 KB requests held 1.5 s each by the
     replica: bounded load spills the excess to other replicas;
  4. fleet state: one replica reports KV 0.95 and 20 waiting requests on its
     /metrics; new conversations avoid it. Then its /health says 503: it gets
     nothing until it is ready again;
then the kvroute_* metrics from Envoy's admin endpoint, fleet ones included.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

import harness  # noqa: E402
from harness import chat_body, filler, send  # noqa: E402

CHAT = "/v1/chat/completions"


def short(host: str | None) -> str:
    """'127.0.0.1:8003' -> ':8003' (all replicas are on loopback)."""
    return ":" + host.rsplit(":", 1)[1] if host else "-"


def bar(n: int, total: int, width: int = 24) -> str:
    filled = round(width * n / total) if total else 0
    return "#" * filled + "." * (width - filled)


def check(r: harness.Reply) -> harness.Reply:
    if r.status != 200:
        raise RuntimeError(f"request failed: {r.describe()}")
    return r


def phase_sessions(stack: harness.Stack, conversations: int = 20, turns: int = 4) -> bool:
    print(f"\n[1] {conversations} conversations x {turns} turns, session header x-session-id")
    where: dict[str, list[str]] = defaultdict(list)
    for t in range(turns):
        for c in range(conversations):
            messages = [{"role": "user", "content": f"conversation {c}: tell me about topic {c}"}]
            for k in range(t):
                messages += [
                    {"role": "assistant", "content": f"answer {k} for conversation {c}"},
                    {"role": "user", "content": f"follow-up {k + 1}"},
                ]
            r = check(send(stack.gateway_url, CHAT, json_body=chat_body(messages), session=f"conv-{c:02d}"))
            where[f"conv-{c:02d}"].append(r.served_by)
    sticky = 0
    cells = []
    for name, hosts in where.items():
        top, n = Counter(hosts).most_common(1)[0]
        sticky += n == len(hosts)
        cells.append(f"{name} {short(top)} {n}/{len(hosts)}{'' if n == len(hosts) else ' MOVED'}")
    for i in range(0, len(cells), 4):
        print("    " + "   ".join(f"{c:<22}" for c in cells[i : i + 4]).rstrip())
    per_replica = Counter(hosts[0] for hosts in where.values())
    print(f"    stayed on one replica: {sticky}/{len(where)} conversations")
    print("    conversations per replica:")
    for host in stack.live_hosts:
        n = per_replica.get(host, 0)
        print(f"      {host}  {bar(n, len(where))} {n}")
    return sticky == len(where)


def phase_prefix(stack: harness.Stack) -> bool:
    print("\n[2] no session key: prefix affinity")
    system = filler("demo shared system prompt", 8192)
    shared = Counter()
    for q in range(10):
        body = chat_body(system=system, user_text=f"question {q}")
        shared[check(send(stack.gateway_url, CHAT, json_body=body)).served_by] += 1
    distinct = Counter()
    for q in range(20):
        body = chat_body(user_text=f"{q:03d} " + filler(f"opening {q}", 600))
        distinct[check(send(stack.gateway_url, CHAT, json_body=body)).served_by] += 1
    fmt = lambda c: ", ".join(f"{short(h)} x{n}" for h, n in sorted(c.items()))  # noqa: E731
    print(f"    10 requests sharing an 8 KB system prompt -> {fmt(shared)}"
          f"{'  (co-located)' if len(shared) == 1 else ''}")
    print(f"    20 conversations, different openings      -> {fmt(distinct)}")
    return len(shared) == 1 and len(distinct) >= 3


def phase_hot_key(stack: harness.Stack, n: int = 16) -> bool:
    print(f"\n[3] hot key: {n} concurrent 20 KB requests of one session, each held 1.5 s by its replica")
    body = chat_body(user_text=filler("hot document", 20_000), max_tokens=512)

    def one(_):
        return check(send(stack.gateway_url, CHAT, json_body=body, session="hot-session",
                          headers={"x-upstream-delay-ms": "1500"}, timeout=30))

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        replies = list(pool.map(one, range(n)))
    elapsed = time.monotonic() - started
    by_host: dict[str, Counter] = defaultdict(Counter)
    for r in replies:
        by_host[r.served_by][r.reason or "?"] += 1
    print(f"    {'replica':<16} {'requests':>8}  reasons")
    for host in stack.live_hosts:
        reasons = by_host.get(host, Counter())
        total = sum(reasons.values())
        detail = ", ".join(f"{k} x{v}" for k, v in reasons.most_common())
        print(f"    {host:<16} {total:>8}  {bar(total, n, 16)} {detail}")
    print(f"    wall time {elapsed:.1f} s for {n} x 1.5 s requests")
    return len(by_host) > 1


def phase_fleet(stack: harness.Stack, collector: harness.Collector | None) -> bool:
    busy = stack.live_hosts[1]
    how = (f"kvroute-collector (pid {collector.proc.pid}) scrapes /metrics and /health every "
           f"{collector.interval_ms} ms and pushes to {stack.ingest_url}" if collector else
           "no collector built: this script pushes the snapshots itself (what the collector would send)")
    print(f"\n[4] fleet state: {how}")

    def publish() -> None:
        if collector is None:
            r = stack.push_from_replicas()
            if r.status != 204:
                raise RuntimeError(f"snapshot push refused: {r}")

    def conversations(label: str, n: int = 20) -> Counter:
        served = Counter()
        for c in range(n):
            body = chat_body(user_text=f"{label} conversation {c}: hello")
            served[check(send(stack.gateway_url, CHAT, json_body=body, session=f"{label}-{c:02d}")).served_by] += 1
        return served

    def settle(avoid: str, label: str, timeout: float = 3.0) -> float:
        """Seconds until fresh conversations stop landing on `avoid`."""
        started = time.monotonic()
        for i in range(1000):
            if avoid not in conversations(f"{label}-probe-{i}", 8):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                break
            time.sleep(0.02)
        raise RuntimeError(f"{avoid} still gets new conversations {timeout} s after its state changed")

    def row(served: Counter) -> str:
        return "   ".join(f"{short(h)} {served.get(h, 0):>2}" for h in stack.live_hosts)

    publish()
    before = conversations("fleet-idle")
    print(f"    all idle: 20 new conversations    {row(before)}")
    stack.replica_control(busy, kv=0.95, waiting=20)
    publish()
    took = settle(busy, "fleet-busy")
    after = conversations("fleet-busy")
    print(f"    {short(busy)} reports KV 0.95 and 20 waiting on its /metrics: avoided after {took * 1000:.0f} ms")
    print(f"    20 new conversations              {row(after)}")
    stack.replica_control(busy, kv=0.0, waiting=0, ready=False)
    publish()
    took = settle(busy, "fleet-down")
    down = conversations("fleet-down")
    print(f"    {short(busy)} /health answers 503: avoided after {took * 1000:.0f} ms")
    print(f"    20 new conversations              {row(down)}")
    stack.replica_control(busy, ready=True)
    publish()
    if collector is not None:
        time.sleep(3 * collector.interval_ms / 1000)  # let it see the replica back before the metrics
    return busy not in after and busy not in down


def show_metrics(stack: harness.Stack, collector: harness.Collector | None = None, limit: int = 16) -> None:
    print("\n[5] kvroute metrics (admin /stats/prometheus)")
    try:
        metrics = stack.envoy.kvroute_metrics()
    except (OSError, harness.HarnessError) as exc:
        print(f"    could not read metrics: {exc}")
        return
    if not metrics:
        print("    (no kvroute_* series exported)")
        return
    def fmt(value: float) -> str:
        return str(int(value)) if value.is_integer() else f"{value:.3f}"

    fleet = [k for k in metrics if k.startswith(("kvroute_fleet", "kvroute_ingest", "kvroute_decisions_degraded",
                                                 "kvroute_snapshot"))]
    names = sorted((k for k in metrics if k not in fleet), key=lambda k: (not k.startswith("kvroute_decision"), k))
    for name in names[:limit]:
        print(f"    {name:<44} {fmt(metrics[name])}")
    if len(names) > limit:
        print(f"    ... and {len(names) - limit} more")
    print("    fleet state:")
    for name in sorted(fleet):
        print(f"    {name:<44} {fmt(metrics[name])}")
    if collector is not None and collector.running():
        try:
            own = collector.metrics()
        except (OSError, harness.HarnessError) as exc:
            print(f"    (collector metrics unavailable: {exc})")
            return
        print(f"    collector ({collector.metrics_url}):")
        for name in sorted(own):
            if name.startswith("kvroute_collector_") and not any(x in name for x in ("_bucket", "_sum", "_count")):
                print(f"    {name:<70} {fmt(own[name])}")


def compare(keep: bool) -> int:
    """Round robin vs kvroute on the simulated fleet (scripts/bench.py in small)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench  # noqa: PLC0415

    out = Path(tempfile.mkdtemp(prefix="kvroute-demo-"))
    if bench.DEFAULT_TRACE.is_file():
        workload = ["--workload", "trace", "--window", "600:690", "--rate", "1.5"]
    else:
        workload = ["--workload", "groups", "--workload-arg=--group-requests=300", "--workload-arg=--group-rate=5"]
    print("kvroute demo: the same workload through Envoy round robin, then Envoy + kvroute, "
          "on four simulated engines (local stack ports)")
    rc = bench.main(["--routers", "envoy-round-robin,kvroute", "--local-stack", "--time-scale", "20",
                     "--out", str(out), *workload, *(["--keep"] if keep else [])])
    if rc == 0:
        try:
            report = json.loads((out / "report.json").read_text())
            runs = {r["router"]: r for r in report["runs"]}
            rr, kv = runs.get("envoy-round-robin"), runs.get("kvroute")
            if rr and kv:
                print(f"\nkvroute vs round robin: prefix-cache hit rate {100 * kv['hit_rate']:.1f} % vs "
                      f"{100 * rr['hit_rate']:.1f} %, TTFT p50 {kv['ttft_ms']['p50']:.0f} vs "
                      f"{rr['ttft_ms']['p50']:.0f} ms, p99 {kv['ttft_ms']['p99']:.0f} vs {rr['ttft_ms']['p99']:.0f} ms "
                      "(modelled time)")
        except (OSError, ValueError, KeyError) as exc:
            print(f"demo: cannot read the report: {exc}", file=sys.stderr)
            rc = 1
        print(f"report and plots: {out}/report.md, ttft-cdf.svg, kv-utilisation.svg")
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvroute demo on the local stack")
    parser.add_argument("--tour", action="store_true",
                        help="the feature tour on scripted replicas (stickiness, spill-over, fleet state)")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (default 2)")
    parser.add_argument("--keep-logs", action="store_true", help="keep Envoy/upstream logs and config")
    parser.add_argument("--up", action="store_true",
                        help="just bring the stack up and keep it running until Ctrl-C (same as scripts/up.py)")
    args, rest = parser.parse_known_args(argv)
    if args.up:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from up import main as up_main  # noqa: PLC0415

        return up_main(["--concurrency", str(args.concurrency), *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not args.tour:
        return compare(args.keep_logs)

    if not harness.wasm_available():
        print(f"demo: {harness.WASM_MISSING_REASON}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from up import start_collector  # noqa: PLC0415

    harness.install_sigterm_as_interrupt()
    started = time.monotonic()
    try:
        stack = harness.local_stack(concurrency=args.concurrency, keep_workdir=args.keep_logs)
    except harness.HarnessError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    ok = True
    collector = None
    try:
        stack.start()
        print(f"kvroute demo: replicas {short(stack.live_hosts[0])}..{short(stack.live_hosts[-1])} on 127.0.0.1, "
              f"gateway {stack.gateway_url}, admin {stack.admin_url}, ingest {stack.ingest_url}, "
              f"Envoy workers {args.concurrency}")
        collector = start_collector(stack, interval_ms=100)
        if collector is not None:
            print(f"collector: pid {collector.proc.pid}, scraping every 100 ms, metrics {collector.metrics_url}")
        ok &= phase_sessions(stack)
        ok &= phase_prefix(stack)
        ok &= phase_hot_key(stack)
        ok &= phase_fleet(stack, collector)
        show_metrics(stack, collector)
    except harness.HarnessError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndemo: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed request: report it plainly, still stop the stack
        print(f"demo: {exc}", file=sys.stderr)
        if stack.envoy is not None:
            print("Envoy log tail:\n" + stack.envoy.log_tail(20), file=sys.stderr)
        return 1
    finally:
        stack.stop()
        if args.keep_logs:
            print(f"logs and config kept in {stack.workdir}")
    print(f"\n{'all checks passed' if ok else 'SOME CHECKS FAILED (see above)'}; "
          f"stack stopped; {time.monotonic() - started:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A/B of filter builds: Envoy CPU per request and req/s, interleaved.

The gateway overhead benchmark (scripts/bench_overhead.py) compares
contenders; this compares *builds* of the kvroute module (before and after a
change, or builds cut short to see what a step costs) in one session, with
plain Envoy and the no-op and minimal filters for reference. Each variant is
an Envoy 1.40 (--concurrency 2) in front of the same null engines; kvroute
variants get the benchmark's 64-host snapshot. Rounds interleave the
variants, so slow drift of a shared machine hits them alike; the summary is
the median over rounds.

    .venv/bin/python scripts/ab_wasm.py plain minimal before=/tmp/before.wasm \\
        after=target/wasm32-wasip1/release/kvroute.wasm --rounds 5 --duration 6

A variant is `plain`, `noop`, `minimal`, `kvroute` (this tree's build) or
`LABEL=PATH` (a kvroute module). Ratios are to the first variant. Build the
modules first (`make wasm`, and `cargo build --release --target
wasm32-wasip1 -p kvroute-noop` for noop and minimal).

Everything binds 127.0.0.1; every process started here is stopped by PID.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_overhead as bo  # noqa: E402  (one definition of the Envoys, the load and the figures)


def variant(spec: str) -> tuple[str, Path | None]:
    """(label, module) for a command-line variant; module None: a built-in contender."""
    if spec in bo.ENVOYS:
        return spec, None
    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected one of {bo.ENVOYS} or LABEL=PATH")
    module = Path(path)
    if not module.is_file():
        raise argparse.ArgumentTypeError(f"{spec!r}: no file {module}")
    return label, module


def start(label: str, module: Path | None, workdir: Path, real: list[str], fake: list[str]) -> bo.Contender:
    where = workdir / label
    where.mkdir()
    if module is None:
        return bo.start_envoy(label, where, real, fake)
    c = bo.start_envoy("kvroute", where, real, fake, wasm=module)
    c.name = label
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", type=variant, help="plain, noop, minimal, kvroute or LABEL=PATH")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--duration", type=float, default=6.0, help="whole seconds per run (default 6)")
    ap.add_argument("--warmup", type=float, default=1.0, help="whole seconds of warm-up per run (default 1)")
    ap.add_argument("--kb", type=int, default=1, help="body size in KB (default 1)")
    ap.add_argument("--conns", type=int, default=64, help="connections (default 64)")
    args = ap.parse_args()
    labels = [label for label, _ in args.variants]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"variant labels must differ: {labels}")

    wrk = bo.ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-ab-"))
    sim = bo.Sim(bo.consecutive_free_ports(bo.REAL_ENGINES), bo.REAL_ENGINES, workdir)
    contenders: dict[str, bo.Contender] = {}
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    try:
        sim.start()
        real = sim.addresses
        fake = [f"127.0.0.2:{20000 + i}" for i in range(bo.FLEET_HOSTS - bo.REAL_ENGINES)]
        for label, module in args.variants:
            contenders[label] = start(label, module, workdir, real, fake)
            bo.check_contender(contenders[label], bo.chat_body(1024, 1))
        script = bo.write_bodies(workdir, args.kb * 1024)
        for rnd in range(args.rounds):
            for label, c in contenders.items():
                m = bo.measure(wrk, c, sim, script, args.conns, args.duration, args.warmup)
                runs[label].append(m)
                bo.log(f"round {rnd + 1}/{args.rounds} {label:<16} {m['rps']:8.0f} req/s  "
                       f"Envoy {m['router_cpu_10k'] * 100:6.1f} µs/request  p50 {m['p50']:.3f} ms  "
                       f"errors {m['non2xx'] + m['socket_errors']}")
    finally:
        for c in contenders.values():
            c.stop()
        sim.stop()

    base = statistics.median(m["rps"] for m in runs[labels[0]])
    print(f"{args.kb} KB, {args.conns} connections, medians of {args.rounds} rounds of {args.duration:g} s "
          f"(ratios to {labels[0]}):")
    print("| variant | req/s | ratio | Envoy CPU µs / request | p50 ms | errors |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        ms = runs[label]
        rps = statistics.median(m["rps"] for m in ms)
        cpu = statistics.median(m["router_cpu_10k"] * 100 for m in ms)
        p50 = statistics.median(m["p50"] for m in ms)
        errors = sum(m["non2xx"] + m["socket_errors"] for m in ms)
        print(f"| {label} | {rps:.0f} | {rps / base if base else 0:.2f} | {cpu:.1f} | {p50:.3f} | {errors} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

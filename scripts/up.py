#!/usr/bin/env python3
"""Bring kvroute's local stack up and keep it running until Ctrl-C.

    .venv/bin/python scripts/up.py            (`make up` runs scripts/demo.py --up, i.e. this)

  gateway   http://127.0.0.1:10000   (OpenAI-compatible API through Envoy + kvroute)
  admin     http://127.0.0.1:9901    (Envoy admin; /stats/prometheus)
  ingest    http://127.0.0.1:10001   (fleet snapshots: POST /v1/fleet/snapshot, bearer token)
  replicas  127.0.0.1:8001..8004     (simulated engines, tests/e2e/upstream.py: /metrics,
                                      /health, and POST /_control to change their state)
  collector metrics on 127.0.0.1:9102 (kvroute-collector scraping the replicas every
            250 ms and pushing to the ingest listener; started when it is built:
            cargo build --release -p kvroute-collector)

Options: --replicas N (ports 8001..8000+N; the plugin's hosts follow),
--no-filter (Envoy without kvroute, for comparison), --no-collector,
--collector-interval MS, --concurrency N.
Logs and the generated Envoy config are kept in a temporary directory whose
path is printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

import harness  # noqa: E402


def start_collector(stack: harness.Stack, interval_ms: int, quiet: bool = False) -> harness.Collector | None:
    """kvroute-collector on the local layout (metrics on 127.0.0.1:9102), if
    it is built; None (with a hint) if not. HarnessError if it cannot start."""
    binary = harness.collector_binary()
    if binary is None:
        if not quiet:
            print(f"  (no collector: {harness.collector_missing_reason()};\n"
                  "   without it the router balances on its own in-flight accounting only)")
        return None
    harness.require_free_ports([harness.LOCAL_COLLECTOR_METRICS_PORT])
    return stack.start_collector(
        binary=binary,
        interval_ms=interval_ms,
        metrics_port=harness.LOCAL_COLLECTOR_METRICS_PORT,
        collector_id="kvroute-local",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the kvroute local stack until Ctrl-C")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (default 2)")
    parser.add_argument("--no-filter", action="store_true", help="run Envoy without the kvroute filter")
    parser.add_argument("--log-level", default="info", help="Envoy log level (default info)")
    parser.add_argument("--no-collector", action="store_true", help="do not start kvroute-collector")
    parser.add_argument("--collector-interval", type=int, default=250, metavar="MS",
                        help="collector scrape interval in ms (default 250)")
    args = parser.parse_args(argv)

    with_wasm = not args.no_filter
    if with_wasm and not harness.wasm_available():
        print(f"up: {harness.WASM_MISSING_REASON}\n    (or run with --no-filter)", file=sys.stderr)
        return 2
    harness.install_sigterm_as_interrupt()
    try:
        stack = harness.local_stack(
            replicas=args.replicas,
            with_wasm=with_wasm,
            concurrency=args.concurrency,
            log_level=args.log_level,
            keep_workdir=True,
        )
    except harness.HarnessError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 2
    code = 0
    collector = None
    try:
        stack.start()
        print(f"kvroute local stack is up{'' if with_wasm else ' (WITHOUT the kvroute filter)'}:")
        print(f"  gateway   {stack.gateway_url}")
        print(f"  admin     {stack.admin_url}   (kvroute metrics: {stack.admin_url}/stats/prometheus)")
        if stack.has_ingest:
            print(f"  ingest    {stack.ingest_url}{harness.INGEST_PATH}   (loopback; token in envoy-config/envoy.yaml)")
        print(f"  replicas  {', '.join(stack.live_hosts)}")
        if stack.has_ingest and not args.no_collector:
            collector = start_collector(stack, args.collector_interval)
        if collector is not None:
            print(f"  collector pid {collector.proc.pid}, every {args.collector_interval} ms, "
                  f"metrics {collector.metrics_url}")
        print(f"  logs      {stack.workdir}/envoy.log, {stack.workdir}/upstream.log"
              + (f", {collector.log_path}" if collector else ""))
        print("try:")
        print(f"  curl -si {stack.gateway_url}/v1/chat/completions -H 'content-type: application/json' \\")
        print("       -H 'x-session-id: demo' -d '{\"model\":\"test-model\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
        if collector is not None:
            second = stack.live_hosts[min(1, len(stack.live_hosts) - 1)]
            print(f"  curl -s -XPOST http://{second}/_control -d '{{\"kv\": 0.95, \"waiting\": 20}}'   "
                  "# a busy replica: new conversations avoid it")
            print(f"  curl -s -XPOST http://{second}/_control -d '{{\"ready\": false}}'   # /health 503: avoided")
            print(f"  curl -s {stack.admin_url}/stats/prometheus | grep kvroute_fleet")
        print("Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(0.5)
            if collector is not None and not collector.running():
                print(f"up: the collector exited ({collector.proc.returncode}); the router keeps going on its last "
                      f"snapshot, then on its own accounting. Log tail:\n{collector.log_tail()}", file=sys.stderr)
                collector = None
            if not stack.envoy.running():
                print(f"up: Envoy exited ({stack.envoy.proc.returncode}); log tail:\n{stack.envoy.log_tail()}",
                      file=sys.stderr)
                code = 1
                break
            if stack.upstreams.proc.poll() is not None:
                print(f"up: replicas exited ({stack.upstreams.proc.returncode}):\n{stack.upstreams.log_text()}",
                      file=sys.stderr)
                code = 1
                break
    except harness.HarnessError as exc:
        print(f"up: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
    finally:
        stack.stop()
    print(f"stopped (logs kept in {stack.workdir})")
    return code


if __name__ == "__main__":
    sys.exit(main())

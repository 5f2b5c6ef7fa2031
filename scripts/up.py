#!/usr/bin/env python3
"""Bring kvroute's local stack up and keep it running until Ctrl-C.

    .venv/bin/python scripts/up.py            (`make up` runs scripts/demo.py --up, i.e. this)

  gateway   http://127.0.0.1:10000   (OpenAI-compatible API through Envoy + kvroute)
  admin     http://127.0.0.1:9901    (Envoy admin; /stats/prometheus)
  replicas  127.0.0.1:8001..8004     (simulated engines, tests/e2e/upstream.py)

Options: --replicas N (ports 8001..8000+N; the plugin's hosts follow),
--no-filter (Envoy without kvroute, for comparison), --concurrency N.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the kvroute local stack until Ctrl-C")
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default 4)")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (default 2)")
    parser.add_argument("--no-filter", action="store_true", help="run Envoy without the kvroute filter")
    parser.add_argument("--log-level", default="info", help="Envoy log level (default info)")
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
    try:
        stack.start()
        print(f"kvroute local stack is up{'' if with_wasm else ' (WITHOUT the kvroute filter)'}:")
        print(f"  gateway   {stack.gateway_url}")
        print(f"  admin     {stack.admin_url}   (kvroute metrics: {stack.admin_url}/stats/prometheus)")
        print(f"  replicas  {', '.join(stack.live_hosts)}")
        print(f"  logs      {stack.workdir}/envoy.log, {stack.workdir}/upstream.log")
        print("try:")
        print(f"  curl -si {stack.gateway_url}/v1/chat/completions -H 'content-type: application/json' \\")
        print("       -H 'x-session-id: demo' -d '{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
        print("Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(0.5)
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

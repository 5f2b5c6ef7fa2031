#!/usr/bin/env python3
"""Loopback stand-in for a fleet of inference replicas.

One process serves several ports, one per replica. Every request, on any
path and with any method, is answered 200 with a small JSON document that
says which replica served it and what it saw:

    {"served_by": "127.0.0.1:8002", "method": "POST", "path": "/v1/chat/completions",
     "request_bytes": 1234, "destination_header": "127.0.0.1:8002,127.0.0.1:8004"}

plus the response header ``x-served-by``. The whole request body is read
(Content-Length or chunked). A request with ``x-upstream-delay-ms: N`` is held
for N milliseconds before the answer (capped at 60 s), which is how tests keep
requests in flight to exercise bounded load.

Run standalone:   python tests/e2e/upstream.py --ports 8001,8002,8003,8004
Or import:        fleet = Fleet([8001, 8002]); fleet.start(); ...; fleet.stop()
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

HOST = "127.0.0.1"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DELAY_HEADER = "x-upstream-delay-ms"
MAX_DELAY_MS = 60_000
# Refuse absurd uploads rather than eat the test machine's memory.
MAX_BODY_BYTES = 256 * 1024 * 1024


class _BodyError(Exception):
    pass


class ReplicaHandler(BaseHTTPRequestHandler):
    # HTTP/1.1 with keep-alive: Envoy pools upstream connections.
    protocol_version = "HTTP/1.1"
    server_version = "kvroute-test-upstream"
    # Headers and body go out in two writes; with Nagle on, the second waits
    # for a delayed ACK (~40 ms per request on loopback).
    disable_nagle_algorithm = True
    sys_version = ""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    # -- body reading -----------------------------------------------------
    def _read_exact(self, n: int) -> bytes:
        chunks = []
        remaining = n
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 65536))
            if not chunk:
                raise _BodyError("connection closed inside the body")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def _read_chunked(self) -> int:
        total = 0
        while True:
            line = self.rfile.readline(1024)
            if not line:
                raise _BodyError("connection closed inside a chunk header")
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as exc:
                raise _BodyError(f"bad chunk size {size_text!r}") from exc
            if size == 0:
                # Trailers end with an empty line.
                while True:
                    trailer = self.rfile.readline(8192)
                    if trailer in (b"\r\n", b"\n", b""):
                        return total
            total += size
            if total > MAX_BODY_BYTES:
                raise _BodyError("body too large")
            self._read_exact(size)
            self._read_exact(2)  # CRLF after the chunk data

    def _read_body(self) -> int:
        encoding = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in encoding:
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if not length:
            return 0
        try:
            n = int(length)
        except ValueError as exc:
            raise _BodyError(f"bad Content-Length {length!r}") from exc
        if n < 0 or n > MAX_BODY_BYTES:
            raise _BodyError("bad Content-Length")
        self._read_exact(n)
        return n

    # -- answering --------------------------------------------------------
    def _answer(self) -> None:
        try:
            body_bytes = self._read_body()
        except _BodyError as exc:
            self.close_connection = True
            self._send(400, {"error": str(exc), "served_by": self.server.replica})
            return
        delay = self.headers.get(DELAY_HEADER)
        if delay:
            try:
                time.sleep(min(max(int(delay), 0), MAX_DELAY_MS) / 1000.0)
            except ValueError:
                pass
        dest_values = self.headers.get_all(DESTINATION_HEADER) or []
        self._send(
            200,
            {
                "served_by": self.server.replica,
                "method": self.command,
                "path": self.path,
                "request_bytes": body_bytes,
                "destination_header": ",".join(dest_values) if dest_values else None,
            },
        )

    def _send(self, status: int, doc: dict) -> None:
        payload = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("x-served-by", self.server.replica)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _answer


class ReplicaServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Many concurrent connections from Envoy in the bounded-load tests.
    request_queue_size = 128

    def __init__(self, port: int, verbose: bool = False):
        super().__init__((HOST, port), ReplicaHandler)
        self.replica = f"{HOST}:{self.server_address[1]}"
        self.verbose = verbose


class Fleet:
    """Several replica servers in this process, each on its own thread."""

    def __init__(self, ports: Iterable[int], verbose: bool = False):
        self.ports = list(ports)
        self.verbose = verbose
        self.servers: list[ReplicaServer] = []
        self.threads: list[threading.Thread] = []

    @property
    def addresses(self) -> list[str]:
        return [s.replica for s in self.servers]

    def start(self) -> "Fleet":
        try:
            for port in self.ports:
                server = ReplicaServer(port, self.verbose)
                thread = threading.Thread(
                    target=server.serve_forever,
                    kwargs={"poll_interval": 0.1},
                    name=f"replica-{port}",
                    daemon=True,
                )
                thread.start()
                self.servers.append(server)
                self.threads.append(thread)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        for thread in self.threads:
            thread.join(timeout=5)
        self.servers.clear()
        self.threads.clear()

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_ports(text: str) -> list[int]:
    ports = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            ports.extend(range(lo, hi + 1))
        else:
            ports.append(int(part))
    if not ports:
        raise ValueError("no ports given")
    return ports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", required=True, help="e.g. 8001,8002 or 8001-8004")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    try:
        fleet = Fleet(parse_ports(args.ports), args.verbose).start()
    except OSError as exc:
        print(f"upstream: cannot listen: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("upstream: serving " + " ".join(fleet.addresses), flush=True)
    while not stop.wait(0.5):
        pass
    fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

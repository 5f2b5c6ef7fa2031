#!/usr/bin/env python3
"""Loopback stand-in for a fleet of inference replicas (vLLM-like).

One process serves several ports, one per replica. Every request, on any
path and with any method, is answered 200 with a small JSON document that
says which replica served it and what it saw:

    {"served_by": "127.0.0.1:8002", "method": "POST", "path": "/v1/chat/completions",
     "request_bytes": 1234, "destination_header": "127.0.0.1:8002,127.0.0.1:8004",
     "model": "test-model", "model_served": true}

plus the response header ``x-served-by``. The whole request body is read
(Content-Length or chunked). ``model`` is the body's "model" field (null if
there is none); a request for a model the replica does not serve is still
answered 200 (this is a test double), with ``"model_served": false``, so tests
can check where each model's requests went. A request with
``x-upstream-delay-ms: N`` is held for N milliseconds before the answer
(capped at 60 s), which is how tests keep requests in flight. With
``x-upstream-body-delay-ms: N`` the response headers go out at once and the
body (chunked) in two chunks, N milliseconds later and 2N milliseconds
later, as vLLM streams: its headers before the prefill, the first chunk
with the first token, the rest as the answer is decoded.

Three paths are the engine's own, as a scraper sees them (vLLM's names):

- ``GET /health``: 200 when the replica is ready, 503 when not;
- ``GET /metrics``: Prometheus text with ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (series
  labelled ``model_name="<first model>"``), ``vllm:cache_config_info``
  (labels ``block_size``, ``num_gpu_blocks``) and, when the replica serves
  more than one model, the others as LoRA adapters in
  ``vllm:lora_requests_info{running_lora_adapters="a,b"}``;
- ``GET /_control``: the replica's state and request counts as JSON;
  ``POST /_control`` with a JSON object changes the state, e.g.
  ``{"ready": false}``, ``{"kv": 0.95, "waiting": 20}``,
  ``{"models": ["model-a"]}``, ``{"answer_status": 503}`` (inference
  requests are answered with that status, the same JSON body),
  ``{"reset_counts": true}``, ``{"prefix_cache": true}`` (answers carry
  OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``, below),
  ``{"flush_cache": true}`` (the replica forgets every prompt it saw),
  ``{"prefill_tokens_per_s": N}`` (with the prefix cache on, an answer
  waits its uncached tokens / N seconds before it is sent, as an engine's
  first token waits for the prefill; 0, the default, waits nothing).

The prefix cache, when on, is a model for kvroute's learning from answers:
a prompt is the request's messages as ``role\ncontent\n`` each (the
body itself for other requests), 4 bytes a token; the replica remembers the
last 256 prompts it answered, and a request's cached tokens are its longest
byte prefix shared with one of them, in whole blocks of 16 tokens (64
bytes), at most all tokens but one.

State (defaults): ready true, kv 0.0, waiting 0, running 0, models
["test-model"] (an empty list exports no model_name label), block_size 16,
num_gpu_blocks 8192. The figures are what the test sets, not measured.

Run standalone:   python tests/e2e/upstream.py --ports 8001,8002,8003,8004
Or import:        fleet = Fleet([8001, 8002]); fleet.start();
                  fleet.set_state(8001, ready=False); ...; fleet.stop()
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

HOST = "127.0.0.1"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DELAY_HEADER = "x-upstream-delay-ms"
BODY_DELAY_HEADER = "x-upstream-body-delay-ms"
MAX_DELAY_MS = 60_000
# Refuse absurd uploads rather than eat the test machine's memory.
MAX_BODY_BYTES = 256 * 1024 * 1024
# Bodies up to this size are kept and parsed for their "model" field.
MAX_PARSED_BODY_BYTES = 8 * 1024 * 1024
CONTROL_PATH = "/_control"
DEFAULT_MODEL = "test-model"

DEFAULT_STATE: dict[str, Any] = {
    "ready": True,
    "kv": 0.0,
    "waiting": 0,
    "running": 0,
    "models": [DEFAULT_MODEL],
    "block_size": 16,
    "num_gpu_blocks": 8192,
    # Status of the answers to inference requests (not /health, /metrics,
    # /_control): 200, or e.g. 503 for a replica that went bad.
    "answer_status": 200,
    # Answers carry usage with cached tokens from a modelled prefix cache.
    "prefix_cache": False,
    # With the prefix cache on: uncached tokens per second of the modelled
    # prefill before the answer (0: none).
    "prefill_tokens_per_s": 0,
}
# Prompts a replica remembers for its modelled prefix cache.
CACHE_PROMPTS = 256


class StateError(ValueError):
    pass


def validate_state_update(update: Any) -> dict[str, Any]:
    """A partial state from /_control, type-checked (a typo is an error, not ignored)."""
    if not isinstance(update, dict):
        raise StateError("expected a JSON object")
    out: dict[str, Any] = {}
    for key, value in update.items():
        if key in ("reset_counts", "flush_cache"):
            out[key] = bool(value)
        elif key in ("ready", "prefix_cache"):
            if not isinstance(value, bool):
                raise StateError(f"{key}: expected true or false")
            out[key] = value
        elif key == "kv":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise StateError("kv: expected a number from 0 to 1")
            out[key] = float(value)
        elif key in ("waiting", "running", "block_size", "num_gpu_blocks", "prefill_tokens_per_s"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateError(f"{key}: expected a non-negative integer")
            out[key] = value
        elif key == "answer_status":
            if isinstance(value, bool) or not isinstance(value, int) or not 200 <= value <= 599:
                raise StateError("answer_status: expected an HTTP status from 200 to 599")
            out[key] = value
        elif key == "models":
            if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
                raise StateError("models: expected a list of non-empty strings")
            out[key] = list(value)
        else:
            raise StateError(f"unknown field {key!r}")
    return out


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(state: dict[str, Any]) -> str:
    """vLLM-style Prometheus exposition text for one replica's state."""
    models = state["models"]
    labels = f'engine="0",model_name="{_label(models[0])}"' if models else 'engine="0"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(state['running'])}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(state['waiting'])}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{labels}}} {float(state['kv'])}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{labels}}} 0.0",
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="%d",cache_dtype="auto",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_cpu_blocks="0",num_gpu_blocks="%d"} 1.0'
        % (state["block_size"], state["num_gpu_blocks"]),
    ]
    if len(models) > 1:
        adapters = ",".join(_label(m) for m in models[1:])
        lines += [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="{len(models)}",running_lora_adapters="{adapters}",'
            f'waiting_lora_adapters=""}} {time.time():.3f}',
        ]
    return "\n".join(lines) + "\n"


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

    def _read_chunked(self) -> bytes:
        total = 0
        parts: list[bytes] = []
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
                        return b"".join(parts)
            total += size
            if total > MAX_BODY_BYTES:
                raise _BodyError("body too large")
            parts.append(self._read_exact(size))
            self._read_exact(2)  # CRLF after the chunk data

    def _read_body(self) -> bytes:
        encoding = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in encoding:
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if not length:
            return b""
        try:
            n = int(length)
        except ValueError as exc:
            raise _BodyError(f"bad Content-Length {length!r}") from exc
        if n < 0 or n > MAX_BODY_BYTES:
            raise _BodyError("bad Content-Length")
        return self._read_exact(n)

    # -- answering --------------------------------------------------------
    def _answer(self) -> None:
        try:
            body = self._read_body()
        except _BodyError as exc:
            self.close_connection = True
            self._send(400, {"error": str(exc), "served_by": self.server.replica})
            return
        route = self.path.split("?", 1)[0]
        if route == CONTROL_PATH:
            return self._control(body)
        if self.command == "GET" and route == "/health":
            ready = self.server.snapshot_state()["ready"]
            return self._send(200 if ready else 503, {"status": "ok" if ready else "not ready"})
        if self.command == "GET" and route == "/metrics":
            return self._send_text(200, render_metrics(self.server.snapshot_state()))

        model = request_model(body)
        self.server.begin_request(model)
        try:
            delay = self.headers.get(DELAY_HEADER)
            if delay:
                try:
                    time.sleep(min(max(int(delay), 0), MAX_DELAY_MS) / 1000.0)
                except ValueError:
                    pass
            state = self.server.snapshot_state()
            models = state["models"]
            dest_values = self.headers.get_all(DESTINATION_HEADER) or []
            doc = {
                "served_by": self.server.replica,
                "method": self.command,
                "path": self.path,
                "request_bytes": len(body),
                "destination_header": ",".join(dest_values) if dest_values else None,
                "model": model,
                "model_served": model is None or not models or model in models,
            }
            if state["prefix_cache"] and state["answer_status"] == 200:
                prompt, cached = self.server.prefill(prompt_bytes(body))
                rate = state["prefill_tokens_per_s"]
                if rate > 0:
                    time.sleep(min((prompt - cached) / rate, MAX_DELAY_MS / 1000.0))
                doc["usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": 1,
                    "total_tokens": prompt + 1,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
            body_delay = self.headers.get(BODY_DELAY_HEADER)
            if body_delay:
                self._send_late(state["answer_status"], doc, body_delay)
            else:
                self._send(state["answer_status"], doc)
        finally:
            self.server.end_request()

    def _control(self, body: bytes) -> None:
        if self.command == "POST":
            try:
                update = validate_state_update(json.loads(body or b"{}"))
            except (ValueError, StateError) as exc:
                return self._send(400, {"error": f"/_control: {exc}"})
            self.server.update_state(update)
        elif self.command != "GET":
            return self._send(405, {"error": "use GET or POST /_control"})
        self._send(200, self.server.info())

    def _send(self, status: int, doc: dict) -> None:
        self._send_bytes(status, json.dumps(doc).encode(), "application/json")

    def _send_late(self, status: int, doc: dict, delay_ms: str) -> None:
        """Headers now; the body's first chunk after delay_ms, the rest
        (and the end) after delay_ms more."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-served-by", self.server.replica)
        self.end_headers()
        self.wfile.flush()
        try:
            pause = min(max(int(delay_ms), 0), MAX_DELAY_MS) / 1000.0
        except ValueError:
            pause = 0.0
        payload = json.dumps(doc).encode()
        half = len(payload) // 2
        for i, part in enumerate((payload[:half], payload[half:])):
            time.sleep(pause)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) + (b"0\r\n\r\n" if i else b""))
            self.wfile.flush()

    def _send_text(self, status: int, text: str) -> None:
        self._send_bytes(status, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _send_bytes(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
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
        self._lock = threading.Lock()
        self._state = copy.deepcopy(DEFAULT_STATE)
        self._requests = 0
        self._by_model: Counter = Counter()
        self._inflight = 0
        self._prompts: list[bytes] = []

    # State and counts, shared by the handler threads.
    def snapshot_state(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._state)

    def update_state(self, update: dict[str, Any]) -> None:
        update = dict(update)
        with self._lock:
            if update.pop("reset_counts", False):
                self._requests = 0
                self._by_model.clear()
            if update.pop("flush_cache", False):
                self._prompts.clear()
            self._state.update(update)

    def prefill(self, prompt: bytes) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of a prompt, which is then remembered."""
        tokens = -(-len(prompt) // 4)
        with self._lock:
            shared = max((_common_prefix(prompt, p) for p in self._prompts), default=0)
            if prompt in self._prompts:
                self._prompts.remove(prompt)
            self._prompts.append(prompt)
            del self._prompts[:-CACHE_PROMPTS]
        cached = (shared // 64) * 16
        return tokens, max(0, min(cached, tokens - 1))

    def begin_request(self, model: str | None) -> None:
        with self._lock:
            self._requests += 1
            self._by_model[model if model is not None else ""] += 1
            self._inflight += 1

    def end_request(self) -> None:
        with self._lock:
            self._inflight -= 1

    def info(self) -> dict[str, Any]:
        """What GET /_control answers: state plus counts of non-engine requests."""
        with self._lock:
            return {
                "replica": self.replica,
                "state": copy.deepcopy(self._state),
                "requests": self._requests,
                "requests_by_model": dict(self._by_model),
                "inflight": self._inflight,
            }


def _common_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_bytes(body: bytes) -> bytes:
    """The prompt the modelled prefix cache sees: the messages as
    `role\ncontent\n` each, or the body when it has none."""
    try:
        doc = json.loads(body) if body and len(body) <= MAX_PARSED_BODY_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    messages = doc.get("messages") if isinstance(doc, dict) else None
    if not isinstance(messages, list):
        return body
    out = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            out.append(f"{m.get('role')}\n{content if isinstance(content, str) else json.dumps(content)}\n")
    return "".join(out).encode()


def request_model(body: bytes) -> str | None:
    """The "model" field of a JSON request body, if there is one."""
    if not body or len(body) > MAX_PARSED_BODY_BYTES or body.lstrip()[:1] != b"{":
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # hostile test bodies nest 100k deep
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else None


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

    def server(self, replica: int | str) -> ReplicaServer:
        """A replica by port or by "ip:port"."""
        for server in self.servers:
            if replica in (server.server_address[1], server.replica):
                return server
        raise KeyError(f"no replica {replica!r} in this fleet")

    def set_state(self, replica: int | str, **update: Any) -> None:
        """In-process equivalent of POST /_control."""
        self.server(replica).update_state(validate_state_update(update))

    def info(self, replica: int | str) -> dict[str, Any]:
        return self.server(replica).info()

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

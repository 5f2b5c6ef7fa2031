"""Helpers shared by the real-engine tests."""

from __future__ import annotations

import threading
import time

import httpx

import harness
from engines import MODEL_NAME, Engine
from harness import parse_prometheus

CHAT = "/v1/chat/completions"
# Scrape often; a CPU engine's /metrics can take longer than the default
# 200 ms per phase while it computes.
COLLECTOR_ARGS = ["--timeout", "2s"]
SCRAPE_MS = 250
WORDS = "the contion proment ver able ness ing tion per com ter ment".split()


def text(label: str, words: int) -> str:
    """Deterministic pseudo-English of `words` words, distinct per label."""
    h = sum(map(ord, label))
    return f"[{label}] " + " ".join(WORDS[(h + i * 7 + i // 3) % len(WORDS)] for i in range(words))


def body(messages: list[dict], max_tokens: int = 16) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


def host_of(reply) -> str:
    return reply.decision.get("host", "")


def cached_tokens(reply) -> int:
    usage = (reply.body or {}).get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def engine_counter(engine: Engine, name: str) -> float:
    m = parse_prometheus(engine.metrics_text())
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def wait_for(cond, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def engine_gauge(engine: Engine, name: str) -> float:
    m = parse_prometheus(engine.metrics_text())
    vals = [v for k, v in m.items() if k.split("{")[0] == name]
    return max(vals) if vals else 0.0


def flood(engine: Engine, stop: threading.Event, n: int = 6, max_tokens: int = 1400,
          words: int = 300) -> list[threading.Thread]:
    """Keep `n` long-generating requests running on one replica, sent to it
    directly (not through the gateway), until `stop` is set."""
    def one(i: int):
        msgs = [{"role": "user", "content": text(f"flood {i}", words)}]
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                try:
                    c.post(f"{engine.url}{CHAT}", json=body(msgs, max_tokens=max_tokens))
                except httpx.HTTPError:
                    time.sleep(0.2)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def gateway_for(request, engines) -> harness.Stack:
    """Envoy + kvroute in front of `engines`, with a collector scraping
    them every SCRAPE_MS; returns once the gateway holds a snapshot of
    them all. Stopped when the module ends."""
    stack = harness.Stack(external_replicas=[e.port for e in engines], concurrency=1).start()
    request.addfinalizer(stack.stop)
    stack.start_collector(interval_ms=SCRAPE_MS, extra_args=COLLECTOR_ARGS)
    wait_for(
        lambda: stack.envoy.kvroute_metrics(settle=0).get("kvroute_fleet_hosts") == len(engines),
        30, "a snapshot of every replica at the gateway",
    )
    return stack

"""Helpers shared by the real-engine tests."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter

import httpx

import harness
from engines import MODEL_NAME, Engine
from harness import parse_prometheus, send, wait_for

CHAT = "/v1/chat/completions"
# Scrape often; a CPU engine's /metrics can take longer than the default
# 200 ms per phase while it computes (a flooded vLLM CPU replica on 2
# shared cores), so the collector waits up to 5 s and the gateway keeps a
# replica's data for 15 s before judging it stale: with the defaults a
# flooded replica's data went stale and, judged on the gateway's own
# figures, it took new conversations (a fresh-clone CI run).
COLLECTOR_ARGS = ["--timeout", "5s"]
PLUGIN_OVERRIDES = {"fleet": {"staleAfterMs": 15_000}}
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
    stack = harness.Stack(
        external_replicas=[e.port for e in engines], concurrency=1, plugin_overrides=PLUGIN_OVERRIDES,
    ).start()
    request.addfinalizer(stack.stop)
    stack.start_collector(interval_ms=SCRAPE_MS, extra_args=COLLECTOR_ARGS)
    wait_for(
        lambda: stack.envoy.kvroute_metrics(settle=0).get("kvroute_fleet_hosts") == len(engines),
        30, "a snapshot of every replica at the gateway",
    )
    return stack


def collector_once(binary, engines) -> dict[str, dict]:
    """`kvroute-collector --once` against `engines`: the snapshot's hosts
    by address (checked to be exactly the engines)."""
    out = subprocess.run(
        [str(binary), "--once", "--engines", ",".join(e.address for e in engines),
         "--metrics-addr", "off", *COLLECTOR_ARGS],
        capture_output=True, text=True, timeout=60, check=True,
    )
    snap = json.loads(out.stdout)
    hosts = {h["address"]: h for h in snap["hosts"]}
    assert set(hosts) == {e.address for e in engines}, snap
    return hosts


def ask(gateway: harness.Stack, session: str, label: str, words: int = 20, max_tokens: int = 4):
    """One new conversation's first turn through the gateway; HTTP 200."""
    r = send(gateway.gateway_url, CHAT, json_body=body([{"role": "user", "content": text(label, words)}], max_tokens),
             session=session, timeout=60)
    assert r.status == 200, r.describe()
    return r


def homed_on(gateway: harness.Stack, engine: Engine, prefix: str, probes: int = 40, least: int = 1) -> list[str]:
    """Sessions (`prefix-0` ...) whose first turn the gateway sends to
    `engine` while the fleet is idle: their home. At least `least`."""
    home = [f"{prefix}-{i}" for i in range(probes)
            if host_of(ask(gateway, f"{prefix}-{i}", f"probe {prefix} {i}")) == engine.address]
    assert len(home) >= least, f"only {len(home)} of {probes} sessions homed on {engine.address}"
    return home


def placement(gateway: harness.Stack, sessions: list[str], label: str) -> Counter:
    """Where a new conversation of each session starts: decided host counts."""
    return Counter(host_of(ask(gateway, s, f"{label} {s}")) for s in sessions)


def converse(gateway: harness.Stack, session: str, label: str, turns: int, system_words: int = 300):
    """A conversation of `turns` turns through the gateway under one session
    key, each answer appended to the history: (decided host, cached tokens)
    per turn. Every turn is HTTP 200 with reason `session`."""
    messages = [{"role": "system", "content": text(f"{label} system", system_words)}]
    hosts, cached = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": text(f"{label} q{turn}", 60)})
        r = send(gateway.gateway_url, CHAT, json_body=body(messages), session=session, timeout=60)
        assert r.status == 200, r.describe()
        assert r.reason == "session", r.describe()
        hosts.append(host_of(r))
        cached.append(cached_tokens(r))
        messages.append({"role": "assistant", "content": r.body["choices"][0]["message"]["content"]})
    return hosts, cached

"""kvroute in front of two real llama.cpp servers (llama-server, the tiny
model as GGUF, 4 slots each): the collector reads their metrics as the
`llamacpp` engine family, a conversation stays on one server and its
answers report the prompt cache, and a server whose slots are all busy
(requests deferred) loses new conversations to the other. Behaviour only,
no timings.

llama-server exports no KV gauge or capacity (crates/kvroute-collector/
src/engines.rs says what stands in for them).
"""

from __future__ import annotations

import threading
import time

import pytest

from helpers import (
    SCRAPE_MS, collector_once, converse, engine_counter, engine_gauge, flood, gateway_for, homed_on, placement,
    wait_for,
)


@pytest.fixture(scope="module")
def gateway(request, llama_fleet, wasm_path, collector_binary):
    return gateway_for(request, llama_fleet)


def test_the_collector_reads_real_llama_pages(llama_fleet, collector_binary):
    hosts = collector_once(collector_binary, llama_fleet)
    for e in llama_fleet:
        h = hosts[e.address]
        assert h["engine"] == "llamacpp", h
        assert h["ready"] is True, h
        assert h["waiting"] == 0 and h["running"] == 0, h
        # Not exported by llama-server: no capacity, no model list.
        assert "kvCapacityTokens" not in h, h
        assert h.get("models", []) == [], h


def test_a_conversation_stays_on_its_server_and_hits_its_cache(gateway, llama_fleet):
    by_address = {e.address: e for e in llama_fleet}
    before = {a: engine_counter(e, "llamacpp:prompt_tokens_cached_total") for a, e in by_address.items()}
    hosts, cached = converse(gateway, "llama-conv", "llama", 5)
    assert len(set(hosts)) == 1, hosts
    home = hosts[0]
    assert all(c > 0 for c in cached[1:]), cached
    assert cached == sorted(cached), cached
    grew = {a: engine_counter(e, "llamacpp:prompt_tokens_cached_total") - before[a] for a, e in by_address.items()}
    assert grew[home] >= sum(cached[1:]), (grew, cached)
    assert all(grew[a] == 0 for a in by_address if a != home), grew
    print(f"\n[llama] one conversation on {home}: cached tokens per turn {cached}; server cache counters grew {grew}")


def test_busy_slots_move_new_conversations_away(gateway, llama_fleet):
    """Eight long requests sent straight to one server (4 slots): 4 are
    deferred, the snapshot's waiting figure, and new conversations whose
    home it is start on the other server."""
    a, b = llama_fleet
    homed_on_a = homed_on(gateway, a, "llama-new", least=5)
    stop = threading.Event()
    threads = flood(a, stop, n=8, max_tokens=3500)
    try:
        wait_for(lambda: engine_gauge(a, "llamacpp:requests_deferred") >= 1, 60, f"{a.address} deferring requests")
        time.sleep(2 * SCRAPE_MS / 1000 + 0.5)
        placed = placement(gateway, homed_on_a[:10], "fresh")
        deferred = engine_gauge(a, "llamacpp:requests_deferred")
        print(f"\n[llama] {a.address} busy ({deferred:.0f} deferred): new conversations homed there went to {dict(placed)}")
        assert placed[a.address] == 0, placed
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)

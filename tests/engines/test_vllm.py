"""kvroute in front of two real vLLM replicas (the CPU build, the tiny
model): the collector reads their real metrics pages, conversations stay
on one replica and hit its prefix cache, KV pressure moves new
conversations away, and a killed replica is avoided and used again after
its restart. Behaviour only, no timings.

Each replica has 256 KV blocks of 32 tokens (8192 tokens), so a few long
requests fill it. The tiny model's text is noise; requests ask for
`max_tokens` with `ignore_eos`.
"""

from __future__ import annotations

import threading
import time

import pytest

from engines import MODEL_NAME

from helpers import (
    SCRAPE_MS, ask, collector_once, converse, engine_counter, engine_gauge, flood, gateway_for, homed_on, host_of,
    placement, wait_for,
)


@pytest.fixture(scope="module")
def gateway(request, vllm_fleet, wasm_path, collector_binary):
    return gateway_for(request, vllm_fleet)


def test_the_collector_reads_real_vllm_pages(vllm_fleet, collector_binary):
    """`kvroute-collector --once` against the live engines: the engine
    family, readiness, the served model and the KV capacity
    (`vllm:cache_config_info`: 256 blocks x 32 tokens)."""
    hosts = collector_once(collector_binary, vllm_fleet)
    for e in vllm_fleet:
        h = hosts[e.address]
        assert h["engine"] == "vllm", h
        assert h["ready"] is True, h
        assert h["models"] == [MODEL_NAME], h
        assert h["kvCapacityTokens"] == e.kv_blocks * e.block_size, h
        assert h["blockSize"] == e.block_size, h
        assert 0.0 <= h["kvUtilization"] <= 1.0, h


def test_a_conversation_stays_on_its_replica_and_hits_its_cache(gateway, vllm_fleet):
    """Six turns of one session through the gateway: every turn on one
    replica; from the second turn on, the answers report cached tokens, and
    only that replica's `vllm:prefix_cache_hits_total` grows."""
    by_address = {e.address: e for e in vllm_fleet}
    hits_before = {a: engine_counter(e, "vllm:prefix_cache_hits_total") for a, e in by_address.items()}
    hosts, cached = converse(gateway, "conv-sticky", "vllm", 6)
    assert len(set(hosts)) == 1, hosts
    home = hosts[0]
    assert cached[0] == 0 or cached[0] < cached[1], cached
    assert all(c > 0 for c in cached[1:]), cached
    assert cached == sorted(cached), f"cached tokens grow with the conversation: {cached}"
    grew = {a: engine_counter(e, "vllm:prefix_cache_hits_total") - hits_before[a] for a, e in by_address.items()}
    assert grew[home] >= sum(cached[1:]) * 0.9, (grew, cached)
    others = [a for a in by_address if a != home]
    assert all(grew[a] == 0 for a in others), grew
    print(f"\n[vllm] one conversation on {home}: cached tokens per turn {cached}; engine hits grew {grew}")


def test_expected_and_cached_tokens_agree_with_vllm(gateway, vllm_fleet):
    """Learning from answers against a real engine: the gateway's
    per-replica `kvroute_prefix_expected_tokens_total` (what its prefix
    index counted on, scaled into the engine's tokens) and
    `kvroute_prefix_cached_tokens_total` (what vLLM's answers reported):
    the engine delivered at least what the index counted on, no answer
    fell short and no entry was dropped. vLLM may deliver more: it also
    caches the tokens it generated, which the next turn sends back and the
    gateway's index never saw sent."""
    m0 = gateway.envoy.kvroute_metrics()
    converse(gateway, "conv-precision", "precision", 5, system_words=400)
    m1 = gateway.envoy.kvroute_metrics()

    def grew(name):
        return sum(v for k, v in m1.items() if k.startswith(name + "{")) - sum(
            v for k, v in m0.items() if k.startswith(name + "{"))

    answers = m1.get("kvroute_prefix_answers_total", 0) - m0.get("kvroute_prefix_answers_total", 0)
    expected = grew("kvroute_prefix_expected_tokens_total")
    cached = grew("kvroute_prefix_cached_tokens_total")
    print(f"\n[vllm] answers compared {answers:.0f}: expected {expected:.0f} tokens, vLLM reported {cached:.0f}")
    assert answers >= 3, (m0, m1)
    assert expected > 0 and cached > 0, (expected, cached)
    assert cached >= 0.9 * expected, (expected, cached)
    shortfalls = m1.get("kvroute_prefix_shortfalls_total", 0) - m0.get("kvroute_prefix_shortfalls_total", 0)
    assert shortfalls == 0, shortfalls
    dropped = m1.get("kvroute_prefix_entries_dropped_total", 0) - m0.get("kvroute_prefix_entries_dropped_total", 0)
    assert dropped == 0, dropped


def test_kv_pressure_moves_new_conversations_away(gateway, vllm_fleet):
    """Flood one replica (sent to it directly) until its KV is nearly full
    and requests wait for memory: new conversations then all start on the
    other replica, including those whose home it is on the idle fleet."""
    a, b = vllm_fleet
    homed_on_a = homed_on(gateway, a, "new", least=5)
    stop = threading.Event()
    # Ten requests of about 2k prompt tokens, each growing to 3.5k: more
    # than the 8192-token cache holds at every moment, so KV stays near
    # full and requests wait for memory (`vllm:num_requests_waiting`) for
    # as long as the flood lasts, not only when the batch peaks.
    threads = flood(a, stop, n=10, max_tokens=1500, words=1500)
    try:
        peak = wait_for(lambda: (kv := engine_gauge(a, "vllm:kv_cache_usage_perc")) >= 0.9 and kv, 120,
                        f"{a.address} KV past 0.9")
        wait_for(lambda: engine_gauge(a, "vllm:num_requests_waiting") >= 1, 60, f"{a.address} requests waiting")
        time.sleep(2 * SCRAPE_MS / 1000 + 0.5)
        placed = placement(gateway, homed_on_a[:10], "fresh")
        kv = engine_gauge(a, "vllm:kv_cache_usage_perc")
        waiting = engine_gauge(a, "vllm:num_requests_waiting")
        print(f"\n[vllm] {a.address} flooded (KV reached {peak:.2f}; {kv:.2f} and {waiting:.0f} waiting at the end): "
              f"new conversations homed there went to {dict(placed)}")
        assert placed[a.address] == 0, placed
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)


def test_a_killed_replica_is_avoided_then_used_again(gateway, vllm_fleet):
    """SIGKILL one replica's process group: within a few scrape intervals
    every request goes to the other and succeeds; after a restart on the
    same port (40-110 s), the collector sees it ready and its sessions
    return to it."""
    a, b = vllm_fleet
    sessions = homed_on(gateway, a, "kill")
    a.kill()
    time.sleep(4 * SCRAPE_MS / 1000)
    served = placement(gateway, sessions[:8], "after")
    assert served == {b.address: min(8, len(sessions))}, served
    a.spawn()
    took = a.wait_healthy()
    wait_for(lambda: host_of(ask(gateway, sessions[0], f"back {sessions[0]}")) == a.address,
             30, f"{sessions[0]} back on {a.address}")
    print(f"\n[vllm] killed {a.address}: its sessions went to {dict(served)}; restarted healthy after {took:.0f} s and used again")

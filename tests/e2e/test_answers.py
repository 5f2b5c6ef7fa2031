"""Learning from answers through a real Envoy 1.40: the cached tokens an
engine reports against the prefix hit the gateway's index expected.

A module stack of 4 loopback replicas (tests/e2e/upstream.py) with their
modelled prefix cache on: each answer carries OpenAI `usage` with
`prompt_tokens_details.cached_tokens` (the longest prefix the replica saw
before, in whole 16-token blocks). Snapshots are pushed from Python, so the
filter routes on fleet state and keeps its prefix index.

What is shown: the per-replica counters `kvroute_prefix_expected_tokens_total`
and `kvroute_prefix_cached_tokens_total` move with an answer the index
expected a hit for; and after a replica's cache is flushed, the first answer
that falls short drops that replica's index entries, so the prefix stops
attracting requests to it (the next one goes to the other replica the index
knows holds the prompt, and finds it cached there).
"""

from __future__ import annotations

import time

import pytest

import harness
from conftest import ask_chat as ask
from conftest import start_answers_stack
from harness import chat_body, filler



def series(metrics: dict[str, float], name: str, replica: str) -> float:
    """One replica's series of a per-replica counter (the `replica` label,
    extracted by envoy.yaml's stats_tags from the metric's name)."""
    label = replica.replace(".", "_").replace(":", "_")
    return metrics.get(f'{name}{{replica="{label}"}}', 0.0)


@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_answers_stack(request)



def expected_cached(r: harness.Reply) -> int:
    return int(r.decision.get("expected_cached", "-1"))


def test_counters_move_and_an_evicted_prefix_stops_attracting(stack):
    # A prompt of 8 KB (about 2k tokens, 32 index blocks), no session: the
    # prefix key and the index decide.
    body = chat_body(system=filler("answers-sys", 6000), user_text=filler("answers-q", 2000))
    assert stack.push_fleet().status == 204
    # The key's home: where the prompt goes with an empty index.
    home = ask(stack, body).served_by
    assert expected_cached(ask(stack, body)) > 0, "the index saw the first send"
    # Place the prompt on a second replica R too, by taking the home out for
    # one request: the index then names both (it keeps several replicas per
    # block, and a request placed by its prefix counts them all).
    down = {home: {"ready": False}}
    assert stack.push_fleet(overrides=down).status == 204
    r = ask(stack, body)
    second = r.served_by
    assert second != home, r.describe()
    assert stack.push_fleet().status == 204

    before = stack.envoy.kvroute_metrics()
    # The index attracts the prompt to one of the two (X, the first of
    # equals in the key's order), which reports it cached.
    r = ask(stack, body)
    replica = r.served_by
    assert replica in (home, second), r.describe()
    other = second if replica == home else home
    want = expected_cached(r)
    assert want > 1500, r.describe()
    cached = r.body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, r.body
    after = stack.envoy.kvroute_metrics()
    grew = {
        n: series(after, n, replica) - series(before, n, replica)
        for n in ("kvroute_prefix_expected_tokens_total", "kvroute_prefix_cached_tokens_total")
    }
    print(f"\nanswer from {replica}: expected {want} (gateway tokens), engine cached {cached}; counters grew {grew}")
    assert grew["kvroute_prefix_cached_tokens_total"] == cached, (grew, after)
    # Expected is scaled into the engine's tokens by its prompt_tokens.
    assert grew["kvroute_prefix_expected_tokens_total"] > 0, (grew, after)
    assert after.get("kvroute_prefix_shortfalls_total", 0) == before.get("kvroute_prefix_shortfalls_total", 0)

    # X loses its cache. The index still expects the prompt there ...
    stack.replica_control(replica, flush_cache=True)
    # (A shortfall only removes entries older than answers::SETTLE_MS, 2 s,
    # at the decision: a younger send may still be in its prefill.)
    time.sleep(2.2)
    r = ask(stack, body)
    assert r.served_by == replica and expected_cached(r) > 1500, r.describe()
    assert r.body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.body
    # ... and the answer says nothing was: X's entries are dropped.
    m = stack.envoy.kvroute_metrics()
    dropped = m.get("kvroute_prefix_entries_dropped_total", 0) - before.get("kvroute_prefix_entries_dropped_total", 0)
    shortfalls = m.get("kvroute_prefix_shortfalls_total", 0) - before.get("kvroute_prefix_shortfalls_total", 0)
    print(f"after the flush: {shortfalls:.0f} shortfall, {dropped:.0f} index entries dropped")
    assert shortfalls == 1, m
    assert dropped >= 1, m
    # The prefix no longer attracts requests to X: the next one goes to the
    # other replica that holds it, which the index still names and which
    # reports it cached.
    r = ask(stack, body)
    assert r.served_by == other, r.describe()
    assert expected_cached(r) > 1500, r.describe()
    assert r.body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r.body


def test_answers_without_a_cached_figure_teach_nothing(stack):
    body = chat_body(system=filler("answers-plain", 6000), user_text="q")
    assert stack.push_fleet().status == 204
    for h in stack.live_hosts:
        stack.replica_control(h, prefix_cache=False)
    try:
        before = stack.envoy.kvroute_metrics()
        ask(stack, body)
        r = ask(stack, body)
        assert expected_cached(r) > 0 and "usage" not in r.body, r.describe()
        after = stack.envoy.kvroute_metrics()
        assert after.get("kvroute_prefix_answers_total", 0) == before.get("kvroute_prefix_answers_total", 0)
    finally:
        for h in stack.live_hosts:
            stack.replica_control(h, prefix_cache=True)


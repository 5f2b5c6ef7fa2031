"""Prefill rates learned from answers (kvroute_core::rates) through a real
Envoy 1.40.

A stack of its own (a fresh Envoy, so that no earlier answers are in the
gateway's learned rates) with 4 loopback replicas (tests/e2e/upstream.py)
whose modelled prefix cache is on: each answer carries OpenAI `usage` with
`cached_tokens`, and waits its uncached tokens / `prefill_tokens_per_s`
before it is sent, as an engine's first token waits for the prefill. One
replica answers at a tenth of the others' rate. Snapshots are pushed from
Python.

What is shown: answers to requests with nothing queued ahead are counted
as samples (`kvroute_prefill_rate_samples_total`); once the slow replica
and two others have answered enough of them and the next snapshot is
decoded, a cold prompt whose home is the slow replica goes to a faster one,
and the per-replica gauge `kvroute_prefill_rate_tokens_per_s` shows the
slow replica's lower rate.
"""

from __future__ import annotations

import pytest

import harness
from conftest import ask_chat as ask
from conftest import start_answers_stack
from harness import chat_body, filler



@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_answers_stack(request)



def label(replica: str) -> str:
    """A replica's `replica` label (envoy.yaml's stats_tags)."""
    return replica.replace(".", "_").replace(":", "_")


def samples(stack: harness.Stack) -> float:
    return stack.envoy.kvroute_metrics().get("kvroute_prefill_rate_samples_total", 0)


def test_a_replica_whose_answers_show_a_slow_prefill_stops_getting_cold_prompts(stack):
    assert stack.push_fleet().status == 204
    slow = stack.live_hosts[0]
    for h in stack.live_hosts:
        # A tenth of the others' rate: 2.5k tokens take 500 ms against 50
        # ms (long beside the few ms of loopback HTTP, which the samples
        # count too).
        stack.replica_control(h, prefill_tokens_per_s=5_000 if h == slow else 50_000)
    # Cold prompts of about 2.5k tokens, one at a time (nothing pending
    # ahead of any), until the slow replica and two others have answered
    # enough of them (rates::MIN_SAMPLES is 5; the reference is the second
    # fastest replica). Each prompt's key has a home; at equal rates about
    # a quarter of them are the slow one's.
    before = samples(stack)
    served: dict[str, int] = {}
    for i in range(200):
        r = ask(stack, chat_body(user_text=filler(f"rate-learn-{i}", 10_000)))
        served[r.served_by] = served.get(r.served_by, 0) + 1
        fast = sorted((n for h, n in served.items() if h != slow), reverse=True)
        if served.get(slow, 0) >= 7 and len(fast) >= 2 and fast[1] >= 7:
            break
    print(f"\nlearning (slow: {slow}): served {served}")
    assert served.get(slow, 0) >= 7, served
    learned = samples(stack) - before
    assert learned >= sum(served.values()) - 2, (learned, served)
    # The learned rates are applied when the next snapshot is decoded.
    assert stack.push_fleet().status == 204
    moved: dict[str, int] = {}
    for i in range(40):
        r = ask(stack, chat_body(user_text=filler(f"rate-after-{i}", 10_000)))
        moved[r.served_by] = moved.get(r.served_by, 0) + 1
    print(f"after: served {moved}")
    # Without the learned rate, about 10 of 40 would have gone to the slow
    # replica (the chance of none is 0.75^40, 1e-5); the fast ones still
    # share the rest.
    assert moved.get(slow, 0) == 0, moved
    assert len(moved) >= 2, moved
    # Operators see it: the rate the cost uses, per replica (a gauge set
    # when a snapshot is decoded), is the configured 30k tokens/s on the
    # fast replicas and about a tenth of it on the slow one.
    metrics = stack.envoy.kvroute_metrics()
    rate = {h: metrics.get(f'kvroute_prefill_rate_tokens_per_s{{replica="{label(h)}"}}')
            for h in stack.live_hosts}
    print(f"priced rates: {rate}")
    assert rate[slow] is not None and rate[slow] < 30_000 / 2, rate
    assert all(rate[h] == 30_000 for h in stack.live_hosts if h != slow), rate
    # A short prompt is no sample.
    m0 = samples(stack)
    ask(stack, chat_body(user_text=filler("rate-short", 800)))
    assert samples(stack) == m0

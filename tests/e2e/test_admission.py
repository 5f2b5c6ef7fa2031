"""Admission control through a real Envoy 1.40: priorities, shedding, and
held requests (kvroute_core::admit, src/lib.rs).

One stack for the module: 2 loopback replicas behind Envoy with ONE worker
(`--concurrency 1`: the queue is per worker, and the bound tests count on
one queue), objectives `premium` (priority 10) and `batch` (-1, sheddable),
a queue of 4 with at most 2 per session, held requests answered after 4 s.
Snapshots are pushed from Python and stay fresh for a minute: a saturated
one says every replica has 100 requests waiting (about 102k tokens of
prefill pending, over the 1 s bound at 30k tokens/s), a free one none.

Behaviour only, no timings: the waits below are bounds on how long the
gateway may take, not measurements.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from conftest import start_module_stack
from harness import chat_body, send, wait_for

CHAT = "/v1/chat/completions"
TOKEN = "e2e-admission-token-0123456789abcdef"
OBJECTIVE = "x-gateway-inference-objective"
MAX_WAIT_MS = 4000
QUEUED = "kvroute_admission_queued_requests"


@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_module_stack(
        request, replicas=2, concurrency=1, ingest_token=TOKEN,
        plugin_overrides={
            "fleet": {"staleAfterMs": 60_000},
            "objectives": {"premium": {"priority": 10}, "batch": {"priority": -1}},
            "admission": {"enabled": True, "maxQueue": 4, "maxQueuedPerKey": 2,
                          "maxWaitMs": MAX_WAIT_MS, "retryAfterS": 2},
        },
    )


def saturate(stack: harness.Stack) -> None:
    r = stack.push_fleet(models=MODELS, waiting=100)
    assert r.status == 204, r


MODELS = ["test-model", "model-a", "model-b"]


def free(stack: harness.Stack) -> None:
    r = stack.push_fleet(models=MODELS, waiting=0)
    assert r.status == 204, r


@pytest.fixture
def fresh(stack) -> harness.Stack:
    """A free fleet and an empty queue before and after each test."""
    free(stack)
    wait_for(lambda: held(stack) == 0, 10, "an empty queue")
    yield stack
    free(stack)
    wait_for(lambda: held(stack) == 0, 10, "an empty queue")


def ask(stack: harness.Stack, session: str | None, objective: str | None = None, text: str = "hello",
        timeout: float = 15.0, model: str = "test-model") -> harness.Reply:
    headers = {OBJECTIVE: objective} if objective is not None else {}
    return send(stack.gateway_url, CHAT, json_body=chat_body(user_text=text, model=model), session=session,
                headers=headers, fresh_connection=True, timeout=timeout)


def held(stack: harness.Stack) -> float:
    m = harness.parse_prometheus(stack.envoy.prometheus(), prefix="kvroute")
    return m.get(QUEUED, 0.0)


def counter(stack: harness.Stack, name: str, objective: str) -> float:
    return stack.envoy.kvroute_metrics().get(f'kvroute_admission_{name}_total{{objective="{objective}"}}', 0.0)


def served(r: harness.Reply, stack: harness.Stack) -> None:
    assert r.status == 200, r.describe()
    assert r.served_by in stack.live_hosts and r.served_by == r.decided_host, r.describe()


def refused(r: harness.Reply, status: int, kind: str, objective: str) -> dict:
    assert r.status == status, r.describe()
    assert r.served_by is None, r.describe()
    assert r.headers.get("retry-after") == "2", r.describe()
    assert r.headers.get("content-type") == "application/json", r.describe()
    err = (r.body or {}).get("error", {})
    assert err.get("type") == kind and err.get("objective") == objective, r.describe()
    assert "kvroute:" in err.get("message", ""), r.describe()
    return err


def test_a_free_fleet_admits_every_objective(fresh):
    stack = fresh
    before = counter(stack, "admitted", "batch")
    for objective in (None, "premium", "batch", "gold"):
        served(ask(stack, f"free-{objective}", objective), stack)
    assert counter(stack, "admitted", "batch") == before + 1


def test_sheddable_request_gets_429_with_retry_after(fresh):
    stack = fresh
    saturate(stack)
    before = counter(stack, "shed", "batch")
    r = ask(stack, "shed-1", "batch")
    refused(r, 429, "saturated", "batch")
    assert counter(stack, "shed", "batch") == before + 1
    free(stack)
    served(ask(stack, "shed-1", "batch"), stack)


def test_held_requests_complete_once_a_snapshot_frees_a_replica(fresh):
    """Default, unknown ("gold": the default) and premium requests wait
    while every replica is saturated, and all complete after a free
    snapshot."""
    stack = fresh
    saturate(stack)
    before = {o: counter(stack, "queued", o) for o in ("default", "premium")}
    with ThreadPoolExecutor(3) as ex:
        futures = []
        for i, objective in enumerate((None, "gold", "premium")):
            futures.append(ex.submit(ask, stack, f"held-{i}", objective))
            wait_for(lambda n=i + 1: held(stack) == n, 5, f"{i + 1} held")
        time.sleep(0.5)
        assert not any(f.done() for f in futures), [f.result().describe() for f in futures if f.done()]
        free(stack)
        replies = [f.result(timeout=10) for f in futures]
    for r in replies:
        served(r, stack)
    assert counter(stack, "queued", "default") == before["default"] + 2
    assert counter(stack, "queued", "premium") == before["premium"] + 1
    wait_for(lambda: held(stack) == 0, 5, "an empty queue")
    # Envoy merges histograms on its stats flush (every 5 s by default).
    def waits():
        m = harness.parse_prometheus(stack.envoy.prometheus(), prefix="kvroute_admission_wait_ms")
        return m.get("kvroute_admission_wait_ms_count", 0) >= 3
    wait_for(waits, 12, "three waits in kvroute_admission_wait_ms")


def test_queue_bounds_answer_as_configured(fresh):
    """Per session 2, in all 4; a premium arrival displaces the default
    request that would leave last (k1's second: fair queueing puts a
    session's second request behind the others' first); what is left gets
    its 503 after maxWaitMs."""
    stack = fresh
    saturate(stack)
    with ThreadPoolExecutor(6) as ex:
        def hold(session, objective=None):
            n = held(stack)
            f = ex.submit(ask, stack, session, objective)
            wait_for(lambda: held(stack) == n + 1, 5, f"{session} held")
            return f

        k1 = [hold("k1"), hold("k1")]
        refused(ask(stack, "k1"), 503, "key_queue_full", "default")
        others = [hold("k2"), hold("k3")]
        refused(ask(stack, "k4"), 503, "queue_full", "default")
        # Full of default requests: a premium one takes the place of the
        # one that would leave last.
        premium = ex.submit(ask, stack, "p1", "premium")
        refused(k1[1].result(timeout=5), 503, "displaced", "default")
        wait_for(lambda: held(stack) == 4, 5, "the premium request held")
        started = time.monotonic()
        late = [f.result(timeout=MAX_WAIT_MS / 1000 + 5) for f in (k1[0], others[0], others[1], premium)]
    for r in late[:3]:
        refused(r, 503, "queue_timeout", "default")
    refused(late[3], 503, "queue_timeout", "premium")
    assert time.monotonic() - started < MAX_WAIT_MS / 1000 + 5
    wait_for(lambda: held(stack) == 0, 5, "an empty queue")


def test_a_client_that_disconnects_leaves_the_queue(fresh):
    stack = fresh
    saturate(stack)
    before = counter(stack, "abandoned", "default")
    body = json.dumps(chat_body(user_text="leaving")).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"x-session-id: leaver\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((harness.LOCALHOST, stack.gateway_port), timeout=10) as s:
        s.sendall(head + body)
        wait_for(lambda: held(stack) == 1, 5, "the request held")
    wait_for(lambda: held(stack) == 0, 5, "the queue emptied by the disconnect")
    assert counter(stack, "abandoned", "default") == before + 1
    # The place is free: four more can be held, and a free fleet serves them.
    with ThreadPoolExecutor(4) as ex:
        futures = []
        for i in range(4):
            futures.append(ex.submit(ask, stack, f"after-leave-{i}"))
            wait_for(lambda n=i + 1: held(stack) == n, 5, f"{i + 1} held")
        free(stack)
        for f in futures:
            served(f.result(timeout=10), stack)


@pytest.mark.parametrize("value", [b"\xff\xfe\x80", b"premium" * 2000, b"", b"PREMIUM"],
                         ids=["non-utf8", "huge", "empty", "wrong-case"])
def test_malformed_objectives_are_the_default(fresh, value):
    """A header kvroute cannot match is the default objective: held (not
    shed) while saturated, then served."""
    stack = fresh
    saturate(stack)
    body = json.dumps(chat_body(user_text="odd objective")).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            f"x-session-id: odd\r\ncontent-length: {len(body)}\r\n").encode()
    head += OBJECTIVE.encode() + b": " + value + b"\r\n\r\n"
    with socket.create_connection((harness.LOCALHOST, stack.gateway_port), timeout=10) as s:
        s.sendall(head + body)
        wait_for(lambda: held(stack) == 1, 5, "the request held")
        free(stack)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    assert status == 200, data[:400]


def test_one_saturated_model_does_not_hold_another(fresh):
    """Replica 1 serves model-a and is saturated, replica 2 serves model-b
    and is idle: model-a requests are held, model-b requests (any
    objective, sheddable too) go on to replica 2 meanwhile."""
    stack = fresh
    a, b = stack.live_hosts
    r = stack.push_fleet({a: {"models": ["model-a"], "waiting": 100}, b: {"models": ["model-b"]}})
    assert r.status == 204, r
    with ThreadPoolExecutor(1) as ex:
        held_a = ex.submit(ask, stack, "model-a-1", None, "for a", 15.0, "model-a")
        wait_for(lambda: held(stack) == 1, 5, "the model-a request held")
        for objective in (None, "batch", "premium"):
            rb = ask(stack, f"model-b-{objective}", objective, model="model-b")
            served(rb, stack)
            assert rb.served_by == b, rb.describe()
        assert not held_a.done()
        free(stack)
        served(held_a.result(timeout=10), stack)

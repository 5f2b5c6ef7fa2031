"""Fleet state through a real Envoy 1.40: the ingest listener, and routing on
what the snapshots say.

Each module-level stack is 4 loopback replicas (tests/e2e/upstream.py) behind
Envoy with two kvroute plugins of one module and one vm_id: the router on the
gateway listener and the ingest role on a loopback listener of its own, as in
envoy-config/envoy.yaml. The filter-side tests push snapshots from Python
(harness.make_snapshot / Stack.push_fleet); the collector tests at the end run
the real kvroute-collector against the replicas' /metrics and /health.

Figures (ingest-to-first-use latency, unready-avoidance latency, snapshot
sizes) are printed: run with -s to see them.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from conftest import start_module_stack
from harness import chat_body, filler, host_state, make_snapshot, send

CHAT = "/v1/chat/completions"
TOKEN = "e2e-ingest-token-0123456789abcdef"
# Small enough to send an oversized push cheaply, big enough for 4096 hosts.
INGEST_MAX = 1 << 20


# ------------------------------------------------------------------ helpers


def metric(stack: harness.Stack, name: str) -> float:
    return stack.envoy.kvroute_metrics().get(name, 0.0)


def metrics(stack: harness.Stack, *names: str) -> dict[str, float]:
    m = stack.envoy.kvroute_metrics()
    return {n: m.get(n, 0.0) for n in names}


def ask(stack: harness.Stack, session: str | None, text: str, *, model: str = "test-model", **kw) -> harness.Reply:
    return send(stack.gateway_url, CHAT, json_body=chat_body(user_text=text, model=model), session=session, **kw)


def routed(r: harness.Reply, stack: harness.Stack, allowed: set[str] | None = None) -> harness.Reply:
    """A 200 from a replica that is the filter's choice, with every address
    of the destination header a live replica (and in `allowed`, if given)."""
    allowed = set(stack.live_hosts) if allowed is None else allowed
    assert r.status == 200, r.describe()
    assert r.served_by == r.decided_host, r.describe()
    assert r.destination and r.destination[0] == r.decided_host, r.describe()
    assert set(r.destination) <= allowed, f"destination outside {sorted(allowed)}: {r.describe()}"
    return r


def spread(stack: harness.Stack, label: str, n: int = 40, allowed: set[str] | None = None, **kw) -> Counter:
    """n fresh sessions with distinct short prompts; where they were served."""
    served = Counter()
    for s in range(n):
        r = routed(ask(stack, f"{label}-{s}", f"{label} question {s}", **kw), stack, allowed)
        served[r.served_by] += 1
    return served


def sessions_on(stack: harness.Stack, host: str, label: str, want: int = 3, tries: int = 200) -> list[str]:
    """Sessions whose requests (prompt `label ...`) currently land on `host`."""
    found = []
    for s in range(tries):
        session = f"{label}-{s}"
        if routed(ask(stack, session, f"{label} probe"), stack).served_by == host:
            found.append(session)
            if len(found) == want:
                return found
    raise AssertionError(f"no {want} sessions of {tries} landed on {host}")


def raw_http(port: int, head: list[str], body_parts=(), timeout: float = 10.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a raw socket. Sending stops quietly if the
    peer closes (a server may answer before the body is complete, which is
    the point of the 413 tests); the response is read to its Content-Length."""
    with socket.create_connection((harness.LOCALHOST, port), timeout=timeout) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for part in body_parts:
                s.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest[:length]


def padded_snapshot(stack: harness.Stack, size: int) -> bytes:
    """A valid snapshot of the live replicas, padded with spaces to exactly size bytes."""
    doc = json.dumps(make_snapshot(stack.fleet_states())).encode()
    assert len(doc) <= size
    return doc + b" " * (size - len(doc))


def wait_until(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    return harness.wait_for(predicate, timeout, what, every=interval)


# ----------------------------------------------------------------- fixtures


# These stacks are about what a snapshot says, not about its age: a pushed
# snapshot stays fresh for 10 s (default 2 s), so a slow machine cannot turn a
# test into a staleness test. Staleness has its own stack below.
FRESH_FOR_TESTS = {"staleAfterMs": 10_000}


@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_module_stack(
        request, replicas=4, concurrency=2, ingest_token=TOKEN,
        plugin_overrides={"fleet": FRESH_FOR_TESTS},
        ingest_overrides={"ingest": {"maxBytes": INGEST_MAX}},
    )


@pytest.fixture
def idle(stack) -> harness.Stack:
    """The module stack with a fresh all-idle snapshot (any model) and default replicas."""
    for h in stack.live_hosts:
        stack.replica_control(h, ready=True, kv=0.0, waiting=0, running=0, models=["test-model"])
    r = stack.push_fleet()
    assert r.status == 204, r
    return stack


# ------------------------------------------------------------------ ingest


def test_push_is_stored_and_used(idle):
    stack = idle
    before = metric(stack, "kvroute_ingest_accepted_total")
    r = stack.push_fleet()
    assert r.status == 204 and r.text == "", r
    routed(ask(stack, "stored-1", "hello"), stack)
    m = stack.envoy.kvroute_metrics()
    assert m["kvroute_ingest_accepted_total"] == before + 1, m
    assert m["kvroute_fleet_hosts"] == 4, m
    assert 0 <= m["kvroute_fleet_snapshot_age_ms"] < 1000, m


@pytest.mark.parametrize(
    "authorization",
    [None, f"Bearer {TOKEN[:-1]}X", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer", TOKEN, f"Basic {TOKEN}"],
    ids=["missing", "wrong-last-char", "longer", "shorter", "empty", "no-scheme", "basic"],
)
def test_push_without_the_token_is_401(idle, authorization):
    stack = idle
    down = stack.live_hosts[0]
    stack.push_fleet({down: {"ready": False}})
    before = metric(stack, "kvroute_ingest_unauthorized_total")
    headers = {"authorization": authorization} if authorization is not None else {}
    r = harness.push_snapshot(stack.ingest_url, make_snapshot(stack.fleet_states()), None, headers=headers)
    assert r.status == 401, r
    assert r.error == "missing or wrong bearer token", r
    assert TOKEN not in r.text
    assert metric(stack, "kvroute_ingest_unauthorized_total") == before + 1
    # The refused push (all ready) did not replace the stored one (first host down).
    assert down not in spread(stack, f"auth-{authorization and len(authorization)}", n=20)


def test_push_declared_too_large_is_413(idle):
    stack = idle
    before = metric(stack, "kvroute_ingest_too_large_total")
    # Refused from Content-Length alone: the body is never sent.
    status, body = raw_http(stack.ingest_port, [
        f"POST {harness.INGEST_PATH} HTTP/1.1", "Host: ingest", f"Authorization: Bearer {TOKEN}",
        "Content-Type: application/json", f"Content-Length: {INGEST_MAX + 1}",
    ])
    assert status == 413, body
    assert json.loads(body)["error"] == f"snapshot larger than {INGEST_MAX} bytes"
    # A whole (valid) snapshot one byte over the limit, sent in full.
    r = stack.push_snapshot(padded_snapshot(stack, INGEST_MAX + 1))
    assert r.status == 413, r
    assert metric(stack, "kvroute_ingest_too_large_total") == before + 2
    # Exactly the limit is fine.
    r = stack.push_snapshot(padded_snapshot(stack, INGEST_MAX))
    assert r.status == 204, r


def test_push_chunked_too_large_is_413(idle):
    """No Content-Length: the filter counts the body as it arrives."""
    stack = idle
    down = stack.live_hosts[1]
    stack.push_fleet({down: {"ready": False}})
    before = metric(stack, "kvroute_ingest_too_large_total")
    valid = padded_snapshot(stack, INGEST_MAX + 65536)
    chunks = [valid[i:i + 65536] for i in range(0, len(valid), 65536)]
    # Chunked framing by hand; no terminating chunk: the answer must come
    # while the body is still open.
    framed = [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks]
    status, body = raw_http(stack.ingest_port, [
        f"POST {harness.INGEST_PATH} HTTP/1.1", "Host: ingest", f"Authorization: Bearer {TOKEN}",
        "Content-Type: application/json", "Transfer-Encoding: chunked",
    ], framed)
    assert status == 413, body
    assert json.loads(body)["error"] == f"snapshot larger than {INGEST_MAX} bytes"
    # The filter answered, not Envoy's buffer limit.
    assert metric(stack, "kvroute_ingest_too_large_total") == before + 1
    # A chunked push within the limit is stored (httpx sends an iterator chunked).
    doc = json.dumps(make_snapshot(stack.fleet_states())).encode()
    r = stack.push_snapshot(iter([doc[:100], doc[100:]]))
    assert r.status == 204, r


def _valid_host(address: str = "127.0.0.1:9", **overrides) -> dict:
    h = {"address": address, "ready": True, "scrapedAtMs": 1000}
    h.update(overrides)
    return h


def _doc(hosts=None, **overrides) -> dict:
    doc = {"version": 1, "seq": harness.next_seq(), "collector": "e2e", "takenAtMs": 2000,
           "hosts": [_valid_host()] if hosts is None else hosts}
    doc.update(overrides)
    return doc


INVALID = [
    # id, body (dict -> JSON; bytes verbatim), the field the error must name (None: just 400)
    ("not-json", b"{nope", None),
    ("truncated", b'{"version": 1, "seq": ', None),
    ("empty-body", b"", None),
    ("array", b"[]", None),
    ("kv-over-1", lambda: _doc([_valid_host(kvUtilization=2)]), "hosts[0].kvUtilization"),
    ("kv-negative", lambda: _doc([_valid_host(kvUtilization=-0.1)]), "hosts[0].kvUtilization"),
    ("unknown-top-level-field", lambda: _doc(extra=1), "unknown field `extra`"),
    ("unknown-host-field", lambda: _doc([_valid_host(gpu="h100")]), "unknown field `gpu`"),
    ("waiting-negative", lambda: _doc([_valid_host(waiting=-1)]), "hosts[0].waiting"),
    ("ready-missing", lambda: _doc([{"address": "127.0.0.1:9", "scrapedAtMs": 1}]), "ready"),
    ("version-2", lambda: _doc(version=2), "version"),
    ("seq-0", lambda: _doc(seq=0), "seq"),
    ("collector-empty", lambda: _doc(collector=""), "collector"),
    ("scraped-after-taken", lambda: _doc([_valid_host(scrapedAtMs=2001)]), "hosts[0].scrapedAtMs"),
    ("address-not-ip-port", lambda: _doc([_valid_host("replica-1:8000")]), "hosts[0].address"),
    ("address-port-0", lambda: _doc([_valid_host("127.0.0.1:0")]), "hosts[0].address"),
    ("address-twice", lambda: _doc([_valid_host(), _valid_host()]), "hosts[1].address"),
    ("model-empty", lambda: _doc([_valid_host(models=[""])]), "hosts[0].models[0]"),
    ("block-size-0", lambda: _doc([_valid_host(blockSize=0)]), "hosts[0].blockSize"),
    ("too-many-hosts", lambda: _doc([_valid_host(f"127.3.{i // 250}.{i % 250 + 1}:9") for i in range(4097)]),
     "hosts"),
]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_push_is_400_naming_the_field(idle, case):
    stack = idle
    _id, body, field = case
    down = stack.live_hosts[2]
    stack.push_fleet({down: {"ready": False}})
    before = metric(stack, "kvroute_ingest_invalid_total")
    r = stack.push_snapshot(body() if callable(body) else body)
    assert r.status == 400, r
    assert r.error and r.error.startswith("invalid snapshot: "), r
    if field is not None:
        assert field in r.error, r
    assert metric(stack, "kvroute_ingest_invalid_total") == before + 1
    assert down not in spread(stack, f"invalid-{_id}", n=12)


def test_push_with_old_or_equal_seq_is_409(idle):
    stack = idle
    down = stack.live_hosts[3]
    good = make_snapshot(stack.fleet_states({down: {"ready": False}}))
    assert stack.push_snapshot(good).status == 204
    before = metric(stack, "kvroute_ingest_stale_total")
    everyone = stack.fleet_states()
    for seq in (good["seq"], good["seq"] - 1, 1):
        r = stack.push_snapshot(make_snapshot(everyone, seq=seq))
        assert r.status == 409, r
        assert r.error == f"seq {seq} is not newer than the stored seq {good['seq']}", r
    assert metric(stack, "kvroute_ingest_stale_total") == before + 3
    assert down not in spread(stack, "stale-seq", n=20)
    # The next seq is taken.
    assert stack.push_snapshot(make_snapshot(everyone, seq=good["seq"] + 1)).status == 204
    assert down in spread(stack, "stale-seq-after", n=40)


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("POST", "/v1/fleet", 404),
        ("POST", "/v1/fleet/snapshot/", 404),
        ("POST", "/v1/chat/completions", 404),
        ("GET", "/", 404),
        ("GET", harness.INGEST_PATH, 405),
        ("PUT", harness.INGEST_PATH, 405),
        ("DELETE", harness.INGEST_PATH, 405),
    ],
)
def test_ingest_other_paths_and_methods(idle, method, path, status):
    stack = idle
    before = {h: stack.replica_info(h)["requests"] for h in stack.live_hosts}
    accepted = metric(stack, "kvroute_ingest_accepted_total")
    r = harness.push_snapshot(stack.ingest_url, make_snapshot(stack.fleet_states()), TOKEN, method=method, path=path)
    assert r.status == status, r
    assert r.error, r
    assert metric(stack, "kvroute_ingest_accepted_total") == accepted
    assert {h: stack.replica_info(h)["requests"] for h in stack.live_hosts} == before, "forwarded to a replica"


def test_public_listener_does_not_take_snapshots(idle):
    """The gateway answers 404 for the ingest path itself, token or not: the
    snapshot is not stored, not forwarded, and routing ignores it."""
    stack = idle
    down = stack.live_hosts[0]
    stack.push_fleet({down: {"ready": False}})
    before = {h: stack.replica_info(h)["requests"] for h in stack.live_hosts}
    accepted = metric(stack, "kvroute_ingest_accepted_total")
    # A snapshot that would send everything to the first replica.
    only_down = make_snapshot(stack.fleet_states({h: {"ready": False} for h in stack.live_hosts if h != down}))
    for token in (TOKEN, None):
        for path in (harness.INGEST_PATH, harness.INGEST_PATH + "?x=1"):
            r = harness.push_snapshot(stack.gateway_url, only_down, token, path=path)
            assert r.status == 404, r
            assert "not found" in (r.error or ""), r
    assert metric(stack, "kvroute_ingest_accepted_total") == accepted
    assert {h: stack.replica_info(h)["requests"] for h in stack.live_hosts} == before, "forwarded to a replica"
    assert down not in spread(stack, "public-ingest", n=20)


def test_bad_pushes_never_replace_a_good_snapshot(idle):
    """After a good snapshot (one replica unready), every kind of refused push
    that says "all ready" leaves routing on the good one; a good newer push
    then takes effect (so the check is sensitive)."""
    stack = idle
    down = stack.live_hosts[1]
    good = make_snapshot(stack.fleet_states({down: {"ready": False}}))
    assert stack.push_snapshot(good).status == 204
    everyone = stack.fleet_states()
    bad_pushes = {
        "wrong-token": lambda: stack.push_snapshot(make_snapshot(everyone), token="x" * 32),
        "invalid": lambda: stack.push_snapshot(make_snapshot(everyone + [host_state("127.0.0.1:9", kv=1.5)])),
        "garbage-after-json": lambda: stack.push_snapshot(json.dumps(make_snapshot(everyone)) + " trailing"),
        "too-large": lambda: stack.push_snapshot(
            json.dumps(make_snapshot(everyone)).encode() + b" " * INGEST_MAX),
        "old-seq": lambda: stack.push_snapshot(make_snapshot(everyone, seq=good["seq"] - 1)),
        "public-listener": lambda: harness.push_snapshot(stack.gateway_url, make_snapshot(everyone), TOKEN),
    }
    for name, push in bad_pushes.items():
        r = push()
        assert r.status in (400, 401, 404, 409, 413), (name, r)
        served = spread(stack, f"bad-push-{name}", n=16)
        assert down not in served, f"after the refused {name} push, {down} got traffic: {dict(served)}"
    assert stack.push_snapshot(make_snapshot(everyone)).status == 204
    assert down in spread(stack, "bad-push-then-good", n=40)


# ----------------------------------------------------- routing on the snapshot


def test_unready_replica_is_avoided_immediately(idle):
    stack = idle
    down = stack.live_hosts[2]
    mine = sessions_on(stack, down, "unready", want=4)
    r = stack.push_fleet({down: {"ready": False}})
    assert r.status == 204
    for session in mine:
        reply = routed(ask(stack, session, "unready probe"), stack, set(stack.live_hosts) - {down})
        assert reply.reason == "session", reply.describe()
    served = spread(stack, "unready-fresh", n=40, allowed=set(stack.live_hosts) - {down})
    assert len(served) == 3, served
    # Draining is the same as not ready for new work.
    stack.push_fleet({down: {"draining": True}})
    spread(stack, "draining-fresh", n=20, allowed=set(stack.live_hosts) - {down})
    # Back in service: fresh sessions reach it again.
    stack.push_fleet()
    assert down in spread(stack, "unready-back", n=40)


def test_ingest_to_first_use_latency(idle):
    """Push a snapshot that takes a conversation's replica out; the very next
    request (on either Envoy worker) follows it."""
    stack = idle
    rounds = []
    for i in range(12):
        stack.push_fleet()
        session = f"latency-{i}"
        home = routed(ask(stack, session, f"latency {i}"), stack).served_by
        t0 = time.perf_counter()
        r = stack.push_fleet({home: {"ready": False}})
        t_ack = time.perf_counter()
        assert r.status == 204, r
        tries = 0
        while True:
            tries += 1
            reply = routed(ask(stack, session, f"latency {i}", fresh_connection=(i % 2 == 1)), stack)
            if reply.served_by != home:
                break
            assert tries < 20, f"round {i}: still on {home} after {tries} requests"
        rounds.append((t_ack - t0, time.perf_counter() - t0, tries))
    acks = [a * 1000 for a, _, _ in rounds]
    uses = [u * 1000 for _, u, _ in rounds]
    print(
        f"\n[fleet] ingest-to-first-use over {len(rounds)} pushes: push answered (204) after "
        f"median {statistics.median(acks):.2f} ms (max {max(acks):.2f}); first request following the new "
        f"snapshot answered {statistics.median(uses):.2f} ms after the push started (max {max(uses):.2f}); "
        f"requests needed: {Counter(t for _, _, t in rounds)}"
    )
    assert all(t == 1 for _, _, t in rounds), f"a request after the 204 still used the old snapshot: {rounds}"


def test_models_route_only_to_replicas_serving_them(idle):
    stack = idle
    a_hosts, b_hosts = set(stack.live_hosts[:2]), set(stack.live_hosts[2:])
    lora_host = stack.live_hosts[3]
    plan = {h: ["model-a"] for h in a_hosts}
    plan.update({h: ["model-b"] for h in b_hosts})
    plan[lora_host] = ["model-b", "adapter-x"]
    for h, models in plan.items():
        stack.replica_control(h, models=models, reset_counts=True)
    assert stack.push_fleet({h: {"models": m} for h, m in plan.items()}).status == 204

    for model, allowed in (("model-a", a_hosts), ("model-b", b_hosts), ("adapter-x", {lora_host})):
        served = spread(stack, f"models-{model}", n=30, allowed=allowed, model=model)
        assert set(served) <= allowed, (model, served)
        if len(allowed) > 1:
            assert len(served) == len(allowed), f"{model} did not use all its replicas: {served}"
    # The replicas confirm what they received.
    for h, models in plan.items():
        seen = stack.replica_info(h)["requests_by_model"]
        assert set(seen) <= set(models), (h, seen)

    # Nobody serves model-c: 503 JSON naming it, nothing forwarded.
    before = {h: stack.replica_info(h)["requests"] for h in stack.live_hosts}
    no_hosts = metric(stack, "kvroute_decisions_no_hosts_total")
    for session in ("models-c-1", None):
        r = ask(stack, session, "who serves me?", model="model-c")
        assert r.status == 503, r.describe()
        assert r.headers["content-type"] == "application/json"
        err = r.response.json()["error"]
        assert err["model"] == "model-c" and "model-c" in err["message"], err
        assert r.served_by is None and r.reason == "no-hosts", r.describe()
    assert {h: stack.replica_info(h)["requests"] for h in stack.live_hosts} == before, "model-c reached a replica"
    assert metric(stack, "kvroute_decisions_no_hosts_total") == no_hosts + 2
    # A model served only by a replica that is not ready: 503 as well.
    assert stack.push_fleet({h: {"models": m, "ready": h != lora_host} for h, m in plan.items()}).status == 204
    r = ask(stack, "models-lora-down", "adapter please", model="adapter-x")
    assert r.status == 503 and r.response.json()["error"]["model"] == "adapter-x", r.describe()
    # Requests without a parsable body still go somewhere (any replica).
    r = send(stack.gateway_url, "/v1/models", method="GET")
    assert r.status == 200 and r.reason == "fallback", r.describe()


def test_unparsed_requests_avoid_unready_replicas(idle):
    stack = idle
    up = stack.live_hosts[0]
    assert stack.push_fleet({h: {"ready": False} for h in stack.live_hosts[1:]}).status == 204
    served = Counter()
    for _ in range(20):
        r = send(stack.gateway_url, "/v1/models", method="GET")
        assert r.status == 200 and r.reason == "fallback", r.describe()
        assert set(r.destination) == {up}, f"unready replicas in the destination: {r.describe()}"
        served[r.served_by] += 1
    assert set(served) == {up}, served


@pytest.mark.parametrize("fakes_are", ["unready", "other-model"])
def test_snapshot_of_1024_hosts(idle, fakes_are):
    """4 real replicas plus 1020 addresses that are not cluster endpoints: the
    snapshot is taken (204) and used, and picks land on the real ones."""
    stack = idle
    fake = {"ready": False} if fakes_are == "unready" else {"models": ["other-model"]}
    fakes = [host_state(f"127.2.{i // 250}.{i % 250 + 1}:8000", **fake) for i in range(1020)]
    real = stack.fleet_states(models=["test-model"])
    # Real replicas spread through the list, not just at the front.
    hosts = fakes[:300] + real[:2] + fakes[300:700] + real[2:] + fakes[700:]
    doc = make_snapshot(hosts)
    size = len(json.dumps(doc))
    r = stack.push_snapshot(doc)
    assert r.status == 204, r
    t0 = time.perf_counter()
    first = routed(ask(stack, "big-0", "big snapshot"), stack)
    first_ms = (time.perf_counter() - t0) * 1000
    assert metric(stack, "kvroute_fleet_hosts") == 1024
    t0 = time.perf_counter()
    served = spread(stack, f"big-{fakes_are}", n=40)
    per_request_ms = (time.perf_counter() - t0) * 1000 / 40
    assert len(served) >= 3, served
    assert first.served_by in stack.live_hosts
    print(f"\n[fleet] 1024-host snapshot ({fakes_are} fakes): {size} bytes, push answered in "
          f"{r.elapsed * 1000:.1f} ms; first request after it {first_ms:.1f} ms (decodes it), "
          f"then {per_request_ms:.1f} ms per request; spread {dict(served)}")


def test_snapshot_of_4096_hosts_is_accepted(idle):
    stack = idle
    fakes = [host_state(f"127.2.{i // 250}.{i % 250 + 1}:8000", ready=False) for i in range(4092)]
    doc = make_snapshot(stack.fleet_states() + fakes)
    r = stack.push_snapshot(doc)
    assert r.status == 204, r
    routed(ask(stack, "huge-0", "huge snapshot"), stack)
    assert metric(stack, "kvroute_fleet_hosts") == 4096
    print(f"\n[fleet] 4096-host snapshot: {len(json.dumps(doc))} bytes, push answered in {r.elapsed * 1000:.1f} ms")


def _concurrent(stack: harness.Stack, bodies: list[tuple[str, dict]], hold_ms: int) -> list[harness.Reply]:
    def one(item):
        session, body = item
        return send(stack.gateway_url, CHAT, json_body=body, session=session,
                    headers={"x-upstream-delay-ms": str(hold_ms)}, timeout=30)

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_no_herding_on_an_idle_snapshot(idle):
    """The snapshot says all idle and stays so for the whole burst: 24
    concurrent long requests must spread anyway, because the gateway counts
    what it sent at once."""
    stack = idle
    bodies = [(f"herd-{i}", chat_body(user_text=f"{i:03d} " + filler(f"herd {i}", 16_000), max_tokens=256))
              for i in range(24)]
    replies = _concurrent(stack, bodies, 1000)
    for r in replies:
        routed(r, stack)
    served = Counter(r.served_by for r in replies)
    print(f"\n[fleet] 24 concurrent 16 KB requests on an all-idle snapshot: {dict(served)}; "
          f"reasons {dict(Counter(r.reason for r in replies))}")
    assert len(served) >= 3, served
    assert max(served.values()) <= 12, served


def test_no_herding_onto_the_one_idle_replica(idle):
    """The snapshot says one replica is idle and the others half full: a burst
    must not all go to the idle one (the snapshot cannot see the burst; the
    gateway's own accounting must)."""
    stack = idle
    cold = stack.live_hosts[0]
    assert stack.push_fleet({h: {"kv": 0.5} for h in stack.live_hosts if h != cold}).status == 204
    bodies = [(f"herd1-{i}", chat_body(user_text=f"{i:03d} " + filler(f"herd1 {i}", 16_000), max_tokens=256))
              for i in range(24)]
    replies = _concurrent(stack, bodies, 1000)
    for r in replies:
        routed(r, stack)
    served = Counter(r.served_by for r in replies)
    print(f"\n[fleet] 24 concurrent 16 KB requests, snapshot says only {cold} is idle: {dict(served)}")
    assert served[cold] >= 1, served
    assert served[cold] < 24 and len(served) >= 3, served


def test_shared_prefix_burst_spreads(idle):
    """24 concurrent requests sharing an 8 KB prefix: the prefix index pulls
    them to one replica, bounded load on the gateway's own count spreads the
    burst."""
    stack = idle
    system = filler("herd shared system prompt", 8192)
    bodies = [(f"herd2-{i}", chat_body(system=system, user_text=f"question {i}", max_tokens=256)) for i in range(24)]
    replies = _concurrent(stack, bodies, 1000)
    for r in replies:
        routed(r, stack)
    served = Counter(r.served_by for r in replies)
    print(f"\n[fleet] 24 concurrent requests sharing an 8 KB prefix: {dict(served)}; "
          f"reasons {dict(Counter(r.reason for r in replies))}")
    assert len(served) >= 3, served


def test_original_dst_variant_takes_snapshots(stack_factory, wasm_path):
    """envoy-config/envoy-original-dst.yaml has the ingest listener too; a
    replica the snapshot calls unready gets nothing."""
    stack = stack_factory(replicas=4, base=harness.ENVOY_CONFIG_DIR / "envoy-original-dst.yaml",
                          ingest_token=TOKEN, plugin_overrides={"fleet": FRESH_FOR_TESTS})
    down = stack.live_hosts[0]
    assert stack.push_fleet({down: {"ready": False}}).status == 204
    served = Counter()
    for s in range(30):
        r = ask(stack, f"odst-fleet-{s}", f"odst {s}")
        assert r.status == 200 and r.destination == [r.served_by], r.describe()
        served[r.served_by] += 1
    assert down not in served and len(served) == 3, served


# --------------------------------------------------- pressure and stickiness

PRESSURE_FLEET = {"kvPressure": 0.99, "queuePressure": 64, **FRESH_FOR_TESTS}


@pytest.fixture(scope="module")
def pressure_stack(request, wasm_path) -> harness.Stack:
    return start_module_stack(
        request, replicas=4, concurrency=2, ingest_token=TOKEN, plugin_overrides={"fleet": PRESSURE_FLEET},
    )


def conversation(label: str, turn: int) -> list[dict]:
    """A conversation with a 6 KB opening (24 prefix blocks), `turn` exchanges later."""
    messages = [{"role": "user", "content": f"{label}: " + filler(label, 6000)}]
    for k in range(turn):
        messages += [{"role": "assistant", "content": f"answer {k} " * 20}, {"role": "user", "content": f"more {k}"}]
    return messages


def establish(stack: harness.Stack, label: str, n: int = 16) -> tuple[str, list[str]]:
    """n conversations' first turns on an idle fleet; the replica holding the
    most of them, and those conversations."""
    assert stack.push_fleet().status == 204
    home = {}
    for c in range(n):
        session = f"{label}-{c}"
        r = routed(send(stack.gateway_url, CHAT, json_body=chat_body(conversation(session, 0)), session=session), stack)
        home[session] = r.served_by
    hot = Counter(home.values()).most_common(1)[0][0]
    return hot, [s for s, h in home.items() if h == hot]


def next_turn(stack: harness.Stack, session: str, turn: int) -> harness.Reply:
    return routed(send(stack.gateway_url, CHAT, json_body=chat_body(conversation(session, turn)), session=session),
                  stack)


@pytest.mark.parametrize(
    "pressure, stays",
    [({"kv": 0.5, "waiting": 1}, True), ({"kv": 0.5, "waiting": 20}, False), ({"kv": 0.995, "waiting": 0}, False)],
    ids=["short-queue-stays", "long-queue-moves", "full-kv-moves"],
)
def test_conversations_stay_while_the_cache_outweighs_the_queue(pressure_stack, pressure, stays):
    """The pick is the predicted cost. A conversation (a 6 KB opening, about
    1.5k tokens) stays on its replica while the prefill it would redo
    elsewhere (times 1 + recomputeWeight) costs more than that replica's
    queue (waiting x 1024 tokens) and memory term: one waiting request does
    not move it; twenty do, and so does KV at 99.5 %. Once it moves, new
    conversations avoid the replica too."""
    stack = pressure_stack
    label = f"sticky-{pressure['kv']}-{pressure['waiting']}"
    hot, mine = establish(stack, label)
    assert len(mine) >= 2, mine
    others = set(stack.live_hosts) - {hot}

    assert stack.push_fleet({hot: pressure}).status == 204
    for session in mine:
        r = next_turn(stack, session, 1)
        assert r.reason == "session", r.describe()
        if stays:
            assert r.served_by == hot, f"{session} left its replica at {pressure}: {r.describe()}"
        else:
            assert r.served_by != hot, f"{session} stayed on its replica at {pressure}: {r.describe()}"
    if not stays:
        fresh = spread(stack, f"{label}-fresh", n=40, allowed=others)
        assert len(fresh) == 3, fresh


@pytest.mark.parametrize("kv, stays", [(0.3, True), (0.95, False)])
def test_memory_term_moves_conversations_only_near_capacity(pressure_stack, kv, stays):
    """With the KV capacity a vLLM collector reports (16 x 8192 tokens) and
    no queue: at KV 0.3 the predicted use is far from the memoryKnee (0.8)
    and conversations stay; at 0.95 the memory term outweighs the cache and
    they move."""
    stack = pressure_stack
    hot, mine = establish(stack, f"capacity-{kv}")
    assert stack.push_fleet({hot: {"kv": kv, "waiting": 0}}, kv_capacity_tokens=131072, block_size=16).status == 204
    replies = [next_turn(stack, s, 1) for s in mine]
    if stays:
        moved = [r.describe() for r in replies if r.served_by != hot]
        assert not moved, f"{len(moved)}/{len(mine)} conversations left a replica at KV {kv}:\n" + "\n".join(moved)
    else:
        kept = [r.describe() for r in replies if r.served_by == hot]
        assert not kept, f"{len(kept)}/{len(mine)} conversations stayed on a replica at KV {kv}:\n" + "\n".join(kept)


# ------------------------------------------------------------ the collector

COLLECTOR_INTERVAL_MS = 100
# For the staleness test only: elsewhere the default (2 s) keeps a loaded test
# machine's late scrape from turning a test into a staleness test.
STALE_AFTER_MS = 500


@pytest.fixture(scope="module")
def collector_stack(request, wasm_path, collector_binary) -> harness.Stack:
    return start_module_stack(request, replicas=4, concurrency=2, ingest_token=TOKEN)


def wait_for_pushes(stack: harness.Stack, n: int = 2, timeout: float = 5.0) -> None:
    """Until n more snapshots were accepted (i.e. the collector is pushing)."""
    start = metric(stack, "kvroute_ingest_accepted_total")
    wait_until(lambda: metric(stack, "kvroute_ingest_accepted_total") >= start + n, timeout,
               what=f"{n} accepted pushes")


def run_collector(stack: harness.Stack, binary) -> harness.Collector:
    for h in stack.live_hosts:
        stack.replica_control(h, ready=True, kv=0.0, waiting=0, running=0, models=["test-model"])
    c = stack.start_collector(binary=binary, interval_ms=COLLECTOR_INTERVAL_MS,
                              metrics_port=harness.free_ports(1)[0])
    try:
        wait_for_pushes(stack)
    except AssertionError:
        c.stop()
        pytest.fail(f"the collector is not pushing; its log:\n{c.log_tail()}")
    return c


@pytest.fixture
def collector(collector_stack, collector_binary) -> harness.Collector:
    c = run_collector(collector_stack, collector_binary)
    yield c
    c.stop()


def degraded_delta(stack: harness.Stack, label: str, n: int = 10) -> float:
    before = metric(stack, "kvroute_decisions_degraded_total")
    for i in range(n):
        routed(ask(stack, f"{label}-{i}", f"{label} {i}"), stack)
    return metric(stack, "kvroute_decisions_degraded_total") - before


def test_collector_feeds_the_router(collector_stack, collector):
    stack = collector_stack
    assert degraded_delta(stack, "collector-fresh") == 0
    m = stack.envoy.kvroute_metrics()
    assert m["kvroute_fleet_hosts"] == 4, m
    assert m["kvroute_fleet_snapshot_age_ms"] < 2000, m
    assert m["kvroute_ingest_unauthorized_total"] == 0 and m["kvroute_ingest_invalid_total"] == 0, m
    own = collector.metrics()
    assert any(k.startswith("kvroute_collector_") for k in own), f"the collector's /metrics: {sorted(own)[:20]}"


def test_collector_unready_replica_is_avoided(collector_stack, collector):
    stack = collector_stack
    down = stack.live_hosts[1]
    session = sessions_on(stack, down, "collector-unready", want=1)[0]
    t0 = time.perf_counter()
    stack.replica_control(down, ready=False)
    requests = 0
    while True:
        requests += 1
        r = routed(ask(stack, session, "collector-unready probe"), stack)
        if r.served_by != down:
            break
        assert requests < 1000, f"{down} still used after {requests} requests since its /health went 503"
        time.sleep(0.005)
    latency_ms = (time.perf_counter() - t0) * 1000
    print(f"\n[fleet] unready avoidance with the collector (scrape interval {COLLECTOR_INTERVAL_MS} ms): "
          f"/health 503 -> requests avoid the replica after {latency_ms:.0f} ms ({requests} requests)")
    spread(stack, "collector-unready-fresh", n=30, allowed=set(stack.live_hosts) - {down})
    # Ready again: it takes fresh sessions again.
    t0 = time.perf_counter()
    stack.replica_control(down, ready=True)
    wait_until(lambda: down in spread(stack, f"collector-back-{time.perf_counter_ns()}", n=12), 3.0,
               interval=0.05, what=f"{down} back in service")
    print(f"[fleet] back in service after {(time.perf_counter() - t0) * 1000:.0f} ms")


def test_collector_kv_pressure_diverts_new_conversations(collector_stack, collector):
    stack = collector_stack
    hot = stack.live_hosts[2]
    stack.replica_control(hot, kv=0.95, waiting=40)
    wait_until(lambda: hot not in spread(stack, f"collector-kv-{time.perf_counter_ns()}", n=12), 2.0,
               interval=0.05, what=f"{hot} avoided")
    before = metric(stack, "kvroute_decisions_degraded_total")
    replies = [routed(ask(stack, f"collector-kv-fresh-{s}", f"collector-kv-fresh question {s}"), stack)
               for s in range(40)]
    served = Counter(r.served_by for r in replies)
    # Seen once in CI (7 of 40 on the hot replica, not reproduced since): say
    # why, if it happens again.
    assert hot not in served and len(served) == 3, (
        f"{dict(served)}; degraded decisions during the 40: "
        f"{metric(stack, 'kvroute_decisions_degraded_total') - before:.0f}; "
        f"on {hot}: {[r.describe() for r in replies if r.served_by == hot][:3]}; "
        f"snapshot age {metric(stack, 'kvroute_fleet_snapshot_age_ms'):.0f} ms; "
        f"collector log:\n{collector.log_tail()}"
    )


def test_collector_models_from_metrics(collector_stack, collector):
    stack = collector_stack
    a_hosts = set(stack.live_hosts[:2])
    for h in stack.live_hosts:
        stack.replica_control(h, models=["model-a"] if h in a_hosts else ["model-b", "adapter-y"])

    def model_c_refused() -> bool:
        return ask(stack, None, "anyone?", model="test-model").status == 503

    wait_until(model_c_refused, 2.0, interval=0.05, what="the collector's new model lists")
    served = spread(stack, "collector-model-a", n=30, allowed=a_hosts, model="model-a")
    assert set(served) == a_hosts, served
    served = spread(stack, "collector-adapter", n=30, allowed=set(stack.live_hosts) - a_hosts, model="adapter-y")
    assert len(served) == 2, served


def test_killed_collector_degrades_then_recovers(stack_factory, wasm_path, collector_binary):
    stack = stack_factory(replicas=4, concurrency=2, ingest_token=TOKEN,
                          plugin_overrides={"fleet": {"staleAfterMs": STALE_AFTER_MS}})
    collector = run_collector(stack, collector_binary)
    assert degraded_delta(stack, "kill-before") == 0
    collector.kill()
    # Routing goes on at once, and after staleAfterMs on the gateway's own load.
    routed(ask(stack, "kill-now", "still there?"), stack)
    time.sleep(STALE_AFTER_MS / 1000 + 0.3)
    assert degraded_delta(stack, "kill-stale", n=10) == 10
    age = metric(stack, "kvroute_fleet_snapshot_age_ms")
    assert age > STALE_AFTER_MS, age
    # Stale data does not exclude anyone: all replicas take work.
    assert len(spread(stack, "kill-stale-spread", n=40)) == 4

    t0 = time.perf_counter()
    again = stack.start_collector(binary=collector.binary, interval_ms=COLLECTOR_INTERVAL_MS)

    def fresh_again() -> bool:
        return degraded_delta(stack, f"kill-restart-{time.perf_counter_ns()}", n=1) == 0

    wait_until(fresh_again, 5.0, interval=0.02, what="fleet mode after the restart")
    restored_ms = (time.perf_counter() - t0) * 1000
    assert degraded_delta(stack, "kill-after", n=10) == 0
    assert metric(stack, "kvroute_fleet_snapshot_age_ms") < STALE_AFTER_MS
    print(f"\n[fleet] collector killed: degraded after staleAfterMs={STALE_AFTER_MS} (snapshot age {age:.0f} ms); "
          f"restarted: fleet mode again {restored_ms:.0f} ms after the new process started")
    again.stop()


def test_a_second_collector_is_refused_then_takes_over(stack_factory, wasm_path, collector_binary):
    """Two collectors with different views push to one gateway: the owner's
    view holds (the other's pushes get 409 and are counted) until the owner
    falls silent for ingest.ownerLeaseMs; then the other takes over."""
    lease_ms = 600
    stack = stack_factory(replicas=4, concurrency=2, ingest_token=TOKEN,
                          ingest_overrides={"ingest": {"ownerLeaseMs": lease_ms}})
    for h in stack.live_hosts:
        stack.replica_control(h, ready=True, kv=0.0, waiting=0, running=0, models=["test-model"])
    owner = stack.start_collector(binary=collector_binary, interval_ms=COLLECTOR_INTERVAL_MS,
                                  collector_id="e2e-owner")
    wait_for_pushes(stack)
    standby = stack.start_collector(binary=collector_binary, interval_ms=COLLECTOR_INTERVAL_MS,
                                    collector_id="e2e-standby", engines=stack.live_hosts[:3])
    wait_until(lambda: metric(stack, "kvroute_ingest_conflicts_total") >= 5, 5.0,
               what="the standby's pushes refused")
    # The owner's four-replica view holds while both push.
    assert metric(stack, "kvroute_fleet_hosts") == 4
    assert len(spread(stack, "two-collectors", n=40)) == 4
    wait_until(lambda: "owns this gateway's snapshot" in standby.log_text(), 3.0,
               what="the standby's log naming the conflict")
    log = stack.envoy.log_text()
    assert log.count("conflicts with") >= 1, log[-2000:]

    owner.kill()
    t0 = time.perf_counter()
    wait_until(lambda: metric(stack, "kvroute_fleet_hosts") == 3, 5.0, interval=0.02,
               what="the standby's view in use")
    took_ms = (time.perf_counter() - t0) * 1000
    assert took_ms >= lease_ms * 0.5, took_ms
    assert "took the snapshot over from \"e2e-owner\"" in stack.envoy.log_text()
    assert stack.live_hosts[3] not in spread(stack, "standby-view", n=30)
    print(f"\n[fleet] owner killed: the standby's view in use after {took_ms:.0f} ms (lease {lease_ms} ms)")

"""Several gateway replicas in front of one fleet, as behind a Service: two
real Envoy processes, each with the kvroute filter, its own shared data, its
own ingest listener and its own kvroute-collector (the sidecar layout of the
shipped manifests), all on the same four loopback replicas.

kvroute keeps no shared store between gateways. A conversation's replica is
a function of what every gateway sees alike: the request and the snapshot
(its home is the rendezvous top of its key among the replicas with
headroom). The prefix index and the in-flight accounting are per gateway and
may only confirm that choice. These tests check the behaviour, not timings:
- turns of each conversation alternate between the gateways and still land
  on one replica, with the replicas loaded unevenly and one gateway carrying
  in-flight work the other does not see;
- a gateway killed mid-run loses only its own in-flight streams, and the
  other keeps routing every conversation where it was;
- with one collector for both gateways (instead of one each), each gateway
  gets the other's pending prefill per replica in its snapshot, and new
  conversations avoid the replicas where the other gateway's long prompts
  wait;
- with key memory (`fleet.coldHomeShare`), a key that one gateway placed off
  its busy home reaches the other gateway through the collector, which then
  sends the key there too;
- likewise each request's last block (`fleet.shareLastBlocks`): a
  conversation's next turn on the other gateway goes where its previous
  turn went.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from harness import chat_body, filler, send
from upstream import BODY_DELAY_HEADER, DELAY_HEADER

CHAT = "/v1/chat/completions"
TOKEN = "e2e-ingest-token-0123456789abcdef"
LOAD_PATH = "/v1/fleet/load"
COLLECTOR_INTERVAL_MS = 100
# Uneven but with headroom everywhere (kvPressure 0.9, queuePressure 32): a
# short queue on a conversation's replica costs less than recomputing its
# prompt elsewhere, so "load allows" staying. Every replica at or above
# recomputeFullKv (0.3): below it a replica's recompute weight is smaller,
# and with these metrics pinned (they never rise as it takes conversations)
# every new conversation would go to the one idle replica.
UNEVEN = [dict(kv=0.3, waiting=0), dict(kv=0.45, waiting=1), dict(kv=0.6, waiting=2), dict(kv=0.8, waiting=3)]
SYSTEM = "You are the assistant of a support desk. " + filler("policy", 1500)
# Each conversation's own first question: about 1k tokens, so that a turn
# sent away from its conversation's replica recomputes more than one
# waiting request is worth (waitingRequestTokens 1024 at recomputeWeight 3).
# With shorter questions (700 bytes) the test sat on a knife edge: the
# shared system prompt, indexed on whichever replica this gateway last sent
# it to, was most of a first turn, so a first turn left a home with one
# waiting request for an idle replica holding the system prompt, the other
# gateway (whose index did not know that) sent the next turn home, and each
# gateway then kept the conversation where its own index saw it: 90 % of
# turns on one replica in one CI run (4 of 20 conversations alternating),
# depending on which replicas the random ports made homes.
QUESTION_BYTES = 4000


def metric(stack: harness.Stack, name: str) -> float:
    return stack.envoy.kvroute_metrics().get(name, 0.0)


wait_until = harness.wait_for


@pytest.fixture
def two_gateways(stack_factory, wasm_path, collector_binary):
    a = stack_factory(replicas=4, concurrency=2, ingest_token=TOKEN)
    b = stack_factory(fleet_of=a, concurrency=2, ingest_token=TOKEN)
    assert a.live_hosts == b.live_hosts and a.gateway_url != b.gateway_url
    for host, load in zip(a.live_hosts, UNEVEN):
        a.replica_control(host, ready=True, running=2, models=["test-model"], **load)
    for gw, name in ((a, "gw-a"), (b, "gw-b")):
        gw.start_collector(binary=collector_binary, interval_ms=COLLECTOR_INTERVAL_MS, collector_id=name)
    for gw in (a, b):
        wait_until(lambda gw=gw: metric(gw, "kvroute_ingest_accepted_total") >= 2, 10.0,
                   f"{gw.gateway_url}'s collector pushing")
        wait_until(lambda gw=gw: metric(gw, "kvroute_fleet_hosts") == 4, 5.0, "four replicas in the snapshot")
    return a, b


def turns(conversation: int, n: int) -> list[list[dict]]:
    """The growing message lists a chat client re-sends: a shared system
    prompt, a first question of the conversation's own, then follow-ups."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"conversation {conversation}: " + filler(f"case-{conversation}", QUESTION_BYTES)}]
    out = []
    for t in range(n):
        if t:
            messages.append({"role": "assistant", "content": f"answer {t} " * 20})
            messages.append({"role": "user", "content": f"follow-up {t} of conversation {conversation}"})
        out.append(list(messages))
    return out


def hold_in_flight(gw: harness.Stack, n: int, delay_ms: int, tag: str) -> list:
    """n requests that the replicas hold for delay_ms, sent through gw only
    (the other gateway does not see them in flight). Returns the futures."""
    pool = ThreadPoolExecutor(max_workers=n)
    futures = [pool.submit(send, gw.gateway_url, CHAT, json_body=chat_body(user_text=f"{tag} long job {i}"),
                           session=f"{tag}-{i}", headers={DELAY_HEADER: str(delay_ms)},
                           timeout=delay_ms / 1000 + 10)
               for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def conversation_split(served: dict[str, list[str]]) -> float:
    """The share of turns served by their conversation's most frequent replica."""
    total = sum(len(v) for v in served.values())
    return sum(Counter(v).most_common(1)[0][1] for v in served.values()) / total


@pytest.mark.parametrize("keyed", [True, False], ids=["session-header", "prefix-key"])
def test_alternating_gateways_keep_each_conversation_on_one_replica(two_gateways, keyed):
    a, b = two_gateways
    held = hold_in_flight(a, 6, 4000, f"held-{keyed}")
    served: dict[str, list[str]] = defaultdict(list)
    for t in range(6):
        for c in range(20):
            gw = (a, b)[(t + c) % 2]
            name = f"alt-{keyed}-{c}"
            body = chat_body(turns(c, t + 1)[t])
            r = send(gw.gateway_url, CHAT, json_body=body, session=name if keyed else None)
            assert r.status == 200, r.describe()
            assert r.served_by == r.decided_host, r.describe()
            served[name].append(r.served_by)
    share = conversation_split(served)
    replicas = Counter(v[0] for v in served.values())
    moved = {k: v for k, v in served.items() if len(set(v)) > 1}
    print(f"\n[gateways] {'session header' if keyed else 'prefix key'}: {share:.1%} of 120 turns "
          f"on their conversation's replica; first turns per replica {dict(replicas)}; moved: {moved}")
    assert share >= 0.95, f"{share:.1%}; moved: {moved}"
    # Not everything on one replica: the choice still spreads conversations.
    assert len(replicas) >= 2, replicas
    for f in held:
        assert f.result().status == 200


def test_a_killed_gateway_loses_only_its_own_streams(two_gateways):
    a, b = two_gateways
    homes = {}
    for c in range(12):
        r = send(a.gateway_url, CHAT, json_body=chat_body(turns(c, 1)[0]), session=f"kill-{c}")
        assert r.status == 200, r.describe()
        # Where the conversation is once both gateways have served it (a
        # first turn may be placed off its home; see the alternating test).
        r = send(b.gateway_url, CHAT, json_body=chat_body(turns(c, 2)[1]), session=f"kill-{c}")
        assert r.status == 200, r.describe()
        homes[c] = r.served_by
    degraded_before = metric(b, "kvroute_decisions_degraded_total")
    on_a = hold_in_flight(a, 4, 5000, "on-a")
    on_b = hold_in_flight(b, 4, 5000, "on-b")
    time.sleep(0.5)
    a.envoy.kill()
    # The other gateway keeps routing, every conversation where it was.
    for t in range(2, 5):
        for c in range(12):
            r = send(b.gateway_url, CHAT, json_body=chat_body(turns(c, t + 1)[t]), session=f"kill-{c}")
            assert r.status == 200, r.describe()
            assert r.served_by == homes[c], f"conversation {c} moved after the other gateway died: {r.describe()}"
    assert [f.result().status for f in on_b] == [200] * 4
    lost = 0
    for f in on_a:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - the stream was cut with the process
            lost += 1
    assert lost == 4, "the killed gateway's streams should have been cut"
    assert metric(b, "kvroute_decisions_degraded_total") == degraded_before


def gateway_load(gw: harness.Stack, token: str | None = TOKEN, method: str = "GET",
                 path: str = LOAD_PATH) -> tuple[int, dict | str]:
    """The gateway's in-flight load from its ingest listener."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(gw.ingest_url + path, headers=headers, method=method,
                                 data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def test_prefill_is_pending_until_the_first_body_byte(stack_factory, wasm_path):
    """vLLM sends a stream's response headers as soon as it takes the
    request and its first chunk with the first token. The gateway counts
    the prompt as pending prefill until that first body byte, not until the
    headers (nor until the end); the memory it holds until the end."""
    gw = stack_factory(replicas=2, ingest_token=TOKEN)
    # The load table lists the snapshot's replicas.
    assert gw.push_fleet().status == 204
    prompt = chat_body(user_text="long prompt " + filler("late", 40_000))
    conn = http.client.HTTPConnection(harness.LOCALHOST, int(gw.gateway_url.rsplit(":", 1)[1]), timeout=20)
    try:
        conn.request("POST", CHAT, body=json.dumps(prompt),
                     headers={"content-type": "application/json", BODY_DELAY_HEADER: "3000"})
        resp = conn.getresponse()  # the headers: the first body chunk is 3 s away
        assert resp.status == 200
        served_by = resp.getheader("x-served-by")

        def mine() -> dict:
            status, load = gateway_load(gw)
            assert status == 200, load
            return next((h for h in load["hosts"] if h["address"] == served_by),
                        {"address": served_by, "prefillPendingTokens": 0, "memoryTokens": 0})

        held = mine()
        assert held["prefillPendingTokens"] >= 5000, held
        assert held["memoryTokens"] >= held["prefillPendingTokens"], held
        first = resp.read1()  # the first chunk; the rest is 3 s away
        assert first, "no first chunk"
        after_first = mine()
        assert after_first["prefillPendingTokens"] == 0, after_first
        assert after_first["memoryTokens"] == held["memoryTokens"], after_first
        body = json.loads(first + resp.read())
        assert body["served_by"] == served_by
    finally:
        conn.close()
    # The stream is done: nothing held.
    wait_until(lambda: mine()["memoryTokens"] == 0, 5.0, "the memory released")



def test_a_continuing_request_counts_as_an_arrival(stack_factory, wasm_path):
    """The load report carries, per replica, the rate of requests that
    continue a conversation this gateway sent there lately (`arrivalsPerS`,
    decayed over `fleet.arrivalWindowMs`, 10 s): a replica that only
    started conversations has none, and one continuing turn is 0.1 a
    second, decaying."""
    gw = stack_factory(replicas=2, ingest_token=TOKEN)
    # The load report names the snapshot's replicas.
    assert gw.push_fleet().status == 204

    def report() -> list[dict]:
        status, load = gateway_load(gw)
        assert status == 200, load
        return load["hosts"]

    first = send(gw.gateway_url, CHAT, json_body=chat_body(turns(0, 1)[0]))
    assert first.status == 200, first.describe()
    assert all("arrivalsPerS" not in h for h in report()), report()
    second = send(gw.gateway_url, CHAT, json_body=chat_body(turns(0, 2)[1]))
    assert second.status == 200, second.describe()
    counted = [h for h in report() if "arrivalsPerS" in h]
    assert [h["address"] for h in counted] == [second.served_by], counted
    assert 0.05 < counted[0]["arrivalsPerS"] <= 0.1, counted
    # Once the answer is done, the host is reported for its arrivals alone.
    wait_until(lambda: [(h["prefillPendingTokens"], h["memoryTokens"]) for h in report()] == [(0, 0)],
               5.0, "the memory released, the arrivals kept")

def test_a_bare_prompt_that_extends_an_earlier_one_counts_as_an_arrival(stack_factory, wasm_path):
    """/v1/completions, no session: a prompt has no answers to show it
    continues a conversation. Questions over one shared document (each
    the document and its own question) continue nothing, even under one
    remembered key; a conversation's next turn, whose prompt holds its
    first turn whole, continues it and counts as an arrival on its replica
    (docs/fleet-state.md, "Bare prompts that continue")."""
    gw = stack_factory(replicas=2, ingest_token=TOKEN)
    assert gw.push_fleet().status == 204
    document = filler("bare-arrivals-document", 8192)

    def report() -> list[dict]:
        status, load = gateway_load(gw)
        assert status == 200, load
        return load["hosts"]

    def ask(prompt: str) -> harness.Reply:
        body = {"model": "test-model", "prompt": prompt, "max_tokens": 16}
        r = send(gw.gateway_url, "/v1/completions", json_body=body)
        assert r.status == 200, r.describe()
        return r

    def question(q: int) -> str:
        return f"{document}\n\nQuestion {q}: " + filler(f"bare-question-{q}", 600)

    for q in range(30):
        ask(question(q))
    assert all("arrivalsPerS" not in h for h in report()), report()
    first = question(100)
    ask(first)
    assert all("arrivalsPerS" not in h for h in report()), report()
    second = ask(first + "\n\nAnswer: " + filler("bare-answer", 800) + "\n\nQuestion: and then?")
    counted = [h for h in report() if "arrivalsPerS" in h]
    assert [h["address"] for h in counted] == [second.served_by], counted
    assert 0.05 < counted[0]["arrivalsPerS"] <= 0.1, counted


@pytest.mark.parametrize("layout", ["shared", "sidecars"])
def test_the_gateways_share_their_pending_prefill(stack_factory, wasm_path, collector_binary, layout):
    """One collector pushing to both gateways (shared), or a collector per
    gateway that pushes to its own and reads the other's load
    (--peer-gateways: the sidecar layout), gives each gateway the other's
    pending prefill per replica: new conversations sent through one
    gateway avoid the replicas where the other has long prompts waiting
    for their first byte, though the engines' metrics (pinned, no queue)
    show nothing of them."""
    a = stack_factory(replicas=4, concurrency=2, ingest_token=TOKEN)
    b = stack_factory(fleet_of=a, concurrency=2, ingest_token=TOKEN)
    for host in a.live_hosts:
        a.replica_control(host, ready=True, running=2, models=["test-model"], kv=0.3, waiting=0)
    port = harness.free_ports(1)[0]
    if layout == "shared":
        collector = a.start_collector(binary=collector_binary, gateways=[a.ingest_url, b.ingest_url],
                                      interval_ms=COLLECTOR_INTERVAL_MS, metrics_port=port, collector_id="shared")
        readers = {a.ingest_url: collector, b.ingest_url: collector}
    else:
        collector = a.start_collector(binary=collector_binary, interval_ms=COLLECTOR_INTERVAL_MS,
                                      metrics_port=port, collector_id="sidecar-a",
                                      extra_args=["--peer-gateways", b.ingest_url])
        other = b.start_collector(binary=collector_binary, interval_ms=COLLECTOR_INTERVAL_MS,
                                  metrics_port=harness.free_ports(1)[0], collector_id="sidecar-b",
                                  extra_args=["--peer-gateways", a.ingest_url])
        # Each sidecar reads the other gateway's load and pushes to its own only.
        readers = {b.ingest_url: collector, a.ingest_url: other}
    for gw in (a, b):
        wait_until(lambda gw=gw: metric(gw, "kvroute_fleet_hosts") == 4, 10.0, "four replicas in the snapshot")

    # The load endpoint answers the bearer token only, and only GET.
    assert gateway_load(b)[0] == 200
    assert gateway_load(b, token=None)[0] == 401
    assert gateway_load(b, token="wrong-token-0123456789abcdef")[0] == 401
    assert gateway_load(b, method="POST")[0] == 405

    # Two long prompts (about 30k tokens each: a second of prefill at
    # prefillTokensPerS, so slow snapshots here do not drain them) held at
    # their replicas by b.
    pool = ThreadPoolExecutor(max_workers=2)
    held = [pool.submit(send, b.gateway_url, CHAT,
                        json_body=chat_body(user_text=f"held {i} " + filler(f"held-{i}", 120_000)),
                        session=f"held-{i}", headers={DELAY_HEADER: "6000"}, timeout=20)
            for i in range(2)]
    pool.shutdown(wait=False)
    loaded: set[str] = set()

    def b_has_pending() -> bool:
        status, body = gateway_load(b)
        if status != 200:
            return False
        loaded.clear()
        loaded.update(h["address"] for h in body["hosts"] if h["prefillPendingTokens"] >= 5000)
        return len(loaded) > 0

    wait_until(b_has_pending, 5.0, "b's held prompts in its load table")
    assert len(loaded) <= 2, loaded
    # A collector round or two, so that a's snapshot carries b's figures.
    time.sleep(3 * COLLECTOR_INTERVAL_MS / 1000)
    placed = []
    for c in range(12):
        r = send(a.gateway_url, CHAT, json_body=chat_body(user_text=f"new conversation {c} " + filler(f"new-{c}", 2000)),
                 session=f"new-{c}")
        assert r.status == 200, r.describe()
        placed.append(r.served_by)
    print(f"\n[gateways] b holds prompts on {sorted(loaded)}; a placed 12 new conversations on {Counter(placed)}")
    assert not loaded & set(placed), f"a sent new conversations where b's prompts wait: {Counter(placed)}"
    assert len(set(placed)) >= 2, placed
    for url, reader in readers.items():
        text = harness.http_get(reader.metrics_url)[1]
        assert f'kvroute_collector_load_reads_total{{gateway="{url}",result="ok"}}' in text, text
    if layout == "sidecars":
        # Nothing pushed to a peer: each gateway's snapshots are its own sidecar's.
        text = harness.http_get(collector.metrics_url)[1]
        assert f'gateway="{b.ingest_url}",status=' not in text, text
        assert "kvroute_collector_peer_gateways 1" in text, text
    for f in held:
        assert f.result().status == 200


def shared_collector_pair(stack_factory, collector_binary, overrides: dict):
    """Gateways a and b on four idle replicas, one collector pushing to both
    (so each learns the other's load, placements and last blocks)."""
    a = stack_factory(replicas=4, concurrency=2, ingest_token=TOKEN, plugin_overrides=overrides)
    b = stack_factory(fleet_of=a, concurrency=2, ingest_token=TOKEN, plugin_overrides=overrides)
    for host in a.live_hosts:
        a.replica_control(host, ready=True, running=2, models=["test-model"], kv=0.3, waiting=0)
    a.start_collector(binary=collector_binary, gateways=[a.ingest_url, b.ingest_url],
                      interval_ms=COLLECTOR_INTERVAL_MS, metrics_port=harness.free_ports(1)[0],
                      collector_id="shared")
    for gw in (a, b):
        wait_until(lambda gw=gw: metric(gw, "kvroute_fleet_hosts") == 4, 10.0, "four replicas in the snapshot")
    return a, b


def hold_long_prompt(a: harness.Stack, tag: str):
    """About 30k tokens held 4 s before their first byte, sent through a:
    pending prefill on one replica, as a sees it. Returns the request's
    future and the set holding that replica's address."""
    pool = ThreadPoolExecutor(max_workers=1)
    held = pool.submit(send, a.gateway_url, CHAT,
                       json_body=chat_body(user_text="held " + filler(tag, 120_000)),
                       session=tag, headers={BODY_DELAY_HEADER: "4000"}, timeout=20)
    pool.shutdown(wait=False)
    busy: set[str] = set()

    def a_has_pending() -> bool:
        status, body = gateway_load(a)
        if status != 200:
            return False
        busy.clear()
        busy.update(h["address"] for h in body["hosts"] if h["prefillPendingTokens"] >= 5000)
        return len(busy) == 1

    wait_until(a_has_pending, 5.0, "the held prompt in a's load table")
    return held, busy


def test_a_key_placed_off_home_follows_to_the_other_gateway(stack_factory, wasm_path, collector_binary):
    """Key memory (`fleet.coldHomeShare`) across two gateways and one
    collector: every key's first request that gateway a places, off its
    busy home or on its home, is reported in a's load (`GET
    /v1/fleet/load?placed=1`), the collector hands it to b in its
    snapshots, and b sends the key's next request, which it has never
    seen, to the same replica (for a key that left its home: rather than
    to the home). At share 0 a cold prompt credits its home with nothing,
    so the home's pending prefill alone moves it."""
    overrides = {"fleet": {"coldHomeShare": 0}, "explainHeader": True}
    a, b = shared_collector_pair(stack_factory, collector_binary, overrides)
    held, busy = hold_long_prompt(a, "held")
    # New keys, each its first request: those whose home is the busy
    # replica go elsewhere (a quarter of them; 24 keys leave none with
    # probability 0.1 %), the rest go home. Every one is reported.
    served: dict[str, str] = {}
    for i in range(24):
        r = send(a.gateway_url, CHAT, json_body=chat_body(user_text=f"question {i} " + filler(f"q{i}", 8000)),
                 session=f"k{i}")
        assert r.status == 200, r.describe()
        assert r.served_by not in busy, (r.served_by, busy)
        served[r.key] = r.served_by
    status, report = gateway_load(a)
    assert status == 200 and "placed" not in report, report
    status, report = gateway_load(a, path=LOAD_PATH + "?placed=1")
    assert status == 200, report
    placed = {p["key"]: p["address"] for p in report["placed"]}
    assert set(served) <= set(placed), (placed, served)
    assert all(placed[k] == v for k, v in served.items()), (placed, served)
    moved = [p for p in report["placed"] if p["key"] in served]
    assert held.result().status == 200
    # The busy replica is idle again; b has never seen these keys. Each
    # one's next request goes where a put it, once a collector round has
    # carried it over.
    time.sleep(3 * COLLECTOR_INTERVAL_MS / 1000)
    sessions = {r_key: f"k{i}" for i, r_key in enumerate(served)}
    for p in moved:
        follow = send(b.gateway_url, CHAT,
                      json_body=chat_body(user_text="another question " + filler(f"next-{p['key']}", 8000)),
                      session=sessions[p["key"]])
        assert follow.status == 200, follow.describe()
        print(f"\n[gateways] key {p['key']}: a placed it on {p['address']} (busy {sorted(busy)}); "
              f"b sent its next request to {follow.served_by}")
        assert follow.served_by == p["address"], follow.describe()
    # Every placement was counted; none left a's ring (256 entries) before
    # a report carried it.
    assert metric(a, "kvroute_placements_noted_total") >= len(served)
    assert metric(a, "kvroute_placements_lost_total") == 0


def test_a_conversations_next_turn_follows_its_last_block_to_the_other_gateway(
        stack_factory, wasm_path, collector_binary):
    """Two gateways, one collector: gateway a sends each conversation's first
    turn, off its busy home for those whose home holds a long prompt, and
    reports each turn's last block (`GET /v1/fleet/load?lastBlocks=1`); the
    collector hands them to b, which sends each second turn, never seen
    there before, where the first turn went. Key memory is off
    (`coldHomeShare` and `sharedOnlyHomeShare` at `homeCachedShare`), so
    only the last blocks tell b: without them b would send a moved
    conversation home."""
    overrides = {"fleet": {"coldHomeShare": 0.95, "sharedOnlyHomeShare": 0.95}, "explainHeader": True}
    a, b = shared_collector_pair(stack_factory, collector_binary, overrides)
    # The collector has read a's last blocks: a writes them from now on.
    wait_until(lambda: metric(b, "kvroute_ingest_accepted_total") >= 3, 10.0, "a few collector rounds")
    held, busy = hold_long_prompt(a, "held-last")

    def conversation(i: int, n: int) -> list[dict]:
        messages = [{"role": "user", "content": f"conversation {i}: " + filler(f"last-{i}", 8000)}]
        if n > 1:
            messages += [{"role": "assistant", "content": "an answer " * 10},
                         {"role": "user", "content": f"and a follow-up to {i}"}]
        return messages

    first: dict[int, str] = {}
    for i in range(24):
        r = send(a.gateway_url, CHAT, json_body=chat_body(conversation(i, 1)), session=f"last-{i}")
        assert r.status == 200, r.describe()
        assert r.served_by not in busy, (r.served_by, busy)
        first[i] = r.served_by
    status, report = gateway_load(a, path=LOAD_PATH + "?placed=1")
    assert status == 200 and "lastBlocks" not in report, report
    status, report = gateway_load(a, path=LOAD_PATH + "?lastBlocks=1")
    assert status == 200, report
    reported = {x["address"] for x in report["lastBlocks"]}
    assert len(report["lastBlocks"]) >= len(first), report
    assert set(first.values()) <= reported, (reported, first)
    assert held.result().status == 200
    # The busy replica is idle again. b has seen none of these
    # conversations; each second turn goes where a sent the first.
    time.sleep(3 * COLLECTOR_INTERVAL_MS / 1000)
    for i, went in first.items():
        r = send(b.gateway_url, CHAT, json_body=chat_body(conversation(i, 2)), session=f"last-{i}")
        assert r.status == 200, r.describe()
        assert r.served_by == went, (i, went, busy, r.describe())
    print(f"\n[gateways] {len(first)} conversations: a sent their first turns to "
          f"{dict(Counter(first.values()))} (busy {sorted(busy)}); b sent every second turn there")
    assert metric(a, "kvroute_last_blocks_noted_total") >= len(first)
    assert metric(a, "kvroute_last_blocks_lost_total") == 0

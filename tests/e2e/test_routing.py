"""Routing behaviour through a real Envoy 1.40 with the kvroute wasm filter.

Each module-level stack is 4 loopback replicas (tests/e2e/upstream.py) behind
Envoy; the filter runs with explainHeader on, so every answer says what it
decided (x-kvroute-decision) and the replica says who served it (x-served-by)
and what destination header it received.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness
from conftest import start_module_stack
from checks import KEY_RE, check_routed
from harness import chat_body, filler, send

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_module_stack(request, replicas=4, concurrency=2)


def conversation_turns(first_user: str, turns: int, system: str | None = None) -> list[list[dict]]:
    """The growing message lists a chat client re-sends on every turn."""
    messages: list[dict] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": first_user if t == 0 else f"follow-up question {t}"})
        out.append(list(messages))
        messages.append({"role": "assistant", "content": f"answer number {t} " * 8})
    return out


# ------------------------------------------------------------- stickiness


def test_session_header_keeps_conversation_on_one_replica(stack):
    for c in range(5):
        session = f"conv-header-{c}"
        served, keys = set(), set()
        for messages in conversation_turns(f"conversation {c}: explain KV caches", turns=6):
            r = send(stack.gateway_url, CHAT, json_body=chat_body(messages), session=session)
            check_routed(r, stack, "session")
            assert KEY_RE.match(r.key or ""), r.describe()
            served.add(r.served_by)
            keys.add(r.key)
        assert len(served) == 1, f"{session} moved between replicas: {served}"
        assert len(keys) == 1, f"{session} key changed between turns: {keys}"


@pytest.mark.parametrize(
    "path,field",
    [
        (CHAT, {"prompt_cache_key": "pck"}),
        (CHAT, {"user": "user"}),
        ("/v1/responses", {"prompt_cache_key": "pck"}),
        ("/v1/messages", {"metadata": {"user_id": "anthropic-user"}}),
    ],
    ids=["chat-prompt_cache_key", "chat-user", "responses-prompt_cache_key", "messages-metadata.user_id"],
)
def test_body_session_key_keeps_conversation_on_one_replica(stack, path, field):
    for c in range(4):
        served = set()
        # Make the value distinct per conversation, keep the field's shape.
        value = {k: (v if isinstance(v, str) else dict(v)) for k, v in field.items()}
        for k, v in value.items():
            if isinstance(v, str):
                value[k] = f"{v}-{c}"
            else:
                value[k] = {kk: f"{vv}-{c}" for kk, vv in v.items()}
        for messages in conversation_turns(f"body-key conversation {c} about {path}", turns=4):
            if path == "/v1/responses":
                body = {"model": "test-model", "input": messages, "max_output_tokens": 64, **value}
            elif path == "/v1/messages":
                body = {"model": "test-model", "max_tokens": 64, "messages": messages, **value}
            else:
                body = chat_body(messages, **value)
            r = send(stack.gateway_url, path, json_body=body)
            check_routed(r, stack, "session")
            served.add(r.served_by)
        assert len(served) == 1, f"conversation {c} ({value}) moved between replicas: {served}"


def test_growing_conversation_without_session_key_stays(stack):
    """No session key: the first 16 blocks (4 KiB) of the message stream
    are identical across turns, so every turn maps to the same replica."""
    for c in range(5):
        document = filler(f"document-{c}", 6000)
        served, keys = set(), set()
        for messages in conversation_turns(f"Summarise this:\n{document}", turns=5):
            r = send(stack.gateway_url, CHAT, json_body=chat_body(messages))
            check_routed(r, stack, "prefix")
            served.add(r.served_by)
            keys.add(r.key)
        assert len(served) == 1, f"conversation {c} moved between replicas: {served}"
        assert len(keys) == 1, f"conversation {c} key changed: {keys}"


# ----------------------------------------------------------------- spread


def test_sessions_spread_over_replicas(stack):
    served = Counter()
    for s in range(40):
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="hi"), session=f"spread-{s}")
        check_routed(r, stack, "session")
        served[r.served_by] += 1
    assert len(served) >= 3, f"40 sessions used only {dict(served)}"


def test_conversations_without_key_spread_over_replicas(stack):
    served = Counter()
    for s in range(40):
        first = f"{s:04d} " + filler(f"topic-{s}", 600)
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text=first))
        check_routed(r, stack, "prefix")
        served[r.served_by] += 1
    assert len(served) >= 3, f"40 distinct conversations used only {dict(served)}"


def test_shared_long_prefix_colocates_while_rare(stack):
    """8 KB system prompts, different short questions, no session key. Each
    conversation is keyed by its text up to its first question, and knows
    the system prompt as its shared prefix (the same rule as for sessions,
    `prefixAffinityShare`): a prompt that carries a small share of a
    worker's requests takes the prompt's key (one replica, where it is
    cached); once it carries more than a quarter of one replica's share,
    each conversation keeps its own key and they spread."""
    def ask(system: str, question: str) -> harness.Reply:
        r = send(stack.gateway_url, CHAT, json_body=chat_body(system=system, user_text=question))
        check_routed(r, stack, "prefix")
        return r

    hot = filler("shared-system-prompt", 8192)
    late_served, late_keys = Counter(), set()
    for q in range(80):
        r = ask(hot, f"question {q}: what is {q} squared?")
        if q >= 60:
            late_served[r.served_by] += 1
            late_keys.add(r.key)
    # By then the prompt is most of each worker's recent requests.
    assert len(late_keys) == 20, late_keys
    assert len(late_served) >= 2, f"popular-prompt conversations all on {dict(late_served)}"
    rare = filler("rare-system-prompt", 8192)
    served, keys = Counter(), set()
    for q in range(3):
        r = ask(rare, f"question {q}: what is {q} cubed?")
        served[r.served_by] += 1
        keys.add(r.key)
    assert len(served) == 1, f"rare shared-prefix requests spread over {dict(served)}"
    assert len(keys) == 1, keys


def test_bare_prompt_conversations_are_keyed_past_their_shared_prompt(stack):
    """/v1/completions: each turn re-sends the whole conversation as one
    prompt string, every conversation opens with the same 8 KB, and no
    request carries a session. Nothing in the body says where the shared
    part ends; the filter learns it from two conversations that differ
    after it (docs/fleet-state.md, "Bare prompts"). Once the prompt is most
    of the traffic, each conversation is keyed by its own text after it:
    its turns keep one key and one replica, and conversations spread."""
    shared = filler("bare-shared-prompt", 8192)

    def turns(c: int, n: int) -> list[str]:
        text = f"{shared}\n\nUser: conversation {c} asks " + filler(f"question-{c}", 400)
        out = []
        for t in range(n):
            out.append(text)
            text += "\n\nAssistant: " + filler(f"answer-{c}-{t}", 600) + f"\n\nUser: and then {t}?"
        return out

    def ask(prompt: str) -> harness.Reply:
        body = {"model": "test-model", "prompt": prompt, "max_tokens": 32}
        r = send(stack.gateway_url, "/v1/completions", json_body=body)
        check_routed(r, stack, "prefix")
        return r

    # Every worker sees conversations differ after the prompt, and the
    # prompt becomes most of its recent requests.
    for c in range(60):
        ask(turns(c, 1)[0])
    served_by, keys = {}, {}
    for c in range(100, 112):
        replies = [ask(p) for p in turns(c, 4)]
        served_by[c] = {r.served_by for r in replies}
        keys[c] = {r.key for r in replies}
    for c in served_by:
        assert len(keys[c]) == 1, f"conversation {c} changed key between turns: {keys[c]}"
        assert len(served_by[c]) == 1, f"conversation {c} moved between replicas: {served_by[c]}"
    distinct = {k for ks in keys.values() for k in ks}
    assert len(distinct) == 12, f"12 conversations share keys: {keys}"
    replicas = Counter(next(iter(s)) for s in served_by.values())
    assert len(replicas) >= 2, f"12 conversations over one shared prompt all on {dict(replicas)}"


# ----------------------------------------------------------- bounded load


def test_hot_key_spills_under_load(stack):
    """12 concurrent 20 KB requests of one session, each held 1.5 s by the
    replica: the session's replica exceeds (1+epsilon) x average and the
    rest spill to other replicas. Afterwards the session follows its prompt
    to the replica the prefix index last saw it sent to."""
    session = "hot-session"
    prompt = filler("hot", 20_000)
    body = chat_body(user_text=prompt, max_tokens=512)

    # Where the session lives while the fleet is idle.
    home = send(stack.gateway_url, CHAT, json_body=body, session=session)
    check_routed(home, stack, "session")

    def one(_):
        return send(
            stack.gateway_url, CHAT, json_body=body, session=session,
            headers={"x-upstream-delay-ms": "1500"}, timeout=30,
        )

    with ThreadPoolExecutor(max_workers=12) as pool:
        replies = list(pool.map(one, range(12)))
    for r in replies:
        check_routed(r, stack)
    served = Counter(r.served_by for r in replies)
    reasons = Counter(r.reason for r in replies)
    assert len(served) > 1, f"hot key never spilled: {dict(served)}, reasons {dict(reasons)}"
    assert reasons["spill"] > 0, f"no reason=spill among {dict(reasons)}"
    assert reasons["session"] > 0, f"the session's own replica got nothing: {dict(reasons)}"
    assert all(r.served_by == home.served_by for r in replies if r.reason == "session")
    assert all(r.served_by != home.served_by for r in replies if r.reason == "spill")

    # Load is released when responses finish. The session then goes where the
    # prefix index last saw its prompt sent: a replica it spilled to (the
    # index keeps one replica per block, last writer wins, and the last
    # decisions of the burst were spills), whose evidence of the whole prompt
    # outweighs the share assumed cached at the home. The same rule as with a
    # fleet snapshot (crates/kvroute-core/src/decide.rs, module doc). It
    # stays there, and expects its prompt cached there.
    spilled_to = {r.served_by for r in replies if r.reason == "spill"}
    after = []
    for _ in range(3):
        r = send(stack.gateway_url, CHAT, json_body=body, session=session)
        check_routed(r, stack, "session")
        assert int(r.decision.get("expected_cached", "0")) > 0, r.describe()
        after.append(r)
    assert len({r.served_by for r in after}) == 1, [r.describe() for r in after]
    assert after[0].served_by in spilled_to, (after[0].describe(), spilled_to)


# -------------------------------------------------------------- fallbacks


def test_fallback_when_primary_is_down(stack_factory, wasm_path):
    """A 5th configured host has no listener: requests whose primary is that
    host are retried on the next address of the destination header."""
    stack = stack_factory(replicas=4, dead_hosts=1, concurrency=2)
    dead = stack.dead_host_addresses[0]
    hit_dead = 0
    for s in range(60):
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="x"), session=f"fb-{s}")
        check_routed(r, stack, "session")
        assert r.served_by != dead
        first_live = next(h for h in r.destination if h != dead)
        assert r.served_by == first_live, f"not the first live address of the list: {r.describe()}"
        if r.decided_host == dead:
            hit_dead += 1
            assert r.served_by == r.destination[1], r.describe()
        else:
            assert r.served_by == r.decided_host, r.describe()
    assert hit_dead > 0, "no session had the dead host as primary; the test proved nothing"


def test_a_replicas_503_goes_to_the_fallback(stack_factory, wasm_path):
    """A replica that just went bad answers 503 before any snapshot says so:
    the shipped route retries on the next address of the destination header,
    and no client sees the 503. Other 5xx are passed through."""
    stack = stack_factory(replicas=4, concurrency=2)
    bad = stack.live_hosts[1]
    stack.replica_control(bad, answer_status=503)
    hit_bad = 0
    for s in range(60):
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="x"), session=f"r503-{s}")
        assert r.status == 200 and r.decided_host in stack.hosts, r.describe()
        assert r.served_by != bad, r.describe()
        if r.decided_host == bad:
            hit_bad += 1
            assert r.served_by == r.destination[1], r.describe()
        else:
            assert r.served_by == r.decided_host, r.describe()
    assert hit_bad > 0, "no session had the 503ing replica as primary; the test proved nothing"
    # A 500 is not retried: it reaches the client from the replica itself.
    stack.replica_control(bad, answer_status=500)
    statuses = Counter()
    for s in range(60):
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="x"), session=f"r503-{s}")
        statuses[r.status] += 1
        if r.status == 500:
            assert r.served_by == bad, r.describe()
    assert statuses[500] == hit_bad, statuses


# ---------------------------------------------------------- spoofed header


@pytest.mark.parametrize(
    "variant", ["lower-case", "upper-case", "repeated", "list", "http2"],
)
def test_client_destination_header_is_ignored(stack, variant):
    target = stack.live_hosts[0]
    other = stack.live_hosts[1]
    name = harness.DESTINATION_HEADER
    spoof = {
        "lower-case": [(name, target)],
        "upper-case": [(name.upper(), target)],
        "repeated": [(name, target), (name, other)],
        "list": [(name, f"{target},{other},{target}")],
        "http2": [(name, target)],
    }[variant]
    served = Counter()
    for s in range(20):
        r = send(
            stack.gateway_url, CHAT, json_body=chat_body(user_text="hello"),
            session=f"spoof-{variant}-{s}", headers=spoof, http2=(variant == "http2"),
        )
        check_routed(r, stack, "session")
        # The replica saw exactly one destination header: the filter's.
        assert r.body["destination_header"].count(",") == len(r.destination) - 1
        assert r.served_by == r.decided_host
        served[r.served_by] += 1
    assert len(served) >= 3, f"routing followed the client's header? {dict(served)}"


# ------------------------------------------------------------ ORIGINAL_DST


def test_original_dst_variant_routes_to_the_filter_choice(stack_factory, wasm_path):
    """envoy-config/envoy-original-dst.yaml: one address in the header, the
    cluster connects exactly there; a client's header must not steer it."""
    stack = stack_factory(replicas=4, base=harness.ENVOY_CONFIG_DIR / "envoy-original-dst.yaml")
    target = stack.live_hosts[0]
    served = Counter()
    for s in range(24):
        r = send(
            stack.gateway_url, CHAT, json_body=chat_body(user_text="odst"), session=f"odst-{s}",
            headers=[(harness.DESTINATION_HEADER, target), (harness.DESTINATION_HEADER, "10.255.255.1:80")],
        )
        check_routed(r, stack, "session")  # checks len(destination) == 1 + fallbacks == 1
        served[r.served_by] += 1
    assert len(served) >= 3, f"routing followed the client's header? {dict(served)}"


# ------------------------------------------------------------ determinism


def test_same_session_same_replica_across_workers(stack_factory, wasm_path):
    """--concurrency 4: one VM per worker; fresh connections spread over the
    workers, and every worker must pick the same replica for a session."""
    stack = stack_factory(replicas=4, concurrency=4)
    for s in range(6):
        session = f"det-{s}"
        served, keys = set(), set()
        for i in range(16):
            r = send(
                stack.gateway_url, CHAT, json_body=chat_body(user_text=f"turn {i}"),
                session=session, fresh_connection=True,
            )
            check_routed(r, stack, "session")
            served.add(r.served_by)
            keys.add(r.key)
        assert len(served) == 1, f"{session} landed on {served}"
        assert len(keys) == 1, f"{session} keys differ between workers: {keys}"

    # Prove the connections really reached several workers.
    stats = stack.envoy.admin("/stats?filter=worker_.*downstream_cx_total")
    per_worker = {
        line.split(":")[0]: int(line.split(":")[1])
        for line in stats.splitlines()
        if f"127.0.0.1_{stack.gateway_port}.worker_" in line
    }
    assert sum(1 for v in per_worker.values() if v > 0) >= 2, per_worker


# ---------------------------------------------------------------- metrics


def test_kvroute_metrics_exported(stack):
    """kvroute_* series are in /stats/prometheus and count decisions by reason
    (summed over all worker VMs)."""

    def decisions() -> dict[str, float]:
        metrics = stack.envoy.kvroute_metrics()
        assert metrics, "no kvroute_* series in /stats/prometheus"
        found = {k: v for k, v in metrics.items() if k.startswith("kvroute_decision")}
        assert found, f"no kvroute_decision* series among {sorted(metrics)}"
        return found

    def by_reason(series: dict[str, float], reason: str) -> float:
        return sum(v for k, v in series.items() if reason in k)

    before = decisions()
    for s in range(5):
        check_routed(send(stack.gateway_url, CHAT, json_body=chat_body(user_text="m"), session=f"metrics-{s}"),
                     stack, "session")
    check_routed(send(stack.gateway_url, "/v1/models", method="GET"), stack, "fallback")
    after = decisions()
    assert by_reason(after, "session") - by_reason(before, "session") == 5, (before, after)
    assert by_reason(after, "fallback") - by_reason(before, "fallback") == 1, (before, after)

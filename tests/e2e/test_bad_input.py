"""Hostile and unusual requests: the filter answers with a routing decision,
never a 5xx of its own, and keeps working afterwards.

Every case goes through a real Envoy + kvroute in front of 4 replicas and
checks: HTTP 200 from a replica, the reason in x-kvroute-decision (fallback
for what cannot be parsed, session/prefix for good requests), the replica got
a well-formed destination header, and a normal request right after still
routes by session.
"""

from __future__ import annotations

import json

import pytest

import harness
from conftest import start_module_stack
from harness import chat_body, filler, send
from checks import KEY_RE, check_routed

CHAT = "/v1/chat/completions"
# Small enough to send an over-cap body cheaply, big enough that the deeply
# nested documents below are parsed (and must be refused by the parser).
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def stack(request, wasm_path) -> harness.Stack:
    return start_module_stack(request, replicas=4, concurrency=2, plugin_overrides={"maxBodyBytes": MAX_BODY})


def j(doc) -> bytes:
    return json.dumps(doc).encode()


def chunks(data: bytes, size: int = 1000):
    """An iterator body: httpx sends it chunked, without Content-Length."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


GOOD_CHAT = j(chat_body(user_text="What is a KV cache?"))

# id, method, path, body (bytes | callable -> iterable | None), headers, http2, expected reason
CASES = [
    # --- well-formed requests: routed by their key -------------------------
    ("chat-session-header", "POST", CHAT, GOOD_CHAT, {"x-session-id": "good-1"}, False, "session"),
    ("chat-no-key", "POST", CHAT, GOOD_CHAT, {}, False, "prefix"),
    ("completions-user", "POST", "/v1/completions",
     j({"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "user": "u-1"}), {}, False, "session"),
    ("responses-prompt-cache-key", "POST", "/v1/responses",
     j({"model": "m", "input": "hello", "prompt_cache_key": "pck-1"}), {}, False, "session"),
    ("messages-metadata-user", "POST", "/v1/messages",
     j({"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "anthropic-1"}}), {}, False, "session"),
    ("chat-content-parts", "POST", CHAT,
     j(chat_body([{"role": "user", "content": [{"type": "text", "text": "describe"},
                                              {"type": "image_url", "image_url": {"url": "data:x"}}]}])),
     {"x-session-id": "parts-1"}, False, "session"),
    ("utf8-multibyte", "POST", CHAT, j(chat_body(user_text="héllo wörld ✓ 日本語 🙂")),
     {"x-session-id": "utf8-1"}, False, "session"),
    ("huge-max-tokens", "POST", CHAT, j(chat_body(user_text="long answer please", max_tokens=10**15)),
     {"x-session-id": "huge-1"}, False, "session"),
    ("query-string", "POST", CHAT + "?api-version=2024-10-21", GOOD_CHAT,
     {"x-session-id": "qs-1"}, False, "session"),
    ("chunked-upload", "POST", CHAT, lambda: chunks(j(chat_body(user_text=filler("chunked", 5000)))),
     {"x-session-id": "chunked-1"}, False, "session"),
    ("http2-good", "POST", CHAT, GOOD_CHAT, {"x-session-id": "h2-1"}, True, "session"),
    ("http2-chunked-no-length", "POST", CHAT, lambda: chunks(GOOD_CHAT, 10),
     {"x-session-id": "h2-2"}, True, "session"),
    # --- unparsable or not for kvroute: fallback ----------------------------
    ("invalid-json", "POST", CHAT, b'{"model": "m", "messages": [', {}, False, "fallback"),
    ("not-json-at-all", "POST", CHAT, b"hello there, this is plain text", {}, False, "fallback"),
    ("whitespace-only", "POST", CHAT, b"   \n\t  ", {}, False, "fallback"),
    ("top-level-array", "POST", CHAT, b"[1, 2, 3]", {}, False, "fallback"),
    ("messages-is-number", "POST", CHAT, j({"model": "m", "messages": 42}), {}, False, "fallback"),
    ("model-is-object", "POST", CHAT,
     j({"model": {"name": "m"}, "messages": [{"role": "user", "content": "hi"}]}), {}, False, "fallback"),
    ("max-tokens-is-string", "POST", CHAT,
     j({"model": "m", "max_tokens": "64", "messages": [{"role": "user", "content": "hi"}]}), {}, False, "fallback"),
    ("deeply-nested-arrays", "POST", CHAT, b"[" * 100_000, {}, False, "fallback"),
    ("deeply-nested-in-messages", "POST", CHAT,
     b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, False, "fallback"),
    ("deeply-nested-objects", "POST", CHAT, b'{"a":' * 40_000 + b"1" + b"}" * 40_000, {}, False, "fallback"),
    ("empty-body", "POST", CHAT, b"", {}, False, "fallback"),
    ("over-cap", "POST", CHAT, j(chat_body(user_text=filler("big", 2 * MAX_BODY))), {}, False, "fallback"),
    ("over-cap-chunked", "POST", CHAT, lambda: chunks(j(chat_body(user_text=filler("bigc", 2 * MAX_BODY))), 65536),
     {}, False, "fallback"),
    ("non-utf8", "POST", CHAT,
     b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe\xc3\x28 bad"}]}', {}, False, "fallback"),
    ("raw-nul-in-string", "POST", CHAT,
     b'{"model":"m","messages":[{"role":"user","content":"a\x00b"}]}', {}, False, "fallback"),
    ("truncated-unicode-escape", "POST", CHAT,
     b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', {}, False, None),
    ("get-models", "GET", "/v1/models", None, {}, False, "fallback"),
    ("get-chat", "GET", CHAT, None, {}, False, "fallback"),
    ("other-endpoint", "POST", "/v1/embeddings", j({"model": "m", "input": "embed me"}), {}, False, "fallback"),
    ("http2-invalid-json", "POST", CHAT, b"{nope", {}, True, "fallback"),
    ("http2-get", "GET", "/v1/models", None, {}, True, "fallback"),
]


@pytest.mark.parametrize(
    "case_id,method,path,body,headers,http2,reason", CASES, ids=[c[0] for c in CASES]
)
def test_bad_input(stack, case_id, method, path, body, headers, http2, reason):
    content = body() if callable(body) else body
    r = send(
        stack.gateway_url, path, method=method, content=content, headers=headers,
        http2=http2, fresh_connection=http2, timeout=20,
    )
    if http2:
        assert r.response.http_version == "HTTP/2", r.response.http_version
    check_routed(r, stack, reason)
    if reason is None:
        # Lone surrogate escape: valid JSON syntax, not valid Unicode. Either
        # answer is acceptable as long as it routes.
        assert r.reason in ("prefix", "fallback"), r.describe()
    if r.reason in ("session", "prefix"):
        assert KEY_RE.match(r.key or ""), r.describe()
    # The replica received the whole body.
    if isinstance(body, bytes):
        assert r.body["request_bytes"] == len(body), r.describe()

    # The filter is still healthy for the next request.
    after = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="still ok?"), session="after-bad-input")
    check_routed(after, stack, "session")


def test_many_bad_requests_leave_routing_intact(stack):
    """A burst of garbage must not leak in-flight load or change decisions."""
    before = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="x"), session="steady")
    check_routed(before, stack, "session")
    for i in range(50):
        r = send(stack.gateway_url, CHAT, content=b"{" * (i + 1))
        check_routed(r, stack, "fallback")
    for _ in range(5):
        r = send(stack.gateway_url, CHAT, json_body=chat_body(user_text="x"), session="steady")
        check_routed(r, stack, "session")
        assert r.served_by == before.served_by, r.describe()


def test_unparsed_requests_are_counted(stack):
    """The refusals above show up in kvroute_unparsed_* (names not pinned)."""
    unparsed = {k: v for k, v in stack.envoy.kvroute_metrics().items() if k.startswith("kvroute_unparsed")}
    assert unparsed, "no kvroute_unparsed* series"
    assert sum(unparsed.values()) >= 50, unparsed


def test_envoy_never_logged_a_wasm_crash(stack):
    """Runs last in this module: no VM trap/panic after all the input above."""
    log = stack.envoy.log_text()
    for marker in ("Function: proxy_on", "panicked", "wasm trap", "Wasm VM failed"):
        assert marker not in log, f"{marker!r} in Envoy log:\n{stack.envoy.log_tail(60)}"

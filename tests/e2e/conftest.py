"""Fixtures for the kvroute end-to-end tests.

Stacks (replicas + Envoy + kvroute) are started per test module and stopped
by PID when the module is done. Tests that need the built filter skip with a
clear reason while target/wasm32-wasip1/release/kvroute.wasm does not exist
(KVROUTE_REQUIRE_WASM=1 turns that into a failure; KVROUTE_WASM=path tests
another build; KVROUTE_E2E_KEEP=1 keeps each stack's logs and config).

Tests that run kvroute-collector skip likewise while it is not built
(target/release or target/debug, or KVROUTE_COLLECTOR=path);
KVROUTE_REQUIRE_COLLECTOR=1 turns that into a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.fixture(scope="session")
def wasm_path() -> Path:
    if not harness.wasm_available():
        if os.environ.get("KVROUTE_REQUIRE_WASM") == "1":
            # CI sets this: a missing build must fail, not skip quietly.
            pytest.fail(harness.WASM_MISSING_REASON + " and KVROUTE_REQUIRE_WASM=1")
        pytest.skip(harness.WASM_MISSING_REASON)
    return harness.WASM_PATH


@pytest.fixture(scope="session")
def collector_binary() -> Path:
    found = harness.collector_binary()
    if found is None:
        reason = harness.collector_missing_reason()
        if os.environ.get("KVROUTE_REQUIRE_COLLECTOR") == "1":
            # CI sets this once it builds the collector: a missing binary must fail.
            pytest.fail(reason + " and KVROUTE_REQUIRE_COLLECTOR=1")
        pytest.skip(reason)
    return found


@pytest.fixture
def stack_factory(request):
    """Start stacks inside a test; all are stopped when the test ends."""
    started: list[harness.Stack] = []

    def make(**kwargs) -> harness.Stack:
        stack = harness.Stack(**kwargs)
        started.append(stack)
        return stack.start()

    yield make
    for stack in reversed(started):
        stack.stop()


def start_module_stack(request, **kwargs) -> harness.Stack:
    """For module-scoped fixtures: start a stack and register its stop."""
    stack = harness.Stack(**kwargs)
    request.addfinalizer(stack.stop)
    return stack.start()


ANSWERS_TOKEN = "e2e-ingest-token-0123456789abcdef"


def start_answers_stack(request) -> harness.Stack:
    """4 replicas with their modelled prefix cache on (answers carry usage
    with cached tokens), snapshots pushed from Python, data stale after 10 s."""
    s = start_module_stack(
        request, replicas=4, concurrency=2, ingest_token=ANSWERS_TOKEN,
        plugin_overrides={"fleet": {"staleAfterMs": 10_000}},
    )
    for h in s.live_hosts:
        s.replica_control(h, prefix_cache=True, flush_cache=True)
    return s


def ask_chat(stack: harness.Stack, body: dict) -> harness.Reply:
    """A chat request that must succeed on the replica the filter chose."""
    r = harness.send(stack.gateway_url, "/v1/chat/completions", json_body=body)
    assert r.status == 200, r.describe()
    assert r.served_by == r.decided_host, r.describe()
    return r

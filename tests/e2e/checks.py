"""Assertions shared by the e2e test modules."""

from __future__ import annotations

import re

import harness
from harness import Reply

# x-kvroute-decision key: 16 lower-case hex digits ("-" when there is none).
KEY_RE = re.compile(r"^[0-9a-f]{16}$")


def check_routed(reply: Reply, stack: harness.Stack, reason: str | None = None) -> None:
    """An answer from a replica, consistent with the filter's decision.

    - HTTP 200 from one of the live replicas (never a 5xx of the filter's);
    - x-kvroute-decision present, with the expected reason if one is given;
    - the replica received exactly the filter's destination header: the
      decided host first, then distinct fallbacks, all configured hosts,
      1 + fallbacks of them;
    - without dead hosts, the decided host is the one that served.
    """
    assert reply.status == 200, reply.describe()
    assert reply.served_by in stack.live_hosts, reply.describe()
    assert reply.decision, f"no {harness.DECISION_HEADER}: {reply.describe()}"
    if reason is not None:
        assert reply.reason == reason, reply.describe()
    assert reply.decided_host in stack.hosts, reply.describe()
    dest = reply.destination
    assert dest, f"replica got no destination header: {reply.describe()}"
    assert dest[0] == reply.decided_host, reply.describe()
    assert len(dest) == len(set(dest)), f"duplicate hosts in destination: {reply.describe()}"
    assert set(dest) <= set(stack.hosts), reply.describe()
    config = stack.plugin_config if isinstance(stack.plugin_config, dict) else {}
    fallbacks = config.get("fallbacks", 2)
    assert len(dest) == min(1 + fallbacks, len(stack.hosts)), reply.describe()
    if not stack.dead_ports:
        assert reply.served_by == reply.decided_host, reply.describe()

"""Plugin configurations the filter must refuse, shared by the schema tests
(test_configs.py) and the real-Envoy tests (test_bad_config.py).

Each case: (id, configuration sent to the filter, words its refusal must name,
whether the JSON Schema can express the rule).
"""

from __future__ import annotations

HOSTS = ["127.0.0.1:8001", "127.0.0.1:8002"]


def _with(**fields) -> dict:
    return {"hosts": list(HOSTS), **fields}


BAD_PLUGIN_CONFIGS = [
    # id, config (dict -> JSON, str -> verbatim), words that must appear, schema can tell
    ("unknown-field", _with(bogusField=1), ["bogusField"], True),
    ("unknown-nested-field", _with(hashing={"blockBytes": 256, "blockSize": 64}), ["blockSize"], True),
    ("hosts-empty", {"hosts": []}, ["hosts"], True),
    ("hosts-missing", {"fallbacks": 1}, ["hosts"], True),
    ("hosts-duplicate", {"hosts": ["127.0.0.1:8001", "127.0.0.1:8001"]}, ["hosts"], True),
    ("hosts-not-ip-port", {"hosts": ["localhost:8001"]}, ["hosts"], True),
    ("hosts-port-zero", {"hosts": ["127.0.0.1:0"]}, ["hosts"], True),
    ("destination-header-upper-case", _with(destinationHeader="X-Dest"), ["destinationHeader"], True),
    ("session-header-is-destination-header", _with(sessionHeaders=["x-gateway-destination-endpoint"]),
     ["sessionHeaders"], False),
    ("epsilon-negative", _with(epsilon=-0.5), ["epsilon"], True),
    ("epsilon-zero", _with(epsilon=0), ["epsilon"], True),
    ("fallbacks-too-many", _with(fallbacks=17), ["fallbacks"], True),
    ("max-body-bytes-zero", _with(maxBodyBytes=0), ["maxBodyBytes"], True),
    ("explain-header-not-bool", _with(explainHeader="yes"), ["explainHeader"], True),
    ("affinity-over-max-blocks", _with(hashing={"maxBlocks": 8, "affinityBlocks": 16}), ["affinityBlocks"], False),
    ("shared-data-prefix-slash", _with(sharedDataPrefix="kv/route"), ["sharedDataPrefix"], True),
    ("shared-data-prefix-too-long", _with(sharedDataPrefix="k" * 129), ["sharedDataPrefix"], True),
    ("cost-bytes-per-token-zero", _with(cost={"bytesPerToken": 0}), ["bytesPerToken"], True),
    ("block-bytes-too-small", _with(hashing={"blockBytes": 8}), ["blockBytes"], True),
    ("not-json", "hosts = 127.0.0.1:8001", [], True),
    # --- roles and fleet state ---------------------------------------------
    ("role-unknown", _with(role="gateway"), ["role"], True),
    ("router-role-hosts-missing", {"role": "router"}, ["hosts"], True),
    ("ingest-role-without-ingest", {"role": "ingest"}, ["ingest"], True),
    ("ingest-token-too-short", {"role": "ingest", "ingest": {"token": "short-token"}}, ["ingest.token"], True),
    ("ingest-token-with-space", {"role": "ingest", "ingest": {"token": "0123456789 abcdef"}}, ["ingest.token"], True),
    ("ingest-max-bytes-zero", {"role": "ingest", "ingest": {"token": "0123456789abcdef", "maxBytes": 0}},
     ["ingest.maxBytes"], True),
    ("ingest-owner-lease-over-an-hour",
     {"role": "ingest", "ingest": {"token": "0123456789abcdef", "ownerLeaseMs": 3600001}},
     ["ingest.ownerLeaseMs"], True),
    ("ingest-unknown-field", {"role": "ingest", "ingest": {"token": "0123456789abcdef", "tokens": []}},
     ["tokens"], True),
    ("fleet-kv-pressure-over-1", _with(fleet={"kvPressure": 1.5}), ["fleet.kvPressure"], True),
    ("fleet-recompute-weight-negative", _with(fleet={"recomputeWeight": -1}), ["fleet.recomputeWeight"], True),
    ("fleet-recompute-full-kv-over-one", _with(fleet={"recomputeFullKv": 1.5}), ["fleet.recomputeFullKv"], True),
    ("fleet-stale-after-zero", _with(fleet={"staleAfterMs": 0}), ["fleet.staleAfterMs"], True),
    ("fleet-queue-pressure-zero", _with(fleet={"queuePressure": 0}), ["fleet.queuePressure"], True),
    ("fleet-unknown-field", _with(fleet={"staleAfter": 500}), ["staleAfter"], True),
    # --- objectives and admission control ----------------------------------
    ("objective-name-with-dot", _with(objectives={"a.b": {"priority": 1}}), ["objectives"], True),
    ("objective-named-default", _with(objectives={"default": {"priority": 1}}), ["objectives"], True),
    ("objective-priority-not-integer", _with(objectives={"a": {"priority": "high"}}), ["priority"], True),
    ("admission-max-queue-zero", _with(admission={"maxQueue": 0}), ["admission.maxQueue"], True),
    ("admission-per-key-over-queue", _with(admission={"maxQueue": 4, "maxQueuedPerKey": 8}),
     ["admission.maxQueuedPerKey"], False),
    ("admission-max-memory-over-one", _with(admission={"maxMemory": 1.5}), ["admission.maxMemory"], True),
    ("admission-unknown-field", _with(admission={"enable": True}), ["enable"], True),
]

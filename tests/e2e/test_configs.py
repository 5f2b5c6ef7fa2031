"""Static checks of the shipped configuration.

- Every Envoy bootstrap YAML under envoy-config/ passes `envoy --mode validate`
  (run from the repository root, as the configs use a relative wasm path).
  Envoy 1.40's validate mode loads the wasm module and runs on_configure, so it
  needs the built filter; without it the file is validated with the kvroute
  filter removed (everything else still checked) and the full check skips.
- Every examples/*.json plugin config, and the one embedded in every Envoy
  YAML, validates against examples/kvroute.schema.json.
- The schema refuses the broken configs the filter must refuse.
- Cross-file invariants of the local stack (hosts == cluster endpoints,
  retries == fallbacks, ORIGINAL_DST => fallbacks 0 and fail-closed, the
  ingest listener shares the router's vm_id and sharedDataPrefix).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml

import harness
from config_cases import BAD_PLUGIN_CONFIGS

EXAMPLES = harness.REPO_ROOT / "examples"
SCHEMA_PATH = EXAMPLES / "kvroute.schema.json"
# Envoy bootstraps only; the Istio and Envoy Gateway manifests in the
# subfolders are checked by test_deploy_manifests.py.
YAMLS = sorted(p for p in harness.ENVOY_CONFIG_DIR.glob("*") if p.suffix in (".yaml", ".yml"))
EXAMPLE_JSONS = sorted(p for p in EXAMPLES.glob("*.json") if p != SCHEMA_PATH)


def rel(p: Path) -> str:
    return str(p.relative_to(harness.REPO_ROOT))


def load_docs(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def is_bootstrap(doc) -> bool:
    """An Envoy bootstrap (not a Kubernetes/Istio manifest with apiVersion/kind)."""
    return (
        isinstance(doc, dict)
        and "kind" not in doc
        and any(k in doc for k in ("static_resources", "dynamic_resources", "admin", "node"))
    )


def bootstrap_yamls() -> list[Path]:
    return [p for p in YAMLS if len(load_docs(p)) == 1 and is_bootstrap(load_docs(p)[0])]


def uses_kvroute_wasm(doc) -> bool:
    return bool(harness.wasm_filter_configs(doc))


@pytest.fixture(scope="module")
def schema() -> dict:
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        doc = json.load(f)
    jsonschema.Draft202012Validator.check_schema(doc)
    return doc


def schema_errors(schema: dict, instance) -> list[str]:
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(instance)]


# ------------------------------------------------------------------ envoy


def test_there_are_configs_to_check():
    names = {p.name for p in YAMLS}
    assert {"envoy.yaml", "envoy-original-dst.yaml"} <= names, names
    assert {"minimal.json", "local-stack.json", "production.json", "ingest.json"} <= {p.name for p in EXAMPLE_JSONS}


@pytest.mark.parametrize("path", YAMLS, ids=rel)
def test_envoy_validate(path: Path, tmp_path: Path):
    docs = load_docs(path)
    if not (len(docs) == 1 and is_bootstrap(docs[0])):
        pytest.skip(f"{rel(path)} is not an Envoy bootstrap (a manifest for another tool)")
    if uses_kvroute_wasm(docs[0]) and not harness.wasm_available():
        pytest.skip(
            f"`envoy --mode validate` loads the wasm and runs on_configure; {harness.WASM_MISSING_REASON}"
        )
    if "KVROUTE_WASM" in os.environ:
        # Testing another build of the filter: point the config at it.
        cfg = copy.deepcopy(docs[0])
        for plugin in harness.wasm_filter_configs(cfg):
            plugin["vm_config"]["code"]["local"]["filename"] = str(harness.WASM_PATH)
        path = tmp_path / path.name
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = harness.validate_config(path)
    assert result.returncode == 0, f"{path} invalid:\n{result.stdout}\n{result.stderr}"
    assert "OK" in result.stdout + result.stderr


@pytest.mark.parametrize("path", YAMLS, ids=rel)
def test_envoy_validate_without_filter(path: Path, tmp_path: Path):
    """The rest of each config is valid even before the wasm is built."""
    docs = load_docs(path)
    if not (len(docs) == 1 and is_bootstrap(docs[0])):
        pytest.skip(f"{rel(path)} is not an Envoy bootstrap")
    cfg = copy.deepcopy(docs[0])
    for d in harness.iter_dicts(cfg):
        if isinstance(d.get("http_filters"), list):
            d["http_filters"] = [f for f in d["http_filters"] if f.get("name") != harness.WASM_FILTER]
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = harness.validate_config(out)
    assert result.returncode == 0, f"{rel(path)} (filter removed) invalid:\n{result.stdout}\n{result.stderr}"


def test_validate_without_wasm_file_fails_clearly(tmp_path: Path):
    """Pins the Envoy 1.40 behaviour the skip above relies on."""
    cfg = harness.load_yaml()
    for plugin in harness.wasm_filter_configs(cfg):
        plugin["vm_config"]["code"]["local"]["filename"] = str(tmp_path / "absent.wasm")
    out = tmp_path / "envoy.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = harness.validate_config(out)
    assert result.returncode != 0
    assert "absent.wasm" in result.stdout + result.stderr


# ----------------------------------------------------------------- schema


@pytest.mark.parametrize("path", EXAMPLE_JSONS, ids=rel)
def test_example_matches_schema(path: Path, schema: dict):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    assert schema_errors(schema, doc) == []
    hashing = doc.get("hashing", {})
    assert hashing.get("affinityBlocks", 16) <= hashing.get("maxBlocks", 1024), "affinityBlocks > maxBlocks"


@pytest.mark.parametrize(
    "path", [p for p in YAMLS if any(uses_kvroute_wasm(d) for d in load_docs(p))], ids=rel
)
def test_embedded_plugin_config_matches_schema(path: Path, schema: dict):
    for doc in load_docs(path):
        for plugin in harness.wasm_filter_configs(doc):
            value = plugin["configuration"]["value"]
            assert schema_errors(schema, json.loads(value)) == [], f"{rel(path)}: {plugin.get('name')}"


def test_local_stack_example_equals_envoy_yaml():
    with open(EXAMPLES / "local-stack.json", encoding="utf-8") as f:
        example = json.load(f)
    assert harness.embedded_plugin_config(harness.load_yaml()) == example


@pytest.mark.parametrize("path", [
    p for p in YAMLS if len(load_docs(p)) == 1 and harness.ingest_plugins(load_docs(p)[0])
], ids=rel)
def test_ingest_example_equals_envoy_yaml(path: Path):
    with open(EXAMPLES / "ingest.json", encoding="utf-8") as f:
        example = json.load(f)
    assert harness.embedded_ingest_config(load_docs(path)[0]) == example


@pytest.mark.parametrize(
    "case", [c for c in BAD_PLUGIN_CONFIGS if c[3]], ids=[c[0] for c in BAD_PLUGIN_CONFIGS if c[3]]
)
def test_schema_rejects_bad_config(case, schema: dict):
    _id, config, _words, _ = case
    if isinstance(config, str):
        with pytest.raises(json.JSONDecodeError):
            json.loads(config)
        return
    assert schema_errors(schema, config), f"schema accepted {config}"


def test_schema_defaults_are_valid(schema: dict):
    """A config spelling out every default is itself valid."""

    def defaults(node: dict) -> dict:
        out = {}
        for name, prop in node.get("properties", {}).items():
            if prop.get("type") == "object" and "default" in prop:
                out[name] = defaults(prop)
            elif "default" in prop:
                out[name] = prop["default"]
        return out

    full = defaults(schema)
    full["hosts"] = ["127.0.0.1:8001"]
    assert full["role"] == "router"
    assert schema_errors(schema, full) == []
    # hosts is required (router role); ingest has no default (its token has none).
    assert set(full) == set(schema["properties"]) - {"ingest"}, "every top-level field but ingest has a default"
    # The ingest role with every default spelled out, plus a token.
    ingest = {**full, "role": "ingest", "hosts": [],
              "ingest": {**defaults(schema["properties"]["ingest"]), "token": "0123456789abcdef"}}
    assert schema_errors(schema, ingest) == []


@pytest.mark.parametrize(
    "config,ok",
    [
        ({"hosts": ["127.0.0.1:1"]}, True),
        ({"role": "router", "hosts": ["127.0.0.1:1"]}, True),
        ({"role": "router"}, False),
        ({"role": "router", "hosts": []}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789abcdef"}}, True),
        ({"role": "ingest", "hosts": [], "ingest": {"token": "0123456789abcdef"}}, True),
        ({"role": "ingest"}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789abcde"}}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789 abcdef"}}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789abcdef", "maxBytes": 0}}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789abcdef", "maxBytes": 67108865}}, False),
        ({"role": "ingest", "ingest": {"token": "0123456789abcdef", "other": 1}}, False),
        ({"role": "gateway", "hosts": ["127.0.0.1:1"]}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"staleAfterMs": 500, "kvPressure": 0.99, "queuePressure": 64}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"recomputeWeight": 0, "homeCachedShare": 1, "memoryKnee": 0.5}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"recomputeWeight": -1}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"weights": {"prefix": 1}}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"memoryKnee": 1}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"kvPressure": 0}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"kvPressure": 1.01}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"staleAfterMs": 0}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"staleAfterMs": 3600001}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"queuePressure": 0}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"prefillTokensPerS": 0}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"costQuantumMs": 10001}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"spillCostRatio": 0, "spillMarginMs": 0}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"spillCostRatio": 1.5, "spillMarginMs": 250}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"spillCostRatio": 0.5}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"coldHomeShare": 0.5}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"coldHomeShare": 1.01}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"sharedOnlyHomeShare": 0.25}}, True),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"sharedOnlyHomeShare": -0.01}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"spillMarginMs": -1}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"prefixIndexSlots": 1048577}}, False),
        ({"hosts": ["127.0.0.1:1"], "fleet": {"staleAfter": 1}}, False),
    ],
)
def test_schema_roles_and_fleet(config: dict, ok: bool, schema: dict):
    assert (schema_errors(schema, config) == []) == ok, schema_errors(schema, config)


@pytest.mark.parametrize(
    "host,ok",
    [
        ("127.0.0.1:8001", True),
        ("10.42.3.13:65535", True),
        ("[::1]:8001", True),
        ("127.0.0.1", False),
        ("127.0.0.1:0", False),
        ("127.0.0.1:65536", False),
        ("256.0.0.1:80", False),
        ("localhost:80", False),
        ("127.0.0.1:80,127.0.0.1:81", False),
        (" 127.0.0.1:80", False),
    ],
)
def test_schema_host_pattern(host: str, ok: bool, schema: dict):
    assert (schema_errors(schema, {"hosts": [host]}) == []) == ok


# ------------------------------------------------------------- invariants


def _cluster(cfg: dict, name: str = harness.CLUSTER_NAME) -> dict:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def _route(cfg: dict) -> dict:
    return next(d["route"] for d in harness.iter_dicts(cfg) if isinstance(d.get("route"), dict) and "cluster" in d["route"])


def test_local_stack_invariants():
    cfg = harness.load_yaml()
    plugin = harness.wasm_filter_configs(cfg)[0]
    pc = json.loads(plugin["configuration"]["value"])
    assert plugin["allow_on_headers_stop_iteration"] is True
    assert plugin["root_id"] == "kvroute" and plugin["vm_config"]["vm_id"] == "kvroute"
    assert plugin["vm_config"]["runtime"] == "envoy.wasm.runtime.v8"
    cluster = _cluster(cfg)
    endpoints = [
        "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]
    assert pc["hosts"] == endpoints, "plugin hosts must be the cluster's endpoints (override_host ignores others)"
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [{"header": pc["destinationHeader"]}]
    assert _route(cfg)["retry_policy"]["num_retries"] == pc["fallbacks"]
    # A replica's 503 goes on to the fallbacks (test_routing.py, with a real Envoy).
    assert 503 in _route(cfg)["retry_policy"].get("retriable_status_codes", [])
    assert "retriable-status-codes" in _route(cfg)["retry_policy"]["retry_on"].split(",")
    # The wasm runs before the router.
    names = [f["name"] for f in next(d["http_filters"] for d in harness.iter_dicts(cfg) if "http_filters" in d)]
    assert names.index(harness.WASM_FILTER) < names.index("envoy.filters.http.router")
    listener = cfg["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] >= pc.get("maxBodyBytes", 1048576)


def test_original_dst_invariants():
    cfg = harness.load_yaml(harness.ENVOY_CONFIG_DIR / "envoy-original-dst.yaml")
    plugin = harness.wasm_filter_configs(cfg)[0]
    pc = json.loads(plugin["configuration"]["value"])
    assert pc["fallbacks"] == 0, "ORIGINAL_DST takes exactly one address"
    assert plugin["failure_policy"] == "FAIL_CLOSED", "a dead VM must not pass client headers through"
    assert plugin["allow_on_headers_stop_iteration"] is True
    cluster = _cluster(cfg)
    assert cluster["type"] == "ORIGINAL_DST" and cluster["lb_policy"] == "CLUSTER_PROVIDED"
    assert cluster["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": pc.get("destinationHeader", "x-gateway-destination-endpoint"),
    }


@pytest.mark.parametrize("path", [p for p in YAMLS if p.name in ("envoy.yaml", "envoy-original-dst.yaml")], ids=rel)
def test_ingest_listener_invariants(path: Path):
    """The collector's push must land where the router reads: same vm_id and
    code, same sharedDataPrefix; the listener is loopback, buffers more than
    maxBytes (so the filter, not Envoy, answers 413) and pauses for bodies."""
    cfg = harness.load_yaml(path)
    listener = harness.find_listener(cfg, harness.INGEST_LISTENER_NAME)
    assert listener is not None, f"{rel(path)} has no ingest listener"
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10001}
    router, ingest = harness.router_plugins(cfg)[0], harness.ingest_plugins(cfg)[0]
    assert ingest["vm_config"] == router["vm_config"], "same vm_id, runtime and code: shared data is per vm_id"
    assert ingest["allow_on_headers_stop_iteration"] is True
    assert ingest["failure_policy"] == "FAIL_CLOSED"
    rc, ic = (json.loads(p["configuration"]["value"]) for p in (router, ingest))
    assert ic["role"] == "ingest" and rc.get("role", "router") == "router"
    assert ic.get("sharedDataPrefix", "kvroute") == rc.get("sharedDataPrefix", "kvroute")
    assert listener["per_connection_buffer_limit_bytes"] > ic["ingest"].get("maxBytes", 4194304)
    # No upstream: every request is answered by the filter (or the direct response).
    routes = [d for d in harness.iter_dicts(listener) if "match" in d]
    assert routes and all("direct_response" in r for r in routes), routes


def test_every_yaml_listens_on_loopback_only():
    for path in bootstrap_yamls():
        doc = load_docs(path)[0]
        for listener in doc.get("static_resources", {}).get("listeners", []):
            assert listener["address"]["socket_address"]["address"] == "127.0.0.1", rel(path)
        if "admin" in doc:
            assert doc["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", rel(path)

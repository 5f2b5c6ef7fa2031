"""The Istio and Envoy Gateway manifests (envoy-config/istio/, envoy-config/envoy-gateway/),
checked as far as a machine without a cluster can.

1. YAML and schemas. Every document parses and names its kind. Istio,
   Gateway API and Kubernetes kinds are checked against the schemas shipped by
   npm packages (tests/e2e/crd/: ajv validators generated from the CRDs, and a
   TypeScript excess-property check for field names). Envoy Gateway's CRDs
   ship in no package registry: its kinds are checked against an extract of
   the v1.9.0 CRDs (tests/e2e/crd/eg-v1.9.0-subset.json), strictly (unknown
   fields are errors, as with `kubectl apply --validate=strict`).
2. Embedded Envoy config. The Envoy fragments in the manifests are assembled
   the way Istio and Envoy Gateway assemble them (the cluster, listener and
   route those control planes generate are rebuilt here from their source, see
   docs/deploy.md), the patches are applied, and the result passes `envoy
   --mode validate` with the built module.
3. Consistency. Router and ingest share vm_id and sharedDataPrefix; the
   collector's token and gateway address match the ingest plugin; retries
   match fallbacks; buffer limits cover the body limits; every plugin config
   validates against examples/kvroute.schema.json; the collector accepts its
   ConfigMap (run with --once).
4. The WasmPlugin's limit, shown: the filter as Istio builds it from
   wasmplugin-example.yaml turns an inference request into a 504; with
   allow_on_headers_stop_iteration (what the EnvoyFilter sets) it is a 200.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

import harness

ISTIO_DIR = harness.ENVOY_CONFIG_DIR / "istio"
EG_DIR = harness.ENVOY_CONFIG_DIR / "envoy-gateway"
MANIFESTS = sorted([*ISTIO_DIR.glob("*.yaml"), *EG_DIR.glob("*.yaml")])
CRD_DIR = Path(__file__).resolve().parent / "crd"
CRD_TOOLS = Path(os.environ.get("KVROUTE_CRD_TOOLS", harness.REPO_ROOT / ".tools" / "crd"))
EG_SUBSET = CRD_DIR / "eg-v1.9.0-subset.json"
SCHEMA = json.loads((harness.REPO_ROOT / "examples" / "kvroute.schema.json").read_text())

WASM_TYPE = harness.WASM_TYPE
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
OVERRIDE_HOST = "envoy.load_balancing_policies.override_host"
EG_GROUP = "gateway.envoyproxy.io"


def need(ok: bool, reason: str) -> None:
    if not ok:
        if os.environ.get("KVROUTE_REQUIRE_DEPLOY") == "1":
            pytest.fail(reason + " (KVROUTE_REQUIRE_DEPLOY=1)")
        pytest.skip(reason)


def rel(p: Path) -> str:
    return str(p.relative_to(harness.REPO_ROOT))


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs() -> list[tuple[str, dict]]:
    out = []
    for p in MANIFESTS:
        for i, d in enumerate(load(p)):
            out.append((f"{rel(p)}#{i}:{d.get('kind')}/{d.get('metadata', {}).get('name')}", d))
    return out


def find(kind: str, name: str | None = None, api_prefix: str = "") -> dict:
    found = [d for _, d in all_docs()
             if d["kind"] == kind and d["apiVersion"].startswith(api_prefix)
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def validate(config: dict, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = harness.validate_config(path)
    assert result.returncode == 0, f"{name}: envoy --mode validate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def schema_errors(config: dict) -> list[str]:
    v = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(config)]


def bytes_of(quantity: str | int) -> int:
    """A Kubernetes quantity (4Mi, 8Mi, 1048576) in bytes."""
    if isinstance(quantity, int):
        return quantity
    m = re.fullmatch(r"(\d+)([KMG]i)?", quantity)
    assert m, quantity
    return int(m.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[m.group(2)]


# ============================================================ 1. YAML, schemas


def test_there_are_manifests():
    names = {rel(p) for p in MANIFESTS}
    assert {
        "envoy-config/istio/kvroute-envoyfilter.yaml",
        "envoy-config/istio/gateway.yaml",
        "envoy-config/istio/wasmplugin-example.yaml",
        "envoy-config/istio/shared-collector.yaml",
        "envoy-config/istio/sidecar-peers.yaml",
        "envoy-config/envoy-gateway/gateway.yaml",
        "envoy-config/envoy-gateway/kvroute-policies.yaml",
    } <= names, names


@pytest.mark.parametrize("path", MANIFESTS, ids=rel)
def test_manifest_parses(path: Path):
    docs = load(path)
    assert docs, f"{rel(path)} is empty"
    for d in docs:
        assert isinstance(d, dict) and {"apiVersion", "kind", "metadata"} <= set(d), d
        assert d["metadata"].get("name") and d["metadata"].get("namespace"), d["metadata"]


# --- registry packages (npm): Istio, Gateway API, Kubernetes


def _crd_inputs() -> list[dict]:
    items = [{"id": i, "doc": d, "partial": False} for i, d in all_docs()
             if not d["apiVersion"].startswith(EG_GROUP + "/")]
    # The EnvoyProxy's strategic merge patch is a partial Deployment.
    proxy = find("EnvoyProxy", api_prefix=EG_GROUP)
    patch = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]
    items.append({"id": "EnvoyProxy kvroute-proxy: deployment patch",
                  "doc": {"apiVersion": "apps/v1", "kind": "Deployment", **patch}, "partial": True})
    # Negative controls: the checks must reject these.
    items += [
        {"id": "negative: WasmPlugin with allowOnHeadersStopIteration", "partial": False, "doc": {
            "apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin", "metadata": {"name": "x"},
            "spec": {"url": "oci://r/k:1", "allowOnHeadersStopIteration": True}}},
        {"id": "negative: WasmPlugin with vmConfig.vmId", "partial": False, "doc": {
            "apiVersion": "extensions.istio.io/v1alpha1", "kind": "WasmPlugin", "metadata": {"name": "x"},
            "spec": {"url": "oci://r/k:1", "vmConfig": {"vmId": "kvroute"}}}},
        {"id": "negative: EnvoyFilter with a bad applyTo", "partial": False, "doc": {
            "apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter", "metadata": {"name": "x"},
            "spec": {"configPatches": [{"applyTo": "HTTP_FILTERS", "patch": {"operation": "MERGE"}}]}}},
        {"id": "negative: Deployment patch with a misspelt field", "partial": True, "doc": {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "spec": {"template": {"spec": {"containers": [{"name": "c", "volumeMount": []}]}}}}},
    ]
    return items


@pytest.fixture(scope="module")
def crd_check(tmp_path_factory) -> dict:
    node = shutil.which("node")
    need(node is not None, "node not found (Node 20 is part of this machine's image)")
    need((CRD_TOOLS / "node_modules" / "typescript").is_dir(), f"{CRD_TOOLS} not installed: run `make crd-tools`")
    work = tmp_path_factory.mktemp("crd")
    inputs = work / "input.json"
    inputs.write_text(json.dumps(_crd_inputs()))
    result = subprocess.run([node, str(CRD_DIR / "check_manifests.mjs"), str(CRD_TOOLS), str(inputs), str(work / "ts")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["other"] == [], out["other"]
    return out


def test_every_kind_has_a_schema(crd_check):
    """Nothing is left unchecked: every non-Envoy-Gateway kind has a package schema."""
    assert crd_check["unsupported"] == []
    eg_kinds = set(json.loads(EG_SUBSET.read_text())["kinds"])
    for _, d in all_docs():
        if d["apiVersion"].startswith(EG_GROUP + "/"):
            assert d["kind"] in eg_kinds, d["kind"]


@pytest.mark.parametrize("doc_id", [i["id"] for i in _crd_inputs() if not i["id"].startswith("negative")])
def test_package_schemas_accept(doc_id, crd_check):
    res = crd_check["results"][doc_id]
    assert res == {"schema": [], "fields": []}, res


@pytest.mark.parametrize("doc_id,expect", [
    ("negative: WasmPlugin with allowOnHeadersStopIteration", "allowOnHeadersStopIteration"),
    ("negative: WasmPlugin with vmConfig.vmId", "vmId"),
    ("negative: EnvoyFilter with a bad applyTo", "allowed values"),
    ("negative: Deployment patch with a misspelt field", "volumeMount"),
])
def test_package_schemas_reject(doc_id, expect, crd_check):
    """The checks bite; and the WasmPlugin schema has no field for the stop
    iteration setting nor for vm_id (what wasmplugin-example.yaml says)."""
    res = crd_check["results"][doc_id]
    assert any(expect in e for e in res["schema"] + res["fields"]), res


# --- Envoy Gateway: the v1.9.0 CRD extract, strict


def _strict(schema: dict, path: str = "") -> dict:
    """The extract as JSON Schema: objects reject unknown fields, and a field
    our manifests never used (not expanded) may not appear."""
    if schema.get("x-kvroute-unexpanded"):
        return {"not": {}, "description": f"{path}: not in the extract; regenerate with tests/e2e/crd/gen_eg_subset.py"}
    out = {k: v for k, v in schema.items() if k in ("type", "enum", "required", "pattern", "minItems", "maxItems",
                                                      "minimum", "maximum", "minLength", "maxLength")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "allOf" in schema:
        out["allOf"] = schema["allOf"]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if "properties" in schema:
        out["properties"] = {k: _strict(v, f"{path}.{k}") for k, v in schema["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = _strict(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"], f"{path}.*")
    return out


def eg_errors(doc: dict) -> list[str]:
    kinds = json.loads(EG_SUBSET.read_text())["kinds"]
    entry = kinds[doc["kind"]]
    assert doc["apiVersion"] == entry["apiVersion"]
    schema = _strict(entry["schema"])
    # metadata is Kubernetes' ObjectMeta, not part of the CRD schema.
    schema["properties"]["metadata"] = {"type": "object"}
    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message} {e.schema.get('description', '')}".strip()
            for e in v.iter_errors(doc)]


@pytest.mark.parametrize("doc_id", [i for i, d in all_docs() if d["apiVersion"].startswith(EG_GROUP + "/")])
def test_envoy_gateway_crd_fields(doc_id):
    doc = dict(all_docs())[doc_id]
    assert eg_errors(doc) == []


@pytest.mark.parametrize("mutate,expect", [
    (lambda d: d["spec"]["wasm"][0].update(allowOnHeadersStopIteration=True), "allowOnHeadersStopIteration"),
    (lambda d: d["spec"]["wasm"][0]["code"].update(type="OCI"), "OCI"),
    (lambda d: d["spec"]["wasm"][0].pop("code"), "code"),
])
def test_envoy_gateway_check_bites(mutate, expect):
    doc = copy.deepcopy(find("EnvoyExtensionPolicy", "kvroute"))
    mutate(doc)
    errors = eg_errors(doc)
    assert any(expect in e for e in errors), errors


# ============================================== 2. Istio: assembled and validated


def istio_envoyfilter() -> dict:
    return find("EnvoyFilter", "kvroute")


def istio_extension_configs(wasm: Path | None) -> dict[str, dict]:
    """EXTENSION_CONFIG name -> typed_config, with `remote` rewritten to a
    local file as the istio-agent does after pulling the image."""
    out = {}
    for p in istio_envoyfilter()["spec"]["configPatches"]:
        if p["applyTo"] != "EXTENSION_CONFIG":
            continue
        assert p["patch"]["operation"] == "ADD"
        value = copy.deepcopy(p["patch"]["value"])
        tc = value["typed_config"]
        code = tc["config"]["vm_config"]["code"]
        assert code["remote"]["http_uri"]["uri"].startswith("oci://")
        if wasm is not None:
            code.pop("remote")
            code["local"] = {"filename": str(wasm)}
        out[value["name"]] = tc
    return out


def resolve_ecds(http_filters: list, ext: dict[str, dict]) -> list:
    """A filter with config_discovery gets the config ECDS would deliver."""
    out = []
    for f in http_filters:
        if "config_discovery" in f:
            assert f["config_discovery"]["type_urls"] == [WASM_TYPE]
            assert f["name"] in ext, f"no EXTENSION_CONFIG named {f['name']}"
            f = {"name": f["name"], "typed_config": ext[f["name"]]}
        out.append(f)
    return out


def proto_merge(dst: dict, src: dict) -> dict:
    """Istio's MERGE (proto merge): messages merge, repeated fields append, scalars replace."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict) and "@type" not in v:
            proto_merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k] = dst[k] + copy.deepcopy(v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def assert_503_is_retried(policy: dict) -> None:
    """A replica that just went bad answers 503: the route sends the
    request on to the fallbacks (tests/e2e/test_routing.py checks it with a
    real Envoy)."""
    assert "retriable-status-codes" in policy["retry_on"].split(","), policy
    assert 503 in policy.get("retriable_status_codes", []), policy
    for t in ("connect-failure", "refused-stream", "reset"):
        assert t in policy["retry_on"].split(","), policy


def istio_retry_policy(retries: dict) -> dict:
    """A VirtualService's retries as Istio translates them: numbers in
    retryOn become Envoy's retriable-status-codes."""
    on = [t.strip() for t in retries["retryOn"].split(",") if t.strip()]
    codes = [int(t) for t in on if t.isdigit()]
    triggers = [t for t in on if not t.isdigit()] + (["retriable-status-codes"] if codes else [])
    policy = {"retry_on": ",".join(triggers), "num_retries": retries["attempts"]}
    if codes:
        policy["retriable_status_codes"] = codes
    return policy


def istio_bootstrap(wasm: Path | None) -> dict:
    """What the gateway's Envoy runs: Istio's listener, route and cluster for
    gateway.yaml (rebuilt with the fields Istio sets that matter here), with
    the EnvoyFilter applied."""
    ef = istio_envoyfilter()
    ext = istio_extension_configs(wasm)
    vs = find("VirtualService", "vllm")
    gw = find("Gateway", "kvroute-gateway", "networking.istio.io")
    port = gw["spec"]["servers"][0]["port"]["number"]
    dest = vs["spec"]["http"][0]["route"][0]["destination"]
    cluster_name = f"outbound|{dest['port']['number']}||{dest['host']}"
    router_cfg = json.loads(ext["kvroute-router"]["config"]["configuration"]["value"])
    retries = vs["spec"]["http"][0]["retries"]
    listener = {
        "name": f"0.0.0.0_{port}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": {
            "@type": HCM_TYPE,
            "stat_prefix": f"outbound_0.0.0.0_{port}",
            "route_config": {"name": f"http.{port}", "virtual_hosts": [{
                "name": f"*:{port}", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": {
                    "cluster": cluster_name,
                    "timeout": vs["spec"]["http"][0]["timeout"],
                    "retry_policy": istio_retry_policy(retries),
                }}],
            }]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}],
        }}]}],
    }
    cluster = {
        "name": cluster_name,
        # Istio uses EDS; validate mode has no xDS server, so the endpoints are static here.
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295, "max_pending_requests": 4294967295,
                                             "max_requests": 4294967295, "max_retries": 4294967295,
                                             "track_remaining": True}]},
        "load_assignment": {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": [
            harness._endpoint(h) for h in router_cfg["hosts"]]}]},
    }
    listeners = [listener]
    for p in ef["spec"]["configPatches"]:
        applied = p["applyTo"]
        op = p["patch"]["operation"]
        match = p.get("match", {})
        if applied == "EXTENSION_CONFIG":
            continue
        assert match.get("context") == "GATEWAY", p
        if applied == "HTTP_FILTER":
            assert op == "INSERT_BEFORE" and match["listener"]["portNumber"] == port
            sub = match["listener"]["filterChain"]["filter"]
            assert sub["name"] == HCM
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            names = [f["name"] for f in hcm["http_filters"]]
            hcm["http_filters"].insert(names.index(sub["subFilter"]["name"]),
                                       resolve_ecds([p["patch"]["value"]], ext)[0])
        elif applied == "LISTENER" and op == "MERGE":
            assert match["listener"]["portNumber"] == port
            proto_merge(listener, p["patch"]["value"])
        elif applied == "LISTENER" and op == "ADD":
            added = copy.deepcopy(p["patch"]["value"])
            for d in harness.iter_dicts(added):
                if isinstance(d.get("http_filters"), list):
                    d["http_filters"] = resolve_ecds(d["http_filters"], ext)
            listeners.append(added)
        elif applied == "CLUSTER":
            assert op == "MERGE"
            assert (match["cluster"]["service"], match["cluster"]["portNumber"]) == (dest["host"], dest["port"]["number"])
            proto_merge(cluster, p["patch"]["value"])
        else:
            pytest.fail(f"unhandled patch {applied}/{op}")
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {"listeners": listeners, "clusters": [cluster]},
    }


def test_istio_envoy_config_validates(wasm_path, tmp_path: Path):
    validate(istio_bootstrap(wasm_path), tmp_path, "istio-gateway.yaml")


def test_istio_envoy_config_validates_without_filter(tmp_path: Path):
    """Listener, cluster and LB patches are valid even before the module is built."""
    cfg = istio_bootstrap(None)
    for d in harness.iter_dicts(cfg):
        if isinstance(d.get("http_filters"), list):
            d["http_filters"] = [f for f in d["http_filters"] if f["name"] == "envoy.filters.http.router"]
    validate(cfg, tmp_path, "istio-gateway-no-filter.yaml")


def test_istio_consistency():
    cfg = istio_bootstrap(Path("/nonexistent.wasm"))
    ext = istio_extension_configs(None)
    router, ingest = ext["kvroute-router"]["config"], ext["kvroute-ingest"]["config"]
    rc, ic = (json.loads(c["configuration"]["value"]) for c in (router, ingest))
    assert schema_errors(rc) == [] and schema_errors(ic) == []
    assert rc.get("role", "router") == "router" and ic["role"] == "ingest"
    for c in (router, ingest):
        assert c["allow_on_headers_stop_iteration"] is True
        assert c["failure_policy"] == "FAIL_CLOSED"
        assert c["root_id"] == "kvroute"
    assert router["vm_config"] == ingest["vm_config"] and router["vm_config"]["vm_id"]
    assert rc["sharedDataPrefix"] == ic["sharedDataPrefix"]
    gateway, ingest_listener = cfg["static_resources"]["listeners"]
    assert gateway["per_connection_buffer_limit_bytes"] >= rc.get("maxBodyBytes", 1 << 20)
    assert ingest_listener["per_connection_buffer_limit_bytes"] > ic["ingest"]["maxBytes"]
    assert ingest_listener["address"]["socket_address"]["address"] == "127.0.0.1"
    names = [f["name"] for f in next(d["http_filters"] for d in harness.iter_dicts(gateway) if "http_filters" in d)]
    assert names == ["kvroute-router", "envoy.filters.http.router"]
    route = next(d["route"] for d in harness.iter_dicts(gateway) if isinstance(d.get("route"), dict))
    assert route["retry_policy"]["num_retries"] == rc["fallbacks"]
    assert_503_is_retried(route["retry_policy"])
    cluster = cfg["static_resources"]["clusters"][0]
    policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == OVERRIDE_HOST
    assert policy["typed_config"]["override_host_sources"] == [{"header": rc["destinationHeader"]}]
    # The gateway Deployment, Service and Istio Gateway agree on the port.
    dep = find("Deployment", "kvroute-gateway")
    proxy = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "istio-proxy")
    svc = find("Service", "kvroute-gateway")
    port = gateway["address"]["socket_address"]["port_value"]
    assert [p["containerPort"] for p in proxy["ports"]] == [port]
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == [port]
    assert dep["spec"]["template"]["metadata"]["labels"]["istio"] == istio_envoyfilter()["spec"]["workloadSelector"]["labels"]["istio"]
    _check_collector_wiring(dep["spec"]["template"]["spec"], ic, ingest_listener, "inference")


def test_istio_shared_collector_consistency():
    """shared-collector.yaml: one collector for every gateway pod, through a
    headless Service over their ingest port; only it may reach that port."""
    cfg = istio_bootstrap(Path("/nonexistent.wasm"))
    _, ingest_listener = cfg["static_resources"]["listeners"]
    ingest_port = ingest_listener["address"]["socket_address"]["port_value"]
    ic = json.loads(istio_extension_configs(None)["kvroute-ingest"]["config"]["configuration"]["value"])
    gateway_pods = find("Deployment", "kvroute-gateway")["spec"]["template"]["metadata"]["labels"]
    svc = find("Service", "kvroute-gateway-ingest")
    assert svc["spec"]["clusterIP"] == "None", "headless: one address per gateway pod"
    assert svc["spec"]["publishNotReadyAddresses"] is True, "starting and draining pods need snapshots too"
    assert svc["spec"]["selector"].items() <= gateway_pods.items()
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(ingest_port, ingest_port)]
    # The collector's ConfigMap names that Service, and its pod reads it.
    collector = find("Deployment", "kvroute-collector")
    pod = collector["spec"]["template"]["spec"]
    _check_collector_wiring(pod, ic, None, "inference")
    cm = find("ConfigMap", "kvroute-collector-shared")
    toml = tomllib.loads(cm["data"]["collector.toml"])
    assert "gateways" not in toml
    ns = svc["metadata"]["namespace"]
    assert toml["gateway-service"] == [f"http://{svc['metadata']['name']}.{ns}.svc.cluster.local:{ingest_port}"]
    # Only the collector's pods reach the ingest port; the gateway port is open.
    netpol = find("NetworkPolicy", "kvroute-gateway-ingest")["spec"]
    assert netpol["podSelector"]["matchLabels"].items() <= gateway_pods.items()
    assert netpol["policyTypes"] == ["Ingress"]
    collector_pods = collector["spec"]["template"]["metadata"]["labels"]
    assert collector["spec"]["selector"]["matchLabels"].items() <= collector_pods.items()
    assert collector_pods.get("sidecar.istio.io/inject") == "false", "plain HTTP, no mesh proxy"
    _check_ingest_policy(netpol, cfg, ingest_port, collector_pods)


def test_istio_sidecar_peers_consistency():
    """sidecar-peers.yaml: each gateway pod's collector pushes to its own
    ingest listener and reads the other pods' load through a headless
    Service over that port; only gateway pods may reach it."""
    cfg = istio_bootstrap(Path("/nonexistent.wasm"))
    _, ingest_listener = cfg["static_resources"]["listeners"]
    ingest_port = ingest_listener["address"]["socket_address"]["port_value"]
    gateway = find("Deployment", "kvroute-gateway")
    gateway_pods = gateway["spec"]["template"]["metadata"]["labels"]
    svc = find("Service", "kvroute-gateway-peers")
    assert svc["spec"]["clusterIP"] == "None", "headless: one address per gateway pod"
    assert svc["spec"]["selector"].items() <= gateway_pods.items()
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(ingest_port, ingest_port)]
    toml = tomllib.loads(find("ConfigMap", "kvroute-collector-peers")["data"]["collector.toml"])
    sidecar_cm = next(d for _, d in all_docs() if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"] == "kvroute-collector" and d["metadata"]["namespace"] == "inference")
    sidecar = tomllib.loads(sidecar_cm["data"]["collector.toml"])
    # The sidecar's own config, plus the peers: same gateway, same token.
    assert toml["gateways"] == sidecar["gateways"] == [f"http://127.0.0.1:{ingest_port}"]
    assert toml["token-file"] == sidecar["token-file"]
    ns = svc["metadata"]["namespace"]
    assert toml["peer-gateway-service"] == [f"http://{svc['metadata']['name']}.{ns}.svc.cluster.local:{ingest_port}"]
    netpol = find("NetworkPolicy", "kvroute-gateway-peers")["spec"]
    assert netpol["podSelector"]["matchLabels"].items() <= gateway_pods.items()
    # The policy selects the gateway pods, where the sidecar serves its metrics.
    metrics_port = int(toml["metrics-addr"].rsplit(":", 1)[1])
    assert metrics_port in {p["port"] for r in netpol["ingress"] if "from" not in r for p in r["ports"]}
    _check_ingest_policy(netpol, cfg, ingest_port, gateway_pods)


def _check_ingest_policy(netpol: dict, cfg: dict, ingest_port: int, readers: dict) -> None:
    """Only pods labelled like `readers` reach the ingest port; the gateway
    port is open to everyone."""
    for rule in netpol["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ingest_port in ports:
            assert ports == {ingest_port}
            [peer] = rule["from"]
            assert peer["podSelector"]["matchLabels"].items() <= readers.items()
        else:
            assert "from" not in rule
    open_ports = {p["port"] for r in netpol["ingress"] if "from" not in r for p in r["ports"]}
    gateway_port = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    assert gateway_port in open_ports and ingest_port not in open_ports


def _check_collector_wiring(pod: dict, ingest_cfg: dict, ingest_listener_or_addr, namespace: str) -> None:
    """The sidecar reads its ConfigMap, its token from the Secret, and pushes to the ingest listener."""
    c = next(c for c in pod["containers"] if c["name"] == "kvroute-collector")
    config_arg = c["args"][c["args"].index("--config") + 1]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cm_vol = next(n for n, v in volumes.items() if "configMap" in v)
    assert config_arg.startswith(mounts[cm_vol] + "/")
    cm = next(d for _, d in all_docs() if d["kind"] == "ConfigMap"
              and d["metadata"]["name"] == volumes[cm_vol]["configMap"]["name"]
              and d["metadata"]["namespace"] == namespace)
    toml = tomllib.loads(cm["data"][config_arg.rsplit("/", 1)[1]])
    secret_vol = next(n for n, v in volumes.items() if "secret" in v)
    item = volumes[secret_vol]["secret"]["items"][0]
    assert toml["token-file"] == f"{mounts[secret_vol]}/{item['path']}"
    secret = next(d for _, d in all_docs() if d["kind"] == "Secret"
                  and d["metadata"]["name"] == volumes[secret_vol]["secret"]["secretName"]
                  and d["metadata"]["namespace"] == namespace)
    assert secret["stringData"][item["key"]] == ingest_cfg["ingest"]["token"], "collector and ingest tokens differ"
    addr = ingest_listener_or_addr["address"]["socket_address"] if isinstance(ingest_listener_or_addr, dict) else None
    if addr is not None:
        assert toml["gateways"] == [f"http://{addr['address']}:{addr['port_value']}"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False


# ====================================== 2b. Envoy Gateway: generated, patched, validated

EG_WASM_FILTER = "envoy.filters.http.wasm/envoyextensionpolicy/{ns}/{name}/wasm/{i}"
EG_VM_ID = "envoyextensionpolicy/{ns}/{name}/wasm/{i}"


def eg_wasm_filter(policy: dict, i: int, wasm: Path | None) -> dict:
    """The HTTP filter Envoy Gateway v1.9 generates for spec.wasm[i]
    (internal/xds/translator/wasm.go): disabled on the HCM, enabled per route,
    vm_id = the IR name, code from EG's HTTP server (here: the local file)."""
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    w = policy["spec"]["wasm"][i]
    code = ({"local": {"filename": str(wasm)}} if wasm is not None
            else {"remote": {"http_uri": {"uri": "https://envoy-gateway:18002/x.wasm", "cluster": "wasm_cluster",
                                          "timeout": "10s"}, "sha256": "0" * 64}})
    config = {
        "name": w.get("name", EG_VM_ID.format(ns=ns, name=name, i=i)),
        "vm_config": {"vm_id": EG_VM_ID.format(ns=ns, name=name, i=i), "runtime": "envoy.wasm.runtime.v8", "code": code},
        "configuration": {"@type": STRING_VALUE, "value": json.dumps(w.get("config", {}))},
    }
    if w.get("failOpen"):
        config["fail_open"] = True
    if "rootID" in w:
        config["root_id"] = w["rootID"]
    return {"name": EG_WASM_FILTER.format(ns=ns, name=name, i=i), "disabled": True,
            "typed_config": {"@type": WASM_TYPE, "config": config}}


def eg_generated(wasm: Path | None) -> tuple[list[dict], list[dict]]:
    """Listeners and clusters Envoy Gateway v1.9 generates from gateway.yaml and
    the policies (xDS name scheme V1: listener = <ns>/<gateway>/<listener>)."""
    gw = find("Gateway", "kvroute", "gateway.networking.k8s.io")
    ns = gw["metadata"]["namespace"]
    policies = [d for _, d in all_docs() if d["kind"] == "EnvoyExtensionPolicy"]
    btps = [d for _, d in all_docs() if d["kind"] == "BackendTrafficPolicy"]
    ctps = [d for _, d in all_docs() if d["kind"] == "ClientTrafficPolicy"]
    routes = [d for _, d in all_docs() if d["kind"] == "HTTPRoute"]
    listeners, clusters = [], []
    for l in gw["spec"]["listeners"]:
        lname = f"{ns}/{gw['metadata']['name']}/{l['name']}"
        filters, vroutes = [], []
        for r in routes:
            if not any(p["name"] == gw["metadata"]["name"] and p.get("sectionName") == l["name"] for p in r["spec"]["parentRefs"]):
                continue
            enabled = []
            for pol in policies:
                if any(t["kind"] == "HTTPRoute" and t["name"] == r["metadata"]["name"] for t in pol["spec"]["targetRefs"]):
                    for i in range(len(pol["spec"]["wasm"])):
                        f = eg_wasm_filter(pol, i, wasm)
                        filters.append(f)
                        enabled.append(f["name"])
            for ri, rule in enumerate(r["spec"]["rules"]):
                route: dict = {"match": {"prefix": "/"},
                               "typed_per_filter_config": {n: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                                                               "config": {}}
                                                           for n in enabled}}
                if rule.get("backendRefs"):
                    cname = f"httproute/{r['metadata']['namespace']}/{r['metadata']['name']}/rule/{ri}"
                    action: dict = {"cluster": cname}
                    if "timeouts" in rule:
                        action["timeout"] = rule["timeouts"]["request"]
                    cluster = {"name": cname, "type": "STATIC", "connect_timeout": "10s",
                               "load_assignment": {"cluster_name": cname, "endpoints": [{"lb_endpoints": []}]}}
                    for b in btps:
                        if any(t["name"] == r["metadata"]["name"] for t in b["spec"]["targetRefs"]):
                            lb = b["spec"].get("loadBalancer")
                            if lb and "endpointOverride" in lb:
                                assert lb["type"] == "LeastRequest"
                                cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
                                    "name": OVERRIDE_HOST,
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                                        "override_host_sources": [{"header": s["header"]} for s in lb["endpointOverride"]["extractFrom"]],
                                        "fallback_policy": {"policies": [{"typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.least_request",
                                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"}}}]},
                                    }}}]}
                            if "retry" in b["spec"]:
                                retry = b["spec"]["retry"]
                                action["retry_policy"] = {
                                    "retry_on": ",".join(retry["retryOn"]["triggers"]),
                                    "num_retries": retry["numRetries"]}
                                if retry["retryOn"].get("httpStatusCodes"):
                                    action["retry_policy"]["retriable_status_codes"] = retry["retryOn"]["httpStatusCodes"]
                    clusters.append(cluster)
                    route["route"] = action
                else:
                    # No backend: Envoy Gateway answers 500 itself.
                    route["direct_response"] = {"status": 500}
                vroutes.append(route)
        listener = {
            "name": lname,
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": l["port"]}},
            "default_filter_chain": {"filters": [{"name": HCM, "typed_config": {
                "@type": HCM_TYPE, "stat_prefix": f"http-{l['port']}",
                "route_config": {"name": lname, "virtual_hosts": [{"name": f"{lname}/*", "domains": ["*"], "routes": vroutes}]},
                "http_filters": [*filters, {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}],
            }}]},
        }
        for c in ctps:
            if any(t["kind"] == "Gateway" and t.get("sectionName") == l["name"] for t in c["spec"]["targetRefs"]):
                listener["per_connection_buffer_limit_bytes"] = bytes_of(c["spec"]["connection"]["bufferLimit"])
        listeners.append(listener)
    return listeners, clusters


def jsonpath_pointers(doc, expr: str) -> list[str]:
    """The JSONPath form the patch policy uses, `$..KEY[?(@.FIELD == 'VALUE')]`,
    as JSON pointers (Envoy Gateway evaluates it with ojg, then appends `path`)."""
    m = re.fullmatch(r"\$\.\.(\w+)\[\?\(@\.(\w+) == '([^']*)'\)\]", expr)
    assert m, f"unsupported JSONPath {expr!r}"
    key, field, value = m.groups()
    out = []

    def walk(node, ptr):
        if isinstance(node, dict):
            for k, v in node.items():
                p = f"{ptr}/{k.replace('~', '~0').replace('/', '~1')}"
                if k == key and isinstance(v, list):
                    out.extend(f"{p}/{i}" for i, e in enumerate(v) if isinstance(e, dict) and e.get(field) == value)
                walk(v, p)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{ptr}/{i}")
    walk(doc, "")
    return out


def json_patch(doc: dict, op: str, pointer: str, value) -> None:
    """RFC 6902 add/replace, with Envoy Gateway's EnsurePathExistsOnAdd."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    node = doc
    for p in parts[:-1]:
        if isinstance(node, list):
            node = node[int(p)]
        else:
            if p not in node:
                assert op == "add", f"{pointer}: {p} missing"
                node[p] = {}
            node = node[p]
    last = parts[-1]
    if op == "replace":
        assert last in node, f"replace of a missing {pointer}"
    else:
        assert op == "add", op
    node[last] = copy.deepcopy(value)


def eg_patched(wasm: Path | None) -> tuple[list[dict], list[dict]]:
    listeners, clusters = eg_generated(wasm)
    epp = find("EnvoyPatchPolicy", "kvroute")
    by_name = {l["name"]: l for l in listeners}
    for p in epp["spec"]["jsonPatches"]:
        assert p["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener"
        assert p["name"] in by_name, f"no listener {p['name']} (have {sorted(by_name)})"
        target = by_name[p["name"]]
        op = p["operation"]
        # Envoy Gateway marshals with proto field names (snake_case), as here.
        if "jsonPath" in op:
            pointers = jsonpath_pointers(target, op["jsonPath"])
            assert pointers, f"{op['jsonPath']} selects nothing in {p['name']}"
            pointers = [ptr + op["path"] for ptr in pointers]
        else:
            pointers = [op["path"]]
        for ptr in pointers:
            json_patch(target, op["op"], ptr, op["value"])
    return listeners, clusters


def test_envoy_gateway_envoy_config_validates(wasm_path, tmp_path: Path):
    listeners, clusters = eg_patched(wasm_path)
    # The endpoints EDS would deliver: the plugin's hosts.
    router_cfg = find("EnvoyExtensionPolicy", "kvroute")["spec"]["wasm"][0]["config"]
    for c in clusters:
        c["load_assignment"]["endpoints"] = [{"lb_endpoints": [harness._endpoint(h) for h in router_cfg["hosts"]]}]
    for l in listeners:
        if l["address"]["socket_address"]["address"] == "0.0.0.0":
            l["address"]["socket_address"]["address"] = "127.0.0.1"  # validate binds nothing; keep to loopback anyway
    cfg = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
           "static_resources": {"listeners": listeners, "clusters": clusters}}
    validate(cfg, tmp_path, "envoy-gateway.yaml")


def test_envoy_gateway_patches_do_what_they_say():
    before, _ = eg_generated(Path("/nonexistent.wasm"))
    listeners, clusters = eg_patched(Path("/nonexistent.wasm"))
    wasm_filters = [f for d in harness.iter_dicts(listeners) for f in d.get("http_filters", [])
                    if f["name"].startswith("envoy.filters.http.wasm/")]
    assert len(wasm_filters) == 2
    configs = [f["typed_config"]["config"] for f in wasm_filters]
    assert all(c["allow_on_headers_stop_iteration"] is True for c in configs)
    assert len({c["vm_config"]["vm_id"] for c in configs}) == 1, "router and ingest must share the VM"
    # Before the patch they did not: that is why the patch policy exists.
    before_filters = [f for d in harness.iter_dicts(before) for f in d.get("http_filters", [])
                      if f["name"].startswith("envoy.filters.http.wasm/")]
    assert len({f["typed_config"]["config"]["vm_config"]["vm_id"] for f in before_filters}) == 2
    ingest = next(l for l in listeners if l["name"].endswith("/kvroute-ingest"))
    assert ingest["address"]["socket_address"]["address"] == "127.0.0.1"
    rc, ic = (json.loads(c["configuration"]["value"]) for c in configs)
    if rc.get("role") == "ingest":
        rc, ic = ic, rc
    assert schema_errors(rc) == [] and schema_errors(ic) == []
    assert rc["sharedDataPrefix"] == ic["sharedDataPrefix"]
    gateway = next(l for l in listeners if l["name"].endswith("/http"))
    assert gateway["per_connection_buffer_limit_bytes"] >= rc.get("maxBodyBytes", 1 << 20)
    assert ingest["per_connection_buffer_limit_bytes"] > ic["ingest"]["maxBytes"]
    route = next(d["route"] for d in harness.iter_dicts(gateway) if isinstance(d.get("route"), dict))
    assert route["retry_policy"]["num_retries"] == rc["fallbacks"]
    assert_503_is_retried(route["retry_policy"])
    policy = clusters[0]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["typed_config"]["override_host_sources"] == [{"header": rc["destinationHeader"]}]
    # Both policies pull the same image; neither fails open.
    eeps = [d for _, d in all_docs() if d["kind"] == "EnvoyExtensionPolicy"]
    assert len({e["spec"]["wasm"][0]["code"]["image"]["url"] for e in eeps}) == 1
    assert all(e["spec"]["wasm"][0]["failOpen"] is False for e in eeps)
    # The collector sidecar in the Envoy pods.
    proxy = find("EnvoyProxy", "kvroute-proxy")
    pod = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]["spec"]["template"]["spec"]
    _check_collector_wiring(pod, ic, {"address": {"socket_address": {
        "address": "127.0.0.1",
        "port_value": next(l["port"] for l in find("Gateway", "kvroute", "gateway.networking.k8s.io")["spec"]["listeners"]
                           if l["name"] == "kvroute-ingest")}}}, "envoy-gateway-system")


# ================================================ 3. the collector takes its ConfigMaps


@pytest.mark.parametrize("namespace,name", [("inference", "kvroute-collector"),
                                            ("inference", "kvroute-collector-shared"),
                                            ("inference", "kvroute-collector-peers"),
                                            ("envoy-gateway-system", "kvroute-collector")])
def test_collector_accepts_its_configmap(namespace, name, collector_binary, tmp_path: Path):
    """The ConfigMap's TOML, with its token file, is a valid collector config:
    the real collector reads it (unknown keys would exit 2; its gateways are
    checked) and scrapes once. Flags override the engines (no cluster DNS
    here) and the metrics address."""
    cm = next(d for _, d in all_docs() if d["kind"] == "ConfigMap" and d["metadata"]["namespace"] == namespace
              and d["metadata"]["name"] == name)
    secret = next(d for _, d in all_docs() if d["kind"] == "Secret" and d["metadata"]["namespace"] == namespace)
    toml_text = cm["data"]["collector.toml"]
    conf = tomllib.loads(toml_text)
    token_file = tmp_path / "ingest-token"
    token_file.write_text(secret["stringData"]["token"])
    toml_text = toml_text.replace(conf["token-file"], str(token_file))
    (tmp_path / "collector.toml").write_text(toml_text)
    port = harness.free_ports(1)[0]
    ups = harness.Upstreams([port], tmp_path)
    try:
        ups.start()
        result = subprocess.run(
            [str(collector_binary), "--config", str(tmp_path / "collector.toml"),
             "--engines", f"127.0.0.1:{port}", "--metrics-addr", "off", "--once"],
            capture_output=True, text=True, timeout=30)
    finally:
        ups.stop()
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert [h["address"] for h in snapshot["hosts"]] == [f"127.0.0.1:{port}"]


# ======================================= 4. what a WasmPlugin alone does to kvroute


def wasmplugin_filter(wp: dict, hosts: list[str], wasm: Path) -> dict:
    """The PluginConfig Istio builds from a WasmPlugin (pilot/pkg/model/extensions.go):
    name <namespace>.<name>, root_id = pluginName, no vm_id, the pluginConfig as
    JSON, failStrategy mapped to failure_policy, and nothing else."""
    spec = wp["spec"]
    plugin_config = {**spec["pluginConfig"], "hosts": hosts, "explainHeader": True}
    config = {
        "name": f"{wp['metadata']['namespace']}.{wp['metadata']['name']}",
        "root_id": spec["pluginName"],
        "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": str(wasm)}}},
        "configuration": {"@type": STRING_VALUE, "value": json.dumps(plugin_config)},
        "failure_policy": {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}[spec["failStrategy"]],
    }
    return {"name": config["name"], "typed_config": {"@type": WASM_TYPE, "config": config}}


@pytest.mark.parametrize("stop_iteration,expect", [(False, 504), (True, 200)])
def test_wasmplugin_alone_cannot_run_kvroute(stop_iteration, expect, wasm_path, tmp_path: Path):
    wp = find("WasmPlugin", "kvroute")
    assert schema_errors(wp["spec"]["pluginConfig"] | {"hosts": ["127.0.0.1:1"]}) == []
    ports = harness.free_ports(4)
    ups = harness.Upstreams(ports[:2], tmp_path)
    hosts = ups.addresses
    cfg = harness.build_envoy_config(gateway_port=ports[2], admin_port=ports[3], endpoints=hosts, wasm=wasm_path)
    gateway = harness.find_listener(cfg, harness.LISTENER_NAME)
    hcm = next(d for d in harness.iter_dicts(gateway) if isinstance(d.get("http_filters"), list))
    f = wasmplugin_filter(wp, hosts, wasm_path)
    if stop_iteration:
        f["typed_config"]["config"]["allow_on_headers_stop_iteration"] = True
    hcm["http_filters"] = [f, *[x for x in hcm["http_filters"] if x["name"] != harness.WASM_FILTER]]
    # The paused request never reaches the router; it ends when the stream
    # has been idle this long (a 504: the request was complete).
    hcm["stream_idle_timeout"] = "3s"
    envoy = harness.Envoy(cfg, tmp_path / "envoy")
    try:
        ups.start()
        envoy.start()
        reply = harness.send(envoy.gateway_url, json_body=harness.chat_body(user_text="wasmplugin"), timeout=20)
    finally:
        envoy.stop()
        ups.stop()
    assert reply.status == expect, reply.describe()
    if expect == 504:
        assert reply.served_by is None, "the request must never have reached a replica"
        assert "stream timeout" in reply.response.text, reply.describe()
    if expect == 200:
        assert reply.served_by in hosts and reply.reason in ("session", "prefix", "spill"), reply.describe()

"""Regenerate eg-v1.9.0-subset.json: the part of Envoy Gateway's CRD schemas
that envoy-config/envoy-gateway/*.yaml reaches.

No package registry ships Envoy Gateway's CRD schemas, so the test checks our
manifests against this extract. It keeps only structure: property names,
types, enums, required lists, patterns, int-or-string and
preserve-unknown-fields markers. Descriptions and CEL rules are dropped. At
every object our manifests use, all of its property names are kept (so a
sibling field can be added without regenerating). A property our manifests
do not use is kept as a stub marked "x-kvroute-unexpanded". A manifest that
starts using it fails the test with a message naming this script.

Usage, with a checkout of github.com/envoyproxy/gateway at tag v1.9.0:

    python3 tests/e2e/crd/gen_eg_subset.py \
        GATEWAY_CHECKOUT/charts/gateway-helm/charts/crds/crds/generated \
        > tests/e2e/crd/eg-v1.9.0-subset.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = sorted((REPO / "envoy-config" / "envoy-gateway").glob("*.yaml"))
GROUP = "gateway.envoyproxy.io"
SCALAR_KEYS = ("type", "enum", "pattern", "format", "x-kubernetes-int-or-string",
               "x-kubernetes-preserve-unknown-fields", "required", "minItems", "maxItems",
               "minimum", "maximum", "minLength", "maxLength")


def stub(schema: dict) -> dict:
    out = {k: schema[k] for k in ("type", "enum", "x-kubernetes-int-or-string") if k in schema}
    if "properties" in schema or "items" in schema or "additionalProperties" in schema:
        out["x-kvroute-unexpanded"] = True
    if "anyOf" in schema:
        out["anyOf"] = [stub(s) for s in schema["anyOf"]]
    return out


def extract(schema: dict, docs: list) -> dict:
    """The schema, expanded along the values in docs (all at this position)."""
    out = {k: schema[k] for k in SCALAR_KEYS if k in schema}
    if "anyOf" in schema:
        out["anyOf"] = [stub(s) for s in schema["anyOf"]]
    if "allOf" in schema:
        out["allOf"] = [{k: s[k] for k in ("pattern", "enum") if k in s} for s in schema["allOf"]]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if "properties" in schema:
        out["properties"] = {}
        for name, sub in schema["properties"].items():
            values = [d[name] for d in docs if isinstance(d, dict) and name in d]
            out["properties"][name] = extract(sub, values) if values else stub(sub)
    if "items" in schema:
        items = [x for d in docs if isinstance(d, list) for x in d]
        out["items"] = extract(schema["items"], items) if items else stub(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        values = [v for d in docs if isinstance(d, dict) for v in d.values()]
        sub = schema["additionalProperties"]
        out["additionalProperties"] = extract(sub, values) if values else stub(sub)
    return out


def main(crd_dir: str) -> None:
    docs = [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    by_kind: dict[str, list] = {}
    for d in docs:
        if d["apiVersion"].startswith(GROUP + "/"):
            by_kind.setdefault(d["kind"], []).append(d)
    kinds = {}
    for path in sorted(Path(crd_dir).glob(f"{GROUP}_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kind = crd["spec"]["names"]["kind"]
        if kind not in by_kind:
            continue
        version = next(v for v in crd["spec"]["versions"] if v.get("served") and v.get("storage"))
        kinds[kind] = {
            "apiVersion": f"{GROUP}/{version['name']}",
            "schema": extract(version["schema"]["openAPIV3Schema"], by_kind[kind]),
        }
    missing = set(by_kind) - set(kinds)
    if missing:
        sys.exit(f"no CRD for {sorted(missing)} in {crd_dir}")
    out = {
        "source": "github.com/envoyproxy/gateway v1.9.0, charts/gateway-helm/charts/crds/crds/generated "
                  "(structure only; regenerate with tests/e2e/crd/gen_eg_subset.py)",
        "kinds": kinds,
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

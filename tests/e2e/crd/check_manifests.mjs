// Checks Kubernetes manifests against schemas shipped by npm packages:
//   @kubernetes-models/istio        (Istio 1.29 CRDs: EnvoyFilter, WasmPlugin, Gateway, VirtualService)
//   @kubernetes-models/gateway-api  (Gateway API CRDs: Gateway, HTTPRoute)
//   kubernetes-models               (Kubernetes OpenAPI: Deployment, ConfigMap, Secret, Service, ...)
//
// Two checks per document:
//   1. schema: the package's validator (ajv, compiled from the CRD's
//      openAPIV3Schema): types, enums, required fields, patterns. These
//      schemas do not reject unknown fields.
//   2. field names: every document becomes a typed TypeScript constant
//      (`const d0: IEnvoyFilter = {...}`) and `tsc --noEmit` runs. TypeScript's
//      excess-property check rejects any field the generated interface does
//      not name, at any depth; preserve-unknown-fields parts (EnvoyFilter
//      patch values, Envoy config) are typed `{}` and pass. Documents marked
//      "partial" (a strategic merge patch) are checked as DeepPartial<T>.
//
// Usage: node check_manifests.mjs CRD_TOOLS_DIR INPUT.json WORKDIR
//   INPUT.json: [{"id": "...", "doc": {...}, "partial": false}, ...]
// Prints {"results": {id: {"schema": [...], "fields": [...]}}, "unsupported": [ids]}.

import { readFileSync, writeFileSync, mkdirSync, symlinkSync, existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { spawnSync } from "node:child_process";

const MODELS = {
  "networking.istio.io/v1alpha3/EnvoyFilter": "@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter",
  "extensions.istio.io/v1alpha1/WasmPlugin": "@kubernetes-models/istio/extensions.istio.io/v1alpha1/WasmPlugin",
  "networking.istio.io/v1/Gateway": "@kubernetes-models/istio/networking.istio.io/v1/Gateway",
  "networking.istio.io/v1/VirtualService": "@kubernetes-models/istio/networking.istio.io/v1/VirtualService",
  "gateway.networking.k8s.io/v1/Gateway": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway",
  "gateway.networking.k8s.io/v1/HTTPRoute": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute",
  "apps/v1/Deployment": "kubernetes-models/apps/v1/Deployment",
  "v1/ConfigMap": "kubernetes-models/v1/ConfigMap",
  "v1/Secret": "kubernetes-models/v1/Secret",
  "v1/Service": "kubernetes-models/v1/Service",
  "v1/ServiceAccount": "kubernetes-models/v1/ServiceAccount",
  "networking.k8s.io/v1/NetworkPolicy": "kubernetes-models/networking.k8s.io/v1/NetworkPolicy",
};

const [root, inputPath, workdir] = process.argv.slice(2);
if (!root || !inputPath || !workdir) {
  console.error("usage: node check_manifests.mjs CRD_TOOLS_DIR INPUT.json WORKDIR");
  process.exit(2);
}
const modules = join(root, "node_modules");
const input = JSON.parse(readFileSync(inputPath, "utf8"));
const results = {};
const unsupported = [];
const typed = [];

for (const item of input) {
  const doc = item.doc;
  const key = `${doc.apiVersion}/${doc.kind}`;
  const mod = MODELS[key];
  if (!mod) {
    unsupported.push(item.id);
    continue;
  }
  const res = (results[item.id] = { schema: [], fields: [] });
  if (!item.partial) {
    // The package's "exports" map names these paths; import the files directly.
    const loaded = await import(pathToFileURL(join(modules, mod + ".js")).href);
    const Model = loaded[doc.kind];
    try {
      new Model(doc).validate();
    } catch (e) {
      res.schema.push(String(e.message || e));
    }
  }
  typed.push({ id: item.id, mod, iface: "I" + doc.kind, partial: !!item.partial, doc });
}

// --- field names: one typed constant per line, then tsc.
mkdirSync(workdir, { recursive: true });
if (!existsSync(join(workdir, "node_modules"))) symlinkSync(modules, join(workdir, "node_modules"), "dir");
const lines = [
  "type DeepPartial<T> = T extends (infer U)[] ? DeepPartial<U>[] : T extends object ? { [K in keyof T]?: DeepPartial<T[K]> } : T;",
];
const imported = new Map();
for (const t of typed) {
  if (!imported.has(t.mod)) {
    const alias = `M${imported.size}`;
    imported.set(t.mod, alias);
    lines.push(`import type * as ${alias} from "${t.mod}";`);
  }
}
const lineOf = {};
typed.forEach((t, i) => {
  const type = `${imported.get(t.mod)}.${t.iface}`;
  lineOf[lines.length + 1] = t.id;
  lines.push(`export const d${i}: ${t.partial ? `DeepPartial<${type}>` : type} = ${JSON.stringify(t.doc)};`);
});
writeFileSync(join(workdir, "check.ts"), lines.join("\n") + "\n");
writeFileSync(
  join(workdir, "tsconfig.json"),
  JSON.stringify({
    compilerOptions: {
      strict: true, noEmit: true, module: "nodenext", moduleResolution: "nodenext",
      target: "es2022", skipLibCheck: true, types: [],
    },
    files: ["check.ts"],
  }),
);
const tsc = spawnSync(process.execPath, [join(modules, "typescript", "bin", "tsc"), "-p", workdir], {
  encoding: "utf8",
  timeout: 120000,
});
const other = [];
for (const line of (tsc.stdout + tsc.stderr).split("\n")) {
  const m = line.match(/check\.ts\((\d+),\d+\): (error .*)$/);
  if (m && lineOf[m[1]]) results[lineOf[m[1]]].fields.push(m[2]);
  else if (line.trim()) other.push(line);
}
if (tsc.status !== 0 && tsc.status !== 2) other.push(`tsc exited with ${tsc.status} ${tsc.error || ""}`);
console.log(JSON.stringify({ results, unsupported, other }));

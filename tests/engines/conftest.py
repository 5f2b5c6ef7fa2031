"""Fixtures for the real-engine tests (`make test-engines`).

The engines and the tiny model come from `make engines`:
- KVROUTE_VLLM_PYTHON: the vLLM virtualenv's python (default .venv-vllm);
- KVROUTE_LLAMA_SERVER: llama-server (default .tools/llama.cpp-*/bin);
- KVROUTE_TINY_MODEL / KVROUTE_TINY_GGUF: the model folder and its GGUF.

Missing pieces skip their tests with the reason; KVROUTE_REQUIRE_ENGINES=1
(set by `make test-engines`) turns that into a failure. Engines are started
once per module, on free loopback ports, and stopped by PID group when the
module ends.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from engines import LlamaServer, Vllm  # noqa: E402


def _missing(reason: str):
    if os.environ.get("KVROUTE_REQUIRE_ENGINES") == "1":
        pytest.fail(reason + " and KVROUTE_REQUIRE_ENGINES=1")
    pytest.skip(reason)


def _path(env: str, default: Path) -> Path:
    return Path(os.environ.get(env) or default)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    p = _path("KVROUTE_TINY_MODEL", REPO / ".tools" / "tiny-model")
    if not (p / "config.json").exists():
        _missing(f"no tiny model at {p} (make engines)")
    return p


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    p = _path("KVROUTE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python")
    if not p.exists():
        _missing(f"no vLLM virtualenv at {p} (make engines)")
    return p


@pytest.fixture(scope="session")
def llama_server() -> Path:
    env = os.environ.get("KVROUTE_LLAMA_SERVER")
    found = [Path(env)] if env else sorted((REPO / ".tools").glob("llama.cpp-*/bin/llama-server"))
    if not found or not found[-1].exists():
        _missing("no llama-server under .tools (make engines)")
    return found[-1]


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model) -> Path:
    p = _path("KVROUTE_TINY_GGUF", tiny_model.parent / "tiny-model.gguf")
    if not p.exists():
        _missing(f"no GGUF of the tiny model at {p} (make engines)")
    return p


def _start_all(engines):
    for e in engines:
        e.spawn()
    try:
        for e in engines:
            took = e.wait_healthy()
            print(f"\n[engines] {e.kind} on {e.address} healthy after {took:.0f} s")
    except BaseException:
        for e in engines:
            e.cleanup()
        raise
    return engines


def _fleet(make):
    """Two engines made by `make(port)`, started together; stopped and
    their folders removed when the module ends."""
    engines = _start_all([make(p) for p in harness.free_ports(2)])
    yield engines
    for e in engines:
        e.cleanup()


@pytest.fixture(scope="module")
def vllm_fleet(vllm_python, tiny_model):
    """Two vLLM replicas, started together (each takes 40-110 s)."""
    yield from _fleet(lambda port: Vllm(port, vllm_python, tiny_model))


@pytest.fixture(scope="module")
def llama_fleet(llama_server, tiny_gguf):
    yield from _fleet(lambda port: LlamaServer(port, llama_server, tiny_gguf))


@pytest.fixture(scope="session")
def collector_binary() -> Path:
    found = harness.collector_binary()
    if found is None:
        _missing(harness.collector_missing_reason())
    return found


@pytest.fixture(scope="session")
def wasm_path() -> Path:
    if not harness.wasm_available():
        _missing(harness.WASM_MISSING_REASON)
    return harness.WASM_PATH

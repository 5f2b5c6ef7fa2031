"""A broken plugin configuration is refused, loudly.

What Envoy 1.40 does when the plugin's on_configure returns false (observed,
pinned by these tests):
- at start-up the process exits with status 1, logging
    [critical][wasm] ... Plugin kvroute failed to load
    [critical][main] ... error `Unable to create Wasm plugin kvroute` initializing config ...
  (the listener never comes up); the filter's own log lines appear as
    [error][wasm] ... wasm log kvroute kvroute: <message>
- `envoy --mode validate` also runs on_configure and exits 1 with
    error initializing configuration '...': Unable to create Wasm plugin kvroute
  so CI can catch a bad config without starting a proxy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import harness
from config_cases import BAD_PLUGIN_CONFIGS

EXAMPLES = harness.REPO_ROOT / "examples"
ENVOY_REFUSAL = "Unable to create Wasm plugin kvroute"


def write_config(tmp_path: Path, plugin_config) -> tuple[Path, dict]:
    gateway, admin = harness.free_ports(2)
    cfg = harness.build_envoy_config(
        gateway_port=gateway,
        admin_port=admin,
        endpoints=["127.0.0.1:8001", "127.0.0.1:8002"],
        plugin_config=plugin_config,
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, cfg


def kvroute_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "kvroute" in line]


def assert_names_problem(log: str, words: list[str]) -> None:
    lines = kvroute_lines(log)
    assert lines, f"no log line mentions kvroute:\n{log[-3000:]}"
    # The filter itself said something (a line logged from inside the VM).
    assert any("wasm log" in line for line in lines), "the filter logged no reason:\n" + "\n".join(lines)
    for word in words:
        assert any(word in line for line in lines), (
            f"no kvroute log line names {word!r}:\n" + "\n".join(lines)
        )


IDS = [c[0] for c in BAD_PLUGIN_CONFIGS]


@pytest.mark.parametrize("case", BAD_PLUGIN_CONFIGS, ids=IDS)
def test_envoy_refuses_bad_config_at_startup(case, tmp_path, wasm_path):
    _id, plugin_config, words, _ = case
    _, cfg = write_config(tmp_path, plugin_config)
    envoy = harness.Envoy(cfg, tmp_path / "run", concurrency=1)
    envoy.spawn()
    try:
        code = envoy.wait_exit(timeout=30)
        log = envoy.log_text()
        assert code is not None, f"Envoy kept running with a broken kvroute config:\n{envoy.log_tail()}"
        assert code != 0, f"Envoy exited 0:\n{envoy.log_tail()}"
    finally:
        envoy.stop()
    assert ENVOY_REFUSAL in log, log[-3000:]
    assert_names_problem(log, words)


@pytest.mark.parametrize("case", BAD_PLUGIN_CONFIGS, ids=IDS)
def test_validate_mode_refuses_bad_config(case, tmp_path, wasm_path):
    _id, plugin_config, words, _ = case
    path, _ = write_config(tmp_path, plugin_config)
    result = harness.validate_config(path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert ENVOY_REFUSAL in output, output
    assert_names_problem(output, words)


@pytest.mark.parametrize(
    "path", sorted(p for p in EXAMPLES.glob("*.json") if not p.name.endswith(".schema.json")),
    ids=lambda p: p.name,
)
def test_filter_accepts_example_config(path, tmp_path, wasm_path):
    """The examples are not just schema-valid: the filter takes them."""
    plugin_config = json.loads(path.read_text())
    cfg_path, _ = write_config(tmp_path, plugin_config)
    result = harness.validate_config(cfg_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ingest_token_is_never_logged(tmp_path, wasm_path):
    """A refused ingest config names ingest.token but never prints its value."""
    secret = "sekrit-Value-42"  # 15 characters: one too short
    path, _ = write_config(tmp_path, {"role": "ingest", "ingest": {"token": secret}})
    result = harness.validate_config(path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert_names_problem(output, ["ingest.token"])
    assert secret not in output


def test_bad_ingest_listener_config_is_refused(tmp_path, wasm_path):
    """The ingest listener's plugin is checked like the router's: Envoy refuses it."""
    gateway, admin, ingest = harness.free_ports(3)
    cfg = harness.build_envoy_config(
        gateway_port=gateway, admin_port=admin, endpoints=["127.0.0.1:8001"],
        ingest_port=ingest, ingest_config={"role": "ingest", "ingest": {"token": "0123456789abcdef", "maxBytes": 0}},
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = harness.validate_config(path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Unable to create Wasm plugin kvroute-ingest" in output, output[-3000:]
    assert_names_problem(output, ["ingest.maxBytes"])


def test_good_config_starts(tmp_path, wasm_path):
    """Control for the refusals above: the same harness path with a good config comes up."""
    _, cfg = write_config(tmp_path, {"hosts": ["127.0.0.1:8001", "127.0.0.1:8002"]})
    envoy = harness.Envoy(cfg, tmp_path / "run", concurrency=1)
    try:
        envoy.start(timeout=30)
        assert envoy.running()
    finally:
        envoy.stop()

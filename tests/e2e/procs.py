"""Start kvgate processes (emulated engines, the gateway) on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.cli.demo import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "e2e-model"


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start(args: list[str], name: str, port: int, logdir: Path) -> Proc:
    log = logdir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KVGATE_PORT", None)
    with log.open("wb") as fh:
        popen = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            cwd=ROOT,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Proc(name, f"http://127.0.0.1:{port}", popen, log)


def wait_for(proc: Proc, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited early:\n{proc.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(proc.url + path).status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not ready after {timeout} s:\n{proc.output()}")


def start_emulator(
    logdir: Path,
    index: int,
    *,
    time_scale: float = 0.02,
    extra: list[str] | None = None,
    port: int | None = None,
    name: str | None = None,
    timeout: float = 30.0,
    wait: bool = True,
) -> Proc:
    """An emulated engine on ``port`` (a free one by default), healthy when returned
    (``wait=False``: just started; wait for its ``/health`` yourself)."""
    port = port or free_port()
    proc = start(
        [
            "emulate",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--time-scale",
            str(time_scale),
            "--seed",
            str(index),
            *(extra or []),
        ],
        name or f"engine{index}",
        port,
        logdir,
    )
    if wait:
        wait_for(proc, "/health", timeout=timeout)
    return proc


def start_gateway(
    logdir: Path, engines: list[str], *, policy: str = "cache_aware", extra: list[str] | None = None
) -> Proc:
    port = free_port()
    args = ["serve", "--port", str(port), "--policy", policy]
    for url in engines:
        args += ["--engine", url]
    proc = start([*args, *(extra or [])], "gateway", port, logdir)
    wait_for(proc, "/ready")
    return proc


@dataclass
class Cluster:
    engines: list[Proc]
    gateway: Proc
    all: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for p in [self.gateway, *self.engines]:
            p.stop()


@contextlib.contextmanager
def cluster(
    logdir: Path,
    n: int = 3,
    *,
    policy: str = "cache_aware",
    time_scale: float = 0.02,
    gateway_args: list[str] | None = None,
) -> Iterator[Cluster]:
    engines: list[Proc] = []
    gw: Proc | None = None
    try:
        engines = [start_emulator(logdir, i, time_scale=time_scale) for i in range(n)]
        gw = start_gateway(logdir, [e.url for e in engines], policy=policy, extra=gateway_args)
        yield Cluster(engines, gw)
    finally:
        for p in [gw, *engines]:
            if p is not None:
                p.stop()


@contextlib.contextmanager
def pd_cluster(
    logdir: Path,
    prefill: int = 1,
    decode: int = 2,
    *,
    policy: str = "cost_model",
    time_scale: float = 0.05,
) -> Iterator[Cluster]:
    """Prefill and decode emulators (NIXL-style roles) behind one gateway.

    The engines start together (each takes seconds to import on a loaded machine)."""
    engines: list[Proc] = []
    gw: Proc | None = None
    try:
        for i in range(prefill + decode):
            role = "prefill" if i < prefill else "decode"
            port = free_port()
            args = ["emulate", "--port", str(port), "--model", MODEL, "--seed", str(i)]
            args += ["--time-scale", str(time_scale), "--role", role]
            engines.append(start(args, f"engine{i}", port, logdir))
        for e in engines:
            wait_for(e, "/health")
        port = free_port()
        args = ["serve", "--port", str(port), "--policy", policy]
        for i, e in enumerate(engines):
            args += ["--prefill" if i < prefill else "--decode", e.url]
        gw = start(args, "gateway", port, logdir)
        wait_for(gw, "/ready")
        yield Cluster(engines, gw)
    finally:
        for p in [gw, *engines]:
            if p is not None:
                p.stop()

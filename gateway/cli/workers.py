"""``kvgate serve --workers N``: N gateway processes sharing one port (SO_REUSEPORT).

One kvgate process is one Python event loop, so it uses one core. With
``--workers N`` a supervisor process starts N workers; each binds its own
listening socket to the same address with ``SO_REUSEPORT`` and the kernel
spreads incoming connections over them (by a hash of the connection's
addresses). Each worker is a full replica, built by ``create_app`` from the
same resolved :class:`~gateway.config.Settings`: its own engine probes,
policy state and KV-event subscription, exactly as separate replicas behind
a load balancer (docs/deployment.md, "Worker processes").

Lifecycle:

* The supervisor binds (without listening) a socket of its own first: it
  holds the port for the workers' whole life, turns ``--port 0`` into a
  concrete port, and fails at once if the port is taken.
* A worker listens only after its startup (engine probes, KV-event
  subscriptions) is done, so no connection waits on a worker that is not ready.
  The supervisor exits 1 if any worker fails to start.
* SIGTERM or SIGINT to the supervisor: every worker drains (uvicorn stops
  accepting and lets open requests finish within ``shutdown_grace_s``); the
  supervisor exits 0 once all have exited (a worker still running
  ``shutdown_grace_s + KILL_AFTER_S`` later is killed).
* A worker that dies (crash, OOM kill, SIGKILL) is restarted after a backoff
  (``RESTART_BACKOFF_S`` doubling up to ``RESTART_BACKOFF_MAX_S``; reset once a
  worker has run ``STABLE_AFTER_S``); the connections it held are lost, as with
  any process death; the others keep serving. ``MAX_FAILED_STARTS`` restarts in
  a row that never become ready stop the whole server with exit code 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from gateway.config import Settings
from gateway.core.errors import ConfigError

log = logging.getLogger("kvgate.workers")

RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
STABLE_AFTER_S = 30.0
MAX_FAILED_STARTS = 5
KILL_AFTER_S = 10.0
"""Seconds past the drain grace period after which a worker still running is killed."""
START_TIMEOUT_S = 120.0
"""Longest a worker may take to become ready (discovery can wait for the API server)."""


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, not yet listening."""
    if not hasattr(socket, "SO_REUSEPORT"):  # pragma: no cover - Linux and BSDs have it
        raise ConfigError("--workers needs SO_REUSEPORT, which this platform lacks")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


def worker_settings(values: dict[str, Any], index: int) -> Settings:
    """Worker ``index``'s settings: the supervisor's, with ``-w<index>`` appended to an
    explicit ``replica_sync.replica_id`` (replica sync ignores messages carrying its own id,
    so workers sharing one would not see each other's load)."""
    sync = values.get("replica_sync")
    if isinstance(sync, dict) and sync.get("replica_id"):
        sync = {**sync, "replica_id": f"{sync['replica_id']}-w{index}"}
        values = {**values, "replica_sync": sync}
    return Settings.model_validate(values)


def worker_main(values: dict[str, Any], port: int, index: int, ready: Any) -> None:
    """One worker process: the gateway app on its own SO_REUSEPORT socket.

    ``values`` is the supervisor's resolved settings (``Settings.model_dump()``, secrets
    included): validated again as they are, without reading the environment or a file, so
    every worker runs with exactly the supervisor's settings (:func:`worker_settings`)."""
    import uvicorn

    from gateway.cli.http_limits import server_options
    from gateway.observability import configure_logging
    from gateway.proxy.app import create_app

    settings = worker_settings(values, index)
    configure_logging(settings.log_level)
    sock = reuseport_socket(settings.host, port)  # listened on after startup, by uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.send(index)

    config = uvicorn.Config(
        create_app(settings),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        **server_options(settings.max_header_bytes),
    )
    # uvicorn re-raises SIGTERM/SIGINT after draining: absorbed here, so a drained worker
    # exits 0 rather than by the signal
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    signal.signal(signal.SIGINT, lambda _sig, _frame: None)
    Server(config).run(sockets=[sock])


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    ready_conn: Any
    started: float = field(default_factory=time.monotonic)
    ready: bool = False


class Supervisor:
    """Starts, watches, restarts and drains the worker processes."""

    def __init__(self, settings: Settings, workers: int) -> None:
        if workers < 1:
            raise ConfigError("--workers must be at least 1")
        self.settings = settings
        self.count = workers
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.workers: dict[int, _Worker] = {}
        self.stopping = False
        self.failed_starts = 0
        self.backoff = RESTART_BACKOFF_S
        self._holder = reuseport_socket(settings.host, settings.port)
        self.port: int = self._holder.getsockname()[1]

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the exit code."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for i in range(self.count):
                self._spawn(i)
            if not self._wait_ready():
                self._stop_all()
                return 1
            log.info(
                "kvgate serving",
                extra={"host": self.settings.host, "port": self.port, "workers": self.count},
            )
            code = self._watch()
            self._stop_all()
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._holder.close()

    # -- internals -----------------------------------------------------------------
    def _on_signal(self, _sig: int, _frame: FrameType | None) -> None:
        self.stopping = True

    def _spawn(self, index: int) -> None:
        receiver, sender = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(
            target=worker_main,
            args=(self.settings.model_dump(), self.port, index, sender),
            name=f"kvgate-worker-{index}",
        )
        process.start()
        sender.close()
        self.workers[index] = _Worker(index, process, receiver)

    def _poll_ready(self, worker: _Worker) -> None:
        with contextlib.suppress(EOFError, OSError):
            if not worker.ready and worker.ready_conn.poll():
                worker.ready_conn.recv()
                worker.ready = True

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self.stopping:
            for w in self.workers.values():
                self._poll_ready(w)
                if not w.ready and not w.process.is_alive():
                    log.error(
                        "worker failed to start",
                        extra={"worker": w.index, "exit_code": w.process.exitcode},
                    )
                    return False
            if all(w.ready for w in self.workers.values()):
                return True
            self._sleep(0.05)
        if not self.stopping:
            log.error("workers not ready in time", extra={"timeout_s": START_TIMEOUT_S})
        return self.stopping  # a signal during startup: drain what started, exit 0

    def _watch(self) -> int:
        restart_at: dict[int, float] = {}
        while not self.stopping:
            now = time.monotonic()
            for index, w in list(self.workers.items()):
                self._poll_ready(w)
                if w.ready and now - w.started > STABLE_AFTER_S:
                    self.failed_starts = 0
                    self.backoff = RESTART_BACKOFF_S
                if w.process.is_alive() or index in restart_at:
                    continue
                if not w.ready:
                    self.failed_starts += 1
                if self.failed_starts >= MAX_FAILED_STARTS:
                    log.error("workers keep failing to start; stopping", extra={"worker": index})
                    return 1
                log.error(
                    "worker died; restarting it",
                    extra={
                        "worker": index,
                        "exit_code": w.process.exitcode,
                        "restart_in_s": self.backoff,
                    },
                )
                restart_at[index] = now + self.backoff
                self.backoff = min(RESTART_BACKOFF_MAX_S, self.backoff * 2)
            for index, at in list(restart_at.items()):
                if now >= at:
                    del restart_at[index]
                    self.workers[index].ready_conn.close()
                    self._spawn(index)
            self._sleep(0.2)
        return 0

    def _sleep(self, seconds: float) -> None:
        sentinels = [w.process.sentinel for w in self.workers.values()]
        multiprocessing.connection.wait(sentinels, timeout=seconds)

    def _stop_all(self) -> None:
        alive = [w for w in self.workers.values() if w.process.is_alive()]
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                if w.process.pid is not None:  # uvicorn drains: no new connections, open
                    os.kill(w.process.pid, signal.SIGTERM)  # requests finish
        deadline = time.monotonic() + self.settings.shutdown_grace_s + KILL_AFTER_S
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.error("worker did not drain in time; killed", extra={"worker": w.index})
                w.process.kill()
                w.process.join(5)
        for w in self.workers.values():
            w.ready_conn.close()

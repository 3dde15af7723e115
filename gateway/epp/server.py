"""``kvgate epp``'s server: ext_proc and gRPC health on one port, ``/metrics`` on another.

:class:`EppServer` builds the routing service (:class:`~gateway.proxy.service.RoutingService`,
the same object ``kvgate serve`` fronts with HTTP), a :class:`~gateway.epp.picker.Picker`
and a :class:`~gateway.epp.accounting.Ledger` over it, and serves
``envoy.service.ext_proc.v3.ExternalProcessor`` on a ``grpc.aio`` server (one asyncio
loop: the routing service's tasks and every stream share it, no thread hand-offs). gRPC
messages may be as large as ``max_body_bytes`` plus 1 MiB (a BUFFERED body comes in one).
TLS when a certificate and key are given; plaintext otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import start_http_server

from gateway.config import Settings
from gateway.core.errors import ConfigError
from gateway.proxy.service import RoutingService

from .accounting import Ledger
from .bridge import NativeFrontEnd, find_binary
from .health import Health
from .picker import Picker
from .stream import StreamHandler
from .tracing import PickTracing

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger("kvgate.epp")


@dataclass(frozen=True, slots=True)
class EppOptions:
    """What ``kvgate epp`` adds to the gateway's settings."""

    host: str = "127.0.0.1"
    port: int = 9002
    metrics_host: str | None = None
    """Address of ``/metrics`` (None: ``host``)."""
    metrics_port: int | None = 9090
    """None: no metrics endpoint (tests read the registry directly)."""
    cert_path: Path | None = None
    key_path: Path | None = None
    fallbacks: int = 0
    """Fallback endpoints named after the primary (0: the primary alone). Envoy's
    ``ORIGINAL_DST`` cluster keyed by the header (the extension's own configuration) does not
    reliably take a list: name fallbacks only for a data plane that reads one."""
    release_after_s: float | None = None
    """Release a picked request whose response has not ended after this long (None: the
    upstream read timeout, ``timeouts.read_s``)."""
    grace_s: float = 5.0
    frontend: str = "python"
    """``python``: grpc.aio in this process; ``native``: ``kvgate-epp-front`` (C++) speaks
    the protocol and asks this process for each decision (:mod:`gateway.epp.bridge`)."""
    native_binary: Path | None = None
    """The native front end's binary (None: found by :func:`~gateway.epp.bridge.find_binary`)."""


class _Processor:
    """The ExternalProcessor servicer: ``Process`` is the handler's async generator itself
    (grpc.aio streams it; no wrapper generator per message)."""

    def __init__(self, handler: StreamHandler) -> None:
        self.Process = handler.run


def _credentials(options: EppOptions) -> grpc.ServerCredentials | None:
    if options.cert_path is None and options.key_path is None:
        return None
    if options.cert_path is None or options.key_path is None:
        raise ConfigError("TLS needs both --cert-path and --key-path")
    try:
        cert = options.cert_path.read_bytes()
        key = options.key_path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS certificate or key: {exc}") from None
    return grpc.ssl_server_credentials([(key, cert)])


class EppServer:
    """The endpoint picker: start, serve until stopped, stop."""

    def __init__(
        self,
        settings: Settings,
        options: EppOptions,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.service = RoutingService(settings, transport=transport)
        self.picker = Picker(self.service, fallbacks=options.fallbacks)
        release = options.release_after_s or settings.timeouts.read_s
        self.ledger = Ledger(self.service, self.picker, release_after_s=release)
        self.tracing = (
            PickTracing(settings.tracing, tracer_provider) if settings.tracing.enabled else None
        )
        """Spans per routed request (``tracing.enabled``); ``tracer_provider``: a caller's."""
        self.handler = StreamHandler(self.service, self.picker, self.ledger, tracing=self.tracing)
        self.health = Health()
        self.port = 0
        """The gRPC port bound (``options.port``, or the one the OS chose for 0)."""
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._native: NativeFrontEnd | None = None
        self._metrics: Any = None

    @property
    def failed(self) -> asyncio.Event | None:
        """Set when the native front end exited on its own (None: the Python front end)."""
        return self._native.failed if self._native is not None else None

    async def _start_native(self) -> None:
        o = self.options
        tls = None
        if o.cert_path is not None or o.key_path is not None:
            _credentials(o)  # both given and readable, or a clear error
            assert o.cert_path is not None and o.key_path is not None
            tls = (o.cert_path, o.key_path)
        host = f"[{o.host}]" if ":" in o.host else o.host
        self._native = NativeFrontEnd(
            self.handler,
            self.ledger,
            find_binary(o.native_binary),
            listen=f"{host}:{o.port}",
            max_body=self.settings.max_body_bytes,
            grace_s=o.grace_s,
            tls=tls,
        )
        self.port = await self._native.start()  # liveness serves from here

    async def start(self) -> None:
        """Listen (liveness serves at once), start the routing service, then be ready."""
        if self.options.frontend == "native":
            await self._start_native()
        else:
            await self._start_grpc()
        if self.options.metrics_port is not None:
            host = self.options.metrics_host or self.options.host
            try:
                self._metrics = start_http_server(
                    self.options.metrics_port, addr=host, registry=self.service.metrics.registry
                )
            except OSError as exc:
                raise ConfigError(f"cannot serve /metrics on {host}: {exc}") from None
            self.metrics_port = self._metrics[0].server_port
        await self.service.start()
        await self.set_ready(True)
        log.info(
            "kvgate epp ready",
            extra={
                "port": self.port,
                "tls": self.options.cert_path is not None,
                "policy": self.service.policy_name,
                "frontend": self.options.frontend,
            },
        )

    async def _start_grpc(self) -> None:
        creds = _credentials(self.options)  # a bad certificate fails before anything runs
        limit = self.settings.max_body_bytes + (1 << 20)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(_Processor(self.handler), server)
        self.health.attach(server)
        target = f"{self.options.host}:{self.options.port}"
        port = (
            server.add_secure_port(target, creds)
            if creds is not None
            else server.add_insecure_port(target)
        )
        if not port:
            raise ConfigError(f"cannot listen on {target}")
        self.port = port
        await server.start()
        self._server = server
        await self.health.alive()

    async def set_ready(self, ready: bool) -> None:
        """Readiness (and the processor's health) as Envoy's health check sees it."""
        if self._native is not None:
            await self._native.ready(ready)
        else:
            await self.health.ready(ready)

    async def wait(self) -> None:
        if self._native is not None:
            await self._native.failed.wait()
            return
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self) -> None:
        """Not ready, let open streams finish within the grace period, then stop all."""
        await self.set_ready(False)
        if self._native is not None:
            await self._native.stop()
            self._native = None
        if self._server is not None:
            await self._server.stop(self.options.grace_s)
            self._server = None
        for ticket in list(self.ledger.open.values()):
            self.ledger.release(ticket, "shutdown")
        if self._metrics is not None:
            server, thread = self._metrics
            server.shutdown()
            server.server_close()
            await asyncio.to_thread(thread.join, 5)
            self._metrics = None
        await self.service.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # flushes the spans still queued

"""gRPC health (``grpc.health.v1.Health``) as the Endpoint Picker protocol asks.

* ``liveness``: SERVING as soon as the server listens;
* ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``: SERVING once the
  routing service has started (engines probed, KV events replayed, discovery's first list
  read), NOT_SERVING again while shutting down;
* ``""`` (the server as a whole) follows readiness.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

LIVENESS = "liveness"
READINESS = "readiness"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The health service's statuses; :meth:`attach` it to a ``grpc.aio`` server."""

    def __init__(self) -> None:
        self.servicer = health_aio.HealthServicer()

    def attach(self, server: Any) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def alive(self) -> None:
        await self.servicer.set(LIVENESS, _SERVING)
        for name in ("", READINESS, EXT_PROC):
            await self.servicer.set(name, _NOT_SERVING)

    async def ready(self, ready: bool) -> None:
        status = _SERVING if ready else _NOT_SERVING
        for name in ("", READINESS, EXT_PROC):
            await self.servicer.set(name, status)

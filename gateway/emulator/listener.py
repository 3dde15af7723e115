"""Listener control for the ``refuse`` and ``reset`` faults, around a ``uvicorn.Server``.

``refuse`` closes the listening socket (new connections are refused, as by a
process that is gone) and aborts every open connection (keep-alive ones too),
then after the given time binds the same address again and serves on it with
the server's own protocol factory. ``reset`` aborts one request's connection
(TCP RST) before any byte of an answer. This reaches into uvicorn's server
state (``servers``, ``server_state.connections``, ``lifespan.state``); it is
used only when a fault asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import Scope

if TYPE_CHECKING:
    from gateway.emulator.faults import FaultInjector

log = logging.getLogger(__name__)


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port), reusing the address; raises OSError."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ServerListener:
    """Closes and reopens a running uvicorn server's listener; aborts its connections."""

    def __init__(self, server: Any, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.refusing = False

    def _connections(self) -> list[Any]:
        state = getattr(self.server, "server_state", None)
        return list(getattr(state, "connections", ()))

    def abort(self, scope: Scope) -> bool:
        client = scope.get("client")
        if not client:
            return False
        peer = tuple(client)
        for conn in self._connections():
            if getattr(conn, "client", None) == peer:
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
                    return True
        return False

    async def refuse(self, seconds: float) -> None:
        if self.refusing:
            return
        self.refusing = True
        log.warning("fault refuse: not listening for %.1f s", seconds)
        try:
            for server in list(getattr(self.server, "servers", ())):
                server.close()
            self.sock.close()
            for conn in self._connections():
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
            await asyncio.sleep(seconds)
            if getattr(self.server, "should_exit", False):
                return
            await self._reopen()
        finally:
            self.refusing = False

    async def _reopen(self) -> None:
        config = self.server.config
        state = self.server.server_state
        app_state = self.server.lifespan.state
        for attempt in range(50):
            try:
                sock = listen(self.host, self.port, config.backlog)
                break
            except OSError as exc:  # pragma: no cover - the port lingers briefly
                if attempt == 49:
                    log.error("fault refuse: cannot listen again: %s", exc)
                    return
                await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            made: asyncio.Protocol = config.http_protocol_class(
                config=config, server_state=state, app_state=app_state
            )
            return made

        server = await loop.create_server(protocol, sock=sock, backlog=config.backlog)
        self.server.servers = [server]
        self.sock = sock
        log.warning("fault refuse: listening again on %s:%s", self.host, self.port)


class FaultServer(uvicorn.Server):
    """A uvicorn server whose listener the faults may close and reopen."""

    def __init__(self, config: uvicorn.Config, faults: FaultInjector, sock: socket.socket) -> None:
        super().__init__(config)
        self.faults = faults
        self.sock = sock

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.faults.attach(ServerListener(self, self.sock))

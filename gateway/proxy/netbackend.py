"""The upstream client's HTTP/1.1 connections: asyncio protocols parsed by httptools.

Profiling the proxy path (docs/performance.md, "Throughput") showed httpcore,
h11 and anyio taking about half of the gateway's CPU per proxied request: a
pool scan over every connection per request, h11's pure-Python parsing, two
socket writes per request and cancel scopes. A connection here is one
``asyncio.Protocol`` whose bytes go through httptools (llhttp, the C parser
uvicorn uses on the client side); the request head and body leave in one
write; body chunks (de-chunked by the parser) wait in a bounded buffer (the
socket stops being read past ``HIGH_WATER`` bytes until the consumer catches
up). Waits are bounded by the caller's timeouts; errors are the
:mod:`gateway.proxy.upstream` ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from typing import cast

import httptools

HIGH_WATER = 256 * 1024
"""Bytes of response body buffered before the socket stops being read."""
MAX_HEAD_BYTES = 64 * 1024
"""Bytes of response head (status line, headers, any 1xx heads before it) accepted before
the answer is refused as broken (nginx refuses past 4-8 KiB, h11 past 16 KiB)."""
MAX_HEADERS = 100
"""Header lines accepted in one response head."""


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""

    reason = "transport"


class UpstreamConnectError(UpstreamError):
    reason = "connect"


class UpstreamTimeoutError(UpstreamError):
    reason = "timeout"


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class H1Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an engine; one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._reading_paused = False
        self.begin()

    # -- one exchange --------------------------------------------------------------
    def begin(self) -> None:
        """Reset the per-response state before a request is written."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.received = 0
        self.head_done = False
        self.head_bytes = 0
        self.complete = False
        self.framed = False
        self.interim = False
        self.keep_alive = False
        self.error: UpstreamError | None = None

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.error is None
            and not self.closed
            and not self.chunks
            and self.keep_alive
        )

    def take(self) -> bytes:
        """Every buffered body byte as one chunk; reading resumes if it was paused."""
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout: float | None) -> None:
        """Until the parser or the connection has news; TimeoutError after ``timeout``."""
        waiter = self.loop.create_future()
        self._waiter = waiter
        timer = self.loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def drain(self, timeout: float) -> None:
        """Until the socket's write buffer is below its high-water mark again."""
        while self._write_paused and not self.closed:
            try:
                await self.wait(timeout)
            except TimeoutError:
                raise UpstreamTimeoutError(f"write blocked for {timeout:g} s") from None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback raised
            self._fail(
                cause if isinstance(cause, UpstreamError) else f"engine sent invalid HTTP: {exc}"
            )
        except httptools.HttpParserUpgrade:
            self._fail("engine switched protocols (101): kvgate never asks it to")
        if not self.head_done and self.received > MAX_HEAD_BYTES and self.error is None:
            self._fail(f"engine sent a response head over {MAX_HEAD_BYTES} bytes")

    def _fail(self, error: UpstreamError | str) -> None:
        """The exchange is broken: record why, close the connection, wake the reader."""
        if self.error is None:
            self.error = error if isinstance(error, UpstreamError) else UpstreamError(error)
        self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and not self.framed and exc is None:
            self.complete = True  # a close-delimited body ends with the connection
        elif not self.complete and self.error is None:
            detail = f": {exc}" if exc else ""
            self.error = UpstreamError(
                "engine closed the connection "
                + ("mid-response" if self.received else "without answering")
                + detail
            )
        self._wake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # -- httptools callbacks -------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the answer, or while the connection sat idle
            raise UpstreamError("engine sent more than one answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self.framed = True
        elif name == b"transfer-encoding":
            if value.strip().lower() != b"chunked":  # kvgate never sends TE: the engine is wrong
                raise UpstreamError(f"engine sent transfer-encoding {value!r}, not chunked")
            self.framed = True
        self.head_bytes += len(name) + len(value)
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the answer follows
            self.interim = True
            self.headers = []
            self.framed = False
            return
        if self.head_bytes > MAX_HEAD_BYTES:  # a head that came whole in one read
            raise UpstreamError(f"engine sent a response head over {MAX_HEAD_BYTES} bytes")
        if len(self.headers) > MAX_HEADERS:
            raise UpstreamError(f"engine sent over {MAX_HEADERS} header lines")
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # valid now, reset after the body
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._reading_paused and self.transport:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()


Origin = tuple[str, str, int]
"""(scheme, host, port)."""


class H1Pool:
    """Keep-alive connections per origin, at most ``max_connections`` open in all.

    Idle connections are reused newest first (their peers are least likely to
    have timed them out) and dropped when the engine closes them, when they
    have been idle for ``keepalive_expiry`` s, or to make room under the cap.
    A request waits at most ``pool_timeout`` s for a connection slot.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        pool_timeout: float,
        keepalive_expiry: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.pool_timeout = pool_timeout
        self.keepalive_expiry = keepalive_expiry
        self._ssl = ssl_context
        self._idle: dict[Origin, deque[H1Connection]] = {}
        self._idle_count = 0
        self.active = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def idle(self) -> int:
        return self._idle_count

    def idle_connections(self) -> list[H1Connection]:
        """The idle connections, every origin's (for health checks and tests)."""
        return [conn for conns in self._idle.values() for conn in conns]

    async def acquire(self, origin: Origin) -> H1Connection:
        """A connection to ``origin`` reserved for one exchange (idle, else new)."""
        if self._closed:
            raise UpstreamError("the upstream client is closed")
        if self.active >= self.max_connections:
            await self._wait_for_slot()
        else:
            self.active += 1
        try:
            conn = self._reuse(origin)
            if conn is None:
                if self.active + self._idle_count > self.max_connections:
                    self._close_oldest_idle()
                conn = await self._connect(origin)
        except BaseException:
            self._free_slot()
            raise
        conn.begin()
        return conn

    def release(self, conn: H1Connection, origin: Origin) -> None:
        """Give back a reserved connection: kept when it can carry another exchange.

        (Connections in use plus idle ones never exceed the cap: a new connection is only
        opened after closing the oldest idle one when the sum would.)"""
        if conn.reusable and not self._closed:
            conn.reused = True
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, deque()).append(conn)
            self._idle_count += 1
        else:
            conn.close()
        self._free_slot()

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._idle_count = 0

    # -- internals -----------------------------------------------------------------
    def _reuse(self, origin: Origin) -> H1Connection | None:
        conns = self._idle.get(origin)
        if not conns:
            return None
        oldest_ok = time.monotonic() - self.keepalive_expiry
        if conns[0].idle_since < oldest_ok:  # expire from the old end, one per request
            conns.popleft().close()
            self._idle_count -= 1
        while conns:
            conn = conns.pop()
            self._idle_count -= 1
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    def _close_oldest_idle(self) -> None:
        oldest: deque[H1Connection] | None = None
        for conns in self._idle.values():
            if conns and (oldest is None or conns[0].idle_since < oldest[0].idle_since):
                oldest = conns
        if oldest is not None:
            oldest.popleft().close()
            self._idle_count -= 1

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, self.pool_timeout)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"no upstream connection free within {self.pool_timeout:g} s "
                f"({self.max_connections} in use)"
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled
                self._free_slot()
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._slot_waiters.remove(waiter)

    def _free_slot(self) -> None:
        while self._slot_waiters:  # hand the slot straight to the next waiter
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    async def _connect(self, origin: Origin) -> H1Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            tls = self._ssl or ssl.create_default_context()
            self._ssl = tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, conn = await loop.create_connection(
                    lambda: H1Connection(loop),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                )
        except TimeoutError:
            raise UpstreamTimeoutError(f"connect took over {self.connect_timeout:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(f"cannot connect: {exc or 'refused'}") from None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

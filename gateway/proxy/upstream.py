"""The upstream HTTP client of the proxy path: one small interface, two implementations.

Production uses :class:`HttpUpstream`: kvgate's own keep-alive pool of
httptools-parsed HTTP/1.1 connections (:mod:`gateway.proxy.netbackend`; it
replaced httpcore, whose pool scan, h11 parsing and anyio layers cost about
half the proxy's CPU per request). Tests pass an ``httpx`` transport (e.g.
``httpx.MockTransport``) and get :class:`HttpxUpstream`. Both raise the same
:class:`UpstreamError` subclasses, so the forwarder has one retry policy.
Neither sends hop-by-hop headers (:func:`end_to_end`); responses expose only
their status, one header lookup and the body, so an engine's hop-by-hop
headers never reach the client either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from gateway.proxy.netbackend import (
    HIGH_WATER,
    H1Connection,
    H1Pool,
    Origin,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)

__all__ = [
    "HttpUpstream",
    "HttpxUpstream",
    "Timeouts",
    "Upstream",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamTimeoutError",
    "end_to_end",
]

Headers = Sequence[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect: float
    read: float
    write: float
    pool: float


class UpstreamResponse(Protocol):
    status: int

    def header(self, name: bytes) -> bytes | None: ...
    async def read(self) -> bytes: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    async def close(self) -> None: ...


class Upstream(Protocol):
    async def send(
        self, url: str, headers: Headers, body: bytes, *, method: str = "POST"
    ) -> UpstreamResponse: ...
    async def aclose(self) -> None: ...


HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Hop-by-hop headers (RFC 9110 §7.6.1): never sent on to an engine."""
_FRAMING = frozenset({b"host", b"content-length"})
"""Set by the upstream client itself, from the engine URL and the body."""


def end_to_end(headers: Headers) -> list[tuple[bytes, bytes]]:
    """``headers`` without hop-by-hop ones, those a ``Connection`` header names, and framing
    headers (the forwarder sends only its own few headers; this is the last line)."""
    named: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b","))
    return [
        (key, value)
        for key, value in headers
        if (k := key.lower()) not in HOP_BY_HOP and k not in _FRAMING and k not in named
    ]


_METHODS = frozenset({"GET", "POST", "DELETE"})
_MAX_TARGETS = 4096
"""Parsed request URLs kept (engine URL x path: a handful per engine)."""


@dataclass(frozen=True, slots=True)
class _Target:
    origin: Origin
    head: bytes
    """Request line and Host header, ready to be followed by the other headers."""


def _target(url: str, method: str = "POST") -> _Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"unsupported engine URL {url!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if method not in _METHODS:
        raise UpstreamError(f"unsupported method {method!r}")
    head = method.encode() + b" " + path.encode("ascii") + b" HTTP/1.1\r\nhost: "
    head += parts.netloc.encode()
    return _Target((scheme, parts.hostname, port), head + b"\r\n")


class _H1Response:
    """An engine's answer on one pooled connection; the connection goes back on the last
    byte, or is closed when the answer is abandoned."""

    __slots__ = ("_conn", "_origin", "_pool", "_read_timeout", "status")

    def __init__(self, pool: H1Pool, origin: Origin, conn: H1Connection, read_timeout: float):
        self._pool = pool
        self._origin = origin
        self._conn: H1Connection | None = conn
        self._read_timeout = read_timeout
        self.status = conn.status

    def header(self, name: bytes) -> bytes | None:
        conn = self._conn
        if conn is not None:
            for key, value in conn.headers:
                if key == name:
                    return value
        return None

    async def _next(self, conn: H1Connection) -> None:
        try:
            await conn.wait(self._read_timeout)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"no data from the engine for {self._read_timeout:g} s"
            ) from None

    async def read(self) -> bytes:
        """The whole body; it must arrive within the read timeout after the head (a drip of
        bytes does not extend it), and a body past ``HIGH_WATER`` keeps the socket read."""
        conn = self._conn
        assert conn is not None, "read after close"
        try:
            if conn.complete:  # the common case: the body came with the head
                return conn.take() if conn.chunks else b""
            parts: list[bytes] = []
            deadline = conn.loop.time() + self._read_timeout
            while not conn.complete:
                if conn.error is not None:
                    raise conn.error
                if conn.buffered >= HIGH_WATER:
                    parts.append(conn.take())
                left = deadline - conn.loop.time()
                try:
                    await conn.wait(max(left, 0.0))
                except TimeoutError:
                    raise UpstreamTimeoutError(
                        f"the engine's answer did not end within {self._read_timeout:g} s"
                    ) from None
            if conn.chunks:
                parts.append(conn.take())
            return b"".join(parts)
        finally:
            await self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None, "chunks after close"
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await self._next(conn)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn, self._origin)


class HttpUpstream:
    """Production: pooled keep-alive HTTP/1.1 connections with explicit timeouts."""

    def __init__(self, timeouts: Timeouts, *, max_connections: int = 1000) -> None:
        self._pool = H1Pool(
            max_connections=max_connections,
            connect_timeout=timeouts.connect,
            pool_timeout=timeouts.pool,
        )
        self._timeouts = timeouts
        self._targets: dict[tuple[str, str], _Target] = {}

    @property
    def pool(self) -> H1Pool:
        return self._pool

    async def send(
        self, url: str, headers: Headers, body: bytes, *, method: str = "POST"
    ) -> UpstreamResponse:
        target = self._targets.get((method, url))
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[(method, url)] = _target(url, method)
        lines = [target.head]
        if body or method == "POST":
            lines += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        for key, value in end_to_end(headers):
            if b"\n" in value or b"\r" in value or b"\n" in key or b"\r" in key:
                raise UpstreamError(f"refused to send header {key!r}: it holds a line break")
            lines += (key, b": ", value, b"\r\n")
        lines += (b"\r\n", body)
        request = b"".join(lines)
        for attempt in (0, 1):
            conn = await self._pool.acquire(target.origin)
            reused = conn.reused
            try:
                await self._exchange(conn, request)
            except UpstreamError as exc:
                # a kept-alive connection the engine had closed before reading it: once more
                stale = reused and conn.closed and conn.received == 0
                self._pool.release(conn, target.origin)
                if attempt == 0 and stale and not isinstance(exc, UpstreamTimeoutError):
                    continue
                raise
            except BaseException:
                self._pool.release(conn, target.origin)
                raise
            return _H1Response(self._pool, target.origin, conn, self._timeouts.read)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _exchange(self, conn: H1Connection, request: bytes) -> None:
        """Write the request and wait for the response head."""
        if conn.closed or conn.transport is None or conn.transport.is_closing():
            raise UpstreamError("engine closed the connection without answering")
        conn.transport.write(request)
        await conn.drain(self._timeouts.write)
        read = self._timeouts.read
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            try:
                await conn.wait(read)
            except TimeoutError:
                raise UpstreamTimeoutError(f"no answer from the engine within {read:g} s") from None

    async def aclose(self) -> None:
        await self._pool.aclose()


class _HttpxResponse:
    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code

    def header(self, name: bytes) -> bytes | None:
        value = self._resp.headers.get(name.decode())
        return None if value is None else value.encode()

    async def read(self) -> bytes:
        chunks = [c async for c in self.chunks()]
        await self.close()
        return b"".join(chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        stream = self._resp.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        try:
            async for chunk in stream:
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"timed out between chunks ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        await self._resp.aclose()


class HttpxUpstream:
    """Any httpx transport (tests use ``httpx.MockTransport``)."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def send(
        self, url: str, headers: Headers, body: bytes, *, method: str = "POST"
    ) -> UpstreamResponse:
        request = httpx.Request(method, url, headers=end_to_end(headers), content=body or None)
        try:
            resp = await self._transport.handle_async_request(request)
        except httpx.ConnectError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc}") from None
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"timed out ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._transport.aclose()

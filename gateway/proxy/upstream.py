"""The upstream HTTP client of the proxy path: one small interface, two implementations.

Production uses httpcore's connection pool directly (the transport under
httpx, without httpx's per-request model building, which costs more than half
the proxy's CPU time per request). Tests pass an ``httpx`` transport (e.g.
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

import httpcore
import httpx

from gateway.proxy.netbackend import AsyncioBackend

Headers = Sequence[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""

    reason = "transport"


class UpstreamConnectError(UpstreamError):
    reason = "connect"


class UpstreamTimeoutError(UpstreamError):
    reason = "timeout"


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
    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse: ...
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


def _lookup(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


class _CoreResponse:
    def __init__(self, resp: httpcore.Response) -> None:
        self._resp = resp
        self.status = resp.status

    def header(self, name: bytes) -> bytes | None:
        return _lookup(self._resp.headers, name)

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeoutError(f"timed out reading ({type(exc).__name__})") from None
        except httpcore.NetworkError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        except httpcore.ProtocolError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        finally:
            await self._resp.aclose()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_stream():
                yield chunk
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeoutError(f"timed out between chunks ({type(exc).__name__})") from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        await self._resp.aclose()


class HttpcoreUpstream:
    """Production: an httpcore connection pool with explicit timeouts."""

    def __init__(self, timeouts: Timeouts, *, max_connections: int = 1000) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
            network_backend=AsyncioBackend(),
        )
        self._extensions = {
            "timeout": {
                "connect": timeouts.connect,
                "read": timeouts.read,
                "write": timeouts.write,
                "pool": timeouts.pool,
            }
        }

    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        # httpcore adds no headers of its own: Host and Content-Length are ours to send.
        host = urlsplit(url).netloc.encode("ascii")
        request = httpcore.Request(
            b"POST",
            url,
            headers=[
                (b"host", host),
                (b"content-length", str(len(body)).encode()),
                *end_to_end(headers),
            ],
            content=body,
            extensions=self._extensions,
        )
        try:
            resp = await self._pool.handle_async_request(request)
        except httpcore.ConnectError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc or 'refused'}") from None
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeoutError(f"timed out ({type(exc).__name__})") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        return _CoreResponse(resp)

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

    async def send(self, url: str, headers: Headers, body: bytes) -> UpstreamResponse:
        request = httpx.Request("POST", url, headers=end_to_end(headers), content=body)
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

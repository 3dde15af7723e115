"""The production upstream client (HttpUpstream over gateway.proxy.netbackend) against
scripted HTTP/1.1 servers on 127.0.0.1: keep-alive reuse, framing, streaming, back-pressure,
timeouts, the connection cap and the errors the forwarder retries on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest

from gateway.proxy.netbackend import HIGH_WATER
from gateway.proxy.upstream import (
    HttpUpstream,
    Timeouts,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[object]]
JSON = [(b"content-type", b"application/json")]


class Server:
    """A scripted engine: counts connections, records requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(r, w)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                w.close()

        self._server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def read_request(self, r: asyncio.StreamReader) -> bytes:
        head = await r.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + await r.readexactly(length)
        self.requests.append(request)
        return request


def answer(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"content-type: application/json", *extra]
    head.append(b"content-length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def client(max_connections: int = 10, **timeouts: float) -> HttpUpstream:
    t = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0, **timeouts}
    return HttpUpstream(Timeouts(**t), max_connections=max_connections)


@pytest.fixture
async def up() -> AsyncIterator[HttpUpstream]:
    upstream = client()
    yield upstream
    await upstream.aclose()


async def test_keep_alive_connections_are_reused_and_requests_framed(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(r)
            w.write(answer(b'{"ok": 1}'))

    async with Server(handler) as srv:
        for i in range(3):
            resp = await up.send(srv.url + "/v1/completions", JSON, b'{"n": %d}' % i)
            assert resp.status == 200
            assert resp.header(b"content-type") == b"application/json"
            assert await resp.read() == b'{"ok": 1}'
        assert srv.connections == 1
        assert up.pool.idle == 1 and up.pool.active == 0
        first = srv.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nhost: 127.0.0.1:" in first and b"\r\ncontent-length: 8\r\n" in first
        assert first.endswith(b'\r\n\r\n{"n": 0}')


async def test_connection_close_answers_are_not_reused(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(answer(b"{}", b"connection: close"))
        await w.drain()

    async with Server(handler) as srv:
        for _ in range(2):
            assert await (await up.send(srv.url + "/x", JSON, b"{}")).read() == b"{}"
        assert srv.connections == 2
        assert up.pool.idle == 0


async def test_a_kept_alive_connection_the_engine_closed_is_replaced_once(
    up: HttpUpstream,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(answer(b'"first"'))  # keep-alive promised...
        await srv.read_request(r)  # ...but the next request on it is dropped unanswered

    async with Server(handler) as srv:
        assert await (await up.send(srv.url + "/x", JSON, b"{}")).read() == b'"first"'
        assert await (await up.send(srv.url + "/x", JSON, b"{}")).read() == b'"first"'
        assert srv.connections == 2 and len(srv.requests) == 3


async def test_a_fresh_connection_closed_unanswered_is_an_error(up: HttpUpstream) -> None:
    async with Server(lambda r, w: srv.read_request(r)) as srv:
        with pytest.raises(UpstreamError, match="without answering"):
            await up.send(srv.url + "/x", JSON, b"{}")
        assert srv.connections == 1  # not retried: only a reused connection can be stale


async def test_streamed_chunks_arrive_before_the_answer_is_complete(up: HttpUpstream) -> None:
    go_on = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        w.write(b"7\r\ndata: 1\r\n")
        await w.drain()
        await go_on.wait()
        w.write(b"7\r\ndata: 2\r\n0\r\n\r\n")

    async with Server(handler) as srv:
        resp = await up.send(srv.url + "/x", JSON, b"{}")
        chunks = resp.chunks()
        assert await asyncio.wait_for(chunks.__anext__(), 1) == b"data: 1"
        go_on.set()
        assert [c async for c in chunks] == [b"data: 2"]
        await resp.close()
        assert up.pool.idle == 1  # the stream ended cleanly: the connection is kept


async def test_an_abandoned_stream_closes_its_connection(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(5)

    async with Server(handler) as srv:
        resp = await up.send(srv.url + "/x", JSON, b"{}")
        assert await resp.chunks().__anext__() == b"abc"
        await resp.close()
        assert up.pool.idle == 0 and up.pool.active == 0


async def test_a_close_delimited_body_ends_with_the_connection(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart one, ")
        await w.drain()
        w.write(b"part two")

    async with Server(handler) as srv:
        assert await (await up.send(srv.url + "/x", JSON, b"{}")).read() == b"part one, part two"


async def test_a_truncated_body_is_an_error_not_a_short_answer(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")

    async with Server(handler) as srv:
        resp = await up.send(srv.url + "/x", JSON, b"{}")
        with pytest.raises(UpstreamError, match="mid-response"):
            await resp.read()
        assert up.pool.idle == 0 and up.pool.active == 0


async def test_garbage_from_the_engine_is_an_upstream_error(up: HttpUpstream) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"SPDY/9 what\r\n\r\n")
        await asyncio.sleep(1)

    async with Server(handler) as srv:
        with pytest.raises(UpstreamError, match="invalid HTTP"):
            await up.send(srv.url + "/x", JSON, b"{}")


async def test_a_silent_engine_times_out_after_the_read_timeout() -> None:
    up = client(read=0.3)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        await asyncio.sleep(5)

    async with Server(handler) as srv:
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeoutError):
            await up.send(srv.url + "/x", JSON, b"{}")
        assert 0.25 < time.monotonic() - t0 < 1.5
        assert srv.connections == 1  # a timeout is not retried on a fresh connection
    await up.aclose()


async def test_a_refused_connection_is_a_connect_error(up: HttpUpstream) -> None:
    async with Server(lambda r, w: asyncio.sleep(0)) as srv:
        url = srv.url
    with pytest.raises(UpstreamConnectError):
        await up.send(url + "/x", JSON, b"{}")
    assert up.pool.active == 0


async def test_the_connection_cap_queues_then_times_out_waiters() -> None:
    up = client(1, pool=0.3)
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(r)
            await release.wait()
            w.write(answer(b"{}"))

    async with Server(handler) as srv:
        first = asyncio.create_task(up.send(srv.url + "/x", JSON, b"{}"))
        await asyncio.sleep(0.05)
        with pytest.raises(UpstreamTimeoutError, match="no upstream connection free"):
            await up.send(srv.url + "/x", JSON, b"{}")
        second = asyncio.create_task(up.send(srv.url + "/x", JSON, b"{}"))
        await asyncio.sleep(0.05)
        release.set()
        assert await (await first).read() == b"{}"
        assert await (await asyncio.wait_for(second, 1)).read() == b"{}"  # handed the slot
        assert srv.connections == 1 and up.pool.active == 0
    await up.aclose()


async def test_a_slow_reader_stops_the_socket_instead_of_buffering(up: HttpUpstream) -> None:
    size = 8 * HIGH_WATER

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        w.write(b"x" * size)
        await w.drain()

    async with Server(handler) as srv:
        resp = await up.send(srv.url + "/x", JSON, b"{}")
        await asyncio.sleep(0.3)  # the server writes as fast as the socket takes it
        conn = cast(Any, resp)._conn
        assert conn is not None
        assert conn.buffered <= HIGH_WATER + 256 * 1024, conn.buffered  # one read beyond
        total = 0
        async for chunk in resp.chunks():
            total += len(chunk)
        assert total == size


async def test_header_values_with_line_breaks_are_never_sent(up: HttpUpstream) -> None:
    async with Server(lambda r, w: srv.read_request(r)) as srv:
        with pytest.raises(UpstreamError, match="line break"):
            await up.send(srv.url + "/x", [(b"x-session-id", b"a\r\nx-evil: 1")], b"{}")
        assert srv.requests == []

"""Headers: hop-by-hop ones are not forwarded either way; request heads are bounded in size,
count and time (gateway/cli/http_limits.py, uvicorn in process)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fake_engines import FakeEngine
from inproc_gateway import A, gateway

from gateway.cli.http_limits import limited_protocol, server_options
from gateway.proxy.upstream import end_to_end

HOP = {
    "connection": "keep-alive, x-session-id, x-vllm-priority",
    "keep-alive": "timeout=999",
    "te": "trailers",
    "trailer": "x-checksum",
    "upgrade": "websocket",
    "proxy-authorization": "Basic cHJveHk6c2VjcmV0",
    "proxy-connection": "keep-alive",
}


async def test_hop_by_hop_and_client_headers_are_not_forwarded_upstream() -> None:
    a = FakeEngine(A)
    async with gateway(a) as gw:
        r = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={
                **HOP,
                "x-session-id": "named-in-connection",
                "x-vllm-priority": "5",
                "host": "evil.example",
                "x-forwarded-host": "evil.example",
                "cookie": "a=b",
                "authorization": "Bearer client",
            },
        )
        plain = await gw.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"x-session-id": "s-1", "x-vllm-priority": "3"},
        )
    assert r.status_code == 200 and plain.status_code == 200
    sent = a.headers[0]
    for name in [*HOP, "x-session-id", "x-vllm-priority", "x-forwarded-host", "cookie"]:
        assert name not in sent, name
    assert sent["host"] == "a:1" and "authorization" not in sent
    assert a.headers[1]["x-session-id"] == "s-1" and a.headers[1]["x-vllm-priority"] == "3"


class NoisyEngine(FakeEngine):
    """Answers with hop-by-hop and private headers of its own."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        resp = await super().handle(request)
        if request.url.path.startswith("/v1/"):
            resp.headers.update(
                {
                    "connection": "keep-alive, x-engine-internal",
                    "keep-alive": "timeout=999",
                    "x-engine-internal": "secret-topology",
                    "proxy-authenticate": "Basic",
                    "upgrade": "h2c",
                    "trailer": "x-checksum",
                    "set-cookie": "engine=1",
                    "server": "vllm-internal",
                }
            )
        return resp


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_headers_do_not_reach_the_client(stream: bool) -> None:
    async with gateway(NoisyEngine(A)) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
    assert r.status_code == 200
    got = {k.lower() for k in r.headers}
    leaked = got & {
        "connection",
        "keep-alive",
        "x-engine-internal",
        "proxy-authenticate",
        "upgrade",
        "trailer",
        "set-cookie",
        "server",
    }
    assert not leaked
    assert "x-request-id" in got


def test_end_to_end_filter() -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"Connection", b"close, X-Named"),
        (b"x-named", b"1"),
        (b"TE", b"trailers"),
        (b"transfer-encoding", b"chunked"),
        (b"host", b"evil"),
        (b"content-length", b"5"),
        (b"x-request-id", b"r"),
    ]
    assert end_to_end(headers) == [(b"content-type", b"application/json"), (b"x-request-id", b"r")]


def test_server_options() -> None:
    options = server_options(65536)
    assert options["ws"] == "none"
    assert options["h11_max_incomplete_event_size"] == 65536
    assert isinstance(options["http"], type)


# -- request heads, on a real socket ----------------------------------------------------
async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = str(len(scope["headers"])).encode()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def server(http: Any, **options: Any) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        _echo, http=http, lifespan="off", log_level="error", ws="none", **options
    )
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    while not srv.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        await task


async def exchange(
    port: int, *parts: bytes, pause: float = 0.0, timeout: float = 5.0
) -> tuple[bytes, float]:
    """Send ``parts`` with ``pause`` between them; (all the answer, seconds to the close)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i and pause:
                await asyncio.sleep(pause)
            with contextlib.suppress(ConnectionError):
                writer.write(part)
                await writer.drain()
        out = b""
        with contextlib.suppress(ConnectionError, TimeoutError):
            while chunk := await asyncio.wait_for(reader.read(65536), timeout):
                out += chunk
        return out, loop.time() - t0
    finally:
        writer.close()


PROTO = limited_protocol(4096, max_headers=20, header_timeout_s=0.5)
GET = b"GET / HTTP/1.1\r\nhost: x\r\n"


async def test_head_size_count_and_target_limits() -> None:
    async with server(PROTO) as port:
        one_read, _ = await exchange(port, GET + b"x-a: " + b"a" * 5000 + b"\r\n\r\n")
        dripped, seconds = await exchange(
            port, GET, *[b"x-a: " + b"a" * 1000 + b"\r\n"] * 10, pause=0.01
        )
        many, _ = await exchange(
            port, GET + b"".join(b"x-%d: v\r\n" % i for i in range(25)) + b"\r\n"
        )
        target, _ = await exchange(port, b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n")
        fine, _ = await exchange(
            port,
            GET + b"".join(b"x-%d: v\r\n" % i for i in range(10)) + b"connection: close\r\n\r\n",
        )
    assert one_read.startswith(b"HTTP/1.1 431 ")
    assert dripped.startswith(b"HTTP/1.1 431 ") and seconds < 0.5  # before the head is complete
    assert many.startswith(b"HTTP/1.1 431 ") and b"more than 20 header fields" in many
    assert target.startswith(b"HTTP/1.1 414 ")
    assert fine.startswith(b"HTTP/1.1 200 ") and b"\r\n12\r\n" in fine  # 12 headers seen


async def test_slow_heads_time_out_but_slow_bodies_and_idle_keepalive_do_not() -> None:
    async with server(PROTO) as port:
        slow, seconds = await exchange(port, GET, timeout=3.0)
        body_later, _ = await exchange(
            port,
            b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\n",
            b"abc",
            pause=1.0,
        )
        keepalive, _ = await exchange(
            port,
            GET + b"\r\n",
            GET + b"connection: close\r\n\r\n",
            pause=1.0,  # idle between requests longer than the head timeout
        )
    assert slow.startswith(b"HTTP/1.1 408 ") and 0.4 < seconds < 0.5 + 1.5  # + the linger
    assert body_later.startswith(b"HTTP/1.1 200 ")
    assert keepalive.count(b"HTTP/1.1 200 ") == 2


async def test_h11_fallback_is_bounded_too() -> None:
    """h11 bounds what it buffers of an incomplete head (a head that arrives whole in one
    read passes): it refuses and closes (uvicorn answers 400, and without a linger the
    client may only see the reset); kvgate serve uses it only where httptools is missing."""
    async with server("h11", h11_max_incomplete_event_size=4096) as port:
        big, seconds = await exchange(
            port, GET, *[b"x-a: " + b"a" * 1000 + b"\r\n"] * 10, pause=0.01
        )
        after, _ = await exchange(port, GET + b"connection: close\r\n\r\n")
    assert not big.startswith(b"HTTP/1.1 200 ") and seconds < 2
    assert after.startswith(b"HTTP/1.1 200 ")


async def test_engine_header_can_be_hidden() -> None:
    async with gateway(FakeEngine(A), expose_engine_header=False) as gw:
        r = await gw.post("/v1/completions", json={"model": "m", "prompt": "x"})
        s = await gw.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    assert r.status_code == 200 and s.status_code == 200
    assert "x-kvgate-engine" not in r.headers and "x-kvgate-engine" not in s.headers

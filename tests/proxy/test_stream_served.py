"""A stream whose last event reached the client counts as served, wherever the client leaves.

The ``openai`` SDK closes its connection on ``data: [DONE]`` without reading the body to
its end; an engine may end its body a moment later. The gateway (uvicorn in process, the
real upstream client) sees the client leave mid-body: the request is still ``ok`` in
``kvgate_requests_total`` (and so in recordings and the policies' completion hooks), while
a client that leaves before the last event is counted ``cancelled``.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn
from hostile_engine import MODEL, HostileEngine
from openai import AsyncOpenAI

from gateway.config import load_settings
from gateway.proxy.app import create_app
from gateway.proxy.relay import stream_ended

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}


@asynccontextmanager
async def served_gateway(engine: HostileEngine) -> AsyncIterator[str]:
    cfg = load_settings(
        engines=[{"url": engine.url, "model": MODEL}],
        policy={"name": "round_robin"},
        timeouts={"read_s": 60.0, "connect_s": 2.0},
        log_requests=False,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(cfg), log_level="error", ws="none")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True
        await task


async def outcomes(url: str) -> dict[str, float]:
    """The completions route's ``kvgate_requests_total`` by outcome, as the gateway exports."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(url + "/metrics")).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"kvgate_requests_total\{([^}]*)\} (\S+)", line)
        if m and 'route="completions"' in m[1]:
            outcome = re.search(r'outcome="([^"]*)"', m[1])
            assert outcome is not None
            found[outcome[1]] = float(m[2])
    return found


async def settled(url: str) -> dict[str, float]:
    """Once the gateway has settled the one request (its client has gone)."""
    async with asyncio.timeout(10):
        while not (found := await outcomes(url)):
            await asyncio.sleep(0.05)
    return found


async def test_a_client_that_leaves_on_done_was_served() -> None:
    async with (
        HostileEngine(completions="linger_after_done") as engine,
        served_gateway(engine) as url,
    ):
        oa = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = await oa.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
        text = "".join([c.choices[0].text async for c in stream])
        assert text == "ab"  # every event, and the SDK left on [DONE]
        assert await settled(url) == {"ok": 1.0}
        assert "linger_after_done" not in engine.finished  # the engine's body had not ended


async def test_a_client_that_leaves_before_the_last_event_cancelled() -> None:
    async with (
        HostileEngine(completions="stall_mid_stream") as engine,  # one event, then nothing
        served_gateway(engine) as url,
    ):
        async with (
            httpx.AsyncClient() as c,
            c.stream("POST", url + "/v1/completions", json=BODY) as r,
        ):
            async for line in r.aiter_lines():  # leave after the first event
                if line.startswith("data: "):
                    break
        found = await settled(url)
        assert found == {"cancelled": 1.0}, found


@pytest.mark.parametrize(
    "tail",
    [
        b"data: [DONE]\n\n",
        b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
        b'data: {"type":"message_stop"}\n\n',
        b"event: response.completed\ndata: {}\n\n",
        b"event: response.incomplete\r\ndata: {}\r\n\r\n",
    ],
)
def test_each_apis_last_event_is_known(tail: bytes) -> None:
    assert stream_ended(b'data: {"x": 1}\n\n' + tail)
    assert not stream_ended(b'data: {"text": "data: [DONE] event: message_stop"}\n\n')

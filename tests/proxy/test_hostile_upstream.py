"""kvgate's own HTTP/1.1 upstream client against an engine that breaks HTTP at the byte level.

Each case of ``hostile_engine.CASES`` is sent to :class:`HttpUpstream` directly and through
the gateway (``create_app`` without a transport: the real client). Every case ends in the
right answer or a clear :class:`UpstreamError`, within the read timeout (never the drip's
length), and the pool is sound afterwards: the next request to the same engine succeeds and
no idle connection is broken. The gateway retries on another engine when nothing reached the
client yet, answers an OpenAI-shaped 503 when no engine could, and ends a stream that broke
mid-way with an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from hostile_engine import EVENTS, GOOD_JSON, MODEL, HostileEngine

from gateway.config import load_settings
from gateway.proxy.app import create_app
from gateway.proxy.netbackend import H1Pool
from gateway.proxy.upstream import HttpUpstream, Timeouts, UpstreamError, UpstreamTimeoutError

READ_S = 1.5
"""The read timeout of every case; drips last over 100 s, so a bound near it is the client's."""
BOUND_S = READ_S + 1.5
"""What a case may take at most (the read timeout plus scheduling slack on a busy machine)."""
JSON = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class Case:
    name: str
    expect: bytes | tuple[type[UpstreamError], str]
    """The body the client must return, or the error class and a pattern of its message."""
    kept: bool = False
    """The connection may carry the next request (a well-framed keep-alive answer)."""
    stream: bool = False
    """Read with ``chunks()``: the first event arrives before the error."""


BIG = b'"' + b"x" * (1 << 20) + b'"'
CASES = [
    Case("chunk_bad_size", (UpstreamError, "invalid HTTP: Invalid character in chunk size")),
    Case("chunk_missing_crlf", (UpstreamError, "invalid HTTP")),
    Case("chunk_longer", (UpstreamError, "invalid HTTP: Expected LF after chunk data")),
    Case("cl_longer_then_close", (UpstreamError, "closed the connection mid-response")),
    Case("cl_shorter", GOOD_JSON[:10]),
    Case("cl_shorter_second_answer", b"ok"),
    Case("second_answer_later", GOOD_JSON),
    Case("te_not_chunked", (UpstreamError, "transfer-encoding b'gzip', not chunked")),
    Case("cl_and_chunked", (UpstreamError, "invalid HTTP: Transfer-Encoding can't be present")),
    Case("huge_header", (UpstreamError, "response head over 65536 bytes")),
    Case("endless_head", (UpstreamError, "response head over 65536 bytes")),
    Case("many_headers", (UpstreamError, "over 100 header lines")),
    Case("continue_100", GOOD_JSON, kept=True),
    Case("early_hints_103", GOOD_JSON, kept=True),
    Case("switching_101", (UpstreamError, "switched protocols")),
    Case("close_without_answer", (UpstreamError, "closed the connection without answering")),
    Case("close_mid_body", (UpstreamError, "closed the connection mid-response")),
    Case("close_mid_stream", (UpstreamError, "mid-response"), stream=True),
    Case("reset_mid_stream", (UpstreamError, "mid-response"), stream=True),
    Case("stall_mid_stream", (UpstreamTimeoutError, "no data from the engine for"), stream=True),
    Case("drip_head", (UpstreamTimeoutError, "no answer from the engine within")),
    Case("drip_body", (UpstreamTimeoutError, "answer did not end within")),
    Case("connection_close", GOOD_JSON),
    Case("close_delimited", GOOD_JSON),
    Case("http10", GOOD_JSON),
    Case("http10_close_delimited", GOOD_JSON),
    Case("big_body", BIG, kept=True),
    Case("garbage", (UpstreamError, "invalid HTTP")),
]
BY_NAME = {c.name: c for c in CASES}


def client() -> HttpUpstream:
    return HttpUpstream(Timeouts(connect=2.0, read=READ_S, write=2.0, pool=2.0))


@pytest.fixture
async def engine() -> AsyncIterator[HostileEngine]:
    async with HostileEngine() as e:
        yield e


async def wait_until(what: str, predicate: object, timeout: float = 5.0) -> None:
    """Until ``predicate()`` holds (a condition, polled), else fail naming ``what``."""
    assert callable(predicate)
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


def assert_sound(pool: H1Pool) -> None:
    """Nothing reserved, and every idle connection able to carry an exchange."""
    assert pool.active == 0
    for conn in pool.idle_connections():
        assert not conn.closed and conn.error is None and conn.reusable, vars(conn)


async def exchange(up: HttpUpstream, url: str, case: Case) -> tuple[bytes, list[bytes]]:
    """Send one request; the body (``read``) or the chunks seen (``chunks``) before the end."""
    resp = await up.send(url, JSON, b"{}")
    if not case.stream:
        return await resp.read(), []
    seen: list[bytes] = []
    try:
        async for piece in resp.chunks():
            seen.append(piece)
    finally:
        await resp.close()
    return b"".join(seen), seen


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_the_client_survives_a_hostile_engine(engine: HostileEngine, case: Case) -> None:
    up = client()
    try:
        # a kept-alive connection first, so that a poisoned one would be reused next
        assert await (await up.send(engine.url + "/ok", JSON, b"{}")).read() == GOOD_JSON
        t0 = time.monotonic()
        async with asyncio.timeout(BOUND_S + 5):  # a hang fails here, not at the suite's limit
            if isinstance(case.expect, bytes):
                body, _ = await exchange(up, engine.url + "/case/" + case.name, case)
                assert body == case.expect
            else:
                error, pattern = case.expect
                with pytest.raises(error, match=pattern) as info:
                    await exchange(up, engine.url + "/case/" + case.name, case)
                assert str(info.value)
        elapsed = time.monotonic() - t0
        assert elapsed < BOUND_S, f"{case.name} took {elapsed:.2f} s (read timeout {READ_S} s)"
        assert_sound(up.pool)
        if case.name == "second_answer_later":  # the unasked answer arrives while pooled
            await engine.wait_finished(case.name)
            await wait_until(
                "the connection holding an unasked answer is closed",
                lambda: all(c.closed for c in up.pool.idle_connections()),
            )
        before = engine.connections
        resp = await up.send(engine.url + "/ok", JSON, b"{}")
        assert resp.status == 200 and await resp.read() == GOOD_JSON
        assert_sound(up.pool)
        assert up.pool.idle == 1
        if not case.kept:  # the hostile answer's connection was not reused
            assert engine.connections == before + 1
        else:  # it was, and carried the next exchange cleanly
            assert engine.connections == before
    finally:
        await up.aclose()


@pytest.mark.parametrize("name", ["close_mid_stream", "reset_mid_stream", "stall_mid_stream"])
async def test_a_stream_broken_mid_way_delivers_what_came_first(
    engine: HostileEngine, name: str
) -> None:
    up = client()
    try:
        resp = await up.send(engine.url + "/case/" + name, JSON, b"{}")
        chunks = resp.chunks()
        assert await chunks.__anext__() == EVENTS[0]
        expect = BY_NAME[name].expect
        assert isinstance(expect, tuple)
        with pytest.raises(expect[0], match=expect[1]):
            async with asyncio.timeout(BOUND_S):
                async for _ in chunks:
                    pass
        await resp.close()
        assert_sound(up.pool)
    finally:
        await up.aclose()


async def test_interim_answers_leave_no_header_behind(engine: HostileEngine) -> None:
    up = client()
    try:
        resp = await up.send(engine.url + "/case/early_hints_103", JSON, b"{}")
        assert resp.status == 200
        assert resp.header(b"link") is None  # the 103's header, not the answer's
        assert resp.header(b"content-length") == b"%d" % len(GOOD_JSON)
        assert await resp.read() == GOOD_JSON
    finally:
        await up.aclose()


# -- through the gateway ---------------------------------------------------------------
@asynccontextmanager
async def gateway(*engines: HostileEngine) -> AsyncIterator[httpx.AsyncClient]:
    cfg = load_settings(
        engines=[{"url": e.url, "model": MODEL} for e in engines],
        policy={"name": "round_robin"},
        timeouts={"read_s": READ_S, "connect_s": 2.0, "pool_s": 2.0},
        retries={"max_attempts": 3, "backoff_s": 0.0},
        log_requests=False,
    )
    app = create_app(cfg)  # no transport: the real HttpUpstream
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as gw:
            yield gw


def completion(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": stream}


BEFORE_FIRST_BYTE = [c.name for c in CASES if not isinstance(c.expect, bytes) and not c.stream]
MID_STREAM = [c.name for c in CASES if c.stream]


@pytest.mark.parametrize("name", BEFORE_FIRST_BYTE)
async def test_the_gateway_retries_a_broken_answer_on_another_engine(name: str) -> None:
    async with (
        HostileEngine(completions=name) as bad,
        HostileEngine() as good,
        gateway(bad, good) as gw,
    ):
        t0 = time.monotonic()
        for _ in range(4):  # round robin: the hostile engine is tried at least once
            r = await gw.post("/v1/completions", json=completion(False))
            assert r.status_code == 200, r.text
            assert r.content == GOOD_JSON
            assert r.headers["x-kvgate-engine"] == good.url
        assert time.monotonic() - t0 < 4 * BOUND_S
        assert "/v1/completions" in bad.paths


@pytest.mark.parametrize("name", BEFORE_FIRST_BYTE)
async def test_the_gateway_answers_an_openai_error_when_no_engine_can(name: str) -> None:
    async with HostileEngine(completions=name) as bad, gateway(bad) as gw:
        t0 = time.monotonic()
        r = await gw.post("/v1/completions", json=completion(False))
        assert time.monotonic() - t0 < 3 * BOUND_S  # three attempts, each bounded
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["message"] and error["type"] and "code" in error


@pytest.mark.parametrize("name", MID_STREAM)
async def test_the_gateway_ends_a_broken_stream_with_an_error_event(name: str) -> None:
    async with HostileEngine(completions=name) as bad, gateway(bad) as gw:
        t0 = time.monotonic()
        r = await gw.post("/v1/completions", json=completion(True))
        assert time.monotonic() - t0 < BOUND_S
        assert r.status_code == 200
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[0] + b"\n\n" == EVENTS[0]
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert "failed mid-stream" in error["message"]
        assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("name", ["continue_100", "early_hints_103", "close_delimited", "http10"])
async def test_the_gateway_passes_legal_but_unusual_answers(name: str) -> None:
    async with HostileEngine(completions=name) as engine, gateway(engine) as gw:
        for _ in range(2):
            r = await gw.post("/v1/completions", json=completion(False))
            assert r.status_code == 200 and r.content == GOOD_JSON

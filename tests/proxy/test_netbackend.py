"""H1Connection's parsing is independent of how the bytes are split: any valid HTTP/1.1
answer fed in pieces (``data_received`` at any split points) gives the same status, headers
and body as fed whole, and the same as what was sent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.netbackend import H1Connection

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
VALUE = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E) | st.just(" "),
    min_size=0,
    max_size=40,
).map(str.strip)
FRAMING = {"content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"}


@dataclass(frozen=True)
class Answer:
    wire: bytes
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    status = draw(st.integers(200, 599))
    no_body = status in (204, 304)
    body = b"" if no_body else draw(st.binary(max_size=3000))
    names = draw(st.lists(TOKEN.filter(lambda n: n not in FRAMING), max_size=10))
    headers = [(n.encode(), draw(VALUE).encode()) for n in names]
    interim = [b"100 Continue", b"103 Early Hints\r\nlink: </hints.css>; rel=preload"]
    wire = b"".join(
        b"HTTP/1.1 " + i + b"\r\n\r\n" for i in draw(st.lists(st.sampled_from(interim), max_size=2))
    )
    wire += b"HTTP/1.1 %d Whatever\r\n" % status
    wire += b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    chunked = not no_body and draw(st.booleans())
    if no_body:
        wire += b"\r\n"
    elif chunked:
        framing = (b"transfer-encoding", b"chunked")
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=8)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        hexes = draw(st.sampled_from([b"%x", b"%X"]))
        wire += b"transfer-encoding: chunked\r\n\r\n"
        wire += b"".join((hexes % len(p)) + b"\r\n" + p + b"\r\n" for p in pieces if p)
        wire += b"0\r\n\r\n"
        headers.append(framing)
    else:
        framing = (b"content-length", b"%d" % len(body))
        wire += b"content-length: %d\r\n\r\n" % len(body) + body
        headers.append(framing)
    return Answer(wire, status, headers, body)


def feed(conn: H1Connection, wire: bytes, cuts: list[int]) -> tuple[object, ...]:
    conn.begin()
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        if b > a:
            conn.data_received(wire[a:b])
    body = b"".join(conn.chunks)
    conn.chunks.clear()
    return conn.status, conn.headers, body, conn.complete, conn.error, conn.keep_alive


@settings(max_examples=300, deadline=None)
@given(st.lists(answers(), min_size=1, max_size=3), st.data())
def test_any_split_parses_like_the_whole(responses: list[Answer], data: st.DataObject) -> None:
    loop = asyncio.new_event_loop()
    try:
        whole, pieces = H1Connection(loop), H1Connection(loop)  # keep-alive: answers in turn
        for answer in responses:
            n = len(answer.wire)
            cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=min(n - 1, 40))))
            expected = feed(whole, answer.wire, [])
            assert expected == (answer.status, answer.headers, answer.body, True, None, True)
            assert feed(pieces, answer.wire, cuts) == expected
            assert pieces.reusable
    finally:
        loop.close()


def test_one_byte_at_a_time_parses_like_the_whole() -> None:
    loop = asyncio.new_event_loop()
    try:
        wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-a: 1\r\n"
        wire += b"transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        got = feed(H1Connection(loop), wire, list(range(1, len(wire))))
        headers = [(b"x-a", b"1"), (b"transfer-encoding", b"chunked")]
        assert got == (200, headers, b"abcde", True, None, True)
    finally:
        loop.close()

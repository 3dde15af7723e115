"""A hostile engine: a raw asyncio TCP server that answers with scripted bytes.

The upstream client's tests (``test_hostile_upstream.py``) point kvgate's own HTTP/1.1
client at it. Every request is read whole (head, then ``Content-Length`` bytes), then
answered by a *script*: raw bytes, pauses, a byte-by-byte drip, a close or a reset.
``POST /case/<name>`` answers with ``CASES[name]``; the completions routes answer with
:attr:`HostileEngine.completions` (a case name, or ``None`` for a well-behaved answer);
``/health``, ``/v1/models`` and ``/metrics`` are always well-behaved, so a gateway's
monitor keeps the engine in routing. ``/ok`` is a well-behaved JSON answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, cast

MODEL = "hostile-model"

GOOD_JSON = json.dumps(
    {
        "id": "cmpl-ok",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
).encode()


def sse(text: str) -> bytes:
    chunk = {"id": "cmpl-s", "object": "text_completion", "model": MODEL}
    chunk["choices"] = [{"index": 0, "text": text, "finish_reason": None}]  # type: ignore[assignment]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


EVENTS = (sse("a"), sse("b"))
DONE = b"data: [DONE]\n\n"


def head(*headers: bytes, status: bytes = b"200 OK", version: bytes = b"HTTP/1.1") -> bytes:
    return b"\r\n".join([version + b" " + status, *headers]) + b"\r\n\r\n"


def unary(body: bytes = GOOD_JSON, *headers: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    length = b"content-length: %d" % len(body)
    return head(b"content-type: application/json", *headers, length, version=version) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


CHUNKED_JSON = head(b"content-type: application/json", b"transfer-encoding: chunked")
SSE_HEAD = head(b"content-type: text/event-stream", b"transfer-encoding: chunked")
GOOD_STREAM = SSE_HEAD + b"".join(chunk(e) for e in (*EVENTS, DONE)) + b"0\r\n\r\n"


@dataclass(frozen=True)
class Pause:
    """Wait before the next step (the engine's timing, part of what it does wrong)."""

    seconds: float


@dataclass(frozen=True)
class Drip:
    """Send ``data`` one byte at a time, ``every_s`` apart, until the client leaves."""

    data: bytes
    every_s: float = 1.0


CLOSE: Final = "close"
RESET: Final = "reset"
Step = bytes | Pause | Drip | Literal["close", "reset"]
Script = Sequence[Step]

CASES: dict[str, Script] = {
    # chunked encoding broken three ways
    "chunk_bad_size": [CHUNKED_JSON, b"zz\r\n", GOOD_JSON, b"\r\n0\r\n\r\n"],
    "chunk_missing_crlf": [CHUNKED_JSON, b"%x\r\n" % len(GOOD_JSON), GOOD_JSON, b"0\r\n\r\n"],
    "chunk_longer": [CHUNKED_JSON, b"2\r\n", GOOD_JSON, b"\r\n0\r\n\r\n"],
    # Content-Length against the body
    "cl_longer_then_close": [head(b"content-length: %d" % (len(GOOD_JSON) + 50)), GOOD_JSON, CLOSE],
    "cl_shorter": [head(b"content-length: 10"), GOOD_JSON],
    "cl_shorter_second_answer": [head(b"content-length: 2"), b"ok", unary(b'"smuggled"')],
    "second_answer_later": [unary(), Pause(0.05), unary(b'"unasked"')],
    "te_not_chunked": [head(b"transfer-encoding: gzip"), b"\x1f\x8b\x08", CLOSE],
    "cl_and_chunked": [head(b"content-length: 2", b"transfer-encoding: chunked"), b"2\r\nok\r\n"],
    # heads over the client's limits
    "huge_header": [head(b"x-big: " + b"a" * (80 * 1024), b"content-length: 2"), b"ok"],
    "endless_head": [b"HTTP/1.1 200 OK\r\nx-big: ", b"a" * (1 << 20)],
    "many_headers": [head(*[b"x-h%d: 1" % i for i in range(150)], b"content-length: 2"), b"ok"],
    # interim answers before the real one, each in a segment of its own
    "continue_100": [head(status=b"100 Continue"), Pause(0.05), unary()],
    "early_hints_103": [
        head(b"link: </hints.css>; rel=preload", status=b"103 Early Hints"),
        Pause(0.05),
        unary(),
    ],
    "switching_101": [head(b"upgrade: h2c", b"connection: upgrade", status=b"101 Switching")],
    # the connection lost mid-way
    "close_without_answer": [CLOSE],
    "close_mid_body": [CHUNKED_JSON, chunk(GOOD_JSON[:20]), CLOSE],
    "close_mid_stream": [SSE_HEAD, chunk(EVENTS[0]), Pause(0.05), b"40\r\ndata: {", CLOSE],
    "reset_mid_stream": [SSE_HEAD, chunk(EVENTS[0]), Pause(0.05), RESET],
    "stall_mid_stream": [SSE_HEAD, chunk(EVENTS[0]), Pause(120)],
    # every event sent, [DONE] last, and the body ended only later
    "linger_after_done": [SSE_HEAD, *(chunk(e) for e in (*EVENTS, DONE)), Pause(30), b"0\r\n\r\n"],
    # one byte a second, for longer than any read timeout in the tests
    "drip_head": [Drip(unary())],
    "drip_body": [head(b"content-length: %d" % len(GOOD_JSON)), Drip(GOOD_JSON)],
    # framing that is legal but not the common case
    "connection_close": [unary(GOOD_JSON, b"connection: close")],  # and the socket left open
    "close_delimited": [head(b"content-type: application/json"), GOOD_JSON, CLOSE],
    "http10": [unary(version=b"HTTP/1.0")],  # no keep-alive in HTTP/1.0, the socket left open
    "http10_close_delimited": [head(version=b"HTTP/1.0"), GOOD_JSON, CLOSE],
    "big_body": [unary(b'"' + b"x" * (1 << 20) + b'"')],
    "garbage": [b"HELLO engine\r\n\r\n"],
}

MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}
).encode()


class HostileEngine:
    """The server; counts connections and records request paths (bounded by the test)."""

    def __init__(self, completions: str | None = None) -> None:
        self.completions = completions
        self.connections = 0
        self.paths: list[str] = []
        self.heads: list[bytes] = []
        """Each request's head (request line and headers), in arrival order."""
        self.finished: list[str] = []
        self.url = ""
        self._progress = asyncio.Event()
        self._closing = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> HostileEngine:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._closing.set()  # pauses and drips end
        for w in self._writers:
            w.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_finished(self, case: str, timeout: float = 5.0) -> None:
        """Until the engine has played ``case``'s script to its end."""
        async with asyncio.timeout(timeout):
            while case not in self.finished:
                self._progress.clear()
                await self._progress.wait()

    # -- serving -------------------------------------------------------------------
    async def _on_connect(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = cast("asyncio.Task[None] | None", asyncio.current_task())
        assert task is not None
        self._tasks.add(task)
        self._writers.add(w)
        self.connections += 1
        try:
            while await self._serve_one(r, w):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(w)
            w.close()

    async def _serve_one(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is done."""
        request = await r.readuntil(b"\r\n\r\n")
        line, *headers = request.split(b"\r\n")
        length = 0
        for header in headers:
            key, _, value = header.partition(b":")
            if key.strip().lower() == b"content-length":
                length = int(value)
        await r.readexactly(length)
        path = line.split(b" ")[1].decode()
        self.paths.append(path)
        self.heads.append(request)
        name, script = self._script(path)
        keep_open = await self._play(script, r, w)
        self.finished.append(name)
        self._progress.set()
        return keep_open

    def _script(self, path: str) -> tuple[str, Script]:
        if path.startswith("/case/"):
            name = path.removeprefix("/case/")
            return name, CASES[name]
        if path in ("/v1/completions", "/v1/chat/completions") and self.completions:
            return self.completions, CASES[self.completions]
        if path == "/v1/models":
            return path, [unary(MODELS)]
        if path == "/metrics":
            return path, [head(b"content-type: text/plain", b"content-length: 0")]
        if path == "/stream":
            return path, [GOOD_STREAM]
        return path, [unary()]

    async def _stopped_within(self, seconds: float) -> bool:
        """Wait ``seconds`` (the script's timing); True when the engine is shutting down."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)
        return self._closing.is_set()

    async def _play(self, script: Script, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        for step in script:
            if isinstance(step, bytes):
                w.write(step)
                await w.drain()
            elif isinstance(step, Pause):
                if await self._stopped_within(step.seconds):
                    return False
            elif isinstance(step, Drip):
                for i in range(len(step.data)):
                    if r.at_eof() or w.is_closing():
                        return False
                    w.write(step.data[i : i + 1])
                    await w.drain()
                    if await self._stopped_within(step.every_s):
                        return False
            elif step == RESET:
                sock = w.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
                return False
            else:
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()
                return False
        return True

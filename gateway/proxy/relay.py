"""Relaying an engine's SSE stream to the client, chunk by chunk, with one clean-up.

Streams pass through unchanged, whatever the API (chat and completions chunks,
Responses events, Anthropic Messages events). The output length for the policies'
completion hooks comes from the last usage in the stream's tail (``completion_tokens``
or, for Responses and Messages, ``output_tokens``). A stored response's id is read from
the stream's first event. An upstream failure mid-stream ends the stream with an error
in the API's own framing: ``data: {"error": ...}`` then ``data: [DONE]`` (OpenAI chat
and completions), an ``event: error`` (Responses; Anthropic's error shape on Messages).

A client that leaves once the stream's last event has reached it (``[DONE]``,
``message_stop``, ``response.completed`` or ``response.incomplete``; the ``openai`` SDK
closes its connection on ``[DONE]``, before the engine's body has ended) got the whole
answer: the request counts as served, not cancelled.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio

from gateway.cluster.registry import EngineState
from gateway.proxy.errors import error_body
from gateway.proxy.upstream import UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from gateway.proxy.exchange import Exchange
    from gateway.proxy.forwarder import Forwarder

log = logging.getLogger("kvgate.proxy")

_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096
_HEAD_BYTES = 8192
LAST_EVENT = re.compile(
    rb"^(?:data: ?\[DONE\]|event: ?(?:message_stop|response\.completed|response\.incomplete)"
    rb'|data: ?\{"type": ?"message_stop"\})\r?$',
    re.MULTILINE,
)
"""A stream's last event, by API: chat and completions, Messages, Responses (an SSE line)."""


class Relay:
    """Passes an upstream SSE stream through chunk by chunk, and cleans up once."""

    def __init__(
        self,
        fwd: Forwarder,
        ex: Exchange,
        engine: EngineState,
        *,
        resp: UpstreamResponse,
        first: bytes,
        chunks: AsyncIterator[bytes],
    ) -> None:
        self.fwd = fwd
        self.ex = ex
        self.engine = engine
        self.resp = resp
        self.first = first
        self.chunks = chunks
        self.tail = b""
        self.head = b""
        self.seen = 0
        self.events = 0
        self.outcome = "cancelled"
        self.last = False  # the stream's last event is in what was passed on
        self.delivered = False
        """The stream's last event has been sent: a client leaving now was served."""
        self.done = False

    async def run(self) -> AsyncIterator[bytes]:
        try:
            yield self._seen(self.first)
            self.delivered = self.last  # the consumer asks for more once a chunk is sent
            async for chunk in self.chunks:
                yield self._seen(chunk)
                self.delivered = self.last
            self.outcome = "ok"
        except UpstreamError as exc:
            self.outcome = "engine_error_mid_stream"
            detail = f"engine {self.engine.id} failed mid-stream: {exc}"
            self.fwd.metrics.engine_errors.labels(self.engine.id, "mid_stream").inc()
            self.fwd.registry.mark_failure(self.engine.id, detail, self.fwd.clock())
            log.warning(detail, extra={"request_id": self.ex.request_id})
            # an engine that stopped inside an event: end that event first, so the client
            # parses the error event on its own
            cut = b"" if not self.tail or self.tail.endswith((b"\n\n", b"\r\n\r\n")) else b"\n\n"
            yield cut + error_event(self.ex.route, detail)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    def _seen(self, chunk: bytes) -> bytes:
        if not self.last:  # with the tail's end: the event's line may span two chunks
            self.last = stream_ended(self.tail[-48:] + chunk)
        self.events += chunk.count(b"data: ")
        if self.ex.store_response and self.seen < _HEAD_BYTES:  # the id is in the first event
            self.head += chunk[: _HEAD_BYTES - self.seen]
            self.fwd.bind_response(self.ex, self.engine, self.head)
        self.seen += len(chunk)
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
        return chunk

    async def close(self) -> None:
        if self.done:
            return
        self.done = True
        await self.resp.close()
        if self.outcome == "cancelled" and self.delivered:
            self.outcome = "ok"
        output = completion_tokens(self.tail)
        if output is None and self.events:
            output = max(0, self.events - 2)  # minus the role chunk and [DONE]: an estimate
        ok = self.outcome == "ok"
        self.fwd.finish(
            self.ex,
            self.engine,
            ok=ok,
            output=output if ok else None,
            outcome=self.outcome,
            usage=self.tail,
        )


def error_event(route: str, detail: str) -> bytes:
    """The end of a stream whose engine failed mid-way, framed as ``route``'s API frames it."""
    if route == "messages":
        body = {"type": "error", "error": {"type": "api_error", "message": detail}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if route == "responses":
        event: dict[str, object] = {
            "type": "error",
            "code": "upstream_error",
            "message": detail,
            "param": None,
        }
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    chunk = json.dumps(error_body(502, detail, error_type="upstream_error"))
    return f"data: {chunk}\n\ndata: [DONE]\n\n".encode()


def stream_ended(content: bytes) -> bool:
    """``content`` (a stream's bytes) holds the stream's last event (:data:`LAST_EVENT`)."""
    return LAST_EVENT.search(content) is not None


def completion_tokens(content: bytes) -> int | None:
    found = _COMPLETION_TOKENS.findall(content)
    return int(found[-1]) if found else None

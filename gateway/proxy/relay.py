"""Relaying an engine's SSE stream to the client, chunk by chunk, with one clean-up.

Streams pass through unchanged, whatever the API (chat and completions chunks,
Responses events, Anthropic Messages events). The output length for the policies'
completion hooks comes from the last usage in the stream's tail (``completion_tokens``
or, for Responses and Messages, ``output_tokens``). A stored response's id is read from
the stream's first event. An upstream failure mid-stream ends the stream with an error
in the API's own framing: ``data: {"error": ...}`` then ``data: [DONE]`` (OpenAI chat
and completions), an ``event: error`` (Responses; Anthropic's error shape on Messages).
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
        self.done = False

    async def run(self) -> AsyncIterator[bytes]:
        try:
            yield self._seen(self.first)
            async for chunk in self.chunks:
                yield self._seen(chunk)
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


def completion_tokens(content: bytes) -> int | None:
    found = _COMPLETION_TOKENS.findall(content)
    return int(found[-1]) if found else None

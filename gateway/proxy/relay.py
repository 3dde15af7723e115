"""Relaying an engine's SSE stream to the client, chunk by chunk, with one clean-up."""

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
    from gateway.proxy.forwarder import Exchange, Forwarder

log = logging.getLogger("kvgate.proxy")

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL_BYTES = 4096


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
            event = json.dumps(error_body(502, detail, error_type="upstream_error"))
            yield f"data: {event}\n\ndata: [DONE]\n\n".encode()
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    def _seen(self, chunk: bytes) -> bytes:
        self.events += chunk.count(b"data: ")
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


def completion_tokens(content: bytes) -> int | None:
    found = _COMPLETION_TOKENS.findall(content)
    return int(found[-1]) if found else None

"""A request in flight in the emulated engine, as its HTTP handler sees it.

A :class:`GenerationHandle` keeps a produced-token counter and an event instead
of a queue: the driver never waits on a reader, and a slow reader gets several
tokens in one :class:`TokenDelta` (vLLM's output collector merges deltas the
same way). With the engine model's frontend term the driver passes a delay:
readers then see the tokens (and the end) that many real seconds after the
engine made them, never out of order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.core.errors import KvgateError
from gateway.perfmodel.engine import EngineRequest


class RequestRejectedError(KvgateError):
    """The engine can never run this request (vLLM answers 400)."""

    status_code = 400
    error_type = "BadRequestError"


class EngineDeadError(KvgateError):
    """The driver task died or was stopped while the request was in flight."""

    status_code = 500
    error_type = "InternalServerError"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens ``start .. start+count`` are ready; ``finish_reason`` is set on the last delta."""

    start: int
    count: int
    finish_reason: str | None = None


class GenerationHandle:
    """One request in flight: an async iterator of :class:`TokenDelta`."""

    def __init__(
        self, req: EngineRequest, *, digest: int, max_tokens: int, finish_reason: str
    ) -> None:
        self.req = req
        self.digest = digest
        self.max_tokens = max_tokens
        self.target_reason = finish_reason
        self.produced = 0
        self.finish_reason: str | None = None
        self.last_token_time: float | None = None
        self.scheduled = False
        self.pin_id: str | None = None
        """P/D prefill leg: the id its prompt KV is pinned under when it ends."""
        self.reported_cached: int | None = None
        """P/D decode leg: the prefill engine's ``remote_prefill_cached_tokens``."""
        self._delivered = 0
        self._visible = 0
        """Tokens readers may see (``produced`` less those still on their way)."""
        self._shown_reason: str | None = None
        self._show_at = 0.0
        self._error: str | None = None
        self._event = asyncio.Event()
        self._done = asyncio.Event()

    @property
    def id(self) -> str:
        """The engine request id (unique per driver)."""
        return self.req.id

    @property
    def prompt_tokens(self) -> int:
        return self.req.prompt_tokens

    @property
    def local_hits(self) -> int:
        """Prompt tokens served from the local prefix cache at first scheduling."""
        return self.req.cached_tokens or 0

    @property
    def cached_tokens(self) -> int:
        """``usage.prompt_tokens_details.cached_tokens``, as vLLM reports it: the local
        hits plus the KV loaded from a prefill engine, unless that engine reported its
        own hits (``remote_prefill_cached_tokens``, vLLM >= 0.31)."""
        if self.reported_cached is not None:
            return min(max(self.reported_cached, 0), self.req.prompt_tokens)
        return self.local_hits + self.req.external_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self._error is not None

    def push(self, count: int, now: float, delay_s: float = 0.0) -> None:
        """Driver side: ``count`` more tokens exist at virtual time ``now``; readers see
        them ``delay_s`` real seconds later."""
        self.produced += count
        self.last_token_time = now
        self._later(delay_s, self.produced, None)

    def finish(self, reason: str, delay_s: float = 0.0) -> None:
        """Driver side: generation ended (``stop``, ``length`` or ``abort``); readers see
        the end ``delay_s`` real seconds later (an abort at once)."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self._later(0.0 if reason == "abort" else delay_s, self.produced, reason)

    def _later(self, delay_s: float, visible: int, reason: str | None) -> None:
        """Show readers ``visible`` tokens (and ``reason``) after ``delay_s``, in order."""
        loop = asyncio.get_running_loop() if delay_s > 0 or self._show_at else None
        if loop is None:
            self._show(visible, reason)
            return
        at = max(loop.time() + delay_s, self._show_at)
        self._show_at = at
        loop.call_at(at, self._show, visible, reason)

    def _show(self, visible: int, reason: str | None) -> None:
        self._visible = max(self._visible, visible)
        if reason is not None and self._shown_reason is None:
            self._shown_reason = reason
            self._done.set()
        self._event.set()

    def fail(self, message: str) -> None:
        """Driver side: the engine died; readers get :class:`EngineDeadError`."""
        self._error = message
        self._event.set()
        self._done.set()

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[TokenDelta]:
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise EngineDeadError(self._error)
            start = self._delivered
            count = self._visible - start
            reason = self._shown_reason
            self._delivered = self._visible
            if count or reason is not None:
                yield TokenDelta(start, count, reason)
            if reason is not None:
                return

    async def wait(self) -> str:
        """Wait for the end of generation (without waking per token); the finish reason."""
        await self._done.wait()
        if self._error is not None:
            raise EngineDeadError(self._error)
        assert self._shown_reason is not None
        self._delivered = self._visible
        return self._shown_reason

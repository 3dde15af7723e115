"""One generation on the emulated engine, as every generating route runs it.

:func:`start` validates and queues a prompt with its LoRA adapter and cache salt;
:func:`wait_or_disconnect` waits for the end of a non-streamed generation unless the
client goes away first; :class:`GenerationStream` is the SSE response that aborts its
engine request however the stream ends (client gone, error, normal end).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.emulator.driver import EngineDriver, GenerationHandle
from gateway.emulator.state import EmulatorState


def start(
    state: EmulatorState,
    token_ids: list[int],
    *,
    max_tokens: int,
    lora: str = "",
    cache_salt: str | None = None,
    ignore_eos: bool = False,
) -> GenerationHandle:
    """Queue a generation (raises the engine's 400/500 errors before queueing)."""
    return state.driver.submit(
        token_ids,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        lora=state.lora.key(lora),
        lora_id=state.lora.ids.get(lora),
        cache_salt=cache_salt,
    )


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_or_disconnect(
    request: Request, driver: EngineDriver, handle: GenerationHandle
) -> str | None:
    """The finish reason, or None when the client went away first (the request is aborted)."""
    waiter = asyncio.ensure_future(handle.wait())
    listener = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            return None
        return waiter.result()
    finally:
        driver.abort(handle.id)  # no-op when it finished
        for task in (waiter, listener):
            task.cancel()
        await asyncio.wait({waiter, listener})


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its engine request however the stream ends."""

    def __init__(self, body: AsyncIterator[str], driver: EngineDriver, handle_id: str) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._driver = driver
        self._handle_id = handle_id

    async def listen_for_disconnect(self, receive: Receive) -> None:
        # Abort at once: the engine request is freed and the event stream ends at its
        # next delta, even if the cancellation of the sending task is delivered late.
        await super().listen_for_disconnect(receive)
        self._driver.abort(self._handle_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._driver.abort(self._handle_id)  # no-op when it finished normally

"""``/v1/completions`` and ``/v1/chat/completions``: JSON or SSE, aborted on disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.emulator.driver import EngineDeadError, EngineDriver, GenerationHandle
from gateway.emulator.protocol import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    ResponseShape,
    TokenizeRequest,
    error_body,
    parse_body,
    request_id,
    sse,
    usage,
)
from gateway.emulator.state import EmulatorState, StateDep
from gateway.emulator.tokenizer import render_chat

router = APIRouter()


class _GenerationStream(StreamingResponse):
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


async def _events(
    state: EmulatorState,
    handle: GenerationHandle,
    shape: ResponseShape,
    *,
    include_usage: bool,
    continuous: bool,
) -> AsyncIterator[str]:
    role_sent = shape.kind != "chat"
    try:
        async for delta in handle:
            if delta.finish_reason == "abort":
                return
            if not role_sent:
                yield sse(shape.role_chunk())
                role_sent = True
            text = state.text(handle, delta.start, delta.count)
            chunk = shape.chunk(text, delta.finish_reason)
            if continuous:
                done = delta.start + delta.count
                chunk["usage"] = usage(handle.prompt_tokens, done, handle.cached_tokens)
            yield sse(chunk)
        if include_usage:
            block = usage(handle.prompt_tokens, handle.produced, handle.cached_tokens)
            yield sse(shape.usage_chunk(block))
    except EngineDeadError as exc:
        yield sse(error_body(exc))
    yield SSE_DONE


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(
    request: Request,
    state: EmulatorState,
    *,
    shape: ResponseShape,
    token_ids: list[int],
    max_tokens: int,
    body: CompletionRequest | ChatRequest,
) -> Response:
    options = body.stream_options
    if options is not None and not body.stream:
        raise ApiError("Stream options can only be defined when `stream=True`.", param="stream")
    if body.n != 1:
        raise ApiError(f"The emulator supports n=1 only, got n={body.n}.", param="n")
    driver = state.driver
    handle = driver.submit(token_ids, max_tokens=max_tokens, ignore_eos=body.ignore_eos)
    if body.stream:
        continuous = bool(options and options.continuous_usage_stats)
        include = continuous or bool(options and options.include_usage)
        events = _events(state, handle, shape, include_usage=include, continuous=continuous)
        return _GenerationStream(events, driver, handle.id)
    waiter = asyncio.ensure_future(handle.wait())
    listener = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():  # the client went away first
            return Response(status_code=499)
        reason = waiter.result()
    finally:
        driver.abort(handle.id)  # no-op when it finished
        for task in (waiter, listener):
            task.cancel()
        await asyncio.wait({waiter, listener})
    text = state.text(handle, 0, handle.produced)
    block = usage(handle.prompt_tokens, handle.produced, handle.cached_tokens)
    return JSONResponse(shape.final(text, reason, block))


def prompt_ids(state: EmulatorState, prompt: Any) -> list[int]:
    """Token ids of a completions ``prompt``: text, token ids, or a list of one of them."""
    item = prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(
                f"The emulator takes one prompt per request, got {len(prompt)}.", param="prompt"
            )
        item = prompt[0]
    if isinstance(item, str):
        return state.tokenizer.encode(item)
    ids = [int(t) for t in item]
    if not ids:
        raise ApiError("The prompt cannot be empty.", param="prompt")
    bad = state.tokenizer.out_of_vocab(ids)
    if bad is not None:
        raise ApiError(f"Token id {bad} is out of vocabulary.", param="prompt")
    return ids


def chat_prompt(body: ChatRequest | TokenizeRequest, messages: list[dict[str, Any]]) -> str:
    """The chat template applied to ``messages`` (and ``tools``)."""
    for i, msg in enumerate(messages):
        if not isinstance(msg.get("role"), str):
            raise ApiError(f"messages[{i}] has no role.", param="messages")
    return render_chat(
        messages,
        body.tools,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )


@router.post("/v1/completions")
async def completions(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), CompletionRequest)
    state.check_model(body.model)
    ids = prompt_ids(state, body.prompt)
    limit = state.perf.max_model_len
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, limit - len(ids))
    rid = request_id(request.headers.get("x-request-id"), body.request_id)
    shape = ResponseShape("completion", rid, state.settings.model)
    return await _respond(
        request, state, shape=shape, token_ids=ids, max_tokens=max_tokens, body=body
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), ChatRequest)
    state.check_model(body.model)
    ids = state.tokenizer.encode(chat_prompt(body, body.messages))
    requested = body.max_completion_tokens
    if requested is None:
        requested = body.max_tokens
    limit = state.perf.max_model_len
    max_tokens = requested if requested is not None else max(1, limit - len(ids))
    rid = request_id(request.headers.get("x-request-id"), body.request_id)
    shape = ResponseShape("chat", rid, state.settings.model)
    return await _respond(
        request, state, shape=shape, token_ids=ids, max_tokens=max_tokens, body=body
    )

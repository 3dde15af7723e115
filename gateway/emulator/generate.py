"""``/v1/completions`` and ``/v1/chat/completions``: JSON or SSE, aborted on disconnect.

P/D legs (:mod:`gateway.emulator.pd`): a prefill leg runs with ``max_tokens=1``
and answers ``kv_transfer_params`` (on the chunk with ``finish_reason`` when
streamed); a decode leg pulls its prompt KV first, then computes the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.core.errors import KvgateError
from gateway.emulator.driver import EngineDeadError, GenerationHandle
from gateway.emulator.engine_call import GenerationStream, wait_or_disconnect
from gateway.emulator.lora import check_cache_salt
from gateway.emulator.pd import (
    DecodeLeg,
    KvEndpoint,
    Leg,
    PrefillLeg,
    parse_leg,
    prefill_params,
)
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


async def _events(
    state: EmulatorState,
    handle: GenerationHandle,
    shape: ResponseShape,
    *,
    include_usage: bool,
    continuous: bool,
    endpoint: KvEndpoint | None = None,
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
            if delta.finish_reason is not None and endpoint is not None:
                chunk["kv_transfer_params"] = _kv_params(state, endpoint, handle)
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


def _kv_params(
    state: EmulatorState, endpoint: KvEndpoint | None, handle: GenerationHandle
) -> dict[str, Any] | None:
    """A finished prefill leg's ``kv_transfer_params`` (None when nothing is pinned)."""
    pin = None if handle.pin_id is None else state.driver.pins.get(handle.pin_id)
    if pin is None or endpoint is None:
        return None
    return prefill_params(pin, endpoint)


async def _submit(
    request: Request,
    state: EmulatorState,
    leg: Leg | None,
    *,
    shape: ResponseShape,
    token_ids: list[int],
    max_tokens: int,
    body: CompletionRequest | ChatRequest,
    lora: str,
) -> tuple[GenerationHandle, KvEndpoint | None]:
    """Queue the generation; a decode leg pulls its KV first, a prefill leg pins it after."""
    remote, arrival, pin_id, endpoint = 0, None, None, None
    if isinstance(leg, DecodeLeg):
        arrival = state.driver.now()
        remote = await state.kv.pull(leg, token_ids)
    elif isinstance(leg, PrefillLeg):
        pin_id = f"{shape.id}-{uuid.uuid4().hex[:8]}"  # like vLLM's internal request id
        endpoint = KvEndpoint(state.engine_id, *state.kv_address(request))
    handle = state.driver.submit(
        token_ids,
        max_tokens=max_tokens,
        ignore_eos=body.ignore_eos,
        remote_tokens=remote,
        arrival=arrival,
        pin_id=pin_id,
        lora=state.lora.key(lora),
        lora_id=state.lora.ids.get(lora),
        cache_salt=body.cache_salt,
    )
    if isinstance(leg, DecodeLeg):
        handle.reported_cached = leg.cached_tokens
    return handle, endpoint


async def _respond(
    request: Request,
    state: EmulatorState,
    *,
    shape: ResponseShape,
    token_ids: list[int],
    max_tokens: int,
    body: CompletionRequest | ChatRequest,
    lora: str = "",
) -> Response:
    leg: Leg | None = parse_leg(body.kv_transfer_params, state.settings.role)
    options = body.stream_options
    driver = state.driver
    try:
        if options is not None and not body.stream:
            raise ApiError("Stream options can only be defined when `stream=True`.", param="stream")
        if body.n != 1:
            raise ApiError(f"The emulator supports n=1 only, got n={body.n}.", param="n")
        if isinstance(leg, PrefillLeg):
            max_tokens = 1  # the prefill leg of a P/D pair only computes the prompt
        driver.validate(token_ids, max_tokens=max_tokens, ignore_eos=body.ignore_eos)
    except KvgateError:
        if isinstance(leg, DecodeLeg):  # vLLM frees the prefill engine's blocks then too
            state.kv.notify(leg)
        raise
    handle, endpoint = await _submit(
        request,
        state,
        leg,
        shape=shape,
        token_ids=token_ids,
        max_tokens=max_tokens,
        body=body,
        lora=lora,
    )
    if body.stream:
        continuous = bool(options and options.continuous_usage_stats)
        include = continuous or bool(options and options.include_usage)
        events = _events(
            state, handle, shape, include_usage=include, continuous=continuous, endpoint=endpoint
        )
        return GenerationStream(events, driver, handle.id)
    reason = await wait_or_disconnect(request, driver, handle)
    if reason is None:  # the client went away first
        return Response(status_code=499)
    text = state.text(handle, 0, handle.produced)
    block = usage(handle.prompt_tokens, handle.produced, handle.cached_tokens)
    final = shape.final(text, reason, block)
    final["kv_transfer_params"] = _kv_params(state, endpoint, handle)
    return JSONResponse(final)


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
    check_cache_salt(body.cache_salt)
    lora = state.check_model(body.model)
    ids = prompt_ids(state, body.prompt)
    limit = state.perf.max_model_len
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, limit - len(ids))
    rid = request_id(request.headers.get("x-request-id"), body.request_id)
    shape = ResponseShape("completion", rid, state.served_name(lora))
    return await _respond(
        request, state, shape=shape, token_ids=ids, max_tokens=max_tokens, body=body, lora=lora
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), ChatRequest)
    check_cache_salt(body.cache_salt)
    lora = state.check_model(body.model)
    ids = state.tokenizer.encode(chat_prompt(body, body.messages))
    requested = body.max_completion_tokens
    if requested is None:
        requested = body.max_tokens
    limit = state.perf.max_model_len
    max_tokens = requested if requested is not None else max(1, limit - len(ids))
    rid = request_id(request.headers.get("x-request-id"), body.request_id)
    shape = ResponseShape("chat", rid, state.served_name(lora))
    return await _respond(
        request, state, shape=shape, token_ids=ids, max_tokens=max_tokens, body=body, lora=lora
    )

"""OpenAI Responses on the emulator: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` (the three routes vLLM 0.32 registers; no DELETE).

The prompt is the chat template over vLLM's message list: ``instructions`` as the
system message, then (with ``previous_response_id``) the stored conversation without
its system message and the previous output as an assistant message, then ``input``
(a string, or message / ``function_call`` / ``function_call_output`` items). A
follow-up's prompt therefore starts with the earlier turn's prompt and output, and
hits the prefix cache as on vLLM. Responses are stored (``store``, default true) in
this process only (:mod:`gateway.emulator.response_store`; a real vLLM stores only
with ``VLLM_ENABLE_RESPONSES_API_STORE=1``); an unknown id answers vLLM's 404.
``background`` (non-streamed) answers ``queued`` at once and runs on; cancel aborts
it (a finished or synchronous response cannot be cancelled: 400). The response
object and the SSE events (``event: <type>`` + ``data: <json>``, ``sequence_number``
from 0) are vLLM's :mod:`gateway.emulator.responses_shape`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.emulator import responses_shape as shape
from gateway.emulator.driver import EngineDeadError, GenerationHandle
from gateway.emulator.engine_call import GenerationStream, start, wait_or_disconnect
from gateway.emulator.lora import check_cache_salt
from gateway.emulator.protocol import ApiError, error_body, parse_body
from gateway.emulator.response_store import StoredResponse
from gateway.emulator.responses_shape import ResponsesBody
from gateway.emulator.state import EmulatorState, StateDep
from gateway.emulator.tokenizer import render_chat

router = APIRouter()


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        f"Response with id '{response_id}' not found.",
        status=404,
        param="response_id",
        error_type="invalid_request_error",
    )


def _messages(state: EmulatorState, body: ResponsesBody) -> list[dict[str, Any]]:
    """vLLM's chat messages for the request (with the stored conversation it continues)."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if body.previous_response_id is not None:
        prev = state.responses.get(body.previous_response_id)
        if prev is None:
            raise _not_found(body.previous_response_id)
        out.extend(m for m in prev.messages if m.get("role") != "system")
        out.extend(shape.output_messages(prev.body))
    out.extend(shape.input_messages(body.input))
    return out


@router.post("/v1/responses")
async def create_response(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), ResponsesBody)
    check_cache_salt(body.cache_salt)
    if body.background and not body.store:
        raise ApiError("background can only be used when `store` is true", param="background")
    if body.background and body.stream:
        raise ApiError("The emulator does not stream background responses.", param="stream")
    lora = state.check_model(body.model)
    messages = _messages(state, body)
    prompt = render_chat(messages, shape.chat_tools(body.tools))
    ids = state.tokenizer.encode(prompt)
    limit = state.perf.max_model_len
    if len(ids) >= limit:
        raise ApiError(
            f"The engine prompt length {len(ids)} exceeds the max_model_len {limit}. "
            "Please reduce prompt.",
            param="input",
        )
    max_tokens = body.max_output_tokens or limit - len(ids)
    rid = body.request_id or f"resp_{uuid.uuid4().hex[:16]}"
    head = shape.ResponseHead(rid, state.served_name(lora), body, max_tokens)
    handle = start(
        state,
        ids,
        max_tokens=max_tokens,
        lora=lora,
        cache_salt=body.cache_salt,
        ignore_eos=body.ignore_eos,
    )
    stored = StoredResponse(head.response([], "queued"), messages, handle.id)
    if body.background:  # stored at once; sync responses once they are done, as vLLM
        state.responses.put(rid, stored)
        task = asyncio.create_task(_finish_background(state, head, handle, stored))
        state.responses.tasks.add(task)
        task.add_done_callback(state.responses.tasks.discard)
        return JSONResponse(stored.body)
    keep = rid if body.store else None
    if body.stream:
        events = _events(state, head, handle, stored, keep)
        return GenerationStream(events, state.driver, handle.id)
    reason = await wait_or_disconnect(request, state.driver, handle)
    if reason is None:
        return Response(status_code=499)
    stored.body, stored.engine_request = _final(state, head, handle, reason), None
    if keep is not None:
        state.responses.put(keep, stored)
    return JSONResponse(stored.body)


def _final(
    state: EmulatorState, head: shape.ResponseHead, handle: GenerationHandle, reason: str
) -> dict[str, Any]:
    text = state.text(handle, 0, handle.produced)
    items = [shape.message_item(shape.item_id(), text)] if text else []
    return head.response(items, "incomplete" if reason == "length" else "completed", handle)


async def _finish_background(
    state: EmulatorState, head: shape.ResponseHead, handle: GenerationHandle, stored: StoredResponse
) -> None:
    stored.body = head.response([], "in_progress")
    try:
        reason = await handle.wait()
    except EngineDeadError:
        stored.body = head.response([], "failed")
        return
    finally:
        stored.engine_request = None
    if stored.body["status"] != "cancelled":
        stored.body = _final(state, head, handle, reason)


async def _events(
    state: EmulatorState,
    head: shape.ResponseHead,
    handle: GenerationHandle,
    stored: StoredResponse,
    keep: str | None,
) -> AsyncIterator[str]:
    events = shape.EventStream(head)
    yield events.created()
    text: list[str] = []
    try:
        async for delta in handle:
            if delta.finish_reason == "abort":
                return
            piece = state.text(handle, delta.start, delta.count)
            if piece:
                text.append(piece)
                for event in events.delta(piece):
                    yield event
        reason = handle.finish_reason or "stop"
    except EngineDeadError as exc:
        yield events.error(error_body(exc))
        return
    for event in events.close():
        yield event
    status = "incomplete" if reason == "length" else "completed"
    stored.body, stored.engine_request = head.response(events.items, status, handle), None
    if keep is not None:
        state.responses.put(keep, stored)
    yield events.completed(stored.body)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, state: StateDep) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: StateDep) -> Response:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    if stored.body.get("status") not in ("queued", "in_progress"):
        raise ApiError("Cannot cancel a synchronous response.", param="response_id")
    stored.body = {**stored.body, "status": "cancelled"}
    if stored.engine_request is not None:
        state.driver.abort(stored.engine_request)
    return JSONResponse(stored.body)

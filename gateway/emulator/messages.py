"""Anthropic Messages on the emulator: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

As vLLM 0.32 does, a Messages request becomes a chat request: ``system`` (a string
or text blocks) the system message, text blocks the content, ``tool_use`` blocks
assistant tool calls, ``tool_result`` blocks ``tool`` messages, ``tools`` (with
``input_schema``) function tools; the chat template then gives the prompt (so the
same conversation sent as chat or as messages shares its prefix blocks). The message
id is the chat id (``chatcmpl-`` + ``X-Request-Id`` or a uuid). Usage is
``{input_tokens, output_tokens, cache_creation_input_tokens: 0, cache_read_input_tokens}``
with ``input_tokens`` the prompt tokens *not* read from the cache (Anthropic's
convention). The stream is
``message_start`` (usage ``{input_tokens: prompt, output_tokens: 0}``),
``content_block_start`` / ``content_block_delta`` (``text_delta``) /
``content_block_stop`` for the text, ``message_delta`` (``stop_reason``
``end_turn`` or ``max_tokens``, the usage) and ``message_stop``, each framed
``event: <type>\\ndata: <json>\\n\\n``; vLLM sends no ``ping``. A malformed body is
answered with vLLM's OpenAI-shaped 400; errors after it (unknown model: 404, too
long, bad ``cache_salt``) in Anthropic's shape ``{"type": "error", "error": {"type",
"message"}}``, as vLLM's route translates them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from gateway.core.errors import KvgateError
from gateway.emulator.driver import EngineDeadError, GenerationHandle
from gateway.emulator.engine_call import GenerationStream, start, wait_or_disconnect
from gateway.emulator.lora import check_cache_salt
from gateway.emulator.protocol import _Lenient, dumps, error_body, parse_body, request_id
from gateway.emulator.state import EmulatorState, StateDep
from gateway.emulator.tokenizer import render_chat

router = APIRouter()
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class CountTokensBody(_Lenient):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int = Field(gt=0)
    stream: bool | None = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    ignore_eos: bool = False


def _anthropic_error(exc: KvgateError) -> JSONResponse:
    kind = error_body(exc)["error"]["type"]
    body = {"type": "error", "error": {"type": kind, "message": exc.message}}
    return JSONResponse(body, status_code=exc.status_code)


def _block_text(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    return "" if kind in ("thinking", "redacted_thinking") else f"<|{kind}|>"


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(_block_text(b) for b in content)
    return "" if content is None else str(content)


def chat_messages(body: CountTokensBody) -> list[dict[str, Any]]:
    """The chat messages vLLM converts a Messages request into."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system)})
    for msg in body.messages:
        role, content = str(msg.get("role", "user")), msg.get("content")
        if not isinstance(content, list):
            out.append({"role": role, "content": _text(content)})
            continue
        calls = [
            {
                "id": b.get("id"),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}))},
            }
            for b in content
            if isinstance(b, dict) and b.get("type") == "tool_use"
        ]
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                result = {"role": "tool", "tool_call_id": b.get("tool_use_id")}
                out.append({**result, "content": _text(b.get("content"))})
        rest = [
            b
            for b in content
            if not (isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result"))
        ]
        if rest or calls:
            entry: dict[str, Any] = {"role": role, "content": _text(rest)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _tools(body: CountTokensBody) -> list[dict[str, Any]] | None:
    if not body.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("input_schema", {}),
            },
        }
        for t in body.tools
    ]


def _prompt_ids(state: EmulatorState, body: CountTokensBody) -> list[int]:
    return state.tokenizer.encode(render_chat(chat_messages(body), _tools(body)))


def _usage(handle: GenerationHandle) -> dict[str, int]:
    cached = handle.cached_tokens
    return {
        "input_tokens": max(0, handle.prompt_tokens - cached),
        "output_tokens": handle.produced,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


async def _events(
    state: EmulatorState, handle: GenerationHandle, mid: str, model: str
) -> AsyncIterator[str]:
    start_usage = {"input_tokens": handle.prompt_tokens, "output_tokens": 0}
    message: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    yield _event("message_start", {"type": "message_start", "message": message})
    open_block = False
    try:
        async for delta in handle:
            if delta.finish_reason == "abort":
                return
            text = state.text(handle, delta.start, delta.count)
            if not text:
                continue
            if not open_block:
                open_block = True
                block = {"type": "text", "text": ""}
                opening = {"type": "content_block_start", "content_block": block, "index": 0}
                yield _event("content_block_start", opening)
            body = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": text}}
            yield _event("content_block_delta", {**body, "index": 0})
    except EngineDeadError as exc:
        err = {"type": "internal_error", "message": exc.message}
        yield _event("error", {"type": "error", "error": err})
        return
    if open_block:
        yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason = STOP_REASONS.get(handle.finish_reason or "stop", "end_turn")
    done = {"stop_reason": reason, "stop_sequence": None}
    yield _event("message_delta", {"type": "message_delta", "delta": done, "usage": _usage(handle)})
    yield _event("message_stop", {"type": "message_stop"})


@router.post("/v1/messages")
async def create_message(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), MessagesBody)
    try:
        check_cache_salt(body.cache_salt)
        lora = state.check_model(body.model)
        ids = _prompt_ids(state, body)
        handle = start(
            state,
            ids,
            max_tokens=body.max_tokens,
            lora=lora,
            cache_salt=body.cache_salt,
            ignore_eos=body.ignore_eos,
        )
    except KvgateError as exc:
        return _anthropic_error(exc)
    mid = "chatcmpl-" + request_id(request.headers.get("x-request-id"), None)
    model = state.served_name(lora)
    if body.stream:
        return GenerationStream(_events(state, handle, mid, model), state.driver, handle.id)
    try:
        reason = await wait_or_disconnect(request, state.driver, handle)
    except EngineDeadError as exc:
        return _anthropic_error(exc)
    if reason is None:
        return Response(status_code=499)
    text = state.text(handle, 0, handle.produced)
    return JSONResponse(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": model,
            "stop_reason": STOP_REASONS.get(reason, "end_turn"),
            "usage": _usage(handle),
        }
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, state: StateDep) -> Response:
    body = parse_body(await request.body(), CountTokensBody)
    try:
        state.check_model(body.model)
    except KvgateError as exc:
        return _anthropic_error(exc)
    n = len(_prompt_ids(state, body))
    return JSONResponse({"input_tokens": n, "context_management": {"original_input_tokens": n}})

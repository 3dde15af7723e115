"""The Responses API wire format as vLLM 0.32 emits it: request body, response object,
output items, usage and the SSE event sequence.

Response ids are ``resp_`` + 16 hex digits (or the body's ``request_id``); output
message ids ``msg_`` + 16 hex. The stream is ``response.created``,
``response.in_progress`` (both carrying the in-progress response, whose ``id`` is the
response id), then for the text ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per engine delta,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, and last ``response.completed`` with the final
response and its usage ``{input_tokens, input_tokens_details: {cached_tokens,
cache_write_tokens, ...}, output_tokens, output_tokens_details: {reasoning_tokens,
tool_output_tokens, ...}, total_tokens}``. Each event is ``event: <type>\\ndata:
<json>\\n\\n``; there is no ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.emulator.handle import GenerationHandle
from gateway.emulator.protocol import ApiError, _Lenient, dumps


class ResponsesBody(_Lenient):
    """``POST /v1/responses`` (unknown fields accepted and ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    service_tier: str = "auto"
    truncation: str | None = "disabled"
    user: str | None = None
    text: Any = None
    reasoning: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    request_id: str | None = None
    cache_salt: Any = None
    ignore_eos: bool = False


def item_id() -> str:
    return f"msg_{uuid.uuid4().hex[:16]}"


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return ""
    kind = str(part.get("type", "input_text"))
    if kind in ("input_text", "output_text", "text", "refusal"):
        return str(part.get("text", part.get("refusal", "")))
    return f"<|{kind}|>"


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for ``input``: messages, function calls (merged into the assistant
    message before them) and function call outputs (``tool`` messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise ApiError(f"input[{i}] has no role.", param="input")
            content = item.get("content", "")
            if isinstance(content, list):
                content = "".join(_part_text(p) for p in content)
            out.append({"role": role, "content": str(content)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
            )
        elif kind != "reasoning":  # vLLM skips reasoning items in the prompt
            raise ApiError(f"Unsupported input item type {kind!r} (input[{i}]).", param="input")
    return out


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output as assistant messages (one per text part)."""
    out: list[dict[str, Any]] = []
    for item in response.get("output", []):
        if item.get("type") == "message":
            out.extend({"role": "assistant", "content": c["text"]} for c in item["content"])
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools in the chat format the template renders."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if tool.get("type") == "function":
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def message_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    ]
    return {
        "id": mid,
        "content": content if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def usage(handle: GenerationHandle) -> dict[str, Any]:
    prompt, output = handle.prompt_tokens, handle.produced
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": handle.cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


@dataclass(slots=True)
class ResponseHead:
    """What every snapshot of one response shares (id, model, echoed request fields)."""

    id: str
    model: str
    body: ResponsesBody
    max_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, output: list[dict[str, Any]], status: str, handle: GenerationHandle | None = None
    ) -> dict[str, Any]:
        """The response object in vLLM's field order (usage once ``handle`` is done)."""
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "metadata": b.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "tool_choice": b.tool_choice if b.tools else "none",
            "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "background": bool(b.background),
            "max_output_tokens": self.max_tokens,
            "max_tool_calls": b.max_tool_calls,
            "previous_response_id": b.previous_response_id,
            "prompt": b.prompt,
            "reasoning": b.reasoning,
            "service_tier": b.service_tier,
            "status": status,
            "text": b.text,
            "top_logprobs": b.top_logprobs,
            "truncation": b.truncation,
            "usage": usage(handle) if handle is not None else None,
            "user": b.user,
            "presence_penalty": b.presence_penalty or 0.0,
            "frequency_penalty": b.frequency_penalty or 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }


class EventStream:
    """The SSE events of one streamed response, numbered from 0."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self._id: str | None = None
        self._text: list[str] = []

    def _event(self, kind: str, payload: dict[str, Any]) -> str:
        data = {**payload, "sequence_number": self.seq, "type": kind}
        if "response" in payload:  # vLLM's order: response, sequence_number, type
            data = {"response": payload["response"], "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    def created(self) -> str:
        snapshot = self.head.response([], "in_progress")
        return self._event("response.created", {"response": snapshot}) + self._event(
            "response.in_progress", {"response": snapshot}
        )

    def _at(self) -> dict[str, Any]:
        return {"content_index": 0, "item_id": self._id}

    def delta(self, text: str) -> Iterator[str]:
        """Events for a text delta (opening the message item on the first one)."""
        if self._id is None:
            self._id = item_id()
            yield self._event(
                "response.output_item.added",
                {"item": message_item(self._id, "", "in_progress"), "output_index": 0},
            )
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            yield self._event(
                "response.content_part.added", {**self._at(), "output_index": 0, "part": part}
            )
        self._text.append(text)
        yield self._event(
            "response.output_text.delta",
            {
                "content_index": 0,
                "delta": text,
                "item_id": self._id,
                "logprobs": [],
                "output_index": 0,
            },
        )

    def close(self) -> Iterator[str]:
        """Close the open message item (nothing when no text came)."""
        if self._id is None:
            return
        text = "".join(self._text)
        done = {**self._at(), "logprobs": [], "output_index": 0, "text": text}
        yield self._event("response.output_text.done", done)
        part: dict[str, Any] = {
            "annotations": [],
            "text": text,
            "type": "output_text",
            "logprobs": None,
        }
        yield self._event(
            "response.content_part.done", {**self._at(), "output_index": 0, "part": part}
        )
        item = message_item(self._id, text)
        self.items.append(item)
        yield self._event("response.output_item.done", {"item": item, "output_index": 0})

    def completed(self, final: dict[str, Any]) -> str:
        return self._event("response.completed", {"response": final})

    def error(self, body: dict[str, Any]) -> str:
        err = body["error"]
        payload = {"code": str(err.get("code")), "message": err["message"], "param": None}
        return self._event("error", payload)

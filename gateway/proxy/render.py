"""Responses and Messages bodies as chat messages, for one canonical routing key.

vLLM renders ``/v1/responses`` and ``/v1/messages`` through the model's chat template,
as it does chat completions; kvgate converts both to chat's message and tool shapes
before :func:`gateway.proxy.routing_key.render_chat`, so a system prompt and tools
shared by a chat client, a Responses client and an Anthropic client key alike and
their shared prefix is credited on the engines that hold it.

* Responses: ``instructions`` -> a system message; ``input`` (a string, or items:
  messages with string or ``input_text``/``output_text`` parts, ``function_call``,
  ``function_call_output``) -> messages in order; function tools
  ``{"type": "function", "name", "parameters"}`` -> chat's ``{"type": "function",
  "function": {...}}``.
* Messages: ``system`` (a string or text blocks) -> a system message; content blocks
  ``text`` -> text, ``tool_use`` -> an assistant tool call, ``tool_result`` -> a tool
  message, images and documents -> their content identity; tools
  ``{"name", "description", "input_schema"}`` -> chat function tools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

Message = dict[str, Any]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _chat_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _parts(content: Any, text_types: tuple[str, ...]) -> Any:
    """Content parts with every text-like part as chat's ``{"type": "text"}``."""
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in text_types:
            out.append({"type": "text", "text": part.get("text", "")})
        else:
            out.append(part)
    return out


_RESPONSES_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def responses_messages(body: Mapping[str, Any]) -> tuple[list[Message], list[Any] | None]:
    """(messages, chat tools) of a ``/v1/responses`` body."""
    messages: list[Message] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping):
                messages.append(_responses_item(item))
    tools = body.get("tools")
    chat_tools = None
    if isinstance(tools, list) and tools:
        chat_tools = [
            _chat_tool(t.get("name"), t.get("description"), t.get("parameters"))
            if isinstance(t, Mapping) and t.get("type") == "function" and "function" not in t
            else t
            for t in tools
        ]
    return messages, chat_tools


def _responses_item(item: Mapping[str, Any]) -> Message:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {
            "id": item.get("call_id", ""),
            "type": "function",
            "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {
            "role": "tool",
            "tool_call_id": item.get("call_id", ""),
            "content": _text(item.get("output", "")),
        }
    if kind == "message" or "role" in item:
        return {
            "role": str(item.get("role", "user")),
            "content": _parts(item.get("content"), _RESPONSES_TEXT),
        }
    return {"role": "user", "content": [dict(item)]}  # reasoning and other items: as they are


def messages_messages(body: Mapping[str, Any]) -> tuple[list[Message], list[Any] | None]:
    """(messages, chat tools) of an Anthropic ``/v1/messages`` body."""
    messages: list[Message] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        messages.append({"role": "system", "content": _parts(system, ("text",))})
    for m in body.get("messages") or ():
        if isinstance(m, Mapping):
            messages.extend(_anthropic_message(m))
    tools = body.get("tools")
    chat_tools = None
    if isinstance(tools, list) and tools:
        chat_tools = [
            _chat_tool(t.get("name"), t.get("description"), t.get("input_schema"))
            if isinstance(t, Mapping) and "input_schema" in t
            else t
            for t in tools
        ]
    return messages, chat_tools


def _anthropic_message(m: Mapping[str, Any]) -> list[Message]:
    role = str(m.get("role", "user"))
    content = m.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]
    out: list[Message] = []
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input", {}), sort_keys=True)
            calls.append(
                {
                    "id": block.get("id", ""),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            result = block.get("content", "")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id", ""),
                    "content": _parts(result, ("text",)),
                }
            )
        else:
            parts.append(block)
    if parts or calls:
        message: Message = {"role": role, "content": parts or None}
        if calls:
            message["tool_calls"] = calls
        out.insert(0, message)
    return out

"""The routing key of a request: chained block hashes of its whole prompt.

Completions: token-id prompts are hashed exactly per engine block; text is
cut into chunks of ``block_size * chars_per_token`` characters. Chat: every
message (role, name, content parts, tool calls, tool call id) and the tool
definitions are rendered in one canonical, deterministic text — never only
the first message — so two conversations share a key prefix exactly as far
as they share content from the start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.blocks import hashes_from_text, hashes_from_tokens


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            parts.append(_canonical(part))
    return "\n".join(parts)


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
    """Canonical text of a chat request: tools first, then every message in order."""
    out = []
    if tools:
        out.append("<|tools|>\n" + _canonical(list(tools)) + "\n")
    for m in messages:
        head = f"<|{m.get('role', '')}|>"
        if m.get("name"):
            head += f" {m['name']}"
        if m.get("tool_call_id"):
            head += f" [{m['tool_call_id']}]"
        text = head + "\n" + _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += "\n" + _canonical(m["tool_calls"])
        out.append(text + "\n")
    return "".join(out)


def completion_prompt(prompt: Any) -> str | list[int]:
    """The prompt to route on: text, or token ids (the first one of a batch)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return list(prompt)
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
    return ""


class RoutingKeyer:
    """Turns prompts into (block hashes, estimated prompt tokens)."""

    def __init__(self, block_size: int = 16, chars_per_token: float = 4.0, seed: int = 0) -> None:
        self.chars_per_token = chars_per_token
        self.seed = seed
        self.block_size = block_size
        self.chunk_chars = 1
        self.set_block_size(block_size)

    def set_block_size(self, block_size: int) -> None:
        """Key on blocks of ``block_size`` tokens from now on."""
        self.block_size = block_size
        self.chunk_chars = max(1, round(block_size * self.chars_per_token))

    def key(self, prompt: str | list[int]) -> tuple[tuple[int, ...], int]:
        if isinstance(prompt, list):
            return hashes_from_tokens(prompt, self.block_size, self.seed), len(prompt)
        tokens = max(1, math.ceil(len(prompt) / self.chars_per_token))
        return hashes_from_text(prompt, self.chunk_chars, self.seed), tokens

    def chat_key(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None
    ) -> tuple[tuple[int, ...], int]:
        return self.key(render_chat(messages, tools))

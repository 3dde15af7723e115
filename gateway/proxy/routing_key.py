"""The routing key of a request: chained block hashes of its whole prompt.

Completions: token-id prompts are hashed exactly per engine block; text is
cut into chunks of ``block_size * chars_per_token`` characters. Chat: every
message (role, name, content parts, tool calls, tool call id) and the tool
definitions are rendered in one canonical, deterministic text — never only
the first message — so two conversations share a key prefix exactly as far
as they share content from the start. Images, audio, video and documents enter the
rendering as a content identity (a digest of the part, as vLLM hashes multimodal
inputs by content), never as their base64 bytes, so a 1 MB image is not counted as
250,000 prompt tokens. Responses and Messages bodies are converted to chat's shapes
first (:mod:`gateway.proxy.render`).

Cache partitions: vLLM shares no KV block between LoRA adapters nor between
``cache_salt`` values, so each (adapter, salt) keys on its own hash chain
(:func:`gateway.core.blocks.partition_seed`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.core.blocks import hashes_from_text, hashes_from_tokens, partition_seed

_MEDIA_PARTS = frozenset(
    {
        "image_url",
        "input_image",
        "image",
        "image_embeds",
        "input_audio",
        "audio_url",
        "video_url",
        "document",
        "file",
        "input_file",
    }
)
"""Content part types that carry media: keyed by identity, not by their bytes."""


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
        elif isinstance(part, Mapping) and part.get("type") in _MEDIA_PARTS:
            parts.append(media_identity(part))
        else:
            parts.append(_canonical(part))
    return "\n".join(parts)


def media_identity(part: Mapping[str, Any]) -> str:
    """A media part's place in the rendering: its type and a digest of its content."""
    digest = hashlib.sha256(_canonical(part).encode("utf-8", "surrogatepass")).hexdigest()
    return f"<|{part.get('type')}:{digest[:32]}|>"


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

    def key(
        self, prompt: str | list[int], *, lora: str = "", cache_salt: str = ""
    ) -> tuple[tuple[int, ...], int]:
        """(block hashes, estimated prompt tokens) of ``prompt`` in the cache partition of
        ``lora`` and ``cache_salt``."""
        seed = partition_seed(self.seed, lora, cache_salt)
        if isinstance(prompt, list):
            return hashes_from_tokens(prompt, self.block_size, seed), len(prompt)
        tokens = max(1, math.ceil(len(prompt) / self.chars_per_token))
        return hashes_from_text(prompt, self.chunk_chars, seed), tokens

    def chat_key(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        *,
        lora: str = "",
        cache_salt: str = "",
    ) -> tuple[tuple[int, ...], int]:
        return self.key(render_chat(messages, tools), lora=lora, cache_salt=cache_salt)

"""A deterministic fake tokenizer, chat template and text generator for the emulator.

* **Tokens.** Text is cut into chunks of ``chars_per_token`` characters (4); a
  chunk's token id is the XXH3 hash of its UTF-8 bytes modulo the vocabulary
  (ids below :data:`FIRST_TEXT_ID` are special). A prefix of a text that ends
  on a chunk boundary therefore tokenizes to a prefix of the text's tokens, so
  shared prompt prefixes give shared block hashes, as with a real tokenizer.
* **Chat template.** Messages render as ``<|role|>\\n<content>\\n`` blocks, the
  ``tools`` list as a leading ``<|tools|>`` block, and the generation prompt as
  ``<|assistant|>\\n``.
* **Generated text.** Output token ``i`` of a request is a hash of (prompt
  digest, ``i``, seed); it decodes to one word. The natural output length (where
  the fake model "emits EOS") is a hash of the prompt too, so the same prompt
  always gives the same answer.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

VOCAB_SIZE = 32_000
BOS_ID = 1
EOS_ID = 2
FIRST_TEXT_ID = 3
"""Ids ``0..2`` are ``<unk>``, ``<s>`` (BOS) and ``</s>`` (EOS)."""

_SPECIAL = {0: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
          "by", "on", "not", "this", "are", "or", "from", "at", "which", "but", "have", "an",
          "they", "you", "were", "there", "one", "all", "we", "their", "has", "been", "if",
          "more", "when", "will", "would", "who", "so", "no", "model", "token", "cache",
          "prefix", "block", "engine", "request", "batch", "router", "queue", "fast", "small",
          "large", "simple", "fleet", "serve", "route", "hit", "miss", "time", "step", "decode",
          "prefill", "stream", "answer")  # fmt: skip
_GEN = struct.Struct("<QQQ")
_xxh = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class FakeTokenizer:
    """Chunk-hash tokenizer: about ``chars_per_token`` characters per token, prefix-stable."""

    vocab_size: int = VOCAB_SIZE
    chars_per_token: int = 4

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with a leading BOS when ``add_special_tokens``)."""
        step = self.chars_per_token
        span = self.vocab_size - FIRST_TEXT_ID
        ids = [BOS_ID] if add_special_tokens else []
        for i in range(0, len(text), step):
            chunk = text[i : i + step].encode("utf-8", "surrogatepass")
            ids.append(FIRST_TEXT_ID + _xxh(chunk) % span)
        return ids

    def token_str(self, token_id: int) -> str:
        """The text one token decodes to (a word; special tokens decode to nothing)."""
        if token_id < FIRST_TEXT_ID:
            return ""
        return " " + _WORDS[token_id % len(_WORDS)]

    def token_repr(self, token_id: int) -> str:
        """A printable name for a token (``return_token_strs`` of /tokenize)."""
        return _SPECIAL.get(token_id) or self.token_str(token_id)

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text for ``token_ids``: one word per token (not the original text)."""
        return "".join(self.token_str(t) for t in token_ids)

    def out_of_vocab(self, token_ids: Iterable[int]) -> int | None:
        """The first id outside ``[0, vocab_size)``, or ``None``."""
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                return t
        return None


def prompt_digest(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of a prompt's token ids: the identity of a generation."""
    return _xxh(array("q", token_ids).tobytes())


def output_token(digest: int, index: int, seed: int, vocab_size: int = VOCAB_SIZE) -> int:
    """Token id of output position ``index`` for a prompt with ``digest``."""
    h = _xxh(_GEN.pack(digest, index, seed & 0xFFFFFFFFFFFFFFFF))
    return FIRST_TEXT_ID + h % (vocab_size - FIRST_TEXT_ID)


def output_tokens(digest: int, start: int, count: int, seed: int) -> list[int]:
    """Output token ids ``start .. start+count`` of a generation."""
    return [output_token(digest, i, seed) for i in range(start, start + count)]


def natural_length(digest: int, seed: int, low: int = 16, high: int = 256) -> int:
    """Where the fake model stops on its own: ``low..high`` tokens, fixed per prompt."""
    h = _xxh(_GEN.pack(digest, 0xE05, seed & 0xFFFFFFFFFFFFFFFF))
    return low + h % (high - low + 1)


# -- chat template ---------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                kind = str(part.get("type", "text"))
                if kind == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    parts.append(f"<|{kind}|>")
        return "".join(parts)
    return json.dumps(content, sort_keys=True)


def _tool_calls_text(calls: Any) -> str:
    if not isinstance(calls, list):
        return ""
    out: list[str] = []
    for call in calls:
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        name = fn.get("name", "") if isinstance(fn, Mapping) else ""
        args = fn.get("arguments", "") if isinstance(fn, Mapping) else ""
        out.append(f"<|tool_call|>{name}({args})\n")
    return "".join(out)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for a chat: one block per message, then ``<|assistant|>\\n``."""
    out: list[str] = []
    if tools:
        out.append("<|tools|>\n" + json.dumps(list(tools), sort_keys=True) + "\n")
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        role = str(msg.get("role", "user"))
        body = _content_text(msg.get("content")) + _tool_calls_text(msg.get("tool_calls"))
        if continue_final_message and i == last:
            out.append(f"<|{role}|>\n{body}")
        else:
            out.append(f"<|{role}|>\n{body}\n")
    if add_generation_prompt and not continue_final_message:
        out.append("<|assistant|>\n")
    return "".join(out)

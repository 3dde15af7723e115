"""Validation of OpenAI request bodies at the edge.

Only the fields kvgate reads are checked, strictly typed; everything else is
passed through untouched (the engine validates the rest). Bodies are parsed
once and forwarded byte for byte. Whatever the bytes, parsing and validation
end in a value or a 4xx :class:`ApiError`, never another exception: nesting
deeper than :data:`MAX_JSON_DEPTH`, integers too long to convert and numbers
kvgate would compute with beyond 64 bits are 400s (tests/fuzz prove it).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.proxy.errors import ApiError

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects accepted in a body (tool schemas stay far below)."""
MAX_CACHE_SALT = 1024
"""Longest ``cache_salt`` accepted (characters)."""
MAX_INT64 = 2**63 - 1
"""Bound of the integers kvgate computes with (token ids, ``max_tokens``): larger ones are
400s here; anything up to it goes to the engine, which answers for what it cannot serve."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT64)
    n: int = Field(default=1, ge=1, le=128)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _token_ids_in_range(
        cls, value: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        # min/max run in C: far cheaper than a per-item constraint on long token prompts
        if isinstance(value, list) and value and not isinstance(value[0], str):
            rows = [value] if isinstance(value[0], int) else value
            for row in rows:
                if row and (min(row) < 0 or max(row) > MAX_INT64):
                    raise ValueError(f"token ids must be between 0 and {MAX_INT64}")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_INT64)


class ResponsesBody(_Body):
    """``POST /v1/responses``: what kvgate keys and routes on."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
    tools: list[dict[str, Any]] | None = None
    store: bool = True
    background: bool = False
    max_output_tokens: int | None = Field(default=None, ge=0, le=MAX_INT64)


class MessagesBody(_Body):
    """Anthropic ``POST /v1/messages`` (``count_tokens``: the same, less ``max_tokens``)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class PooledBody(_Body):
    """Embeddings, pooling, scoring, reranking and tokenizing: only ``model`` is read."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error kvgate answers (and vLLM's): OpenAI's shape, ``code`` the HTTP status."""

    error: ErrorDetail


def body_schema(model_cls: type[BaseModel]) -> dict[str, Any]:
    """``model_cls``'s JSON schema with its ``$defs`` inlined, for an OpenAPI request body."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    out: dict[str, Any] = inline(schema)
    return out


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming what is wrong."""
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid JSON: {exc.msg} at position {exc.pos}"
        ) from None
    except ValueError:  # an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise ApiError(
            400, "request body is not valid JSON: a number has too many digits"
        ) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    # a body cannot nest deeper than it has brackets: walk it only when it has that many
    if _brackets_exceed(raw, MAX_JSON_DEPTH) and _depth(body) > MAX_JSON_DEPTH:
        raise ApiError(
            400, f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
    return body


def _brackets_exceed(raw: bytes, limit: int) -> bool:
    """More than ``limit`` of ``[`` and ``{`` in ``raw`` (memchr scans: ~40 µs per MB, and
    done after ``limit`` hits; ``bytes.count`` is ten times slower)."""
    n = 0
    for bracket in (b"[", b"{"):
        i = raw.find(bracket)
        while i >= 0:
            n += 1
            if n > limit:
                return True
            i = raw.find(bracket, i + 1)
    return False


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a deep body must not blow the stack);
    stops counting past ``MAX_JSON_DEPTH``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if level > deepest:
            deepest = level
            if deepest > MAX_JSON_DEPTH:
                break
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                stack.append((child, level + 1))
    return deepest


def validate(model_cls: type[_Body], body: dict[str, Any]) -> _Body:
    """Check the fields kvgate reads; a 400 with the first problem otherwise."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            msg = "field required"
        elif err.get("type") == "value_error":
            msg = msg.removeprefix("Value error, ")
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None

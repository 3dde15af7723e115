"""Validation of OpenAI request bodies at the edge.

Only the fields kvgate reads are checked, strictly typed; everything else is
passed through untouched (the engine validates the rest). Bodies are parsed
once and forwarded byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.proxy.errors import ApiError


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=128)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]


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
    max_completion_tokens: int | None = Field(default=None, ge=0)


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
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


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
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None

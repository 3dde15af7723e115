"""The OpenAI/vLLM wire format of the emulator: request bodies, responses, SSE, errors.

Request models accept and ignore unknown fields (vLLM's ``extra="allow"``).
Responses are plain dicts in vLLM's field order, serialised compactly; SSE
events are ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]\\n\\n``.
Errors are ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status equal to ``code`` and vLLM's type names (``BadRequestError`` ..., or the one a
route names, e.g. ``invalid_request_error`` for an unknown response id).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from gateway.core.errors import KvgateError

ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(KvgateError):
    """An error answered to an API client with ``status`` (400 unless told)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.status_code = status
        self.error_type = error_type or ERROR_TYPES.get(status, "BadRequestError")


def error_body(exc: KvgateError) -> dict[str, Any]:
    """vLLM's error JSON for ``exc``."""
    status = exc.status_code
    kind = exc.error_type if isinstance(exc, ApiError) else ERROR_TYPES.get(status, exc.error_type)
    return {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": status}}


# -- request bodies -----------------------------------------------------------------


M = TypeVar("M", bound=BaseModel)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Generate(_Lenient):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    request_id: str | None = None
    cache_salt: Any = None
    """Prefix-cache partition (checked by :func:`gateway.emulator.lora.check_cache_salt`)."""
    kv_transfer_params: Any = None
    """P/D (vLLM NIXL): checked by :func:`gateway.emulator.pd.parse_leg`."""


class CompletionRequest(_Generate):
    """``POST /v1/completions`` (vLLM's default ``max_tokens`` is 16)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16


class ChatRequest(_Generate):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(_Lenient):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Lenient):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[M]) -> M:
    """Validate a JSON body, raising a 400 :class:`ApiError` as vLLM does."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        fields: dict[str, str] = {}
        for e in errors:  # one message per top-level field (unions report every branch)
            fields.setdefault(str(e["loc"][0]) if e["loc"] else "body", e["msg"])
        text = "; ".join(f"{name}: {msg}" for name, msg in fields.items())
        param = next(iter(fields), None)
        raise ApiError(f"Invalid request: {text}", param=param) from None


def request_id(header: str | None, body_id: str | None) -> str:
    """The external request id: header ``X-Request-Id``, else body ``request_id``, else uuid."""
    return header or body_id or uuid.uuid4().hex


# -- responses ----------------------------------------------------------------------

Kind = Literal["completion", "chat"]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """vLLM's usage block (``prompt_tokens_details`` needs --enable-prompt-tokens-details
    on a real vLLM; the emulator always includes it)."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class ResponseShape:
    """Builds the response objects of one generation (ids, chunk and final bodies)."""

    def __init__(self, kind: Kind, rid: str, model: str) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def role_chunk(self) -> dict[str, Any]:
        """The first chat chunk: the assistant role and empty content."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self._head(self.chunk_object), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """A content chunk; the last one carries ``finish_reason``."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if finish_reason is not None or self.kind == "completion":
            choice["stop_reason"] = None
        return {**self._head(self.chunk_object), "choices": [choice]}

    def usage_chunk(self, usage_block: dict[str, Any]) -> dict[str, Any]:
        """The ``include_usage`` chunk: no choices, only usage."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage_block}

    def final(self, text: str, finish_reason: str, usage_block: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming response body."""
        if self.kind == "completion":
            choice: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            return {
                **self._head("text_completion"),
                "choices": [choice],
                "usage": usage_block,
                "system_fingerprint": None,
                "kv_transfer_params": None,
            }
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return {
            **self._head("chat.completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage_block,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }

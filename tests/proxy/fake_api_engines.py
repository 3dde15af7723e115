"""Fake engines that also answer vLLM's other APIs: Responses (stored in the process),
Anthropic Messages, pooling, tokenize and audio (multipart)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fake_engines import FakeEngine


@dataclass
class FakeApiEngine(FakeEngine):
    """A :class:`FakeEngine` with Responses, Messages, pooling, tokenize and audio."""

    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    die_mid_stream: bool = False

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/health", "/v1/models", "/metrics") or self.mode == "refuse":
            return await super().handle(request)
        self.calls.append((request.method, path))
        self.headers.append(dict(request.headers))
        self.raw.append(request.content)
        if path.startswith("/v1/responses/"):
            return self._stored(request.method, path.removeprefix("/v1/responses/"))
        if path.startswith("/v1/audio/"):
            return httpx.Response(200, json={"text": f"heard by {self.url}"})
        body = json.loads(request.content)
        if body.get("model") not in (None, self.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if path == "/v1/responses":
            return self._responses(body)
        if path == "/v1/messages":
            return self._messages(body)
        if path == "/v1/messages/count_tokens":
            return httpx.Response(200, json={"input_tokens": 7})
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.raw.pop()
            self.headers.pop()
            self.calls.pop()
            return await super().handle(request)
        return httpx.Response(200, json={"object": "list", "engine": self.url, "path": path})

    def _stored(self, method: str, rest: str) -> httpx.Response:
        response_id, _, action = rest.partition("/")
        found = self.stored.get(response_id)
        if found is None:
            return _error(404, f"Response with id '{response_id}' not found.")
        if method == "DELETE":
            del self.stored[response_id]
            return httpx.Response(200, json={"id": response_id, "deleted": True})
        if action == "cancel":
            return _error(400, "Cannot cancel a synchronous response.")
        return httpx.Response(200, json=found)

    def _responses(self, body: dict[str, Any]) -> httpx.Response:
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return _error(404, f"Response with id '{previous}' not found.")
        response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "status": "completed",
            "model": self.model,
            "engine": self.url,
            "previous_response_id": previous,
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": f"hi from {self.url}"}],
                }
            ],
            "usage": {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9},
        }
        if body.get("store", True):
            self.stored[str(response["id"])] = response
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=self._response_events(response),
            )
        return httpx.Response(200, json=response)

    async def _response_events(self, response: dict[str, Any]) -> AsyncIterator[bytes]:
        created = {**response, "status": "in_progress", "output": [], "usage": None}
        yield _event("response.created", {"type": "response.created", "response": created})
        yield _event("response.output_text.delta", {"type": "response.output_text.delta"})
        if self.die_mid_stream:
            raise httpx.ReadError("engine died")
        yield _event("response.completed", {"type": "response.completed", "response": response})

    def _messages(self, body: dict[str, Any]) -> httpx.Response:
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": f"hi from {self.url}"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 6},
        }
        if body.get("stream"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=self._message_events()
            )
        return httpx.Response(200, json=message)

    async def _message_events(self) -> AsyncIterator[bytes]:
        start = {"type": "message_start", "message": {"usage": {"output_tokens": 1}}}
        yield _event("message_start", start)
        if self.die_mid_stream:
            raise httpx.ReadError("engine died")
        yield _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": 6}})
        yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _error(code: int, message: str) -> httpx.Response:
    body = {"error": {"message": message, "type": "X", "param": None, "code": code}}
    return httpx.Response(code, json=body)

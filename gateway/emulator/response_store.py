"""Stored Responses (``POST /v1/responses`` with ``store``), kept in this process only.

vLLM keeps a stored response, and the chat messages it was computed from, in the API
server process that created it: a ``previous_response_id`` or ``GET
/v1/responses/{id}`` sent to another process (another engine) is answered 404. The
emulator does the same. The store holds at most ``capacity`` responses
(``--responses-store-size``, default :data:`DEFAULT_CAPACITY`); past it the oldest is
dropped (vLLM's own store is unbounded).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024


@dataclass(slots=True)
class StoredResponse:
    """A response object (vLLM's JSON) and the chat messages of its prompt."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    engine_request: str | None = None
    """The engine request id while it runs (cancel aborts it), else None."""


class ResponseStore:
    """Response id -> :class:`StoredResponse`, oldest dropped past ``capacity``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"the responses store needs room for one, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.tasks: set[asyncio.Task[None]] = set()
        """Background responses still running (held so the loop keeps them)."""

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

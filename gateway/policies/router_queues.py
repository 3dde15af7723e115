"""Router-side queues: requests the router holds until their engine can take them.

One priority queue per engine: the longest expected cache hit first, then
first come first served. Bounded in total and per engine; a full queue
refuses (the gateway answers 429 with ``Retry-After``). Entries can move to
another engine's queue (hotspot rebalancing) or leave (client gone).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.core.types import EngineId, RequestInfo


@dataclass(slots=True, eq=False)
class QueuedRequest:
    """A held request: where it waits, its expected hit there, and the driver's handle."""

    req: RequestInfo
    engine: EngineId
    hit_tokens: int
    enqueued: float
    seq: int
    candidates: tuple[EngineId, ...] = ()
    handle: object = None
    migrations: int = 0
    live: bool = field(default=True, repr=False)

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.req.prompt_tokens - self.hit_tokens)


class QueueFullError(Exception):
    """The router's queues are full; the client should retry later."""


class RouterQueues:
    """Per-engine priority queues with a total bound."""

    def __init__(self, *, max_total: int = 10_000, max_per_engine: int = 2_000) -> None:
        self.max_total = max_total
        self.max_per_engine = max_per_engine
        self._heaps: dict[EngineId, list[tuple[int, int, int, QueuedRequest]]] = {}
        self._entries = 0  # unique per heap entry: a moved request keeps its seq
        self._by_id: dict[str, QueuedRequest] = {}
        self._count: dict[EngineId, int] = {}
        self._tokens: dict[EngineId, int] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> QueuedRequest | None:
        return self._by_id.get(request_id)

    def count(self, engine: EngineId) -> int:
        return self._count.get(engine, 0)

    def tokens(self, engine: EngineId) -> int:
        """Uncached prompt tokens waiting in ``engine``'s queue."""
        return self._tokens.get(engine, 0)

    def engines(self) -> list[EngineId]:
        return [e for e, n in self._count.items() if n]

    def push(
        self,
        req: RequestInfo,
        engine: EngineId,
        hit_tokens: int,
        now: float,
        *,
        candidates: tuple[EngineId, ...] = (),
        handle: object = None,
    ) -> QueuedRequest:
        """Hold ``req`` for ``engine``; raises :class:`QueueFullError` when full."""
        if req.id in self._by_id:
            raise ValueError(f"request {req.id} is already queued")
        if len(self._by_id) >= self.max_total or self.count(engine) >= self.max_per_engine:
            raise QueueFullError(f"router queue full ({len(self._by_id)} requests held)")
        self._seq += 1
        item = QueuedRequest(req, engine, hit_tokens, now, self._seq, candidates, handle)
        self._add(item)
        return item

    def peek(self, engine: EngineId) -> QueuedRequest | None:
        heap = self._heaps.get(engine)
        while heap and not heap[0][3].live:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self, engine: EngineId) -> QueuedRequest | None:
        """The next request for ``engine``: longest hit first, then oldest."""
        item = self.peek(engine)
        if item is not None:
            self._drop(item)
        return item

    def remove(self, request_id: str) -> QueuedRequest | None:
        item = self._by_id.get(request_id)
        if item is not None:
            self._drop(item)
        return item

    def move(self, request_id: str, engine: EngineId, hit_tokens: int) -> QueuedRequest | None:
        """Move a held request to ``engine``'s queue, keeping its place in time."""
        item = self._by_id.get(request_id)
        if item is None or item.engine == engine:
            return item
        self._drop(item)
        moved = QueuedRequest(
            item.req,
            engine,
            hit_tokens,
            item.enqueued,
            item.seq,
            item.candidates,
            item.handle,
            item.migrations + 1,
        )
        self._add(moved)
        return moved

    def items(self, engine: EngineId) -> Iterator[QueuedRequest]:
        """``engine``'s held requests in dispatch order (a snapshot)."""
        heap = self._heaps.get(engine, [])
        return iter(sorted((x[3] for x in heap if x[3].live), key=lambda q: (-q.hit_tokens, q.seq)))

    def oldest(self, engine: EngineId) -> float | None:
        """Enqueue time of ``engine``'s oldest held request."""
        heap = self._heaps.get(engine, [])
        times = [x[3].enqueued for x in heap if x[3].live]
        return min(times) if times else None

    def _add(self, item: QueuedRequest) -> None:
        self._entries += 1
        heapq.heappush(
            self._heaps.setdefault(item.engine, []),
            (-item.hit_tokens, item.seq, self._entries, item),
        )
        self._by_id[item.req.id] = item
        self._count[item.engine] = self._count.get(item.engine, 0) + 1
        self._tokens[item.engine] = self._tokens.get(item.engine, 0) + item.uncached_tokens

    def _drop(self, item: QueuedRequest) -> None:
        item.live = False
        del self._by_id[item.req.id]
        self._count[item.engine] -= 1
        self._tokens[item.engine] -= item.uncached_tokens
        heap = self._heaps.get(item.engine)
        if heap is not None and len(heap) > 2 * self._count[item.engine] + 16:
            self._heaps[item.engine] = [x for x in heap if x[3].live]
            heapq.heapify(self._heaps[item.engine])

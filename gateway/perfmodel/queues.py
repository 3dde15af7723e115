"""Waiting queues of the engine model: vLLM's FCFS and Preble's priority groups."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.perfmodel.request import EngineRequest

PRIORITY_GROUPS = 10
"""Preble's P: the number of cache-hit-ratio groups."""


class WaitQueue(Protocol):
    """The order in which an engine admits waiting requests."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[EngineRequest]: ...
    def push(self, req: EngineRequest) -> None: ...
    def push_front(self, req: EngineRequest) -> None: ...
    def remove(self, req: EngineRequest) -> bool: ...
    def begin_step(self) -> None: ...
    def skip_steps(self, steps: int) -> None: ...
    def peek(self) -> EngineRequest | None: ...
    def take(self) -> EngineRequest: ...


class FcfsQueue:
    """First come, first served (vLLM's default scheduling policy)."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._q)

    def push(self, req: EngineRequest) -> None:
        self._q.append(req)

    def push_front(self, req: EngineRequest) -> None:
        self._q.appendleft(req)

    def remove(self, req: EngineRequest) -> bool:
        try:
            self._q.remove(req)
        except ValueError:
            return False
        return True

    def begin_step(self) -> None:
        return None

    def skip_steps(self, steps: int) -> None:
        return None

    def peek(self) -> EngineRequest | None:
        return self._q[0] if self._q else None

    def take(self) -> EngineRequest:
        return self._q.popleft()


def priority_group(hit_ratio: float, groups: int = PRIORITY_GROUPS) -> int:
    """Preble's group of a request: ``ceil(P * hit_ratio) - 1``, clamped to ``[0, P-1]``."""
    g = math.ceil(groups * hit_ratio) - 1
    return min(max(g, 0), groups - 1)


class PriorityGroupQueue:
    """Preble's local scheduler: groups by cache-hit ratio, visited round-robin.

    Each step visits the groups in turn starting from a rotating group; group
    ``g`` may admit up to ``(g + 1) * 10`` requests per step, FCFS inside it.
    Higher hit ratios thus get more admissions without starving low ones.
    """

    __slots__ = ("_groups", "_len", "_order", "_pos", "_quota", "_start")

    def __init__(self, groups: int = PRIORITY_GROUPS) -> None:
        self._groups: list[deque[EngineRequest]] = [deque() for _ in range(groups)]
        self._len = 0
        self._start = groups - 1
        self._order: list[int] = []
        self._pos = 0
        self._quota = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[EngineRequest]:
        for group in reversed(self._groups):
            yield from group

    def push(self, req: EngineRequest) -> None:
        self._groups[priority_group(req.hit_ratio, len(self._groups))].append(req)
        self._len += 1

    def push_front(self, req: EngineRequest) -> None:
        self._groups[priority_group(req.hit_ratio, len(self._groups))].appendleft(req)
        self._len += 1

    def remove(self, req: EngineRequest) -> bool:
        for group in self._groups:
            try:
                group.remove(req)
            except ValueError:
                continue
            self._len -= 1
            return True
        return False

    def begin_step(self) -> None:
        n = len(self._groups)
        self._order = [(self._start - i) % n for i in range(n)]
        self._start = (self._start - 1) % n
        self._pos = 0
        self._quota = (self._order[0] + 1) * 10

    def skip_steps(self, steps: int) -> None:
        """Account for steps that admitted nothing (a decode run), as if each had begun."""
        self._start = (self._start - steps) % len(self._groups)

    def peek(self) -> EngineRequest | None:
        if not self._order:
            self.begin_step()
        while self._pos < len(self._order):
            group = self._groups[self._order[self._pos]]
            if group and self._quota > 0:
                return group[0]
            self._pos += 1
            if self._pos < len(self._order):
                self._quota = (self._order[self._pos] + 1) * 10
        return None

    def take(self) -> EngineRequest:
        req = self._groups[self._order[self._pos]].popleft()
        self._quota -= 1
        self._len -= 1
        return req


class PrefixCounts(dict[int, int]):
    """Block hashes with a count each: the prompt blocks of the requests an engine has
    queued or still prefilling (at most their blocks)."""

    __slots__ = ()

    def add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self[h] = self.get(h, 0) + 1

    def drop(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            count = self[h] - 1
            if count:
                self[h] = count
            else:
                del self[h]

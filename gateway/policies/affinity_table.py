"""A bounded key -> engine table whose entries expire: session bindings, stored responses.

Pure: the caller passes ``now``. Entries live ``ttl_s`` after their last
:meth:`AffinityTable.put` (or :meth:`AffinityTable.touch`); past ``max_entries``
the least recently written entry is dropped first, so memory is bounded by
``max_entries`` keys whatever the traffic. Lookups of an expired entry drop it.
An entry may carry a small payload (a tuple of ints the caller keeps with the binding:
session affinity's prefix checkpoints), read back with :meth:`AffinityTable.entry`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from gateway.core.types import EngineId

Payload = tuple[int, ...]
"""What an entry may carry besides its engine (a few ints)."""


class AffinityTable:
    """key -> (engine, expiry), LRU-bounded and TTL-expired."""

    __slots__ = ("_entries", "max_entries", "ttl_s")

    def __init__(self, *, ttl_s: float, max_entries: int) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[EngineId, float, Payload | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        key: str,
        engine: EngineId,
        now: float,
        *,
        ttl_s: float | None = None,
        payload: Payload | None = None,
    ) -> None:
        """Bind ``key`` to ``engine`` until ``now + ttl`` (replacing any older binding)."""
        entries = self._entries
        entries[key] = (engine, now + (self.ttl_s if ttl_s is None else ttl_s), payload)
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get(self, key: str, now: float) -> EngineId | None:
        """The engine bound to ``key``, or None (never bound, expired or evicted)."""
        found = self.entry(key, now)
        return None if found is None else found[0]

    def entry(self, key: str, now: float) -> tuple[EngineId, Payload | None] | None:
        """(engine, payload) bound to ``key``, or None (never bound, expired or evicted)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._entries[key]
            return None
        return entry[0], entry[2]

    def expires(self, key: str) -> float | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def touch(self, key: str, now: float) -> None:
        """Extend a live binding's lifetime by one TTL from ``now``."""
        found = self.entry(key, now)
        if found is not None:
            self.put(key, found[0], now, payload=found[1])

    def pop(self, key: str) -> EngineId | None:
        entry = self._entries.pop(key, None)
        return None if entry is None else entry[0]

    def drop_engine(self, engine: EngineId) -> int:
        """Forget every binding to ``engine`` (removed from the fleet); how many went."""
        gone = [k for k, (e, _, _) in self._entries.items() if e == engine]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def items(self, now: float) -> Iterator[tuple[str, EngineId, float]]:
        """Live bindings as (key, engine, expiry), oldest write first."""
        for key, (engine, expiry, _) in list(self._entries.items()):
            if expiry > now:
                yield key, engine, expiry

"""An engine's KV block pool with a prefix cache of whole blocks, as vLLM keeps it.

The pool has ``capacity`` blocks. A block is in one of four states:

* free: never used, or freed without a hash (partial and output blocks);
* referenced and hashed: a full prompt block some running request holds;
* referenced and anonymous: a partial block, an output block, or a duplicate;
* cached and evictable: a hashed block no request holds. Evictable blocks
  stay reusable until evicted, least recently freed first (vLLM frees a
  request's blocks tail first, so tails are evicted before heads).

Only counts and hashes are tracked, never token contents. The pool records
``stored`` and ``removed`` hashes when ``track_events`` is on (the source of
``on_cache_event`` hooks, like vLLM's KV events).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence


class BlockPool:
    """Block accounting and the prefix cache. Invariant: used + evictable <= capacity."""

    __slots__ = ("_anon", "_evictable", "_ref", "capacity", "removed", "stored", "track_events")

    def __init__(self, capacity: int, *, track_events: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._ref: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._anon = 0
        self.track_events = track_events
        self.stored: list[int] = []
        self.removed: list[int] = []

    # -- queries -----------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks held by running requests (hashed or not)."""
        return len(self._ref) + self._anon

    @property
    def cached(self) -> int:
        """Hashed blocks in the pool, held or evictable."""
        return len(self._ref) + len(self._evictable)

    @property
    def evictable(self) -> int:
        return len(self._evictable)

    @property
    def free(self) -> int:
        """Blocks holding nothing at all."""
        return self.capacity - len(self._ref) - len(self._evictable) - self._anon

    @property
    def available(self) -> int:
        """Blocks an allocation can get now (free plus evictable)."""
        return self.capacity - len(self._ref) - self._anon

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: held blocks over capacity (evictable count as free)."""
        return self.used / self.capacity

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._ref or block_hash in self._evictable

    def match(
        self, hashes: Sequence[int], limit: int | None = None, also: Container[int] = ()
    ) -> int:
        """How many leading ``hashes`` are cached, or in ``also`` (at most ``limit``)."""
        ref, ev = self._ref, self._evictable
        n = len(hashes) if limit is None else min(limit, len(hashes))
        for i in range(n):
            h = hashes[i]
            if h not in ref and h not in ev and h not in also:
                return i
        return n

    def count_evictable(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` are cached but held by no request."""
        ev = self._evictable
        return sum(1 for h in hashes if h in ev)

    # -- mutations -----------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Take references on cached blocks (a prefix-cache hit). All must be cached."""
        ref, ev = self._ref, self._evictable
        for h in hashes:
            count = ref.get(h)
            if count is None:
                del ev[h]
                ref[h] = 1
            else:
                ref[h] = count + 1

    def allocate(self, n: int) -> bool:
        """Allocate ``n`` anonymous blocks, evicting LRU cached blocks if needed."""
        if n <= 0:
            return True
        if n > self.available:
            return False
        shortfall = n - self.free
        if shortfall > 0:
            ev = self._evictable
            if self.track_events:
                removed = self.removed
                for _ in range(shortfall):
                    removed.append(ev.popitem(last=False)[0])
            else:
                for _ in range(shortfall):
                    ev.popitem(last=False)
        self._anon += n
        return True

    def register(self, block_hash: int) -> bool:
        """Turn one held anonymous block into the cached block ``block_hash``.

        Returns False (the block stays anonymous) when that hash is already
        cached: the request computed a duplicate, which vLLM does not cache.
        """
        if block_hash in self._ref or block_hash in self._evictable:
            return False
        if self._anon <= 0:
            raise RuntimeError("register() needs a held anonymous block")
        self._anon -= 1
        self._ref[block_hash] = 1
        if self.track_events:
            self.stored.append(block_hash)
        return True

    def register_many(self, hashes: Sequence[int], held: list[int]) -> int:
        """:meth:`register` each of ``hashes``; appends the cached ones to ``held``.

        Returns how many were cached (each consumed one held anonymous block).
        """
        ref, ev = self._ref, self._evictable
        before = len(held)
        for h in hashes:
            if h not in ref and h not in ev:
                ref[h] = 1
                held.append(h)
        n = len(held) - before
        if n > self._anon:
            raise RuntimeError("register_many() needs a held anonymous block per new hash")
        self._anon -= n
        if self.track_events and n:
            self.stored.extend(held[before:])
        return n

    def release(self, hashes: Sequence[int], anon: int) -> None:
        """Drop a request's references: hashed blocks become evictable, tail first."""
        ref, ev = self._ref, self._evictable
        for h in reversed(hashes):
            count = ref[h] - 1
            if count:
                ref[h] = count
            else:
                del ref[h]
                ev[h] = None
        if anon > self._anon:
            raise RuntimeError("release() of more anonymous blocks than held")
        self._anon -= anon

    def drain_events(self) -> tuple[list[int], list[int]]:
        """Hashes stored and removed since the last call."""
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def clear(self) -> list[int]:
        """Drop every evictable block (a prefix-cache reset); returns their hashes."""
        dropped = list(self._evictable)
        self._evictable.clear()
        if self.track_events:
            self.removed.extend(dropped)
        return dropped

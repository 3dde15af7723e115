"""Consistent hash rings with virtual nodes, in two independent hash families.

Each engine owns ``vnodes`` points on the ring, at hashes of its id; a key
belongs to the first point clockwise from the key's hash. Adding or removing
an engine moves only the keys between its points and their predecessors:
about 1/n of all keys. Positions depend only on engine ids, so every gateway
replica given the same engines builds the same ring, in any order.

Two rings with different seeds give two independent candidates per key
(DualMap); :meth:`HashRing.lookup` can skip engines, which gives the next
distinct engine clockwise when both rings agree.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import xxhash

_MASK = (1 << 64) - 1


class HashRing:
    """One ring: sorted points, each owned by an engine."""

    def __init__(self, *, seed: int = 0, vnodes: int = 100) -> None:
        if vnodes <= 0:
            raise ValueError("vnodes must be positive")
        self.seed = seed
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._engines: set[str] = set()

    def __len__(self) -> int:
        return len(self._engines)

    def __contains__(self, engine: object) -> bool:
        return engine in self._engines

    @property
    def engines(self) -> list[str]:
        return sorted(self._engines)

    def key_hash(self, key: int) -> int:
        return xxhash.xxh3_64_intdigest((key & _MASK).to_bytes(8, "little"), seed=self.seed)

    def _point(self, engine: str, i: int) -> int:
        return xxhash.xxh3_64_intdigest(f"{engine}#{i}".encode(), seed=self.seed)

    def set_engines(self, engines: Iterable[str]) -> None:
        """Make the ring hold exactly ``engines`` (adding and removing as needed)."""
        wanted = set(engines)
        for engine in sorted(self._engines - wanted):
            self.remove(engine)
        for engine in sorted(wanted - self._engines):
            self.add(engine)

    def add(self, engine: str) -> None:
        if engine in self._engines:
            return
        self._engines.add(engine)
        for i in range(self.vnodes):
            p = self._point(engine, i)
            at = bisect.bisect_left(self._points, p)
            # equal points (astronomically rare) are ordered by engine id for determinism
            while at < len(self._points) and self._points[at] == p and self._owners[at] < engine:
                at += 1
            self._points.insert(at, p)
            self._owners.insert(at, engine)

    def remove(self, engine: str) -> None:
        if engine not in self._engines:
            return
        self._engines.discard(engine)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != engine]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def lookup(self, key: int, skip: Iterable[str] = ()) -> str | None:
        """The engine owning ``key``; with ``skip``, the first other engine clockwise."""
        if not self._points:
            return None
        skipped = set(skip)
        start = bisect.bisect_right(self._points, self.key_hash(key))
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in skipped:
                return owner
        return None

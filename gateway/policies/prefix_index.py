"""An approximate, bounded index of which engine has seen which prompt blocks.

Router-side prefix state as SGLang/SMG's approximate tree and llm-d's
approximate prefix producer keep it: after routing a request to an engine,
its chained block hashes are recorded for that engine. Because hashes are
chained, a set of hashes per engine *is* a prefix tree: the engine has seen a
prompt's first ``k`` blocks exactly when it has seen hash ``k - 1`` and its
ancestors.

Memory is bounded: each engine keeps at most ``max_blocks`` hashes and
forgets the least recently used first. A prompt's blocks are touched tail
first, so a prefix's root outlives its leaves (as vLLM evicts tails first).
Matching is one dict lookup per prompt block whatever the number of engines:
each hash maps to a bitmask of the engines holding it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from gateway.core.types import EngineId


class PrefixIndex:
    """Per-engine LRU sets of chained block hashes, matched with one pass."""

    __slots__ = ("_bits", "_free_bits", "_lru", "_names", "_owners", "max_blocks")

    def __init__(self, max_blocks: int = 262_144) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._bits: dict[EngineId, int] = {}
        self._names: dict[int, EngineId] = {}
        self._free_bits: list[int] = []
        self._lru: dict[EngineId, OrderedDict[int, None]] = {}
        self._owners: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct hashes held for any engine."""
        return len(self._owners)

    def size(self, engine: EngineId) -> int:
        """Blocks recorded for ``engine``."""
        lru = self._lru.get(engine)
        return 0 if lru is None else len(lru)

    def blocks(self, engine: EngineId) -> frozenset[int]:
        """The hashes recorded for ``engine``."""
        lru = self._lru.get(engine)
        return frozenset() if lru is None else frozenset(lru)

    @property
    def engines(self) -> tuple[EngineId, ...]:
        return tuple(self._bits)

    def match(self, hashes: Sequence[int]) -> dict[EngineId, int]:
        """Leading blocks of ``hashes`` recorded per engine (engines with none are absent)."""
        if not hashes or not self._bits:
            return {}
        owners = self._owners
        names = self._names
        cur = owners.get(hashes[0], 0)
        if not cur:
            return {}
        out: dict[EngineId, int] = {}
        for i in range(1, len(hashes)):
            m = owners.get(hashes[i], 0) & cur
            if m != cur:
                dropped = cur & ~m
                while dropped:
                    low = dropped & -dropped
                    out[names[low.bit_length() - 1]] = i
                    dropped ^= low
                cur = m
                if not cur:
                    return out
        while cur:
            low = cur & -cur
            out[names[low.bit_length() - 1]] = len(hashes)
            cur ^= low
        return out

    def insert(
        self, engine: EngineId, hashes: Sequence[int], max_blocks: int | None = None
    ) -> None:
        """Record that ``engine`` now holds ``hashes`` (touching them as most recent)."""
        bit = self._bit_for(engine)
        cap = self.max_blocks if max_blocks is None else max(1, min(max_blocks, self.max_blocks))
        lru = self._lru[engine]
        owners = self._owners
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                owners[h] = owners.get(h, 0) | bit
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop_owner(old, bit)

    def remove(self, engine: EngineId, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` for ``engine`` (it evicted them)."""
        bit = self._bits.get(engine)
        if bit is None:
            return
        lru = self._lru[engine]
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._drop_owner(h, bit)

    def remove_engine(self, engine: EngineId) -> None:
        """Forget everything about ``engine`` and free its bit."""
        bit = self._bits.pop(engine, None)
        if bit is None:
            return
        for h in self._lru.pop(engine):
            self._drop_owner(h, bit)
        index = bit.bit_length() - 1
        del self._names[index]
        self._free_bits.append(index)

    def _bit_for(self, engine: EngineId) -> int:
        bit = self._bits.get(engine)
        if bit is None:
            index = self._free_bits.pop() if self._free_bits else len(self._bits)
            bit = 1 << index
            self._bits[engine] = bit
            self._names[index] = engine
            self._lru[engine] = OrderedDict()
        return bit

    def _drop_owner(self, h: int, bit: int) -> None:
        m = self._owners.get(h, 0) & ~bit
        if m:
            self._owners[h] = m
        else:
            self._owners.pop(h, None)

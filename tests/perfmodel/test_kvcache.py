"""BlockPool: block accounting, the prefix cache of whole blocks and LRU eviction."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.perfmodel.kvcache import BlockPool

HASHES = st.integers(0, 11)


@dataclass
class _Req:
    held: list[int] = field(default_factory=list)
    anon: int = 0


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / register / acquire / release / match against a plain model.

    The model keeps reference counts and an explicit LRU list of evictable
    hashes; evictions are observed through the pool's ``removed`` events.
    """

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.pool: BlockPool | None = None
        self.ref: dict[int, int] = {}
        self.lru: list[int] = []  # evictable hashes, least recently released first
        self.anon = 0
        self.reqs: list[_Req] = []

    # -- setup ---------------------------------------------------------------
    @precondition(lambda self: self.pool is None)
    @rule(capacity=st.integers(1, 12))
    def create(self, capacity: int) -> None:
        self.capacity = capacity
        self.pool = BlockPool(capacity, track_events=True)

    def _p(self) -> BlockPool:
        assert self.pool is not None
        return self.pool

    # -- rules ---------------------------------------------------------------
    @precondition(lambda self: self.pool is not None)
    @rule(n=st.integers(0, 8))
    def allocate(self, n: int) -> None:
        pool = self._p()
        available = self.capacity - len(self.ref) - self.anon
        free = available - len(self.lru)
        ok = pool.allocate(n)
        assert ok == (n <= available)
        stored, removed = pool.drain_events()
        assert stored == []
        if not ok:
            assert removed == []
            return
        shortfall = max(0, n - free)
        # Only as many evictions as needed, least recently released first.
        assert removed == self.lru[:shortfall]
        del self.lru[:shortfall]
        self.anon += n
        self.reqs.append(_Req(anon=n))

    @precondition(lambda self: any(r.anon > 0 for r in self.reqs))
    @rule(data=st.data(), h=HASHES)
    def register(self, data: st.DataObject, h: int) -> None:
        pool = self._p()
        candidates = [r for r in self.reqs if r.anon > 0]
        req = data.draw(st.sampled_from(candidates), label="req")
        expected = h not in self.ref and h not in self.lru
        used_before = pool.used
        assert pool.register(h) == expected
        stored, removed = pool.drain_events()
        assert removed == []
        assert pool.used == used_before  # a block changes state, never count
        if expected:
            assert stored == [h]
            req.held.append(h)
            req.anon -= 1
            self.anon -= 1
            self.ref[h] = 1
        else:
            assert stored == []

    @precondition(lambda self: self.reqs and (self.ref or self.lru))
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        pool = self._p()
        req = data.draw(st.sampled_from(self.reqs), label="req")
        cached = sorted(set(self.ref) | set(self.lru))
        hs = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3), label="hashes")
        pool.acquire(hs)
        for h in hs:
            if h in self.lru:
                self.lru.remove(h)
                self.ref[h] = 1
            else:
                self.ref[h] += 1
        req.held.extend(hs)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pool = self._p()
        i = data.draw(st.integers(0, len(self.reqs) - 1), label="req")
        req = self.reqs.pop(i)
        pool.release(req.held, req.anon)
        for h in reversed(req.held):  # tail first
            self.ref[h] -= 1
            if self.ref[h] == 0:
                del self.ref[h]
                self.lru.append(h)
        self.anon -= req.anon

    @precondition(lambda self: self.pool is not None)
    @rule(hs=st.lists(HASHES, max_size=6), limit=st.none() | st.integers(0, 6))
    def match(self, hs: list[int], limit: int | None) -> None:
        pool = self._p()
        cached = set(self.ref) | set(self.lru)
        n = len(hs) if limit is None else min(limit, len(hs))
        expected = 0
        while expected < n and hs[expected] in cached:
            expected += 1
        assert pool.match(hs, limit) == expected
        assert pool.count_evictable(hs) == sum(1 for h in hs if h in self.lru)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def clear(self) -> None:
        pool = self._p()
        assert pool.clear() == self.lru
        _, removed = pool.drain_events()
        assert removed == self.lru
        self.lru = []

    # -- invariants ----------------------------------------------------------
    @invariant()
    def accounting(self) -> None:
        if self.pool is None:
            return
        pool = self.pool
        assert pool.used + pool.evictable <= pool.capacity
        assert pool.free >= 0
        assert pool.available == pool.capacity - pool.used
        assert pool.used == len(self.ref) + self.anon
        assert set(self.ref) == {h for r in self.reqs for h in r.held}
        assert self.anon == sum(r.anon for r in self.reqs)
        for h, count in self.ref.items():
            assert count == sum(r.held.count(h) for r in self.reqs)
        assert pool.evictable == len(self.lru)
        assert pool.cached == len(self.ref) + len(self.lru)
        assert pool.free == self.capacity - pool.used - pool.evictable
        assert pool.usage == pytest.approx(pool.used / pool.capacity)
        for h in range(12):
            assert pool.contains(h) == (h in self.ref or h in self.lru)


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestPoolMachine = PoolMachine.TestCase


# --------------------------------------------------------------------------- unit tests


def _hold(pool: BlockPool, hashes: list[int]) -> list[int]:
    """Allocate and register ``hashes`` as one request's computed prompt blocks."""
    assert pool.allocate(len(hashes))
    for h in hashes:
        assert pool.register(h)
    return hashes


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(-3)


def test_lru_evicts_least_recently_released_first_tail_before_head() -> None:
    pool = BlockPool(6, track_events=True)
    a = _hold(pool, [1, 2, 3])
    b = _hold(pool, [4, 5, 6])
    pool.release(b, 0)  # b first: b's blocks are older than a's
    pool.release(a, 0)
    assert pool.evictable == 6 and pool.used == 0 and pool.free == 0
    pool.drain_events()
    order = []
    for _ in range(6):
        assert pool.allocate(1)
        order.extend(pool.drain_events()[1])
    assert order == [6, 5, 4, 3, 2, 1]
    assert not pool.allocate(1)
    assert pool.used == 6 and pool.evictable == 0


def test_partial_eviction_keeps_heads_cached() -> None:
    pool = BlockPool(4)
    req = _hold(pool, [10, 11, 12, 13])
    pool.release(req, 0)
    assert pool.allocate(2)  # evicts the two tail blocks
    assert pool.match([10, 11, 12, 13]) == 2
    assert [pool.contains(h) for h in (10, 11, 12, 13)] == [True, True, False, False]


def test_allocate_uses_free_blocks_before_evicting() -> None:
    pool = BlockPool(5, track_events=True)
    req = _hold(pool, [1, 2])
    pool.release(req, 0)
    pool.drain_events()
    assert pool.free == 3
    assert pool.allocate(3)
    assert pool.drain_events()[1] == []
    assert pool.evictable == 2
    assert pool.allocate(1)
    assert pool.drain_events()[1] == [2]


def test_acquire_protects_from_eviction_and_refreshes_recency() -> None:
    pool = BlockPool(4, track_events=True)
    req = _hold(pool, [1, 2, 3, 4])
    pool.release(req, 0)
    pool.drain_events()
    pool.acquire([4])  # the LRU block is now held
    assert pool.used == 1 and pool.evictable == 3 and pool.available == 3
    assert not pool.allocate(4)
    assert pool.allocate(3)
    assert sorted(pool.drain_events()[1]) == [1, 2, 3]
    assert pool.contains(4)
    # Once released again it is evictable, and the most recent.
    pool.release([4], 3)
    assert pool.evictable == 1 and pool.used == 0


def test_reacquired_block_becomes_most_recent_on_release() -> None:
    pool = BlockPool(3, track_events=True)
    pool.release(_hold(pool, [1, 2, 3]), 0)  # LRU order: 3, 2, 1
    pool.acquire([3])
    pool.release([3], 0)  # LRU order: 2, 1, 3
    pool.drain_events()
    assert pool.allocate(3)
    assert pool.drain_events()[1] == [2, 1, 3]


def test_shared_block_needs_every_reference_released() -> None:
    pool = BlockPool(4)
    _hold(pool, [1, 2])
    pool.acquire([1, 2])  # a second request hits both
    pool.release([1, 2], 0)
    assert pool.evictable == 0 and pool.used == 2
    pool.release([1, 2], 0)
    assert pool.evictable == 2 and pool.used == 0


def test_register_duplicate_returns_false_and_block_stays_anonymous() -> None:
    pool = BlockPool(4, track_events=True)
    _hold(pool, [7])
    assert pool.allocate(1)
    assert pool.register(7) is False  # held duplicate
    assert pool.used == 2 and pool.cached == 1
    pool.release([7], 1)
    assert pool.evictable == 1 and pool.used == 0
    assert pool.allocate(1)
    assert pool.register(7) is False  # evictable duplicate
    assert pool.evictable == 1 and pool.used == 1
    stored, _ = pool.drain_events()
    assert stored == [7]


def test_register_and_release_misuse_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.register(1)
    assert pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.release([], 2)


def test_allocate_failure_changes_nothing() -> None:
    pool = BlockPool(3, track_events=True)
    pool.release(_hold(pool, [1, 2]), 0)
    assert pool.allocate(1)
    pool.drain_events()
    assert not pool.allocate(3)
    assert pool.used == 1 and pool.evictable == 2
    assert pool.drain_events() == ([], [])
    assert pool.allocate(0) and pool.allocate(-1)
    assert pool.used == 1


def test_match_counts_leading_whole_blocks_only() -> None:
    pool = BlockPool(8)
    _hold(pool, [1, 3])
    assert pool.match([1, 2, 3]) == 1  # a hole stops the match
    assert pool.match([2, 1, 3]) == 0
    assert pool.match([1, 3, 5]) == 2
    assert pool.match([1, 3], limit=1) == 1
    assert pool.match([1, 3], limit=0) == 0
    assert pool.match([1, 3], limit=9) == 2
    assert pool.match([]) == 0


def test_clear_drops_only_evictable_blocks() -> None:
    pool = BlockPool(4, track_events=True)
    held = _hold(pool, [1, 2])
    pool.release(_hold(pool, [3, 4]), 0)
    pool.drain_events()
    assert pool.clear() == [4, 3]
    assert pool.drain_events()[1] == [4, 3]
    assert pool.contains(1) and not pool.contains(3)
    assert pool.free == 2 and pool.used == 2
    pool.release(held, 0)
    assert pool.evictable == 2

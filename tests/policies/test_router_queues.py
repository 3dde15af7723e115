"""Router-side queues: priority, bounds, moves, removal, and lazy deletion vs a reference model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.types import RequestInfo
from gateway.policies.router_queues import QueuedRequest, QueueFullError, RouterQueues


def req(rid: str, prompt: int = 100) -> RequestInfo:
    return RequestInfo(id=rid, block_hashes=(), prompt_tokens=prompt, arrival=0.0)


def ids(items: object) -> list[str]:
    return [q.req.id for q in items]  # type: ignore[attr-defined]


def drain(q: RouterQueues, engine: str) -> list[str]:
    out = []
    while (item := q.pop(engine)) is not None:
        out.append(item.req.id)
    return out


# -- priority --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pushes", "expected"),
    [
        # (id, hit tokens): the longest hit first
        ([("a", 0), ("b", 32), ("c", 16)], ["b", "c", "a"]),
        # equal hits: first come, first served
        ([("a", 16), ("b", 16), ("c", 16)], ["a", "b", "c"]),
        # mixed: FIFO within each hit level
        ([("a", 0), ("b", 48), ("c", 0), ("d", 48), ("e", 16)], ["b", "d", "e", "a", "c"]),
    ],
)
def test_pop_order_is_longest_hit_then_fifo(
    pushes: list[tuple[str, int]], expected: list[str]
) -> None:
    q = RouterQueues()
    for t, (rid, hit) in enumerate(pushes):
        q.push(req(rid), "e0", hit, float(t))
    assert ids(q.items("e0")) == expected  # items() is a snapshot in dispatch order
    assert q.peek("e0") is not None and q.peek("e0").req.id == expected[0]  # type: ignore[union-attr]
    assert len(q) == len(expected)  # peek does not remove
    assert drain(q, "e0") == expected
    assert q.pop("e0") is None and q.peek("e0") is None
    assert len(q) == 0


def test_fifo_follows_push_order_not_the_clock() -> None:
    """Ties break on the queue's sequence number, so equal timestamps stay ordered."""
    q = RouterQueues()
    for rid in "abc":
        q.push(req(rid), "e0", 0, 5.0)
    assert drain(q, "e0") == ["a", "b", "c"]


def test_queues_are_per_engine() -> None:
    q = RouterQueues()
    q.push(req("a"), "e0", 0, 0.0)
    q.push(req("b"), "e1", 99, 1.0)
    q.push(req("c"), "e0", 0, 2.0)
    assert sorted(q.engines()) == ["e0", "e1"]
    assert (q.count("e0"), q.count("e1"), q.count("e2")) == (2, 1, 0)
    assert drain(q, "e1") == ["b"]
    assert q.engines() == ["e0"]
    assert q.pop("e2") is None
    assert list(q.items("e2")) == [] and q.oldest("e2") is None


def test_entry_fields_and_accounting() -> None:
    q = RouterQueues()
    handle = object()
    item = q.push(req("a", prompt=100), "e0", 30, 1.5, candidates=("e0", "e1"), handle=handle)
    assert isinstance(item, QueuedRequest)
    assert (item.engine, item.hit_tokens, item.enqueued, item.migrations) == ("e0", 30, 1.5, 0)
    assert item.candidates == ("e0", "e1") and item.handle is handle
    assert item.uncached_tokens == 70
    assert "a" in q and q.get("a") is item
    assert "b" not in q and q.get("b") is None
    q.push(req("b", prompt=10), "e0", 50, 2.0)  # a hit longer than the prompt: 0 uncached
    assert q.tokens("e0") == 70
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("a"), "e1", 0, 3.0)
    assert len(q) == 2  # the duplicate changed nothing
    assert q.count("e1") == 0


# -- bounds ----------------------------------------------------------------------------------------
def test_total_bound() -> None:
    q = RouterQueues(max_total=3, max_per_engine=10)
    for i in range(3):
        q.push(req(f"r{i}"), f"e{i}", 0, 0.0)
    with pytest.raises(QueueFullError, match="full"):
        q.push(req("x"), "e9", 0, 0.0)
    assert len(q) == 3 and "x" not in q and q.count("e9") == 0
    q.pop("e0")  # room again
    q.push(req("x"), "e9", 0, 0.0)
    assert len(q) == 3


def test_per_engine_bound() -> None:
    q = RouterQueues(max_total=10, max_per_engine=2)
    q.push(req("a"), "e0", 0, 0.0)
    q.push(req("b"), "e0", 0, 0.0)
    with pytest.raises(QueueFullError):
        q.push(req("c"), "e0", 0, 0.0)
    q.push(req("c"), "e1", 0, 0.0)  # another engine still has room
    assert (q.count("e0"), q.count("e1"), q.tokens("e0")) == (2, 1, 200)
    q.remove("a")
    q.push(req("d"), "e0", 0, 0.0)
    assert q.count("e0") == 2


# -- move, remove, oldest --------------------------------------------------------------------------
def test_move_keeps_its_place_in_time_and_updates_accounting() -> None:
    q = RouterQueues()
    q.push(req("old", prompt=100), "e0", 0, 1.0)
    q.push(req("x", prompt=100), "e1", 0, 2.0)
    q.push(req("y", prompt=100), "e1", 0, 3.0)
    before = q.get("old")
    moved = q.move("old", "e1", 40)
    assert moved is not None and moved is q.get("old")
    assert (moved.engine, moved.hit_tokens, moved.enqueued) == ("e1", 40, 1.0)
    assert moved.seq == before.seq  # type: ignore[union-attr]
    assert moved.migrations == 1
    assert (q.count("e0"), q.tokens("e0")) == (0, 0)
    assert (q.count("e1"), q.tokens("e1")) == (3, 100 + 100 + 60)
    assert q.engines() == ["e1"]
    assert q.oldest("e1") == 1.0
    assert q.pop("e0") is None  # nothing left behind in the source heap
    # same hit as the others: it is the oldest, so it goes first
    q.move("old", "e1", 40)  # moving to its own queue is a no-op
    assert q.get("old").migrations == 1  # type: ignore[union-attr]
    q.move("old", "e0", 0)
    q.move("old", "e1", 0)
    assert q.get("old").migrations == 3  # type: ignore[union-attr]
    assert drain(q, "e1") == ["old", "x", "y"]
    assert q.move("gone", "e0", 0) is None


def test_remove_and_oldest() -> None:
    q = RouterQueues()
    for t, rid in enumerate("abcd"):
        q.push(req(rid), "e0", 16 * (t % 2), float(t))
    assert q.oldest("e0") == 0.0
    removed = q.remove("a")
    assert removed is not None and removed.req.id == "a"
    assert q.remove("a") is None
    assert q.oldest("e0") == 1.0
    assert (q.count("e0"), q.tokens("e0")) == (3, 100 + 84 + 84)
    assert ids(q.items("e0")) == ["b", "d", "c"]
    assert drain(q, "e0") == ["b", "d", "c"]


def test_heap_compaction_under_churn() -> None:
    """Many removals leave dead heap entries; results stay right and the heap stays small."""
    q = RouterQueues()
    for i in range(1000):
        q.push(req(f"r{i}"), "e0", i % 7, float(i))
    for i in range(1000):
        if i % 10:
            q.remove(f"r{i}")
    survivors = [f"r{i}" for i in range(0, 1000, 10)]
    assert q.count("e0") == 100
    assert len(q._heaps["e0"]) <= 2 * 100 + 16 + 1
    expected = sorted(survivors, key=lambda r: (-(int(r[1:]) % 7), int(r[1:])))
    assert ids(q.items("e0")) == expected
    assert drain(q, "e0") == expected


# -- against a reference model ---------------------------------------------------------------------
ENGINES = ["e0", "e1", "e2"]
op_st = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from(ENGINES),
        st.integers(0, 3).map(lambda h: 16 * h),
        st.integers(1, 80),
    ),
    st.tuples(st.just("pop"), st.sampled_from(ENGINES)),
    st.tuples(st.just("move"), st.integers(0, 40), st.sampled_from(ENGINES), st.integers(0, 3)),
    st.tuples(st.just("remove"), st.integers(0, 40)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=120), st.integers(1, 12), st.integers(1, 6))
def test_matches_a_reference_model(ops: list[tuple], max_total: int, max_per_engine: int) -> None:
    q = RouterQueues(max_total=max_total, max_per_engine=max_per_engine)
    # reference: id -> [engine, hit, enqueued, order, prompt, migrations]
    ref: dict[str, list] = {}
    order = 0
    pushed = 0
    for step, op in enumerate(ops):
        now = float(step)
        if op[0] == "push":
            _, engine, hit, prompt = op
            rid = f"r{pushed}"
            pushed += 1
            n_engine = sum(1 for v in ref.values() if v[0] == engine)
            if len(ref) >= max_total or n_engine >= max_per_engine:
                with pytest.raises(QueueFullError):
                    q.push(req(rid, prompt), engine, hit, now)
            else:
                order += 1
                q.push(req(rid, prompt), engine, hit, now)
                ref[rid] = [engine, hit, now, order, prompt, 0]
        elif op[0] == "pop":
            engine = op[1]
            mine = [(-v[1], v[3], rid) for rid, v in ref.items() if v[0] == engine]
            got = q.pop(engine)
            if not mine:
                assert got is None
            else:
                want = min(mine)[2]
                assert got is not None and got.req.id == want
                assert (got.enqueued, got.migrations) == (ref[want][2], ref[want][5])
                del ref[want]
        elif op[0] == "move":
            _, i, engine, h = op
            rid = f"r{i}"
            moved = q.move(rid, engine, 16 * h)
            if rid not in ref:
                assert moved is None
            elif ref[rid][0] != engine:
                ref[rid][0], ref[rid][1] = engine, 16 * h
                ref[rid][5] += 1
        else:
            rid = f"r{op[1]}"
            got = q.remove(rid)
            assert (got is not None) == (rid in ref)
            ref.pop(rid, None)
        # every observable agrees with the model after every step
        assert len(q) == len(ref)
        for engine in ENGINES:
            mine = {rid: v for rid, v in ref.items() if v[0] == engine}
            assert q.count(engine) == len(mine)
            assert q.tokens(engine) == sum(max(0, v[4] - v[1]) for v in mine.values())
            assert ids(q.items(engine)) == sorted(mine, key=lambda r: (-mine[r][1], mine[r][3]))
            assert q.oldest(engine) == (min(v[2] for v in mine.values()) if mine else None)
            assert (engine in q.engines()) == bool(mine)
    for engine in ENGINES:  # and draining gives the model's order
        mine = {rid: v for rid, v in ref.items() if v[0] == engine}
        assert drain(q, engine) == sorted(mine, key=lambda r: (-mine[r][1], mine[r][3]))
    assert len(q) == 0


def test_a_request_moved_back_and_forth_keeps_the_heap_ordered() -> None:
    """Regression: a moved request keeps its seq, so heap entries need their own tiebreak."""
    queues = RouterQueues()
    for i in range(3):
        queues.push(
            RequestInfo(id=f"r{i}", block_hashes=(), prompt_tokens=10, arrival=0.0), "a", 0, 0.0
        )
    queues.move("r1", "b", 0)
    queues.move("r1", "a", 0)  # a dead and a live entry with the same (hit, seq) in "a"
    assert [queues.pop("a").req.id for _ in range(3)] == ["r0", "r1", "r2"]  # type: ignore[union-attr]
    assert queues.pop("a") is None

"""The fair priority queue: priority order, fairness across tenants, bounds, nothing lost.

Property tests (hypothesis) over random sequences of offers, pops, cancels and expiries.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.queue import FairQueue, FlowItem

TENANTS = ("a", "b", "c")


def item(i: int, tenant: str, priority: int, cost: float = 1.0, deadline: float = 1e9) -> FlowItem:
    return FlowItem(f"r{i}", tenant, priority, cost, float(i), deadline)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"),
            st.sampled_from(TENANTS),
            st.integers(-1, 2),
            st.integers(1, 50),
            st.integers(1, 40),
        ),
        st.tuples(st.just("pop"), st.none(), st.none(), st.none(), st.none()),
        st.tuples(st.just("cancel"), st.integers(0, 200), st.none(), st.none(), st.none()),
        st.tuples(st.just("expire"), st.integers(0, 60), st.none(), st.none(), st.none()),
    ),
    max_size=200,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 12), st.integers(1, 8))
def test_bounds_order_and_nothing_lost(program: list, max_total: int, per_band: int) -> None:
    q = FairQueue(max_total=max_total, max_per_priority=per_band)
    fate: dict[str, str] = {}
    offered = 0
    last_pop: dict[str, int] = {}
    for op, a, b, c, d in program:
        if op == "offer":
            it = item(offered, a, b, float(c), deadline=float(d))
            offered += 1
            worst_before = max(q.priorities(), default=None)
            queued, shed = q.offer(it)
            fate[it.id] = "queued" if queued else "refused"
            if shed is not None:
                assert fate[shed.id] == "queued"
                fate[shed.id] = "shed"
                assert shed.priority >= it.priority  # never a better class for a worse one
                if q.count(it.priority) < per_band or shed.priority != it.priority:
                    assert shed.priority == worst_before  # the lowest class goes first
        elif op == "pop":
            head = q.peek()
            got = q.pop()
            assert got is head
            if got is not None:
                assert all(got.priority <= other.priority for other in q)  # priority order
                n = int(got.id[1:])
                assert last_pop.get(got.tenant + str(got.priority), -1) < n  # FIFO per tenant
                last_pop[got.tenant + str(got.priority)] = n
                fate[got.id] = "served"
        elif op == "cancel":
            got = q.remove(f"r{a}")
            if got is not None:
                fate[got.id] = "cancelled"
        else:
            for got in q.expired(float(a)):
                assert got.deadline <= a
                fate[got.id] = "expired"
        assert len(q) <= max_total
        for p in q.priorities():
            assert 0 < q.count(p) <= per_band
        assert sum(q.count(p) for p in q.priorities()) == len(q)
    # nothing lost: every request is queued (and in the queue) or has exactly one fate
    assert len(fate) == offered
    for rid, f in fate.items():
        assert (f == "queued") == (rid in q)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 30)), min_size=1, max_size=120),
    st.sampled_from([(1.0, 1.0, 1.0), (1.0, 2.0, 4.0)]),
)
def test_weighted_service_of_backlogged_tenants_stays_within_one_request(
    arrivals: list[tuple[str, int]], weights: tuple[float, float, float]
) -> None:
    w = dict(zip(TENANTS, weights, strict=True))
    q = FairQueue(max_total=1000, max_per_priority=1000, weights=w)
    left: dict[str, int] = defaultdict(int)
    for i, (tenant, cost) in enumerate(arrivals):
        q.offer(item(i, tenant, 0, float(cost)))
        left[tenant] += 1
    served: dict[str, float] = defaultdict(float)
    max_step = max(cost / w[t] for t, cost in arrivals)
    while (got := q.pop()) is not None:
        served[got.tenant] += got.cost / w[got.tenant]
        left[got.tenant] -= 1
        backlogged = [t for t in TENANTS if left[t] > 0]
        if len(backlogged) >= 2:
            shares = [served[t] for t in backlogged]
            assert max(shares) - min(shares) <= max_step + 1e-9


def test_a_flooding_tenant_waits_behind_the_others() -> None:
    q = FairQueue(max_total=100, max_per_priority=100)
    n = 0
    for _ in range(30):
        q.offer(item(n, "flood", 5))
        n += 1
    q.offer(item(n, "quiet", 5))
    assert q.pop() is not None and q.pop().tenant == "quiet"  # type: ignore[union-attr]


def test_a_full_band_sheds_the_heaviest_tenant_not_the_newcomer() -> None:
    q = FairQueue(max_total=100, max_per_priority=4)
    for i in range(4):
        q.offer(item(i, "flood", 1))
    queued, shed = q.offer(item(9, "quiet", 1))
    assert queued and shed is not None and shed.tenant == "flood" and shed.id == "r3"
    queued, shed = q.offer(item(10, "flood", 1))
    assert not queued and shed is None


def test_a_full_queue_sheds_the_lowest_class_first() -> None:
    q = FairQueue(max_total=3, max_per_priority=10)
    q.offer(item(0, "a", 0))
    q.offer(item(1, "a", 10))
    q.offer(item(2, "b", 5))
    queued, shed = q.offer(item(3, "c", 1))
    assert queued and shed is not None and shed.priority == 10
    queued, shed = q.offer(item(4, "c", 20))  # worse than everything queued: refused
    assert not queued and shed is None

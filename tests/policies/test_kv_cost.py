"""Dynamo's KV cost (kv_cost) on hand-built views: the formula, its credit, TTL and events."""

from __future__ import annotations

import pytest

from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.policies import Dispatcher, PolicyContext, create_policy
from gateway.policies.kv_cost import KvCostPolicy

BS = 16


def view(*engines: EngineView) -> ClusterView:
    return ClusterView(tuple(engines))


def ev(i: int, **kw: object) -> EngineView:
    return EngineView(id=f"e{i}", **kw)  # type: ignore[arg-type]


def req(rid: str, hashes: tuple[int, ...], extra: int = 0) -> RequestInfo:
    return RequestInfo(
        id=rid, block_hashes=hashes, prompt_tokens=BS * len(hashes) + extra, arrival=0.0
    )


def make(**options: object) -> tuple[KvCostPolicy, Dispatcher]:
    policy = create_policy("kv_cost", PolicyContext(seed=3), options or None)
    assert isinstance(policy, KvCostPolicy)
    return policy, Dispatcher(policy)


def warm(d: Dispatcher, r: RequestInfo, engine: str, ids: int, now: float = 0.0) -> None:
    """Route ``r`` with only ``engine`` healthy (same engine set)."""
    engines = [ev(i, healthy=f"e{i}" == engine) for i in range(ids)]
    assert d.route(r, view(*engines), now).engine == engine


def test_cached_blocks_are_credited_against_queued_prefill() -> None:
    _, d = make()
    doc = tuple(range(100, 140))  # 40 blocks
    warm(d, req("w", doc), "e0", 2)
    d.finished(req("w", doc), "e0", 1.0, True)  # its decode blocks leave
    # e0: 20 blocks queued + 41 - 40 cached = 21 (+ 41 decode) ; e1: 0 + 41 (+ 41)
    v = view(ev(0, pending_prefill_tokens=20 * BS), ev(1))
    assert d.route(req("r", (*doc, 7)), v, 2.0).engine == "e0"
    d.finished(req("r", (*doc, 7)), "e0", 2.5, True)
    # 41 blocks queued on e0: 41 + 41 - 40 = 42 (+ 41) > 0 + 41 (+ 41): the credit no longer pays
    v = view(ev(0, pending_prefill_tokens=41 * BS), ev(1))
    assert d.route(req("s", (*doc, 8)), v, 3.0).engine == "e1"


def test_overlap_credit_zero_ignores_the_cache() -> None:
    _, d = make(overlap_credit=0.0)
    doc = tuple(range(100, 140))
    warm(d, req("w", doc), "e0", 2)
    d.finished(req("w", doc), "e0", 1.0, True)
    v = view(ev(0, pending_prefill_tokens=BS), ev(1))
    assert d.route(req("r", (*doc, 7)), v, 2.0).engine == "e1"


def test_active_decode_blocks_count_until_the_request_finishes() -> None:
    policy, d = make()
    big = req("big", tuple(range(500, 600)))  # 100 blocks held on e0 while in flight
    warm(d, big, "e0", 2)
    assert policy._decode_blocks == {"e0": 100}
    fresh = req("x", (1, 2, 3))
    assert d.route(fresh, view(ev(0), ev(1)), 1.0).engine == "e1"
    d.finished(big, "e0", 2.0, True)
    d.finished(fresh, "e1", 2.0, True)
    assert policy._decode_blocks == {}


@pytest.mark.parametrize(("gap_s", "expected"), [(60.0, "e0"), (121.0, "e1")])
def test_approximate_index_forgets_blocks_after_the_ttl(gap_s: float, expected: str) -> None:
    """Dynamo's ApproxKvIndexer: a routed prefix is credited for 120 s after its last use."""
    _, d = make()
    doc = tuple(range(100, 140))
    warm(d, req("w", doc), "e0", 2)
    d.finished(req("w", doc), "e0", 0.5, True)
    v = view(ev(0, pending_prefill_tokens=5 * BS), ev(1))
    assert d.route(req("r", (*doc, 7)), v, gap_s).engine == expected


def test_kv_events_replace_the_ttl_and_learn_other_replicas_placements() -> None:
    policy = create_policy("kv_cost", PolicyContext(kv_events=True))
    assert policy.wants_cache_events
    d = Dispatcher(policy)
    doc = tuple(range(100, 140))
    d.cache_event("e1", doc, ())  # another replica routed doc to e1: its engine says so
    v = view(ev(0), ev(1, pending_prefill_tokens=10 * BS))
    assert d.route(req("r", (*doc, 7)), v, 500.0).engine == "e1"  # no TTL in events mode
    d.cache_event("e1", (), doc[5:])
    assert d.route(req("s", (*doc, 8)), v, 501.0).engine == "e0"  # e1 evicted most of it


def test_options_are_checked() -> None:
    from gateway.core.errors import ConfigError

    with pytest.raises(ConfigError, match="ttl_s"):
        create_policy("kv_cost", options={"ttl_s": "0"})
    with pytest.raises(ConfigError, match="overlap_credit"):
        create_policy("kv_cost", options={"overlap_credit": "-1"})

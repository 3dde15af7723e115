"""Session affinity: sticky until saturated, TTL, and the dispatcher narrowing the view."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.core.types import ClusterView, EngineRole, EngineView, RequestInfo
from gateway.policies import Dispatcher
from gateway.policies.base import PolicyContext
from gateway.policies.registry import create_policy
from gateway.policies.session_affinity import (
    SessionAffinity,
    SessionOutcome,
    StickySettings,
    checkpoints,
    shared_tokens,
)

ENGINES = ("a", "b", "c", "d")
VIEW = ClusterView(tuple(EngineView(e) for e in ENGINES))


HISTORY = tuple(range(1, 65))  # a session's prompt: 64 blocks, the same prefix every turn


def req(i: int, session: str = "s1", hashes: tuple[int, ...] = HISTORY) -> RequestInfo:
    return RequestInfo(f"r{i}", hashes, 16 * max(1, len(hashes)), float(i), session=session)


def loaded(view: ClusterView, engine: str, **fields: Any) -> ClusterView:
    return ClusterView(tuple(replace(e, **fields) if e.id == engine else e for e in view))


def test_a_session_is_new_then_bound_then_expired() -> None:
    s = SessionAffinity(StickySettings(ttl_s=10.0))
    view, outcome = s.narrow(req(0), VIEW, 0.0)
    assert outcome is SessionOutcome.NEW and view is VIEW
    s.bind(req(0), "c", 0.0)
    view, outcome = s.narrow(req(1), VIEW, 5.0)
    assert outcome is SessionOutcome.BOUND and view.ids == ("c",)
    s.bind(req(1), "c", 5.0)  # each turn renews the binding: alive until 15
    assert s.narrow(req(2), VIEW, 14.0)[1] is SessionOutcome.BOUND
    view, outcome = s.narrow(req(3), VIEW, 14.0 + 10.0)
    assert outcome is SessionOutcome.EXPIRED and view is VIEW
    assert s.narrow(req(4, session=""), VIEW, 0.0) == (VIEW, None)  # no session: untouched
    assert s.outcomes == {"new": 1, "bound": 2, "expired": 1}


def test_an_unhealthy_or_missing_bound_engine_lets_the_policy_choose() -> None:
    s = SessionAffinity()
    s.bind(req(0), "c", 0.0)
    sick = loaded(VIEW, "c", healthy=False)
    assert s.narrow(req(1), sick, 1.0) == (sick, SessionOutcome.REBOUND_UNAVAILABLE)
    without = ClusterView(tuple(e for e in VIEW if e.id != "c"))
    assert s.narrow(req(2), without, 1.0)[1] is SessionOutcome.REBOUND_UNAVAILABLE
    s.engine_removed("c")
    assert s.narrow(req(3), VIEW, 1.0)[1] is SessionOutcome.NEW


@pytest.mark.parametrize(
    ("fields", "saturated"),
    [
        ({"in_flight": 3}, False),  # at the floor: sticky whatever the others carry
        ({"in_flight": 4}, True),  # 4 > 1.2 x mean (4 + 3 x 0) / 4
        ({"in_flight": 2, "router_queued": 2}, True),  # held requests count
        # prefill queued here beyond the least backlogged engine, against the 1,024 tokens
        # of the session this engine holds (what a move would prefill again)
        ({"pending_prefill_tokens": 1024}, False),
        ({"pending_prefill_tokens": 1025}, True),
        ({"pending_prefill_tokens": 600, "router_queued_tokens": 500}, True),
    ],
)
def test_saturation_is_load_above_ratio_times_mean_and_a_floor(
    fields: dict[str, Any], saturated: bool
) -> None:
    s = SessionAffinity()
    s.bind(req(0), "a", 0.0)
    expected = SessionOutcome.REBOUND_SATURATED if saturated else SessionOutcome.BOUND
    assert s.narrow(req(1), loaded(VIEW, "a", **fields), 1.0)[1] is expected


def test_backlog_is_compared_with_the_least_backlogged_engine() -> None:
    s = SessionAffinity()
    s.bind(req(0), "a", 0.0)
    busy = ClusterView(tuple(replace(e, pending_prefill_tokens=5000) for e in VIEW))
    assert s.narrow(req(1), loaded(busy, "a", pending_prefill_tokens=6000), 1.0)[1] is (
        SessionOutcome.BOUND
    )
    assert s.narrow(req(2), loaded(busy, "a", pending_prefill_tokens=6100), 1.0)[1] is (
        SessionOutcome.REBOUND_SATURATED
    )


def test_a_prompt_that_does_not_continue_the_session_is_left_to_the_policy() -> None:
    s = SessionAffinity()
    s.bind(req(0), "a", 0.0)
    other = req(1, hashes=tuple(range(1000, 1064)))  # same session, unrelated prompt
    assert s.narrow(other, VIEW, 1.0) == (VIEW, SessionOutcome.UNRELATED)
    half = req(2, hashes=(*HISTORY[:40], *range(2000, 2030)))  # continues 32+ blocks of it
    assert shared_tokens(half, checkpoints(req(0))) == 32 * 16
    assert s.narrow(half, loaded(VIEW, "a", pending_prefill_tokens=500), 1.0)[1] is (
        SessionOutcome.BOUND
    )
    assert s.narrow(half, loaded(VIEW, "a", pending_prefill_tokens=600), 1.0)[1] is (
        SessionOutcome.REBOUND_SATURATED  # 600 queued ahead > the 512 tokens kept here
    )


def test_checkpoints_mark_quarters_of_the_last_prompt() -> None:
    last = req(0, hashes=tuple(range(100, 110)))
    assert checkpoints(last) == (2, 102, 4, 104, 7, 107, 9, 109)
    assert checkpoints(req(0, hashes=())) == ()
    longer = req(1, hashes=(*range(100, 106), 7, 8, 9))
    assert shared_tokens(longer, checkpoints(last)) == 5 * 16
    assert shared_tokens(longer, None) == longer.prompt_tokens  # a peer's binding: no marks
    s = SessionAffinity()
    s.table.put("s1", "b", 0.0)  # as replica sync applies a peer's binding
    assert s.narrow(req(1), VIEW, 1.0) == (ClusterView((VIEW.engines[1],)), SessionOutcome.BOUND)

    s = SessionAffinity()
    s.bind(req(0), "a", 0.0)
    busy = ClusterView(tuple(replace(e, in_flight=8) for e in VIEW))
    assert s.narrow(req(1), loaded(busy, "a", in_flight=10), 1.0)[1] is SessionOutcome.BOUND
    assert s.narrow(req(2), loaded(busy, "a", in_flight=11), 1.0)[1] is (
        SessionOutcome.REBOUND_SATURATED  # 11 > 1.2 x 8.75
    )


def test_bindings_are_bounded() -> None:
    s = SessionAffinity(StickySettings(max_sessions=3))
    for i in range(10):
        s.bind(req(i, session=f"s{i}"), "a", 0.0)
    assert len(s.table) == 3
    assert s.narrow(req(0, session="s0"), VIEW, 0.0)[1] is SessionOutcome.NEW
    assert s.narrow(req(9, session="s9"), VIEW, 0.0)[1] is SessionOutcome.BOUND


def test_the_dispatcher_keeps_a_session_where_the_policy_would_move_it() -> None:
    plain = Dispatcher(create_policy("round_robin", PolicyContext()))
    assert len({plain.route(req(i), VIEW, float(i)).engine for i in range(4)}) == 4
    sticky = Dispatcher(create_policy("round_robin", PolicyContext()), sessions=SessionAffinity())
    first = sticky.route(req(0), VIEW, 0.0).engine
    assert [sticky.route(req(i), VIEW, float(i)).engine for i in range(1, 4)] == [first] * 3
    other = sticky.route(req(9, session="s2"), VIEW, 9.0).engine  # another session: its own
    assert sticky.sessions is not None and sticky.sessions.table.get("s2", 9.0) == other
    # saturated: the policy decides over the whole fleet and the session moves with it
    busy = loaded(VIEW, first, in_flight=9)
    moved = sticky.route(req(10), busy, 10.0).engine
    assert moved != first and sticky.sessions.table.get("s1", 10.0) == moved
    assert sticky.sessions.outcomes["rebound_saturated"] == 1


def test_the_policy_still_prices_the_bound_engine() -> None:
    """Narrowing the view leaves the decision to the policy: its expected hit is reported."""
    policy = create_policy("cache_aware", PolicyContext())
    d = Dispatcher(policy, sessions=SessionAffinity())
    hashes = tuple(range(1, 40))
    first = d.route(req(0, hashes=hashes), VIEW, 0.0)
    turn = d.route(req(1, hashes=(*hashes, 99)), VIEW, 1.0)
    assert turn.engine == first.engine and turn.expected_hit_tokens == 16 * len(hashes)


def test_in_a_disaggregated_pool_the_binding_names_the_decode_engine() -> None:
    roles = (EngineRole.PREFILL, EngineRole.PREFILL, EngineRole.DECODE, EngineRole.DECODE)
    pd = ClusterView(tuple(EngineView(e, role=r) for e, r in zip(ENGINES, roles, strict=True)))
    s = SessionAffinity()
    s.bind(req(0), "d", 0.0)
    view, outcome = s.narrow(req(1), pd, 1.0)
    assert outcome is SessionOutcome.BOUND and view.ids == ("a", "b", "d")
    d = Dispatcher(create_policy("round_robin", PolicyContext()), sessions=s)
    assert {d.route(req(i, hashes=tuple(range(1, 200))), pd, i).engine for i in range(2, 6)} == {
        "d"
    }

"""Precise mode of the cache-aware baselines: KV events correct the approximate prefix state."""

from __future__ import annotations

import pytest

from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.policies import Dispatcher, PolicyContext, create_policy

PROMPT = (11, 12, 13, 14)


def cluster() -> ClusterView:
    return ClusterView((EngineView(id="e0"), EngineView(id="e1")))


def request(rid: str) -> RequestInfo:
    return RequestInfo(id=rid, block_hashes=PROMPT, prompt_tokens=16 * 4 + 1, arrival=0.0)


@pytest.mark.parametrize("name", ["cache_aware", "weighted_scorer"])
def test_approximate_by_default(name: str) -> None:
    d = Dispatcher(create_policy(name, PolicyContext(seed=1)))
    assert not d.policy.wants_cache_events
    first = d.route(request("a"), cluster(), 0.0).engine
    d.cache_event(first, (), PROMPT)  # ignored: the approximate state keeps its guess
    second = d.route(request("b"), cluster(), 0.0)
    assert second.engine == first and second.expected_hit_tokens == 64


@pytest.mark.parametrize("name", ["cache_aware", "weighted_scorer"])
def test_precise_mode_follows_the_engines_events(name: str) -> None:
    d = Dispatcher(create_policy(name, PolicyContext(seed=1), {"precise": "true"}))
    assert d.policy.wants_cache_events
    first = d.route(request("a"), cluster(), 0.0).engine
    other = "e1" if first == "e0" else "e0"
    # The engine evicted the prompt's blocks; the other engine stored them (say, a replica).
    d.cache_event(first, (), PROMPT)
    d.cache_event(other, PROMPT, ())
    second = d.route(request("b"), cluster(), 0.0)
    assert second.engine == other and second.expected_hit_tokens == 64
    # A cleared cache (or lost events) forgets everything the engine was believed to hold.
    d.cache_reset(other)
    d.cache_reset(first)
    third = d.route(request("c"), cluster(), 0.0)
    assert third.expected_hit_tokens == 0


def test_precise_eviction_of_a_middle_block_cuts_the_match() -> None:
    d = Dispatcher(create_policy("weighted_scorer", PolicyContext(seed=1), {"precise": "true"}))
    d.cache_event("e0", PROMPT, ())
    d.cache_event("e0", (), (13,))
    assert d.policy.index.match(PROMPT) == {"e0": 2}  # type: ignore[attr-defined]

"""Preble's kvgate defaults: the load includes the prefill queued now, P/D balancing is off,
and the blocks engines announce (KV events) count as cached.

tests/policies/test_preble.py pins the paper's rules (window load only, P/D balancing on);
these tests check what the defaults change, with the same exact perf model (1 ms per token,
no fixed part: an idle engine prefills 1,000 tokens per second).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.blocks import hashes_from_segments
from gateway.core.types import ClusterView, EngineView, RequestInfo
from gateway.perfmodel.model import PerfModel
from gateway.policies import Dispatcher, PolicyContext, create_policy
from gateway.policies.preble import PrebleConfig, PreblePolicy

BS = 16
PERF = PerfModel(name="test", prefill_a=0.0, prefill_b=1.0, decode_e0=1.0, block_size=BS)
E2 = ("e0", "e1")
_ids = iter(range(1_000_000))


def make(**options: object) -> tuple[PreblePolicy, Dispatcher]:
    policy = create_policy("preble", PolicyContext(block_size=BS, perf=PERF), options or None)
    assert isinstance(policy, PreblePolicy)
    return policy, Dispatcher(policy)


def blocks(*segments: tuple[int, int]) -> tuple[int, ...]:
    return hashes_from_segments([(seg, n * BS) for seg, n in segments], BS)


def req(hashes: Sequence[int], extra: int = 1) -> RequestInfo:
    return RequestInfo(
        id=f"p{next(_ids)}",
        block_hashes=tuple(hashes),
        prompt_tokens=BS * len(hashes) + extra,
        arrival=0.0,
    )


def view(**stats: dict[str, object]) -> ClusterView:
    return ClusterView(tuple(EngineView(id=e, **stats.get(e, {})) for e in E2))  # type: ignore[arg-type]


def only(engine: str) -> ClusterView:
    return ClusterView(tuple(EngineView(id=e, healthy=e == engine) for e in E2))


def test_defaults_are_queue_aware_with_p_d_balancing_off() -> None:
    cfg = PrebleConfig()
    assert cfg.queue_aware and not cfg.pd_balance and cfg.load_horizon_s == 1.0


def test_exploit_avoids_the_holder_with_prefill_queued_now() -> None:
    """Both engines hold the prompt and routed the same work in the window; e0 has 2 s of
    prefill queued right now. The paper's window load cannot tell them apart."""
    quiet = {"initial_tpot_s": 0.0, "rebalance": False}
    doc = blocks((1, 40))
    for options, expected in (({}, "e1"), ({"queue_aware": False}, "e0")):
        _, d = make(**quiet, **options)
        d.route(req(doc), only("e0"), 0.0)
        d.route(req(doc), only("e1"), 0.0)
        decision = d.route(req(doc), view(e0={"pending_prefill_tokens": 2000}), 1.0)
        assert (decision.engine, decision.reason) == (expected, "preble:exploit")


def test_window_load_counts_over_the_load_horizon() -> None:
    """e0 routed 0.64 s of prefill in the window, e1 nothing; e1 has 0.1 s queued now.
    Load = window x 10/180 + queued: e0 0.036, e1 0.100 -> e0; with the full window
    (load_horizon_s = window_s) e0 0.64 > e1 0.10 -> e1. (TPOT filter off: with 2 s mixed
    steps e0's 6 % duty cycle would exclude it, tested below.)"""
    quiet = {"initial_tpot_s": 0.0, "rebalance": False, "tpot_aware": False}
    for horizon, expected in ((10.0, "e0"), (180.0, "e1")):
        _, d = make(**quiet, load_horizon_s=horizon)
        d.route(req(blocks((2, 40))), only("e0"), 0.0)  # 641 tokens: 0.641 s in e0's window
        fresh = req(blocks((3, 4)))  # nothing cached anywhere: explore, equal P
        decision = d.route(fresh, view(e1={"pending_prefill_tokens": 100}), 1.0)
        assert (decision.engine, decision.reason) == (expected, "preble:explore")


def test_announced_blocks_count_as_cached() -> None:
    """Another replica routed a document to e1: its KV events reach this replica, which
    exploits e1 for a prompt it never routed itself."""
    policy, d = make(initial_tpot_s=0.0, rebalance=False)
    doc = blocks((4, 40))
    d.cache_event("e1", doc, ())
    decision = d.route(req(doc), view(), 0.0)
    assert (decision.engine, decision.reason) == ("e1", "preble:exploit")
    assert decision.expected_hit_tokens == 40 * BS
    d.cache_event("e1", (), doc)  # evicted: no longer announced
    assert policy.announced.match(doc) == {}


def test_explore_skips_engines_whose_decodes_would_miss_tpot() -> None:
    """e0 was just sent a 1,000-token prefill (1 s of the last 10: a 10 % duty cycle of 2 s
    mixed steps, so a decode there is predicted at ~0.2 s per token, above the 0.1 s target);
    e1 has 0.5 s of prefill queued. Explore's L + M + P alone prefers e0."""
    quiet = {"initial_tpot_s": 0.0, "rebalance": False}
    for options, expected in (({}, "e1"), ({"tpot_aware": False}, "e0")):
        _, d = make(**quiet, **options)
        d.route(req(blocks((1, 62)), extra=8), only("e0"), 0.0)
        decision = d.route(req(blocks((2, 4))), view(e1={"pending_prefill_tokens": 500}), 1.0)
        assert (decision.engine, decision.reason) == (expected, "preble:explore"), options


def test_rebalancing_starts_with_the_first_request() -> None:
    """Every prompt shares a long prefix (an agent's tool list), cached only on e0, which
    already has 8 s of prefill queued; e1 is idle. Exploit has one holder, so only
    rebalancing can move the request, and with the paper's warm-up (tens of requests per
    engine) it may not start yet: the second request would wait behind the first's queue."""
    quiet = {"initial_tpot_s": 0.0}
    tools = blocks((5, 500))
    for options, expected, reason in (
        ({}, "e1", "preble:rebalance"),
        ({"rebalance_warmup": 5}, "e0", "preble:exploit"),
    ):
        _, d = make(**quiet, **options)
        d.route(req(tools + blocks((6, 2))), only("e0"), 0.0)
        decision = d.route(
            req(tools + blocks((7, 2))), view(e0={"pending_prefill_tokens": 8000}), 1.0
        )
        assert (decision.engine, decision.reason) == (expected, reason), options

"""The P/D rule (local or remote prefill) and the dispatcher's pair mode."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.config import PDConfig
from gateway.core.types import ClusterView, Decision, EngineRole, EngineView, RequestInfo
from gateway.perfmodel.presets import load_preset
from gateway.policies import Dispatcher, PolicyBase, PolicyContext, create_policy
from gateway.policies.pd_rule import PDReason, PDRule, PDSettings, predicted_wait

PERF = load_preset("mistral-7b-a6000")
RULE = PDRule(PDSettings(), PERF)
P, D = EngineRole.PREFILL, EngineRole.DECODE


def req(prompt: int, rid: str = "r", arrival: float = 0.0) -> RequestInfo:
    return RequestInfo(id=rid, block_hashes=(), prompt_tokens=prompt, arrival=arrival)


def engine(name: str, role: EngineRole, pending: int = 0, **kw: object) -> EngineView:
    return EngineView(name, role=role, pending_prefill_tokens=pending, **kw)  # type: ignore[arg-type]


# Tokens a prefill engine must have queued for a predicted wait of about `s` seconds.
def tokens_for(s: float) -> int:
    return int(s * 1000 / PERF.prefill_b)


@pytest.mark.parametrize(
    ("prompt", "hit", "pool_pending", "decode_pending", "expected"),
    [
        (3000, 0, 0, 0, PDReason.REMOTE_LONG),  # long and cold
        (1000, 0, 0, 0, PDReason.REMOTE_UNCACHED),  # short but cold (Dynamo: ratio 1.0)
        (1000, 700, 0, 0, PDReason.LOCAL_CACHED),  # 300 uncached, 30 % of the prompt
        (1000, 200, 0, 0, PDReason.REMOTE_UNCACHED),  # 800 uncached: 80 % >= 70 %
        (1000, 301, 0, 0, PDReason.LOCAL_CACHED),  # 699 uncached: 69.9 % < 70 %
        (1000, 300, 0, 0, PDReason.REMOTE_UNCACHED),  # exactly 70 %: remote
        (5000, 3000, 0, 0, PDReason.LOCAL_CACHED),  # 2,000 uncached, 40 %
        (5000, 2952, 0, 0, PDReason.REMOTE_LONG),  # exactly 2,048 uncached: remote
        (3000, 500, 0, 0, PDReason.REMOTE_LONG),  # 2,500 uncached
        (12, 0, 0, 0, PDReason.LOCAL_SHORT),  # under 16 uncached tokens
        (3000, 0, tokens_for(2.0), 0, PDReason.LOCAL_SATURATED),  # pool waits ~2 s
        (3000, 0, tokens_for(0.9), 0, PDReason.REMOTE_LONG),  # ~0.9 s: not saturated
        (3000, 0, tokens_for(2.0), tokens_for(3.0), PDReason.REMOTE_LONG),  # decode busier
    ],
)
def test_rule_table(
    prompt: int, hit: int, pool_pending: int, decode_pending: int, expected: PDReason
) -> None:
    prefills = [engine("p0", P, pool_pending), engine("p1", P, pool_pending + 5000)]
    choice = RULE.decide(req(prompt), engine("d0", D, decode_pending), hit, prefills)
    assert choice.reason is expected
    assert choice.remote == expected.value.startswith("remote")
    assert choice.uncached == prompt - hit


def test_pool_wait_is_the_least_loaded_healthy_engine_and_none_means_local() -> None:
    busy, idle = engine("p0", P, 50_000), engine("p1", P, 0)
    assert RULE.pool_wait([busy, idle]) == 0.0
    dead = dataclasses.replace(idle, healthy=False)
    assert RULE.pool_wait([busy, dead]) == predicted_wait(PERF, busy) > 5.0
    choice = RULE.decide(req(3000), engine("d0", D), 0, [dead])
    assert choice.reason is PDReason.LOCAL_NO_PREFILL


def test_predicted_wait_uses_the_engine_model() -> None:
    # 4,096 queued tokens: two chunks of 2,048, each a step's fixed cost, plus b per token
    e = engine("p0", P, 4096)
    assert predicted_wait(PERF, e) == pytest.approx(
        (2 * PERF.prefill_a + 4096 * PERF.prefill_b) / 1e3
    )
    assert predicted_wait(PERF, engine("p1", P)) == 0.0
    held = engine("p2", P, 0, router_queued_tokens=2048)
    assert predicted_wait(PERF, held) == pytest.approx(
        (PERF.prefill_a + 2048 * PERF.prefill_b) / 1e3
    )


def test_thresholds_are_configurable() -> None:
    rule = PDRule(
        PDSettings(min_uncached_tokens=256, max_local_tokens=512, saturation_wait_s=5), PERF
    )
    prefills = [engine("p0", P, tokens_for(2.0))]
    assert rule.decide(req(200), engine("d0", D), 0, prefills).reason is PDReason.LOCAL_SHORT
    assert rule.decide(req(1000), engine("d0", D), 400, prefills).reason is PDReason.REMOTE_LONG
    assert RULE.decide(req(1000), engine("d0", D), 400, [engine("p0", P)]).reason is (
        PDReason.LOCAL_CACHED  # the defaults: 600 uncached < 2,048 and 60 % < 70 %
    )
    assert rule.decide(req(3000), engine("d0", D), 0, prefills).reason is PDReason.REMOTE_LONG


@pytest.mark.parametrize(
    "bad",
    [{"max_local_ratio": 1.5}, {"saturation_wait_s": 0}, {"min_uncached_tokens": -1}],
)
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PDSettings(**bad)  # type: ignore[arg-type]


def test_the_config_section_builds_the_settings_with_the_same_defaults() -> None:
    assert PDSettings(**PDConfig().model_dump()) == PDSettings()
    assert {f.name for f in dataclasses.fields(PDSettings)} == set(PDConfig.model_fields)


# -- pair mode -------------------------------------------------------------------------


class Affine(PolicyBase):
    """Always the first healthy engine of the pool; claims ``hit`` cached tokens there."""

    name = "affine"

    def __init__(self, hit: int = 0) -> None:
        self.hit = hit
        self.routed: list[str] = []

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        return Decision(engine=view.healthy()[0].id, expected_hit_tokens=self.hit, reason="aff")

    def on_routed(self, req: RequestInfo, decision: Decision, now: float) -> None:
        self.routed.append(decision.engine)


def pd_view(*, prefill_pending: int = 0) -> ClusterView:
    return ClusterView(
        (
            engine("p0", P, prefill_pending),
            engine("p1", P, prefill_pending),
            engine("d0", D),
            engine("d1", D),
        )
    )


def test_pair_mode_sends_long_cold_prompts_to_the_prefill_pool() -> None:
    policy = Affine()
    d = Dispatcher(policy, perf=PERF)
    decision = d.route(req(3000), pd_view(), 0.0)
    assert (decision.engine, decision.prefill_engine) == ("d0", "p0")
    assert decision.pd_reason == "remote_long"
    assert policy.routed == ["p0", "d0"]  # the policy saw both sub-decisions
    assert d.in_flight == {"p0": 1, "d0": 1}
    assert d.pd_reasons == {"remote_long": 1}


def test_pair_mode_prefills_cached_prompts_locally_and_asks_no_prefill_engine() -> None:
    policy = Affine(hit=700)
    d = Dispatcher(policy, perf=PERF)
    decision = d.route(req(1000), pd_view(), 0.0)
    assert decision.prefill_engine is None and decision.pd_reason == "local_cached"
    assert policy.routed == ["d0"]
    assert d.in_flight == {"d0": 1}


def test_pair_mode_prefills_locally_when_the_prefill_pool_is_saturated() -> None:
    d = Dispatcher(Affine(), perf=PERF, pd=PDSettings(saturation_wait_s=0.5))
    decision = d.route(req(3000), pd_view(prefill_pending=tokens_for(0.6)), 0.0)
    assert decision.prefill_engine is None and decision.pd_reason == "local_saturated"
    relaxed = Dispatcher(Affine(), perf=PERF, pd=PDSettings(saturation_wait_s=1.0))
    assert relaxed.route(req(3000), pd_view(prefill_pending=tokens_for(0.6)), 0.0).prefill_engine


def test_a_both_engine_chosen_for_decode_is_not_its_own_prefill_engine() -> None:
    view = ClusterView((engine("b0", EngineRole.BOTH), engine("p0", P), engine("d0", D)))
    decision = Dispatcher(Affine(), perf=PERF).route(req(3000), view, 0.0)
    assert (decision.engine, decision.prefill_engine) == ("b0", "p0")


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "predicted_ttft"])
def test_both_pools_rotate_in_pair_mode(name: str) -> None:
    """Two pools of two: each request's prefill and decode engine both alternate."""
    d = Dispatcher(create_policy(name, PolicyContext(seed=1)), perf=PERF)
    pairs = []
    for i in range(4):
        r = req(3000, f"r{i}", float(i))
        decision = d.route(r, pd_view(), float(i))
        pairs.append((decision.prefill_engine, decision.engine))
        assert decision.prefill_engine is not None
        d.prefill_done(r, decision.prefill_engine, i + 0.1, ok=True)
        d.finished(r, decision.engine, i + 0.5, ok=True)
    assert {p for p, _ in pairs} == {"p0", "p1"}
    assert {e for _, e in pairs} == {"d0", "d1"}
    assert pairs[0] != pairs[1]


def test_unified_pools_carry_no_pd_reason() -> None:
    view = ClusterView((EngineView("a"), EngineView("b")))
    d = Dispatcher(create_policy("round_robin"), perf=PERF)
    assert d.route(req(3000), view, 0.0).pd_reason == ""
    assert d.pd_reasons == {}


# -- decode balance (remote legs without reuse) -------------------------------------------


def busy_view(*, d0_in_flight: int = 0, d1_in_flight: int = 0, **d1: object) -> ClusterView:
    return ClusterView(
        (
            engine("p0", P),
            engine("p1", P),
            engine("d0", D, in_flight=d0_in_flight),
            engine("d1", D, in_flight=d1_in_flight, **d1),
        )
    )


def test_sequential_cold_prompts_alternate_decode_engines_whatever_the_policy_picks() -> None:
    """The policy always names d0; with every engine idle (nothing in flight by the
    router's count) the decode legs go to the least recently used decode engine."""
    d = Dispatcher(Affine(), perf=PERF)
    legs = [d.route(req(3000, f"r{i}", float(i)), pd_view(), float(i)).engine for i in range(4)]
    assert legs == ["d0", "d1", "d0", "d1"]


def test_a_busy_pick_moves_to_an_idle_decode_engine_and_the_policy_sees_the_move() -> None:
    policy = Affine()
    d = Dispatcher(policy, perf=PERF)
    decision = d.route(req(3000), busy_view(d0_in_flight=1), 0.0)
    assert (decision.engine, decision.prefill_engine) == ("d1", "p0")
    assert decision.pd_reason == "remote_long" and decision.reason.endswith(":idle_decode")
    assert policy.routed == ["p0", "d1"] and d.in_flight == {"p0": 1, "d1": 1}
    # held requests or pending prefill (the router's own counts) make an engine busy too
    for busy in ({"router_queued": 1}, {"pending": 10}):
        assert (
            Dispatcher(Affine(), perf=PERF)
            .route(req(3000), busy_view(d0_in_flight=1, **busy), 0.0)
            .engine
            == "d0"
        )  # no idle engine: the policy's pick stands
    assert (
        Dispatcher(Affine(), perf=PERF)
        .route(req(3000), busy_view(d0_in_flight=2, d1_in_flight=1), 0.0)
        .engine
        == "d0"
    )


def test_reuse_on_the_decode_engine_keeps_the_leg_there() -> None:
    """6,000 tokens, 2,000 cached on d0 (a third): remote (4,000 uncached), but d0's cache
    pays, so the leg stays on the busy d0; 1,500 cached (a quarter) does not."""
    kept = Dispatcher(Affine(hit=2000), perf=PERF).route(req(6000), busy_view(d0_in_flight=1), 0)
    assert (kept.engine, kept.pd_reason) == ("d0", "remote_long")
    moved = Dispatcher(Affine(hit=1500), perf=PERF).route(req(6000), busy_view(d0_in_flight=1), 0)
    assert (moved.engine, moved.pd_reason) == ("d1", "remote_long")


def test_local_legs_are_not_moved() -> None:
    decision = Dispatcher(Affine(hit=700), perf=PERF).route(req(1000), busy_view(d0_in_flight=1), 0)
    assert (decision.engine, decision.pd_reason) == ("d0", "local_cached")

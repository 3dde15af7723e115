"""LoRA adapter affinity: tiers resident > free slot > must evict, the load guard, and
the dispatcher applying it before the policy decides."""

from __future__ import annotations

import pytest

from gateway.core.types import ClusterView, EngineRole, EngineView, RequestInfo
from gateway.policies.dispatcher import Dispatcher
from gateway.policies.lora_affinity import (
    FREE_SLOT,
    MUST_EVICT,
    RESIDENT,
    LoraAffinityConfig,
    adapter_tier,
    narrow_to_adapter,
)
from gateway.policies.registry import create_policy


def eng(
    name: str,
    resident: str = "",
    max_lora: int = 0,
    load: int = 0,
    healthy: bool = True,
    role: EngineRole = EngineRole.BOTH,
) -> EngineView:
    return EngineView(
        id=name,
        role=role,
        healthy=healthy,
        in_flight=load,
        lora_resident=frozenset(n for n in resident.split(",") if n),
        max_lora=max_lora,
    )


def req(lora: str = "sql") -> RequestInfo:
    return RequestInfo(id="r", block_hashes=(), prompt_tokens=10, arrival=0.0, lora=lora)


def kept(view: ClusterView) -> list[str]:
    return [e.id for e in view.healthy()]


@pytest.mark.parametrize(
    ("engine", "tier"),
    [
        (eng("a", "sql", 1), RESIDENT),
        (eng("a", "sql,chat", 2), RESIDENT),
        (eng("a", "", 1), FREE_SLOT),
        (eng("a", "chat", 2), FREE_SLOT),
        (eng("a", "chat,math", 0), FREE_SLOT),  # max_lora unknown
        (eng("a", "chat", 1), MUST_EVICT),
        (eng("a", "chat,math", 2), MUST_EVICT),
    ],
)
def test_adapter_tier(engine: EngineView, tier: int) -> None:
    assert adapter_tier(engine, "sql") == tier


@pytest.mark.parametrize(
    ("engines", "expected"),
    [
        # resident beats free slot beats must evict; order is kept
        ([eng("a", "chat", 1), eng("b", "", 2), eng("c", "sql", 2)], ["c"]),
        ([eng("a", "sql", 2), eng("b", "", 2), eng("c", "sql,x", 2)], ["a", "c"]),
        ([eng("a", "chat", 1), eng("b", "chat", 2), eng("c", "x,y", 2)], ["b"]),
        # unknown max_lora counts as a free slot
        ([eng("a", "chat", 1), eng("b", "chat,x,y")], ["b"]),
        # all in one tier: unchanged
        ([eng("a", "chat", 1), eng("b", "x", 1)], ["a", "b"]),
        ([eng("a"), eng("b")], ["a", "b"]),
        # an unhealthy resident engine does not count; never empty
        ([eng("a", "sql", 1, healthy=False), eng("b", "x", 1)], ["b"]),
        ([eng("a", "sql", 1, healthy=False), eng("b", "x", 2), eng("c", "x,y", 2)], ["b"]),
        # load guard: resident at load 16 vs idle free slot: stays (16 <= 2*0 + 16)
        ([eng("a", "sql", 2, load=16), eng("b", "", 2)], ["a"]),
        # resident at 17 vs idle: widened to both tiers
        ([eng("a", "sql", 2, load=17), eng("b", "", 2)], ["a", "b"]),
        # resident at 32 vs busy free slot at 8: stays (32 <= 2*8 + 16)
        ([eng("a", "sql", 2, load=32), eng("b", "", 2, load=8)], ["a"]),
        ([eng("a", "sql", 2, load=33), eng("b", "", 2, load=8)], ["a", "b"]),
        # the least loaded resident engine counts
        ([eng("a", "sql", 2, load=40), eng("c", "sql", 2, load=1), eng("b", "", 2)], ["a", "c"]),
        # widened twice: resident and free slot both far above an evicting engine
        (
            [eng("a", "sql", 2, load=60), eng("b", "", 2, load=20), eng("c", "x,y", 2)],
            ["a", "b", "c"],
        ),
        # tier by tier: the free slot engine is not far above the resident one, so stop
        (
            [eng("a", "sql", 2, load=50), eng("b", "", 2, load=20), eng("c", "x,y", 2)],
            ["a"],
        ),
        # free slot busy, evict idle: widened from free to evict
        ([eng("b", "", 2, load=17), eng("c", "x,y", 2)], ["b", "c"]),
    ],
)
def test_narrowing_table(engines: list[EngineView], expected: list[str]) -> None:
    view = ClusterView(tuple(engines))
    out = narrow_to_adapter(req(), view)
    assert kept(out) == expected
    assert out.ids == view.ids  # every engine stays, in order


def test_guard_knobs() -> None:
    view = ClusterView((eng("a", "sql", 2, load=5), eng("b", "", 2)))
    assert kept(narrow_to_adapter(req(), view, LoraAffinityConfig(factor=2.0, margin=8))) == ["a"]
    assert kept(narrow_to_adapter(req(), view, LoraAffinityConfig(factor=2.0, margin=4))) == [
        "a",
        "b",
    ]
    tight = LoraAffinityConfig(factor=1.0, margin=0)
    assert kept(narrow_to_adapter(req(), view, tight)) == ["a", "b"]


def test_base_model_request_and_untouched_views_pass_through() -> None:
    view = ClusterView((eng("a", "sql", 1), eng("b", "x", 1)))
    assert narrow_to_adapter(req(lora=""), view) is view
    same = ClusterView((eng("a", "x", 1), eng("b", "y", 1)))
    assert narrow_to_adapter(req(), same) is same


def test_prefill_and_decode_pools_are_tiered_apart() -> None:
    view = ClusterView(
        (
            eng("p1", "sql", 2, role=EngineRole.PREFILL),
            eng("p2", "", 2, role=EngineRole.PREFILL),
            eng("d1", "", 2, role=EngineRole.DECODE),
            eng("d2", "x,y", 2, role=EngineRole.DECODE),
        )
    )
    out = narrow_to_adapter(req(), view)
    assert kept(out) == ["p1", "d1"]
    assert out.disaggregated


@pytest.mark.parametrize(
    ("engines", "lora", "expected"),
    [
        # least loaded alone would pick the idle "a"; affinity keeps the resident "b"
        ([eng("a", "x", 1), eng("b", "sql", 1, load=2)], "sql", "b"),
        ([eng("a", "x", 1), eng("b", "sql", 1, load=2)], "", "a"),
    ],
)
def test_dispatcher_routes_within_the_tier(
    engines: list[EngineView], lora: str, expected: str
) -> None:
    dispatcher = Dispatcher(create_policy("least_loaded"))
    decision = dispatcher.route(req(lora), ClusterView(tuple(engines)), 0.0)
    assert decision.engine == expected

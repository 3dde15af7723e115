"""Decision recording and replay (gateway.policies.recording) in the simulator.

Every registered policy runs a loaded simulation through a RecordingPolicy;
a fresh policy fed the recorded calls (also after a JSON round trip) must
answer every ``decide``/``can_dispatch``/``rebalance`` the same. A policy that
reads state the seam does not hand it must fail the replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gateway.core.types import ClusterView, Decision, RequestInfo
from gateway.policies.base import PolicyContext
from gateway.policies.cost_model import CostModelPolicy
from gateway.policies.pd_rule import PDSettings
from gateway.policies.recording import (
    CALL_BYTES,
    Call,
    PolicySpec,
    RecordingPolicy,
    replay,
)
from gateway.policies.recording_codec import (
    CodecError,
    decode,
    decode_call,
    decode_spec,
    encode,
    encode_call,
    encode_spec,
)
from gateway.policies.registry import policy_names
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.sim.loop import ClusterSpec, Simulation
from gateway.sim.workloads import WorkloadOptions, load_workload
from tests.sim.test_loop import SMALL

# Small KV (evictions), dualmap's router queues with a low dispatch threshold (holds,
# releases and rebalancing happen), and a rate that keeps every engine busy.
OPTIONS: dict[str, dict[str, Any]] = {"dualmap": {"dispatch_pending_tokens": 3000}}
ENGINE = SMALL.with_overrides(kv_capacity_blocks=400)


def recorded_run(name: str, trace: Path, *, max_bytes: int = 64 << 20) -> RecordingPolicy:
    workload = load_workload(f"mooncake:{trace}", WorkloadOptions(rate_scale=4.0))
    ctx = PolicyContext(seed=3, block_size=workload.block_size, perf=ENGINE)
    spec = PolicySpec.of(name, ctx, OPTIONS.get(name))
    policy = RecordingPolicy(spec.build(), spec, max_bytes=max_bytes)
    Simulation(ClusterSpec(4, ENGINE), policy, workload).run()
    return policy


@pytest.mark.parametrize("name", policy_names())
def test_replay_of_a_loaded_simulation_gives_the_same_answers(
    name: str, mooncake_trace: Path
) -> None:
    rec = recorded_run(name, mooncake_trace)
    methods = [c.method for c in rec.calls]
    assert methods.count("decide") >= 120 and not rec.truncated
    assert {"on_routed", "on_first_token", "on_finished"} <= set(methods)
    # under load: some decide saw requests in flight on several engines
    busy = max(
        sum(e.in_flight > 0 for e in c.args[1].engines) for c in rec.calls if c.method == "decide"
    )
    assert busy >= 3
    assert replay(rec.calls, rec.spec.build()) == []
    # the same through JSON (what GET /admin/decisions serves)
    wire = json.loads(json.dumps([encode_call(c) for c in rec.calls]))
    spec = decode_spec(json.loads(json.dumps(encode_spec(rec.spec))))
    assert spec == rec.spec
    assert replay([decode_call(c) for c in wire], spec.build()) == []


def test_dualmap_log_covers_holds_releases_and_rebalancing(mooncake_trace: Path) -> None:
    methods = {c.method for c in recorded_run("dualmap", mooncake_trace).calls}
    assert {"can_dispatch", "rebalance"} <= methods


class _Impure(RoundRobinPolicy):
    """Round robin offset by a value the seam does not carry (say, a global the policy
    reads): the answers then depend on more than the recorded inputs."""

    outside: ClassVar[list[int]] = [0]

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        healthy = view.healthy()
        return Decision(engine=healthy[(self._counter + self.outside[0]) % len(healthy)].id)


def test_replay_catches_a_policy_that_reads_state_outside_the_seam(mooncake_trace: Path) -> None:
    workload = load_workload(f"mooncake:{mooncake_trace}", WorkloadOptions())
    spec = PolicySpec("round_robin")
    rec = RecordingPolicy(_Impure(PolicyContext()), spec)
    Simulation(ClusterSpec(3, ENGINE), rec, workload).run()
    assert replay(rec.calls, _Impure(PolicyContext())) == []  # same outside value: same
    _Impure.outside[0] = 1  # the value outside the seam changed between run and replay
    try:
        mismatches = replay(rec.calls, _Impure(PolicyContext()))
    finally:
        _Impure.outside[0] = 0
    decides = sum(c.method == "decide" for c in rec.calls)
    assert len(mismatches) == decides and {m.method for m in mismatches} == {"decide"}


def test_a_changed_answer_is_reported_with_its_position() -> None:
    view = ClusterView(())
    req = RequestInfo("r", (), 1, 0.0)
    calls = [Call("decide", (req, view, 0.0), Decision("a"))]

    class Fixed(RoundRobinPolicy):
        def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
            return Decision("b")

    [m] = replay(calls, Fixed(PolicyContext()))
    assert (m.index, m.method, m.recorded, m.replayed) == (
        0,
        "decide",
        Decision("a"),
        Decision("b"),
    )


def test_memory_bound_stops_recording_and_the_prefix_still_replays(mooncake_trace: Path) -> None:
    bound = 200 * CALL_BYTES * 4
    rec = recorded_run("cache_aware", mooncake_trace, max_bytes=bound)
    assert rec.truncated and rec.dropped > 0 and rec.bytes <= bound
    assert 0 < len(rec.calls) < 200
    assert replay(rec.calls, rec.spec.build()) == []


def test_wrapper_keeps_the_inner_policys_flags() -> None:
    spec = PolicySpec("dualmap", {}, perf=ENGINE)
    inner = spec.build()
    rec = RecordingPolicy(inner, spec)
    assert (rec.name, rec.may_hold, rec.pd_native, rec.wants_cache_events) == (
        inner.name,
        inner.may_hold,
        inner.pd_native,
        inner.wants_cache_events,
    )
    with pytest.raises(ValueError):
        RecordingPolicy(inner, spec, max_bytes=0)


def test_codec_round_trips_values_and_refuses_other_classes() -> None:
    value = (1, 2**70, -0.5, "x", None, True, [Decision("e", candidates=("e", "f"))])
    assert decode(json.loads(json.dumps(encode(value)))) == value
    with pytest.raises(CodecError):
        encode(object())
    with pytest.raises(CodecError):
        decode({"D": "Popen", "f": {}})
    with pytest.raises(CodecError):
        decode_call({"a": {"T": []}})


def test_the_spec_keeps_the_p_d_rule_thresholds_through_json() -> None:
    """A disaggregated gateway's log replays with the rule thresholds it ran with."""
    pd = PDSettings(min_uncached_tokens=64, max_local_tokens=512, saturation_wait_s=0.25)
    spec = PolicySpec.of("cost_model", PolicyContext(perf=ENGINE, pd=pd), None)
    back = decode_spec(json.loads(json.dumps(encode_spec(spec))))
    assert back == spec and back.pd == pd
    policy = back.build()
    assert isinstance(policy, CostModelPolicy) and policy.rule.settings == pd
    older = {k: v for k, v in encode_spec(spec).items() if k != "pd"}  # a log from before
    assert decode_spec(older).pd == PDSettings()

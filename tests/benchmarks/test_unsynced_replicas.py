"""benchmarks.replicas.unsynced: each simulated replica is shown its own load only."""

from __future__ import annotations

from benchmarks.replicas.unsynced import UnsyncedReplicas
from gateway.core.types import ClusterView, Decision, EngineView, RequestInfo
from gateway.policies.base import PolicyBase


class _Spy(PolicyBase):
    """Sends everything to engine ``a`` and remembers the views it was shown."""

    def __init__(self) -> None:
        self.seen: list[ClusterView] = []

    def decide(self, req: RequestInfo, view: ClusterView, now: float) -> Decision:
        self.seen.append(view)
        return Decision(engine="a", expected_hit_tokens=0)


def _req(i: int) -> RequestInfo:
    return RequestInfo(id=f"r{i}", block_hashes=(), prompt_tokens=100, arrival=float(i))


def _route(policy: UnsyncedReplicas, i: int, view: ClusterView) -> Decision:
    req = _req(i)
    decision = policy.decide(req, view, float(i))
    policy.on_routed(req, decision, float(i))
    return decision


def test_each_replica_sees_only_the_requests_it_routed() -> None:
    """Three requests in flight on ``a`` (as the cluster reports): replica 0 routed two of
    them, so it sees 2 in flight and their 200 pending prefill tokens; replica 1 sees 1."""
    spies = [_Spy(), _Spy()]
    policy = UnsyncedReplicas(spies)
    busy = ClusterView((EngineView(id="a", in_flight=3, pending_prefill_tokens=300),))
    for i in range(3):
        _route(policy, i, busy)
    _route(policy, 3, busy)  # replica 1's second decision
    _route(policy, 4, busy)  # replica 0's third
    last = spies[0].seen[-1].engines[0]
    assert (last.in_flight, last.pending_prefill_tokens) == (2, 200)
    assert spies[1].seen[-1].engines[0].in_flight == 1
    policy.on_first_token(_req(0), "a", 5.0)
    policy.on_finished(_req(0), "a", 6.0, True)
    _route(policy, 5, busy)
    assert spies[1].seen[-1].engines[0].in_flight == 2


def test_requests_are_dealt_in_turn_when_some_have_finished() -> None:
    policy = UnsyncedReplicas([_Spy(), _Spy()])
    view = ClusterView((EngineView(id="a"),))
    _route(policy, 0, view)
    policy.on_finished(_req(0), "a", 0.5, True)
    owners = [policy.owner(_req(i)) for i in (1, 2, 3)]
    assert owners == [1, 0, 1]
